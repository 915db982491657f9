"""Skip ranges (order/skips.py): the parse, and the map against a slow reference.

The reference walks the whole stream step by step, as the issue words the meaning:
at step S each source's stream moves on by what steps S .. S + N - 1 draw from it
(their batch sizes; in a mixture the rule's per-source counts, indexed by training
step), then every step draws its own batch. Hypothesis checks the plans (one store, a
mixture) against it at any DP degree, across batch schedules, including the rank
slices and the windows of a rank's stream the loader reads.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.order.test_mixture import batch_schedules, mixtures
from torchtitan_zephon.job.plans import plan_of
from torchtitan_zephon.order.data_config import SKIP_FIELD, DataConfig, data_extra
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.config import MixtureError
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.spec import MixtureSpec
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import DataPlan, make_keys

# ---------------------------------------------------------------- the setting


def test_parse_reads_entries_and_nothing():
    assert SkipSteps.parse("1200:300").entries == ((1200, 300),)
    assert SkipSteps.parse(" 5:2, 10:1 ").entries == ((5, 2), (10, 1))
    assert not SkipSteps.parse("")
    assert str(SkipSteps.parse("5:2,10:1")) == "5:2,10:1"
    assert SkipSteps.from_json([[5, 2], [10, 1]]) == SkipSteps.parse("5:2,10:1")


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("5:2,6:1", ["overlap", "5:2 and 6:1", "steps 5..6", "at step 7 or later", "5:2"]),
        ("10:2,5:1", ["strictly increasing in S", "10:2 then 5:1"]),
        ("10:2,10:1", ["strictly increasing in S", "10:2 then 10:1"]),
        ("5:0", ["N must be >= 1", "5:0"]),
        ("5:-3", ["N must be >= 1"]),
        ("-5:3", ["S must be >= 1", "1-based"]),
        ("0:3", ["S must be >= 1"]),
        ("5", ["'5' is not S:N", "expected 'S:N,S:N,...'"]),
        ("5:x", ["'5:x' is not S:N"]),
        ("5:2:1", ["'5:2:1' is not S:N"]),
    ],
)
def test_bad_skip_steps_say_what_was_expected(text, fragments):
    with pytest.raises(ValueError) as e:
        SkipSteps.parse(text)
    for fragment in fragments:
        assert fragment in str(e.value)
    with pytest.raises(ValueError, match="^zephon.skip_steps: "):
        data_extra(skip_steps=text)


def test_overlap_suggests_a_merge_that_parses():
    with pytest.raises(ValueError, match=r"merge them into one entry \(e.g. 5:4\)"):
        SkipSteps.parse("1:1,5:2,6:3")  # 5:2 covers 5..6; together with 6:3, 5..8
    assert SkipSteps.parse("5:4")


def test_no_skip_adds_no_field():
    assert data_extra(skip_steps="") == {}
    assert data_extra(skip_steps="3:2") == {SKIP_FIELD: [[3, 2]]}


# ---------------------------------------------------------------- the reference


def reference_store(num_samples, seed, schedule, offset, skips, steps):
    """Global ids of steps 1..steps, walking the whole stream of one store."""
    stream = DataPlan(num_samples, seed, BatchSchedule([(1, 1)]), offset)
    skip_at = dict(skips.entries)
    out, pointer = [], 0
    for step in range(1, steps + 1):
        if step in skip_at:
            pointer += sum(schedule.gbs(u) for u in range(step, step + skip_at[step]))
        g = schedule.gbs(step)
        out.append(stream.ids_for_positions(pointer, g))
        pointer += g
    return out


def reference_mixture(spec, seed, schedule, skips, steps):
    """Sample keys of steps 1..steps: the rule's sources per training step (a plan
    without skips), each source's stream walked draw by draw."""
    rule = MixturePlan(spec, seed, schedule)
    n = len(spec.names)
    last = steps + max([n for _, n in skips.entries], default=0)
    sources = [rule.slot_sources(*rule.step_slots(u)) for u in range(1, last + 1)]
    skip_at = dict(skips.entries)
    pointer = np.zeros(n, dtype=np.int64)
    out = []
    for step in range(1, steps + 1):
        if step in skip_at:
            for u in range(step, step + skip_at[step]):
                pointer += np.bincount(sources[u - 1], minlength=n)
        src = sources[step - 1]
        ids = np.empty(len(src), dtype=np.int64)
        for k, i in enumerate(src.tolist()):
            size = int(rule.num_samples[i])
            epoch, within = divmod(int(pointer[i]), size)
            perm = rule._streams[i].permutation(epoch)
            ids[k] = int(perm.map(np.array([within], dtype=np.uint64))[0])
            pointer[i] += 1
        out.append(make_keys(src, ids))
    return out


