"""Mixtures: exact proportions, weight 0 means none, pure in the past, elastic, parsed strictly."""

import itertools
import json
import math
import re
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from torchtitan_zephon.job.stores import open_mixture_stores
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MAX_PATTERN, MixtureConfig, MixtureError
from torchtitan_zephon.order.mixture.plan import MixturePlan, deviation_warning, source_seed
from torchtitan_zephon.order.mixture.spec import (
    MixtureSpec,
    past_change,
    past_changes,
    resolve_mixture,
)
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.stream import DataPlan, split_keys

NAMES = ["web", "code", "math", "wiki", "books", "a", "zz", "q7"]
WEIGHTS = [0, 0, 1, 2, 3, 7, Decimal("0.001"), Decimal("0.1"), Decimal("0.25"), Decimal("0.7")]


def least_worst(
    deficit: list[Fraction], w: list[Fraction], gbs: int, names: list[str]
) -> list[int]:
    """Slow reference for a corrected step: the counts (>= 0, weight 0 gets none,
    summing to gbs) with the least worst |deficit - count| among the sources of
    weight > 0, found by trying every candidate worst value in increasing order; at
    that value each source gets the fewest counts within it, the rest one by one to
    the largest remaining deficit (ties: smaller name)."""
    n = len(w)
    active = [i for i in range(n) if w[i] > 0]
    values = sorted({abs(deficit[i] - k) for i in active for k in range(0, 4 * gbs + 8)})
    for d in values:
        lo = {i: max(0, math.ceil(deficit[i] - d)) for i in active}
        hi = {i: math.floor(deficit[i] + d) for i in active}
        if any(lo[i] > hi[i] for i in active) or not sum(lo.values()) <= gbs <= sum(hi.values()):
            continue
        for _ in range(gbs - sum(lo.values())):
            j = min(
                (i for i in active if lo[i] < hi[i]), key=lambda i: (lo[i] - deficit[i], names[i])
            )
            lo[j] += 1
        return [lo.get(i, 0) for i in range(n)]
    raise AssertionError("no counts")


def replay(spec: MixtureSpec, batch: BatchSchedule, steps: int) -> list[list[int]]:
    """Slow reference: every position from step 1, exact fractions, no tables, no heaps.

    Earliest deadline first on Tijdeman's windows: with m sources of weight > 0
    and d = 1/(2m-2), a source may take a position when deficit + weight >= d; its
    deadline is floor((1 - d - deficit) / weight) positions from now; ties go to
    the smaller name; without a candidate the largest deficit + weight wins.
    A step whose end would leave a source of weight > 0 more than 1 from its
    target takes ``least_worst`` counts instead when they leave those sources'
    worst smaller, its k-th sample of a source at (2k+1)/(2 count) of the step
    (ties: smaller name).
    """
    names = spec.names
    n = len(names)
    deficit = [Fraction(0)] * n
    out = []
    for step in range(1, steps + 1):
        entry = [e for e in spec.schedule if e.from_step <= step][-1]
        w = [entry.weights[x] for x in names]
        active = [i for i in range(n) if w[i] > 0]
        row = []
        before = list(deficit)
        for _ in range(batch.gbs(step)):
            if len(active) == 1:
                j = active[0]
            else:
                d = Fraction(1, 2 * len(active) - 2)
                cand = [i for i in active if deficit[i] + w[i] >= d]
                if cand:
                    j = min(cand, key=lambda i: (math.floor((1 - d - deficit[i]) / w[i]), names[i]))
                else:
                    j = min(active, key=lambda i: (-(deficit[i] + w[i]), names[i]))
            for i in range(n):
                deficit[i] += w[i]
            deficit[j] -= 1
            row.append(j)
        pattern_worst = max(abs(deficit[i]) for i in active)
        g = batch.gbs(step)
        after = [before[i] + w[i] * g for i in range(n)]
        counts = least_worst(after, w, g, names) if pattern_worst > 1 else None
        if counts and max(abs(after[i] - counts[i]) for i in active) < pattern_worst:
            positions = [
                (Fraction(2 * k + 1, 2 * c), names[i], i)
                for i, c in enumerate(counts)
                for k in range(c)
            ]
            row = [i for _, _, i in sorted(positions)]
            deficit = [after[i] - counts[i] for i in range(n)]
        out.append(row)
    return out


def exact_targets(spec: MixtureSpec, batch: BatchSchedule, steps: int) -> list[list[Fraction]]:
    """targets[s][i] = sum over t <= s of w_i(t) x GBS(t) (targets[0] = 0)."""
    out = [[Fraction(0)] * len(spec.names)]
    for step in range(1, steps + 1):
        entry = [e for e in spec.schedule if e.from_step <= step][-1]
        out.append(
            [
                t + entry.weights[x] * batch.gbs(step)
                for t, x in zip(out[-1], spec.names, strict=True)
            ]
        )
    return out


@st.composite
def mixtures(draw, max_sources=6, max_entries=4, max_start=30):
    n = draw(st.integers(1, max_sources))
    names = draw(st.permutations(NAMES))[:n]
    k = draw(st.integers(1, max_entries))
    starts = [1, *sorted(draw(st.sets(st.integers(2, max_start), min_size=k - 1, max_size=k - 1)))]
    entries = []
    for s in starts:
        w = {x: draw(st.sampled_from(WEIGHTS)) for x in names}
        if all(v == 0 for v in w.values()):
            w[names[draw(st.integers(0, n - 1))]] = 1
        entries.append((s, w))
    sizes = {x: draw(st.integers(1, 60)) for x in names}
    return MixtureSpec.build(sizes, entries)


