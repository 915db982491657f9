"""Corpora already tokenized train without a copy (issue 45, how to check): a
Megatron-LM indexed dataset written here from the builtin store's tokens, registered
in place, trains on the samples of the builtin store prepared from text: every step's
logged token digest is the digest of the text store's samples of the ids it trained
(the order differs: it is keyed by the store's fingerprint, and the registered store's
sources are other files)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.ingest.test_token_files import documents_of, write_megatron
from tests.titan.expect import log_records
from tests.titan.launch import train
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR, builtin_store_path
from torchtitan_zephon.ingest.token_files import register_store
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.tracker.records import sample_digests, tokens_digest


@pytest.mark.slow  # a 2-rank job; tests/ingest/test_token_files.py checks the samples
def test_a_registered_megatron_dataset_trains_the_samples_of_the_text(tmp_path: Path, capsys):
    text = TokenStore.open(builtin_store_path())
    tokens, lengths = documents_of(text)
    cut = len(lengths) // 3
    a = write_megatron(tmp_path / "a", tokens[: sum(lengths[:cut])], lengths[:cut], split=True)
    b = write_megatron(tmp_path / "b", tokens[sum(lengths[:cut]) :], lengths[cut:])
    store = register_store([a, b], "megatron", str(TOKENIZER_DIR), str(tmp_path / "store"))
    assert store.fingerprint != text.fingerprint and store.shards == 2

    run = train(tmp_path / "megatron", 2, "--zephon.store", str(store.path)).check().run
    logged = log_records(run)
    for step in range(1, 9):
        capsys.readouterr()
        assert main(["show", str(run), "--step", str(step), "--json", "--max-chars", "0"]) == 0
        ids = [s["sample"] for s in json.loads(capsys.readouterr().out)["samples"]]
        assert len(ids) == 8
        want = tokens_digest(sample_digests(text.windows(np.array(ids), 64)))
        assert logged[step]["tokens_digest"] == want, step
