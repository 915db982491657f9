"""Per-source accounting in TensorBoard and the log, for Zephon's trainer.

Role: after each trained step, ``StepAccounting.record`` writes the step's
``job.accounting.StepAccount`` through TorchTitan's metrics machinery (the
``MetricsProcessor``'s logger: TensorBoard / W&B on the metrics rank, nothing
elsewhere) at every step, under the tags

    zephon/source/<name>/samples             samples of the step from the source
    zephon/source/<name>/tokens              their input tokens (samples x seq_len)
    zephon/source/<name>/cumulative_samples  trained by steps 1..step
    zephon/source/<name>/target_samples      the exact target sum w x GBS (one store:
                                             the cumulative count)
    zephon/source/<name>/deviation           cumulative - target
    zephon/source/<name>/epoch               epoch of its last trained sample
    zephon/source/<name>/documents_started   documents starting in the step's samples
                                             (not for a store in object storage with
                                             more than 8 M documents: its offsets are
                                             not fetched, job.accounting; packed
                                             samples: the documents whose first piece
                                             they hold, from the packing index)
    zephon/source/<name>/padding             packed samples only: the padding inputs
                                             of the step's samples (EOS, no label)

(``<name>``: the mixture source's name, ``store`` for one store), logs one line on
global rank 0 at TorchTitan's log frequency (``metrics.log_freq``: step 1 and every
log_freq-th step),

    Zephon: step 10 data | docs: 9 samples, 90 in total (target 90.00, +0.00),
    epoch 0, 12 new documents | stdlib: 3 samples, ...

(packed samples: ``..., 12 new documents, 37 padding tokens``),

and warns on global rank 0 when a source enters a new epoch (which source, step,
epoch; the first ``WRAP_WARNINGS`` wraps of each source, then one line saying the
rest are in TensorBoard).

Invariant: nothing proportional to the global batch runs on the training thread.
The counts are the plan's O(sources) closed forms (``job.accounting.step_account``);
the documents started, which need the step's ids, are computed by a background
thread started at the beginning of the step (``ahead``) for that step and the next,
so ``record`` only collects them; that thread also writes the scalars, in step
order. Only the ranks that write anything (global rank 0 and the metrics rank)
account at all; the values depend on the plan and the step alone, so they are the
same at any DP degree and after any resume.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from torchtitan.tools.logging import logger

from torchtitan_zephon.job.accounting import StepAccount, step_account

WRAP_WARNINGS = 3
"""Epoch wraps warned per source; later ones are only in TensorBoard (``epoch``)."""

TAGS = (
    "samples",
    "tokens",
    "cumulative_samples",
    "target_samples",
    "deviation",
    "epoch",
    "documents_started",
)


def metrics_of(
    account: StepAccount, documents: np.ndarray, padding: np.ndarray | None = None
) -> dict[str, float]:
    """The step's TensorBoard scalars (module docstring's tags; ``padding`` per source
    when the samples are packed)."""
    columns = (
        account.samples.tolist(),
        account.tokens.tolist(),
        account.cumulative.tolist(),
        [float(t) for t in account.targets],
        account.deviations,
        account.epochs.tolist(),
        np.asarray(documents).tolist(),
    )
    out: dict[str, float] = {}
    for i, name in enumerate(account.names):
        for tag, column in zip(TAGS, columns, strict=True):
            if tag == "documents_started" and column[i] < 0:
                continue  # not counted (job.source.WindowSource.document_offsets)
            out[f"zephon/source/{name}/{tag}"] = column[i]
        if padding is not None:
            out[f"zephon/source/{name}/padding"] = int(padding[i])
    return out


def log_line(account: StepAccount, documents: np.ndarray, padding: np.ndarray | None = None) -> str:
    """The compact per-step line (module docstring)."""
    parts = [
        f"{name}: {int(account.samples[i]):,} samples, {int(account.cumulative[i]):,} in total "
        f"(target {float(account.targets[i]):,.2f}, {dev:+.2f}), epoch {int(account.epochs[i])}"
        + (f", {int(documents[i]):,} new documents" if documents[i] >= 0 else "")
        + (f", {int(padding[i]):,} padding tokens" if padding is not None else "")
        for i, (name, dev) in enumerate(zip(account.names, account.deviations, strict=True))
    ]
    return f"Zephon: step {account.step} data | " + " | ".join(parts)


class StepAccounting:
    """Per-source accounting of the trainer's steps (module docstring).

    ``plan`` returns the loader's current plan (a resume may replace it); ``data`` is
    the job's data (``job.data.JobData``: documents started, padding); ``sink`` logs a
    dict of scalars at a step (the ``MetricsProcessor``'s logger), ``should_log`` is
    TorchTitan's log-step rule; ``writes_log`` is True on global rank 0 (the log line and the warnings).
    """

    def __init__(
        self,
        *,
        plan: Callable[[], Any],
        data: Any,
        seq_len: int,
        sink: Callable[[dict[str, float], int], None] | None,
        should_log: Callable[[int], bool],
        writes_log: bool,
    ) -> None:
        self.plan = plan
        self.data = data
        self.seq_len = int(seq_len)
        self.sink = sink
        self.should_log = should_log
        self.writes_log = writes_log
        self.active = writes_log or sink is not None
        self._pending: dict[int, tuple[int, Future]] = {}
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-accounting")
            if self.active
            else None
        )
        self._wrap_warnings: dict[str, int] = {}
        self._writes: list[Future] = []

    def _counts(self, plan: Any, step: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(documents started, padding inputs or None: samples that are not packed) per
        source, in the background thread (``job.data.JobData``)."""
        keys = plan.global_ids(step)
        return self.data.documents_started(keys), self.data.padding(keys)

    def _needs_documents(self, step: int) -> bool:
        """Scalars go out at every step, the log line only at log steps."""
        return self.sink is not None or self.should_log(step)

    def ahead(self, step: int) -> None:
        """Start counting the documents of ``step`` and ``step + 1`` in the background
        (those that are written: every step with scalars, else the log steps)."""
        if self._pool is None:
            return
        plan = self.plan()
        for s in (step, step + 1):
            if not self._needs_documents(s):
                continue
            known = self._pending.get(s)
            if known is None or known[0] != id(plan):
                self._pending[s] = (id(plan), self._pool.submit(self._counts, plan, s))
        for old in [s for s in self._pending if s < step]:
            del self._pending[old]

    def ready(self, step: int) -> None:
        """Block until the background thread has counted ``step`` (started by ``ahead``)
        and written every step's scalars handed over: what a training step that outlasts
        that work leaves to ``record`` (benchmarks)."""
        known = self._pending.get(step)
        if known is not None:
            known[1].result()
        for f in self._writes:
            f.result()

    def record(self, step: int) -> StepAccount | None:
        """Account trained step ``step``: the log line and epoch-wrap warnings here, the
        scalars handed to the background thread (written in step order)."""
        if self._pool is None:
            return None
        for f in [f for f in self._writes if f.done()]:
            self._writes.remove(f)
            f.result()  # a failed write raises here, a step later
        plan = self.plan()
        self.ahead(step)
        account = step_account(plan, step, self.seq_len)
        pending = self._pending.pop(step, None)  # None: the step is written nowhere
        documents, padding = (None, None) if pending is None else pending[1].result()
        if documents is not None and self.sink is not None:
            metrics = metrics_of(account, documents, padding)
            self._writes.append(self._pool.submit(self.sink, metrics, step))
        if self.writes_log:
            if documents is not None and self.should_log(step):
                logger.info(log_line(account, documents, padding))
            for name, epoch in account.wraps:
                self._warn_wrap(name, epoch, step)
        return account

    def _warn_wrap(self, name: str, epoch: int, step: int) -> None:
        n = self._wrap_warnings.get(name, 0) + 1
        self._wrap_warnings[name] = n
        if n > WRAP_WARNINGS:
            return
        logger.warning(
            f"Zephon: source {name!r} wrapped into epoch {epoch} at step {step}: its "
            "training samples repeat from here, in a new order"
        )
        if n == WRAP_WARNINGS:
            logger.warning(
                f"Zephon: later epoch wraps of source {name!r} are not logged; its epoch is "
                f"in TensorBoard (zephon/source/{name}/epoch)"
            )

    def close(self) -> None:
        """Drop the counts not yet needed; the scalars handed over are written first."""
        if self._pool is not None:
            for _, f in self._pending.values():
                f.cancel()
            self._pending.clear()
            self._pool.shutdown(wait=True)
            self._pool = None