@st.composite
def batch_schedules(draw, max_gbs=16):
    k = draw(st.integers(1, 3))
    starts = sorted(draw(st.sets(st.integers(2, 30), min_size=k - 1, max_size=k - 1)))
    sizes = draw(st.lists(st.integers(1, max_gbs), min_size=k, max_size=k))
    return BatchSchedule(list(zip([1, *starts], sizes, strict=True)))


def weights_at(spec: MixtureSpec, step: int) -> list[Fraction]:
    entry = [e for e in spec.schedule if e.from_step <= step][-1]
    return [entry.weights[x] for x in spec.names]


# ---------------------------------------------------------------- the engine


@settings(max_examples=40, deadline=None)
@given(spec=mixtures(), batch=batch_schedules(), seed=st.integers(0, 2**40))
def test_plan_equals_slow_replay_and_accounts_exactly(spec, batch, seed):
    plan = MixturePlan(spec, seed, batch)
    steps = 40
    ref = replay(spec, batch, steps)
    targets = exact_targets(spec, batch, steps)
    n = len(spec.names)
    counts = np.zeros(n, dtype=np.int64)
    worst = Fraction(0)
    for step in range(1, steps + 1):
        assert np.array_equal(plan.counts_before(step), counts)
        assert plan.targets_before(step) == targets[step - 1]
        src, _ = plan.global_ids(step)
        assert src.tolist() == ref[step - 1]
        per_step = np.bincount(src, minlength=n)
        assert per_step.sum() == batch.gbs(step)
        assert np.array_equal(plan.step_counts(step), per_step)
        for i, w in enumerate(weights_at(spec, step)):
            if w == 0:
                assert per_step[i] == 0  # weight 0: nothing, not even an owed sample
        counts += per_step
        worst = max(worst, *(abs(t - c) for t, c in zip(targets[step], counts, strict=True)))
    assert worst <= plan.max_deviation()[0]


@settings(max_examples=30, deadline=None)
@given(
    weights=st.lists(
        st.sampled_from([0, Decimal("0.001"), 1, 2, Decimal("0.5"), 5]), min_size=1, max_size=40
    ),
    batch=batch_schedules(max_gbs=24),
    data=st.data(),
)
def test_one_entry_stays_within_one_sample_at_every_step(weights, batch, data):
    assume(any(w != 0 for w in weights))
    names = [f"s{k:02d}" for k in range(len(weights))]
    names = data.draw(st.permutations(names))
    spec = MixtureSpec.build(
        {x: 1000 for x in names}, [(1, dict(zip(names, weights, strict=True)))]
    )
    plan = MixturePlan(spec, 0, batch)
    m = sum(w != 0 for w in weights)
    bound = Fraction(0) if m == 1 else 1 - Fraction(1, 2 * m - 2)
    steps = 60
    targets = exact_targets(spec, batch, steps)
    for step in range(1, steps + 1):
        counts = plan.counts_before(step + 1)
        assert max(abs(t - c) for t, c in zip(targets[step], counts, strict=True)) <= bound
    assert plan.max_deviation()[0] <= bound < 1


@settings(max_examples=25, deadline=None)
@given(spec=mixtures(), batch=batch_schedules(max_gbs=8), data=st.data())
def test_lookup_at_a_random_step_equals_replay(spec, batch, data):
    plan = MixturePlan(spec, 7, batch)
    step = data.draw(st.integers(1, 250))
    ref = replay(spec, batch, step)
    assert plan.global_ids(step)[0].tolist() == ref[-1]
    earlier = np.array([j for row in ref[:-1] for j in row], dtype=np.int64)
    counts = np.bincount(earlier, minlength=len(spec.names))
    assert np.array_equal(plan.counts_before(step), counts)


def test_far_steps_follow_the_period():
    # One entry, constant GBS: the position pattern repeats every `period` positions, so
    # step s and step s + period draw from the same sources.
    spec = MixtureSpec.build(
        {"web": 10**9, "code": 10**7, "math": 10**5},
        [(1, {"web": Decimal("0.637"), "code": Decimal("0.281"), "math": Decimal("0.082")})],
    )
    gbs = 24
    plan = MixturePlan(spec, 3, BatchSchedule([(1, gbs)]))
    period = spec.schedule[0].period
    assert period == 1000
    per_period = np.array([637, 281, 82]) * gbs
    for s in (5, 10**6 + 3, 10**9, 10**12 + 11):
        src, ids = plan.global_ids(s)
        src2, _ = plan.global_ids(s + period)
        assert np.array_equal(src, src2)
        assert np.array_equal(plan.counts_before(s + period), plan.counts_before(s) + per_period)
        assert np.array_equal(
            plan.counts_before(s + 1), plan.counts_before(s) + np.bincount(src, minlength=3)
        )
        assert ((ids >= 0) & (ids < plan.num_samples[src])).all()
    assert np.array_equal(plan.counts_before(10**9 + 1), np.array([637, 281, 82]) * gbs * 10**6)


