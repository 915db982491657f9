"""The mixture rule: which source each position of a step goes to.

Role: the position-assignment machinery ``MixturePlan`` builds its tables from: the
earliest-deadline pattern of one weight entry (``simulate``, kept as a
``Pattern``), the least-worst counts of a corrected step (``least_worst_counts``),
their order within a step (``spread``), and the tables (``Segment``: a run of
steps under one pattern; ``Repeat``: a block of steps whose residuals recur).

Invariant: everything here is a function of the weights, the residuals the
earlier steps left, the batch sizes and the sources' name ranks only: every rank
builds the same tables (see ``order.mixture``'s package docstring for the rule's
bounds).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from torchtitan_zephon.order.layout import (
    BatchSchedule,
)
from torchtitan_zephon.order.mixture.config import (
    MixtureError,
)

_CHECKPOINT = 512  # positions between prefix-count checkpoints of a pattern table


class Pattern:
    """The position -> source assignment of one weight segment, periodic after a prefix.

    ``local`` holds, per simulated position, an index into ``active`` (the sources
    with weight > 0): ``prefix`` positions, then one period of ``cycle`` positions that
    repeats forever (``cycle`` = 0 when the segment is shorter than that).
    """

    def __init__(self, active: np.ndarray, local: np.ndarray, prefix: int, cycle: int) -> None:
        self.active = active
        self.local = local
        self.prefix = prefix
        self.cycle = cycle
        m = len(active)
        checkpoints = np.zeros((len(local) // _CHECKPOINT + 1, m), dtype=np.int64)
        for q in range(1, len(checkpoints)):
            block = local[(q - 1) * _CHECKPOINT : q * _CHECKPOINT]
            checkpoints[q] = checkpoints[q - 1] + np.bincount(block, minlength=m)
        self._checkpoints = checkpoints
        self._cycle_counts = (
            self._local_counts(prefix + cycle) - self._local_counts(prefix)
            if cycle
            else np.zeros(m, dtype=np.int64)
        )

    def _local_counts(self, x: int) -> np.ndarray:
        """Counts per active source of simulated positions [0, x), x <= len(local)."""
        q = x // _CHECKPOINT
        tail = self.local[q * _CHECKPOINT : x]
        return self._checkpoints[q] + np.bincount(tail, minlength=len(self.active))

    def counts(self, t: int) -> np.ndarray:
        """Counts per active source of the segment's positions [0, t)."""
        if t <= len(self.local):
            return self._local_counts(t)
        if not self.cycle:
            raise AssertionError("slot beyond a finite segment pattern")
        full, rem = divmod(t - self.prefix, self.cycle)
        return self._local_counts(self.prefix + rem) + full * self._cycle_counts

    def local_at(self, t0: int, count: int) -> np.ndarray:
        """Indices into ``active`` of the segment's positions [t0, t0+count)."""
        idx = np.arange(t0, t0 + count, dtype=np.int64)
        if self.cycle:
            wrap = idx >= self.prefix + self.cycle
            idx[wrap] = self.prefix + (idx[wrap] - self.prefix) % self.cycle
        return self.local[idx]


