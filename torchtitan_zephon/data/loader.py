"""The Zephon loader: one DP rank's micro-batches, with world-size-free state.

Role: turn a DataPlan over a TokenStore into an infinite iterator of
``({"input": LongTensor[b, seq_len]}, labels LongTensor[b, seq_len])`` for one
DP rank, prefetched in the background, and save/restore its position as one
small record that is the same on every rank.

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

from torchtitan_zephon.data.plan import BatchSchedule, DataPlan, check_batch_layout
from torchtitan_zephon.data.state import (
    DataConfig,
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
        store: TokenStore,
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
        available = store.num_samples(seq_len)
        # Token ids must index the model's embedding: exact and free from the manifest's
        # max_token_id; a store without one (format 1) has each batch checked instead.
        self._id_limit = _id_limit(store, vocab_size)
        if num_samples is None:
            num_samples = available - sample_offset
        if sample_offset < 0 or num_samples < 1 or sample_offset + num_samples > available:
            raise ValueError(
                f"samples [{sample_offset}, {sample_offset + num_samples}) do not fit the store "
                f"{str(store.path)!r}, which holds {available} samples of seq_len {seq_len} "
                f"({store.num_tokens} tokens). Use a smaller seq_len, sample_offset or "
                "num_samples, or a larger store."
            )
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}.")
        schedule.check_layout(dp_degree, local_batch_size)
        if num_workers < 0 or prefetch < 0:
            raise ValueError(
                f"num_workers and prefetch must be >= 0, got {num_workers} and {prefetch}."
            )
        self.config = DataConfig.make(
            seq_len=seq_len,
            seed=seed,
            schedule=schedule,
            sample_offset=sample_offset,
            num_samples=num_samples,
            store_fingerprint=store.fingerprint,
            tokenizer_hash=store.tokenizer_hash,
            extra=extra_config,
        )
        self.store = store
        self.seq_len = int(seq_len)
        self.dp_rank = int(dp_rank)
        self.dp_degree = int(dp_degree)
        self.local_batch_size = int(local_batch_size)
        self.num_workers = int(num_workers)
        self.prefetch = int(prefetch)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.plan = DataPlan(int(num_samples), int(seed), schedule, int(sample_offset))
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
        num_samples) and ``tokenizer``, or ``all``. A schedule that only gained
        entries for untrained steps needs no opt-in.
        """
        saved = state if isinstance(state, DataState) else DataState.from_dict(state)
        decision = check_resume(saved, self.config, allow_changes)
        self._reset()
        self.plan = DataPlan(
            self.plan.num_samples,
            self.plan.seed,
            self.plan.schedule,
            self.plan.sample_offset,
            anchor_step=decision.anchor[0],
            anchor_position=decision.anchor[1],
        )
        self._next_step = saved.next_step
        self._cursor = (saved.next_step, 0)
        return decision


def _id_limit(store: TokenStore, vocab_size: int | None) -> int | None:
    """Refuse a store whose recorded ids exceed ``vocab_size``; the limit left to check per
    batch (only for stores that record no max_token_id)."""
    if vocab_size is None:
        return None
    if store.max_token_id is None:
        return int(vocab_size)
    if store.max_token_id >= vocab_size:
        raise StoreError(
            f"the store {str(store.path)!r} holds token ids up to {store.max_token_id}, but the "
            f"model embeds only {vocab_size} ids (0..{vocab_size - 1}): use a model whose "
            f"vocab_size is at least {store.max_token_id + 1}, or a store prepared with the "
            "model's tokenizer."
        )
    return None


def _out_of_vocab(
    store: TokenStore, ids: np.ndarray, tokens: np.ndarray, seq_len: int, limit: int
) -> str:
    row, col = np.unravel_index(int(np.argmax(tokens)), tokens.shape)
    sample = int(np.asarray(ids).ravel()[row])
    return (
        f"the store {str(store.path)!r} holds token id {int(tokens[row, col])} at token "
        f"{sample * seq_len + int(col)} (sample {sample}), outside the model's vocabulary of "
        f"{limit} ids. The store has no content checksums (format {store.version}), so this may "
        f"be a changed file: check it with `zephon inspect {store.path} --check`, or rebuild it "
        "with `zephon prepare`."
    )
