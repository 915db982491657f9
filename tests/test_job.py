"""Sources behind one interface: one store, or a mixture of several, as sample keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store, edit_token
from tests.order.test_mixture import batch_schedules, mixtures
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.job.plans import mixture_progress, plan_of
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.resume import check_resume
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.order.stream import ID_MASK, DataPlan, make_keys, split_keys
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import slice_store

SEQ = 8
CUTS = {"code": (0, 1800), "web": (1800, 3600), "math": (3600, None)}


@pytest.fixture(scope="module")
def slices(store, tmp_path_factory) -> dict[str, TokenStore]:
    """Three stores cut from the test store: a mixture's sources."""
    root = tmp_path_factory.mktemp("slices")
    return {
        name: slice_store(store, a, b or store.num_tokens, root / name)
        for name, (a, b) in CUTS.items()
    }


def mixture_text(slices, weights: str, later: str = "", *, reverse: bool = False) -> str:
    blocks = [f'[[source]]\nname = "{n}"\nstore = "{s.path}"\n' for n, s in slices.items()]
    if reverse:
        blocks.reverse()
    return "".join(blocks) + f"[[schedule]]\nfrom_step = 1\nweights = {weights}\n" + later


W1 = "{ web = 0.5, code = 0.3, math = 0.2 }"
LATER = "[[schedule]]\nfrom_step = 4\nweights = { web = 0.1, code = 0.0, math = 0.9 }\n"


def mixture(slices, text: str | None = None, heldout: int = 3) -> JobData:
    cfg = MixtureConfig.loads(text or mixture_text(slices, W1, LATER))
    return JobData.open_mixture(cfg, SEQ, default_heldout=heldout)


def loader(source, d, r, b, schedule="1:12,6:24", **kw) -> ZephonLoader:
    return ZephonLoader(
        source, seq_len=SEQ, seed=5, schedule=BatchSchedule.parse(schedule), dp_rank=r,
        dp_degree=d, local_batch_size=b, **kw,
    )  # fmt: skip


def take_steps(ld: ZephonLoader, steps: int) -> list[np.ndarray]:
    out = []
    for _ in range(steps):
        start, rows = ld.next_step, []
        while ld.next_step == start:
            x, y = next(ld)
            rows.append(np.concatenate([x["input"].numpy(), y[:, -1:].numpy()], axis=1))
        out.append(np.concatenate(rows))
    return out


# ---------------------------------------------------------------- keys and plans


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 2**22), st.integers(0, ID_MASK)), max_size=50))
def test_keys_name_source_and_id_exactly(pairs):
    sources = np.array([p[0] for p in pairs], dtype=np.int64)
    ids = np.array([p[1] for p in pairs], dtype=np.int64)
    keys = make_keys(sources, ids)
    s, i = split_keys(keys)
    assert s.tolist() == sources.tolist() and i.tolist() == ids.tolist()
    assert len(set(keys.tolist())) == len(set(pairs))  # distinct pairs, distinct keys
    if pairs:
        assert (make_keys(np.zeros_like(ids), ids) == ids).all()  # source 0: the id itself


@settings(max_examples=200, deadline=None)
@given(
    schedule=batch_schedules(max_gbs=12),
    anchor=st.integers(1, 40),
    extra=st.integers(0, 500),
)
def test_the_whole_schedule_continues_at_the_anchor(schedule, anchor, extra):
    """The whole schedule a mixture plan needs for a DataPlan anchor: same positions
    and batch sizes from the anchor on, the anchor at its recorded position."""
    position = anchor - 1 + extra if anchor > 1 else 0
    eff = Layout(schedule, (anchor, position)).whole_schedule()
    plan = DataPlan(10, 0, schedule, anchor_step=anchor, anchor_position=position)
    for s in range(anchor, anchor + 30):
        assert eff.gbs(s) == schedule.gbs(s)
        assert eff.first_position(s) == plan.step_positions(s)[0]
    with pytest.raises(ValueError, match="impossible"):
        Layout(schedule, (5, 3)).whole_schedule()


@settings(max_examples=40, deadline=None)
@given(
    spec=mixtures(),
    batch=batch_schedules(max_gbs=12),
    data=st.data(),
)
def test_a_rank_stream_window_is_its_slices_concatenated(spec, batch, data):
    plan = MixtureStream(MixturePlan(spec, 3, batch))
    step = data.draw(st.integers(1, 30))
    d = data.draw(st.sampled_from([x for x in range(1, 13) if batch.gbs(step) % x == 0]))
    if any(g % d for _, g in batch.entries):
        d = 1
    r = data.draw(st.integers(0, d - 1))
    stream = np.concatenate([plan.rank_ids(s, r, d) for s in range(step, step + 12)])
    skip = data.draw(st.integers(0, len(stream)))
    count = data.draw(st.integers(0, len(stream) - skip))
    window = plan.rank_stream_ids(step, skip, count, r, d)
    assert window.tolist() == stream[skip : skip + count].tolist()
    assert np.concatenate([plan.rank_ids(step, q, d) for q in range(d)]).tolist() == (
        plan.global_ids(step).tolist()
    )


