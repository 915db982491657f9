"""Packing whole documents (issue 31 part a1): the best-fit rule and the packing index,
property-tested: no document of at most seq_len tokens is split, every token is in
exactly one sample, samples never overflow, the index is the same for any number of
workers, and the order over packed samples is the same at any DP degree."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.order.data_config import PACKING_FIELD, DataConfig, data_extra
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.packing import (
    OPEN_SAMPLES,
    best_fit,
    pack,
    packing_field,
    padding_warning,
    pieces_of,
)
from torchtitan_zephon.order.stream import DataPlan

lengths_st = st.lists(st.integers(1, 300), min_size=0, max_size=200)


def covered(packed, lengths: list[int]) -> None:
    """Every token of every document in exactly one piece; no sample over seq_len."""
    seen = [np.zeros(n, dtype=np.int64) for n in lengths]
    for i in range(packed.num_samples):
        rows = packed.sample(i)
        assert rows.shape[0] >= 1 and int(rows[:, 2].sum()) <= packed.seq_len
        for doc, start, length in rows.tolist():
            assert length >= 1
            seen[doc][start : start + length] += 1
    assert all((s == 1).all() for s in seen)


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.integers(1, 128), st.integers(1, 70))
def test_every_token_once_no_short_document_split_no_overflow(lengths, seq_len, chunk):
    packed = pack(np.array(lengths, dtype=np.int64), seq_len, chunk_documents=chunk)
    covered(packed, lengths)
    assert packed.tokens() == sum(lengths)
    pieces_per_doc = np.bincount(packed.pieces[:, 0], minlength=len(lengths)) if lengths else []
    for doc, n in enumerate(lengths):
        want = -(-n // seq_len)  # ceil: one piece when it fits seq_len
        assert pieces_per_doc[doc] == want
    whole = packed.pieces[packed.pieces[:, 2] < seq_len] if lengths else packed.pieces
    for doc, start, length in whole.tolist():  # a piece shorter than seq_len: a last piece
        assert start + length == lengths[doc] and start % seq_len == 0
    assert packed.split_documents() == sum(n > seq_len for n in lengths)


def reference_best_fit(lengths: list[int], seq_len: int, open_samples: int) -> list[list[int]]:
    """The rule as the module docstring states it, by linear scans: the slow twin."""
    open_: list[dict] = []  # {"n": opening number, "room": r, "items": [...]}
    out, opened = [], 0
    for i, n in enumerate(lengths):
        if n == seq_len:
            out.append([i])
            continue
        fits = [o for o in open_ if o["room"] >= n]
        if fits:
            best = min(fits, key=lambda o: (o["room"], o["n"]))
            best["items"].append(i)
            best["room"] -= n
            if best["room"] == 0:
                open_.remove(best)
                out.append(best["items"])
            continue
        if len(open_) == open_samples:
            fullest = min(open_, key=lambda o: (o["room"], o["n"]))
            open_.remove(fullest)
            out.append(fullest["items"])
        open_.append({"n": opened, "room": seq_len - n, "items": [i]})
        opened += 1
    out.extend(o["items"] for o in sorted(open_, key=lambda o: o["n"]))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=150), st.integers(1, 6))
def test_best_fit_is_the_rule_it_states(lengths, open_samples):
    """Each piece goes into the open sample with the least room that holds it, a new
    sample opens only when none does, at most ``open_samples`` are open: the fast rule
    equals its slow twin."""
    assert best_fit(lengths, 64, open_samples) == reference_best_fit(lengths, 64, open_samples)


def test_documents_just_over_half_a_sample_pad_about_half_and_warn():
    """The worst case the rule has: no two pieces fit together; the start warns."""
    packed = pack(np.full(500, 33), 64)
    assert packed.num_samples == 500 and packed.padding_fraction() == pytest.approx(31 / 64)
    assert padding_warning(packed, "S") == (
        "zephon.packing = best_fit pads 48.4% of the samples of S at seq_len 64 (more than "
        "10%): its documents pack poorly into seq_len tokens (for example, most just over "
        "seq_len / 2); consider another seq_len."
    )
    assert padding_warning(pack(np.full(500, 32), 64), "S") is None  # two to a sample


def test_long_documents_are_cut_into_seq_len_pieces_and_their_rest():
    doc, start, length = pieces_of(np.array([5, 130, 64]), 64)
    assert doc.tolist() == [0, 1, 1, 1, 2]
    assert start.tolist() == [0, 0, 64, 128, 0] and length.tolist() == [5, 64, 64, 2, 64]


def test_the_index_is_the_same_for_any_number_of_workers():
    rng = np.random.default_rng(0)
    lengths = (rng.pareto(1.2, 3000) * 40 + 1).astype(np.int64)
    one = pack(lengths, 256, chunk_documents=500)
    with ProcessPoolExecutor(max_workers=2) as pool:
        two = pack(lengths, 256, chunk_documents=500, map_fn=pool.map)
    assert np.array_equal(one.starts, two.starts) and np.array_equal(one.pieces, two.pieces)
    assert one.padding_fraction() < 0.01  # a heavy-tailed corpus packs tightly
    assert OPEN_SAMPLES == 64


@settings(max_examples=40, deadline=None)
@given(st.integers(12, 400), st.integers(0, 2**31), st.integers(1, 30))
def test_the_order_of_packed_samples_is_the_same_at_any_dp_degree(samples, seed, step):
    """The plan over packed samples is the store order's: DP 1, 2, 3, 4, 6 slices of a
    global batch of 12 concatenate to the step's ids."""
    plan = DataPlan(samples, seed, BatchSchedule.parse("12"))
    whole = plan.global_ids(step).tolist()
    for degree in (1, 2, 3, 4, 6):
        parts = [plan.rank_ids(step, r, degree).tolist() for r in range(degree)]
        assert [i for p in parts for i in p] == whole


def config(packing: str = "none") -> DataConfig:
    return DataConfig.make(
        seq_len=64, seed=0, schedule=BatchSchedule.parse("8"), sample_offset=0,
        num_samples=100, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
        extra=data_extra(packing=packing),
    )  # fmt: skip


def test_packing_enters_the_data_config_only_when_it_packs():
    plain, packed = config(), config("best_fit")
    assert plain == DataConfig.make(
        seq_len=64, seed=0, schedule=BatchSchedule.parse("8"), sample_offset=0,
        num_samples=100, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip  # none: the config (and every fingerprint) of before packing
    assert PACKING_FIELD not in plain.to_dict() and plain.packing == "none"
    assert packed.packing == "best_fit"
    assert packed.to_dict()[PACKING_FIELD] == packing_field("best_fit")
    assert plain.differing(packed) == ["packing"]
    assert plain.order_key != packed.order_key and plain.step_key(1) != packed.step_key(1)
    assert DataConfig.from_dict(packed.to_dict()) == packed


def test_an_unknown_packing_method_names_the_setting():
    with pytest.raises(
        ValueError, match=r"zephon.packing = 'first_fit': expected one of none, best_fit"
    ):
        data_extra(packing="first_fit")
