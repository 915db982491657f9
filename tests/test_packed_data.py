"""A store read as packed samples (issue 31 part a2): each row is its pieces then EOS
padding, every label trained is the next token of the same document, a document's last
token and the padding train nothing, and the loader's micro-batches are the same at any
DP degree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.documents import document_positions
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.job.packing import open_packing
from torchtitan_zephon.job.source import IGNORE_INDEX, unlabel
from torchtitan_zephon.order.data_config import PACKING_FIELD
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.stream import DataPlan

SEQ = 16


@pytest.fixture(scope="module")
def packed_data(store, tmp_path_factory):
    import os

    old = os.environ.get("ZEPHON_CACHE")
    os.environ["ZEPHON_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        packed, _ = open_packing(store, SEQ)
    finally:
        if old is None:
            os.environ.pop("ZEPHON_CACHE")
        else:
            os.environ["ZEPHON_CACHE"] = old
    return JobData.of_store(store, SEQ, packed=packed)


def doc_tokens(store, doc: int) -> np.ndarray:
    offsets = np.append(np.asarray(store.doc_offsets), store.num_tokens)
    return np.asarray(store.tokens[offsets[doc] : offsets[doc + 1]])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rows_are_their_pieces_and_every_label_is_the_next_token_of_its_document(
    packed_data, store, data
):
    n = packed_data.sources[0].packed.num_samples
    keys = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6)))
    rows = packed_data.windows(keys, SEQ)
    ignored = packed_data.ignored(keys, SEQ)
    assert rows.shape == (keys.size, SEQ + 1) and ignored.shape == (keys.size, SEQ)
    for r, key in enumerate(keys.tolist()):
        col, want_ignored = 0, np.ones(SEQ, dtype=bool)
        for doc, start, length in packed_data.sources[0].packed.sample(key).tolist():
            tokens = doc_tokens(store, doc)
            assert rows[r, col : col + length].tolist() == tokens[start : start + length].tolist()
            for j in range(length):  # the label of input col + j
                nxt = start + j + 1
                if nxt < tokens.size:  # the same document goes on: trained
                    want_ignored[col + j] = False
                    assert rows[r, col + j + 1] == tokens[nxt]
            col += length
        assert (rows[r, col:] == store.eos_id).all() or col == SEQ  # padding
        assert ignored[r].tolist() == want_ignored.tolist()
    assert packed_data.labelled_tokens(keys) == int((~ignored).sum())
    fast_rows, fast_ignored = packed_data.rows(keys, SEQ)  # the loader's path
    assert np.array_equal(fast_rows, rows) and np.array_equal(dense(fast_ignored, keys), ignored)
    # from the index alone (a store in object storage): the same untrained inputs
    assert np.array_equal(dense(packed_data.sources[0].unlabelled(keys, SEQ), keys), ignored)


def dense(ignored: tuple | None, keys: np.ndarray, seq_len: int = SEQ) -> np.ndarray:
    """``rows``' untrained inputs as one mask over every row (None: every label
    trained), through ``unlabel`` (what the loader and the validator call)."""
    labels = np.zeros((np.size(keys), seq_len), dtype=np.int64)
    unlabel(labels, ignored)
    return labels == IGNORE_INDEX


def test_positions_restart_at_every_document_and_padding_stands_alone(packed_data):
    keys = np.arange(min(64, packed_data.sources[0].packed.num_samples))
    inputs = torch.from_numpy(packed_data.windows(keys, SEQ)[:, :-1].astype(np.int64))
    positions = document_positions(inputs, packed_data.stores[0].eos_id)
    for r, key in enumerate(keys.tolist()):
        col = 0
        for _doc, _start, length in packed_data.sources[0].packed.sample(key).tolist():
            assert positions[r, col : col + length].tolist() == list(range(length))
            col += length
        assert (positions[r, col:] == 0).all()  # each padding token: a document of one


def _steps(
    data, degree: int, local: int, steps: int = 3
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for rank in range(degree):
        loader = ZephonLoader(
            data, seq_len=SEQ, seed=7, schedule=BatchSchedule([(1, 12)]), dp_rank=rank,
            dp_degree=degree, local_batch_size=local,
        )  # fmt: skip
        with loader:
            out.append([loader.step_microbatches(s) for s in range(1, steps + 1)])
    merged = []
    for s in range(steps):
        batches = [mb for rank in out for mb in rank[s]]
        merged.append(
            (torch.cat([b[0]["input"] for b in batches]), torch.cat([b[1] for b in batches]))
        )
    return merged


def test_the_loader_delivers_the_same_packed_batches_at_any_dp_degree(packed_data):
    one = _steps(packed_data, 1, 12)
    for degree, local in ((2, 3), (3, 4), (4, 1), (6, 2)):
        for (a_in, a_lab), (b_in, b_lab) in zip(
            one, _steps(packed_data, degree, local), strict=True
        ):
            assert torch.equal(a_in, b_in) and torch.equal(a_lab, b_lab)
    labels = torch.cat([lab for _, lab in _steps(packed_data, 1, 12, steps=30)])
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()
    loader = ZephonLoader(packed_data, seq_len=SEQ, seed=7, schedule=BatchSchedule([(1, 12)]),
                          dp_rank=0, dp_degree=1, local_batch_size=12)  # fmt: skip
    with loader:
        assert loader.config.packing == "best_fit"
        assert PACKING_FIELD in loader.config.to_dict()
        assert loader.config.num_samples == packed_data.sources[0].packed.num_samples


def test_a_torchft_step_weighs_by_the_labels_of_all_of_its_global_batch(packed_data):
    """Under torchft every group divides its loss sum by the labels of all of B(s): with
    packed samples, what the packing index counts (no token read) equals the labels the
    step's micro-batches train."""
    from torchtitan_zephon.titan.ft.step import step_label_tokens

    loader = ZephonLoader(packed_data, seq_len=SEQ, seed=7, schedule=BatchSchedule([(1, 12)]),
                          dp_rank=0, dp_degree=1, local_batch_size=4)  # fmt: skip
    with loader:
        for step in range(1, 31):
            labels = torch.cat([lab for _, lab in loader.step_microbatches(step)])
            assert step_label_tokens(loader, step) == int((labels != IGNORE_INDEX).sum())


