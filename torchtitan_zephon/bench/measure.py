"""Timing primitives shared by the benchmark suites.

Invariant: a rate is measured after a warm-up call, over a wall-clock budget,
with ``time.perf_counter``; a latency is the median of repeated runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
