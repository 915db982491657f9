"""DataPlan and BatchSchedule: partition, epoch coverage, exact position accounting."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.order.layout import (
    MIN_STORE_SAMPLES,
    BatchSchedule,
    check_batch_layout,
    check_store_size,
    no_sample_text,
    store_fix,
)
from torchtitan_zephon.order.stream import DataPlan


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw):
    gbs = draw(st.integers(1, 48))
    d = draw(st.sampled_from(_divisors(gbs)))
    b = draw(st.sampled_from(_divisors(gbs // d)))
    return gbs, d, b


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), n=st.integers(1, 200), seed=st.integers(0, 1000))
def test_rank_slices_and_microbatches_concatenate_to_global(layout, n, seed):
    gbs, d, b = layout
    plan = DataPlan(n, seed, BatchSchedule([(1, gbs)]), sample_offset=3)
    for step in (1, 2, 7):
        whole = plan.global_ids(step)
        ranks = [plan.rank_ids(step, r, d) for r in range(d)]
        assert np.array_equal(np.concatenate(ranks), whole)
        micro = [m for r in range(d) for m in plan.microbatch_ids(step, r, d, b)]
        assert all(len(m) == b for m in micro)
        assert len(micro) == d * check_batch_layout(gbs, d, b)
        assert np.array_equal(np.concatenate(micro), whole)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), gbs=st.integers(1, 40), seed=st.integers(0, 10**9))
def test_every_epoch_covers_every_sample_once(n, gbs, seed):
    plan = DataPlan(n, seed, BatchSchedule([(1, gbs)]), sample_offset=10)
    steps = -(-3 * n // gbs)  # enough steps for 3 epochs
    stream = np.concatenate([plan.global_ids(s) for s in range(1, steps + 1)])
    for e in range(3):
        epoch = stream[e * n : (e + 1) * n]
        assert np.array_equal(np.sort(epoch), np.arange(10, 10 + n))
    assert np.array_equal(plan.ids_for_positions(0, len(stream)), stream)


@st.composite
def schedules(draw):
    k = draw(st.integers(1, 4))
    starts = sorted(draw(st.sets(st.integers(2, 30), min_size=k - 1, max_size=k - 1)))
    sizes = draw(st.lists(st.integers(1, 16), min_size=k, max_size=k))
    return BatchSchedule(list(zip([1, *starts], sizes, strict=True)))


@settings(max_examples=40, deadline=None)
@given(schedule=schedules(), n=st.integers(1, 100))
def test_schedule_accounts_positions_exactly(schedule, n):
    plan = DataPlan(n, 0, schedule)
    expected_first = 0
    for step in range(1, 40):
        first, count = plan.step_positions(step)
        assert first == expected_first == schedule.first_position(step)
        assert count == schedule.gbs(step)
        expected_first += count
    assert BatchSchedule.parse(str(schedule)) == schedule
    assert BatchSchedule(schedule.to_list()) == schedule


def test_schedule_parse_and_errors():
    assert BatchSchedule.parse("64").entries == [(1, 64)]
    s = BatchSchedule.parse("1:64,1000:128")
    assert s.gbs(999) == 64 and s.gbs(1000) == 128
    assert s.first_position(1001) == 999 * 64 + 128
    for bad, match in [
        ("2:64", "start at step 1"),
        ("1:64,1:32", "strictly increasing"),
        ("1:0", ">= 1"),
        ("abc", "cannot parse"),
    ]:
        with pytest.raises(ValueError, match=match):
            BatchSchedule.parse(bad)


def test_check_batch_layout_messages():
    assert check_batch_layout(32, 4, 2) == 4
    with pytest.raises(ValueError) as e:
        check_batch_layout(12, 5, 2)
    msg = str(e.value)
    assert "DP degrees that work with local batch size 2: [1, 2, 3, 6]" in msg
    assert "DP degrees dividing it" in msg
    with pytest.raises(
        ValueError, match=r"Local batch sizes that work with DP degree 4: \[1, 2, 4\]"
    ):
        check_batch_layout(16, 4, 3)


def test_anchor_shifts_positions():
    plan = DataPlan(50, 1, BatchSchedule.parse("8"), anchor_step=5, anchor_position=33)
    assert plan.step_positions(5) == (33, 8)
    assert plan.step_positions(6) == (41, 8)
    with pytest.raises(ValueError, match="before the resume anchor"):
        plan.step_positions(1)


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    schedule=schedules(),
    n=st.integers(1, 60),
    seed=st.integers(0, 10**6),
    offset=st.integers(0, 5),
)
def test_rank_stream_window_equals_per_step_slices(data, schedule, n, seed, offset):
    # any DP degree dividing every global batch size of the schedule, any rank of it
    d = data.draw(st.sampled_from(_divisors(math.gcd(*(g for _, g in schedule.entries)))))
    r = data.draw(st.integers(0, d - 1))
    anchor = data.draw(st.sampled_from([(1, 0), (3, 0), (3, 17), (9, 5)]))
    plan = DataPlan(n, seed, schedule, offset, anchor_step=anchor[0], anchor_position=anchor[1])
    step = data.draw(st.integers(anchor[0], anchor[0] + 30))
    skip = data.draw(st.integers(0, 20))
    count = data.draw(st.integers(0, 150))  # past 48 ids the permutation takes its numpy path
    slices, s = [], step
    while sum(map(len, slices)) < skip + count:
        slices.append(plan.rank_ids(s, r, d))
        s += 1
    stream = np.concatenate(slices) if slices else np.empty(0, dtype=np.int64)
    window = plan.rank_stream_ids(step, skip, count, r, d)
    assert window.dtype == np.int64
    assert np.array_equal(window, stream[skip : skip + count])
    # positions in any order, over any epochs: one by one gives the same ids
    first, _ = plan.rank_positions(step, r, d)
    positions = data.draw(st.lists(st.integers(0, first + 4 * n), max_size=60))
    expected = [int(plan.ids_for_positions(p, 1)[0]) for p in positions]
    assert plan.ids_at(np.array(positions, dtype=np.int64)).tolist() == expected


def test_rank_stream_window_spans_epochs_and_schedule_entries():
    plan = DataPlan(7, 3, BatchSchedule.parse("1:4,3:6"))  # 7 samples: an epoch every ~1.5 steps
    window = plan.rank_stream_ids(1, 1, 9, 1, 2)  # rank 1 of 2: 2, 2, 3, 3, ... ids per step
    per_step = np.concatenate([plan.rank_ids(s, 1, 2) for s in range(1, 6)])
    assert np.array_equal(window, per_step[1:10])
    assert plan.rank_stream_ids(2, 0, 0, 0, 2).size == 0
    with pytest.raises(ValueError, match="skip and count must be >= 0"):
        plan.rank_stream_ids(1, -1, 3, 0, 1)
    with pytest.raises(ValueError, match="DP degree 4 does not divide the global batch size 6"):
        plan.rank_stream_ids(1, 0, 12, 0, 4)  # reaches step 3 (batch 6)


def test_layout_error_for_a_huge_batch_is_immediate():
    """The message's divisor search is bounded: a global batch size of 10**30 + 1 (a typo)
    is refused at once (the unbounded search of 10**15 candidates never returned)."""
    with pytest.raises(ValueError, match=r"DP degrees that work with local batch size 1: \[1, "):
        check_batch_layout(10**30 + 1, 2, 1)


# ---------------------------------------------------------------- store sizes (issue 18)


@settings(max_examples=200, deadline=None)
@given(schedule=schedules(), n=st.integers(0, 80), data=st.data())
def test_a_store_is_refused_or_warned_by_its_samples_and_schedule_alone(schedule, n, data):
    """Refused below MIN_STORE_SAMPLES, warned when smaller than some global batch, naming
    the first such entry; and the verdict holds for every layout of that schedule: every
    DP degree and local batch size draws the same ids, with as many repeats."""
    what = "the store S"
    if n < MIN_STORE_SAMPLES:
        with pytest.raises(ValueError) as e:
            check_store_size(what, n, schedule, "FIX.")
        msg = str(e.value)
        assert msg.startswith(what) and msg.endswith("FIX.")
        if n == 1:
            assert "has 1 training sample: every step would train on that one sample" in msg
            assert f"({schedule.gbs(1)} at step 1)" in msg and "needs at least 2" in msg
        return
    warning = check_store_size(what, n, schedule, "FIX.")
    over = [(s, g) for s, g in schedule.entries if g > n]
    if not over:
        assert warning is None
        return
    step, gbs = over[0]
    assert warning.startswith(f"{what} has {n} training samples, fewer than the global batch ")
    assert f"of {gbs} from step {step} on (batch schedule entry {step}:{gbs}" in warning
    plan = DataPlan(n, 0, schedule)
    ids = plan.global_ids(step)
    assert len(np.unique(ids)) < len(ids)  # what the warning says: samples repeat
    d = data.draw(st.sampled_from(_divisors(gbs)))
    assert np.array_equal(np.concatenate([plan.rank_ids(step, r, d) for r in range(d)]), ids)


def test_what_a_too_short_store_needs_is_said_in_tokens_and_seq_len():
    msg = no_sample_text("the store S", 40, 64)
    assert msg == (
        "the store S has 40 tokens, but a sample of seq_len 64 needs seq_len + 1 = 65 tokens "
        "(its inputs and the label of the last one), so it holds no sample"
    )
    fix = store_fix(40, 2, "--training.seq_len", first="lower --zephon.heldout_samples (now 3)")
    assert fix == (
        "To change it: lower --zephon.heldout_samples (now 3), or use --training.seq_len 19 or "
        "less (the longest that gives 2 samples), or use a larger store."
    )
    # the seq_len offered gives the samples asked for, and one more token would not
    for tokens in range(2, 300):
        for samples in range(1, 12):
            longest = (tokens - 1) // samples
            if longest >= 1:
                assert (tokens - 1) // longest >= samples > (tokens - 1) // (longest + 1)
                assert f"--seq-len {longest} or less" in store_fix(tokens, samples, "--seq-len")
            else:
                assert store_fix(tokens, samples, "--seq-len") == (
                    "To change it: use a larger store."
                )


@pytest.mark.parametrize(
    "text, part, what",
    [("1:x", "1:x", "STEP:GBS with two whole numbers"), ("1:2:3", "1:2:3", "STEP:GBS with two whole numbers"),
     ("1:8,,5:4", "", "STEP:GBS with two whole numbers"), ("4x", "4x", "a whole number")],
)  # fmt: skip
def test_a_bad_batch_schedule_names_the_bad_part_in_plain_words(text, part, what):
    """Issue 18 (no Python-isms): not 'invalid literal for int() with base 10' or 'too
    many values to unpack'."""
    with pytest.raises(ValueError) as e:
        BatchSchedule.parse(text)
    assert str(e.value) == (
        f"cannot parse global batch schedule {text!r}: {part!r} is not {what}; expected an "
        "integer like '64' or 'STEP:GBS,...' starting at step 1 like '1:64,1000:128'."
    )
    with pytest.raises(ValueError, match=r"^global batch size must be >= 1, found -3 at step 1\.$"):
        BatchSchedule.parse("-3")
