"""The mixture plan: (source, sample id) of every position and step.

Role: ``MixturePlan`` builds a ``MixtureSpec``'s tables once over the batch
schedule (``Layout.whole_schedule`` of its layout: every step from 1; the walk is
``build.SegmentBuilder``, the tables the rule's, ``rule``) and answers the sources
and sample ids of any positions (positions) in O(positions + sources + 512), the
per-source counts and targets before any step, its worst deviation and the
``max_epochs`` check. ``stream.MixtureStream`` shows it as a stream of sample keys.

Invariants: see the package docstring (``order.mixture``): pure in the spec, the
seed and the batch schedule; every source's ids within one of its epochs are a
permutation of its training samples; the layout's invariants hold (``order.layout``).
Skips (``order.skips``) and left-out samples (``order.exclusions``) move only each
source's stream position (``stream_positions``), never the position assignment: every
step keeps its exact per-source counts.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from torchtitan_zephon.order.exclusions import ExclusionMap, Exclusions
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.build import SegmentBuilder, worst_of
from torchtitan_zephon.order.mixture.config import MixtureError, fraction_text
from torchtitan_zephon.order.mixture.rule import Repeat, Segment
from torchtitan_zephon.order.mixture.spec import (
    MixtureSpec,
    effective_entries,
)
from torchtitan_zephon.order.permutation import map_many
from torchtitan_zephon.order.skips import SkipMap
from torchtitan_zephon.order.stream import DataPlan


def source_seed(seed: int, name: str) -> int:
    """Permutation seed of source ``name``: independent of the other sources."""
    digest = hashlib.blake2b(
        f"zephon-mixture-source-v1:{int(seed)}:{name}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def deviation_warning(worst: Fraction, who: str, step: int) -> str | None:
    """A sentence for a ``MixturePlan.deviation_report`` over one sample, else None."""
    if worst <= 1:
        return None
    return (
        f"mixture source {who!r} ends step {step} {float(worst):.3f} samples "
        f"({fraction_text(worst)}) from its exact target, more than one: from the counts "
        "the earlier steps left, no counts of that step keep every source within one sample "
        "(weight 0 draws nothing, and earlier steps do not depend on later weights). Other "
        f"weights at step {step}, or a change one step earlier or later, may stay within one "
        "sample: `zephon plan --mixture` prints a schedule's worst deviation."
    )


class MixturePlan:
    """(source, sample id) of every position and global step of a mixture (its rank slices
    and micro-batches: ``MixtureStream``, the layout's).

    Built once per job from a ``MixtureSpec``, the seed and the global batch
    schedule (a ``Layout``, when anchored); immutable afterwards (safe to share
    between loader threads). ``schedule`` is the layout's whole schedule: every step
    from 1, as the rule counts their ends.
    """

    def __init__(
        self,
        spec: MixtureSpec,
        seed: int,
        schedule: BatchSchedule | Layout,
        exclusions: Exclusions | None = None,
    ) -> None:
        self.spec = spec
        self.seed = int(seed)
        self.layout = schedule if isinstance(schedule, Layout) else Layout(schedule)
        self.schedule = self.layout.whole_schedule()
        self.names = spec.names
        n = len(self.names)
        self.num_samples = np.array([s.num_samples for s in spec.sources], dtype=np.int64)
        self.max_epochs = [s.max_epochs for s in spec.sources]
        self._limited = any(x is not None for x in self.max_epochs)
        self.source_seeds = [source_seed(self.seed, name) for name in self.names]
        self._streams = [
            DataPlan(int(k), sd, BatchSchedule([(1, 1)]))
            for k, sd in zip(self.num_samples, self.source_seeds, strict=True)
        ]
        order = sorted(range(n), key=lambda i: self.names[i])
        ranks = [0] * n
        for r, i in enumerate(order):
            ranks[i] = r
        builder = SegmentBuilder(self.names, self.schedule)
        counts = np.zeros(n, dtype=np.int64)
        targets = [Fraction(0)] * n
        entries = [e for _, e in effective_entries(spec, 2**63)]
        for k, entry in enumerate(entries):
            end_step = entries[k + 1].from_step if k + 1 < len(entries) else None
            counts, targets = builder.add_entry(entry, end_step, counts, targets, ranks)
        self.segments: list[Segment | Repeat] = builder.segments
        self.corrected_steps = builder.corrected_steps
        self.first_correction: int | None = builder.first_correction
        self._starts = [s.first_position for s in self.segments]
        self.warnings = self._small_source_warnings()
        ranges = self.layout.skip_ranges() if self.layout.skips else []
        self.skip_map: SkipMap | None = (
            SkipMap(
                np.array([self.counts_at_position(q) for q, _ in ranges]),
                np.array([self.counts_at_position(r) for _, r in ranges]),
            )
            if ranges
            else None
        )
        self.exclusion_maps: list[ExclusionMap | None] = [None] * n
        for i, name in enumerate(self.names):
            entries = exclusions.for_source(name) if exclusions else []
            if not entries:
                continue
            starts = np.array(
                [
                    int(self.counts_at_position(self.schedule.first_position(e.from_step))[i])
                    + self._skipped_up_to(e.from_step)[i]
                    for e in entries
                ],
                dtype=np.int64,
            )
            self.exclusion_maps[i] = ExclusionMap(
                int(self.num_samples[i]),
                self.source_seeds[i],
                starts.tolist(),
                [e.ids for e in entries],
                [e.from_step for e in entries],
            )
        self._excluding = any(m is not None for m in self.exclusion_maps)

    def _skipped_up_to(self, step: int) -> np.ndarray:
        """Per source, what the skip entries with S <= ``step`` skip (zeros without):
        with the count before ``step``, the effective position where an entry of
        left-out samples from ``step`` takes effect (``order.exclusions``)."""
        if self.skip_map is None:
            return np.zeros(len(self.names), dtype=np.int64)
        k = sum(1 for s, _ in self.layout.skips.entries if s <= step)
        return self.skip_map.skipped_by_first(k)

    def stream_positions(self, counts: np.ndarray, sources: np.ndarray) -> np.ndarray:
        """Stream positions (int64) of the draws with counts ``counts`` (c_i(p), the
        source's draws before each) of ``sources``: past the skips (``order.skips``),
        then past the left-out samples (``order.exclusions``)."""
        positions = np.asarray(counts, dtype=np.int64)
        src = np.asarray(sources, dtype=np.int64)
        if self.skip_map is not None:
            positions = self.skip_map.shift(positions, src)
        if self._excluding:
            positions = positions.copy()
            for i, m in enumerate(self.exclusion_maps):
                if m is not None:
                    sel = src == i
                    if sel.any():
                        positions[sel] = m.raw(positions[sel])
        return positions

    # ------------------------------------------------------------ accounting

    def _small_source_warnings(self) -> list[str]:
        out = []
        sched = self.schedule.entries
        entries = [e for _, e in effective_entries(self.spec, 2**63)]
        for k, entry in enumerate(entries):
            lo = entry.from_step
            hi = entries[k + 1].from_step if k + 1 < len(entries) else None
            sizes = {g for s, g in sched if (hi is None or s < hi) and s >= lo}
            sizes.add(self.schedule.gbs(lo))
            gbs = max(sizes)
            for i, name in enumerate(self.names):
                w = entry.weights[name]
                share = math.ceil(w * gbs)
                if share > self.num_samples[i]:
                    out.append(
                        f"mixture source {name!r} has {self.num_samples[i]} training "
                        f"samples but weight {fraction_text(w)} of a global batch of {gbs} "
                        f"(schedule entry from_step {lo}) asks up to {share} per step: its "
                        "samples repeat within a step."
                    )
        return out

    def _segment_of(self, position: int) -> Segment | Repeat:
        return self.segments[bisect.bisect_right(self._starts, position) - 1]

    def step_positions(self, step: int) -> tuple[int, int]:
        """(first position, number of positions) of global step ``step``."""
        return self.schedule.first_position(step), self.schedule.gbs(step)

    def counts_at_position(self, position: int) -> np.ndarray:
        """Per-source number of positions among [0, position) (int64, mixture order)."""
        if position < 0:
            raise ValueError(f"slots are >= 0, got {position}.")
        return self._segment_of(position).counts(position)

    def counts_before(self, step: int) -> np.ndarray:
        """Per-source samples drawn (trained) by steps 1 .. step-1 (without skips: each
        source's next stream position, ``stream_positions_before``)."""
        return self.counts_at_position(self.step_positions(step)[0])

    def stream_positions_before(self, step: int) -> np.ndarray:
        """Per-source next stream position at ``step``: the samples steps 1 .. step-1
        drew plus those the skip ranges starting at or before ``step`` skipped (and,
        with left-out samples, the stream position that next draw reads)."""
        counts = self.counts_before(step)
        if self.skip_map is None and not self._excluding:
            return counts
        return self.stream_positions(counts, np.arange(counts.size, dtype=np.int64))

    def step_counts(self, step: int) -> np.ndarray:
        """Per-source samples of step ``step``."""
        first, gbs = self.step_positions(step)
        return self.counts_at_position(first + gbs) - self.counts_at_position(first)

    def targets_before(self, step: int) -> list[Fraction]:
        """Exact per-source targets ``sum over steps < step of w x GBS``."""
        position = self.step_positions(step)[0]
        seg = self._segment_of(position)
        return [
            t + w * (position - seg.first_position)
            for t, w in zip(seg.start_targets, seg.weights, strict=True)
        ]

    def epochs(self, step: int) -> np.ndarray:
        """Per-source epoch of the next sample each source draws at ``step``."""
        return self.stream_positions_before(step) // self.num_samples

    def max_deviation(self) -> tuple[Fraction, str]:
        """(worst |count - target| over the end of every step of the infinite
        stream, its source). Exact. Below 1 for a single schedule entry."""
        worst, who, _ = self.deviation_report()
        return worst, who

    def deviation_report(self) -> tuple[Fraction, str, int]:
        """``max_deviation`` and the first step whose end reaches it."""
        worst, who, when = Fraction(0), self.names[0], 1
        for seg in self.segments:
            if isinstance(seg, Repeat):  # the same deviations as its block, earlier
                continue
            for i, w in enumerate(seg.weights):  # sources of weight 0 keep their residual
                r = abs(seg.start_targets[i] - int(seg.start_counts[i]))
                if w == 0 and r > worst:
                    worst, who, when = r, self.names[i], seg.first_step
            if seg.report is None:
                steps, positions = seg.step_ends(self.schedule)
                seg.report = worst_of(steps, *seg.deviations(positions))
            value, source, step = seg.report
            if value > worst:
                worst, who, when = value, self.names[source], step
        return worst, who, when

    def check_max_epochs(self, last_step: int) -> None:
        """Raise MixtureError if steps 1..``last_step`` run a source past its max_epochs."""
        total = self._reach(last_step + 1)
        for i, limit in enumerate(self.max_epochs):
            if limit is None or total[i] <= limit * self.num_samples[i]:
                continue
            lo, hi = 1, last_step  # first step whose end exceeds the limit
            while lo < hi:
                mid = (lo + hi) // 2
                if self._reach(mid + 1)[i] > limit * self.num_samples[i]:
                    hi = mid
                else:
                    lo = mid + 1
            raise self._epoch_error(i, lo)

    def _reach(self, step: int) -> np.ndarray:
        """Per source, one past the stream position of its last draw before ``step``
        (its draws before it, without skips)."""
        counts = self.counts_before(step)
        if self.skip_map is None and not self._excluding:
            return counts
        last = self.stream_positions(np.maximum(counts - 1, 0), np.arange(counts.size))
        return np.where(counts > 0, last + 1, 0)

    def _epoch_error(self, i: int, step: int | None) -> MixtureError:
        limit, n = self.max_epochs[i], int(self.num_samples[i])
        when = "" if step is None else f" at step {step}"
        return MixtureError(
            f"mixture source {self.names[i]!r} runs past max_epochs={limit}{when}: it has {n} "
            f"training samples and its share of the steps so far needs more than {limit * n}. "
            "Raise its max_epochs, lower its weight, train fewer steps or add data."
        )

    # ------------------------------------------------------------ sample ids

    def position_sources(self, first: int, count: int) -> np.ndarray:
        """Source index (int64) of each position in [first, first + count)."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            position = first + done
            k = bisect.bisect_right(self._starts, position) - 1
            seg = self.segments[k]
            stop = (
                first + count if seg.end_position is None else min(first + count, seg.end_position)
            )
            out[done : done + stop - position] = seg.sources(position, stop - position)
            done += stop - position
        return out

    def ids_for_positions(
        self, first: int, count: int, *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) arrays (int64) of positions [first, first + count)."""
        return self.ids_for_ranges([(first, count)], step=step)

    def ids_for_ranges(
        self, ranges: Sequence[tuple[int, int]], *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) of the positions of ``ranges`` ([first, first + count)
        each), concatenated in order: a window of a DP rank's stream across steps.

        Each position's source comes from its segment's pattern, its position in that
        source's stream from the counts before its range; the ids are then looked up
        with one permutation call per source and epoch for the whole window.
        """
        sources, positions = self.source_positions(ranges)
        if not sources.size:
            return sources, positions
        return sources, self._stream_ids(sources, positions, step)

    def source_positions(self, ranges: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(source index, position in that source's stream) of the positions of ``ranges``,
        concatenated in order; positions are past the skips and the left-out samples
        (a source's epoch is its position // its num_samples)."""
        merged: list[tuple[int, int]] = []
        for first, count in ranges:  # adjacent ranges (one DP rank of one) as one
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + count)
            elif count:
                merged.append((first, count))
        sources_parts, positions_parts = [], []
        for first, count in merged:
            src = self.position_sources(first, count)
            order = np.argsort(src, kind="stable")  # each source's positions, in position order
            sorted_src = src[order]
            starts = np.searchsorted(sorted_src, sorted_src, side="left")
            occurrence = np.empty(count, dtype=np.int64)
            occurrence[order] = np.arange(count, dtype=np.int64) - starts
            sources_parts.append(src)
            positions_parts.append(self.counts_at_position(first)[src] + occurrence)
        if not sources_parts:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        sources = np.concatenate(sources_parts)
        positions = np.concatenate(positions_parts)
        if self.skip_map is not None or self._excluding:  # past skips and left-out samples
            positions = self.stream_positions(positions, sources)
        return sources, positions

    def _stream_ids(
        self, sources: np.ndarray, positions: np.ndarray, step: int | None
    ) -> np.ndarray:
        """Sample ids of stream ``positions`` of ``sources``: the (source, epoch)
        permutations evaluated together (``map_many``), each built once per call."""
        epochs, within = np.divmod(positions, self.num_samples[sources])
        stride = int(epochs.max()) + 1 if epochs.size else 1
        if (len(self.names) + 1) * stride < 1 << 62:  # (source, epoch) as one int64
            codes, which = np.unique(sources * stride + epochs, return_inverse=True)
            first, second = np.divmod(codes, stride)
        else:
            (first, second), which = np.unique(
                np.stack([sources, epochs]), axis=1, return_inverse=True
            )
        pairs = list(zip(first.tolist(), second.tolist(), strict=True))
        if self._limited:
            for i, epoch in pairs:
                limit = self.max_epochs[i]
                if limit is not None and epoch >= limit:
                    raise self._epoch_error(i, step)
        streams = self._streams
        perms = [streams[i].permutation(epoch) for i, epoch in pairs]
        return map_many(perms, which.ravel(), within)

    def global_ids(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) of every position of global step ``step``, in order."""
        first, gbs = self.step_positions(step)
        return self.ids_for_positions(first, gbs, step=step)
