"""The batch layout: the ONE home of steps over positions, rank slices, micro-batches, ranges.

Role: pure index math shared by every stream (one store, a mixture; ``order.stream``):
the global batch schedule (``BatchSchedule``: step -> its positions
``[first_position(s), + gbs(s))``), the layout check (``check_batch_layout``: global
batch = DP degree x local batch x accumulation), and ``Layout``: a schedule placed on the stream by
its anchor, which cuts a step into replica groups' parts (``part_slice``), DP rank
slices (``rank_slice``) and micro-batches
and walks one rank's stream as position ranges (``Layout.rank_ranges``). A stream
only maps positions to sample keys; every rank, micro-batch and range it serves is
a ``Layout`` answer composed with that map, so a slicing change is made here once.

Skips (``order.skips``) live here too, as positions: ``Layout.skip_ranges`` gives,
per entry S:N, the positions ``[q, r)`` that steps S .. S + N - 1 cover. A skip never
moves a step's positions (nor the mixture rule's positions, indexed by training step):
the stream maps each position to its source's stream position past what those
ranges would have drawn (``order.skips.SkipMap``), so one store and a mixture skip
alike and every rank, micro-batch and range sees the same map.

The anchor (step a, position p) is the one way a resume that accepted a schedule
change continues from the recorded position: step s >= a starts at
``p + first_position(s) - first_position(a)``; steps before a are not defined for
a stream. A rule that counts every step's end from step 1 (the mixture's) sees them
as p positions split evenly over steps 1..a-1 (``Layout.whole_schedule``).

Invariants:
- Step s (1-based, at or after the anchor) covers positions
  ``[first, first + gbs(s))`` with consecutive steps adjacent: schedule changes
  never skip or repeat a position.
- For any number of parts n <= gbs(s) / m, the n parts (``part_slice``: a replica
  group's share of the step under torchft, each a multiple of m samples; m = 1, or the
  local batch size under ``zephon.reproducible``) in part order concatenate to the
  step, their sizes differ by at most m, and one part is the whole step. Within a part, the micro-batches
  of the group's inner DP ranks (``Layout.part_microbatch_positions``), rank by rank,
  concatenate to the part; every inner rank runs the same number of them, none empty.
- For any DP degree D dividing gbs(s), the D rank slices in rank order
  concatenate to the step; the micro-batches of a slice, for any local batch size
  b dividing it, concatenate to the slice. Nothing depends on D, the rank or b
  except the cut points.
- A range of a rank's stream (``Layout.rank_ranges``: ids ``[skip, skip + count)``
  of the rank's slices of steps s, s + 1, ... concatenated) is those per-step
  slices concatenated, cut at skip and count; its ranges are computed in a few
  numpy calls per schedule entry, O(1) in the step number.
"""

from __future__ import annotations

import math

import numpy as np

from torchtitan_zephon.order.skips import SkipSteps

