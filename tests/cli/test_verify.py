"""zephon verify: effective sequence logs compared step by step; exit codes 0 / 1 / 2.

Synthetic logs are written with the real SequenceTracker. The real runs (a 2-rank
reference, a copy resumed on 1 rank, a run with another seed) are shared with
test_compare.py and test_inspect_run.py through ``real_runs``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.tracker import SequenceTracker, log_path, read_log

TOPO_2 = {"world_size": 2, "dp_degree": 2, "nnodes": 2, "tp_degree": 1, "local_batch_size": 2}
TOPO_1 = {"world_size": 1, "dp_degree": 1, "nnodes": 1, "tp_degree": 1, "local_batch_size": 2}


def step_ids(step: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, step]).integers(0, 10_000, size=8)


def data_config(seq_len: int = 8, seed: int = 0) -> DataConfig:
    return DataConfig.make(
        seq_len=seq_len, seed=seed, schedule=BatchSchedule.parse("8"), sample_offset=0,
        num_samples=10_000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip


def write_log(
    run: Path,
    steps: int,
    *,
    seed: int = 0,
    resume_at: int | None = None,
    died_at: int | None = None,
    tokens: bool = True,
    first_step: int = 1,
    differ_at: tuple[int, ...] = (),
    tokens_differ_at: tuple[int, ...] = (),
    died_saw_other_data: bool = False,
    config: DataConfig | None = None,
    topology: dict | None = None,
) -> Path:
    """A run folder whose log covers ``first_step..steps``; with ``resume_at``, the first
    job ran to ``died_at`` and a 1-rank job resumed from ``resume_at``. Steps in
    ``differ_at`` see other ids, steps in ``tokens_differ_at`` other tokens; with
    ``died_saw_other_data`` the first job saw other ids after ``resume_at``; ``topology``
    fields override the jobs' (2 ranks, then 1)."""
    tracker = SequenceTracker(log_path(run), config=config or data_config(), writer=True)
    topo_2, topo_1 = {**TOPO_2, **(topology or {})}, {**TOPO_1, **(topology or {})}

    def record(s: int, other: bool = False) -> None:
        ids = step_ids(s, seed + (s in differ_at or other))
        toks = ids.tobytes() + (b"x" if s in tokens_differ_at else b"")
        tracker.record(s, (s - 1) * 8, ids, toks if tokens else None)

    if first_step == 1:
        tracker.start(topo_2)
    else:  # a run whose log begins at a checkpoint copied from elsewhere
        tracker.resume({"step": first_step - 1, "chain": "0" * 64}, topo_2, ignore_mismatch=True)
    heads = {}
    last = died_at if resume_at is not None else steps
    for s in range(first_step, last + 1):
        record(s, died_saw_other_data and resume_at is not None and s > resume_at)
        heads[s] = tracker.head()
    if resume_at is not None:
        tracker.resume(heads[resume_at], topo_1)
        for s in range(resume_at + 1, steps + 1):
            record(s)
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
    b = write_log(tmp_path / "b", 6, differ_at=(4,))
    rc, out, _ = verify(capsys, a, b)
    assert rc == 1
    assert "first mismatch at step 4 (ids_digest, tokens_digest differ)" in out
    assert "matches:   5/6" in out
    rc, report = verify_json(capsys, a, b)
    assert rc == 1 and report["verdict"] == "mismatch" and report["matches"] == 5
    mm = report["first_mismatch"]
    assert mm["step"] == 4 and mm["b"]["ids_digest"] != mm["a"]["ids_digest"]
    assert (
        mm["a"]["ids_digest"] == json.loads(log_path(a).read_text().splitlines()[4])["ids_digest"]
    )


def test_tokens_digest_compared_only_when_both_have_it(tmp_path, capsys):
    a = write_log(tmp_path / "a", 4, tokens=True)
    b = write_log(tmp_path / "b", 4, tokens=False)
    rc, report = verify_json(capsys, a, b)
    assert rc == 0 and report["tokens_compared"] == 0
    c = write_log(tmp_path / "c", 4, tokens=True, tokens_differ_at=(2,))
    rc, report = verify_json(capsys, a, c)
    assert rc == 1 and report["first_mismatch"]["step"] == 2
    assert report["first_mismatch"]["fields"] == ["tokens_digest"]


