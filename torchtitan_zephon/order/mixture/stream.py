"""The mixture's stream: a ``MixturePlan`` as sample keys over its layout.

Role: ``MixtureStream`` is the ``order.stream.StreamPlan`` of a mixture: it maps
positions (a mixture plan's positions) to sample keys ``source << 40 | id``
(``order.stream.make_keys``); its steps, rank slices, micro-batches and ranges are
the plan's layout's (``order.layout.Layout``), as for one store.

Invariant: the key of position p is ``make_keys`` of the plan's (source index,
sample id) of position p, whatever the call (one position, a step, a range of a rank's
stream), so the layout's invariants hold for a mixture as for one store.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.skips import MAX_STEP
from torchtitan_zephon.order.stream import (
    SourceShape,
    StepDraws,
    StreamPlan,
    make_keys,
    split_keys,
)


class MixtureStream(StreamPlan):
    """A ``MixturePlan`` as a stream of sample keys, over the plan's layout."""

    def __init__(self, mixture: MixturePlan) -> None:
        self.mixture = mixture
        self.layout = mixture.layout
        self.names = mixture.names

    def ids_for_positions(self, first: int, count: int) -> np.ndarray:
        return make_keys(*self.mixture.ids_for_positions(first, count))

    def _keys(self, first: int, count: int, step: int) -> np.ndarray:
        return make_keys(*self.mixture.ids_for_positions(first, count, step=step))

    def _range_keys(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """One permutation call per source and epoch for the whole range."""
        ranges = list(zip(starts.tolist(), counts.tolist(), strict=True))
        return make_keys(*self.mixture.ids_for_ranges(ranges))

    def positions_of(self, first: int, count: int) -> np.ndarray:
        """The stream position of each position [first, first + count) in its source's stream."""
        return self.mixture.source_positions([(first, count)])[1]

    def step_draws(self, step: int) -> StepDraws:
        mix = self.mixture
        return StepDraws(
            mix.step_counts(step), mix.counts_before(step + 1), mix.targets_before(step + 1)
        )

    def epochs_of_draws(self, drawn: np.ndarray) -> np.ndarray:
        mix = self.mixture
        drawn = np.asarray(drawn, dtype=np.int64)
        last = np.maximum(drawn - 1, 0)
        stream = mix.stream_positions(last, np.arange(last.size, dtype=np.int64))
        return np.where(drawn > 0, stream // mix.num_samples, 0)

    def source_shape(self, source: int) -> SourceShape:
        m = self.mixture
        return SourceShape(
            0,
            int(m.num_samples[source]),
            m.source_seeds[source],
            m.max_epochs[source],
            m.skip_map,
            m.exclusion_maps[source],
        )

    def place_of_draw(self, source: int, draw: int) -> tuple[int, int] | str:
        """The position of the source's draw: the first step whose end passes the draw (a
        doubling search, then bisection over the plan's O(sources) counts), then the
        draw's position among the step's positions of that source."""
        m = self.mixture

        def before(step: int) -> int:  # the source's draws in steps < step
            return int(m.counts_before(step)[source])

        hi = 1
        while before(hi + 1) <= draw:
            if hi >= MAX_STEP:
                return "not drawn"
            hi = min(2 * hi, MAX_STEP)
        lo = 1
        while lo < hi:
            mid = (lo + hi) // 2
            if before(mid + 1) > draw:
                hi = mid
            else:
                lo = mid + 1
        if lo < self.anchor_step:
            return "trained"
        first, gbs = m.step_positions(lo)
        positions = np.nonzero(m.position_sources(first, gbs) == source)[0]
        return lo, int(positions[draw - before(lo)])

    def check_max_epochs(self, last_step: int) -> None:
        self.mixture.check_max_epochs(last_step)

    def deviation_report(self) -> tuple[Fraction, str, int]:
        return self.mixture.deviation_report()

    def decode(self, keys: np.ndarray) -> tuple[list[str], np.ndarray]:
        """(source name, per-source sample id) of each key."""
        sources, ids = split_keys(keys)
        return [self.names[i] for i in sources.tolist()], ids
