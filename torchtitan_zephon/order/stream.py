"""Streams: the sample keys of every position, step, rank slice and micro-batch.

Role: a *stream* is the global sequence of positions 0, 1, 2, ..., each holding
one sample. ``StreamPlan`` is what every stream offers (keys per position, step,
rank slice and micro-batch, and a range of a rank's stream): one implementation,
a ``order.layout.Layout`` (which positions) composed with the stream's own map from
positions to keys (``ids_for_positions``, ``_range_keys``). ``DataPlan`` is the
stream of one store; a mixture's is ``order.mixture.stream.MixtureStream``. Streams
name samples by **sample keys**: int64 values ``source << SOURCE_SHIFT | id``
(``make_keys`` / ``split_keys``); for one store the key is the sample id. Every
stream also answers, whatever the data's kind, what the readers of a plan ask of its
sources (``names``): the accounting (``step_draws``, ``epochs_of_draws``), ``zephon
where``'s way back from a sample to its position (``source_shape``, ``place_of_draw``) and
a mixture's guards (``check_max_epochs``, ``deviation_report``: nothing for one store),
so nobody outside ``order`` asks which kind a plan is.

Invariants:
- Position p of a ``DataPlan`` reads stream position ``q = p`` plus what the skip
  ranges before p skipped (``order.skips``; q = p without skips), which is sample
  ``sample_offset + Permutation(num_samples, seed, q // num_samples)[q %
  num_samples]``, so every sample appears at most once per epoch (exactly once
  without skips) and epochs are reshuffled. With left-out samples
  (``order.exclusions``) that skip-mapped position is an effective position, mapped
  past the left-out samples to the stream position q first.
- A stream's keys of a step, rank slice, micro-batch or range are its keys of the
  positions its ``Layout`` gives them, so the layout's invariants (rank slices
  concatenate to the step, micro-batches to the slice, a range of a rank's stream
  equals its per-step slices concatenated) hold for every stream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from torchtitan_zephon.order.exclusions import ExcludeEntry, ExclusionMap
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.permutation import Permutation
from torchtitan_zephon.order.skips import SkipMap, SkipSteps

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


STORE_NAME = "store"
"""The source name of a plan of one store, where sources are named (the accounting's
``zephon/source/store/...``)."""


@dataclass(frozen=True)
class SourceShape:
    """One source's stream as the way back from a sample to its position needs it."""

    first_id: int  # the first training id
    num_samples: int  # training samples
    seed: int  # its permutation's seed
    max_epochs: int | None
    skip_map: SkipMap | None
    exclusion_map: ExclusionMap | None


@dataclass(frozen=True)
class StepDraws:
    """What steps 1..s drew from each source (source-index order): ``samples``, the
    samples of step s; ``cumulative``, those of steps 1..s; ``targets``, the exact
    targets of steps 1..s (one store: the cumulative count itself)."""

    samples: np.ndarray
    cumulative: np.ndarray
    targets: list[Fraction]


