"""The sequence tracker at production length (part of ``zephon bench scale``).

- ``log_resume_s``: time to find and check a checkpoint's record in a log of
  1,000 / 1,000,000 (/ 10,000,000 with ``slow``) steps, for a checkpoint at the
  log's end and one far behind it (the larger of the two is reported).
- ``verify_s`` / ``verify_peak_rss_mb``: ``zephon verify A B`` over two logs of
  1,000,000 steps, in a fresh process (wall time; peak RSS of that process plus
  twice the larger of its two log-reading child processes).
- ``tracker_step_path_ms``: what the training thread spends on the tracker per
  step (collecting the ids digest computed ahead, appending the record), keyed by
  samples per step: 32 / 8,192 / 400,000.

Logs of 1,000 and 1,000,000 steps are written through the real
``SequenceTracker``; the 10,000,000-step log by a bulk writer producing the same
bytes (``records.record_line``, the same index). Logs are cached under
``$ZEPHON_CACHE/bench-logs`` between runs.

Invariant: every figure is measured on logs a real run could have written:
each one passes ``zephon verify`` (checked on the 1,000-step log every run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.ingest.builtin import cache_root
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.tracker import SequenceTracker, genesis, read_log
from torchtitan_zephon.tracker.index import LogIndex, index_path
from torchtitan_zephon.tracker.records import TRACKER_FORMAT, record_line
from torchtitan_zephon.tracker.writer import StepDigests

GBS = 64
TOPOLOGY = {"world_size": 1, "dp_degree": 1, "nnodes": 1}
STEP_PATH_SAMPLES = (32, 8192, 400_000)


def _config(num_samples: int = 10**9, gbs: int = GBS) -> DataConfig:
    return DataConfig.make(
        seq_len=2048, seed=0, schedule=BatchSchedule([(1, gbs)]), sample_offset=0,
        num_samples=num_samples, store_fingerprint="b" * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip


def _digest(step: int) -> str:
    return f"{step:064x}"


def write_log_real(path: Path, steps: int) -> None:
    """A log of ``steps`` steps written by the real tracker (digests stand in for ids)."""
    t = SequenceTracker(path, config=_config(), writer=True)
    t.start(TOPOLOGY)
    for s in range(1, steps + 1):
        t.record(s, (s - 1) * GBS, digest=_digest(s), num_samples=GBS)


def write_log_bulk(path: Path, steps: int) -> None:
    """The same bytes as ``write_log_real``, written in bulk (and its index)."""
    t = SequenceTracker(path, config=_config(), writer=True)
    t.start(TOPOLOGY)
    chain = genesis(t.config.fingerprint)
    offset = path.stat().st_size
    with open(path, "ab", buffering=1 << 22) as f:
        slots = bytearray()
        import struct

        slot = struct.Struct("<QII")
        for s in range(1, steps + 1):
            body = {
                "v": TRACKER_FORMAT, "step": s, "first_position": (s - 1) * GBS,
                "num_samples": GBS, "ids_digest": _digest(s),
            }  # fmt: skip
            chain, line = record_line(chain, body)
            f.write(line + b"\n")
            slots += slot.pack(offset, len(line), 0x5A455048)
            offset += len(line) + 1
    fd = os.open(index_path(path), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, bytes(slots), slot.size)  # from step 1's slot
    finally:
        os.close(fd)


def cached_log(steps: int, bulk: bool) -> Path:
    """A cached log of ``steps`` steps (written on first use)."""
    root = cache_root() / "bench-logs" / f"v{TRACKER_FORMAT}-{steps}"
    path = root / "sequence_log.jsonl"
    if (root / "done").exists():
        return path
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    (write_log_bulk if bulk else write_log_real)(path, steps)
    (root / "done").write_text("ok")
    return path


def resume_time(path: Path, steps: int, repeats: int = 5) -> dict[str, float]:
    """Seconds for the writer's resume check at the log's end and far behind it."""
    out = {}
    for label, step in (("end", steps), ("behind", max(1, steps // 10))):
        head = {"step": step, "chain": _chain_at(path, step)}
        times = []
        for _ in range(repeats):
            t = SequenceTracker(path, config=_config(), writer=True)
            t0 = time.perf_counter()
            problem = t.cannot_continue(head)
            times.append(time.perf_counter() - t0)
            if problem is not None:
                raise RuntimeError(f"bench log {path} does not resume at step {step}: {problem}")
        out[label] = float(np.median(times))
    return out


def _chain_at(path: Path, step: int) -> str:
    found = LogIndex(path).record(step)
    if found is None:
        raise RuntimeError(f"bench log {path} has no indexed record of step {step}")
    return json.loads(found[1])["chain"]


VERIFY_CHILD = r"""
import json, resource, sys, time
from torchtitan_zephon.cli.main import build_parser, main
import contextlib, io
build_parser()  # imports every subcommand: not part of verify's time
t0 = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()) as out:
    rc = main(["verify", sys.argv[1], sys.argv[2], "--json"])
