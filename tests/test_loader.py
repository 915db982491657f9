"""ZephonLoader: exact stream, elastic resume, world-size-free state, refusals."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store, edit_token, make_v1
from torchtitan_zephon.job.loader import MAX_BUNDLE, DataStateMismatch, ZephonLoader
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.store.format import (
    DataUnreadable,
    StoreError,
    UncheckedStoreWarning,
    error_kind,
    fingerprint,
)
from torchtitan_zephon.store.reader import TokenStore

SEQ = 8
SCHEDULE = "1:12,5:24,9:12"


def _loader(store, d, r, b, workers=0, prefetch=2, seed=11, schedule=SCHEDULE, seq=SEQ, **kw):
    return ZephonLoader(
        store,
        seq_len=seq,
        seed=seed,
        schedule=BatchSchedule.parse(schedule),
        dp_rank=r,
        dp_degree=d,
        local_batch_size=b,
        num_workers=workers,
        prefetch=prefetch,
        **kw,
    )


def _take_steps(loader, steps):
    """Inputs (with the label column appended) of ``steps`` whole steps, one array per step."""
    out = []
    for _ in range(steps):
        start = loader.next_step
        rows = []
        while loader.next_step == start:
            x, y = next(loader)
            rows.append(torch.cat([x["input"], y[:, -1:]], dim=1).numpy())
        out.append(np.concatenate(rows))
    return out


def _global_steps(store, d, b, steps, workers=0, state=None, allow=()):
    """Concatenate all ranks' deliveries per step."""
    per_rank = []
    for r in range(d):
        with _loader(store, d, r, b, workers=workers) as ld:
            if state is not None:
                ld.load_state_dict(state, allow_changes=allow)
            per_rank.append(_take_steps(ld, steps))
    return [np.concatenate([pr[s] for pr in per_rank]) for s in range(steps)]


def _reference(store, steps, seed=11, schedule=SCHEDULE):
    ld = _loader(store, 1, 0, 1, prefetch=0, seed=seed, schedule=schedule)
    return [store.windows(ld.plan.global_ids(s), SEQ) for s in range(1, steps + 1)]


def test_stream_matches_plan_and_labels_shift(store):
    ref = _reference(store, 12)
    with _loader(store, 1, 0, 4, workers=2) as ld:
        got = _take_steps(ld, 12)
        x, y = ld.step_microbatches(3)[0]
    for a, b in zip(got, ref, strict=True):
        assert np.array_equal(a, b.astype(np.int64))
    assert x["input"].dtype == torch.int64 and y.dtype == torch.int64
    assert x["input"].shape == (4, SEQ) and torch.equal(x["input"][:, 1:], y[:, :-1])


LAYOUTS = [(1, 1), (1, 12), (2, 2), (2, 6), (3, 2), (4, 3), (6, 1), (12, 1)]


@settings(max_examples=12, deadline=None)
@given(
    before=st.sampled_from(LAYOUTS),
    after=st.sampled_from(LAYOUTS),
    workers=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    save_at=st.integers(0, 11),
)
def test_elastic_resume_equals_uninterrupted(store, before, after, workers, save_at):
    (d1, b1), (d2, b2) = before, after
    if d1 == d2:
        d2, b2 = (1, 4) if d1 != 1 else (4, 3)
    total = 14
    ref = _reference(store, total)
    # run under layout 1 up to save_at, collecting every rank's state
    states = []
    for r in range(d1):
        with _loader(store, d1, r, b1, workers=workers[0]) as ld:
            _take_steps(ld, save_at)
            states.append(ld.state_dict())
    assert all(s == states[0] for s in states)
    assert len(json.dumps(states[0])) < 4096
    resumed = _global_steps(store, d2, b2, total - save_at, workers=workers[1], state=states[0])
    for k, got in enumerate(resumed):
        assert np.array_equal(got, ref[save_at + k]), f"step {save_at + k + 1}"


def test_state_independent_of_rank_layout_and_workers(store):
    states = set()
    for d, b in LAYOUTS:
        for w in (0, 2):
            with _loader(store, d, d - 1, b, workers=w) as ld:
                _take_steps(ld, 5)
                states.add(json.dumps(ld.state_dict(), sort_keys=True))
    assert len(states) == 1
    state = json.loads(states.pop())
    assert state["next_step"] == 6 and state["consumed_positions"] == 4 * 12 + 24
    assert set(state["data_config"]) >= {
        "seq_len",
        "seed",
        "schedule",
        "sample_offset",
        "num_samples",
        "store_fingerprint",
        "tokenizer_hash",
    }


