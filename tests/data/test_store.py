"""TokenStore: windows are the documented slices; opening refuses broken stores."""

import json
import shutil

import numpy as np
import pytest

from torchtitan_zephon.data.store import StoreError, TokenStore


def test_store_basics(store):
    assert store.tokens.dtype == np.uint16
    assert not store.tokens.flags.writeable
    assert store.num_tokens == len(store.tokens)
    assert store.doc_offsets.dtype == np.int64 and store.doc_offsets[0] == 0
    # every document ends with EOS right before the next one starts
    ends = np.append(store.doc_offsets[1:], store.num_tokens) - 1
    assert (store.tokens[ends] == store.eos_id).all()
    assert len(store.fingerprint) == 64 and store.manifest["fingerprint"] == store.fingerprint
    info = store.describe()
    assert info["kind"] == "store" and info["num_documents"] == store.num_documents


@pytest.mark.parametrize("seq_len", [1, 7, 64, 100])
def test_windows_match_slices(store, seq_len):
    n = store.num_samples(seq_len)
    assert n == (store.num_tokens - 1) // seq_len
    ids = np.array([0, n - 1, n // 2, 3 % n, 0])
    w = store.windows(ids, seq_len)
    assert w.shape == (5, seq_len + 1)
    for row, i in zip(w, ids, strict=True):
        assert np.array_equal(row, store.tokens[i * seq_len : i * seq_len + seq_len + 1])
        assert np.array_equal(row, store.window(int(i), seq_len))
    with pytest.raises(IndexError):
        store.windows(np.array([n]), seq_len)
    with pytest.raises(IndexError):
        store.window(-1, seq_len)


def test_document_ids(store):
    docs = store.document_ids(0, store.num_tokens)
    assert docs[0] == 0 and docs[-1] == store.num_documents - 1
    assert np.array_equal(np.searchsorted(docs, np.arange(store.num_documents)), store.doc_offsets)


@pytest.fixture
def broken(tmp_path, store_path):
    dst = tmp_path / "copy"
    shutil.copytree(store_path, dst)
    return dst


def test_open_missing_folder(tmp_path):
    with pytest.raises(StoreError, match="does not exist.*zephon prepare"):
        TokenStore.open(tmp_path / "nope")


def test_open_without_manifest(broken):
    (broken / "manifest.json").unlink()
    with pytest.raises(StoreError, match="no manifest.json"):
        TokenStore.open(broken)


@pytest.mark.parametrize("name", ["tokens.bin", "doc_offsets.bin"])
def test_open_truncated_empty_missing(broken, name):
    f = broken / name
    data = f.read_bytes()
    f.write_bytes(data[:-2])
    with pytest.raises(StoreError, match=f"{name}.*truncated.*Re-run `zephon prepare`"):
        TokenStore.open(broken)
    f.write_bytes(b"")
    with pytest.raises(StoreError, match="is empty"):
        TokenStore.open(broken)
    f.unlink()
    with pytest.raises(StoreError, match=f"{name}' is missing"):
        TokenStore.open(broken)


def test_open_edited_manifest(broken):
    m = json.loads((broken / "manifest.json").read_text())
    m["eos_id"] = 0
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="modified after preparation"):
        TokenStore.open(broken)
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="cannot read"):
        TokenStore.open(broken)
