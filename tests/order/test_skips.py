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
from torchtitan_zephon.order.data_config import (
    SKIP_FIELD,
    DataConfig,
    DataStateMismatch,
    data_extra,
)
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.config import MixtureError
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.spec import MixtureSpec
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.resume import check_resume
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.state import DataState
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
        ("1:99999999999999999999", ["reaches step 99999999999999999999", "largest step"]),
        (f"{2**40}:2", [f"reaches step {2**40 + 1}", f"largest step a plan takes ({2**40})"]),
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
    sources = [rule.position_sources(*rule.step_positions(u)) for u in range(1, last + 1)]
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
    # the rule's position assignment stays indexed by training step
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


# ---------------------------------------------------------------- the resume rule


def store_config(skips: str = "", schedule: str = "1:4") -> DataConfig:
    return DataConfig.make(
        seq_len=8,
        seed=5,
        schedule=BatchSchedule.parse(schedule),
        sample_offset=0,
        num_samples=500,
        store_fingerprint="s" * 64,
        tokenizer_hash="t" * 64,
        extra=data_extra(skip_steps=skips),
    )


def saved_at(config: DataConfig, next_step: int) -> DataState:
    return DataState(config, next_step, config.batch_schedule().first_position(next_step))


@settings(max_examples=150, deadline=None)
@given(old=skip_steps(), new=skip_steps(), next_step=st.integers(1, 30))
def test_a_skip_for_untrained_steps_is_a_continuation_and_a_past_edit_is_refused(
    old, new, next_step
):
    a, b = store_config(str(old)), store_config(str(new))
    state = saved_at(a, next_step)
    trained = next_step - 1
    if old == new:
        assert check_resume(state, b).extended == ()
    elif old.up_to(trained) == new.up_to(trained):
        decision = check_resume(state, b)
        assert decision.extended == (SKIP_FIELD,) and decision.anchor == (1, 0)
        added = [e for e in new.entries if e not in old.entries]
        assert [n.split(":")[0] for n in decision.notes] == [
            f"skip_steps gained {s}" for s, _ in added
        ]
        plan_a, plan_b = plan_of(a), plan_of(b)
        for s in range(1, next_step):  # the trained past: same samples, same records
            assert a.step_key(s) == b.step_key(s)
            assert np.array_equal(plan_a.global_ids(s), plan_b.global_ids(s))
    else:
        with pytest.raises(DataStateMismatch) as e:
            check_resume(state, b)
        text = str(e.value)
        assert f"  {SKIP_FIELD}: {str(old) or '(none)'} -> {str(new) or '(none)'}" in text
        assert f"allow_changes=['{SKIP_FIELD}']" in text
        assert check_resume(state, b, [SKIP_FIELD]).accepted == (SKIP_FIELD,)


def test_rolling_back_and_adding_a_skip_resumes_with_a_note():
    state = saved_at(store_config(), 101)  # the checkpoint of step 100
    decision = check_resume(state, store_config("101:40"))
    assert decision.extended == (SKIP_FIELD,)
    assert decision.notes == (
        "skip_steps gained 101:40: at step 101, skip the data of 40 steps (101..140): step "
        "101 trains what step 141 would have trained, and steps 101..140 of the original "
        "order are never trained",
    )
    with pytest.raises(DataStateMismatch) as e:
        check_resume(state, store_config("100:40"))
    assert "  skip_steps: (none) -> 100:40 (the entries at or before step 100 differ from " in (
        str(e.value)
    )
    assert "this run trained step 100 without a skip there" in str(e.value)
    assert "allowed_fields" not in str(e.value)
    # a skip set for a past step can still be dropped from the config only with the opt-in
    with pytest.raises(
        DataStateMismatch, match=r"skip_steps: 50:10 -> \(none\) .* with the skip 50:10"
    ):
        check_resume(saved_at(store_config("50:10"), 101), store_config())
    assert check_resume(
        saved_at(store_config("50:10"), 101), store_config(), ["skip_steps"]
    ).accepted == (SKIP_FIELD,)


