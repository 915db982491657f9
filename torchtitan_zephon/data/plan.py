"""The data plan: which sample ids every step, rank and micro-batch gets.

Role: pure index math from (number of samples, seed, global batch schedule) to
the ordered sample ids of each global step, and from there to DP-rank slices
and gradient-accumulation micro-batches.

Invariants:
- The global stream is positions p = 0, 1, 2, ...; position p is sample
  ``sample_offset + Permutation(num_samples, seed, p // num_samples)[p % num_samples]``,
  so every sample appears exactly once per epoch and epochs are reshuffled.
- Step s (1-based) covers positions [first_position(s), first_position(s) + gbs(s)):
  schedule changes never skip or repeat a position.
- For any DP degree D dividing gbs(s), the concatenation of the D rank slices in
  rank order is the step's global batch, and the concatenation of a rank's
  micro-batches is its slice. Nothing here depends on D, the rank or the
  micro-batch size except the cut points.
- A window of a rank's stream (``rank_stream_ids``: many steps, across epochs, in
  a few numpy calls) equals the per-step slices ``rank_ids`` concatenated.
- What a single store must hold (``check_store_size``) is a function of its
  training samples and the batch schedule only: the same verdict under every
  DP degree and local batch size, so a resume at another topology decides alike.
"""

from __future__ import annotations

import math

import numpy as np

from torchtitan_zephon.data.permutation import Permutation


def _divisors(n: int) -> list[int]:
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
    good_d = [x for x in _divisors(g) if (g // x) % b == 0]
    msg = (
        f"global batch size {g} is not divisible by DP degree {d} x local batch size {b} "
        f"(= {d * b}). "
    )
    if good_d:
        msg += f"DP degrees that work with local batch size {b}: {good_d}. "
    else:
        msg += f"No DP degree works with local batch size {b} (it does not divide {g}). "
    if g % d == 0:
        msg += f"Local batch sizes that work with DP degree {d}: {_divisors(g // d)}."
    else:
        msg += f"DP degree {d} does not divide {g}; DP degrees dividing it: {_divisors(g)}."
    raise ValueError(msg)


MIN_STORE_SAMPLES = 2
"""Training samples a single store needs. With one, every step trains on that one
sample, repeated to fill the global batch, whatever the seed, the batch schedule or
the topology: the order has nothing left to decide. Fewer samples than a global batch
(but at least two) is a warning: the steps still differ, their samples repeat."""


def no_sample_text(what: str, num_tokens: int, seq_len: int) -> str:
    """Why a store of ``num_tokens`` tokens holds no sample of ``seq_len``."""
    return (
        f"{what} has {num_tokens} tokens, but a sample of seq_len {seq_len} needs seq_len + 1 "
        f"= {seq_len + 1} tokens (its inputs and the label of the last one), so it holds no "
        "sample"
    )


def store_fix(num_tokens: int, samples: int, seq_len_flag: str, *, first: str = "") -> str:
    """What to change so that a store of ``num_tokens`` tokens holds ``samples`` samples:
    ``first`` (e.g. the held-out setting, as the user writes it), a shorter seq_len, a
    larger store."""
    options = [first] if first else []
    longest = (num_tokens - 1) // samples if samples > 0 else 0
    if longest >= 1:
        options.append(
            f"use {seq_len_flag} {longest} or less (the longest that gives {samples} samples)"
        )
    options.append("use a larger store")
    return "To change it: " + ", or ".join(options) + "."


def check_store_size(what: str, num_samples: int, schedule: BatchSchedule, fix: str) -> str | None:
    """Refuse a single store with fewer than ``MIN_STORE_SAMPLES`` training samples
    (ValueError naming ``what``, the count and the batch, then ``fix``); return the
    warning for one smaller than a global batch of ``schedule`` (None: no step repeats
    a sample)."""
    largest = max(g for _, g in schedule.entries)
    if num_samples < 1:
        raise ValueError(f"{what} has no training sample. {fix}")
    if num_samples < MIN_STORE_SAMPLES:
        raise ValueError(
            f"{what} has {num_samples} training sample: every step would train on that "
            f"one sample alone, repeated to fill the global batch ({schedule.gbs(1)} at step "
            "1), whatever the seed or the number of ranks. A single store needs at least "
            f"{MIN_STORE_SAMPLES}. {fix}"
        )
    first = next(((s, g) for s, g in schedule.entries if g > num_samples), None)
    if first is None:
        return None
    step, gbs = first
    larger = f", and up to {largest} later" if largest > gbs else ""
    return (
        f"{what} has {num_samples} training samples, fewer than the global batch of {gbs} "
        f"from step {step} on (batch schedule entry {step}:{gbs}{larger}): every such step "
        "repeats samples within itself. Use a larger store or a smaller global batch."
    )


def rank_slice(first: int, gbs: int, step: int, dp_rank: int, dp_degree: int) -> tuple[int, int]:
    """(first, count) of DP rank ``dp_rank``'s contiguous slice of a step that covers
    ``[first, first + gbs)``: the rank slices concatenate, in rank order, to the step."""
    if dp_degree < 1 or gbs % dp_degree != 0:
        raise ValueError(
            f"DP degree {dp_degree} does not divide the global batch size {gbs} of step "
            f"{step}; DP degrees that divide it: {_divisors(gbs)}."
        )
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}.")
    per_rank = gbs // dp_degree
    return first + dp_rank * per_rank, per_rank


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
        try:
            if ":" not in text:
                return cls([(1, int(text))])
            entries = []
            for part in text.split(","):
                step, gbs = part.split(":")
                entries.append((int(step), int(gbs)))
        except ValueError as e:
            raise ValueError(
                f"cannot parse global batch schedule {text!r}: expected an integer like '64' "
                f"or 'STEP:GBS,...' starting at step 1 like '1:64,1000:128' ({e})."
            ) from None
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
