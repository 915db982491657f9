"""``zephon bench accounting``: what the per-source accounting costs a training step.

A mixture of 3 sources (one weight change, one skip range) at 400,000 samples per
step (``--quick``: 4,000), each source with synthetic document offsets (about one
document start per sample). It measures, side by side in one run: (1) the step path:
``titan.components.accounting.StepAccounting.record`` of a step whose background count is done
(``ready``): its counts, targets, epochs and deviations, the log line formatted, its
scalars handed to the background thread (target: under 1 ms); (2) the baseline
a per-sample accounting would put on the step path: the step's ids from the plan,
then a ``bincount`` of their sources; (3) the background thread's work per step (the
documents started: the step's ids, then a ``searchsorted`` over each source's offsets),
which only has to keep up with the training steps, and its scalars written through
TorchTitan's ``TensorBoardLogger`` into a temporary folder.

Invariant: every figure is the median of ``repeats`` calls at consecutive steps far
into the run (step 10^6), each call on a step of its own, measured in this run.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from torchtitan_zephon.bench.measure import ratio
from torchtitan_zephon.job.accounting import documents_started, step_account
from torchtitan_zephon.job.source import starts_in_windows
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.spec import MixtureSpec
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import split_keys

TARGETS = {"step_path_ms": 1.0}
FIRST_STEP = 10**6
DEFAULTS = {
    "gbs": 400_000,
    "seq_len": 2048,
    "samples": (2_000_000, 1_000_000, 500_000),
    "repeats": 15,
}
QUICK = {"gbs": 4_000, "seq_len": 256, "samples": (20_000, 10_000, 5_000), "repeats": 3}


def _plan(gbs: int, samples: tuple[int, ...]) -> MixtureStream:
    names = ["books", "code", "web"]
    spec = MixtureSpec.build(
        dict(zip(names, samples, strict=True)),
        [(1, {"books": 2, "code": 3, "web": 5}), (500_000, {"books": 3, "code": 3, "web": 4})],
    )
    layout = Layout(BatchSchedule([(1, gbs)]), skips=SkipSteps.parse("700000:300"))
    return MixtureStream(MixturePlan(spec, 0, layout))


def _offsets(samples: int, seq_len: int, seed: int) -> np.ndarray:
    """Sorted document offsets from 0, about one start per ``seq_len`` tokens."""
    rng = np.random.default_rng(seed)
    gaps = rng.integers(1, 2 * seq_len, size=samples, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(gaps[:-1])])


class OffsetsOnly:
    """What the accounting asks of a job's data (``job.data.JobData``) for window sources
    with these document offsets, computed as ``JobData`` computes it (the keys split per
    source, ``starts_in_windows`` over each source's offsets): the sources are simulated,
    larger than this machine holds, so there is no store behind them."""

    def __init__(self, offsets: list[np.ndarray], seq_len: int) -> None:
        self.offsets, self.seq_len = offsets, seq_len

    def documents_started(self, keys: np.ndarray) -> np.ndarray:
        sources, ids = split_keys(np.asarray(keys, dtype=np.int64))
        return np.array(
            [
                starts_in_windows(off, ids[sources == i], self.seq_len)
                for i, off in enumerate(self.offsets)
            ],
            dtype=np.int64,
        )

    def padding(self, keys: np.ndarray) -> None:
        return None


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def run(opts: dict[str, Any]) -> dict[str, Any]:
    from torchtitan.components.metrics import TensorBoardLogger
    from torchtitan.tools.logging import logger

    from torchtitan_zephon.titan.components.accounting import StepAccounting, metrics_of

    p = dict(QUICK if opts.get("quick") else DEFAULTS)
    gbs, seq_len, repeats = p["gbs"], p["seq_len"], p["repeats"]
    plan = _plan(gbs, p["samples"])
    data = OffsetsOnly([_offsets(n, seq_len, k) for k, n in enumerate(p["samples"])], seq_len)
    steps = range(FIRST_STEP, FIRST_STEP + repeats)
    with tempfile.TemporaryDirectory() as tb:
        board = TensorBoardLogger(tb)
        accounting = StepAccounting(
            plan=lambda: plan,
            data=data,
            seq_len=seq_len,
            sink=board.log,
            should_log=lambda step: True,  # format the line at every step measured
            writes_log=True,
        )
        level = logger.level
        logger.setLevel(logging.ERROR)  # formatted, not printed
        step_path, background = [], []
        try:
            for step in steps:
                t0 = time.perf_counter()
                accounting.ahead(step)
                accounting.ready(step)
                background.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                accounting.record(step)
                step_path.append(time.perf_counter() - t0)
        finally:
            logger.setLevel(level)
            accounting.close()
            board.close()
    account = step_account(plan, steps[0], seq_len)
    documents = documents_started(plan, steps[0], data.offsets, seq_len)
    scalars = metrics_of(account, documents)
    with tempfile.TemporaryDirectory() as tb:
        board = TensorBoardLogger(tb)
        writes = []
        for step in steps:
            t0 = time.perf_counter()
            board.log(scalars, step)
            writes.append(time.perf_counter() - t0)
        board.close()
    baseline = []
    for step in steps:
        t0 = time.perf_counter()
        sources = split_keys(plan.global_ids(step))[0]
        counts = np.bincount(sources, minlength=len(plan.names))
        baseline.append(time.perf_counter() - t0)
    assert counts.tolist() == step_account(plan, steps[-1], seq_len).samples.tolist()
    r = {
        "global_batch": gbs,
        "sources": len(plan.names),
        "seq_len": seq_len,
        "steps": [steps[0], steps[-1]],
        "step_path_ms": _median_ms(step_path),
        "baseline_ids_ms": _median_ms(baseline),
        "background_ms": _median_ms(background),
        "tensorboard_ms": _median_ms(writes),
        "scalars_per_step": len(scalars),
        "documents_per_step": int(documents.sum()),
    }
    r["baseline_ratio"] = ratio(r["baseline_ids_ms"], r["step_path_ms"])
    r["meets"] = {"step_path_ms": r["step_path_ms"] < TARGETS["step_path_ms"]}
    return r


def rows(r: dict) -> list[tuple[str, str, str]]:
    """(measure, value, note) lines of the printed table."""
    size = f"{r['global_batch']:,} samples a step, {r['sources']} sources"
    return [
        (
            "accounting on the step path",
            f"{r['step_path_ms']:.3f} ms",
            f"{size}: counts, targets, epochs, deviations, log line; "
            f"target < {TARGETS['step_path_ms']:g} ms",
        ),
        (
            "baseline: counts from the step's ids",
            f"{r['baseline_ids_ms']:.1f} ms",
            f"O(global batch) on the step path: {r['baseline_ratio']:,.0f}x the accounting",
        ),
        (
            "documents started, background thread",
            f"{r['background_ms']:.1f} ms",
            f"per step, off the training thread ({r['documents_per_step']:,} documents)",
        ),
        (
            "TensorBoard scalars, background thread",
            f"{r['tensorboard_ms']:.3f} ms",
            f"{r['scalars_per_step']} scalars a step through TorchTitan's TensorBoardLogger",
        ),
    ]
