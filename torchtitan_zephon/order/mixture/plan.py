"""The mixture plan: (source, sample id) of every slot and step; the mixture's stream.

Role: ``MixturePlan`` walks a ``MixtureSpec``'s weight entries once over the
batch schedule (``Layout.whole_schedule`` of its layout: every step from 1),
building the rule's tables (``rule``), and answers the sources and sample ids of
any slots (positions) in O(slots + sources + 512); ``MixtureStream`` shows it as
a ``StreamPlan`` of sample keys (``order.stream``): its steps, rank slices,
micro-batches and windows are the layout's (``order.layout``), as for one store.

Invariants: see the package docstring (``order.mixture``): pure in the spec, the
seed and the batch schedule; every source's ids within one of its epochs are a
permutation of its training samples; the layout's invariants hold (``order.layout``).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.config import (
    MixtureError,
    WeightEntry,
    fraction_text,
)
from torchtitan_zephon.order.mixture.rule import (
    Pattern,
    Repeat,
    Segment,
    least_worst_counts,
    simulate,
    spread,
)
from torchtitan_zephon.order.mixture.spec import (
    MixtureSpec,
    effective_entries,
)
from torchtitan_zephon.order.permutation import map_many
from torchtitan_zephon.order.stream import DataPlan, StreamPlan, make_keys, split_keys

_MAX_CORRECTIONS = 4096
"""Corrected steps per weight entry before their residuals recur (steps inside
a ``Repeat`` are not counted): bounds the plan's build time; past it, the
earliest-deadline pattern alone. Counted in step order, so pure."""
_PROBE_STEPS = 16  # steps simulated first after a correction, before a whole pattern


def source_seed(seed: int, name: str) -> int:
    """Permutation seed of source ``name``: independent of the other sources."""
    digest = hashlib.blake2b(
        f"zephon-mixture-source-v1:{int(seed)}:{name}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def _worst_of(
    steps: np.ndarray, worst: np.ndarray, who: np.ndarray, scale: int
) -> tuple[Fraction, int, int]:
    """(largest deviation, its source, its first step) of ``Segment.deviations``."""
    if not steps.size:
        return Fraction(0), 0, 1
    top = worst.max()
    k = int(np.flatnonzero(worst == top)[np.argmin(steps[worst == top])])
    return Fraction(int(top), scale), int(who[k]), int(steps[k])


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
    """(source, sample id) of every slot and global step of a mixture (its rank slices
    and micro-batches: ``MixtureStream``, the layout's).

    Built once per job from a ``MixtureSpec``, the seed and the global batch
    schedule (a ``Layout``, when anchored); immutable afterwards (safe to share
    between loader threads). ``schedule`` is the layout's whole schedule: every step
    from 1, as the rule counts their ends.
    """

    def __init__(self, spec: MixtureSpec, seed: int, schedule: BatchSchedule | Layout) -> None:
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
        self.segments: list[Segment | Repeat] = []
        self.corrected_steps = 0
        self.first_correction: int | None = None
        counts = np.zeros(n, dtype=np.int64)
        targets = [Fraction(0)] * n
        entries = [e for _, e in effective_entries(spec, 2**63)]
        for k, entry in enumerate(entries):
            end_step = entries[k + 1].from_step if k + 1 < len(entries) else None
            counts, targets = self._build_entry(entry, end_step, counts, targets, ranks)
        self._starts = [s.first_slot for s in self.segments]
        self.warnings = self._small_source_warnings()

    def _build_entry(
        self,
        entry: WeightEntry,
        end_step: int | None,
        counts: np.ndarray,
        targets: list[Fraction],
        ranks: list[int],
    ) -> tuple[np.ndarray, list[Fraction]]:
        """Append the segments of steps [entry.from_step, end_step); return the
        per-source counts and targets at ``end_step``.

        Earliest deadline first from the residuals the entry inherits, cut at the
        first step whose end would leave a source of weight > 0 more than one
        sample from its target; that step takes ``least_worst_counts`` instead
        and the pattern restarts after it. When the residuals after a corrected
        step repeat those after an earlier one under the same batch size, the
        steps from there on repeat those between (the state is the same), up to
        the next batch-size change: one ``Repeat`` holds them, and its last
        repetition may be partial, so a later entry cuts it without changing
        any step before.
        """
        schedule = self.schedule
        n = len(self.names)
        weights = [entry.weights[name] for name in self.names]
        end = None if end_step is None else schedule.first_position(end_step)
        starts = [s for s, _ in schedule.entries]
        step, corrections = entry.from_step, 0
        seen: dict[tuple[Any, ...], tuple[int, int, np.ndarray]] = {}
        while True:
            first = schedule.first_position(step)
            residual = [t - int(c) for t, c in zip(targets, counts, strict=True)]
            seg, bad, chosen = self._pattern_until_bad(
                weights, residual, ranks, step, end_step, counts, targets, corrections
            )
            if seg.end_slot is None or seg.end_slot > seg.first_slot:
                self.segments.append(seg)
            if bad is None or chosen is None:
                if end is None:
                    return counts, targets
                return seg.counts(end), [
                    t + w * (end - first) for t, w in zip(targets, weights, strict=True)
                ]
            # step `bad` takes the counts with the least worst deviation instead
            cut, gbs = schedule.first_position(bad), schedule.gbs(bad)
            counts = seg.counts(cut)
            targets = [t + w * (cut - first) for t, w in zip(targets, weights, strict=True)]
            after = [t + w * gbs for t, w in zip(targets, weights, strict=True)]
            active = seg.pattern.active
            where = np.zeros(n, dtype=np.int64)
            where[active] = np.arange(len(active))
            order = where[spread(chosen, ranks)].astype(seg.pattern.local.dtype)
            fixed = Segment(
                weights, bad, bad + 1, cut, cut + gbs, counts, targets,
                Pattern(active, order, gbs, 0),
            )  # fmt: skip
            ends = [
                (abs(t - int(c) - k), i)
                for i, (t, c, k) in enumerate(zip(after, counts, chosen, strict=True))
            ]
            top = max(d for d, i in ends if weights[i] > 0)
            fixed.report = (top, next(i for d, i in ends if weights[i] > 0 and d == top), bad)
            self.segments.append(fixed)
            self.corrected_steps += 1
            if self.first_correction is None:
                self.first_correction = bad
            corrections += 1
            counts = counts + np.array(chosen, dtype=np.int64)
            targets, step = after, bad + 1
            if end_step is not None and step >= end_step:
                return counts, targets
            # the same residuals under the same batch size: the steps since repeat
            region = bisect.bisect_right(starts, step) - 1
            key = (region, *(t - int(c) for t, c in zip(targets, counts, strict=True)))
            if key not in seen:
                seen[key] = (len(self.segments), step, counts)
                continue
            index, step0, counts0 = seen[key]
            limit = starts[region + 1] if region + 1 < len(starts) else None
            if end_step is not None:
                limit = end_step if limit is None else min(limit, end_step)
            block = self.segments[index:]
            rep = Repeat(
                weights, step, limit, schedule.first_position(step), counts, targets,
                block, schedule.first_position(step0), counts - counts0, step - step0,
            )  # fmt: skip
            self.segments.append(rep)
            if limit is None:
                return counts, targets
            last = schedule.first_position(limit)
            counts = rep.counts(last)
            targets = [
                t + w * (last - rep.first_slot) for t, w in zip(targets, weights, strict=True)
            ]
            step = limit
            seen.clear()
            if end_step is not None and step >= end_step:
                return counts, targets

    def _pattern_until_bad(
        self,
        weights: list[Fraction],
        residual: list[Fraction],
        ranks: list[int],
        step: int,
        end_step: int | None,
        counts: np.ndarray,
        targets: list[Fraction],
        corrections: int,
    ) -> tuple[Segment, int | None, list[int] | None]:
        """The earliest-deadline segment from ``step`` with these residuals, cut at
        the first step it would end more than one sample off where other counts do
        better; that step and those counts (None, None if none or no correction is
        allowed). A short probe of the next steps comes first: right after a
        correction the next miss is often close."""
        schedule = self.schedule
        first = schedule.first_position(step)
        end = None if end_step is None else schedule.first_position(end_step)
        period = math.lcm(*(w.denominator for w in weights))
        probe_step = step + _PROBE_STEPS if end_step is None else min(end_step, step + _PROBE_STEPS)
        probe = schedule.first_position(probe_step) - first
        tries = [(probe_step, probe)] if probe < period and probe_step != end_step else []
        for last_step, length in [*tries, (end_step, None if end is None else end - first)]:
            active, local, prefix, cycle = simulate(weights, residual, ranks, length)
            seg = Segment(
                weights, step, last_step, first, None if length is None else first + length,
                counts, targets, Pattern(active, local, prefix, cycle),
            )  # fmt: skip
            if corrections >= _MAX_CORRECTIONS or len(active) < 2:
                if last_step == end_step:
                    return seg, None, None
                continue
            steps, positions = seg.step_ends(schedule)
            worst, who, scale = seg.deviations(positions)
            bad = chosen = None
            for k in np.flatnonzero(worst > scale)[np.argsort(steps[worst > scale])]:
                chosen = self._better_counts(
                    seg, int(steps[k]), Fraction(int(worst[k]), scale), ranks
                )
                if chosen is not None:
                    bad = int(steps[k])
                    break
            if bad is not None:
                seg.end_step, seg.end_slot = bad, schedule.first_position(bad)
                keep = steps < bad
                steps, worst, who = steps[keep], worst[keep], who[keep]
            seg.report = _worst_of(steps, worst, who, scale)
            if bad is not None or last_step == end_step:
                return seg, bad, chosen
        return seg, None, None

    def _better_counts(
        self, seg: Segment, step: int, worst: Fraction, ranks: list[int]
    ) -> list[int] | None:
        """``least_worst_counts`` of ``step`` (in ``seg``) if they end it closer than
        the pattern's ``worst`` (the sources of weight > 0), else None."""
        slot, gbs = self.schedule.first_position(step), self.schedule.gbs(step)
        counts = seg.counts(slot)
        after = [
            t + w * (slot - seg.first_slot + gbs)
            for t, w in zip(seg.start_targets, seg.weights, strict=True)
        ]
        deficit = [t - int(c) for t, c in zip(after, counts, strict=True)]
        chosen = least_worst_counts(deficit, seg.weights, gbs, ranks)
        best = max(
            abs(d - k) for d, k, w in zip(deficit, chosen, seg.weights, strict=True) if w > 0
        )
        return chosen if best < worst else None

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

    def _segment_of(self, slot: int) -> Segment | Repeat:
        return self.segments[bisect.bisect_right(self._starts, slot) - 1]

    def step_slots(self, step: int) -> tuple[int, int]:
        """(first slot, number of slots) of global step ``step``."""
        return self.schedule.first_position(step), self.schedule.gbs(step)

    def counts_at_slot(self, slot: int) -> np.ndarray:
        """Per-source number of slots among [0, slot) (int64, mixture order)."""
        if slot < 0:
            raise ValueError(f"slots are >= 0, got {slot}.")
        return self._segment_of(slot).counts(slot)

    def counts_before(self, step: int) -> np.ndarray:
        """Per-source samples drawn by steps 1 .. step-1 (each source's next stream position)."""
        return self.counts_at_slot(self.step_slots(step)[0])

    def step_counts(self, step: int) -> np.ndarray:
        """Per-source samples of step ``step``."""
        first, gbs = self.step_slots(step)
        return self.counts_at_slot(first + gbs) - self.counts_at_slot(first)

    def targets_before(self, step: int) -> list[Fraction]:
        """Exact per-source targets ``sum over steps < step of w x GBS``."""
        slot = self.step_slots(step)[0]
        seg = self._segment_of(slot)
        return [
            t + w * (slot - seg.first_slot)
            for t, w in zip(seg.start_targets, seg.weights, strict=True)
        ]

    def epochs(self, step: int) -> np.ndarray:
        """Per-source epoch of the next sample each source draws at ``step``."""
        return self.counts_before(step) // self.num_samples

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
                seg.report = _worst_of(steps, *seg.deviations(positions))
            value, source, step = seg.report
            if value > worst:
                worst, who, when = value, self.names[source], step
        return worst, who, when

    def check_max_epochs(self, last_step: int) -> None:
        """Raise MixtureError if steps 1..``last_step`` run a source past its max_epochs."""
        total = self.counts_before(last_step + 1)
        for i, limit in enumerate(self.max_epochs):
            if limit is None or total[i] <= limit * self.num_samples[i]:
                continue
            lo, hi = 1, last_step  # first step whose end exceeds the limit
            while lo < hi:
                mid = (lo + hi) // 2
                if self.counts_before(mid + 1)[i] > limit * self.num_samples[i]:
                    hi = mid
                else:
                    lo = mid + 1
            raise self._epoch_error(i, lo)

    def _epoch_error(self, i: int, step: int | None) -> MixtureError:
        limit, n = self.max_epochs[i], int(self.num_samples[i])
        when = "" if step is None else f" at step {step}"
        return MixtureError(
            f"mixture source {self.names[i]!r} runs past max_epochs={limit}{when}: it has {n} "
            f"training samples and its share of the steps so far needs more than {limit * n}. "
            "Raise its max_epochs, lower its weight, train fewer steps or add data."
        )

    # ------------------------------------------------------------ sample ids

    def slot_sources(self, first: int, count: int) -> np.ndarray:
        """Source index (int64) of each slot in [first, first + count)."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            slot = first + done
            k = bisect.bisect_right(self._starts, slot) - 1
            seg = self.segments[k]
            stop = first + count if seg.end_slot is None else min(first + count, seg.end_slot)
            out[done : done + stop - slot] = seg.sources(slot, stop - slot)
            done += stop - slot
        return out

    def ids_for_slots(
        self, first: int, count: int, *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) arrays (int64) of slots [first, first + count)."""
        return self.ids_for_ranges([(first, count)], step=step)

    def ids_for_ranges(
        self, ranges: Sequence[tuple[int, int]], *, step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample id) of the slots of ``ranges`` ([first, first + count)
        each), concatenated in order: a window of a DP rank's stream across steps.

        Each slot's source comes from its segment's pattern, its position in that
        source's stream from the counts before its range; the ids are then looked up
        with one permutation call per source and epoch for the whole window.
        """
        merged: list[tuple[int, int]] = []
        for first, count in ranges:  # adjacent ranges (one DP rank of one) as one
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + count)
            elif count:
                merged.append((first, count))
        sources_parts, positions_parts = [], []
        for first, count in merged:
            src = self.slot_sources(first, count)
            order = np.argsort(src, kind="stable")  # each source's slots, in slot order
            sorted_src = src[order]
            starts = np.searchsorted(sorted_src, sorted_src, side="left")
            occurrence = np.empty(count, dtype=np.int64)
            occurrence[order] = np.arange(count, dtype=np.int64) - starts
            sources_parts.append(src)
            positions_parts.append(self.counts_at_slot(first)[src] + occurrence)
        if not sources_parts:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        sources = np.concatenate(sources_parts)
        positions = np.concatenate(positions_parts)
        return sources, self._stream_ids(sources, positions, step)

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
        """(source index, sample id) of every slot of global step ``step``, in order."""
        first, gbs = self.step_slots(step)
        return self.ids_for_slots(first, gbs, step=step)


class MixtureStream(StreamPlan):
    """A ``MixturePlan`` as a stream of sample keys, over the plan's layout."""

    def __init__(self, mixture: MixturePlan) -> None:
        self.mixture = mixture
        self.layout = mixture.layout
        self.names = mixture.names

    def ids_for_positions(self, first: int, count: int) -> np.ndarray:
        return make_keys(*self.mixture.ids_for_slots(first, count))

    def _keys(self, first: int, count: int, step: int) -> np.ndarray:
        return make_keys(*self.mixture.ids_for_slots(first, count, step=step))

    def _window_keys(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """One permutation call per source and epoch for the whole window."""
        ranges = list(zip(starts.tolist(), counts.tolist(), strict=True))
        return make_keys(*self.mixture.ids_for_ranges(ranges))

    def decode(self, keys: np.ndarray) -> tuple[list[str], np.ndarray]:
        """(source name, per-source sample id) of each key."""
        sources, ids = split_keys(keys)
        return [self.names[i] for i in sources.tolist()], ids
