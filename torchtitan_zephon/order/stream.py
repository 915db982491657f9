"""Streams: the sample keys of every position, step, rank slice and micro-batch.

Role: a *stream* is the global sequence of positions 0, 1, 2, ..., each holding
one sample; ``StreamPlan`` is what every stream offers (keys per position, step,
rank slice and micro-batch, and a window of a rank's stream). ``DataPlan`` is the
stream of one store; a mixture's is ``order.mixture.plan.MixtureStream``. Streams
name samples by **sample keys**: int64 values ``source << SOURCE_SHIFT | id``
(``make_keys`` / ``split_keys``); for one store the key is the sample id.

Invariants:
- Position p of a ``DataPlan`` is sample ``sample_offset + Permutation(num_samples,
  seed, p // num_samples)[p % num_samples]``, so every sample appears exactly once
  per epoch and epochs are reshuffled.
- Step s covers the positions ``order.layout.BatchSchedule`` gives it (counted from
  the anchor, if any); the rank slices concatenate to the step for every DP degree
  dividing its batch, and a rank's micro-batches to its slice.
- A window of a rank's stream (``rank_stream_ids``: many steps, across epochs, in
  a few numpy calls) equals the per-step slices ``rank_ids`` concatenated.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from torchtitan_zephon.order.layout import BatchSchedule, check_batch_layout, rank_slice
from torchtitan_zephon.order.permutation import Permutation

SOURCE_SHIFT = 40
"""Bits of a sample key that hold the sample id: 2^40 (~10^12) samples per source."""
ID_MASK = (1 << SOURCE_SHIFT) - 1
_SHIFT, _MASK = np.int64(SOURCE_SHIFT), np.int64(ID_MASK)  # as numpy scalars: no conversion


def make_keys(sources: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Sample keys (int64) of (source index, sample id) pairs."""
    return (np.asarray(sources, dtype=np.int64) << SOURCE_SHIFT) | np.asarray(ids, dtype=np.int64)


