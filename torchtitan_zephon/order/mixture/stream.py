"""The mixture's stream: a ``MixturePlan`` as sample keys over its layout.

Role: ``MixtureStream`` is the ``order.stream.StreamPlan`` of a mixture: it maps
positions (a mixture plan's slots) to sample keys ``source << 40 | id``
(``order.stream.make_keys``); its steps, rank slices, micro-batches and windows are
the plan's layout's (``order.layout.Layout``), as for one store.

Invariant: the key of position p is ``make_keys`` of the plan's (source index,
sample id) of slot p, whatever the call (one position, a step, a window of a rank's
stream), so the layout's invariants hold for a mixture as for one store.
"""

from __future__ import annotations

import numpy as np

from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.stream import StreamPlan, make_keys, split_keys


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

    def positions_of(self, first: int, count: int) -> np.ndarray:
        """The stream position of each slot [first, first + count) in its source's stream."""
        return self.mixture.slot_positions([(first, count)])[1]

    def decode(self, keys: np.ndarray) -> tuple[list[str], np.ndarray]:
        """(source name, per-source sample id) of each key."""
        sources, ids = split_keys(keys)
        return [self.names[i] for i in sources.tolist()], ids