class StreamPlan(ABC):
    """Sample keys of every step, rank slice, micro-batch and range of a rank's stream:
    ``layout``'s positions, mapped to keys by the stream (``ids_for_positions`` for one
    range, ``_range_keys`` for many, both vectorized)."""

    layout: Layout
    names: list[str]
    """The sources' names in source-index order (one store: ``[STORE_NAME]``)."""

    @abstractmethod
    def ids_for_positions(self, first: int, count: int) -> np.ndarray:
        """Keys (int64) of positions [first, first + count)."""

    @abstractmethod
    def positions_of(self, first: int, count: int) -> np.ndarray:
        """The stream position (int64) each of the layout's places [first, first + count)
        reads, in its source's stream: past the skips and the left-out samples."""

    def _keys(self, first: int, count: int, step: int) -> np.ndarray:
        """Keys of positions [first, first + count) of step ``step`` (named in errors)."""
        return self.ids_for_positions(first, count)

    @abstractmethod
    def step_draws(self, step: int) -> StepDraws:
        """Per source: the samples of step ``step``, of steps 1..step and their exact
        targets; O(sources), from the plan's counts (never the step's ids)."""

    @abstractmethod
    def epochs_of_draws(self, drawn: np.ndarray) -> np.ndarray:
        """Per source, the epoch of its ``drawn[i]``-th trained sample (0 if none)."""

    @abstractmethod
    def source_shape(self, source: int) -> SourceShape:
        """Source ``source``'s stream as the way back from a sample needs it."""

    @abstractmethod
    def place_of_draw(self, source: int, draw: int) -> tuple[int, int] | str:
        """(step, index in the step) of the position that reads source ``source``'s
        ``draw``-th trained sample (0-based), or why no position of this plan does:
        ``"trained"`` (before the plan's anchor: trained under its earlier counting) or
        ``"not drawn"`` (no step up to ``MAX_STEP`` draws it)."""

    @abstractmethod
    def check_max_epochs(self, last_step: int) -> None:
        """Refuse a plan that draws a source past its ``max_epochs`` by ``last_step``
        (a mixture's guard; one store has none)."""

    @abstractmethod
    def deviation_report(self) -> tuple[Fraction, str, int] | None:
        """(worst deviation of a source's count from its exact target over every step,
        that source, the step), for a mixture's weights; None for one store, whose count
        is its target at every step."""

    @abstractmethod
    def _range_keys(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Keys of the position ranges ``[starts[k], starts[k] + counts[k])``, concatenated."""

    @property
    def schedule(self) -> BatchSchedule:
        return self.layout.schedule

    @property
    def anchor_step(self) -> int:
        return self.layout.anchor_step

    @property
    def anchor_position(self) -> int:
        return self.layout.anchor_position

    def step_positions(self, step: int) -> tuple[int, int]:
        """(first position, count) of global step ``step``."""
        return self.layout.step_positions(step)

    def global_ids(self, step: int) -> np.ndarray:
        """Ordered keys of the whole global batch of ``step``."""
        return self._keys(*self.step_positions(step), step)

    def rank_positions(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """(first position, count) of DP rank ``dp_rank``'s contiguous slice of ``step``."""
        return self.layout.rank_positions(step, dp_rank, dp_degree)

    def rank_ids(self, step: int, dp_rank: int, dp_degree: int) -> np.ndarray:
        """Slice [r*G/D, (r+1)*G/D) of the step's global batch."""
        return self._keys(*self.rank_positions(step, dp_rank, dp_degree), step)

    def rank_stream_ids(
        self, step: int, skip: int, count: int, dp_rank: int, dp_degree: int
    ) -> np.ndarray:
        """Keys ``[skip, skip + count)`` of DP rank ``dp_rank``'s stream from ``step`` on.

        The rank's stream is ``rank_ids(s, dp_rank, dp_degree)`` for s = step, step + 1,
        ... concatenated; this computes a range of it (several steps, possibly across
        epochs) in a few numpy calls instead of one lookup per step, with equal values.
        """
        return self._range_keys(*self.layout.rank_ranges(step, skip, count, dp_rank, dp_degree))

    def microbatch_ids(
        self, step: int, dp_rank: int, dp_degree: int, local_batch_size: int
    ) -> list[np.ndarray]:
        """The rank slice cut, in order, into micro-batches of ``local_batch_size``."""
        cuts = self.layout.microbatch_positions(step, dp_rank, dp_degree, local_batch_size)
        first = cuts[0][0]  # the rank slice, from its first micro-batch to its last
        keys = self._keys(first, cuts[-1][0] + cuts[-1][1] - first, step)
        return [keys[p - first : p - first + n] for p, n in cuts]

    def part_microbatch_ids(
        self,
        step: int,
        part: int,
        parts: int,
        inner_rank: int,
        inner_degree: int,
        b: int,
        multiple_of: int = 1,
    ) -> list[np.ndarray]:
        """The micro-batches of inner DP rank ``inner_rank`` in part ``part`` of ``parts``
        of ``step`` (torchft, each part a multiple of ``multiple_of`` samples;
        ``Layout.part_microbatch_positions``), in order."""
        cuts = self.layout.part_microbatch_positions(
            step, part, parts, inner_rank, inner_degree, b, multiple_of
        )
        first = cuts[0][0]
        keys = self._keys(first, cuts[-1][0] + cuts[-1][1] - first, step)
        return [keys[p - first : p - first + n] for p, n in cuts]


class DataPlan(StreamPlan):
    """Sample ids of every global step, rank slice and micro-batch of one store (its one
    source, named ``STORE_NAME``).

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
        skips: SkipSteps | None = None,
        exclusions: Sequence[ExcludeEntry] = (),
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
        self.names = [STORE_NAME]
        self.layout = Layout(schedule, (anchor_step, anchor_position), skips)
        self.sample_offset = int(sample_offset)
        self._permutation: Permutation | None = None
        ranges = self.layout.skip_ranges() if self.layout.skips else []
        self.skip_map: SkipMap | None = (
            SkipMap(np.array([q for q, _ in ranges]), np.array([r for _, r in ranges]))
            if ranges
            else None
        )
        self.exclusion_map: ExclusionMap | None = None
        if exclusions:  # thresholds: the effective position of each entry's first step
            whole = self.layout.whole_schedule()
            starts = np.array([whole.first_position(e.from_step) for e in exclusions])
            if self.skip_map is not None:  # past the skip entries with S <= from_step
                k = [
                    sum(1 for s, _ in self.layout.skips.entries if s <= e.from_step)
                    for e in exclusions
                ]
                starts = starts + np.array([self.skip_map.skipped_by_first(j)[0] for j in k])
            self.exclusion_map = ExclusionMap(
                self.num_samples,
                self.seed,
                starts.tolist(),
                [e.ids - self.sample_offset for e in exclusions],
                [e.from_step for e in exclusions],
            )

    def step_draws(self, step: int) -> StepDraws:
        first, count = self.step_positions(step)
        return StepDraws(
            np.array([count], dtype=np.int64),
            np.array([first + count], dtype=np.int64),
            [Fraction(first + count)],
        )

    def epochs_of_draws(self, drawn: np.ndarray) -> np.ndarray:
        """The epoch of the last of the first ``drawn[0]`` positions' samples (0 if none)."""
        count = int(np.asarray(drawn).ravel()[0])
        if count <= 0:
            return np.zeros(1, dtype=np.int64)
        return self.stream_positions(np.array([count - 1], dtype=np.int64)) // self.num_samples

    def check_max_epochs(self, last_step: int) -> None:
        return None  # one store: no max_epochs

    def deviation_report(self) -> None:
        return None  # one store: its count is its target at every step

    def source_shape(self, source: int) -> SourceShape:
        return SourceShape(
            self.sample_offset, self.num_samples, self.seed, None, self.skip_map, self.exclusion_map
        )

    def place_of_draw(self, source: int, draw: int) -> tuple[int, int] | str:
        """The layout's position ``draw`` as (step, index in the step); "trained" before
        the anchor."""
        layout = self.layout
        if draw < layout.anchor_position:
            return "trained"
        lo = hi = layout.anchor_step
        while sum(layout.step_positions(hi)) <= draw:
            hi = lo + 2 * (hi - lo) + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(layout.step_positions(mid)) > draw:
                hi = mid
            else:
                lo = mid + 1
        return lo, draw - layout.step_positions(lo)[0]

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
        if self.skip_map is not None or self.exclusion_map is not None:
            return self.ids_at(first + np.arange(count, dtype=np.int64))
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

    def positions_of(self, first: int, count: int) -> np.ndarray:
        return self.stream_positions(first + np.arange(count, dtype=np.int64))

    def stream_positions(self, positions: np.ndarray) -> np.ndarray:
        """Stream positions (int64; epoch ``q // num_samples``) of the training positions
        ``positions``: past the skips (``order.skips``), then past the left-out samples
        (``order.exclusions``)."""
        p = np.asarray(positions, dtype=np.int64)
        if self.skip_map is not None:
            p = self.skip_map.shift(p)
        if self.exclusion_map is not None:
            p = self.exclusion_map.raw(p)
        return p

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids (int64) of the positions ``positions`` (any shape, order and
        epochs), past the skip ranges: one permutation call per epoch touched."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and p.min() < 0:
            raise ValueError(f"positions must be >= 0, found {p.min()}.")
        p = self.stream_positions(p)
        epochs, within = np.divmod(p, self.num_samples)
        if not p.size or epochs.min() == epochs.max():
            ids = self.permutation(int(epochs.flat[0]) if p.size else 0).map(within)
        else:
            ids = np.empty(p.shape, dtype=np.int64)
            for epoch in np.unique(epochs).tolist():  # ascending: each permutation built once
                sel = epochs == epoch
                ids[sel] = self.permutation(epoch).map(within[sel])
        return ids + self.sample_offset

    def _range_keys(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        if len(starts) == 1:
            positions = starts[0] + np.arange(counts[0], dtype=np.int64)
        else:  # range k's positions, each at its offset in the range
            offsets = np.cumsum(counts) - counts
            positions = np.repeat(starts - offsets, counts) + np.arange(
                int(counts.sum()), dtype=np.int64
            )
        return self.ids_at(positions)