def test_prefetched_and_partial_steps_are_not_counted(store):
    with _loader(store, 2, 0, 2, workers=2, prefetch=4) as ld:  # 3 micro-batches per step
        next(ld)
        assert ld.next_step == 1  # step 1 partially delivered
        next(ld)
        next(ld)
        assert ld.next_step == 2
        next(ld)
        state = ld.state_dict()  # prefetch has run well ahead by now
        assert state["next_step"] == 2 and state["consumed_positions"] == 12
    # resuming replays step 2 entirely
    with _loader(store, 2, 0, 2) as ld2:
        ld2.load_state_dict(state)
        first = next(ld2)
        assert torch.equal(first[0]["input"], ld2.step_microbatches(2)[0][0]["input"])


def test_load_state_resets_prefetch_midstream(store):
    with _loader(store, 1, 0, 4, workers=2, prefetch=3) as ld:
        _take_steps(ld, 3)
        state = ld.state_dict()
        _take_steps(ld, 2)
        next(ld)
        ld.load_state_dict(state)
        assert ld.next_step == 4
        got = _take_steps(ld, 2)
    ref = _reference(store, 5)
    assert np.array_equal(got[0], ref[3]) and np.array_equal(got[1], ref[4])


def test_epochs_wrap_forever(store):
    n = store.num_samples(SEQ)
    with _loader(store, 1, 0, 12, schedule="12", num_samples=30, sample_offset=5) as ld:
        seen = np.concatenate([ld.plan.global_ids(s) for s in range(1, 6)])
        assert np.array_equal(np.sort(seen[:30]), np.arange(5, 35))
        assert not np.array_equal(seen[:30], seen[30:60])
        _take_steps(ld, 6)
    assert n > 35


def test_mismatch_refused_naming_fields(store):
    with _loader(store, 1, 0, 4) as ld:
        _take_steps(ld, 2)
        state = ld.state_dict()
    other = json.loads(json.dumps(state))
    other["store_fingerprint"] = other["data_config"]["store_fingerprint"] = "f" * 64
    with (
        _loader(store, 2, 1, 2, seed=12, seq=16) as ld,
        pytest.raises(
            DataStateMismatch, match="does not hash to its recorded data_config_fingerprint"
        ),
    ):
        ld.load_state_dict(other)  # edited without its fingerprint: corrupt
    other["data_config_fingerprint"] = fingerprint(other["data_config"])  # another run's state
    with _loader(store, 2, 1, 2, seed=12, seq=16) as ld:
        with pytest.raises(DataStateMismatch) as e:
            ld.load_state_dict(other)
        msg = str(e.value)
        for field in ("seed: 11 -> 12", "seq_len: 8 -> 16", "store_fingerprint", "num_samples"):
            assert field in msg
        assert "allow_changes" in msg
        with pytest.raises(DataStateMismatch, match="seq_len"):
            ld.load_state_dict(other, allow_changes=["seed", "store"])
        ld.load_state_dict(other, allow_changes=["seed", "seq_len", "store"])
        assert ld.next_step == 3
        ld.load_state_dict(other, allow_changes="all")
        with pytest.raises(ValueError, match="unknown allow_changes entry 'sed'"):
            ld.load_state_dict(other, allow_changes=["sed"])
    with _loader(store, 1, 0, 4) as ld, pytest.raises(DataStateMismatch, match="format"):
        ld.load_state_dict({"format": 99})


def test_schedule_change_opt_in_continues_from_consumed_position(store):
    with _loader(store, 1, 0, 4, schedule="12") as ld:
        _take_steps(ld, 3)
        state = ld.state_dict()  # next_step 4, 36 positions consumed
    with _loader(store, 2, 0, 4, schedule="1:8,3:16") as ld:
        with pytest.raises(DataStateMismatch, match="schedule"):
            ld.load_state_dict(state)
        ld.load_state_dict(state, allow_changes=["schedule"])
        assert ld.plan.step_positions(4) == (36, 16)
        assert ld.plan.step_positions(5) == (52, 16)
        _take_steps(ld, 2)
        saved = ld.state_dict()
        assert saved["consumed_positions"] == 68 and saved["next_step"] == 6
    # resuming the changed run with its own schedule needs no opt-in
    with _loader(store, 4, 3, 2, schedule="1:8,3:16") as ld:
        ld.load_state_dict(saved)
        assert ld.plan.step_positions(6) == (68, 16)