@st.composite
def skip_steps(draw, max_start=25):
    """Non-overlapping entries, strictly increasing in S (possibly none)."""
    entries, step = [], draw(st.integers(1, 6))
    for _ in range(draw(st.integers(0, 4))):
        if step > max_start:
            break
        n = draw(st.integers(1, 6))
        entries.append((step, n))
        step += n + draw(st.integers(0, 6))
    return SkipSteps(entries)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_against(plan, reference, steps, data):
    """Every step's global ids, one DP degree's rank slices and a window of one rank's
    stream (the loader's read) equal the reference."""
    for step in range(1, steps + 1):
        want = reference[step - 1]
        assert np.array_equal(plan.global_ids(step), want), step
        g = len(want)
        d = data.draw(st.sampled_from(_divisors(g)))
        parts = [plan.rank_ids(step, r, d) for r in range(d)]
        assert np.array_equal(np.concatenate(parts), want)
    step = data.draw(st.integers(1, steps // 2))
    common = math.gcd(*(g for _, g in plan.schedule.entries))  # divides every step's batch
    d = data.draw(st.sampled_from(_divisors(common)))
    r = data.draw(st.integers(0, d - 1))
    per_rank = [plan.rank_ids(s, r, d) for s in range(step, steps + 1)]
    stream = np.concatenate(per_rank)
    skip = data.draw(st.integers(0, max(0, len(stream) - 1)))
    count = data.draw(st.integers(0, len(stream) - skip))
    window = plan.rank_stream_ids(step, skip, count, r, d)
    assert np.array_equal(window, stream[skip : skip + count])


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(2, 50),
    offset=st.integers(0, 4),
    seed=st.integers(0, 2**40),
    schedule=batch_schedules(max_gbs=12),
    skips=skip_steps(),
    data=st.data(),
)
def test_one_store_skips_equal_the_reference(n, offset, seed, schedule, skips, data):
    steps = 36
    plan = DataPlan(n, seed, schedule, offset, skips=skips)
    check_against(plan, reference_store(n, seed, schedule, offset, skips, steps), steps, data)


@settings(max_examples=50, deadline=None)
@given(
    spec=mixtures(max_sources=4, max_entries=3),
    seed=st.integers(0, 2**40),
    schedule=batch_schedules(max_gbs=12),
    skips=skip_steps(),
    data=st.data(),
)
def test_mixture_skips_equal_the_reference(spec, seed, schedule, skips, data):
    steps = 32
    stream = MixtureStream(MixturePlan(spec, seed, Layout(schedule, skips=skips)))
    check_against(stream, reference_mixture(spec, seed, schedule, skips, steps), steps, data)
    # the rule's slot assignment stays indexed by training step
    plain = MixturePlan(spec, seed, schedule)
    for step in range(1, steps + 1):
        assert np.array_equal(stream.mixture.step_counts(step), plain.step_counts(step))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 50),
    seed=st.integers(0, 2**40),
    schedule=batch_schedules(max_gbs=12),
    skips=skip_steps(),
    extra=st.tuples(st.integers(1, 40), st.integers(1, 9)),
)
def test_a_skip_appended_later_changes_no_earlier_step(n, seed, schedule, skips, extra):
    """An entry at step S (after every other entry's range) leaves steps < S alone."""
    start = max([s + k for s, k in skips.entries], default=1) + extra[0] - 1
    longer = SkipSteps([*skips.entries, (start, extra[1])])
    a = DataPlan(n, seed, schedule, skips=skips)
    b = DataPlan(n, seed, schedule, skips=longer)
    for step in range(1, start):
        assert np.array_equal(a.global_ids(step), b.global_ids(step))
    assert (
        b.global_ids(start).tolist()
        == reference_store(n, seed, schedule, 0, longer, start)[-1].tolist()
    )