@settings(max_examples=25, deadline=None)
@given(spec=mixtures(), batch=batch_schedules(), k=st.integers(1, 35), data=st.data())
def test_appended_entries_and_late_sources_keep_the_past(spec, batch, k, data):
    past = [e for e in spec.schedule if e.from_step <= k]
    appended = []
    for s in sorted(data.draw(st.sets(st.integers(k + 1, k + 20), max_size=3))):
        w = {x: data.draw(st.sampled_from(WEIGHTS)) for x in [*spec.names, "late"]}
        w["late"] = w["late"] or 1  # the new source joins
        appended.append((s, w))
    sizes = {s.name: s.num_samples for s in spec.sources}
    longer = MixtureSpec.build(
        {**sizes, "late": 17},
        [(e.from_step, {**e.weights, "late": 0}) for e in past] + appended,
    )
    assert past_change(spec, longer, k) is None
    a, b = MixturePlan(spec, 11, batch), MixturePlan(longer, 11, batch)
    for step in range(1, k + 1):
        (sa, ia), (sb, ib) = a.global_ids(step), b.global_ids(step)
        assert [a.names[i] for i in sa] == [b.names[i] for i in sb]
        assert np.array_equal(ia, ib)
    if appended:
        assert b.step_counts(appended[0][0])[-1] >= 0  # the late source is drawable from there


def test_past_change_names_the_first_difference():
    sizes = {"web": 100, "code": 50}
    base = MixtureSpec.build(sizes, [(1, {"web": 7, "code": 3}), (10, {"web": 1, "code": 1})])
    same = MixtureSpec.build(
        sizes, [(1, {"web": "7/10", "code": "3/10"}), (10, {"web": 5, "code": 5})]
    )
    assert past_change(base, same, 100) is None  # normalized weights are compared
    edited = MixtureSpec.build(sizes, [(1, {"web": 7, "code": 3}), (10, {"web": 2, "code": 1})])
    assert past_change(base, edited, 9) is None
    msg = past_change(base, edited, 10)
    assert "schedule entry 2 (from_step 10)" in msg and "'code' was 1/2, now 1/3" in msg
    moved = MixtureSpec.build(sizes, [(1, {"web": 7, "code": 3}), (8, {"web": 1, "code": 1})])
    assert "from_step was 10, now 8" in past_change(base, moved, 12)
    assert "was added" in past_change(base.__class__(base.sources, base.schedule[:1]), base, 10)
    smaller = MixtureSpec.build(
        {"web": 100, "code": 49}, [(1, {"web": 7, "code": 3}), (10, {"web": 1, "code": 1})]
    )
    assert "source 'code': num_samples was 50, now 49" in past_change(base, smaller, 1)
    unused = MixtureSpec.build(
        {"web": 100, "code": 50, "math": 5},
        [(1, {"web": 7, "code": 3, "math": 0}), (10, {"web": 1, "code": 1, "math": 1})],
    )
    assert past_change(base, unused, 9) is None
    assert "weight of source 'code' was 1/2, now 1/3" in past_change(base, unused, 10)
    repeated = MixtureSpec.build(sizes, [(1, {"web": 7, "code": 3}), (4, {"web": 7, "code": 3})])
    assert past_change(base.__class__(base.sources, base.schedule[:1]), repeated, 9) is None


