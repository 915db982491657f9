"""Timing primitives shared by the benchmark suites.

Invariant: a rate is measured after a warm-up call, over a wall-clock budget,
with ``time.perf_counter``; a latency is the median of repeated runs; a round
rate first draws untimed for a quarter of its budget (what a prefetching loader
made while others were timed is not counted) and also counts tokens per CPU
second of the process (the work per token, whatever the machine's load).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any


def rate(step: Callable[[], object], units_per_call: float, seconds: float) -> dict[str, float]:
    """Call ``step`` for about ``seconds`` after one warm-up call; units per second."""
    step()
    calls, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        step()
        calls += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    elapsed = now - start
    return {"per_s": calls * units_per_call / elapsed, "calls": calls, "seconds": elapsed}


def round_rate(
    fn: Callable[[], object], tokens_per_batch: int, seconds: float
) -> tuple[float, float]:
    """(tokens per second, tokens per CPU second of this process) of ``fn`` over
    ``seconds``, after a quarter as long drawing batches untimed: what a loader prefetched
    while the others had their turn is not counted."""
    rate(fn, tokens_per_batch, seconds / 4)
    calls, cpu0, start = 0, time.process_time(), time.perf_counter()
    deadline = start + seconds
    while True:
        fn()
        calls += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    cpu = time.process_time() - cpu0
    tokens = calls * tokens_per_batch
    return tokens / (now - start), tokens / cpu if cpu > 0 else float("inf")


def latency(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median and min wall time of ``repeats`` calls of ``fn`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": len(times)}


def paired_latency(
    fns: dict[str, Callable[[], object]], repeats: int
) -> dict[str, dict[str, float]]:
    """``latency`` of several functions, interleaved call by call so drift hits all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(max(1, repeats)):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {
        k: {"median_s": statistics.median(v), "min_s": min(v), "repeats": len(v)}
        for k, v in times.items()
    }


def ratio(a: float, b: float) -> float:
    """``a / b``, or infinity when ``b`` is zero."""
    return a / b if b else float("inf")


def first_batch_after_restore(loader: Any, state: object) -> None:
    """Restore ``loader`` to ``state`` and take its first batch (what a resume waits
    for); the loader is closed either way."""
    try:
        loader.load_state_dict(state)
        next(loader)
    finally:
        loader.close()


def child_times(
    argv: list[str], what: str, env: dict[str, str] | None = None
) -> tuple[float, dict[str, Any]]:
    """Run ``argv`` (a fresh Python process) and return (its start time, the JSON object
    its last stdout line holds: the timestamps it took); a RuntimeError naming ``what``
    with the end of its stderr when it fails."""
    t0 = time.time()
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{what} child failed:\n{out.stderr[-3000:]}")
    return t0, json.loads(out.stdout.strip().splitlines()[-1])
