"""The TorchTitan-side dataloader: batch layout errors, the checkpoint record, tokens digests."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from torchtitan_zephon.job.loader import DataStateMismatch
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.store.format import StoreError, UncheckedStoreWarning
from torchtitan_zephon.titan.components.dataloader import ZephonDataLoader
from torchtitan_zephon.titan.settings.job_view import JobView, batch_schedule, job_view
from torchtitan_zephon.titan.start.job_data import (
    ZephonJob,
    open_job_data,
)
from torchtitan_zephon.tracker import sample_digests


def job(
    tmp: Path,
    *,
    global_batch_size: int = 8,
    hf_assets_path: str = "./torchtitan_zephon/assets/tokenizer",
    **zephon: Any,
) -> JobView:
    """The view of the tiny registry job (seq_len 32, local batch 2), run folder ``tmp``."""
    from torchtitan_zephon.configs.config_registry import llama3_tiny

    config = llama3_tiny()
    config.dump_folder = str(tmp)
    config.hf_assets_path = hf_assets_path
    config.training.global_batch_size = global_batch_size
    config.training.local_batch_size = 2
    config.training.seq_len = 32
    z = dict(store="", seed=0, batch_schedule="", heldout_samples=16, audit="tokens",
             allow_changes=[], ignore_log_mismatch=False, prefetch=2)  # fmt: skip
    z.update(zephon)
    config.zephon = dataclasses.replace(config.zephon, **z)
    return job_view(config)


def build_zephon_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer: Any, view: JobView
) -> ZephonDataLoader:
    """The dataloader as Zephon's trainer builds it: the job's data opened once (as the
    preflight does), handed over, then TorchTitan's build keywords."""
    data, _ = open_job_data(view, tokenizer)
    return ZephonDataLoader.Config().build(
        job=ZephonJob.of(view, data),
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=tokenizer,
        seq_len=view.seq_len,
        local_batch_size=view.local_batch_size,
    )


def test_global_batch_size_must_be_explicit(tmp_path):
    cfg = job(tmp_path, global_batch_size=-1)
    with pytest.raises(ValueError, match="training.global_batch_size is not set"):
        batch_schedule(cfg)


def test_dp_degree_that_cannot_split_the_batch_lists_working_degrees(tmp_path):
    cfg = job(tmp_path)
    with pytest.raises(ValueError) as e:
        build_zephon_dataloader(3, 0, None, cfg)
    msg = str(e.value)
    assert "3" in msg and "1, 2, 4" in msg, msg


def test_schedule_entries_are_all_checked():
    from torchtitan_zephon.order.layout import BatchSchedule

    BatchSchedule.parse("1:8,10:16").check_layout(4, 2)
    with pytest.raises(ValueError):
        BatchSchedule.parse("1:8,10:12").check_layout(4, 2)


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path):
    small_tokenizer = SimpleNamespace(get_vocab_size=lambda: 1000)
    with pytest.raises(ValueError, match="vocabulary of 2048 tokens .* has 1000"):
        build_zephon_dataloader(1, 0, small_tokenizer, job(tmp_path))


def deliver(loader, microbatches: int) -> list[np.ndarray]:
    it = iter(loader)
    out = []
    for _ in range(microbatches):
        inputs, labels = next(it)
        out.append(np.concatenate([inputs["input"].numpy(), labels[:, -1:].numpy()], axis=1))
    return out