@settings(max_examples=30, deadline=None)
@given(spec=mixtures(), data=st.data())
def test_rank_slices_and_microbatches_concatenate_to_the_global_batch(spec, data):
    gbs = data.draw(st.integers(1, 48))
    plan = MixturePlan(spec, 5, BatchSchedule([(1, gbs)]))
    stream = MixtureStream(plan)
    divisors = [d for d in range(1, gbs + 1) if gbs % d == 0]
    for step in (1, 2, data.draw(st.integers(3, 10**9))):
        src, ids = plan.global_ids(step)
        for d in divisors:
            parts = [split_keys(stream.rank_ids(step, r, d)) for r in range(d)]
            assert np.array_equal(np.concatenate([p[0] for p in parts]), src)
            assert np.array_equal(np.concatenate([p[1] for p in parts]), ids)
        d = data.draw(st.sampled_from(divisors))
        b = data.draw(st.sampled_from([x for x in divisors if (gbs // d) % x == 0]))
        micro = [split_keys(m) for r in range(d) for m in stream.microbatch_ids(step, r, d, b)]
        assert all(len(m[1]) == b for m in micro)
        assert np.array_equal(np.concatenate([m[1] for m in micro]), ids)
    with pytest.raises(ValueError, match="DP degrees that divide it"):
        stream.rank_ids(1, 0, gbs + 1)


@settings(max_examples=20, deadline=None)
@given(spec=mixtures(max_sources=4), seed=st.integers(0, 2**32), gbs=st.integers(1, 12))
def test_each_source_epoch_is_a_permutation(spec, seed, gbs):
    plan = MixturePlan(spec, seed, BatchSchedule([(1, gbs)]))
    n = len(spec.names)
    streams: list[list[int]] = [[] for _ in range(n)]
    step = 1
    while step < 400 and any(
        len(streams[i]) < 2 * plan.num_samples[i]
        for i in range(n)
        if weights_at(spec, 10**6)[i] > 0
    ):
        src, ids = plan.global_ids(step)
        for i, x in zip(src.tolist(), ids.tolist(), strict=True):
            streams[i].append(x)
        step += 1
    assert np.array_equal(plan.epochs(step), plan.counts_before(step) // plan.num_samples)
    for i in range(n):
        k = int(plan.num_samples[i])
        for e in range(len(streams[i]) // k):
            assert sorted(streams[i][e * k : (e + 1) * k]) == list(range(k))
        # Source i's stream is its own keyed permutation, epoch after epoch.
        own = DataPlan(k, source_seed(seed, spec.names[i]), BatchSchedule([(1, 1)]))
        assert streams[i] == own.ids_for_positions(0, len(streams[i])).tolist()


def test_source_order_and_other_sources_do_not_change_a_source_stream():
    sizes = {"web": 40, "code": 15, "math": 9}
    sched = [(1, {"web": 5, "code": 3, "math": 2}), (6, {"web": 1, "code": 0, "math": 1})]
    a = MixtureSpec.build(sizes, sched)
    b = MixtureSpec.build(dict(reversed(sizes.items())), sched)
    pa, pb = MixturePlan(a, 9, BatchSchedule([(1, 8)])), MixturePlan(b, 9, BatchSchedule([(1, 8)]))
    for step in range(1, 30):
        (sa, ia), (sb, ib) = pa.global_ids(step), pb.global_ids(step)
        assert [pa.names[i] for i in sa] == [pb.names[i] for i in sb]
        assert np.array_equal(ia, ib)
    # Adding a source changes the position pattern, never another source's order of samples.
    c = MixtureSpec.build({**sizes, "extra": 30}, [(1, {**sched[0][1], "extra": 4})])
    pc = MixturePlan(c, 9, BatchSchedule([(1, 8)]))
    web_a = np.concatenate([pa.global_ids(s)[1][pa.global_ids(s)[0] == 0] for s in range(1, 6)])
    web_c = np.concatenate([pc.global_ids(s)[1][pc.global_ids(s)[0] == 0] for s in range(1, 12)])
    k = min(len(web_a), len(web_c))
    assert k > 10 and np.array_equal(web_a[:k], web_c[:k])


def test_max_epochs_is_a_clear_error_at_the_right_step():
    spec = MixtureSpec.build(
        {"web": 1000, "code": 10}, [(1, {"web": 1, "code": 1})], max_epochs={"code": 2}
    )
    plan = MixturePlan(spec, 0, BatchSchedule([(1, 4)]))
    plan.check_max_epochs(10)  # 10 steps x 2 code samples = 20 = 2 epochs: allowed
    plan.global_ids(10)
    assert plan.epochs(11).tolist() == [0, 2]
    with pytest.raises(MixtureError, match=r"'code' runs past max_epochs=2 at step 11"):
        plan.global_ids(11)
    with pytest.raises(MixtureError, match=r"'code' runs past max_epochs=2 at step 11: it has 10"):
        plan.check_max_epochs(500)


def test_small_source_warning():
    spec = MixtureSpec.build(
        {"web": 1000, "tiny": 3}, [(1, {"web": 1, "tiny": 1}), (5, {"web": 1, "tiny": 0})]
    )
    plan = MixturePlan(spec, 0, BatchSchedule([(1, 4), (3, 16)]))
    assert len(plan.warnings) == 1
    assert (
        "'tiny' has 3 training samples but weight 1/2 of a global batch of 16" in plan.warnings[0]
    )
    assert MixturePlan(spec, 0, BatchSchedule([(1, 6)])).warnings == []


@settings(max_examples=40, deadline=None)
@given(spec=mixtures(), batch=batch_schedules())
def test_a_step_ends_more_than_one_sample_off_only_when_no_counts_do_better(spec, batch):
    """The one-sample bound at every step end for the sources the step draws from,
    except where the step's weights make it unreachable from where the earlier steps
    left off: then no counts of that step (weight 0 gets none) leave a smaller worst."""
    plan = MixturePlan(spec, 0, batch)
    names = spec.names
    targets = exact_targets(spec, batch, 40)
    for step in range(1, 41):
        w = weights_at(spec, step)
        before = plan.counts_before(step)
        after = plan.counts_before(step + 1)
        ends = [abs(t - int(c)) for t, c, x in zip(targets[step], after, w, strict=True) if x > 0]
        if max(ends) <= 1:
            continue
        deficit = [t - int(c) for t, c in zip(targets[step], before, strict=True)]
        best = least_worst(deficit, w, batch.gbs(step), names)
        assert max(ends) == max(
            abs(d - k) for d, k, x in zip(deficit, best, w, strict=True) if x > 0
        )


def test_corrections_that_recur_repeat_as_a_block():
    """After a weight change the earliest-deadline pattern can miss the bound once
    per period; each miss is corrected, and once the residuals after a corrected
    step recur the steps between repeat (until the batch size changes): the far
    steps equal the slow replay and advance by the block's counts."""
    w1 = {"a": Decimal("0.5"), "b": Decimal("0.123"), "c": Decimal("0.7")}
    w2 = {"a": 1, "b": Decimal("0.3"), "c": Decimal("0.001")}
    w3 = {"a": Decimal("0.3"), "b": Decimal("0.5"), "c": 0}
    spec = MixtureSpec.build(dict.fromkeys("abc", 1000), [(1, w1), (16, w2), (18, w3)])
    batch = BatchSchedule([(1, 11), (16, 11), (900, 5)])
    plan = MixturePlan(spec, 0, batch)
    repeats = [s for s in plan.segments if hasattr(s, "block")]
    assert len(repeats) >= 2 and plan.first_correction is not None
    steps = 1000
    ref = replay(spec, batch, steps)
    assert [plan.global_ids(s)[0].tolist() for s in range(1, steps + 1)] == ref
    targets = exact_targets(spec, batch, steps)
    worst = max(
        abs(t - int(c))
        for s in range(1, steps + 1)
        for t, c in zip(targets[s], plan.counts_before(s + 1), strict=True)
    )
    assert worst <= 1 and worst == plan.max_deviation()[0]
    last = repeats[-1]
    for s in (10**6, 10**9 + 7):
        ahead = plan.counts_before(s + last.span) - plan.counts_before(s)
        assert np.array_equal(ahead, last.delta)
        assert np.array_equal(plan.global_ids(s)[0], plan.global_ids(s + last.span)[0])


def test_a_long_run_of_corrected_steps_equals_the_replay():
    """A tiny weight next to a source of weight 0 that is ahead: the pattern misses
    the bound at every step for hundreds of steps; each is corrected (no cap cuts
    in), and the plan stays the slow replay, within one sample throughout."""
    spec = MixtureSpec.build(
        {"x": 100, "y": 100, "z": 100},
        [
            (1, {"x": 2, "y": 1, "z": 5}),
            (3, {"x": Decimal("0.0005"), "y": Decimal("0.9995"), "z": 0}),
        ],
    )
    batch = BatchSchedule([(1, 1)])
    plan = MixturePlan(spec, 0, batch)
    assert plan.corrected_steps > 256
    steps = 2500
    ref = replay(spec, batch, steps)
    assert [plan.global_ids(s)[0].tolist() for s in range(1, steps + 1)] == ref
    assert plan.max_deviation()[0] <= 1


def test_an_entry_appended_inside_a_repeat_keeps_every_step_before_it():
    """Corrections that recur become a repeated block; a weight or batch-size entry
    appended later cuts the block (its last repetition partial) and changes no
    step before it."""
    sizes = {"x": 100, "y": 100, "z": 100}
    base = [
        (1, {"x": 2, "y": 1, "z": 5}),
        (3, {"x": Decimal("0.001"), "y": Decimal("0.999"), "z": 0}),
    ]
    plan = MixturePlan(MixtureSpec.build(sizes, base), 0, BatchSchedule([(1, 1)]))
    assert any(hasattr(s, "block") for s in plan.segments)
    cases = [
        (2003, MixtureSpec.build(sizes, [*base, (2003, {"x": 1, "y": 1, "z": 1})]), [(1, 1)]),
        (2003, MixtureSpec.build(sizes, base), [(1, 1), (2003, 2)]),
        (1504, MixtureSpec.build(sizes, base), [(1, 1), (1504, 2)]),
    ]
    for k, spec, batch in cases:
        other = MixturePlan(spec, 0, BatchSchedule(batch))
        for s in range(1, k):
            assert other.global_ids(s)[0].tolist() == plan.global_ids(s)[0].tolist(), s
        assert np.array_equal(other.counts_before(k), plan.counts_before(k))


def test_weight_changes_can_force_more_than_one_sample():
    """Why the one-sample bound is promised for one schedule entry only.

    Six sources at 1/6 and GBS 3: step 1 serves three of them (a fourth would
    put one source 1.5 ahead). If an entry appended from step 2 gives those
    three 1/9, 1/9, 7/9 and the others 0, every step-2 assignment leaves one
    source 7/6 from its target: a pure plan cannot know at step 1 which three
    the future will favour, and weight 0 forbids serving the others.
    """
    names = ["s1", "s2", "s3", "s4", "s5", "s6"]
    sizes = dict.fromkeys(names, 100)
    uniform = [(1, dict.fromkeys(names, 1))]
    batch = BatchSchedule([(1, 3)])
    served = [
        names[i] for i in MixturePlan(MixtureSpec.build(sizes, uniform), 0, batch).global_ids(1)[0]
    ]
    assert len(set(served)) == 3
    x, y, z = sorted(served)
    later = {**dict.fromkeys(names, 0), x: Fraction(1, 9), y: Fraction(1, 9), z: Fraction(7, 9)}
    spec = MixtureSpec.build(sizes, uniform + [(2, later)])
    plan = MixturePlan(spec, 0, batch)
    assert [names[i] for i in plan.global_ids(1)[0]] == served  # the past is kept
    targets = exact_targets(spec, batch, 2)[2]
    engine = max(abs(t - c) for t, c in zip(targets, plan.counts_before(3), strict=True))
    assert engine == plan.max_deviation()[0] == Fraction(7, 6)
    worst, who, step = plan.deviation_report()
    assert (worst, step) == (Fraction(7, 6), 2) and who in (x, y, z)
    assert deviation_warning(worst, who, step).startswith(
        f"mixture source {who!r} ends step 2 1.167 samples (7/6) from its exact target, more "
        "than one: from the counts the earlier steps left, no counts of that step keep every "
        "source within one sample"
    )
    assert deviation_warning(Fraction(1), who, 2) is None
    # No assignment of any step 1 within one sample, followed by that step 2, does better.
    best = None
    for first in itertools.combinations(range(6), 3):  # step 1 must serve 3 distinct sources
        fav = sorted(first)
        weights2 = [0] * 6
        weights2[fav[0]], weights2[fav[1]], weights2[fav[2]] = (
            Fraction(1, 9),
            Fraction(1, 9),
            Fraction(7, 9),
        )
        for second in itertools.product(fav, repeat=3):
            counts = np.bincount(list(first) + list(second), minlength=6)
            dev = max(abs(Fraction(1, 2) + 3 * weights2[i] - counts[i]) for i in range(6))
            best = dev if best is None else min(best, dev)
    assert best == Fraction(7, 6)


# ------------------------------------------------------------------ parsing

GOOD = """
[[source]]
name = "web"
store = "/data/web"

[[source]]
name = "code"
store = "stores/code"
heldout_samples = 8
max_epochs = 3

[[schedule]]
from_step = 1
weights = { web = 0.7, code = 0.3 }

[[schedule]]
from_step = 5000
weights = { web = 0.5, code = 0.5 }
"""


def test_parse_file_relative_store_and_json_round_trip(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text(GOOD)
    cfg = MixtureConfig.load(path)
    assert cfg.names == ["web", "code"]
    assert cfg.sources[0].store == "/data/web"
    assert cfg.sources[1].store == str(tmp_path.resolve() / "stores" / "code")
    assert (cfg.sources[1].heldout_samples, cfg.sources[1].max_epochs) == (8, 3)
    assert cfg.sources[0].heldout_samples is None
    assert cfg.schedule[0].weights == {"web": Fraction(7, 10), "code": Fraction(3, 10)}
    assert cfg.schedule[1].from_step == 5000
    assert MixtureConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_decimal_weights_are_exact():
    def weights(text):
        cfg = MixtureConfig.loads(
            '[[source]]\nname="a"\nstore="x"\n[[source]]\nname="b"\nstore="y"\n'
            '[[source]]\nname="c"\nstore="z"\n[[schedule]]\nfrom_step=1\n' + f"weights = {text}\n"
        )
        return [cfg.schedule[0].weights[k] for k in "abc"]

    # As binary floats 0.1 + 0.2 != 0.3 and 0.1 + 0.2 + 0.7 != 1; taken as written they are exact.
    assert weights("{ a = 0.1, b = 0.2, c = 0.7 }") == [
        Fraction(1, 10),
        Fraction(1, 5),
        Fraction(7, 10),
    ]
    assert weights("{ a = 0.1, b = 0.2, c = 0.3 }") == [
        Fraction(1, 6),
        Fraction(1, 3),
        Fraction(1, 2),
    ]
    third = Fraction(1, 3)
    assert weights("{ a = 0.3333333, b = 0.3333333, c = 0.3333333 }") == [third] * 3
    assert weights("{ a = 1, b = 1, c = 1 }") == [third] * 3
    assert weights("{ a = 1e-3, b = 0, c = 0.999 }") == [Fraction(1, 1000), 0, Fraction(999, 1000)]


TWO = '[[source]]\nname = "web"\nstore = "w"\n[[source]]\nname = "code"\nstore = "c"\n'


@pytest.mark.parametrize(
    "text, message",
    [
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=-0.5, code=1}",
            "source 'web': weight must be >= 0, found -0.5",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=nan, code=1}",
            "weight must be finite, found NaN",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=inf, code=1}",
            "weight must be finite, found Infinity",
        ),
        (TWO + "[[schedule]]\nfrom_step=1\nweights={web=0, code=0.0}", "all weights are 0"),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=1, code=1, math=1}",
            "unknown source 'math'; declared sources: ['web', 'code']",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=1}",
            "no weight for source 'code'; give every source a weight (0 leaves it out",
        ),
        (TWO + "[[schedule]]\nfrom_step=1\nweights={web=1, web=2, code=1}", "not valid TOML"),
        (
            TWO
            + '[[source]]\nname = "web"\nstore = "x"\n[[schedule]]\nfrom_step=1\nweights={web=1, code=1}',
            "source 'web' is declared twice",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=2\nweights={web=1, code=1}",
            "the first entry must start at from_step = 1",
        ),
        (
            TWO
            + "[[schedule]]\nfrom_step=1\nweights={web=1, code=1}\n[[schedule]]\nfrom_step=1\nweights={web=1, code=2}",
            "from_step must be strictly increasing, found 1 then 1",
        ),
        (
            TWO
            + "[[schedule]]\nfrom_step=1\nweights={web=1, code=1}\n[[schedule]]\nfrom_step=0\nweights={web=1, code=2}",
            "from_step must be an integer >= 1, found 0",
        ),
        (
            TWO + '[[schedule]]\nfrom_step=1\nweights={web="0.5", code=1}',
            "found the string '0.5'; remove the quotes",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=true, code=1}",
            "weight must be a number (like 0.7 or 3), found true.",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1.5\nweights={web=1, code=1}",
            "from_step must be an integer >= 1, found 1.5.",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=[1, 2], code={a=1}}",
            "weight must be a number (like 0.7 or 3), found [1, 2].",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights=[0.5, 0.5]",
            "needs weights = { source = weight, ... }, found [0.5, 0.5].",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1",
            "needs weights = { source = weight, ... }, found nothing.",
        ),
        (
            '[[source]]\nname = 3\nstore = "w"\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            "source 1 needs a non-empty name string, found 3.",
        ),
        (
            '[[source]]\nname = "web"\nstore = 1979-05-27\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            'or "builtin:docs" / "builtin:stdlib", found 1979-05-27.',
        ),
        (
            '[[source]]\nname = "web"\nstore = "w"\nmax_epochs = 2.0\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            "max_epochs must be an integer >= 1, found 2.0.",
        ),
        (
            '[[source]]\nname = "web"\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            "source 'web' needs store = a token store path",
        ),
        (
            '[[source]]\nstore = "w"\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            "source 1 needs a non-empty name string",
        ),
        (
            '[[source]]\nname = "web"\nstore = "w"\nweight = 1\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            "unknown keys ['weight']",
        ),
        (TWO + "[[schedule]]\nfrom_step=1\nweight={web=1, code=1}", "unknown keys ['weight']"),
        (TWO, "needs at least one [[schedule]] entry"),
        ("[[schedule]]\nfrom_step=1\nweights={web=1}", "needs at least one [[source]]"),
        ("steps = 3\n" + TWO, "unknown top-level keys ['steps']"),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=0.1234567, code=0.8765432}",
            f"over the cap of {MAX_PATTERN} slots",
        ),
        (
            TWO + "[[schedule]]\nfrom_step=1\nweights={web=1, code=}\n",
            "not valid TOML",
        ),
        (
            '[[source]]\nname = "web"\nstore = "w"\nheldout_samples = -1\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            "heldout_samples must be an integer >= 0, found -1",
        ),
        (
            '[[source]]\nname = "web"\nstore = "w"\nmax_epochs = 0\n[[schedule]]\nfrom_step=1\nweights={web=1}',
            "max_epochs must be an integer >= 1, found 0",
        ),
    ],
)
def test_bad_mixtures_are_refused_with_a_clear_message(text, message):
    with pytest.raises(MixtureError) as e:
        MixtureConfig.loads(text, origin="mixture file 'm.toml'")
    assert message in str(e.value)
    assert str(e.value).startswith("mixture file 'm.toml'")
    for python in ("Decimal(", "NoneType", "True", "False", "None", "<class", "datetime."):
        assert python not in str(e.value), str(e.value)  # TOML's words, not Python's


