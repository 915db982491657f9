"""``zephon bench packing``: its baselines (first-fit, fixed windows) and the suite at
tiny sizes (keys and relations, no timing)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.bench.packing import first_fit, windows_split
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.order.packing import pieces_of


def first_fit_twin(lengths: list[int], seq_len: int, open_samples: int) -> int:
    """First fit as its docstring states it, with explicit sample records."""
    _, _, pieces = pieces_of(np.array(lengths), seq_len)
    open_, closed = [], 0
    for n in pieces.tolist():
        fit = next((o for o in open_ if o["room"] >= n), None)  # the oldest that holds it
        if fit is not None:
            fit["room"] -= n
            if fit["room"] == 0:
                open_.remove(fit)
                closed += 1
            continue
        if len(open_) == open_samples:
            open_.pop(0)
            closed += 1
        if n == seq_len:
            closed += 1
        else:
            open_.append({"room": seq_len - n})
    return closed + len(open_)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 200), max_size=120), st.integers(1, 5))
def test_first_fit_is_the_rule_it_states_and_never_beats_the_tokens(lengths, open_samples):
    samples = first_fit(np.array(lengths, dtype=np.int64), 64, open_samples)
    assert samples == first_fit_twin(lengths, 64, open_samples)
    assert samples * 64 >= sum(lengths)


def test_windows_split_counts_documents_spanning_two_windows():
    # documents of 3, 5, 8, 2 tokens at offsets 0, 3, 8, 16; windows of 4 tokens
    assert windows_split(np.array([3, 5, 8, 2]), 4) == 2  # [3, 8) and [8, 16)


def test_bench_packing_quick(capsys):
    assert main(["bench", "packing", "--quick", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for corpus in ("builtin", "heavy_tailed"):
        c = r[corpus]
        assert c["windows"]["padding"] == 0 and c["best_fit"]["padding"] < 0.05
        assert c["best_fit"]["split_documents"] <= c["windows"]["split_documents"]
        assert c["best_fit"]["split_documents"] == c["first_fit"]["split_documents"]
        assert c["best_fit"]["samples"] <= c["first_fit"]["samples"]  # pads no more
    t = r["throughput"]
    assert t["ratio"] == pytest.approx(t["packed_labelled_tokens_per_s"] / t["window_tokens_per_s"])
    assert r["meets"]["throughput_ratio"] == (t["ratio"] >= r["target_ratio"])
    assert r["index"]["bytes_per_million_documents"] > 0 and r["resume_s"]["packed"] > 0