def test_bad_layouts_are_refused(store):
    with pytest.raises(ValueError, match="DP degrees that work"):
        _loader(store, 5, 0, 1, schedule="12")
    with pytest.raises(ValueError, match="do not fit the store"):
        _loader(store, 1, 0, 1, num_samples=10**9)


@pytest.mark.parametrize("workers, prefetch", [(0, 0), (1, 0), (0, 1), (3, 0), (2, 5)])
def test_any_workers_and_prefetch_give_the_same_stream(store, workers, prefetch):
    ref = _reference(store, 6)
    with _loader(store, 2, 1, 3, workers=workers, prefetch=prefetch) as ld:
        got = _take_steps(ld, 6)
    for s in range(6):
        assert np.array_equal(got[s], ref[s][len(ref[s]) // 2 :])  # rank 1 of 2


# ---------------------------------------------------------------- content checks


def _microbatches_from(plan, step, b, count):
    """(step, ids) of the next ``count`` micro-batches of one rank of DP 1, from ``step``."""
    out = []
    while len(out) < count:
        ids = plan.rank_ids(step, 0, 1)
        out += [(step, ids[k : k + b]) for k in range(0, len(ids), b)]
        step += 1
    return out[:count]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_onto_edited_store_fails_at_the_first_batch_reading_it(
    tmp_path, store_path, store, workers
):
    chunk = 64
    path = copy_store(store_path, tmp_path / "s", chunk_tokens=chunk)
    with _loader(TokenStore.open(path), 1, 0, 4) as ld:
        _take_steps(ld, 3)
        state = ld.state_dict()  # a checkpoint after step 3
        upcoming = _microbatches_from(ld.plan, 4, 4, 40)

    def covered(ids):  # chunks the samples ``ids`` read
        return {c for i in ids for c in range(i * SEQ // chunk, (i * SEQ + SEQ) // chunk + 1)}

    first_read: dict[int, int] = {}  # chunk -> first upcoming micro-batch reading it
    for k, (_, ids) in enumerate(upcoming):
        for c in covered(ids):
            first_read.setdefault(c, k)
    bad, k_bad = max(first_read.items(), key=lambda kv: kv[1])  # read as late as possible
    assert k_bad >= 5
    edit_token(path, bad * chunk + 3)  # same size: the fingerprint cannot see it
    edited = TokenStore.open(path)
    with _loader(edited, 1, 0, 4, workers=workers, prefetch=3) as ld:
        ld.load_state_dict(state)  # accepted: same manifest, nothing read yet
        for _, ids in upcoming[:k_bad]:  # every batch before the bad chunk is delivered
            x, _ = next(ld)
            assert np.array_equal(x["input"].numpy(), store.windows(ids, SEQ)[:, :-1])
        with pytest.raises(StoreError, match=f"chunk {bad} of tokens.bin") as e:
            next(ld)
        assert str(path) in str(e.value)
        assert ld.next_step == upcoming[k_bad][0]  # that step was never completed
        with pytest.raises(StoreError, match=f"chunk {bad} "):  # and is not skipped
            for _ in range(k_bad + 1):
                next(ld)


def test_vocab_size_refused_at_open_from_max_token_id(store):
    top = store.max_token_id
    with pytest.raises(StoreError) as e:
        _loader(store, 1, 0, 4, vocab_size=top)
    msg = str(e.value)
    assert f"holds token ids up to {top}" in msg and f"embeds only {top} ids" in msg
    assert f"vocab_size is at least {top + 1}" in msg
    with _loader(store, 1, 0, 4, vocab_size=top + 1) as ld:
        _take_steps(ld, 2)


def test_store_without_checksums_has_each_batch_checked_against_vocab(tmp_path, store_path, store):
    path = copy_store(store_path, tmp_path / "old")
    make_v1(path)
    where = 500
    edit_token(path, where, value=5000)  # beyond the model's 5000 embeddings
    with pytest.warns(UncheckedStoreWarning):
        old = TokenStore.open(path)
    n = old.num_samples(SEQ)
    with _loader(old, 1, 0, 4, schedule="12", vocab_size=5000) as ld:
        with pytest.raises(StoreError) as e:
            for _ in range(n // 4 + 1):  # one epoch reads token 500
                next(ld)
    msg = str(e.value)
    assert f"holds token id 5000 at token {where}" in msg
    assert "outside the model's vocabulary of 5000 ids" in msg and "--check" in msg


# ---------------------------------------------------------------- prefetch bundles


@settings(max_examples=15, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    multiples=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    starts=st.lists(st.integers(2, 9), max_size=2, unique=True),
    seed=st.integers(0, 10**6),
    num_samples=st.integers(5, 40),  # an epoch every few steps: bundles span epochs
    mode=st.sampled_from([(0, 0), (0, 2), (1, 1), (2, 3)]),  # (num_workers, prefetch)
)
def test_bundle_path_equals_per_step_path(
    store, layout, multiples, starts, seed, num_samples, mode
):
    d, b = layout
    sizes = [d * b * 12 // math.gcd(12, d * b) * m for m in multiples]  # each a multiple of 12
    entries = list(zip([1, *sorted(starts)], sizes, strict=False))
    schedule = ",".join(f"{s}:{g}" for s, g in entries)
    rank = d - 1
    with _loader(
        store, d, rank, b, workers=mode[0], prefetch=mode[1], seed=seed, schedule=schedule,
        num_samples=num_samples,
    ) as ld:  # fmt: skip
        assert ld.max_bundle == (1 if mode == (0, 0) else MAX_BUNDLE)  # tiny micro-batches
        got = _take_steps(ld, 12)
        plan = ld.plan
    for s, rows in enumerate(got, start=1):
        ids = plan.rank_ids(s, rank, d)
        assert np.array_equal(plan.rank_stream_ids(s, 0, len(ids), rank, d), ids)
        assert np.array_equal(rows, store.windows(ids, SEQ)), f"step {s}"


@pytest.mark.parametrize("workers, prefetch", [(0, 0), (0, 2), (2, 3)])
def test_retry_after_a_mid_step_failure_resumes_at_the_failed_micro_batch(
    tmp_path, store_path, store, workers, prefetch
):
    chunk = 64
    path = copy_store(store_path, tmp_path / "s", chunk_tokens=chunk)
    b, per_step = 2, 6  # global batch 12 on DP 1: 6 micro-batches per step
    with _loader(store, 1, 0, b, schedule="12") as ld:
        upcoming = _microbatches_from(ld.plan, 1, b, 60)

    def covered(ids):  # chunks the samples ``ids`` read
        return {c for i in ids for c in range(i * SEQ // chunk, (i * SEQ + SEQ) // chunk + 1)}

    seen: set[int] = set()
    for k, (_, ids) in enumerate(upcoming):  # a chunk first read mid-step, after step 1
        new = covered(ids) - seen
        if new and k > per_step and k % per_step >= 2:
            bad, k_bad = min(new), k
            break
        seen |= covered(ids)
    token = bad * chunk + 5
    original = int(np.asarray(store.tokens)[token])
    edit_token(path, token)  # same size: only the content checks can see it
    with _loader(TokenStore.open(path), 1, 0, b, workers, prefetch, schedule="12") as ld:
        for _, ids in upcoming[:k_bad]:
            x, _ = next(ld)
            assert np.array_equal(x["input"].numpy(), store.windows(ids, SEQ)[:, :-1])
        with pytest.raises(StoreError, match=f"chunk {bad} of tokens.bin") as failed:
            next(ld)
        step = upcoming[k_bad][0]
        # named by the step whose data could not be read (issue 28, item 11)
        assert isinstance(failed.value, DataUnreadable)
        assert (failed.value.step, failed.value.what) == (step, f"the data of step {step}")
        assert failed.value.kind == "StoreError"
        assert ld.next_step == step  # the step is not complete
        edit_token(path, token, value=original)  # the fault is gone (say, a bad read)
        for _, ids in upcoming[k_bad:]:  # the retry starts at the failed micro-batch
            x, y = next(ld)
            assert np.array_equal(x["input"].numpy(), store.windows(ids, SEQ)[:, :-1])
            assert np.array_equal(y.numpy(), store.windows(ids, SEQ)[:, 1:])
        assert ld.next_step == upcoming[-1][0] + 1


def test_an_internal_error_class_is_shown_by_its_public_name():
    """An outage's internal ``_Unanswered`` reads as StoreError in every message."""
    from torchtitan_zephon.store.object_faults import MissingObject, _Unanswered

    assert error_kind(_Unanswered("reading s3://b/x took longer")) == "StoreError"
    assert error_kind(MissingObject("gone")) == "MissingObject"
    failed = DataUnreadable(_Unanswered("reading s3://b/x took longer"), 9, "the data of step 9")
    assert (failed.kind, str(failed), failed.step) == (
        "StoreError",
        "reading s3://b/x took longer",
        9,
    )


def test_a_data_config_built_once_gives_the_same_stream(store):
    """The trainer builds the job's data config once and hands it to the loader; given
    it, the loader uses that object and serves what seed and schedule would build."""
    built = _loader(store, 2, 1, 2)
    config = built.config
    given = ZephonLoader(store, seq_len=SEQ, data_config=config, dp_rank=1, dp_degree=2,
                         local_batch_size=2)  # fmt: skip
    try:
        assert given.config is config
        for _ in range(5):
            (a, la), (b, lb) = next(built), next(given)
            assert a["input"].equal(b["input"]) and la.equal(lb)
    finally:
        built.close()
        given.close()
    with pytest.raises(ValueError, match="data_config or seed and schedule, not both"):
        ZephonLoader(store, seq_len=SEQ, seed=11, data_config=config, dp_rank=0,
                     dp_degree=1, local_batch_size=2)  # fmt: skip
    with pytest.raises(ValueError, match="needs data_config, or seed and schedule"):
        ZephonLoader(store, seq_len=SEQ, seed=11, dp_rank=0, dp_degree=1, local_batch_size=2)
    with pytest.raises(ValueError, match=f"data config is for seq_len {SEQ}, not {SEQ * 2}"):
        ZephonLoader(store, seq_len=SEQ * 2, data_config=config, dp_rank=0, dp_degree=1,
                     local_batch_size=2)  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_torchft_parts_train_each_step_once_and_the_state_moves_only_on_a_commit(store, data):
    """Issue 30: whatever quorum each step gets, the participants' parts (each cut over
    its inner ranks) concatenate to the step a plain run trains; a failed commit draws
    the same part again; after each commit the data state is the plain run's, and a
    plain loader resumed from it continues exactly."""
    steps = 6
    inner = data.draw(st.sampled_from([1, 2]))
    parts = [data.draw(st.integers(1, 3)) for _ in range(steps)]  # the quorum per step
    plain = _loader(store, 1, 0, 12)  # one rank, whole steps (GBS 12/24/12: SCHEDULE)
    loaders = [[_loader(store, inner, r, 2) for r in range(inner)] for _ in range(3)]
    try:
        for step, n in zip(range(1, steps + 1), parts, strict=True):
            drawn = []
            for i in range(n):  # participant i of n
                for loader in loaders[i][:inner]:
                    mbs = loader.part_microbatches(step, i, n)
                    if data.draw(st.booleans()):  # a redo after a failed commit: the same
                        again = loader.part_microbatches(step, i, n)
                        assert all(
                            a[0]["input"].equal(b[0]["input"])
                            for a, b in zip(mbs, again, strict=True)
                        )
                    drawn += [labels for _, labels in mbs]
            want = torch.cat([labels for _, labels in plain.step_microbatches(step)])
            assert torch.cat(drawn).equal(want)
            for group in loaders:
                for loader in group:
                    loader.committed(step)
            for _ in range(plain.grad_accumulation_steps(step)):
                next(plain)
            for group in loaders:
                assert group[0].state_dict() == plain.state_dict()
        resumed = _loader(store, 2, 1, 3)
        resumed.load_state_dict(loaders[0][0].state_dict())
        reference = _loader(store, 2, 1, 3)
        reference.load_state_dict(plain.state_dict())
        for _ in range(8):
            assert next(resumed)[1].equal(next(reference)[1])
        with pytest.raises(
            ValueError, match=f"step 3 committed, but the data state is at step {steps + 1}"
        ):
            loaders[0][0].committed(3)
    finally:
        for loader in [plain, *(x for g in loaders for x in g)]:
            loader.close()