def test_saved_mixture_json_is_named_in_json_words():
    """A saved mixture config (JSON: null, true) is reported as written, never as Python."""
    good = {"sources": [{"name": "web", "store": "w"}], "schedule": [{"from_step": 1}]}
    cases = [(None, "found null"), ({"web": None}, "found null"), ({"web": True}, "found true")]
    for weights, found in cases:
        data = {**good, "schedule": [{"from_step": 1, "weights": weights}]}
        with pytest.raises(MixtureError) as e:
            MixtureConfig.from_json(data)
        assert found in str(e.value) and "None" not in str(e.value), str(e.value)
    with pytest.raises(MixtureError, match=r"from_step must be an integer >= 1, found null\."):
        MixtureConfig.from_json({**good, "schedule": [{"from_step": None, "weights": {}}]})


def test_missing_file_and_missing_store(tmp_path):
    with pytest.raises(MixtureError, match="cannot read mixture file .*nope.toml"):
        MixtureConfig.load(tmp_path / "nope.toml")
    (tmp_path / "m.toml").write_text(TWO + "[[schedule]]\nfrom_step=1\nweights={web=1, code=1}")
    cfg = MixtureConfig.load(tmp_path / "m.toml")
    with pytest.raises(MixtureError, match="mixture source 'web': token store .* does not exist"):
        open_mixture_stores(cfg)


