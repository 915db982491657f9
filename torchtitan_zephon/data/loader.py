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

import hashlib
import json
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from torchtitan_zephon.data.plan import BatchSchedule, DataPlan, check_batch_layout
from torchtitan_zephon.data.store import StoreError, TokenStore

STATE_FORMAT = 1
# allow_changes aliases: one user-facing name can accept several config fields.
_ALIASES = {
    "store": ("store_fingerprint", "num_samples"),
    "tokenizer": ("tokenizer_hash",),
}

MicroBatch = tuple[dict[str, torch.Tensor], torch.Tensor]


class DataStateMismatch(ValueError):
    """A saved data state does not match the current data config."""


def config_fingerprint(data_config: dict[str, Any]) -> str:
    """Hex sha256 of the canonical JSON of a data config."""
    return hashlib.sha256(
        json.dumps(data_config, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


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
        reserved = {
            "seq_len",
            "seed",
            "schedule",
            "sample_offset",
            "num_samples",
            "store_fingerprint",
            "tokenizer_hash",
        }
        clash = reserved & set(extra_config or {})
        if clash:
            raise ValueError(f"extra_config may not redefine data config fields {sorted(clash)}.")

        self.store = store
        self.seq_len = int(seq_len)
        self.dp_rank = int(dp_rank)
        self.dp_degree = int(dp_degree)
        self.local_batch_size = int(local_batch_size)
        self.num_workers = int(num_workers)
        self.prefetch = int(prefetch)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.plan = DataPlan(int(num_samples), int(seed), schedule, int(sample_offset))
        self.data_config: dict[str, Any] = {
            "seq_len": self.seq_len,
            "seed": int(seed),
            "schedule": schedule.to_list(),
            "sample_offset": int(sample_offset),
            "num_samples": int(num_samples),
            "store_fingerprint": store.fingerprint,
            "tokenizer_hash": store.tokenizer_hash,
            **(extra_config or {}),
        }
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

    def state_dict(self) -> dict[str, Any]:
        """World-size-independent record of the data position (same on every rank)."""
        first, _ = self.plan.step_positions(self._next_step)
        return {
            "format": STATE_FORMAT,
            "store_fingerprint": self.store.fingerprint,
            "data_config": dict(self.data_config),
            "data_config_fingerprint": config_fingerprint(self.data_config),
            "next_step": self._next_step,
            "consumed_positions": first,
            "position_anchor": [self.plan.anchor_step, self.plan.anchor_position],
        }

    def load_state_dict(self, state: dict[str, Any], *, allow_changes: Iterable[str] = ()) -> None:
        """Continue at ``state["next_step"]``; refuse config changes not in ``allow_changes``.

        ``allow_changes`` names data config fields whose change is accepted
        (``seed``, ``seq_len``, ``schedule``, ``sample_offset``, ``num_samples``,
        ``store_fingerprint``, ``tokenizer_hash``, any extra_config key), the
        aliases ``store`` (store_fingerprint + num_samples) and ``tokenizer``,
        or ``all``.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise DataStateMismatch(
                f"unsupported data state format {found!r}; expected {STATE_FORMAT}. The "
                "checkpoint was written by an incompatible version of zephon."
            )
        try:
            old_config = dict(state["data_config"])
            next_step = int(state["next_step"])
            consumed = int(state["consumed_positions"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataStateMismatch(
                f"data state is missing or has an invalid field ({e})."
            ) from None
        if next_step < 1 or consumed < 0:
            raise DataStateMismatch(
                f"data state has next_step={next_step}, consumed_positions={consumed}; "
                "expected next_step >= 1 and consumed_positions >= 0."
            )
        allowed = self._allowed(allow_changes)
        new_config = self.data_config
        differing = sorted(
            k for k in set(old_config) | set(new_config) if old_config.get(k) != new_config.get(k)
        )
        if state.get("store_fingerprint") != self.store.fingerprint and (
            "store_fingerprint" not in differing
        ):
            differing.append("store_fingerprint")
        refused = [k for k in differing if not (allowed is True or k in allowed)]
        if refused:
            lines = [
                f"  {k}: {old_config.get(k, '<absent>')!r} -> {new_config.get(k, '<absent>')!r}"
                for k in refused
            ]
            hint = ""
            if "schedule" in refused:
                hint = self._schedule_hint(old_config.get("schedule"), next_step)
            raise DataStateMismatch(
                "the data config differs from the one saved in the checkpoint; resuming would "
                "not continue the same data stream. Differing fields (saved -> current):\n"
                + "\n".join(lines)
                + hint
                + f"\nTo accept, opt in with allow_changes={refused!r} (or 'all')."
            )

        anchor_step, anchor_pos = next_step, consumed
        if "schedule" not in differing:
            saved = state.get("position_anchor", [1, 0])
            probe = DataPlan(
                self.plan.num_samples,
                self.plan.seed,
                self.plan.schedule,
                self.plan.sample_offset,
                anchor_step=int(saved[0]),
                anchor_position=int(saved[1]),
            )
            try:
                expected = probe.step_positions(next_step)[0]
            except ValueError:
                expected = None
            if expected != consumed:
                raise DataStateMismatch(
                    f"data state is inconsistent: step {next_step} should start at position "
                    f"{expected} under schedule {self.plan.schedule}, but the state records "
                    f"consumed_positions={consumed}. The checkpoint's data state is corrupt."
                )
            anchor_step, anchor_pos = int(saved[0]), int(saved[1])
        self._reset()
        self.plan = DataPlan(
            self.plan.num_samples,
            self.plan.seed,
            self.plan.schedule,
            self.plan.sample_offset,
            anchor_step=anchor_step,
            anchor_position=anchor_pos,
        )
        self._next_step = next_step
        self._cursor = (next_step, 0)

    def _allowed(self, allow_changes: Iterable[str]) -> set[str] | bool:
        names = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
        if "all" in names:
            return True
        fields = set(self.data_config)
        allowed: set[str] = set()
        for name in names:
            if name in _ALIASES:
                allowed.update(_ALIASES[name])
            elif name in fields:
                allowed.add(name)
            else:
                raise ValueError(
                    f"unknown allow_changes entry {name!r}; expected one of "
                    f"{sorted(fields | set(_ALIASES) | {'all'})}."
                )
        return allowed

    def _schedule_hint(self, old: Any, next_step: int) -> str:
        try:
            old_sched = BatchSchedule([tuple(e) for e in old])
        except (TypeError, ValueError):
            return ""
        same = old_sched.first_position(next_step) == self.plan.schedule.first_position(next_step)
        if same:
            return (
                f"\nThe new schedule agrees with the saved one on steps < {next_step}, so "
                "accepting 'schedule' continues from the recorded position without a gap."
            )
        return (
            f"\nAccepting 'schedule' continues from the recorded consumed position; steps from "
            f"{next_step} on use the new global batch sizes."
        )


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
