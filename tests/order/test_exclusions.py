"""Left-out samples (order/exclusions.py): the file, the checks, and the map against a
slow reference.

The reference walks every source's whole sample stream draw by draw, as the issue
words the meaning: at step S the skip entries at S consume what steps S .. S + N - 1
draw (each draw the source's next sample not left out so far), then the entries with
from_step S join their source's left-out set, then every draw of the step takes the
source's next sample that is not left out. Hypothesis checks the plans (one store, a
mixture; with skips) against it at any DP degree, across batch schedules, including
the rank slices and the windows of a rank's stream the loader reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.order.schedules import random_schedules
from tests.order.test_mixture import batch_schedules, mixtures
from tests.order.test_skips import check_against, skip_steps
from torchtitan_zephon.job.plans import plan_of
from torchtitan_zephon.order.data_config import DataConfig, DataStateMismatch, data_extra
from torchtitan_zephon.order.exclusions import (
    EXCLUDE_FIELD,
    ExclusionMap,
    Exclusions,
    SourceRange,
)
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.spec import MixtureSpec
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.permutation import Permutation
from torchtitan_zephon.order.resume import allowed_fields, check_resume
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.order.stream import DataPlan, make_keys

# ---------------------------------------------------------------- the reference


def reference(sources_of_step, sizes, seeds, skips, entries, steps, positions=None):
    """(source, index) of every draw of steps 1..steps, walking the whole streams.

    ``entries``: (source, from_step, indices) with indices in [0, size). ``positions``
    (a list) gets, per step, the stream position each of its draws read."""
    n = len(sizes)
    perms: dict[tuple[int, int], np.ndarray] = {}
    raw = [0] * n
    left_out: list[set[int]] = [set() for _ in range(n)]

    def draw(i: int) -> int:
        while True:
            epoch, within = divmod(raw[i], sizes[i])
            if (i, epoch) not in perms:
                plan = DataPlan(sizes[i], seeds[i], BatchSchedule([(1, 1)]))
                perms[(i, epoch)] = plan.permutation(epoch).map(np.arange(sizes[i]))
            raw[i] += 1
            sample = int(perms[(i, epoch)][within])
            if sample not in left_out[i]:
                return sample

    skip_at = dict(skips.entries)
    out = []
    for step in range(1, steps + 1):
        for u in range(step, step + skip_at.get(step, 0)):
            for i in sources_of_step(u).tolist():
                draw(i)
        for i, from_step, ids in entries:
            if from_step == step:
                left_out[i] |= set(ids)
        src = sources_of_step(step)
        drawn, read = [], []
        for i in src.tolist():
            drawn.append(draw(i))
            read.append(raw[i] - 1)
        out.append((src, np.array(drawn, dtype=np.int64)))
        if positions is not None:
            positions.append(read)
    return out


def file_text(entries, names=None) -> str:
    """A zephon.exclude file of ``entries`` (source index, from_step, ids)."""
    return "\n".join(
        json.dumps({"ids": list(ids), "from_step": s, **({"source": names[i]} if names else {})})
        for i, s, ids in entries
    )


@st.composite
def exclusion_entries(draw, sizes, max_step=30, offset=0):
    """0-4 entries over the sources, never leaving one empty (ids as the file gives
    them: ``offset`` + index for one store)."""
    entries, left = [], [set() for _ in sizes]
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(sizes) - 1))
        ids = draw(st.lists(st.integers(0, sizes[i] - 1), max_size=min(8, sizes[i])))
        kept = []
        for x in ids:
            if len(left[i] | {x}) < sizes[i]:
                left[i].add(x)
                kept.append(x)
        ids = kept
        entries.append((i, draw(st.integers(1, max_step)), ids))
    return entries


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(2, 40),
    offset=st.integers(0, 3),
    seed=st.integers(0, 2**40),
    schedule=batch_schedules(max_gbs=12),
    skips=skip_steps(),
    data=st.data(),
)
def test_one_store_left_out_samples_equal_the_reference(n, offset, seed, schedule, skips, data):
    steps = 34
    entries = data.draw(exclusion_entries([n]))
    exclusions = Exclusions.parse(
        file_text([(i, s, [x + offset for x in ids]) for i, s, ids in entries])
    )
    exclusions.check({None: SourceRange(offset, n, offset + n)})
    plan = DataPlan(n, seed, schedule, offset, skips=skips, exclusions=exclusions.for_source(None))
    walk = reference(
        lambda u: np.zeros(schedule.gbs(u), dtype=np.int64), [n], [seed], skips, entries, steps
    )
    want = [ids + offset for _, ids in walk]
    check_against(plan, want, steps, data)
    for _, from_step, ids in entries:  # never trained from its step on
        for step in range(from_step, steps + 1):
            assert not set(plan.global_ids(step).tolist()) & {x + offset for x in ids}


@settings(max_examples=50, deadline=None)
@given(
    spec=mixtures(max_sources=4, max_entries=3),
    seed=st.integers(0, 2**40),
    schedule=batch_schedules(max_gbs=12),
    skips=skip_steps(),
    data=st.data(),
)
def test_mixture_left_out_samples_equal_the_reference(spec, seed, schedule, skips, data):
    steps = 30
    sizes = [int(s.num_samples) for s in spec.sources]
    entries = data.draw(exclusion_entries(sizes))
    exclusions = Exclusions.parse(file_text(entries, spec.names))
    plan = MixturePlan(spec, seed, Layout(schedule, skips=skips), exclusions)
    stream = MixtureStream(plan)
    rule = MixturePlan(spec, seed, schedule)
    walk = reference(
        lambda u: rule.position_sources(*rule.step_positions(u)),
        sizes,
        rule.source_seeds,
        skips,
        entries,
        steps,
    )
    check_against(stream, [make_keys(src, ids) for src, ids in walk], steps, data)
    for step in range(1, steps + 1):  # exact per-source counts: the positions stay
        assert np.array_equal(plan.step_counts(step), rule.step_counts(step))


@pytest.mark.parametrize("case", random_schedules(2201, 6))
def test_mixture_schedules_of_the_benchmark_with_left_out_samples(case):
    """The fixed benchmark schedules (tests/order/schedules.py), a list per source."""
    names = sorted(case["names"])
    sizes = {x: 17 + 5 * k for k, x in enumerate(names)}
    spec = MixtureSpec.build(sizes, case["entries"])
    schedule = BatchSchedule(case["batch"])
    rng = np.random.default_rng(len(names))
    entries = [
        (k, int(rng.integers(1, case["horizon"])), rng.choice(sizes[x], 6, replace=False).tolist())
        for k, x in enumerate(spec.names)
    ]
    plan = MixtureStream(
        MixturePlan(spec, 9, schedule, Exclusions.parse(file_text(entries, spec.names)))
    )
    rule = MixturePlan(spec, 9, schedule)
    steps = min(case["horizon"], 80)
    walk = reference(
        lambda u: rule.position_sources(*rule.step_positions(u)),
        [sizes[x] for x in spec.names],
        rule.source_seeds,
        SkipSteps(),
        entries,
        steps,
    )
    for step in range(1, steps + 1):
        src, ids = walk[step - 1]
        assert np.array_equal(plan.global_ids(step), make_keys(src, ids)), step


def test_an_entry_spans_epochs_and_each_epoch_trains_every_kept_sample_once():
    n, gbs = 30, 4
    left = [3, 7, 11, 29]
    exclusions = Exclusions.parse(file_text([(0, 1, left)]))
    plan = DataPlan(n, 2, BatchSchedule([(1, gbs)]), exclusions=exclusions.for_source(None))
    ids = np.concatenate([plan.global_ids(s) for s in range(1, 1 + (n - 4) * 5 // gbs + 1)])
    kept = n - len(left)
    for epoch in range(4):  # ids of epoch k: the permutation order of the kept samples
        part = ids[epoch * kept : (epoch + 1) * kept]
        assert sorted(part.tolist()) == sorted(set(range(n)) - set(left))
        perm = plan.permutation(epoch).map(np.arange(n))
        assert part.tolist() == [x for x in perm.tolist() if x not in left]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 30), seed=st.integers(0, 2**40), data=st.data())
def test_the_inverse_gives_each_effective_position_back_and_says_what_is_left_out(n, seed, data):
    """ExclusionMap.effective inverts raw: effective(raw(e)) == (e, 0), and every stream
    position raw passes over holds a sample of the entry it names, past that entry's start."""
    k = data.draw(st.integers(1, 4))
    thresholds = sorted(data.draw(st.lists(st.integers(0, 3 * n), min_size=k, max_size=k)))
    steps = sorted(data.draw(st.lists(st.integers(1, 50), min_size=k, max_size=k, unique=True)))
    pool = np.array(data.draw(st.permutations(range(n))), dtype=np.int64)
    pool = pool[: data.draw(st.integers(0, n - 1))]
    cuts = sorted(data.draw(st.lists(st.integers(0, pool.size), min_size=k - 1, max_size=k - 1)))
    new_ids = [np.sort(x) for x in np.split(pool, cuts)]
    m = ExclusionMap(n, seed, thresholds, new_ids, steps)
    e = np.arange(thresholds[-1] + 3 * n, dtype=np.int64)
    q = m.raw(e)
    assert np.all(np.diff(q) > 0)
    back, by = m.effective(q)
    assert back.tolist() == e.tolist() and not by.any()
    assert m.effective(q.reshape(-1, 1))[0].ravel().tolist() == e.tolist()  # any shape
    gaps = np.setdiff1d(np.arange(int(q[-1]) + 1), q)
    back, by = m.effective(gaps)
    assert (back == -1).all() and (by > 0).all()
    for g, s in zip(gaps.tolist(), by.tolist(), strict=True):
        j = steps.index(s)
        assert int(Permutation(n, seed, g // n).map(np.array([g % n]))[0]) in new_ids[j]
        start = int(m.raw(np.array([thresholds[j] - 1]))[0]) + 1 if thresholds[j] else 0
        assert g >= start  # left out only once its entry has taken effect


def test_a_large_list_at_a_late_step_is_exact_without_a_scan():
    """1,000 ids of a store of 10**9 samples, from step 10**8: the map agrees with a
    reference built over the epoch alone (the left-out positions deleted)."""
    n, gbs, step = 10**9, 64, 10**8
    rng = np.random.default_rng(3)
    left = rng.choice(n, 1000, replace=False)
    plan = DataPlan(n, 4, BatchSchedule([(1, gbs)]))
    first = plan.step_positions(step)[0]
    # make the next draws hit left-out samples: leave out ids at positions after the start
    left[:50] = plan.permutation(first // n).map(first % n + np.arange(0, 100, 2))
    exclusions = Exclusions.parse(file_text([(0, step, left.tolist())]))
    excl = DataPlan(n, 4, BatchSchedule([(1, gbs)]), exclusions=exclusions.for_source(None))
    window = plan.ids_for_positions(first, 3 * gbs)
    kept = window[~np.isin(window, left)]
    got = np.concatenate([excl.global_ids(s) for s in (step, step + 1)])
    assert np.array_equal(got, kept[: 2 * gbs])
    assert np.array_equal(excl.global_ids(step - 1), plan.global_ids(step - 1))


# ---------------------------------------------------------------- the data config


def store_config(exclusions: Exclusions | None = None, skips: str = "") -> DataConfig:
    extra = data_extra(skip_steps=skips)
    if exclusions:
        extra[EXCLUDE_FIELD] = exclusions.to_json()
    return DataConfig.make(
        seq_len=8,
        seed=5,
        schedule=BatchSchedule.parse("1:4"),
        sample_offset=0,
        num_samples=500,
        store_fingerprint="s" * 64,
        tokenizer_hash="t" * 64,
        extra=extra,
    )


def test_the_config_binds_the_content_and_each_step_only_its_entries():
    plain = store_config()
    a = Exclusions.parse('{"ids": [5, 9], "from_step": 10}')
    same = Exclusions.parse('\n{"from_step": 10, "ids": [9, 5, 9]}\n\n')  # layout, order
    later = Exclusions.parse('{"ids": [5, 9], "from_step": 10}\n{"ids": [1], "from_step": 30}')
    ca, cl = store_config(a), store_config(later)
    assert EXCLUDE_FIELD not in plain.to_dict()  # no field: the old fingerprint
    assert store_config(same).fingerprint == ca.fingerprint
    assert ca.order_key == plain.order_key == cl.order_key
    assert [ca.step_key(s) == plain.step_key(s) for s in (9, 10)] == [True, False]
    assert all(cl.step_key(s) == ca.step_key(s) for s in range(1, 30))
    assert cl.step_key(30) != ca.step_key(30)
    assert DataConfig.from_dict(ca.to_dict()) == ca
    assert np.array_equal(
        plan_of(ca, exclusions=a).global_ids(12),
        DataPlan(500, 5, BatchSchedule([(1, 4)]), exclusions=a.for_source(None)).global_ids(12),
    )
    with pytest.raises(ValueError, match=r"left-out entries \(exclude\) are not those"):
        plan_of(ca)
    with pytest.raises(ValueError, match=r"left-out entries \(exclude\) are not those"):
        plan_of(ca, exclusions=later)


def test_entries_are_unioned_and_an_id_stays_left_out():
    e = Exclusions.parse(
        '{"ids": [4, 2], "from_step": 5}\n{"ids": [2, 3], "from_step": 9}\n'
        '{"ids": [7], "from_step": 5}'
    )
    assert [(x.from_step, x.ids.tolist()) for x in e.entries] == [(5, [2, 4, 7]), (9, [3])]
    redundant = Exclusions.parse('{"ids": [2, 4, 7], "from_step": 5}\n{"ids": [3], "from_step": 9}')
    assert redundant.to_json() == e.to_json()


# ---------------------------------------------------------------- the resume rule


def saved_at(config: DataConfig, next_step: int) -> DataState:
    return DataState(config, next_step, config.batch_schedule().first_position(next_step))


@st.composite
def lists(draw):
    return draw(exclusion_entries([500], max_step=30))


@settings(max_examples=120, deadline=None)
@given(old=lists(), new=lists(), next_step=st.integers(1, 30))
def test_an_entry_for_untrained_steps_is_a_continuation_and_a_past_edit_is_refused(
    old, new, next_step
):
    ea, eb = Exclusions.parse(file_text(old)), Exclusions.parse(file_text(new))
    a, b = store_config(ea), store_config(eb)
    state = saved_at(a, next_step)
    trained = next_step - 1
    past = lambda x: [e for e in x.to_json() if e["from_step"] <= trained]  # noqa: E731
    if ea.to_json() == eb.to_json():
        assert check_resume(state, b).extended == ()
    elif past(ea) == past(eb):
        decision = check_resume(state, b)
        assert decision.extended == (EXCLUDE_FIELD,)
        added = [e for e in eb.to_json() if e not in ea.to_json()]
        assert len([n for n in decision.notes if n.startswith("exclude gained")]) == len(added)
        plan_a, plan_b = plan_of(a, exclusions=ea), plan_of(b, exclusions=eb)
        for s in range(1, next_step):  # the trained past: same samples, same records
            assert a.step_key(s) == b.step_key(s)
            assert np.array_equal(plan_a.global_ids(s), plan_b.global_ids(s))
    else:
        with pytest.raises(DataStateMismatch) as e:
            check_resume(state, b)
        text = str(e.value)
        assert f"  {EXCLUDE_FIELD}: the left-out entries at or before step {trained}" in text
        assert f"allow_changes=['{EXCLUDE_FIELD}']" in text
        assert check_resume(state, b, [EXCLUDE_FIELD]).accepted == (EXCLUDE_FIELD,)


def test_rolling_back_and_leaving_out_samples_resumes_with_a_note():
    state = saved_at(store_config(), 101)
    later = Exclusions.parse('{"ids": [17, 42], "from_step": 101}')
    decision = check_resume(state, store_config(later))
    assert decision.extended == (EXCLUDE_FIELD,)
    assert decision.notes[0].startswith("exclude gained an entry: from step 101, 2 ids (sha256 ")
    with pytest.raises(DataStateMismatch) as e:
        check_resume(state, store_config(Exclusions.parse('{"ids": [17], "from_step": 100}')))
    assert "differ from step 100 on (saved: (none); current: from step 100, 1 id (sha256" in str(
        e.value
    )
    assert "exclude" in allowed_fields(["exclude"], store_config())


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "text, fragments",
    [
        ('{"ids": [1], "from_step": 1', ["line 1 is not JSON", "expected one JSON object"]),
        ("\n[1, 2]", ["line 2 is [1, 2], not a JSON object"]),
        ('{"ids": [1]}', ["line 1: from_step is missing", "whole number >= 1"]),
        ('{"ids": [1], "from_step": 0}', ["from_step is 0", "1-based", ">= 1"]),
        ('{"ids": [1], "from_step": -4}', ["from_step is -4"]),
        ('{"ids": [1], "from_step": "5"}', ['from_step is "5"']),
        ('{"ids": [1, "x"], "from_step": 5}', ['ids holds "x"', "list of whole sample ids"]),
        ('{"ids": 3, "from_step": 5}', ["ids is 3"]),
        ('{"ids": [true], "from_step": 5}', ["ids holds true"]),
        ('{"id": [1], "from_step": 5}', ["unknown key(s) ['id']"]),
        ('{"ids": [1], "from_step": 5, "source": 7}', ["source is 7"]),
        ('{"ids": [1], "from_step": 9000000000000000000}', ["past the largest step"]),
        ("[" * 100_000, ["line 1 is not JSON", "nested too deeply"]),
    ],
)
def test_a_malformed_line_says_which_and_what_was_expected(text, fragments):
    with pytest.raises(ValueError) as e:
        Exclusions.parse(text, "zephon.exclude file x.jsonl")
    message = str(e.value)
    assert message.startswith("zephon.exclude file x.jsonl, line ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message


STORE = {None: SourceRange(0, 100, 120)}  # 100 training samples, 20 held out
MIX = {"code": SourceRange(0, 10, 12), "web": SourceRange(0, 30, 30)}


@pytest.mark.parametrize(
    "text, sources, fragments",
    [
        ('{"ids": [5, 130], "from_step": 2}', STORE, ["line 1: id 130 is not a sample of the store", "[0, 100)"]),
        ('{"ids": [-1], "from_step": 2}', STORE, ["id -1 is not a sample"]),
        ('{"ids": [105], "from_step": 2}', STORE, ["id 105 is a held-out (validation) sample", "[100, 120)"]),
        ('{"ids": [1], "from_step": 2, "source": "web"}', STORE, ['names "source": "web"', 'drop "source"']),
        ('{"ids": [1], "from_step": 2}', MIX, ['has no "source"', "'code', 'web'"]),
        ('{"ids": [1], "from_step": 2, "source": "wiki"}', MIX, ["source 'wiki' is not a source"]),
        ('{"ids": [10], "from_step": 2, "source": "code"}', MIX, ["held-out (validation) sample of source 'code'"]),
        (f'{{"ids": {list(range(10))}, "from_step": 2, "source": "code"}}', MIX, ["leaves out all 10 training samples of source 'code'", "weight 0"]),
        (f'{{"ids": {list(range(50))}, "from_step": 2}}\n{{"ids": {list(range(50, 100))}, "from_step": 9}}', STORE, ["leaves out all 100 training samples of the store"]),
    ],
)  # fmt: skip
def test_ids_that_do_not_fit_the_data_are_refused(text, sources, fragments):
    e = Exclusions.parse(text, "zephon.exclude file x.jsonl")
    with pytest.raises(ValueError) as err:
        e.check(sources)
    assert "\n" not in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_an_unreadable_file_is_said(tmp_path):
    with pytest.raises(ValueError, match=r"^cannot read zephon.exclude file .*nope.jsonl: No such"):
        Exclusions.load(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="it is not UTF-8 text"):
        Exclusions.load(str(bad))
    with pytest.raises(ValueError, match="cannot read zephon.exclude file"):
        Exclusions.load(str(tmp_path))  # a folder
