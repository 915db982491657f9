"""Skip ranges: the data of whole steps consumed and never trained (after a loss spike).

Role: ``SkipSteps`` is the setting ``zephon.skip_steps = "S:N,S:N,..."`` (entries
strictly increasing in S, N >= 1, never overlapping), parsed with errors that say
what was expected; ``SkipMap`` is its map from a position of the layout to a
source's stream position, built by the stream that owns the sources (one store:
``order.stream.DataPlan``; a mixture: ``order.mixture.plan.MixturePlan``) from the
position ranges ``order.layout.Layout.skip_ranges`` gives: the layout stays the one
home of step -> positions, and a skip never moves a step's positions.

The map. Steps keep their positions, batch sizes and (in a mixture) the rule's position
assignment, all indexed by training step as without skips. For a source i (one
store is one source) let ``c_i(p)`` be the positions before p that draw from i (p
itself for one store; the mixture rule's counts). Entry j = (S_j, N_j) covers the
positions ``[q_j, r_j)`` of steps ``S_j .. S_j + N_j - 1``. The position p that
draws from source i reads its stream position

    c_i(p) + sum over entries j with q_j <= p of (c_i(r_j) - c_i(q_j)).

Invariants:
- Entry j moves every source's stream on by exactly what steps S_j .. S_j + N_j - 1
  draw from it (after the earlier entries; entries never overlap, so that draw is
  not itself moved by a later entry): those samples are consumed and never
  trained. With one store and a constant batch size G, step S_j trains what step
  S_j + N_j would have trained (the map adds N_j x G).
- Positions before q_j are not moved by entry j: adding an entry with S >= the
  next untrained step changes no trained step. A step's ids digest binds the
  entries with S <= its step only (``order.data_config.DataConfig.step_key``).
- The map is increasing in p per source (each stream position is read at most
  once per pass over it: within an epoch no sample is trained twice) and a
  function of the layout alone: the same at every DP degree, rank slice,
  micro-batch and window.
- A lookup is O(log K) for K entries (one ``searchsorted`` over the entries'
  start counts, then their prefix sums), whatever the step number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

SKIP_HELP = (
    "expected 'S:N,S:N,...' with whole numbers: at step S (>= 1) skip the data of N (>= 1) "
    "steps, entries in increasing S, each starting after the steps the one before covers, "
    "e.g. '1200:300' or '1200:300,5000:200'"
)


MAX_STEP = 1 << 40
"""The largest step a skip entry or a left-out entry may name (about 10^12 steps, past
any run): it keeps every stream position they move within int64 at any global batch
size up to 2**22."""


class SkipSteps:
    """The skip entries (S, N): the data of steps S .. S + N - 1 is consumed, never trained."""

    def __init__(self, entries: Iterable[tuple[int, int]] = ()) -> None:
        out: list[tuple[int, int]] = []
        for entry in entries:
            try:
                if isinstance(entry, (str, bytes)) or len(entry) != 2:
                    raise TypeError
                start, count = entry
                if isinstance(start, bool) or isinstance(count, bool):
                    raise TypeError
                if int(start) != start or int(count) != count:
                    raise TypeError
            except (TypeError, ValueError):
                raise ValueError(
                    f"skip entry {entry!r} is not a pair of whole numbers; {SKIP_HELP}."
                ) from None
            out.append((int(start), int(count)))
        for start, count in out:
            if start < 1:
                raise ValueError(
                    f"skip entry {start}:{count} starts at step {start}; steps are 1-based, so "
                    f"S must be >= 1; {SKIP_HELP}."
                )
            if count < 1:
                raise ValueError(
                    f"skip entry {start}:{count} skips {count} steps; N must be >= 1 (drop the "
                    f"entry to skip nothing); {SKIP_HELP}."
                )
            if start + count - 1 > MAX_STEP:
                raise ValueError(
                    f"skip entry {start}:{count} reaches step {start + count - 1}, past the "
                    f"largest step a plan takes ({MAX_STEP}); {SKIP_HELP}."
                )
        for (s0, n0), (s1, n1) in zip(out, out[1:], strict=False):
            if s1 <= s0:
                raise ValueError(
                    f"skip entries must be strictly increasing in S, found {s0}:{n0} then "
                    f"{s1}:{n1}; {SKIP_HELP}."
                )
            if s1 < s0 + n0:
                raise ValueError(
                    f"skip entries {s0}:{n0} and {s1}:{n1} overlap: the first covers steps "
                    f"{s0}..{s0 + n0 - 1}, the second starts at step {s1}. Start the second "
                    f"at step {s0 + n0} or later, or merge them into one entry "
                    f"(e.g. {s0}:{max(s0 + n0, s1 + n1) - s0})."
                )
        self.entries: tuple[tuple[int, int], ...] = tuple(out)

    @classmethod
    def parse(cls, text: str) -> SkipSteps:
        """Parse ``"S:N,S:N,..."`` ("" or blanks: no skip)."""
        text = str(text).strip()
        if not text:
            return cls()
        entries = []
        for part in text.split(","):
            fields = part.strip().split(":")
            try:
                if len(fields) != 2:
                    raise ValueError
                entries.append((int(fields[0]), int(fields[1])))
            except ValueError:
                raise ValueError(
                    f"cannot parse skip_steps {text!r}: {part.strip()!r} is not S:N; {SKIP_HELP}."
                ) from None
        return cls(entries)

    @classmethod
    def from_json(cls, value: Any) -> SkipSteps:
        """The saved form ``[[S, N], ...]`` (None: no skip); ValueError names the problem."""
        if value is None:
            return cls()
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
            raise ValueError(f"skip_steps is {value!r}, expected a list of [S, N] pairs.")
        return cls(tuple(e) if isinstance(e, Sequence) else e for e in value)

    def to_json(self) -> list[list[int]]:
        return [[s, n] for s, n in self.entries]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SkipSteps) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"SkipSteps({list(self.entries)})"

    def __str__(self) -> str:
        return ",".join(f"{s}:{n}" for s, n in self.entries)

    def up_to(self, step: int) -> SkipSteps:
        """The entries with S <= ``step``: what steps up to ``step`` depend on."""
        return SkipSteps(e for e in self.entries if e[0] <= step)

    def reach(self, step: int) -> int:
        """First step after every range an entry with S <= ``step`` covers (``step`` + 1
        when none reaches past it): the batch sizes and weights of the steps before it
        decide what those entries skip."""
        return max([step + 1] + [s + n for s, n in self.entries if s <= step])

    def describe(self, gbs: Callable[[int], int] | None = None) -> list[str]:
        """One sentence per entry, for ``zephon plan``, the sequence log and the start
        and resume logs. ``gbs``: the global batch size of a step (the batch schedule's);
        where step S's differs from step S + N's, the sentence says which part of step
        S + N's data step S trains (its positions start at step S + N's first)."""
        out = []
        for s, n in self.entries:
            size, later = (gbs(s), gbs(s + n)) if gbs is not None else (0, 0)
            if size == later:
                what = f"what step {s + n} would have trained"
            elif size < later:
                what = f"the first {size} of the {later} samples step {s + n} would have trained"
            else:
                what = (
                    f"{size} samples from the first that step {s + n} would have trained (it "
                    f"would have trained {later}; the rest are those of the steps after it)"
                )
            out.append(
                f"at step {s}, skip the data of {n} step{'s' * (n != 1)} ({s}..{s + n - 1}): "
                f"step {s} trains {what}, and steps {s}..{s + n - 1} of the original order "
                "are never trained"
            )
        return out


class SkipMap:
    """A position's stream position per source: the module's map, as arrays.

    ``starts[j, i]`` = c_i(q_j) and ``ends[j, i]`` = c_i(r_j) for entry j and source i;
    ``shift`` adds, to a count k of source i, what the entries with starts[j, i] <= k
    skipped (the positions p >= q_j are exactly those with c_i(p) >= c_i(q_j) among
    the positions drawing from i)."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        starts = np.asarray(starts, dtype=np.int64).reshape(len(starts), -1)
        ends = np.asarray(ends, dtype=np.int64).reshape(starts.shape)
        self.starts = np.ascontiguousarray(starts.T)  # [source, entry]
        skipped = (ends - starts).T
        self.prefix = np.zeros((skipped.shape[0], skipped.shape[1] + 1), dtype=np.int64)
        np.cumsum(skipped, axis=1, out=self.prefix[:, 1:])

    def skipped(self) -> np.ndarray:
        """Per source, the stream positions all entries skip (int64)."""
        return self.prefix[:, -1].copy()

    def skipped_by_first(self, k: int) -> np.ndarray:
        """Per source, the stream positions the first ``k`` entries skip (int64)."""
        return self.prefix[:, k].copy()

    def skipped_before(self, counts: np.ndarray) -> np.ndarray:
        """Per source i, what the entries skip before its count ``counts[i]``."""
        c = np.asarray(counts, dtype=np.int64)
        return np.array(
            [
                self.prefix[i, np.searchsorted(self.starts[i], c[i], side="right")]
                for i in range(len(c))
            ],
            dtype=np.int64,
        )

    def shift(self, counts: np.ndarray, sources: np.ndarray | None = None) -> np.ndarray:
        """Stream positions (int64) of the draws ``counts`` (c_i(p) of each draw) of
        ``sources`` (None: source 0, one store)."""
        k = np.asarray(counts, dtype=np.int64)
        if sources is None or self.starts.shape[0] == 1:
            return k + self.prefix[0][np.searchsorted(self.starts[0], k, side="right")]
        src = np.asarray(sources, dtype=np.int64)
        out = k.copy()
        for i in np.unique(src).tolist():
            sel = src == i
            out[sel] += self.prefix[i][np.searchsorted(self.starts[i], k[sel], side="right")]
        return out
