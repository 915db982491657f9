"""The Zephon loader: one DP rank's micro-batches, with world-size-free state.

Role: turn a source's plan (``data.source``: one TokenStore, or a mixture of
several) into an infinite iterator of
``({"input": LongTensor[b, seq_len]}, labels LongTensor[b, seq_len])`` for one
DP rank, prefetched in the background, and save/restore its position as one
small record that is the same on every rank. The plan yields sample keys
(sample ids for one store); ``source.windows`` gathers their tokens.

Invariants:
- For steps s = next_step, next_step + 1, ... the loader yields exactly the
  rank's micro-batches of ``plan.microbatch_ids(s, ...)`` in order, whatever
  ``num_workers`` and ``prefetch`` are.
- ``state_dict()`` depends only on the data config and on how many whole steps
  have been *delivered* to the caller: never on dp_rank, dp_degree,
  local_batch_size, num_workers or on batches prefetched but not yet returned.
  Loading it under any DP layout that divides the global batch size continues
  the global stream exactly where it stopped; restoring is O(1).
- Every batch holds tokens the store checked against its content checksums
  (see ``store.py``) and, given ``vocab_size``, only ids below it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from torchtitan_zephon.data.plan import BatchSchedule, check_batch_layout
from torchtitan_zephon.data.source import Source, StoreSource
from torchtitan_zephon.data.state import (
    DataState,
    DataStateMismatch,
    ResumeDecision,
    check_resume,
)
from torchtitan_zephon.data.store import StoreError, TokenStore

__all__ = ["DataStateMismatch", "MicroBatch", "ZephonLoader"]

MicroBatch = tuple[dict[str, torch.Tensor], torch.Tensor]


class ZephonLoader:
    """Infinite, deterministic micro-batch stream for one DP rank."""

    def __init__(
        self,
        source: TokenStore | Source,
        *,
        seq_len: int,
        seed: int,
        schedule: BatchSchedule,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        sample_offset: int = 0,
        num_samples: int | None = None,
        num_workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        extra_config: dict | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if isinstance(source, TokenStore):  # the one-store case
            source = StoreSource(
                source, seq_len, sample_offset=sample_offset, num_samples=num_samples
            )
        elif source.seq_len != seq_len:
            raise ValueError(
                f"the source {source.path!r} was resolved for seq_len {source.seq_len}, "
                f"the loader was asked for seq_len {seq_len}."
            )
        # Token ids must index the model's embedding: exact and free from the manifest's
        # max_token_id; a store without one (format 1) has each batch checked instead.
        self._id_limit = source.id_limit(vocab_size)
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}.")
        schedule.check_layout(dp_degree, local_batch_size)
        if num_workers < 0 or prefetch < 0:
            raise ValueError(
                f"num_workers and prefetch must be >= 0, got {num_workers} and {prefetch}."
            )
        self.config = source.data_config(seed=seed, schedule=schedule, extra=extra_config)
        self.source = source
        self.store = source  # what ``windows`` gathers from (the source: one store or several)
        self.seq_len = int(seq_len)
        self.dp_rank = int(dp_rank)
        self.dp_degree = int(dp_degree)
        self.local_batch_size = int(local_batch_size)
        self.num_workers = int(num_workers)
        self.prefetch = int(prefetch)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.plan = source.plan(self.config)
        self._next_step = 1
        self._cursor = (1, 0)  # next (step, micro-batch index) to produce
        self._pending: deque[Future] = deque()
        self._executor: ThreadPoolExecutor | None = None
        self._ids_cache: dict[int, np.ndarray] = {}  # step -> rank ids under self.plan
        self._ids_lock = threading.Lock()

    # ------------------------------------------------------------------ batches

    @property
    def next_step(self) -> int:
        """First step not yet completely delivered to the caller."""
        return self._next_step

    def grad_accumulation_steps(self, step: int) -> int:
        return check_batch_layout(
            self.plan.schedule.gbs(step), self.dp_degree, self.local_batch_size
        )

    def _rank_ids(self, step: int) -> np.ndarray:
        """This rank's ids of ``step``, cached for the few most recent steps."""
        with self._ids_lock:
            ids = self._ids_cache.get(step)
        if ids is None:
            ids = self.plan.rank_ids(step, self.dp_rank, self.dp_degree)
            with self._ids_lock:
                self._ids_cache[step] = ids
                while len(self._ids_cache) > 4:
                    del self._ids_cache[min(self._ids_cache)]
        return ids

    def _microbatch(self, step: int, index: int) -> MicroBatch:
        b = self.local_batch_size
        return self._tensors(self._rank_ids(step)[index * b : (index + 1) * b])

    def _tensors(self, ids: np.ndarray) -> MicroBatch:
        tokens = self.store.windows(ids, self.seq_len)  # the store checks the chunks it reads
        if self._id_limit is not None and tokens.size and int(tokens.max()) >= self._id_limit:
            raise StoreError(_out_of_vocab(self.store, ids, tokens, self.seq_len, self._id_limit))
        w = torch.from_numpy(tokens.astype(np.int64))
        inputs, labels = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if self.pin_memory:
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        return {"input": inputs}, labels

    def step_microbatches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of ``step`` (pure: does not move the loader)."""
        return [self._microbatch(step, k) for k in range(self.grad_accumulation_steps(step))]

    def _advance(self) -> tuple[int, int, bool]:
        step, index = self._cursor
        last = index + 1 == self.grad_accumulation_steps(step)
        self._cursor = (step + 1, 0) if last else (step, index + 1)
        return step, index, last

    def _job(self, step: int, index: int, last: bool) -> tuple[int, bool, MicroBatch]:
        return step, last, self._microbatch(step, index)

    def _fill(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=max(1, self.num_workers), thread_name_prefix="zephon-loader"
            )
        while len(self._pending) < max(1, self.prefetch + self.num_workers - 1):
            self._pending.append(self._executor.submit(self._job, *self._advance()))

    def __iter__(self) -> ZephonLoader:
        return self

    def __next__(self) -> MicroBatch:
        try:
            if self.prefetch == 0 and self.num_workers == 0:
                step, last, batch = self._job(*self._advance())
            else:
                if not self._pending:
                    self._fill()
                step, last, batch = self._pending.popleft().result()
                self._fill()
        except BaseException:
            self._reset()  # rewind to the first undelivered micro-batch: never skip one
            raise
        if last:  # the step's final micro-batch is handed over by this return
            self._next_step = step + 1
        return batch

    def _reset(self) -> None:
        for fut in self._pending:
            fut.cancel()
        for fut in self._pending:  # let running jobs finish before the plan changes
            if not fut.cancelled():
                fut.exception()
        self._pending.clear()
        with self._ids_lock:
            self._ids_cache.clear()
        self._cursor = (self._next_step, 0)

    def close(self) -> None:
        """Stop background threads and drop prefetched batches."""
        self._reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> ZephonLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def data_state(self) -> DataState:
        """World-size-independent record of the data position (same on every rank)."""
        first, _ = self.plan.step_positions(self._next_step)
        anchor = (self.plan.anchor_step, self.plan.anchor_position)
        return DataState(self.config, self._next_step, first, anchor)

    def state_dict(self) -> dict[str, Any]:
        """``data_state()`` as a JSON-able dict."""
        return self.data_state().to_dict()

    def load_state_dict(
        self, state: dict[str, Any] | DataState, *, allow_changes: Iterable[str] = ()
    ) -> ResumeDecision:
        """Continue at the saved ``next_step``; refuse config changes not in ``allow_changes``.

        The rule is ``data.state.check_resume``: ``allow_changes`` names data config
        fields whose change is accepted (``seed``, ``seq_len``, ``schedule``,
        ``sample_offset``, ``num_samples``, ``store_fingerprint``, ``tokenizer_hash``,
        any extra_config key), the aliases ``store`` (store_fingerprint +
        num_samples), ``tokenizer`` and ``mixture`` (a mixture's sources or the
        weights of trained steps), or ``all``. A batch or weight schedule that
        changed only for untrained steps needs no opt-in.
        """
        saved = state if isinstance(state, DataState) else DataState.from_dict(state)
        decision = check_resume(saved, self.config, allow_changes)
        self._reset()
        self.plan = self.source.plan(self.config, decision.anchor)
        self._next_step = saved.next_step
        self._cursor = (saved.next_step, 0)
        return decision


def _out_of_vocab(
    source: Source, keys: np.ndarray, tokens: np.ndarray, seq_len: int, limit: int
) -> str:
    return source.out_of_vocab(keys, tokens, limit)