def test_one_store_is_the_store_source_with_sample_ids_as_keys(store):
    a = loader(store, 1, 0, 4, num_samples=100)
    b = loader(JobData.of_store(store, SEQ, num_samples=100), 1, 0, 4)
    assert a.config == b.config and a.config.mixture is None
    old = DataConfig.make(  # what the loader built before sources: old checkpoints resume
        seq_len=SEQ, seed=5, schedule=a.plan.schedule, sample_offset=0, num_samples=100,
        store_fingerprint=store.fingerprint, tokenizer_hash=store.tokenizer_hash,
    )  # fmt: skip
    assert a.config == old and a.config.fingerprint == old.fingerprint
    assert isinstance(a.plan, DataPlan)
    assert a.plan.global_ids(3).tolist() == DataPlan(100, 5, a.plan.schedule).global_ids(3).tolist()
    for x, y in zip(take_steps(a, 3), take_steps(b, 3), strict=True):
        assert np.array_equal(x, y)
    assert a.state_dict() == b.state_dict()
    (held,) = JobData.of_store(store, SEQ, num_samples=100).heldout()
    assert (held.name, held.first, held.count) == (None, 100, store.num_samples(SEQ) - 100)


# ---------------------------------------------------------------- a mixture


def test_a_mixture_reads_each_key_from_its_store(slices):
    source = mixture(slices)
    assert source.names == ["code", "math", "web"]  # name order: the keys' source index
    plan = source.plan(source.data_config(seed=5, schedule=BatchSchedule.parse("12")))
    keys = np.concatenate([plan.global_ids(s) for s in range(1, 9)])
    rows = source.windows(keys, SEQ)
    names, ids = plan.decode(keys)
    assert set(names) == {"code", "math", "web"}
    for row, name, i in zip(rows, names, ids.tolist(), strict=True):
        assert np.array_equal(row, slices[name].window(i, SEQ))
    # held-out samples are never drawn: each source's last 3 (a [[source]] may say otherwise)
    for h in source.heldout():
        assert h.count == 3 and h.first == slices[h.name].num_samples(SEQ) - 3
        assert (ids[np.array(names) == h.name] < h.first).all()


def test_source_block_order_changes_nothing(slices):
    a = mixture(slices, mixture_text(slices, W1, LATER))
    b = mixture(slices, mixture_text(slices, W1, LATER, reverse=True))
    sched = BatchSchedule.parse("12")
    ca, cb = a.data_config(seed=1, schedule=sched), b.data_config(seed=1, schedule=sched)
    assert ca == cb
    assert a.plan(ca).global_ids(7).tolist() == b.plan(cb).global_ids(7).tolist()


@settings(max_examples=8, deadline=None)
@given(
    first=st.sampled_from([(1, 2), (2, 3), (3, 1), (6, 2)]),
    second=st.sampled_from([(1, 12), (2, 6), (4, 3), (12, 1), (3, 4)]),
    k=st.integers(1, 7),
)
def test_a_mixture_resumes_exactly_under_another_dp_layout(slices, first, second, k):
    """Ranks' micro-batches concatenate to the global batch under any layout, across
    the weight change at step 4 and the batch change at step 6, and a state saved
    after k steps continues the uninterrupted stream under another layout."""
    source = mixture(slices)
    plan = loader(source, 1, 0, 12).plan
    expected = [source.windows(plan.global_ids(s), SEQ) for s in range(1, 10)]

    def run(d, b, steps, state=None):
        per_rank, states = [], []
        for r in range(d):
            with loader(source, d, r, b) as ld:
                if state is not None:
                    ld.load_state_dict(state)
                per_rank.append(take_steps(ld, steps))
                states.append(ld.state_dict())
        assert all(s == states[0] for s in states)  # one record, the same on every rank
        return [np.concatenate([p[s] for p in per_rank]) for s in range(steps)], states[0]

    got, state = run(*first, k)
    rest, _ = run(*second, 9 - k, state)
    for s, (a, b) in enumerate(zip(got + rest, expected, strict=True), 1):
        assert np.array_equal(a, b), f"step {s}"


