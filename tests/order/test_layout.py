"""The one layout (order/layout.py) under both stream kinds: one store and a mixture.

Hypothesis tries to break the invariants the layout's docstring states: rank slices
concatenate to the step, micro-batches to the slice, consecutive steps are adjacent,
and a range of a rank's stream (and the loader's micro-batch walk) equals the per-step
slices concatenated: any DP degree dividing the batch, any micro-batch size dividing the
slice, batch-size schedule changes and resume anchors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.order.test_mixture import batch_schedules, mixtures
from torchtitan_zephon.order.layout import Layout
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.stream import DataPlan, StreamPlan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def streams(draw) -> StreamPlan:
    """A stream of either kind over any batch schedule, from any possible anchor."""
    schedule = draw(batch_schedules(max_gbs=12))
    anchor = (1, 0)
    if draw(st.booleans()):  # a resume that accepted a schedule change
        step = draw(st.integers(2, 25))
        anchor = (step, draw(st.integers(step - 1, 12 * step)))
    seed = draw(st.integers(0, 2**32))
    if draw(st.booleans()):
        n, offset = draw(st.integers(1, 60)), draw(st.integers(0, 5))
        return DataPlan(n, seed, schedule, offset, anchor_step=anchor[0], anchor_position=anchor[1])
    spec = draw(mixtures(max_sources=4, max_entries=3))
    return MixtureStream(MixturePlan(spec, seed, Layout(schedule, anchor)))


@settings(max_examples=120, deadline=None)
@given(stream=streams(), data=st.data())
def test_rank_slices_and_microbatches_concatenate_to_the_step(stream, data):
    layout = stream.layout
    step = data.draw(st.integers(layout.anchor_step, layout.anchor_step + 40))
    first, gbs = stream.step_positions(step)
    after, _ = stream.step_positions(step + 1)
    assert after == first + gbs  # consecutive steps are adjacent: nothing skipped or repeated
    whole = stream.global_ids(step)
    assert np.array_equal(stream.ids_for_positions(first, gbs), whole)
    d = data.draw(st.sampled_from(_divisors(gbs)))
    b = data.draw(st.sampled_from(_divisors(gbs // d)))
    slices, micro, at = [], [], first
    for r in range(d):
        r_first, r_count = stream.rank_positions(step, r, d)
        assert (r_first, r_count) == (at, gbs // d)  # in rank order, contiguous
        at += r_count
        part = stream.rank_ids(step, r, d)
        batches = stream.microbatch_ids(step, r, d, b)
        cuts = layout.microbatch_positions(step, r, d, b)
        assert [len(m) for m in batches] == [n for _, n in cuts] == [b] * (r_count // b)
        assert [p for p, _ in cuts] == list(range(r_first, r_first + r_count, b))
        assert np.array_equal(np.concatenate(batches), part)
        slices.append(part)
        micro += batches
    assert np.array_equal(np.concatenate(slices), whole)
    assert np.array_equal(np.concatenate(micro), whole)


@settings(max_examples=120, deadline=None)
@given(stream=streams(), data=st.data())
def test_a_range_and_the_microbatch_walk_equal_the_per_step_slices(stream, data):
    layout = stream.layout
    d = data.draw(st.sampled_from(_divisors(math.gcd(*(g for _, g in layout.schedule.entries)))))
    r = data.draw(st.integers(0, d - 1))
    step = data.draw(st.integers(layout.anchor_step, layout.anchor_step + 30))
    per_step = [stream.rank_ids(s, r, d) for s in range(step, step + 12)]
    rank_stream = np.concatenate(per_step)
    skip = data.draw(st.integers(0, len(rank_stream)))
    count = data.draw(st.integers(0, len(rank_stream) - skip))
    got = stream.rank_stream_ids(step, skip, count, r, d)
    assert got.dtype == np.int64
    assert np.array_equal(got, rank_stream[skip : skip + count])
    starts, counts = layout.rank_ranges(step, skip, count, r, d)
    assert (counts > 0).all() and int(counts.sum()) == count
    positions = [p for a, n in zip(starts.tolist(), counts.tolist(), strict=True)
                 for p in range(a, a + n)]  # fmt: skip
    slice_positions = [p for s in range(step, step + 12)
                       for a, n in [stream.rank_positions(s, r, d)] for p in range(a, a + n)]  # fmt: skip
    assert positions == slice_positions[skip : skip + count]
    # the loader's walk: micro-batch k of step s is ids [k*b, (k+1)*b) of the rank's slice
    b = data.draw(st.sampled_from(_divisors(min(g for _, g in layout.schedule.entries) // d)))
    b = b if all((g // d) % b == 0 for _, g in layout.schedule.entries) else 1
    index = data.draw(st.integers(0, layout.schedule.gbs(step) // d // b - 1))
    n = data.draw(st.integers(1, 30))
    places, cursor = layout.microbatch_places((step, index), n, d, b)
    assert len(places) == n and places[0][:2] == (step, index)
    ids = stream.rank_stream_ids(step, index * b, n * b, r, d).reshape(n, b)
    for (s, k, last), row in zip(places, ids, strict=True):
        batches = stream.microbatch_ids(s, r, d, b)
        assert np.array_equal(row, batches[k]) and last == (k + 1 == len(batches))
    s, k, last = places[-1]
    assert cursor == ((s + 1, 0) if last else (s, k + 1))


@pytest.mark.parametrize("kind", ["store", "mixture"])
def test_both_streams_refuse_a_step_before_the_anchor_alike(kind):
    from torchtitan_zephon.order.layout import BatchSchedule
    from torchtitan_zephon.order.mixture.spec import MixtureSpec

    schedule = BatchSchedule.parse("1:8,6:4")
    if kind == "store":
        stream: StreamPlan = DataPlan(50, 1, schedule, anchor_step=5, anchor_position=33)
    else:
        spec = MixtureSpec.build({"a": 20, "b": 30}, [(1, {"a": 1, "b": 2})])
        stream = MixtureStream(MixturePlan(spec, 1, Layout(schedule, (5, 33))))
    assert stream.step_positions(5) == (33, 8) and stream.step_positions(6) == (41, 4)
    assert stream.rank_positions(6, 1, 2) == (43, 2)
    for call in (
        lambda: stream.step_positions(4),
        lambda: stream.rank_ids(4, 0, 1),
        lambda: stream.rank_stream_ids(4, 0, 1, 0, 1),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == (
            "step 4 lies before the resume anchor (step 5 at position 33); its positions "
            "are not defined under the current schedule."
        )


# ---------------------------------------------------------------- torchft parts (issue 30)


@given(
    first=st.integers(0, 10**12),
    gbs=st.integers(1, 4096),
    parts=st.integers(1, 64),
    step=st.integers(1, 10**6),
)
def test_the_parts_of_a_step_partition_it_contiguously_and_evenly(first, gbs, parts, step):
    """Participant i of n trains part i: the parts concatenate, in order, to B(s);
    sizes differ by at most one, the larger first; one part is the whole step."""
    from torchtitan_zephon.order.layout import part_slice

    if parts > gbs:
        with pytest.raises(ValueError, match=f"cannot be cut into {parts} parts"):
            part_slice(first, gbs, step, 0, parts)
        return
    cut = [part_slice(first, gbs, step, i, parts) for i in range(parts)]
    assert cut[0][0] == first
    for (a, n), (b, _) in zip(cut, cut[1:], strict=False):
        assert b == a + n  # contiguous, in part order
    assert cut[-1][0] + cut[-1][1] == first + gbs  # the whole step, nothing left
    sizes = [n for _, n in cut]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)
    assert part_slice(first, gbs, step, 0, 1) == (first, gbs)


@given(
    first=st.integers(0, 10**12),
    whole=st.integers(1, 512),
    multiple_of=st.integers(1, 16),
    parts=st.integers(1, 64),
)
def test_parts_in_whole_micro_batches_keep_every_micro_batch_whole(
    first, whole, multiple_of, parts
):
    """zephon.reproducible (issue 46): every part is a multiple of ``multiple_of`` samples
    (the local batch size), so every micro-batch of B(s), ``[k * m, (k + 1) * m)``, lies
    in one part whatever the quorum: its gradient is computed alone, as at
    any DP degree. The micro-batches are shared as evenly as possible, the larger parts first."""
    from torchtitan_zephon.order.layout import part_slice

    gbs = whole * multiple_of
    if parts > whole:
        with pytest.raises(ValueError, match=f"cannot be cut into {parts} parts"):
            part_slice(first, gbs, 1, 0, parts, multiple_of)
        return
    cut = [part_slice(first, gbs, 1, i, parts, multiple_of) for i in range(parts)]
    assert cut[0][0] == first and cut[-1][0] + cut[-1][1] == first + gbs
    for (a, n), (b, _) in zip(cut, cut[1:], strict=False):
        assert b == a + n
    assert all((a - first) % multiple_of == 0 and n % multiple_of == 0 and n > 0 for a, n in cut)
    sizes = [n // multiple_of for _, n in cut]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    if multiple_of == 1:  # the sample-even cut of torchft without the setting
        assert cut == [part_slice(first, gbs, 1, i, parts) for i in range(parts)]


def test_a_global_batch_of_partial_micro_batches_is_refused():
    from torchtitan_zephon.order.layout import part_slice

    with pytest.raises(
        ValueError, match="global batch of 10 samples is not a whole number of micro-batches of 4"
    ):
        part_slice(0, 10, 2, 0, 2, 4)
    assert [part_slice(0, 8, 1, i, 3, 2) for i in range(3)] == [(0, 4), (4, 2), (6, 2)]


def test_three_parts_of_eight_and_a_layout_step():
    """n = 3 at GBS 8 (issue 30's uneven case): 3, 3, 2 samples; the layout's step
    (after a batch-size change and a resume anchor) is what is cut."""
    from torchtitan_zephon.order.layout import BatchSchedule, part_slice

    assert [part_slice(16, 8, 3, i, 3) for i in range(3)] == [(16, 3), (19, 3), (22, 2)]
    layout = Layout(BatchSchedule.parse("1:8,4:16"), anchor=(3, 100))
    first, gbs = layout.step_positions(5)
    assert (first, gbs) == (124, 16)
    assert [layout.part_positions(5, i, 3) for i in range(3)] == [(124, 6), (130, 5), (135, 5)]
    with pytest.raises(ValueError, match=r"part must be in \[0, 3\), got 3"):
        layout.part_positions(5, 3, 3)


@given(gbs=st.integers(1, 512), degree=st.integers(1, 16), first=st.integers(0, 10**9))
def test_a_samples_rank_is_the_rank_whose_slice_holds_it(gbs, degree, first):
    """slice_index inverts rank_slice: the sample at index i of the step lies in the
    slice of the rank it names, at the index it names."""
    from torchtitan_zephon.order.layout import rank_slice, slice_index

    for i in range(gbs):
        rank, within = slice_index(i, gbs, degree)
        if gbs % degree:
            assert (rank, within) == (0, i)  # a degree that does not divide: one slice
            continue
        start, count = rank_slice(first, gbs, 1, rank, degree)
        assert start + within == first + i and 0 <= within < count


@given(part=st.integers(1, 300), inner=st.integers(1, 20), b=st.integers(1, 40))
def test_a_parts_microbatches_match_over_its_inner_ranks(part, inner, b):
    """Issue 30: within a replica group's part, every inner DP rank runs the same
    number k of micro-batches (their collectives match), none empty; the ranks' slices
    are as even as possible and together hold the part; a micro-batch holds at most b
    samples unless the slices' one-sample difference forces more, then at most
    ceil(largest slice / k)."""
    from torchtitan_zephon.order.layout import part_microbatch_sizes

    if inner > part:
        with pytest.raises(ValueError, match=f"cannot be cut over {inner} data-parallel"):
            part_microbatch_sizes(part, 0, inner, b)
        return
    sizes = [part_microbatch_sizes(part, r, inner, b) for r in range(inner)]
    counts = {len(s) for s in sizes}
    assert len(counts) == 1  # one micro-batch count for the whole group
    (k,) = counts
    slices = [sum(s) for s in sizes]
    assert sum(slices) == part and max(slices) - min(slices) <= 1
    assert slices == sorted(slices, reverse=True)
    assert all(n >= 1 for s in sizes for n in s)
    largest = max(slices)
    assert all(n <= max(b, -(-largest // k)) for s in sizes for n in s)
    if min(slices) >= -(-largest // b):  # room for b-sized micro-batches: as few as that
        assert k == -(-largest // b) and all(n <= b for s in sizes for n in s)


@settings(max_examples=120, deadline=None)
@given(stream=streams(), data=st.data())
def test_the_parts_microbatches_concatenate_to_the_step_for_any_quorum(stream, data):
    """Whatever the quorum's size n, the micro-batches of every participant's inner
    ranks, in part, rank and micro-batch order, are the step's positions and its ids;
    with one participant and a layout that divides, they are today's rank micro-batches
    (so one group under torchft draws what a run without it draws)."""
    layout = stream.layout
    step = data.draw(st.integers(layout.anchor_step, layout.anchor_step + 40))
    first, gbs = stream.step_positions(step)
    n = data.draw(st.integers(1, gbs))
    inner = data.draw(st.integers(1, max(1, gbs // n)))
    b = data.draw(st.integers(1, 6))
    cuts, ids = [], []
    for part in range(n):
        for r in range(inner):
            cuts += layout.part_microbatch_positions(step, part, n, r, inner, b)
            ids += stream.part_microbatch_ids(step, part, n, r, inner, b)
    at = first
    for p, count in cuts:
        assert p == at and count >= 1
        at += count
    assert at == first + gbs
    assert np.array_equal(np.concatenate(ids), stream.global_ids(step))
    d = data.draw(st.sampled_from(_divisors(gbs)))
    b = data.draw(st.sampled_from(_divisors(gbs // d)))
    for r in range(d):
        assert layout.part_microbatch_positions(step, 0, 1, r, d, b) == (
            layout.microbatch_positions(step, r, d, b)
        )