wall = time.perf_counter() - t0
report = json.loads(out.getvalue())
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec, so it would report
# the RSS of whatever process launched this one
try:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    peak = int(hwm[0].split()[1]) / 1024
except (OSError, IndexError, ValueError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"rc": rc, "verdict": report["verdict"], "steps": report["steps_compared"],
                  "wall_s": wall,
                  "peak_rss_mb": peak,
                  "reader_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def verify_run(a: Path, b: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", VERIFY_CHILD, str(a), str(b)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"verify benchmark failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_path(samples: int, repeats: int) -> float:
    """Median ms the training thread spends on the tracker per step at ``samples``."""
    plan = DataPlan(10**9, 0, BatchSchedule([(1, samples)]))
    config = _config(gbs=samples)
    digests = StepDigests(lambda: plan, config.step_key)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        t = SequenceTracker(Path(tmp) / "log.jsonl", config=config, writer=True)
        t.start(TOPOLOGY)
        times = []
        for s in range(1, repeats + 1):
            digests.ahead(s)
            digests._pending[s].result()  # the step's forward/backward would run meanwhile
            t0 = time.perf_counter()
            first, count, digest = digests.take(s)
            t.record(s, first, digest=digest, num_samples=count)
            times.append(time.perf_counter() - t0)
    digests.close()
    return float(np.median(times)) * 1e3


def run(quick: bool, slow: bool) -> dict[str, Any]:
    lengths = [1000] if quick else [1000, 1_000_000] + ([10_000_000] if slow else [])
    resume: dict[str, Any] = {}
    for n in lengths:
        path = cached_log(n, bulk=n > 1_000_000)
        resume[str(n)] = resume_time(path, n)
    small = cached_log(1000, bulk=False)
    if not read_log(small).problems == []:
        raise RuntimeError(f"bench log {small} does not verify")
    n_verify = 1000 if quick else 1_000_000
    a = cached_log(n_verify, bulk=False)
    b = a.parent.parent / f"{a.parent.name}-copy" / a.name
    if not b.exists():
        b.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(a, b)
    v = verify_run(a, b)
    if v["rc"] != 0 or v["steps"] != n_verify:
        raise RuntimeError(f"verify of the bench logs did not match: {v}")
    samples = STEP_PATH_SAMPLES[:2] if quick else STEP_PATH_SAMPLES
    return {
        "log_resume_s": {k: max(v.values()) for k, v in resume.items()},
        "log_resume_detail_s": resume,
        "log_resume_ratio": (max(resume[str(lengths[-1])].values()) / max(resume["1000"].values())),
        "verify_steps": n_verify,
        "verify_s": v["wall_s"],
        "verify_steps_per_s": n_verify / v["wall_s"],
        # the comparing process and its two reader processes together (a bound: the
        # readers' pages shared with their parent are counted twice)
        "verify_peak_rss_mb": v["peak_rss_mb"] + 2 * v["reader_peak_rss_mb"],
        "verify_rss_detail_mb": {"compare": v["peak_rss_mb"], "reader": v["reader_peak_rss_mb"]},
        "tracker_step_path_ms": {str(n): step_path(n, 3 if quick else 10) for n in samples},
    }