def test_progress_is_the_replayed_counts(slices):
    source = mixture(slices)
    ld = loader(source, 1, 0, 12)
    plan = ld.plan
    counts = {n: 0 for n in source.names}
    for step in range(1, 30):
        state = DataState(ld.config, step, plan.step_positions(step)[0])
        progress = mixture_progress(state)
        by_name = {s["name"]: s for s in progress["sources"]}
        for name, spec in zip(source.names, source.mixture.sources, strict=True):
            assert by_name[name]["samples"] == counts[name], (step, name)
            assert by_name[name]["epoch"] == counts[name] // spec.num_samples
            assert abs(by_name[name]["deviation"]) <= progress["max_deviation"]
        names, _ = plan.decode(plan.global_ids(step))
        for n in names:
            counts[n] += 1
    assert progress["sources"][1]["weight"] == "9/10"  # math, from step 4
    assert mixture_progress(DataState(loader(slices["web"], 1, 0, 4).config, 3, 8)) is None
    assert isinstance(plan_of(ld.config), MixtureStream)  # rebuilt from the config alone
    assert plan_of(ld.config).global_ids(9).tolist() == plan.global_ids(9).tolist()


def test_a_changed_source_or_past_weight_is_refused_and_future_entries_continue(slices, tmp_path):
    source = mixture(slices, mixture_text(slices, W1))
    ld = loader(source, 1, 0, 12)
    take_steps(ld, 3)
    saved = ld.data_state()
    appended = loader(mixture(slices, mixture_text(slices, W1, LATER)), 1, 0, 12)
    assert check_resume(saved, appended.config).extended == ("mixture",)
    past = "[[schedule]]\nfrom_step = 3\nweights = { web = 1, code = 0, math = 0 }\n"
    edited = loader(mixture(slices, mixture_text(slices, W1, past)), 1, 0, 12)
    with pytest.raises(ValueError, match=r"mixture: schedule entry 2 \(from_step 3\) was added"):
        check_resume(saved, edited.config)
    assert check_resume(saved, edited.config, ["mixture"]).accepted == ("mixture",)

    changed = dict(slices)
    changed["web"] = copy_store(slices["web"].path, tmp_path / "web")
    edit_token(changed["web"], 5)  # content differs; re-checksummed as a new store
    from tests.conftest import _manifest, _write_manifest
    from torchtitan_zephon.store.format import manifest_fingerprint
    from torchtitan_zephon.store.writer import write_checksums

    m = _manifest(changed["web"])
    m["content"] = write_checksums(changed["web"], m)
    m["fingerprint"] = manifest_fingerprint(m)
    _write_manifest(changed["web"], m)
    changed["web"] = TokenStore.open(changed["web"])
    other = loader(mixture(changed, mixture_text(changed, W1)), 1, 0, 12)
    with pytest.raises(ValueError, match=r"mixture: source 'web': store_fingerprint was \w+"):
        check_resume(saved, other.config)


def test_content_checks_and_the_vocabulary_guard_hold_for_every_source(slices, tmp_path):
    bad = dict(slices)
    bad["math"] = TokenStore.open(copy_store(slices["math"].path, tmp_path / "math"))
    edit_token(bad["math"].path, 3)  # same fingerprint, changed content
    source = mixture(bad, mixture_text(bad, "{ web = 1, code = 1, math = 1 }"))
    keys = make_keys(np.array([0, 1, 2]), np.array([0, 0, 1]))  # code 0, math 0, web 1
    with pytest.raises(StoreError, match="chunk 0 of tokens.bin"):
        source.windows(keys, SEQ)
    with pytest.raises(StoreError, match=r"model embeds only 10 ids"):
        source.id_limit(10)
    assert source.id_limit(10**6) is None
    with pytest.raises(IndexError, match="the mixture has 3"):
        source.windows(make_keys(np.array([3]), np.array([0])), SEQ)
    with pytest.raises(IndexError, match=r"sample id 100000 outside \[0, \d+\) for seq_len 8"):
        source.windows(make_keys(np.array([0, 2]), np.array([0, 100000])), SEQ)
    assert source.windows(np.empty(0, dtype=np.int64), SEQ).shape == (0, SEQ + 1)


def test_a_mixture_opened_again_is_a_new_object_checked_afresh(slices, tmp_path):
    """Nothing keeps opened mixtures per process (a job opens its data once and hands
    the object on): a second open is a second object, and a store rebuilt on disk in
    between has its content checked afresh."""
    stores = {n: TokenStore.open(copy_store(s.path, tmp_path / n)) for n, s in slices.items()}
    text = mixture_text(stores, W1)
    first = mixture(stores, text)
    keys = make_keys(np.array([0]), np.array([0]))  # source 'code', sample 0: chunk 0
    first.windows(keys, SEQ)  # checked by the first object
    rebuilt = copy_store(stores["code"].path, tmp_path / "rebuilt")
    edit_token(rebuilt, 3)  # same fingerprint, changed content, written as a new file
    (rebuilt / "tokens.bin").replace(stores["code"].path / "tokens.bin")
    again = mixture(stores, text)
    assert again is not first
    with pytest.raises(StoreError, match="chunk 0 of tokens.bin"):
        again.windows(keys, SEQ)
    assert mixture(stores, text) is not again