def test_resume_in_the_middle_uses_the_effective_history(tmp_path, capsys):
    ref = write_log(tmp_path / "ref", 8)
    # the first job saw other data for steps 5..6 after its checkpoint at 4, then died;
    # the resumed job rewrote 5..8 with the right data: superseded records do not count
    res = write_log(tmp_path / "res", 8, resume_at=4, died_at=6, died_saw_other_data=True)
    superseded = [json.loads(x) for x in log_path(res).read_text().splitlines()[5:7]]
    assert [r["step"] for r in superseded] == [5, 6]
    assert superseded[0]["ids_digest"] != read_log(ref).records[5]["ids_digest"]
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


@pytest.fixture(scope="session")
def real_runs(e2e_root: Path, reference: Path, resumed_on_one_rank: Path) -> RealRuns:
    """The shared reference and its resume on one rank (tests/conftest.py), and a run with
    another seed."""
    from tests.titan.launch import train

    other = e2e_root / "zephon_real_runs" / "other_seed"
    train(other, 1, "--zephon.seed", "1", "--training.steps", "2").check()
    return RealRuns(reference, resumed_on_one_rank, other)


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


# ---------------------------------------------------------------- the log proves itself


def _edit(run: Path, fn) -> None:
    """Rewrite the log's lines through ``fn(list of lines) -> list of lines``."""
    lines = log_path(run).read_text().splitlines()
    log_path(run).write_text("\n".join(fn(lines)) + "\n")


def _set(line: str, **fields) -> str:
    return json.dumps({**json.loads(line), **fields}, sort_keys=True)


@pytest.mark.parametrize(
    "tamper, step",
    [
        ("delete", 4),  # a record removed: a gap
        ("chain", 3),  # a chain value replaced
        ("digest", 5),  # a digest edited, chain left as it was
        ("swap", 3),  # two records exchanged
        ("duplicate", 3),  # a record written twice
    ],
)
def test_a_tampered_log_never_verifies(tmp_path, capsys, tamper, step):
    good, bad = write_log(tmp_path / "good", 6), write_log(tmp_path / "bad", 6)
    edits = {  # line i holds step i (line 0 is the start event)
        "delete": lambda ls: ls[:4] + ls[5:],
        "chain": lambda ls: ls[:3] + [_set(ls[3], chain="f" * 64)] + ls[4:],
        "digest": lambda ls: ls[:5] + [_set(ls[5], ids_digest="0" * 64)] + ls[6:],
        "swap": lambda ls: ls[:3] + [ls[4], ls[3]] + ls[5:],
        "duplicate": lambda ls: ls[:4] + [ls[3]] + ls[4:],
    }
    _edit(bad, edits[tamper])
    rc, out, _ = verify(capsys, bad)
    assert rc == 1 and f"verdict: BROKEN at step {step}" in out, out
    rc, out, _ = verify(capsys, good)
    assert rc == 0 and "verdict: INTACT: 6 effective records" in out
    rc, report = verify_json(capsys, good, bad)
    assert rc == 1 and report["verdict"] == "corrupt"
    assert report["integrity_a"]["intact"] and not report["integrity_b"]["intact"]
    assert report["integrity_b"]["first_problem"]["step"] == step
    rc, out, _ = verify(capsys, good, bad)
    assert "BROKEN LOG" in out and "MATCH" not in out


def test_resume_event_must_link_to_the_record_it_names(tmp_path, capsys):
    run = write_log(tmp_path / "r", 8, resume_at=4, died_at=6)
    assert verify(capsys, run)[0] == 0
    # lines: start, steps 1..6 of the first job, the resume event (line 7), steps 5..8
    assert json.loads(log_path(run).read_text().splitlines()[7])["event"] == "resume"
    _edit(run, lambda ls: ls[:7] + [_set(ls[7], chain="e" * 64)] + ls[8:])
    rc, out, _ = verify(capsys, run)
    assert rc == 1 and "verdict: BROKEN at step 4" in out
    assert "resume from step 4 names chain eeeeeeeeeeeeeeee..., the log's record of step 4" in out


def test_same_ids_under_another_data_config_never_match(tmp_path, capsys):
    """Two runs whose sample ids coincide but whose seq_len differs read other tokens."""
    a = write_log(tmp_path / "a", 4, tokens=False)
    b = write_log(tmp_path / "b", 4, tokens=False, config=data_config(seq_len=16))
    rc, out, _ = verify(capsys, a, b)
    assert rc == 1 and "first mismatch at step 1 (ids_digest differ)" in out
    assert "seq_len: 8 -> 16" in out