def test_one_store_constant_batch_trains_what_step_s_plus_n_would():
    plain = DataPlan(1000, 7, BatchSchedule([(1, 8)]))
    skip = DataPlan(1000, 7, BatchSchedule([(1, 8)]), skips=SkipSteps.parse("10:5,40:3"))
    for step in range(1, 10):
        assert np.array_equal(skip.global_ids(step), plain.global_ids(step))
    for step in range(10, 40):
        assert np.array_equal(skip.global_ids(step), plain.global_ids(step + 5))
    for step in range(40, 60):
        assert np.array_equal(skip.global_ids(step), plain.global_ids(step + 8))
    assert skip.step_positions(10) == plain.step_positions(10)  # positions do not move


def test_skip_through_the_data_config_and_its_keys():
    base = dict(
        seq_len=8,
        seed=3,
        schedule=BatchSchedule([(1, 4)]),
        sample_offset=0,
        num_samples=100,
        store_fingerprint="f",
        tokenizer_hash="t",
    )
    plain = DataConfig.make(**base)
    skip = DataConfig.make(**base, extra=data_extra(skip_steps="5:2"))
    later = DataConfig.make(**base, extra=data_extra(skip_steps="5:2,20:3"))
    assert plain.to_dict().get(SKIP_FIELD) is None  # no field: the old fingerprint
    assert skip.order_key == plain.order_key == later.order_key
    assert [skip.step_key(s) == plain.step_key(s) for s in (4, 5)] == [True, False]
    assert all(later.step_key(s) == skip.step_key(s) for s in range(1, 20))
    assert later.step_key(20) != skip.step_key(20)
    expected = DataPlan(100, 3, BatchSchedule([(1, 4)]), skips=SkipSteps.parse("5:2"))
    assert np.array_equal(plan_of(skip).global_ids(5), expected.global_ids(5))
    assert DataConfig.from_dict(skip.to_dict()) == skip


def test_mixture_max_epochs_counts_the_skipped_samples():
    spec = MixtureSpec.build(
        {"a": 10, "b": 10}, [(1, {"a": 1, "b": 1})], max_epochs={"a": 1, "b": 1}
    )
    schedule = BatchSchedule([(1, 4)])
    MixturePlan(spec, 0, schedule).check_max_epochs(5)  # 5 steps x 2 per source = 10
    skipping = MixturePlan(spec, 0, Layout(schedule, skips=SkipSteps.parse("3:1")))
    skipping.check_max_epochs(4)  # 4 steps drawn + 1 skipped x 2 = 10: the last sample
    with pytest.raises(MixtureError, match="runs past max_epochs=1 at step 5"):
        skipping.check_max_epochs(5)


def test_lookup_cost_does_not_grow_with_the_step():
    """1,000 skip entries: a step near 10^9 costs about what step 10 costs."""
    entries = [(100 + 10**6 * k, 50) for k in range(1000)]
    plan = DataPlan(10**7, 1, BatchSchedule([(1, 512), (10**5, 1024)]), skips=SkipSteps(entries))

    def cost(step: int) -> float:
        best = float("inf")
        for _ in range(7):
            t = time.perf_counter()
            plan.global_ids(step)
            best = min(best, time.perf_counter() - t)
        return best

    early, late = cost(10), cost(10**9)
    assert late < 3 * early + 1e-3, (early, late)