def test_ids_at_far_positions_with_huge_epochs():
    """(source, epoch) pairs too large to pack in one int64 take the slower path alike."""
    from torchtitan_zephon.order.mixture.spec import MixtureSpec

    spec = MixtureSpec.build({"a": 1, "b": 3}, [(1, {"a": 1, "b": 1})])
    plan = MixturePlan(spec, 7, BatchSchedule([(1, 4)]))
    for step in (5, 10**18):  # epochs of 'a' near 2 x 10^18: past the packed path
        first, count = plan.step_positions(step)
        sources, ids = plan.ids_for_positions(first, count)
        before = plan.counts_at_position(first)
        seen = {0: 0, 1: 0}
        for s, i in zip(sources.tolist(), ids.tolist(), strict=True):
            position = int(before[s]) + seen[s]
            seen[s] += 1
            expect = plan._streams[s].ids_for_positions(position, 1)[0]
            assert i == expect, (step, s, position)


def test_sources_of_another_tokenizer_are_refused(slices, corpus_dir, tmp_path):
    """A store prepared with another tokenizer cannot join the mixture: named at open."""
    from tests.conftest import build_tokenizer
    from torchtitan_zephon.ingest.prepare import prepare_store
    from torchtitan_zephon.order.mixture.config import MixtureError

    other_tok = build_tokenizer(tmp_path / "tok", extra_vocab=5)
    prepare_store([str(corpus_dir)], str(other_tok), str(tmp_path / "other"), progress=False)
    text = mixture_text(slices, "{ web = 1, code = 1, math = 1 }").replace(
        str(slices["web"].path), str(tmp_path / "other")
    )
    with pytest.raises(MixtureError, match="sources 'code' and 'web' differ in tokenizer"):
        mixture(slices, text)


def test_an_accepted_batch_schedule_edit_continues_at_the_saved_position(slices):
    """allow_changes=["schedule"] on a mixture: no position skipped or repeated; the new
    batch sizes from the resume on, every key a valid sample of its source."""
    source = mixture(slices)
    ld = loader(source, 1, 0, 12, schedule="12")
    take_steps(ld, 3)
    saved = ld.data_state()
    edited = loader(source, 2, 1, 6, schedule="1:24")
    with pytest.raises(ValueError, match="schedule: "):
        edited.load_state_dict(saved)
    decision = edited.load_state_dict(saved, allow_changes=["schedule"])
    assert decision.anchor == (4, 36)
    assert edited.plan.step_positions(4) == (36, 24) and edited.plan.step_positions(5) == (60, 24)
    rows = take_steps(edited, 2)
    assert [len(r) for r in rows] == [12, 12]  # rank 1 of 2: half of each 24
    names, ids = edited.plan.decode(edited.plan.global_ids(5))
    for name, i in zip(names, ids.tolist(), strict=True):
        assert 0 <= i < slices[name].num_samples(SEQ) - 3
    assert edited.data_state().consumed_positions == 84


def test_a_rule_1_state_continues_bound_to_rule_1_when_no_step_is_corrected(slices):
    """A checkpoint of the previous mixture rule (format 1), whose schedule the current
    rule corrects nowhere: the loader continues the same batches and keeps the saved
    rule in its config, so the next checkpoint and every step's ids digest key still
    bind it (a run resumed across the upgrade verifies against an uninterrupted one)."""
    source = mixture(slices)
    with loader(source, 1, 0, 12) as ld:
        assert source.plan(ld.config).mixture.first_correction is None
        take_steps(ld, 3)
        saved = ld.data_state()
        expected = take_steps(ld, 4)
    rule1 = {**saved.config.mixture, "format": "zephon-mixture/1"}
    old = DataConfig.from_dict({**saved.config.to_dict(), "mixture": rule1})
    state = DataState(old, saved.next_step, saved.consumed_positions, saved.position_anchor)
    with loader(source, 2, 1, 6) as ld:
        decision = ld.load_state_dict(state)
        assert decision.config == old and ld.config == old
        assert ld.data_state().config == old
        assert [ld.config.step_key(s) for s in range(1, 9)] == [
            old.step_key(s) for s in range(1, 9)
        ]
        got = take_steps(ld, 4)
    assert all(np.array_equal(a, b[len(b) // 2 :]) for a, b in zip(got, expected, strict=True))