def test_a_schedule_extended_for_later_steps_still_matches(tmp_path, capsys):
    extended = DataConfig.make(
        seq_len=8, seed=0, schedule=BatchSchedule.parse("1:8,100:16"), sample_offset=0,
        num_samples=10_000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip
    a = write_log(tmp_path / "a", 6)
    b = write_log(tmp_path / "b", 6, config=extended)
    rc, report = verify_json(capsys, a, b)
    assert rc == 0 and report["verdict"] == "match" and report["matches"] == 6


def test_logs_of_tracker_format_1_are_unbound_never_a_plain_match(tmp_path, capsys):
    """A log written before records bound the data config: same digests, no proof."""
    from torchtitan_zephon.tracker import chain_next

    def old_log(run: Path) -> Path:
        lines = [json.dumps({"event": "start", "from_step": 0, **TOPO_2})]
        chain = "0" * 64
        for s in range(1, 5):
            rec = {"step": s, "first_position": (s - 1) * 8, "num_samples": 8,
                   "ids_digest": f"{s:064d}"}  # fmt: skip
            chain = rec["chain"] = chain_next(chain, rec)
            lines.append(json.dumps(rec, sort_keys=True))
        log_path(run).parent.mkdir(parents=True)
        log_path(run).write_text("\n".join(lines) + "\n")
        return run

    a, b = old_log(tmp_path / "a"), old_log(tmp_path / "b")
    rc, out, _ = verify(capsys, a, b)
    assert rc == 1 and "verdict: UNBOUND" in out and "MATCH" not in out.replace("UNBOUND", "")
    rc, out, _ = verify(capsys, a)
    assert rc == 0 and "unbound: steps 1..4" in out and "INTACT" in out


def test_ignored_log_mismatch_is_noted_not_hidden(tmp_path, capsys):
    run = write_log(tmp_path / "r", 6, first_step=3)
    rc, out, _ = verify(capsys, run)
    assert rc == 0 and "restarted the chain (ignore_log_mismatch)" in out
    last = json.loads(log_path(run).read_text().splitlines()[0])
    assert last["event"] == "resume" and "log_mismatch_ignored" in last


@pytest.mark.parametrize("chain", [123, ["a"], {"x": 1}, True])
def test_an_event_chain_that_is_not_text_is_a_broken_log_not_a_traceback(tmp_path, capsys, chain):
    run = write_log(tmp_path / "r", 8, resume_at=4, died_at=6)
    _edit(run, lambda ls: ls[:7] + [_set(ls[7], chain=chain)] + ls[8:])  # the resume event
    rc, out, _ = verify(capsys, run)
    assert rc == 1 and "BROKEN" in out and f"whose chain is {chain!r}, not a hex string" in out
    _edit(run, lambda ls: [_set(ls[0], chain=chain)] + ls[1:])  # the start event too
    rc, out, _ = verify(capsys, run, write_log(tmp_path / "good", 8))
    assert rc == 1 and "BROKEN LOG" in out and "MATCH" not in out


# ---------------------------------------------------------------- the log against its checkpoints


def _copy(run: Path, dst: Path, *, until: int | None = None) -> Path:
    """A copy of a real run to edit (``until``: later checkpoints removed)."""
    import shutil

    from tests.titan.launch import copy_run_until

    return copy_run_until(run, dst, until) if until is not None else shutil.copytree(run, dst)


def _cut_last_line(run: Path, how: str) -> None:
    text = log_path(run).read_text()
    last = text.splitlines()[-1]
    log_path(run).write_text(
        text[: -len(last) // 2 - 1] if how == "half" else text[: -len(last) - 1]
    )


@pytest.mark.parametrize("how", ["half", "delete"])
def test_a_log_that_lost_the_record_its_latest_checkpoint_vouches_for_is_broken(
    real_runs, tmp_path, capsys, how
):
    run = _copy(real_runs.ref, tmp_path / "cut")
    _cut_last_line(run, how)  # step 8, where the latest checkpoint is
    ckpt = run / "checkpoint" / "step-8"
    rc, out, _ = verify(capsys, run)
    assert rc == 1, out
    assert f"verdict: BROKEN at step 8: checkpoint {ckpt} saved the chain head of step 8" in out
    assert "it has no record of step 8" in out and "INTACT" not in out
    assert "the log holds the chain heads of step-4" in out
    # the trainer's own resume check says the same of this folder
    head = runs.read_data_state(ckpt).tracker
    tracker = SequenceTracker(log_path(run), config=data_config(), writer=True)
    assert tracker.cannot_continue(head, repair_index=False) == "it has no record of step 8"
    rc, out, _ = verify(capsys, run, "--json")
    report = json.loads(out)
    assert rc == 1 and not report["intact"] and report["problems"] == 1
    assert report["first_problem"]["kind"] == "checkpoint"
    assert report["first_problem"]["step"] == 8 and str(ckpt) in report["first_problem"]["message"]
    assert [(c["step"], c["result"]) for c in report["checkpoints"]] == [
        (4, "held"),
        (8, "missing"),
    ]
    # against the reference: no longer MATCH over the 7 common steps
    rc, out, _ = verify(capsys, real_runs.ref, run)
    assert rc == 1 and "BROKEN LOG: the sequence log of B does not verify" in out
    assert "MATCH" not in out and "A has 1 step beyond B, B has 0 beyond A" in out
    rc, report = verify_json(capsys, real_runs.ref, run)
    assert report["verdict"] == "corrupt" and report["matches"] == 7
    assert report["integrity_a"]["intact"] and not report["integrity_b"]["intact"]
    assert report["only_in_a"] == [[8, 8]] and report["steps_only_in_a"] == 1
    assert report["only_in_b"] == [] and report["steps_only_in_b"] == 0


@pytest.mark.parametrize("latest", ["removed", "incomplete"])
def test_a_torn_line_beyond_the_latest_complete_checkpoint_stays_a_note(
    real_runs, tmp_path, capsys, latest
):
    """A job that died writing step 8's record, before checkpoint 8 (or while DCP wrote
    it): the log holds every step a complete checkpoint vouches for."""
    run = _copy(real_runs.ref, tmp_path / "torn", until=4 if latest == "removed" else None)
    if latest == "incomplete":
        (run / "checkpoint" / "step-8" / ".metadata").unlink()
    _cut_last_line(run, "half")
    rc, out, _ = verify(capsys, run)
    assert rc == 0, out
    assert "last line truncated (a job died mid-write); ignored" in out
    assert "the log holds the chain heads of step-4" in out
    assert "verdict: INTACT: 7 effective records" in out
    if latest == "incomplete":
        assert f"note: checkpoint {run / 'checkpoint' / 'step-8'} is incomplete" in out


def test_a_foreign_log_in_a_run_folder_is_broken_naming_the_checkpoint(real_runs, tmp_path, capsys):
    """An intact log of another run with as many steps: the checkpoints' heads differ."""
    run = _copy(real_runs.ref, tmp_path / "foreign")
    foreign = write_log(tmp_path / "other", 8)
    log_path(run).write_bytes(log_path(foreign).read_bytes())
    for sidecar in log_path(run).parent.glob("*.jsonl.*"):
        sidecar.unlink()
    rc, out, _ = verify(capsys, run)
    assert rc == 1
    assert f"verdict: BROKEN at step 4: checkpoint {run / 'checkpoint' / 'step-4'}" in out
    assert "its record of step 4 has chain" in out and "belongs to another run" in out
    rc, out, _ = verify(capsys, run, "--json")
    report = json.loads(out)
    assert report["problems"] == 2
    assert [c["result"] for c in report["checkpoints"]] == ["differs", "differs"]


def test_checkpoints_of_a_superseded_history_are_a_note(real_runs, tmp_path, capsys):
    """A start over in the folder with checkpointing off: the old checkpoints stay, the
    log's new start event supersedes the steps they vouch for. The log is intact."""
    run = _copy(real_runs.ref, tmp_path / "over")
    tracker = SequenceTracker(log_path(run), config=data_config(), writer=True)
    tracker.start(TOPO_1)
    for s in (1, 2):
        tracker.record(s, (s - 1) * 8, step_ids(s))
    rc, out, _ = verify(capsys, run)
    assert rc == 0, out
    assert "verdict: INTACT: 2 effective records" in out
    for step in (4, 8):
        assert (
            f"checkpoint {run / 'checkpoint' / f'step-{step}'} saved step {step} of a superseded history"
            in out
        )


def test_two_logs_say_how_many_steps_each_has_beyond_the_other(tmp_path, capsys):
    a = write_log(tmp_path / "a", 8)
    b = write_log(tmp_path / "b", 10, first_step=3)  # from a checkpoint copied at step 2
    rc, out, _ = verify(capsys, a, b)
    assert rc == 0, out
    assert "A has 2 steps beyond B, B has 2 beyond A" in out.splitlines()[-1]
    assert "only in A (missing from the other): steps 1..2" in out
    assert "only in B (missing from the other): steps 9..10" in out
    rc, report = verify_json(capsys, a, b)
    assert report["verdict"] == "match" and report["steps_compared"] == 6
    assert report["only_in_a"] == [[1, 2]] and report["only_in_b"] == [[9, 10]]
    assert report["steps_only_in_a"] == 2 and report["steps_only_in_b"] == 2
    rc, out, _ = verify(capsys, write_log(tmp_path / "c", 9), a)
    assert rc == 0 and out.splitlines()[-1].endswith("A has 1 step beyond B, B has 0 beyond A")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda ls: ls[:5] + [ls[6], ls[5]] + ls[7:], "out of order (step 5 after step 6)"),
        (lambda ls: ls[:5] + ls[6:] + [ls[5]], "out of order (step 5 after step 10)"),
    ],
    ids=["swapped", "moved to the end"],
)
def test_reordered_lines_are_out_of_order_not_missing(tmp_path, capsys, edit, expected):
    run = write_log(tmp_path / "r", 10)
    _edit(run, edit)  # line i holds step i
    rc, out, _ = verify(capsys, run)
    assert rc == 1 and f"verdict: BROKEN at step 5: line 6: {expected}" in out, out
    assert "missing" not in out.splitlines()[-1]
    rc, report = verify_json(capsys, write_log(tmp_path / "good", 10), run)
    assert report["verdict"] == "corrupt"
    assert expected in report["integrity_b"]["first_problem"]["message"]


