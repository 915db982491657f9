"""zephon verify: effective sequence logs compared step by step; exit codes 0 / 1 / 2.

Synthetic logs are written with the real SequenceTracker. The real runs (a 2-rank
reference, a copy resumed on 1 rank, a run with another seed) are shared with
test_compare.py and test_inspect_run.py through ``real_runs``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.tracker import SequenceTracker, log_path

TOPO_2 = {"world_size": 2, "dp_degree": 2, "nnodes": 2, "tp_degree": 1, "local_batch_size": 2}
TOPO_1 = {"world_size": 1, "dp_degree": 1, "nnodes": 1, "tp_degree": 1, "local_batch_size": 2}


def step_ids(step: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, step]).integers(0, 10_000, size=8)


def write_log(
    run: Path,
    steps: int,
    *,
    seed: int = 0,
    resume_at: int | None = None,
    died_at: int | None = None,
    tokens: bool = True,
    first_step: int = 1,
) -> Path:
    """A run folder whose log covers ``first_step..steps``; with ``resume_at``, the first
    job ran to ``died_at`` and a 1-rank job resumed from ``resume_at``."""
    tracker = SequenceTracker(
        log_path(run), store_fingerprint="store", data_config_fingerprint="cfg", writer=True
    )
    tracker.start(TOPO_2)
    tracker.step = first_step - 1
    heads = {}
    last = died_at if resume_at is not None else steps
    for s in range(first_step, last + 1):
        ids = step_ids(s, seed)
        tracker.record(s, (s - 1) * 8, ids, ids.tobytes() if tokens else None)
        heads[s] = tracker.head()
    if resume_at is not None:
        tracker.resume(heads[resume_at], TOPO_1)
        for s in range(resume_at + 1, steps + 1):
            ids = step_ids(s, seed)
            tracker.record(s, (s - 1) * 8, ids, ids.tobytes() if tokens else None)
    return run


def verify(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["verify", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def verify_json(capsys, a, b) -> tuple[int, dict]:
    rc, out, _ = verify(capsys, a, b, "--json")
    return rc, json.loads(out)


def test_identical_logs_match(tmp_path, capsys):
    a, b = write_log(tmp_path / "a", 6), write_log(tmp_path / "b", 6)
    rc, out, _ = verify(capsys, a, b)
    assert rc == 0
    assert "matches:   6/6" in out and "MATCH" in out and "ids + tokens" in out
    rc, report = verify_json(capsys, a, b)
    assert rc == 0 and report["verdict"] == "match"
    assert report["steps_compared"] == 6 and report["matches"] == 6
    assert report["first_mismatch"] is None
    assert report["resumes_a"] == [] and report["resumes_b"] == []


def test_a_log_file_path_is_accepted(tmp_path, capsys):
    a, b = write_log(tmp_path / "a", 3), write_log(tmp_path / "b", 3)
    assert verify(capsys, log_path(a), b)[0] == 0


def test_one_step_differs(tmp_path, capsys):
    a = write_log(tmp_path / "a", 6)
    b = write_log(tmp_path / "b", 6)
    lines = log_path(b).read_text().splitlines()
    rec = json.loads(lines[4])  # line 0 is the start event: this is step 4
    assert rec["step"] == 4
    rec["ids_digest"] = "0" * 64
    lines[4] = json.dumps(rec, sort_keys=True)
    log_path(b).write_text("\n".join(lines) + "\n")
    rc, out, _ = verify(capsys, a, b)
    assert rc == 1
    assert "first mismatch at step 4 (ids_digest differ)" in out and "matches:   5/6" in out
    rc, report = verify_json(capsys, a, b)
    assert rc == 1 and report["verdict"] == "mismatch" and report["matches"] == 5
    mm = report["first_mismatch"]
    assert mm["step"] == 4 and mm["b"]["ids_digest"] == "0" * 64
    assert (
        mm["a"]["ids_digest"] == json.loads(log_path(a).read_text().splitlines()[4])["ids_digest"]
    )


def test_tokens_digest_compared_only_when_both_have_it(tmp_path, capsys):
    a = write_log(tmp_path / "a", 4, tokens=True)
    b = write_log(tmp_path / "b", 4, tokens=False)
    rc, report = verify_json(capsys, a, b)
    assert rc == 0 and report["tokens_compared"] == 0
    c = write_log(tmp_path / "c", 4, tokens=True)
    text = (
        log_path(c)
        .read_text()
        .replace(json.loads(log_path(c).read_text().splitlines()[2])["tokens_digest"], "f" * 64)
    )
    log_path(c).write_text(text)
    rc, report = verify_json(capsys, a, c)
    assert rc == 1 and report["first_mismatch"]["step"] == 2
    assert report["first_mismatch"]["fields"] == ["tokens_digest"]


def test_resume_in_the_middle_uses_the_effective_history(tmp_path, capsys):
    ref = write_log(tmp_path / "ref", 8)
    # the first job saw other data for steps 5..6 after its checkpoint at 4, then died;
    # the resumed job rewrote 5..8 with the right data: superseded records do not count
    res = write_log(tmp_path / "res", 8, resume_at=4, died_at=6)
    lines = log_path(res).read_text().splitlines()
    for i in (5, 6):  # records of steps 5 and 6 of the first job
        rec = json.loads(lines[i])
        assert rec["step"] == i
        rec["ids_digest"] = "1" * 64
        lines[i] = json.dumps(rec, sort_keys=True)
    log_path(res).write_text("\n".join(lines) + "\n")
    rc, out, _ = verify(capsys, ref, res)
    assert rc == 0, out
    assert "resumed from step 4: world_size 1, dp_degree 1, nnodes 1" in out
    assert "started at step 0: world_size 2, dp_degree 2, nnodes 2" in out
    rc, report = verify_json(capsys, ref, res)
    assert report["steps_compared"] == 8 and report["matches"] == 8
    assert report["resumes_b"] == [{"event": "resume", "from_step": 4, **TOPO_1}]


def test_truncated_last_line_is_ignored_and_noted(tmp_path, capsys):
    a = write_log(tmp_path / "a", 6)
    b = write_log(tmp_path / "b", 6)
    text = log_path(b).read_text()
    log_path(b).write_text(text[: -len(text.splitlines()[-1]) // 2 - 1])  # cut step 6 mid-line
    rc, out, _ = verify(capsys, a, b)
    assert rc == 0 and "truncated" in out and "5 common steps" in out
    rc, report = verify_json(capsys, a, b)
    assert report["truncated_tail_b"] and not report["truncated_tail_a"]
    assert report["steps_compared"] == 5


def test_no_overlapping_steps(tmp_path, capsys):
    a = write_log(tmp_path / "a", 3)
    b = write_log(tmp_path / "b", 6, first_step=4)
    rc, out, _ = verify(capsys, a, b)
    assert rc == 1 and "NO OVERLAP" in out
    rc, report = verify_json(capsys, a, b)
    assert report["verdict"] == "no-overlap" and report["steps_compared"] == 0


@pytest.mark.parametrize("problem", ["missing_run", "no_log", "corrupt", "bad_record"])
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, problem):
    a = write_log(tmp_path / "a", 3)
    b = tmp_path / "b"
    if problem == "no_log":
        b.mkdir()
    elif problem == "corrupt":
        write_log(b, 3)
        lines = log_path(b).read_text().splitlines()
        lines[1] = lines[1][:20]  # cut short in the middle of the log: corrupt
        log_path(b).write_text("\n".join(lines) + "\n")
    elif problem == "bad_record":
        log_path(b).parent.mkdir(parents=True)
        log_path(b).write_text('{"step": "x", "chain": "c"}\n')
    rc, out, err = verify(capsys, a, b)
    assert rc == 2 and out == ""
    assert err.startswith("zephon verify: error: ") and str(b) in err
    expected = {
        "missing_run": "does not exist",
        "no_log": "no sequence log",
        "corrupt": "not valid JSON",
        "bad_record": "corrupt",
    }[problem]
    assert expected in err


def test_command_line_prints_no_traceback(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_zephon",
            "verify",
            str(tmp_path / "nope"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "does not exist" in out.stderr


# ---------------------------------------------------------------- real runs


@dataclass(frozen=True)
class RealRuns:
    ref: Path
    """2 ranks, 8 steps, checkpoints at 4 and 8."""
    resumed: Path
    """A copy of ref that died after checkpoint 4, resumed on 1 rank."""
    other_seed: Path
    """1 rank, 2 steps, --zephon.seed 1."""


@functools.cache
def build_real_runs(base: Path) -> RealRuns:
    from tests.titan.launch import copy_run_until, train

    root = base / "zephon_real_runs"
    ref, resumed, other = root / "ref", root / "resumed", root / "other_seed"
    train(ref, 2).check()
    copy_run_until(ref, resumed, 4)
    train(resumed, 1).check()
    train(other, 1, "--zephon.seed", "1", "--training.steps", "2").check()
    return RealRuns(ref, resumed, other)


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory) -> RealRuns:
    return build_real_runs(tmp_path_factory.getbasetemp())


def test_real_resume_on_fewer_ranks_verifies(real_runs, capsys):
    rc, report = verify_json(capsys, real_runs.ref, real_runs.resumed)
    assert rc == 0, report
    assert report["steps_compared"] == 8 and report["matches"] == 8
    assert report["tokens_compared"] == 8
    assert [(r["from_step"], r["world_size"], r["dp_degree"]) for r in report["resumes_b"]] == [
        (4, 1, 1)
    ]
    assert report["starts_a"][0]["world_size"] == 2


def test_real_run_with_another_seed_differs_at_step_1(real_runs, capsys):
    rc, out, _ = verify(capsys, real_runs.ref, real_runs.other_seed)
    assert rc == 1 and "first mismatch at step 1" in out and "MISMATCH" in out
