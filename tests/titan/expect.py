"""Assertions on finished runs: same data (sequence logs), close losses."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.tracker import read_log

# Loss tolerance when the topology changes. Same data, same math, but fp32 sums
# of per-sample losses and gradients are reduced in another order (other DP
# degree, TP sharding, micro-batch split): a few ulps per step (~1e-7 relative
# measured over 8 steps of the tiny model), amplified mildly by the optimizer.
# 1e-5 is two orders above what we observe and far below any data difference
# (a different batch moves the loss by > 1e-2).
TOPOLOGY_RTOL = 1e-5


def log_records(run: Path) -> dict[int, dict]:
    return read_log(run / "zephon" / "sequence_log.jsonl").records


def assert_same_data(reference: Path, run: Path, steps: range) -> None:
    """Every step's ordered ids and token content digests (and the chain) agree."""
    a, b = log_records(reference), log_records(run)
    for s in steps:
        assert s in a and s in b, (
            f"step {s} missing: reference has {sorted(a)}, run has {sorted(b)}"
        )
        for key in ("ids_digest", "tokens_digest", "first_position", "num_samples", "chain"):
            assert a[s][key] == b[s][key], (
                f"step {s}: {key} differs\n  reference {a[s]}\n  run       {b[s]}"
            )


def assert_losses(reference: Path, run: Path, steps: range, *, rtol: float) -> None:
    a, _ = runs.losses(reference)
    b, _ = runs.losses(run)
    for s in steps:
        if rtol == 0:
            assert a[s] == b[s], f"step {s}: loss {b[s]!r} != reference {a[s]!r} (exact expected)"
        else:
            assert abs(a[s] - b[s]) <= rtol * abs(a[s]), (
                f"step {s}: loss {b[s]} vs reference {a[s]} (rtol {rtol})"
            )


def resume_events(run: Path) -> list[dict]:
    return [
        e for e in read_log(run / "zephon" / "sequence_log.jsonl").events if e["event"] == "resume"
    ]


def tree(root: Path) -> dict[str, tuple]:
    """Every file and folder under ``root``: kind, size, mtime and content hash. Equal
    before and after a refused start means nothing was created, changed or deleted."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        content = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(root))] = (p.is_dir(), st.st_size if content else 0,
                                         st.st_mtime_ns, content)  # fmt: skip
    return out


def assert_unchanged(before: dict[str, tuple], after: dict[str, tuple]) -> None:
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"the refused start changed the run folder: {changed}"


def assert_refused(job, *texts: str) -> None:
    """The job was refused with a clear message (no traceback through our code) that
    contains every one of ``texts``."""
    tail = job.output[-4000:]
    assert job.returncode != 0, f"the job was not refused:\n{tail}"
    assert "Zephon refused to start" in job.output, tail
    package = str(Path(__file__).resolve().parents[2] / "torchtitan_zephon")
    assert f'File "{package}' not in job.output, f"a traceback instead of a message:\n{tail}"
    for text in texts:
        assert text in job.output, f"{text!r} not in the message:\n{tail}"


def assert_verify_match(a: Path, b: Path) -> None:
    """``zephon verify A B`` (the command users run) says MATCH, exit 0."""
    from tests.titan.launch import REPO, job_env

    verify = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", "verify", str(a), str(b)],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "verdict: MATCH" in verify.stdout