def test_show_and_where_of_a_packing_run_name_packed_samples(
    packed_data, store_path, tmp_path, capsys
):
    """A run whose log holds a packing data config (no training needed: show and where
    read the log's data config): show lists each packed sample's documents and padding,
    where finds every packed sample of a document at the step that plans it."""
    import json

    from torchtitan_zephon.cli.main import main

    config = packed_data.data_config(seed=3, schedule=BatchSchedule([(1, 4)]))
    run = tmp_path / "run"
    (run / "zephon").mkdir(parents=True)
    event = {"event": "start", "from_step": 0, "chain": "x", "data_config": config.to_dict()}
    (run / "zephon" / "sequence_log.jsonl").write_text(json.dumps(event) + "\n")
    common = ["--store", str(store_path), "--json"]
    assert main(["show", str(run), "--step", "5", *common]) == 0
    step = json.loads(capsys.readouterr().out)
    plan = DataPlan(packed_data.sources[0].packed.num_samples, 3, BatchSchedule([(1, 4)]))
    assert [s["sample"] for s in step["samples"]] == plan.global_ids(5).tolist()
    for s in step["samples"]:
        assert s["documents"] == packed_data.sources[0].documents(s["sample"])
        assert sum(d["stop"] - d["start"] for d in s["documents"]) + s["padding"] == SEQ
    doc = step["samples"][1]["documents"][0]["document"]
    holding = packed_data.sources[0].samples_of_document(doc).tolist()
    assert step["samples"][1]["sample"] in holding
    assert main(["where", str(run), "--doc", str(doc), "--epochs", "0:0", *common]) == 0
    hits = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert sorted(h["sample"] for h in hits) == holding  # each packed sample holding it, once
    assert {"step": 5, "index": 1, "sample": step["samples"][1]["sample"]}.items() <= next(
        h for h in hits if h["step"] == 5
    ).items()
    for h in hits:  # each hit is where the plan puts that sample
        assert plan.global_ids(h["step"])[h["index"]] == h["sample"]


def test_the_accounting_counts_the_documents_and_padding_of_a_packed_step(packed_data, caplog):
    import logging

    from torchtitan_zephon.titan.components.accounting import StepAccounting

    plan = DataPlan(packed_data.sources[0].packed.num_samples, 3, BatchSchedule([(1, 4)]))
    written: dict[int, dict[str, float]] = {}
    acc = StepAccounting(plan=lambda: plan, data=packed_data, seq_len=SEQ,
                         sink=lambda m, s: written.__setitem__(s, m),
                         should_log=lambda s: True, writes_log=True)  # fmt: skip
    caplog.set_level(logging.INFO)
    for step in range(1, 60):
        samples = [
            packed_data.sources[0].packed.sample(key).tolist() for key in plan.global_ids(step)
        ]
        want = sum(1 for sample in samples for _doc, start, _n in sample if start == 0)
        padding = sum(SEQ - sum(n for _doc, _start, n in sample) for sample in samples)
        assert acc._counts(plan, step)[0].tolist() == [want]
        acc.record(step)
        acc.ready(step)
        assert written[step]["zephon/source/store/documents_started"] == want
        assert written[step]["zephon/source/store/padding"] == padding
        assert f"{want:,} new documents, {padding:,} padding tokens" in caplog.text
    acc.close()
    assert any(m["zephon/source/store/padding"] for m in written.values())
