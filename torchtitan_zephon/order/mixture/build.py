"""The build of a mixture plan: its segments, walked once over the weight entries.

Role: ``SegmentBuilder`` walks a mixture's weight entries in step order over the
whole batch schedule (every step from 1) and appends the rule's segments
(``rule.Segment``, ``rule.Repeat``): earliest deadline first from the residuals an
entry inherits, cut at the first step whose end would leave a source of weight > 0
more than one sample off, which takes ``rule.least_worst_counts`` instead when they
do better; when the residuals after a corrected step recur, the steps between
repeat as one block. ``MixturePlan`` (``plan``) keeps what it built.

Invariant: pure and built in step order: the segments up to step k depend only on
the weights, the batch sizes of steps 1..k and the source names (at most
``_MAX_CORRECTIONS`` corrected steps per weight entry, counted in step order), so
every rank builds the same tables.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction
from typing import Any

import numpy as np

from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import WeightEntry
from torchtitan_zephon.order.mixture.rule import (
    Pattern,
    Repeat,
    Segment,
    least_worst_counts,
    simulate,
    spread,
)

_MAX_CORRECTIONS = 4096
"""Corrected steps per weight entry before their residuals recur (steps inside
a ``Repeat`` are not counted): bounds the plan's build time; past it, the
earliest-deadline pattern alone. Counted in step order, so pure."""
_PROBE_STEPS = 16  # steps simulated first after a correction, before a whole pattern


def worst_of(
    steps: np.ndarray, worst: np.ndarray, who: np.ndarray, scale: int
) -> tuple[Fraction, int, int]:
    """(largest deviation, its source, its first step) of ``Segment.deviations``."""
    if not steps.size:
        return Fraction(0), 0, 1
    top = worst.max()
    k = int(np.flatnonzero(worst == top)[np.argmin(steps[worst == top])])
    return Fraction(int(top), scale), int(who[k]), int(steps[k])


class SegmentBuilder:
    """The segments of a mixture's weight entries over ``schedule`` (every step from
    1), appended entry by entry (``add_entry``), with the steps it corrected."""

    def __init__(self, names: list[str], schedule: BatchSchedule) -> None:
        self.names = names
        self.schedule = schedule
        self.segments: list[Segment | Repeat] = []
        self.corrected_steps = 0
        self.first_correction: int | None = None

    def add_entry(
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
            if seg.end_position is None or seg.end_position > seg.first_position:
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
                t + w * (last - rep.first_position) for t, w in zip(targets, weights, strict=True)
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
                seg.end_step, seg.end_position = bad, schedule.first_position(bad)
                keep = steps < bad
                steps, worst, who = steps[keep], worst[keep], who[keep]
            seg.report = worst_of(steps, worst, who, scale)
            if bad is not None or last_step == end_step:
                return seg, bad, chosen
        return seg, None, None

    def _better_counts(
        self, seg: Segment, step: int, worst: Fraction, ranks: list[int]
    ) -> list[int] | None:
        """``least_worst_counts`` of ``step`` (in ``seg``) if they end it closer than
        the pattern's ``worst`` (the sources of weight > 0), else None."""
        position, gbs = self.schedule.first_position(step), self.schedule.gbs(step)
        counts = seg.counts(position)
        after = [
            t + w * (position - seg.first_position + gbs)
            for t, w in zip(seg.start_targets, seg.weights, strict=True)
        ]
        deficit = [t - int(c) for t, c in zip(after, counts, strict=True)]
        chosen = least_worst_counts(deficit, seg.weights, gbs, ranks)
        best = max(
            abs(d - k) for d, k, w in zip(deficit, chosen, seg.weights, strict=True) if w > 0
        )
        return chosen if best < worst else None