def simulate(
    weights: Sequence[Fraction],
    residual: Sequence[Fraction],
    ranks: Sequence[int],
    length: int | None,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Chairman assignment of one weight segment, from the residuals it inherits.

    Returns (active source indices, per-position index into them, prefix, cycle).
    Rule: earliest deadline first on Tijdeman's windows, in exact integer
    arithmetic. With m sources of weight > 0 and ``d = 1/(2m-2)``, a source is
    a candidate for a position when its deficit ``r`` (target - count) plus the
    position's accrual ``w`` is at least ``d`` (taking the position leaves it at most
    ``1 - d`` ahead); its deadline is the last position before its deficit would
    pass ``1 - d`` at the current weights. The candidate with the earliest
    deadline wins, ties to the smaller name. Tijdeman (1980) shows a sequence
    within ``1 - d`` exists for constant weights, and earliest-deadline-first
    meets every deadline of unit jobs whenever any schedule does, so from the
    start of the stream this stays within ``1 - d``. After a weight change the
    windows may have no solution: a source may then pass its deadline (it stays
    first in line), and with no candidate the largest ``r + w`` wins. Sources
    with weight 0 never win.
    """
    active = [i for i, w in enumerate(weights) if w > 0]
    m = len(active)
    period = math.lcm(*(weights[i].denominator for i in active))
    if m == 1:
        return np.array(active, dtype=np.int64), np.zeros(1, dtype=np.uint16), 0, 1
    scale = math.lcm(period, 2 * m - 2, *(residual[i].denominator for i in active))
    acc = [int(weights[i] * scale) for i in active]  # accrual per position, scaled
    low = scale // (2 * m - 2)  # d
    high = scale - low  # 1 - d
    rank = [ranks[i] for i in active]
    base_t = [0] * m  # each source's deficit is base_r at time base_t (+ acc per position)
    base_r = [int(residual[i] * scale) for i in active]

    def candidate_from(j: int) -> int:
        need = low - base_r[j] - acc[j]
        return base_t[j] + (0 if need <= 0 else -(-need // acc[j]))

    waiting = [(candidate_from(j), rank[j], j) for j in range(m)]
    heapq.heapify(waiting)
    ready: list[tuple[int, int, int]] = []  # (deadline, rank, j)
    picks: list[int] = []
    seen: dict[tuple[int, ...], int] = {tuple(base_r): 0}  # state at multiples of period
    cap = 64 * period + 4096
    prefix = cycle = 0
    t = 0
    push, pop = heapq.heappush, heapq.heappop
    while length is None or t < length:
        while waiting and waiting[0][0] <= t:
            j = pop(waiting)[2]
            push(ready, (base_t[j] + (high - base_r[j]) // acc[j], rank[j], j))
        if ready:
            j = pop(ready)[2]
        else:
            j = max(range(m), key=lambda x: (base_r[x] + acc[x] * (t - base_t[x] + 1), -rank[x]))
            waiting = [w for w in waiting if w[2] != j]
            heapq.heapify(waiting)
        base_r[j] += acc[j] * (t - base_t[j] + 1) - scale
        base_t[j] = t + 1
        push(waiting, (candidate_from(j), rank[j], j))
        picks.append(j)
        t += 1
        if t % period == 0:
            state = tuple(base_r[x] + acc[x] * (t - base_t[x]) for x in range(m))
            if state in seen:
                prefix = seen[state]
                cycle = t - prefix
                break
            seen[state] = t
            if t > cap:
                raise MixtureError(
                    f"internal: the slot pattern of weights {[str(weights[i]) for i in active]} "
                    f"did not repeat within {cap} slots; please report this mixture."
                )
    local = np.array(picks, dtype=np.uint16 if m <= 1 << 16 else np.int32)
    return np.array(active, dtype=np.int64), local, prefix, cycle


def least_worst_counts(
    deficit: Sequence[Fraction], weights: Sequence[Fraction], gbs: int, ranks: Sequence[int]
) -> list[int]:
    """The counts of one step that leave the smallest worst |target - count| at its
    end among the sources of weight > 0 (those of weight 0 get none and keep theirs).

    ``deficit[i]`` is source i's target after the step minus its count before
    it. Counts are integers >= 0 summing to ``gbs``. Among the counts that reach
    the least worst deviation ``D``, each source first gets the fewest that keep
    it within ``D``; the rest go one at a time to the source with the largest
    remaining deficit that can take one more, ties to the smaller name.
    """
    active = [i for i, w in enumerate(weights) if w > 0]
    candidates: set[Fraction] = set()
    for i in active:  # the least D is the distance of a deficit to a count
        x = deficit[i]
        candidates.update(abs(x - k) for k in range(max(0, math.floor(x) - 3), math.floor(x) + 5))

    def bounds(d: Fraction) -> tuple[list[int], list[int]] | None:
        lo = [max(0, math.ceil(deficit[i] - d)) for i in active]
        hi = [math.floor(deficit[i] + d) for i in active]
        if any(a > b for a, b in zip(lo, hi, strict=True)) or not sum(lo) <= gbs <= sum(hi):
            return None
        return lo, hi

    ordered = sorted(candidates)
    lo_k, hi_k = 0, len(ordered) - 1  # feasibility is monotone in D; the largest is feasible
    while bounds(ordered[hi_k]) is None:  # (cannot happen for a state within 2 samples)
        ordered.append(ordered[-1] + 1)
        hi_k = len(ordered) - 1
    while lo_k < hi_k:
        mid = (lo_k + hi_k) // 2
        if bounds(ordered[mid]) is None:
            lo_k = mid + 1
        else:
            hi_k = mid
    found = bounds(ordered[lo_k])
    assert found is not None
    lo, hi = found
    n = list(lo)
    heap = [(-(deficit[i] - n[j]), ranks[i], j) for j, i in enumerate(active) if n[j] < hi[j]]
    heapq.heapify(heap)
    for _ in range(gbs - sum(n)):
        _, _, j = heapq.heappop(heap)
        n[j] += 1
        if n[j] < hi[j]:
            heapq.heappush(heap, (-(deficit[active[j]] - n[j]), ranks[active[j]], j))
    out = [0] * len(weights)
    for j, i in enumerate(active):
        out[i] = n[j]
    return out


def spread(counts: Sequence[int], ranks: Sequence[int]) -> np.ndarray:
    """A step's positions in order, given its per-source counts: source i's k-th sample
    sits at (2k+1)/(2 counts[i]) of the step, ties to the smaller name."""
    src = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    n = np.asarray(counts, dtype=np.int64)[src]
    k = np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    key = (2 * k + 1) / (2 * n)  # correctly rounded: equal fractions give equal floats
    return src[np.lexsort((np.asarray(ranks, dtype=np.int64)[src], key))]


@dataclass
class Segment:
    """Steps [first_step, end_step) of the stream: one weight vector, one pattern."""

    weights: list[Fraction]  # per source, mixture order
    first_step: int
    end_step: int | None
    first_position: int
    end_position: int | None
    start_counts: np.ndarray  # per source
    start_targets: list[Fraction]  # exact per-source targets at first_position
    pattern: Pattern
    report: tuple[Fraction, int, int] | None = None
    """(worst deviation, source, first step) over its step ends, sources of weight > 0."""

    def counts(self, position: int) -> np.ndarray:
        """Per-source counts of positions [0, position) of the whole stream (position in this segment)."""
        out = self.start_counts.copy()
        out[self.pattern.active] += self.pattern.counts(position - self.first_position)
        return out

    def sources(self, position: int, count: int) -> np.ndarray:
        """Source indices of positions [position, position + count) (all in this segment)."""
        return self.pattern.active[self.pattern.local_at(position - self.first_position, count)]

    def step_ends(self, schedule: BatchSchedule) -> tuple[np.ndarray, np.ndarray]:
        """(steps, pattern positions) of this segment's step ends, each step end
        position folded into the pattern's table. Enough steps to meet every
        position the infinite segment ever folds to: after the table, a
        constant batch size walks the period with period C / gcd(C, G)."""
        pat = self.pattern
        length = len(pat.local)
        steps_out, pos_out = [], []
        entries = schedule.entries
        for k, (a, g) in enumerate(entries):
            b = entries[k + 1][0] if k + 1 < len(entries) else None
            lo = max(a, self.first_step)
            hi = (
                b
                if self.end_step is None
                else (self.end_step if b is None else min(b, self.end_step))
            )
            if hi is not None and lo >= hi:
                continue
            x0 = schedule.first_position(lo) + g - self.first_position
            count = None if hi is None else hi - lo
            if pat.cycle:
                direct = (length - x0) // g + 1 if x0 <= length else 0
                bound = direct + pat.cycle // math.gcd(pat.cycle, g)
                count = bound if count is None else min(count, bound)
            assert count is not None, "an infinite segment has a periodic pattern"
            kk = np.arange(count, dtype=np.int64)
            x = x0 + kk * g
            if pat.cycle:
                over = x > length
                x[over] = pat.prefix + (x[over] - pat.prefix) % pat.cycle
            steps_out.append(lo + kk)
            pos_out.append(x)
        if not steps_out:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(steps_out), np.concatenate(pos_out)

    def deviations(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """At each pattern position: the worst |target - count| among the sources
        of weight > 0, times the returned integer, and which source it is."""
        pat = self.pattern
        residual = [t - int(c) for t, c in zip(self.start_targets, self.start_counts, strict=True)]
        active = pat.active.tolist()
        scale = math.lcm(
            *(self.weights[i].denominator for i in active),
            *(residual[i].denominator for i in active),
        )
        big = max(abs(residual[i]) for i in active) * scale + scale * (
            int(positions.max(initial=0)) + 2
        )
        dtype: Any = np.int64 if big < 1 << 62 else object
        order = np.argsort(pat.local, kind="stable")
        bounds_ = np.searchsorted(pat.local[order], np.arange(len(active) + 1))
        pos = positions.astype(dtype)
        worst = np.full(len(positions), -1, dtype=dtype)
        who = np.zeros(len(positions), dtype=np.int64)
        for j, i in enumerate(active):
            picks = order[bounds_[j] : bounds_[j + 1]]  # positions source i takes, ascending
            taken = np.searchsorted(picks, positions, side="left").astype(dtype)
            dev = int(residual[i] * scale) + int(self.weights[i] * scale) * pos - scale * taken
            dev = np.abs(dev)
            better = dev > worst
            worst = np.where(better, dev, worst)
            who[better] = i
        return worst, who, scale


class Repeat:
    """Steps that repeat an earlier block of segments: ``block`` covers the
    ``span`` steps from position ``block_position``, and every repetition adds ``delta``
    to each source's count (the residuals are the same at each block start).
    The last repetition may be partial (``end_step`` need not be a whole number
    of spans away)."""

    def __init__(
        self,
        weights: list[Fraction],
        first_step: int,
        end_step: int | None,
        first_position: int,
        start_counts: np.ndarray,
        start_targets: list[Fraction],
        block: list[Segment],
        block_position: int,
        delta: np.ndarray,
        span: int,
    ) -> None:
        self.weights = weights
        self.first_step, self.end_step = first_step, end_step
        self.first_position = first_position
        self.positions = first_position - block_position
        self.end_position = (  # one batch size throughout: positions // span per step
            None
            if end_step is None
            else first_position + (end_step - first_step) * (self.positions // span)
        )
        self.start_counts, self.start_targets = start_counts, start_targets
        self.block, self.block_position, self.delta, self.span = block, block_position, delta, span
        self._starts = [b.first_position for b in block]

    def _locate(self, position: int) -> tuple[int, int, Segment]:
        q, within = divmod(position - self.first_position, self.positions)
        orig = self.block_position + within
        return q + 1, orig, self.block[bisect.bisect_right(self._starts, orig) - 1]

    def counts(self, position: int) -> np.ndarray:
        q, orig, seg = self._locate(position)
        return seg.counts(orig) + q * self.delta

    def sources(self, position: int, count: int) -> np.ndarray:
        parts = []
        while count > 0:
            _, orig, seg = self._locate(position)
            take = min(count, int(seg.end_position) - orig)
            parts.append(seg.sources(orig, take))
            position, count = position + take, count - take
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