def test_a_deleted_record_is_still_missing(tmp_path, capsys):
    run = write_log(tmp_path / "r", 10)
    _edit(run, lambda ls: ls[:5] + ls[6:])
    rc, out, _ = verify(capsys, run)
    assert rc == 1
    assert (
        "verdict: BROKEN at step 5: line 6: step 5 is missing before the record of step 6 (deleted?)"
        in out
    )


# ---------------------------------------------------------------- skip ranges (issue 22)


def skip_log(run: Path, skips: str, steps: int = 8, *, resume: tuple[int, str] | None = None):
    """A run whose ids are its plan's (``job.plans.plan_of``) under ``skips``; with
    ``resume`` (k, skips after), a job without them trained to step ``steps``, then one
    resumed from checkpoint k (1 rank) with the skips of the second job."""
    from torchtitan_zephon.job.plans import plan_of
    from torchtitan_zephon.order.data_config import data_extra

    def config(text: str) -> DataConfig:
        return DataConfig.make(
            seq_len=8, seed=0, schedule=BatchSchedule.parse("8"), sample_offset=0,
            num_samples=10_000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
            extra=data_extra(skip_steps=text),
        )  # fmt: skip

    first = config(skips if resume is None else "")
    tracker = SequenceTracker(log_path(run), config=first, writer=True)
    tracker.start(TOPO_2)
    heads = {}
    for s in range(1, steps + 1):
        tracker.record(s, (s - 1) * 8, plan_of(first).global_ids(s))
        heads[s] = tracker.head()
    if resume is not None:
        k, later = resume
        tracker.config = config(later)
        tracker.resume(heads[k], TOPO_1)
        for s in range(k + 1, steps + 1):
            tracker.record(s, (s - 1) * 8, plan_of(tracker.config).global_ids(s))
    return run