def _fake(store, **changes):
    fields = {
        k: getattr(store, k)
        for k in ("fingerprint", "tokenizer_hash", "vocab_size", "eos_id", "dtype")
    }
    fields.update(changes)
    return SimpleNamespace(num_samples=store.num_samples, **fields)


def test_resolve_checks_stores_and_gives_the_canonical_spec(store, store_path):
    cfg = MixtureConfig.loads(
        f'[[source]]\nname = "web"\nstore = "{store_path}"\n'
        f'[[source]]\nname = "code"\nstore = "{store_path}"\nheldout_samples = 5\n'
        "[[schedule]]\nfrom_step = 1\nweights = { web = 0.75, code = 0.25 }\n"
    )
    stores = open_mixture_stores(cfg)
    total = store.num_samples(16)
    spec = resolve_mixture(cfg, stores, 16, default_heldout=2)
    assert [(s.num_samples, s.heldout_samples) for s in spec.sources] == [
        (total - 2, 2),
        (total - 5, 5),
    ]
    doc = spec.to_json()
    assert doc["sources"][0]["store_fingerprint"] == store.fingerprint
    assert doc["tokenizer_hash"] == store.tokenizer_hash
    assert doc["schedule"] == [{"from_step": 1, "weights": {"code": "1/4", "web": "3/4"}}]
    assert "store" not in doc["sources"][0]  # paths are not part of the data
    assert MixtureSpec.from_json(json.loads(json.dumps(doc))) == spec
    plan = MixturePlan(spec, 0, BatchSchedule([(1, 4)]))
    src, ids = plan.global_ids(3)
    assert (ids < plan.num_samples[src]).all()

    for field, value, label in [
        ("tokenizer_hash", "other", "tokenizer (sha256)"),
        ("vocab_size", 7, "vocabulary size"),
        ("eos_id", 99, "EOS id"),
        ("dtype", np.dtype("<u4"), "token dtype"),
    ]:
        bad = {"web": stores["web"], "code": _fake(store, **{field: value})}
        with pytest.raises(
            MixtureError, match=re.escape(f"sources 'web' and 'code' differ in {label}")
        ):
            resolve_mixture(cfg, bad, 16)
    with pytest.raises(MixtureError, match=r"'web': heldout_samples=\d+ must be in \[0, \d+\)"):
        resolve_mixture(cfg, stores, 16, default_heldout=total)
    with pytest.raises(MixtureError, match="no opened store for mixture source 'code'"):
        resolve_mixture(cfg, {"web": stores["web"]}, 16)


