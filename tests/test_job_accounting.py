"""job.accounting: the per-source counts of a step against the plan's ids (a slow
per-sample reference), cumulative = the sum of the steps, exact targets from the
weights, epochs past skip ranges and left-out samples (a whole-stream walk),
documents started against a per-sample count."""

from __future__ import annotations

import bisect
from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.order.test_exclusions import exclusion_entries, file_text, reference
from tests.order.test_mixture import batch_schedules, mixtures
from tests.order.test_skips import skip_steps
from torchtitan_zephon.job.accounting import document_offsets, documents_started, step_account
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.order.exclusions import Exclusions
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.spec import MixtureSpec
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import STORE_NAME, DataPlan, split_keys
from torchtitan_zephon.store.writer import slice_store


def step_sources(plan, step: int, n: int) -> np.ndarray:
    """Per-source samples of a step, counted sample by sample from its ids."""
    keys = plan.global_ids(step)
    sources = split_keys(keys)[0] if isinstance(plan, MixtureStream) else np.zeros(len(keys))
    out = np.zeros(n, dtype=np.int64)
    for s in sources.tolist():
        out[int(s)] += 1
    return out


def reference_epochs(plan, steps, skips, sizes, seeds, entries=()) -> list[list[int]]:
    """Per step, each source's epoch of its last trained sample, walking the whole
    streams (tests/order/test_exclusions.py's reference): a skip range's steps read
    their draws, a left-out sample is deleted from its step on, so the stream reads
    past both."""
    n = len(sizes)
    read: list[list[int]] = []
    walk = reference(lambda u: rule_sources(plan, u), sizes, seeds, skips, entries, steps, read)
    last = [None] * n
    out = []
    for (src, _), positions in zip(walk, read, strict=True):
        for i, q in zip(src.tolist(), positions, strict=True):
            last[i] = q
        out.append([0 if last[i] is None else last[i] // sizes[i] for i in range(n)])
    return out


def rule_sources(plan, step: int) -> np.ndarray:
    """The source of each position of a step (no skips: the rule indexes positions by step)."""
    if isinstance(plan, MixtureStream):
        m = plan.mixture
        return m.position_sources(*m.step_positions(step))
    return np.zeros(plan.schedule.gbs(step), dtype=np.int64)


def weights_at(spec: MixtureSpec, step: int) -> list[Fraction]:
    entry = [e for e in spec.schedule if e.from_step <= step][-1]
    return [entry.weights[x] for x in spec.names]


@settings(max_examples=40, deadline=None)
@given(
    spec=mixtures(max_sources=4, max_entries=3),
    seed=st.integers(0, 2**40),
    schedule=batch_schedules(max_gbs=12),
    skips=skip_steps(),
    data=st.data(),
)
def test_mixture_accounting_equals_the_steps_ids(spec, seed, schedule, skips, data):
    steps = 30
    sizes = [int(s.num_samples) for s in spec.sources]
    entries = data.draw(exclusion_entries(sizes))
    exclusions = Exclusions.parse(file_text(entries, spec.names))
    plan = MixtureStream(MixturePlan(spec, seed, Layout(schedule, skips=skips), exclusions))
    n = len(spec.names)
    epochs = reference_epochs(plan, steps, skips, sizes, plan.mixture.source_seeds, entries)
    cumulative = np.zeros(n, dtype=np.int64)
    target = [Fraction(0)] * n
    previous = [0] * n
    for step in range(1, steps + 1):
        a = step_account(plan, step, seq_len=5)
        per = step_sources(plan, step, n)
        cumulative += per
        gbs = schedule.gbs(step)
        target = [t + w * gbs for t, w in zip(target, weights_at(spec, step), strict=True)]
        assert a.names == spec.names and a.step == step
        assert a.samples.tolist() == per.tolist()  # trained counts: skips change none
        assert a.tokens.tolist() == (per * 5).tolist()
        assert a.cumulative.tolist() == cumulative.tolist()
        assert a.targets == target
        assert a.deviations == [float(int(c) - t) for c, t in zip(cumulative, target, strict=True)]
        assert a.epochs.tolist() == epochs[step - 1]
        assert a.wraps == [
            (spec.names[i], epochs[step - 1][i])
            for i in range(n)
            if epochs[step - 1][i] > previous[i]
        ]
        previous = epochs[step - 1]


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(2, 50),
    offset=st.integers(0, 4),
    seed=st.integers(0, 2**40),
    schedule=batch_schedules(max_gbs=12),
    skips=skip_steps(),
    data=st.data(),
)
def test_one_store_is_one_source_whose_target_is_what_it_trained(
    size, offset, seed, schedule, skips, data
):
    entries = data.draw(exclusion_entries([size]))
    exclusions = Exclusions.parse(
        file_text([(i, s, [x + offset for x in ids]) for i, s, ids in entries])
    )
    plan = DataPlan(
        size, seed, schedule, offset, skips=skips, exclusions=exclusions.for_source(None)
    )
    epochs = reference_epochs(plan, 30, skips, [size], [seed], entries)
    total = 0
    for step in range(1, 31):
        a = step_account(plan, step, seq_len=3)
        total += schedule.gbs(step)
        assert a.names == [STORE_NAME]
        assert (a.samples.tolist(), a.cumulative.tolist()) == ([schedule.gbs(step)], [total])
        assert a.targets == [Fraction(total)] and a.deviations == [0.0]
        assert a.epochs.tolist() == epochs[step - 1]


def test_a_weight_change_and_a_skip_by_hand():
    """Weights 3:1 on GBS 8, then 1:1 from step 3; a skip of steps 2-3. Source b has 4
    samples: its 2 draws per step wrap it every second step; the skip consumes b's draws
    of steps 2 and 3 (2 + 4), so step 2 trains b's stream positions 8, 9 (epoch 2)."""
    spec = MixtureSpec.build({"a": 1000, "b": 4}, [(1, {"a": 3, "b": 1}), (3, {"a": 1, "b": 1})])
    plan = MixtureStream(
        MixturePlan(spec, 1, Layout(BatchSchedule([(1, 8)]), skips=SkipSteps.parse("2:2")))
    )
    got = [step_account(plan, s, seq_len=4) for s in (1, 2, 3, 4)]
    assert [a.samples.tolist() for a in got] == [[6, 2], [6, 2], [4, 4], [4, 4]]
    assert [a.cumulative.tolist() for a in got] == [[6, 2], [12, 4], [16, 8], [20, 12]]
    assert [a.targets for a in got] == [[6, 2], [12, 4], [16, 8], [20, 12]]
    # b: step 1 reads 0-1; step 2 reads 2 + 6 = 8, 9; step 3 reads 10-13; step 4 14-17
    assert [a.epochs.tolist() for a in got] == [[0, 0], [0, 2], [0, 3], [0, 4]]
    assert [a.wraps for a in got] == [[], [("b", 2)], [("b", 3)], [("b", 4)]]


# ---------------------------------------------------------------- documents started


def per_sample_documents(offsets: np.ndarray, ids, seq_len: int) -> int:
    off = offsets.tolist()
    return sum(
        bisect.bisect_left(off, (i + 1) * seq_len) - bisect.bisect_left(off, i * seq_len)
        for i in ids
    )


def test_documents_started_count_each_samples_document_starts(store, tmp_path):
    seq_len = 8
    data = JobData.of_store(
        store, seq_len, sample_offset=3, num_samples=store.num_samples(seq_len) - 5
    )
    plan = data.plan(data.data_config(seed=4, schedule=BatchSchedule([(1, 16), (3, 40)])))
    (offsets,) = document_offsets(data)
    assert offsets.tolist() == np.asarray(store.doc_offsets).tolist()
    seen = 0
    for step in range(1, 8):
        ids = plan.global_ids(step).tolist()
        got = documents_started(plan, step, [offsets], seq_len)
        assert got.tolist() == [per_sample_documents(offsets, ids, seq_len)]
        seen += int(got[0])
    assert seen > 0

    slice_store(store, 0, 2500, tmp_path / "code")
    slice_store(store, 2500, store.num_tokens, tmp_path / "web")
    (tmp_path / "mix.toml").write_text(
        '[[source]]\nname = "web"\nstore = "web"\n[[source]]\nname = "code"\nstore = "code"\n'
        "[[schedule]]\nfrom_step = 1\nweights = { web = 0.7, code = 0.3 }\n"
    )
    mix = JobData.open_mixture(MixtureConfig.load(tmp_path / "mix.toml"), seq_len)
    plan = mix.plan(mix.data_config(seed=2, schedule=BatchSchedule([(1, 20)])))
    offsets = document_offsets(mix)
    assert len(offsets) == 2
    for step in range(1, 6):
        sources, ids = split_keys(plan.global_ids(step))
        want = [
            per_sample_documents(offsets[i], ids[sources == i].tolist(), seq_len) for i in (0, 1)
        ]
        assert documents_started(plan, step, offsets, seq_len).tolist() == want