def test_a_run_with_a_skip_and_one_without_differ_from_its_step_in_words(tmp_path, capsys):
    plain, skipped = skip_log(tmp_path / "a", ""), skip_log(tmp_path / "b", "5:3")
    rc, out, _ = verify(capsys, plain, skipped)
    assert rc == 1 and "matches:   4/8" in out
    assert (
        "   skips: at step 5, A does not skip there and B skips the data of 3 steps there "
        "(skip_steps 5:3): the runs are meant to differ from step 5 on"
    ) in out
    assert (
        "verdict: MISMATCH: the runs saw different data from step 5 (where their skip_steps "
        "differ: at step 5, A does not skip there and B skips the data of 3 steps there "
        "(skip_steps 5:3))"
    ) in out
    rc, report = verify_json(capsys, plain, skipped)
    assert report["first_mismatch"]["skip_difference"]["step"] == 5
    rc, out, _ = verify(capsys, skip_log(tmp_path / "c", "5:2"), skipped)
    assert "at step 5, A skips the data of 2 steps there (skip_steps 5:2) and B skips" in out


def test_a_rollback_with_a_skip_matches_a_run_with_the_skip_from_the_start(tmp_path, capsys):
    fresh = skip_log(tmp_path / "fresh", "5:3")
    rolled = skip_log(tmp_path / "rolled", "", resume=(4, "5:3"))
    rc, out, _ = verify(capsys, fresh, rolled)
    assert rc == 0 and "matches:   8/8" in out and "verdict: MATCH" in out
    # a skip appended for a later step changes no earlier step's record
    rc, report = verify_json(capsys, skip_log(tmp_path / "later", "5:3,8:1"), fresh)
    assert report["first_mismatch"]["step"] == 8 and report["matches"] == 7
    assert report["first_mismatch"]["skip_difference"]["step"] == 8
    # the same ids but no skip difference: no skip sentence
    rc, out, _ = verify(capsys, skip_log(tmp_path / "x", ""), skip_log(tmp_path / "y", ""))
    assert rc == 0 and "skips:" not in out