def test_record_is_identical_on_every_rank_and_small(tmp_path):
    records = set()
    for degree in (1, 2, 4):
        for rank in range(degree):
            dl = build_zephon_dataloader(degree, rank, None, job(tmp_path))
            deliver(dl, 3 * 8 // (degree * 2))  # three whole steps
            state = dl.state_dict()
            assert list(state) == ["zephon"] and len(state["zephon"]) < 4096
            records.add(state["zephon"])
            dl.close()
    assert len(records) == 1
    record = json.loads(records.pop())
    assert record["next_step"] == 4 and record["consumed_positions"] == 24


def test_resume_under_another_degree_continues_the_tokens(tmp_path):
    cfg = job(tmp_path)
    whole = build_zephon_dataloader(1, 0, None, cfg)
    stream = deliver(whole, 4 * 4)  # steps 1..4 on one rank, 4 micro-batches each
    first_half = build_zephon_dataloader(1, 0, None, cfg)
    deliver(first_half, 2 * 4)
    state = first_half.state_dict()
    got = []
    for rank in range(2):
        dl = build_zephon_dataloader(2, rank, None, cfg)
        dl.tracker.writer = False  # no log file in this unit test
        dl.load_state_dict(state)
        got.append(deliver(dl, 2 * 2))  # steps 3..4: 2 micro-batches per rank per step
    for step in range(2):
        expect = np.concatenate(stream[(2 + step) * 4 : (3 + step) * 4])
        merged = np.concatenate(got[0][step * 2 : step * 2 + 2] + got[1][step * 2 : step * 2 + 2])
        assert np.array_equal(expect, merged)


def test_tokens_digests_are_kept_per_step_in_delivery_order(tmp_path):
    dl = build_zephon_dataloader(1, 0, None, job(tmp_path))
    mbs = deliver(dl, 8)  # steps 1 and 2
    assert dl.step_token_digests(1) == sample_digests(np.concatenate(mbs[:4]))
    assert dl.step_token_digests(2) == sample_digests(np.concatenate(mbs[4:]))
    assert dl.step_token_digests(1) == b""  # handed over once


def test_refusal_names_the_trainer_flag(tmp_path):
    a = build_zephon_dataloader(1, 0, None, job(tmp_path))
    deliver(a, 4)
    b = build_zephon_dataloader(1, 0, None, job(tmp_path, seed=3))
    with pytest.raises(DataStateMismatch, match=r"(?s)seed: 0 -> 3.*--zephon.allow_changes"):
        b.load_state_dict(a.state_dict())


def test_resume_from_a_checkpoint_written_with_audit_off(tmp_path):
    """No chain head for that step: the log's chain restarts, marked in the resume event."""
    off = build_zephon_dataloader(1, 0, None, job(tmp_path, audit="off"))
    deliver(off, 3 * 4)
    state = off.state_dict()
    on = build_zephon_dataloader(1, 0, None, job(tmp_path, audit="ids"))
    on.load_state_dict(state)
    assert on.resumed_from == 3 and on.tracker.step == 3
    (event,) = [json.loads(line) for line in on.tracker.path.read_text().splitlines()]
    assert event["event"] == "resume" and event["from_step"] == 3 and event["chain_restart"]


def test_store_vocabulary_larger_than_the_model_is_refused(tmp_path):
    cfg = job(tmp_path)
    assert cfg.model == "llama3 flavor tiny" and cfg.vocab_size == 2048
    build_zephon_dataloader(1, 0, None, cfg).close()  # vocab 2048 == store's 2048
    # a model of 1000 embeddings (0.3: the model spec's, as the trainer's view reads it)
    small = dataclasses.replace(cfg, model_flavor="test_vocab_1000", vocab_size=1000)
    with pytest.raises(
        ValueError,
        match="vocabulary of 2048 tokens but model llama3 flavor test_vocab_1000 embeds only 1000",
    ):
        build_zephon_dataloader(1, 0, None, small)


def test_resume_onto_edited_store_content_fails_before_the_step_reading_it(tmp_path):
    """Tokens edited in place keep the fingerprint, so the resume is accepted; the first
    micro-batch that reads the edited chunk is refused, naming it."""
    from tests.conftest import copy_store, edit_token
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    path = copy_store(builtin_store_path(), tmp_path / "store")
    cfg = job(tmp_path / "run", store=str(path))
    first = build_zephon_dataloader(1, 0, None, cfg)
    deliver(first, 2 * 4)  # steps 1..2
    state = first.state_dict()
    sample = int(first.plan.global_ids(3)[0])  # read by step 3's first micro-batch
    first.close()
    token = sample * 32 + 5
    edit_token(path, token)
    again = build_zephon_dataloader(1, 0, None, cfg)
    again.tracker.writer = False
    again.load_state_dict(state)
    with pytest.raises(StoreError, match=f"chunk {token // 65536} of tokens.bin"):
        deliver(again, 1)
    again.close()


def test_out_of_vocabulary_id_in_a_store_without_checksums_is_a_clear_error(tmp_path):
    from tests.conftest import copy_store, edit_token, make_v1
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    path = copy_store(builtin_store_path(), tmp_path / "store")
    make_v1(path)
    cfg = job(tmp_path / "run", store=str(path))  # tiny: 2048 embeddings
    with pytest.warns(UncheckedStoreWarning):
        dl = build_zephon_dataloader(1, 0, None, cfg)
    sample = int(dl.plan.global_ids(1)[1])  # in step 1's first micro-batch
    edit_token(path, sample * 32 + 7, value=3000)  # the map sees the edit
    with pytest.raises(StoreError, match="holds token id 3000 .* vocabulary of 2048 ids"):
        deliver(dl, 1)
    dl.close()


def _pydoc_jsonl(path: Path, topics: int = 60) -> Path:
    import pydoc_data.topics

    with open(path, "w") as f:
        for k in sorted(pydoc_data.topics.topics)[:topics]:
            f.write(json.dumps({"body": pydoc_data.topics.topics[k]}) + "\n")
    return path


def test_raw_store_value_has_the_data_config_of_its_prepared_store(tmp_path, monkeypatch):
    """zephon.store = a raw JSONL file gives the data config of `zephon prepare` of it:
    the store fingerprint, never the path, identifies the data."""
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
    from torchtitan_zephon.ingest.prepare import prepare_store

    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    data = _pydoc_jsonl(tmp_path / "docs.jsonl")
    prepared = tmp_path / "store"
    prepare_store([str(data)], str(TOKENIZER_DIR), str(prepared), text_field="body")
    _, from_raw = open_job_data(job(tmp_path, store=str(data), text_field="body"))
    _, from_store = open_job_data(job(tmp_path, store=str(prepared)))
    assert from_raw == from_store and from_raw.fingerprint == from_store.fingerprint
    # another text field is another store
    with pytest.raises(StoreError, match="unknown text field 'text'.*fields present: \\['body'\\]"):
        open_job_data(job(tmp_path, store=str(data)))


def test_raw_store_value_needs_a_tokenizer_json(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    data = _pydoc_jsonl(tmp_path / "docs.jsonl", topics=2)
    config = job(tmp_path, store=str(data), hf_assets_path=str(tmp_path / "assets"))
    with pytest.raises(StoreError, match=r"tokenizer.json in hf_assets_path = '.*/assets'"):
        build_zephon_dataloader(1, 0, None, config)
    assert not (tmp_path / "cache").exists()


def test_a_rule_1_mixture_checkpoint_resumes_bound_to_rule_1(tmp_path):
    """A mixture checkpoint of the previous rule (format 1) whose schedule the current
    rule corrects nowhere resumes with the same batches; the next checkpoint, the
    resume event and the steps' ids digest keys keep binding rule 1."""
    cfg = job(tmp_path, mixture="train_configs/mixtures/docs_stdlib.toml")
    a = build_zephon_dataloader(1, 0, None, cfg)
    a.tracker.writer = False
    deliver(a, 2 * 4)
    saved = DataState.from_json(a.state_dict()["zephon"])
    expected = deliver(a, 2 * 4)
    rule1 = {**saved.config.mixture, "format": "zephon-mixture/1"}
    old = DataConfig.from_dict({**saved.config.to_dict(), "mixture": rule1})
    state = DataState(old, saved.next_step, saved.consumed_positions, saved.position_anchor)
    b = build_zephon_dataloader(1, 0, None, cfg)
    b.load_state_dict({"zephon": state.to_json()})
    assert b.tracker.config == old and b.loader.config == old
    (event,) = [json.loads(line) for line in b.tracker.path.read_text().splitlines()]
    assert event["event"] == "resume" and event["data_config"]["mixture"]["format"] == (
        "zephon-mixture/1"
    )
    assert "the run keeps zephon-mixture/1" in event["notes"][0]
    got = deliver(b, 2 * 4)
    assert all(np.array_equal(x, y) for x, y in zip(got, expected, strict=True))
    assert b.ids_digests.step_key(3) == old.step_key(3)
    assert DataState.from_json(b.state_dict()["zephon"]).config == old


def test_another_trainer_builds_the_dataloader_through_the_public_seam(tmp_path):
    """Issue 29 (c3): without Zephon's trainer, ``ZephonJob.open(job_view(config))`` as
    the build keyword ``job`` gives the dataloader everything it reads; it then serves
    the same batches as the trainer's hand-off, and the config TorchTitan logs or saves
    (``to_dict``) holds no opened data."""
    view = job(tmp_path)
    handoff = ZephonJob.open(view)
    config = ZephonDataLoader.Config()
    assert "job" not in config.to_dict()
    assert json.dumps(config.to_dict())  # plain data only
    built = config.build(job=handoff, dp_world_size=2, dp_rank=1, tokenizer=None, seq_len=32,
                         local_batch_size=2)  # fmt: skip
    reference = build_zephon_dataloader(2, 1, None, job(tmp_path / "ref"))
    try:
        assert built.loader.config is handoff.data_config
        for _ in range(6):  # three steps of two micro-batches
            (a, la), (b, lb) = next(iter(built)), next(iter(reference))
            assert a["input"].equal(b["input"]) and la.equal(lb)
    finally:
        built.close()
        reference.close()


def test_built_without_the_seam_it_refuses_and_names_it(tmp_path):
    with pytest.raises(ValueError) as e:
        ZephonDataLoader.Config().build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=32, local_batch_size=2
        )
    assert "config.build(job=ZephonJob.open(job_view(trainer_config)), ...)" in str(e.value)
    assert "build_context(job)" in str(e.value)
    assert "python -m torchtitan_zephon.train" in str(e.value)