# ---------------------------------------------------------------- issue 18


def test_past_changes_lists_every_changed_weight_not_only_the_first():
    sizes = {"web": 100, "code": 50, "math": 10}
    base = MixtureSpec.build(
        sizes, [(1, {"web": 2, "code": 1, "math": 1}), (5, {"web": 1, "code": 1, "math": 0})]
    )
    edited = MixtureSpec.build(
        sizes, [(1, {"web": 1, "code": 2, "math": 1}), (5, {"web": 1, "code": 1, "math": 2})]
    )
    assert past_changes(base, edited, 4) == [
        "schedule entry 1 (from_step 1): weight of source 'code' was 1/4, now 1/2 (normalized).",
        "schedule entry 1 (from_step 1): weight of source 'web' was 1/2, now 1/4 (normalized).",
    ]
    assert len(past_changes(base, edited, 5)) == 5  # and every weight of entry 2
    assert past_change(base, edited, 4) == " ".join(past_changes(base, edited, 4))
    assert past_changes(base, base, 10**6) == [] and past_change(base, base, 9) is None


def _tokenizers(store, hashes: dict[str, str]) -> dict:
    return {name: _fake(store, tokenizer_hash=h) for name, h in hashes.items()}


def test_a_tokenizer_mismatch_names_the_odd_one_out(store, store_path):
    """The advice names the source outside the majority, or outside the group that has
    the job's tokenizer when that decides, never simply the second source."""
    names = ["web", "code", "math"]
    body = "".join(f'[[source]]\nname = "{n}"\nstore = "{store_path}"\n' for n in names)
    weights = "[[schedule]]\nfrom_step = 1\nweights = { web = 1, code = 1, math = 1 }\n"
    cfg = MixtureConfig.loads(body + weights)
    x, y = "x" * 64, "y" * 64

    def refused(hashes: dict[str, str], tokenizer=None) -> str:
        with pytest.raises(MixtureError) as e:
            resolve_mixture(cfg, _tokenizers(store, hashes), 16, tokenizer=tokenizer)
        return str(e.value)

    # the first source is the odd one: the other two share one tokenizer
    msg = refused({"web": x, "code": y, "math": y})
    assert msg.startswith(
        f"mixture sources 'code' and 'web' differ in tokenizer (sha256): {y} vs {x}."
    )
    assert (
        "The odd one out: 'web' ('code', 'math' share one: 2 of the 3 sources). Re-run `zephon "
        "prepare` for 'web' with the tokenizer of 'code'."
    ) in msg
    # the job's tokenizer decides, even against the majority
    msg = refused({"web": x, "code": y, "math": y}, (x, "model.hf_assets_path (/tok)"))
    assert (
        "The odd ones out: 'code', 'math' ('web' has the tokenizer of model.hf_assets_path (/tok))"
        in msg
    )
    assert "Re-run `zephon prepare` for 'code', 'math' with the tokenizer of 'web'." in msg
    # no majority and no job tokenizer among them: said so, the groups named
    z = "z" * 64
    msg = refused({"web": x, "code": y, "math": z})
    assert "No majority tells which is right (the groups: 'web'; 'code'; 'math')" in msg
    msg = refused({"web": x, "code": y, "math": z}, ("q" * 64, "--tokenizer (/t)"))
    assert f"and none has the tokenizer of --tokenizer (/t) (sha256 {'q' * 64})" in msg


def test_a_source_shorter_than_one_sample_says_tokens_and_seq_len(store, store_path):
    cfg = MixtureConfig.loads(
        f'[[source]]\nname = "web"\nstore = "{store_path}"\n'
        "[[schedule]]\nfrom_step = 1\nweights = { web = 1 }\n"
    )
    seq_len = store.num_tokens  # one token short of a sample
    with pytest.raises(MixtureError) as e:
        resolve_mixture(cfg, open_mixture_stores(cfg), seq_len, default_heldout=2)
    assert str(e.value) == (
        f"mixture source 'web': its store {str(store_path)!r} has {store.num_tokens} tokens, "
        f"but a sample of seq_len {seq_len} needs seq_len + 1 = {seq_len + 1} tokens (its "
        "inputs and the label of the last one), so it holds no sample. To change it: use "
        f"seq_len {(store.num_tokens - 1) // 3} or less (the longest that gives 3 samples), or "
        "use a larger store."
    )