def test_an_edited_skip_event_breaks_the_log_at_the_step_it_precedes(tmp_path, capsys):
    run = skip_log(tmp_path / "run", "3:2")
    path = log_path(run)
    lines = path.read_text().splitlines()
    event = json.loads(lines[3])
    assert (event["event"], event["from_step"], event["step"]) == ("skip", 2, 3)
    rc, out, _ = verify(capsys, run)
    assert rc == 0 and "verdict: INTACT" in out
    event["from_step"] = 1
    lines[3] = json.dumps(event, sort_keys=True)
    path.write_text("\n".join(lines) + "\n")
    rc, out, _ = verify(capsys, run)
    assert rc == 1
    assert (
        "verdict: BROKEN at step 3: line 4: a skip event for step 3 (from_step 1) that does "
        "not follow the log's step 2 before it (the event was edited or moved)"
    ) in out


def exclude_log(run: Path, lines: str, steps: int = 8, *, resume: tuple[int, str] | None = None):
    """``skip_log`` for left-out samples: ``lines`` is a zephon.exclude file's text."""
    from torchtitan_zephon.job.plans import plan_of
    from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD, Exclusions

    def config(text: str) -> tuple[DataConfig, Exclusions]:
        exclusions = Exclusions.parse(text)
        extra = {EXCLUDE_FIELD: exclusions.to_json()} if exclusions else {}
        return DataConfig.make(
            seq_len=8, seed=0, schedule=BatchSchedule.parse("8"), sample_offset=0,
            num_samples=10_000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
            extra=extra,
        ), exclusions  # fmt: skip

    first, ex = config(lines if resume is None else "")
    tracker = SequenceTracker(log_path(run), config=first, writer=True)
    tracker.start(TOPO_2)
    heads = {}
    for s in range(1, steps + 1):
        tracker.record(s, (s - 1) * 8, plan_of(first, exclusions=ex).global_ids(s))
        heads[s] = tracker.head()
    if resume is not None:
        k, later = resume
        tracker.config, ex = config(later)
        tracker.resume(heads[k], TOPO_1)
        for s in range(k + 1, steps + 1):
            tracker.record(s, (s - 1) * 8, plan_of(tracker.config, exclusions=ex).global_ids(s))
    return run


def test_runs_that_leave_out_other_samples_differ_from_that_step_in_words(tmp_path, capsys):
    from torchtitan_zephon.order.stream import DataPlan

    ids = DataPlan(10_000, 0, BatchSchedule.parse("8")).global_ids(6)[:2].tolist()
    entry = json.dumps({"ids": ids, "from_step": 5})
    plain, left = exclude_log(tmp_path / "a", ""), exclude_log(tmp_path / "b", entry)
    rc, out, _ = verify(capsys, plain, left)
    assert rc == 1 and "matches:   4/8" in out
    assert (
        "   left out: at step 5, A leaves out no new sample there and B leaves out 2 ids (sha256 "
    ) in out
    assert "(exclude): the runs are meant to differ from step 5 on" in out
    assert "verdict: MISMATCH: the runs saw different data from step 5 (where their left-out " in (
        out
    )
    rc, report = verify_json(capsys, plain, left)
    assert report["first_mismatch"]["exclusion_difference"]["step"] == 5
    # rolled back to step 4 and resumed on 1 rank with the list: MATCH with a run that
    # had it from the start
    rolled = exclude_log(tmp_path / "rolled", "", resume=(4, entry))
    rc, out, _ = verify(capsys, left, rolled)
    assert rc == 0 and "matches:   8/8" in out and "verdict: MATCH" in out
    rc, out, _ = verify(capsys, plain, exclude_log(tmp_path / "p2", ""))
    assert rc == 0 and "left out:" not in out