def split_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source index, sample id) arrays (int64) of sample keys."""
    k = np.asarray(keys, dtype=np.int64)
    return k >> _SHIFT, k & _MASK


class StreamPlan(Protocol):
    """Sample keys of every step, rank slice and micro-batch (``DataPlan``'s interface)."""

    schedule: BatchSchedule
    anchor_step: int
    anchor_position: int

    def step_positions(self, step: int) -> tuple[int, int]: ...
    def ids_for_positions(self, first: int, count: int) -> np.ndarray: ...
    def global_ids(self, step: int) -> np.ndarray: ...
    def rank_positions(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int]: ...
    def rank_ids(self, step: int, dp_rank: int, dp_degree: int) -> np.ndarray: ...
    def microbatch_ids(
        self, step: int, dp_rank: int, dp_degree: int, local_batch_size: int
    ) -> list[np.ndarray]: ...


class DataPlan:
    """Sample ids of every global step, rank slice and micro-batch.

    ``anchor_step`` / ``anchor_position`` pin step ``anchor_step`` to start at
    ``anchor_position``; the default (1, 0) is the plain schedule. A resume that
    explicitly accepts a schedule change uses the anchor to continue from the
    recorded consumed position exactly.
    """

    def __init__(
        self,
        num_samples: int,
        seed: int,
        schedule: BatchSchedule,
        sample_offset: int = 0,
        *,
        anchor_step: int = 1,
        anchor_position: int = 0,
    ) -> None:
        if num_samples < 1:
            raise ValueError(
                f"a data plan needs at least 1 sample, got num_samples={num_samples}; "
                "use a larger store or a shorter seq_len."
            )
        if sample_offset < 0:
            raise ValueError(f"sample_offset must be >= 0, got {sample_offset}.")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.schedule = schedule
        self.sample_offset = int(sample_offset)
        self.anchor_step = int(anchor_step)
        self.anchor_position = int(anchor_position)
        self._permutation: Permutation | None = None

    def permutation(self, epoch: int) -> Permutation:
        """The epoch's permutation; the latest one is kept (consecutive steps share it)."""
        cached = self._permutation  # one reference read: safe across loader threads
        if cached is None or cached.epoch != epoch:
            cached = Permutation(self.num_samples, self.seed, epoch)
            self._permutation = cached
        return cached

    def ids_for_positions(self, first: int, count: int) -> np.ndarray:
        """Sample ids (int64) of positions [first, first + count); may span epochs."""
        if first < 0 or count < 0:
            raise ValueError(f"positions must be >= 0, got first={first}, count={count}.")
        out = np.empty(count, dtype=np.int64)
        n = self.num_samples
        p, done = first, 0
        while done < count:
            epoch, offset = divmod(p, n)
            take = min(n - offset, count - done)
            within = np.arange(offset, offset + take, dtype=np.uint64)
            out[done : done + take] = self.permutation(epoch).map(within)
            p += take
            done += take
        return out + self.sample_offset

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids (int64) of the stream positions ``positions`` (any shape, order and
        epochs): one permutation call per epoch touched."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and p.min() < 0:
            raise ValueError(f"positions must be >= 0, found {p.min()}.")
        epochs, within = np.divmod(p, self.num_samples)
        if not p.size or epochs.min() == epochs.max():
            ids = self.permutation(int(epochs.flat[0]) if p.size else 0).map(within)
        else:
            ids = np.empty(p.shape, dtype=np.int64)
            for epoch in np.unique(epochs).tolist():  # ascending: each permutation built once
                sel = epochs == epoch
                ids[sel] = self.permutation(epoch).map(within[sel])
        return ids + self.sample_offset

    def step_positions(self, step: int) -> tuple[int, int]:
        """(first position, count) of global step ``step``."""
        if step < self.anchor_step:
            raise ValueError(
                f"step {step} lies before the resume anchor (step {self.anchor_step} at "
                f"position {self.anchor_position}); its positions are not defined under the "
                "current schedule."
            )
        sched = self.schedule
        first = (
            self.anchor_position
            + sched.first_position(step)
            - sched.first_position(self.anchor_step)
        )
        return first, sched.gbs(step)

    def global_ids(self, step: int) -> np.ndarray:
        """Ordered sample ids of the whole global batch of ``step``."""
        return self.ids_for_positions(*self.step_positions(step))

    def rank_positions(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """(first position, count) of DP rank ``dp_rank``'s contiguous slice of ``step``."""
        return rank_slice(*self.step_positions(step), step, dp_rank, dp_degree)

    def rank_ids(self, step: int, dp_rank: int, dp_degree: int) -> np.ndarray:
        """Slice [r*G/D, (r+1)*G/D) of the step's global batch."""
        return self.ids_for_positions(*self.rank_positions(step, dp_rank, dp_degree))

    def rank_stream_ids(
        self, step: int, skip: int, count: int, dp_rank: int, dp_degree: int
    ) -> np.ndarray:
        """Ids ``[skip, skip + count)`` of DP rank ``dp_rank``'s stream from ``step`` on.

        The rank's stream is ``rank_ids(s, dp_rank, dp_degree)`` for s = step, step + 1,
        ... concatenated; this computes a window of it (several steps, possibly across
        epochs) in a few numpy calls instead of one lookup per step, with equal values.
        """
        if skip < 0 or count < 0:
            raise ValueError(f"skip and count must be >= 0, got skip={skip}, count={count}.")
        rows: list[np.ndarray] = []  # positions, one row per step, a few steps per entry
        need, s = skip + count, step
        while need > 0:
            first, per_rank = self.rank_positions(s, dp_rank, dp_degree)
            # Within one schedule entry a rank's slice moves by gbs(s) positions per step.
            steps = -(-need // per_rank)
            end = self.schedule.segment_end(s)
            if end is not None:
                steps = min(steps, end - s)
            starts = first + self.schedule.gbs(s) * np.arange(steps, dtype=np.int64)
            rows.append((starts[:, None] + np.arange(per_rank, dtype=np.int64)).ravel())
            need -= steps * per_rank
            s += steps
        positions = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        return self.ids_at(positions[skip : skip + count])

    def microbatch_ids(
        self, step: int, dp_rank: int, dp_degree: int, local_batch_size: int
    ) -> list[np.ndarray]:
        """The rank slice cut, in order, into micro-batches of ``local_batch_size``."""
        check_batch_layout(self.schedule.gbs(step), dp_degree, local_batch_size)
        ids = self.rank_ids(step, dp_rank, dp_degree)
        return [ids[k : k + local_batch_size] for k in range(0, len(ids), local_batch_size)]
