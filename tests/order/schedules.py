"""A fixed benchmark of mixture schedules (issue 19, point 5): deterministic random
weight and batch schedules, the yardstick any change of the mixture rule is measured on.

``random_schedules(seed, count, entries)`` gives ``count`` cases, each a dict with
  names    source names (2-6, distinct; in random order, so name order != list order)
  entries  [(from_step, {name: Decimal weight})], from_step 1 first, strictly
           increasing; with entries=(2, 4) every entry changes the weights of the one
           before (1-3 real weight changes)
  batch    [(start_step, gbs)]: 1-3 entries, gbs 1-16
  horizon  60-200: every weight and batch change lies at or before it
The same seed gives the same cases on every Python (only ``random.Random`` is used).
"""

from __future__ import annotations

import random
from decimal import Decimal

NAMES = ["web", "code", "math", "wiki", "books", "a", "zz", "q7"]
# 0 twice (as likely as any two decimals), 0.001, and a few decimals: 1/3-ish,
# quarters, tenths, integers (normalized by the sum, so 2 next to 0.5 is 0.8).
WEIGHTS = ["0", "0", "0.001", "0.1", "0.25", "0.333", "0.5", "0.7", "0.75", "1", "2", "3"]
CHANGES_SEED, SINGLE_SEED = 195, 1951


def _weights(rng: random.Random, names: list[str]) -> dict[str, Decimal]:
    w = {x: Decimal(rng.choice(WEIGHTS)) for x in names}
    if all(v == 0 for v in w.values()):
        w[rng.choice(names)] = Decimal(1)
    return w


def _same(a: dict[str, Decimal], b: dict[str, Decimal]) -> bool:
    """Equal after normalization (the plan merges such entries)."""
    sa, sb = sum(a.values()), sum(b.values())
    return all(a[x] * sb == b[x] * sa for x in a)


def random_schedules(seed: int, count: int, entries: tuple[int, int] = (2, 4)) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        names = rng.sample(NAMES, rng.randint(2, 6))
        horizon = rng.randint(60, 200)
        k = rng.randint(*entries)
        starts = [1, *sorted(rng.sample(range(2, horizon + 1), k - 1))]
        sched: list[tuple[int, dict[str, Decimal]]] = []
        for s in starts:
            w = _weights(rng, names)
            while sched and _same(sched[-1][1], w):
                w = _weights(rng, names)
            sched.append((s, w))
        b = rng.randint(1, 3)
        bstarts = [1, *sorted(rng.sample(range(2, horizon + 1), b - 1))]
        batch = [(s, rng.randint(1, 16)) for s in bstarts]
        out.append({"names": names, "entries": sched, "batch": batch, "horizon": horizon})
    return out


def with_changes(count: int = 3000) -> list[dict]:
    """Schedules with 2-4 weight entries."""
    return random_schedules(CHANGES_SEED, count, (2, 4))


def single_entry(count: int = 500) -> list[dict]:
    """Schedules with one weight entry (any batch schedule)."""
    return random_schedules(SINGLE_SEED, count, (1, 1))