def test_a_trained_skip_fixes_the_batch_sizes_of_the_steps_it_covers():
    """Skip 95:20 trained at step 95..100: what it skipped is what steps 95..114 draw,
    so a batch size entry at 101..114 would change the trained past."""
    state = saved_at(store_config("95:20"), 101)
    with pytest.raises(DataStateMismatch) as e:
        check_resume(state, store_config("95:20", "1:4,110:8"))
    text = str(e.value)
    assert "  schedule: [[1, 4]] -> [[1, 4], [110, 8]]" in text
    assert "The skip 95:20 (already in effect at trained step 95) skips what steps 95..114" in text
    assert "a change must start at step 115 or later" in text
    assert check_resume(state, store_config("95:20", "1:4,115:8")).extended == ("schedule",)
    # without the skip, step 110 is an untrained step like any other
    assert check_resume(saved_at(store_config(), 101), store_config("", "1:4,110:8")).extended


def test_a_trained_skip_fixes_the_mixture_weights_of_the_steps_it_covers():
    from torchtitan_zephon.job.data import mixture_store_fingerprint

    def mixture(entries, skips):
        spec = MixtureSpec.build({"code": 50, "web": 70}, entries)
        return DataConfig.make(
            seq_len=8,
            seed=1,
            schedule=BatchSchedule.parse("1:4"),
            sample_offset=0,
            num_samples=120,
            store_fingerprint=mixture_store_fingerprint(spec),
            tokenizer_hash="t" * 64,
            extra={"mixture": spec.to_json(), **data_extra(skip_steps=skips)},
        )

    even = [(1, {"code": 1, "web": 1})]
    state = saved_at(mixture(even, "8:5"), 11)
    with pytest.raises(DataStateMismatch) as e:
        check_resume(state, mixture([*even, (12, {"code": 0, "web": 1})], "8:5"))
    assert "  mixture: " in str(e.value) and "The skip 8:5" in str(e.value)
    later = mixture([*even, (13, {"code": 0, "web": 1})], "8:5")
    assert check_resume(state, later).extended == ("mixture",)
    a, b = plan_of(state.config), plan_of(later)
    for step in range(1, 11):
        assert np.array_equal(a.global_ids(step), b.global_ids(step))
        assert state.config.step_key(step) == later.step_key(step)


def test_the_skip_sentence_says_which_part_of_a_step_of_another_batch_size_is_trained():
    """--global-batch-size 1:8,4:16 --skip-steps 3:2: step 3 trains 8 samples from the first
    of step 5's 16, not 'what step 5 would have trained' (issue 28, item 6)."""
    gbs = BatchSchedule.parse("1:8,4:16").gbs
    (text,) = SkipSteps.parse("3:2").describe(gbs)
    assert text == (
        "at step 3, skip the data of 2 steps (3..4): step 3 trains the first 8 of the 16 "
        "samples step 5 would have trained, and steps 3..4 of the original order are never "
        "trained"
    )
    (larger,) = SkipSteps.parse("5:2").describe(BatchSchedule.parse("1:16,6:8").gbs)
    assert (
        "step 5 trains 16 samples from the first that step 7 would have trained (it "
        "would have trained 8; the rest are those of the steps after it)" in larger
    )
    (same,) = SkipSteps.parse("3:2").describe(gbs=BatchSchedule.parse("1:8,10:16").gbs)
    assert "step 3 trains what step 5 would have trained," in same
    # and the plan the sentence describes: step 3's ids are the first 8 of step 5's unskipped
    plan = DataPlan(1000, 0, BatchSchedule.parse("1:8,4:16"))
    skipped = DataPlan(1000, 0, BatchSchedule.parse("1:8,4:16"), skips=SkipSteps.parse("3:2"))
    assert skipped.global_ids(3).tolist() == plan.global_ids(5)[:8].tolist()