# What a single store must hold for a schedule moved to ``store_size``; importable here too.
from torchtitan_zephon.order.store_size import (  # noqa: E402, F401
    MIN_STORE_SAMPLES,
    check_store_size,
    no_sample_text,
    store_fix,
)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` for error messages: all of them up to n = 10**12; beyond, those
    up to 10**6 and their cofactors (a full search of n = 10**30 would never end)."""
    small = [d for d in range(1, min(math.isqrt(n), 10**6) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_batch_layout(global_batch_size: int, dp_degree: int, local_batch_size: int) -> int:
    """Return the gradient-accumulation steps for this layout, or raise ValueError.

    The layout is valid when ``global_batch_size`` is a multiple of
    ``dp_degree * local_batch_size``.
    """
    g, d, b = int(global_batch_size), int(dp_degree), int(local_batch_size)
    if g < 1 or d < 1 or b < 1:
        raise ValueError(
            "global batch size, DP degree and local batch size must all be >= 1, "
            f"got global_batch_size={g}, dp_degree={d}, local_batch_size={b}."
        )
    if g % (d * b) == 0:
        return g // (d * b)
    good_d = [x for x in divisors(g) if (g // x) % b == 0]
    msg = (
        f"global batch size {g} is not divisible by DP degree {d} x local batch size {b} "
        f"(= {d * b}). "
    )
    if good_d:
        msg += f"DP degrees that work with local batch size {b}: {good_d}. "
    else:
        msg += f"No DP degree works with local batch size {b} (it does not divide {g}). "
    if g % d == 0:
        msg += f"Local batch sizes that work with DP degree {d}: {divisors(g // d)}."
    else:
        msg += f"DP degree {d} does not divide {g}; DP degrees dividing it: {divisors(g)}."
    raise ValueError(msg)


def rank_slice(first: int, gbs: int, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """(first, count) of DP rank ``dp_rank``'s contiguous slice of a step that covers
    ``[first, first + gbs)``: the rank slices concatenate, in rank order, to the step."""
    if dp_degree < 1 or gbs % dp_degree != 0:
        raise ValueError(
            f"DP degree {dp_degree} does not divide the global batch size {gbs} of step "
            f"{step}; DP degrees that divide it: {divisors(gbs)}."
        )
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}.")
    per_rank = gbs // dp_degree
    return first + dp_rank * per_rank, per_rank


def part_slice(
    first: int, gbs: int, step: int, part: int, parts: int, multiple_of: int = 1
) -> tuple[int, int]:
    """(first, count) of part ``part`` of ``parts`` of a step covering ``[first, first +
    gbs)``: the step cut into ``parts`` contiguous parts, each a multiple of
    ``multiple_of`` samples, as evenly as possible, in part order, the first ones
    ``multiple_of`` samples larger. Under torchft, participant i of n (in the quorum's
    order) trains part i of n; one part is the whole step. ``multiple_of`` > 1
    (``zephon.reproducible``: the local batch size) keeps every micro-batch of the step
    whole, whatever the quorum."""
    m = multiple_of
    if m < 1 or gbs % m:
        raise ValueError(
            f"step {step}'s global batch of {gbs} samples is not a whole number of "
            f"micro-batches of {m}."
        )
    whole = gbs // m  # the parts' building blocks: samples, or micro-batches of m
    if not 1 <= parts <= whole:
        what, each = (f"{gbs} samples", "sample") if m == 1 else (
            f"{gbs} samples ({whole} micro-batches of {m})", "micro-batch"
        )  # fmt: skip
        raise ValueError(
            f"step {step}'s global batch of {what} cannot be cut into {parts} parts "
            f"(1 to {whole}): every part must hold at least one {each}."
        )
    if not 0 <= part < parts:
        raise ValueError(f"part must be in [0, {parts}), got {part}.")
    size, larger = divmod(whole, parts)
    return first + (part * size + min(part, larger)) * m, (size + (part < larger)) * m


def part_microbatch_sizes(part_size: int, inner_rank: int, inner_degree: int, b: int) -> list[int]:
    """The micro-batch sizes of inner DP rank ``inner_rank`` of ``inner_degree`` within a
    replica group's part of ``part_size`` samples (torchft): the part cut over the inner
    ranks as evenly as possible (``part_slice``, the first ones one sample larger), then
    each rank's slice cut as evenly as possible into k micro-batches, where
    k = min(ceil(largest slice / b), smallest slice): every rank of the group runs the
    same k (their collectives match), none is empty, none holds more than b samples
    unless the slices' one-sample difference forces one more (then at most
    ceil(largest slice / k)). Pure: a function of its arguments only."""
    if not 1 <= inner_degree <= part_size:
        raise ValueError(
            f"a part of {part_size} samples cannot be cut over {inner_degree} data-parallel "
            f"ranks (1 to {part_size}): every rank must hold at least one sample."
        )
    if not 0 <= inner_rank < inner_degree or b < 1:
        raise ValueError(
            f"inner_rank must be in [0, {inner_degree}) and the local batch size >= 1, got "
            f"{inner_rank} and {b}."
        )
    smallest, larger = divmod(part_size, inner_degree)
    largest = smallest + (larger > 0)
    k = min(-(-largest // b), smallest)
    mine = smallest + (inner_rank < larger)
    size, bigger = divmod(mine, k)
    return [size + (j < bigger) for j in range(k)]


def slice_index(index: int, gbs: int, dp_degree: int) -> tuple[int, int]:
    """(DP rank, index within its slice) of the sample at ``index`` of a step of ``gbs``
    samples cut into ``dp_degree`` rank slices (``rank_slice``); a degree that does not
    divide the step leaves it whole: rank 0."""
    per_rank = gbs // dp_degree if dp_degree >= 1 and gbs % dp_degree == 0 else gbs
    return divmod(index, per_rank)


class BatchSchedule:
    """Global batch size per step: piecewise constant, starting at step 1."""

    def __init__(self, entries: list[tuple[int, int]]) -> None:
        entries = [(int(s), int(g)) for s, g in entries]
        if not entries:
            raise ValueError("a batch schedule needs at least one (start_step, gbs) entry.")
        if entries[0][0] != 1:
            raise ValueError(
                f"a batch schedule must start at step 1 (steps are 1-based), "
                f"found first entry {entries[0][0]}:{entries[0][1]}."
            )
        for (s0, _), (s1, _) in zip(entries, entries[1:], strict=False):
            if s1 <= s0:
                raise ValueError(
                    f"batch schedule steps must be strictly increasing, found {s0} then {s1}."
                )
        for s, g in entries:
            if g < 1:
                raise ValueError(f"global batch size must be >= 1, found {g} at step {s}.")
        self.entries: list[tuple[int, int]] = entries

    @classmethod
    def parse(cls, text: str | int) -> BatchSchedule:
        """Parse ``"64"`` (constant) or ``"1:64,1000:128"`` (from step 1, then from 1000)."""
        text = str(text).strip()
        parts = [text] if ":" not in text else text.split(",")
        entries = []
        for part in parts:
            fields = part.split(":") if ":" in text else ["1", part]
            try:
                step, gbs = (int(x) for x in fields) if len(fields) == 2 else (None, None)
            except ValueError:
                step = None
            if step is None:
                what = "STEP:GBS with two whole numbers" if ":" in text else "a whole number"
                raise ValueError(
                    f"cannot parse global batch schedule {text!r}: {part.strip()!r} is not "
                    f"{what}; expected an integer like '64' or 'STEP:GBS,...' starting at "
                    "step 1 like '1:64,1000:128'."
                )
            entries.append((step, gbs))
        return cls(entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSchedule) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"BatchSchedule({self.entries})"

    def __str__(self) -> str:
        return ",".join(f"{s}:{g}" for s, g in self.entries)

    def to_list(self) -> list[list[int]]:
        return [[s, g] for s, g in self.entries]

    def check_layout(self, dp_degree: int, local_batch_size: int) -> None:
        """Every global batch size of the schedule must split into DP ranks x micro-batches."""
        for start, gbs in self.entries:
            try:
                check_batch_layout(gbs, dp_degree, local_batch_size)
            except ValueError as e:
                raise ValueError(f"batch schedule entry {start}:{gbs}: {e}") from None

    def gbs(self, step: int) -> int:
        """Global batch size of ``step`` (>= 1)."""
        if step < 1:
            raise ValueError(f"steps are 1-based, got step {step}.")
        size = self.entries[0][1]
        for s, g in self.entries:
            if s > step:
                break
            size = g
        return size

    def segment_end(self, step: int) -> int | None:
        """First step after ``step`` that starts a new schedule entry (None: none does);
        steps ``step .. segment_end - 1`` all have ``gbs(step)``."""
        for s, _ in self.entries:
            if s > step:
                return s
        return None

    def first_position(self, step: int) -> int:
        """Number of positions consumed by steps 1 .. step-1."""
        if step < 1:
            raise ValueError(f"steps are 1-based, got step {step}.")
        total = 0
        for k, (s, g) in enumerate(self.entries):
            end = self.entries[k + 1][0] if k + 1 < len(self.entries) else None
            if s >= step:
                break
            last = step if end is None else min(end, step)
            total += (last - s) * g
        return total


class Layout:
    """A batch schedule placed on the stream by its anchor: a step's positions, its DP
    rank slices and micro-batches, and ranges of one rank's stream (module docstring).

    The anchor ``(step, position)`` pins step ``step`` to start at ``position``; the
    default (1, 0) is the plain schedule.
    """

    def __init__(
        self,
        schedule: BatchSchedule,
        anchor: tuple[int, int] = (1, 0),
        skips: SkipSteps | None = None,
    ) -> None:
        self.schedule = schedule
        self.anchor_step, self.anchor_position = int(anchor[0]), int(anchor[1])
        self.skips = skips if skips is not None else SkipSteps()
        self._whole: BatchSchedule | None = None

    @property
    def anchor(self) -> tuple[int, int]:
        return self.anchor_step, self.anchor_position

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

    def rank_positions(self, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """(first position, count) of DP rank ``dp_rank``'s contiguous slice of ``step``."""
        return rank_slice(*self.step_positions(step), step, dp_rank, dp_degree)

    def part_positions(
        self, step: int, part: int, parts: int, multiple_of: int = 1
    ) -> tuple[int, int]:
        """(first position, count) of part ``part`` of ``parts`` of ``step`` (``part_slice``:
        a replica group's share under torchft, each a multiple of ``multiple_of`` samples)."""
        return part_slice(*self.step_positions(step), step, part, parts, multiple_of)

    def microbatch_positions(
        self, step: int, dp_rank: int, dp_degree: int, local_batch_size: int
    ) -> list[tuple[int, int]]:
        """(first position, count) of each micro-batch of the rank slice, in order."""
        check_batch_layout(self.schedule.gbs(step), dp_degree, local_batch_size)
        first, count = self.rank_positions(step, dp_rank, dp_degree)
        b = int(local_batch_size)
        return [(p, b) for p in range(first, first + count, b)]

    def part_microbatch_positions(
        self,
        step: int,
        part: int,
        parts: int,
        inner_rank: int,
        inner_degree: int,
        b: int,
        multiple_of: int = 1,
    ) -> list[tuple[int, int]]:
        """(first position, count) of each micro-batch of inner DP rank ``inner_rank`` of
        ``inner_degree`` in part ``part`` of ``parts`` of ``step`` (torchft: participant
        ``part`` of the quorum's ``parts``, each a multiple of ``multiple_of`` samples), in order
        (``part_microbatch_sizes``)."""
        first, size = self.part_positions(step, part, parts, multiple_of)
        smallest, larger = divmod(size, inner_degree)
        first += inner_rank * smallest + min(inner_rank, larger)
        out = []
        for n in part_microbatch_sizes(size, inner_rank, inner_degree, b):
            out.append((first, n))
            first += n
        return out

    def microbatch_places(
        self, cursor: tuple[int, int], count: int, dp_degree: int, local_batch_size: int
    ) -> tuple[list[tuple[int, int, bool]], tuple[int, int]]:
        """The next ``count`` micro-batches of a rank's stream from ``cursor`` (step,
        index of the micro-batch within the step), as (step, index, last of the step),
        and the cursor after them. Micro-batch k of step s is ids ``[k*b, (k+1)*b)``
        of the rank's slice (``microbatch_positions``)."""
        step, index = cursor
        places: list[tuple[int, int, bool]] = []
        while len(places) < count:
            per_step = check_batch_layout(self.schedule.gbs(step), dp_degree, local_batch_size)
            stop = min(per_step, index + count - len(places))
            places += [(step, k, k + 1 == per_step) for k in range(index, stop)]
            step, index = (step + 1, 0) if stop == per_step else (step, stop)
        return places, (step, index)

    def rank_ranges(
        self, step: int, skip: int, count: int, dp_rank: int, dp_degree: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(starts, counts) int64 of the position ranges holding ids ``[skip, skip +
        count)`` of DP rank ``dp_rank``'s stream from ``step`` on (its slices of steps
        ``step, step + 1, ...`` concatenated), in stream order; adjacent slices (one
        rank of one) come as one range. Within one schedule entry a rank's slice moves
        by the global batch each step: one numpy call per entry, whatever the steps."""
        if skip < 0 or count < 0:
            raise ValueError(f"skip and count must be >= 0, got skip={skip}, count={count}.")
        starts: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        need, s = skip + count, step
        while need > 0:
            first, per_rank = self.rank_positions(s, dp_rank, dp_degree)
            gbs = self.schedule.gbs(s)
            steps = -(-need // per_rank)
            end = self.schedule.segment_end(s)
            if end is not None:
                steps = min(steps, end - s)
            if per_rank == gbs:
                starts.append(np.array([first], dtype=np.int64))
                counts.append(np.array([steps * gbs], dtype=np.int64))
            else:
                starts.append(first + gbs * np.arange(steps, dtype=np.int64))
                counts.append(np.full(steps, per_rank, dtype=np.int64))
            need -= steps * per_rank
            s += steps
        if not starts:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        first_at, n = np.concatenate(starts), np.concatenate(counts)
        ends = np.cumsum(n)  # offsets in the rank's stream: range k is [ends[k] - n[k], ends[k])
        begins = ends - n
        lo = np.clip(skip - begins, 0, n)
        hi = np.clip(skip + count - begins, 0, n)
        keep = hi > lo
        return first_at[keep] + lo[keep], hi[keep] - lo[keep]

    def skip_ranges(self) -> list[tuple[int, int]]:
        """Per skip entry S:N, the positions ``[q, r)`` of steps S .. S + N - 1 (counted
        over ``whole_schedule``: from the anchor on, ``step_positions``' own)."""
        whole = self.whole_schedule()
        return [
            (whole.first_position(s), whole.first_position(s + n)) for s, n in self.skips.entries
        ]

    def whole_schedule(self) -> BatchSchedule:
        """The batch schedule of every step from 1 that starts step ``anchor_step`` at
        ``anchor_position``: the schedule's own from the anchor on; before it, the
        anchor's positions split evenly over steps 1 .. anchor_step - 1 (the first of
        them one larger). What a rule that counts every step's end from step 1 (a
        mixture's) is built over; ``step_positions`` leaves those earlier steps out."""
        if self._whole is None:
            self._whole = self._whole_schedule()
        return self._whole

    def _whole_schedule(self) -> BatchSchedule:
        a, p, schedule = self.anchor_step, self.anchor_position, self.schedule
        if (a, p) == (1, 0):
            return schedule
        if a < 1 or p < a - 1 or (a == 1 and p != 0):
            raise ValueError(
                f"position anchor (step {a}, position {p}) is impossible: steps 1..{a - 1} "
                "hold at least one position each. The data state is corrupt."
            )
        q, r = divmod(p, a - 1)
        entries = [(1, q + 1), (r + 1, q)] if r else [(1, q)]
        entries.append((a, schedule.gbs(a)))
        entries += [(s, g) for s, g in schedule.entries if s > a]
        return BatchSchedule(entries)
