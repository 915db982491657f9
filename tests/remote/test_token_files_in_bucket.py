"""Corpora already tokenized, read in place in a bucket (issue 45 part b), against a
real S3 API on loopback: a Megatron-LM indexed dataset and OLMo numpy token files,
written here in those formats and uploaded, register into a store in the same bucket
(only metadata written, the objects named by URL), with the fingerprint, samples and
order of the same files registered on local disk; packed samples too, from the index
kept in the bucket; bad input is one line naming the object, nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.ingest.test_token_files import documents_of, write_megatron
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.token_files import register_store
from torchtitan_zephon.job.packed import PackedSource
from torchtitan_zephon.job.packing import open_packing
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore


@pytest.fixture(scope="module")
def text_store(store_path) -> TokenStore:
    return TokenStore.open(store_path)


@pytest.fixture(scope="module")
def uploaded(s3, text_store, tmp_path_factory):
    """The text store's documents as two Megatron datasets and three OLMo numpy files,
    on local disk and in the bucket under ``corpus/``: (local folder, bucket URL)."""
    root = tmp_path_factory.mktemp("token-files")
    tokens, lengths = documents_of(text_store)
    half = sum(lengths[: len(lengths) // 2])
    write_megatron(root / "a", tokens[:half], lengths[: len(lengths) // 2], split=True)
    write_megatron(root / "b", tokens[half:], lengths[len(lengths) // 2 :])
    for k, part in enumerate(np.split(tokens, np.cumsum(lengths)[[10, 50]])):
        part.astype("<u2").tofile(root / f"part-{k}.npy")
    for p in sorted(root.iterdir()):
        s3.put(f"corpus/{p.name}", p.read_bytes())
    return root, f"s3://{s3.bucket}/corpus"


def _same(a: TokenStore, b: TokenStore) -> None:
    assert a.fingerprint == b.fingerprint and a.num_documents == b.num_documents
    for seq_len in (64, 333):
        ids = np.arange(a.num_samples(seq_len))
        assert np.array_equal(a.windows(ids, seq_len), b.windows(ids, seq_len))


def test_megatron_datasets_in_a_bucket_register_in_place(
    s3, uploaded, text_store, tokenizer_dir, tmp_path
):
    root, corpus = uploaded
    local = register_store(
        [str(root / "a.bin"), str(root / "b")], "megatron", str(tokenizer_dir), str(tmp_path / "s")
    )
    before = {o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]}
    url = f"s3://{s3.bucket}/stores/megatron"
    store = register_store([f"{corpus}/a.bin", f"{corpus}/b"], "megatron", str(tokenizer_dir), url)
    after = {o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]}
    assert sorted(after - before) == [
        f"stores/megatron/{n}"
        for n in ("checksums.bin", "doc_offsets.bin", "manifest.json", "shards.json")
    ]  # metadata only: the tokens are read where they are
    shards = json.loads(s3.client.get_object(Bucket=s3.bucket, Key="stores/megatron/shards.json")["Body"].read())  # fmt: skip
    assert shards["files"] == [f"{corpus}/a.bin", f"{corpus}/b.bin"]
    assert store.shards == 2 and not store.mapped
    _same(local, store)
    again = TokenStore.open(url)
    assert again.check().ok and again.fingerprint == local.fingerprint
    again.close()
    store.close()


def test_numpy_files_in_a_bucket_by_pattern_pack_from_the_bucket(
    s3, uploaded, tokenizer_dir, tmp_path, capsys, monkeypatch
):
    """A glob pattern of objects; with --pack-seq-len the packing index is kept in the
    bucket (its spans hashed from the objects) and packed samples read from there equal
    the local registration's."""
    root, corpus = uploaded
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    local = register_store(
        [str(root / f"part-{k}.npy") for k in range(3)], "numpy", str(tokenizer_dir),
        str(tmp_path / "s"),
    )  # fmt: skip
    url = f"s3://{s3.bucket}/stores/numpy"
    code = main(["prepare", f"{corpus}/part-*.npy", "--input-format", "numpy", "--tokenizer",
                 str(tokenizer_dir), "--output", url, "--pack-seq-len", "64"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "in 3 numpy file(s) read in place" in out, out
    assert f"index kept in {url}/packing/best_fit-L64-v1" in out
    store = TokenStore.open(url)
    try:
        _same(local, store)
        packed, where = open_packing(store, 64, cache_dir=str(tmp_path / "node"))
        assert where.startswith(url) and packed.spans is not None
        want, _ = open_packing(local, 64, cache_dir=str(tmp_path / "local"))
        keys = np.arange(want.num_samples)
        assert np.array_equal(
            PackedSource(store, packed).windows(keys, 64),
            PackedSource(local, want).windows(keys, 64),
        )
    finally:
        store.close()


def _refused(capsys, argv, *texts):
    code = main(["prepare", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in texts:
        assert text in err, err


def test_bad_objects_and_places_are_refused_naming_them(
    s3, uploaded, tokenizer_dir, tmp_path, capsys
):
    root, corpus = uploaded
    tok = ["--tokenizer", str(tokenizer_dir)]
    url = f"s3://{s3.bucket}/stores/refused"
    # an index whose counts disagree with its .bin
    idx = (root / "a.idx").read_bytes()
    s3.put("bad/a.idx", idx)
    s3.put("bad/a.bin", (root / "a.bin").read_bytes()[:-2])
    _refused(capsys, [f"s3://{s3.bucket}/bad/a", "--input-format", "megatron", *tok,
                      "--output", url], f"s3://{s3.bucket}/bad/a.idx: its counts disagree")  # fmt: skip
    # a missing object
    _refused(capsys, [f"{corpus}/nothing.npy", "--input-format", "numpy", *tok, "--output", url],
             f"{corpus}/nothing.npy: not found")  # fmt: skip
    # a token id at or above the vocabulary
    bad = np.fromfile(root / "part-0.npy", dtype="<u2")
    bad[3] = 65000
    s3.put("bad/ids.npy", bad.tobytes())
    _refused(capsys, [f"s3://{s3.bucket}/bad/ids.npy", "--input-format", "numpy", *tok,
                      "--output", url], "bad/ids.npy: token id 65000 is outside")  # fmt: skip
    # objects of a bucket into a local store, or into a store in another bucket
    _refused(capsys, [f"{corpus}/part-0.npy", "--input-format", "numpy", *tok, "--output",
                      str(tmp_path / "local")], "lives in that bucket too")  # fmt: skip
    assert not (tmp_path / "local").exists()
    _refused(capsys, [f"{corpus}/part-0.npy", "--input-format", "numpy", *tok, "--output",
                      "s3://another-bucket/s"], "lives in that bucket too")  # fmt: skip
    # local files into a store in a bucket; a mix of both
    _refused(capsys, [str(root / "part-0.npy"), "--input-format", "numpy", *tok, "--output",
                      url], "token files on local disk are registered into a local store")  # fmt: skip
    _refused(capsys, [str(root / "part-0.npy"), f"{corpus}/part-1.npy", "--input-format",
                      "numpy", *tok, "--output", url], "mix URLs and local paths")  # fmt: skip
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]]
    assert not [k for k in keys if k.startswith("stores/refused")]  # nothing written


def test_a_store_in_a_bucket_naming_a_file_of_another_bucket_is_refused(
    s3, uploaded, tokenizer_dir
):
    _, corpus = uploaded
    url = f"s3://{s3.bucket}/stores/moved"
    register_store([f"{corpus}/part-0.npy"], "numpy", str(tokenizer_dir), url).close()
    shards = json.loads(s3.client.get_object(Bucket=s3.bucket, Key="stores/moved/shards.json")["Body"].read())  # fmt: skip
    shards["files"] = ["s3://elsewhere/corpus/part-0.npy"]
    s3.put("stores/moved/shards.json", json.dumps(shards).encode())
    with pytest.raises(StoreError, match=r"not an object of s3://"):
        TokenStore.open(url)


def test_an_object_changed_or_gone_since_it_was_read_is_found(s3, uploaded):
    """What registering asks before it writes anything: which token file is no longer
    the object it read (replaced: another ETag; deleted), none when all stayed put."""
    from torchtitan_zephon.ingest.token_files import TokenPlace
    from torchtitan_zephon.store.urls import ObjectURL

    root, _ = uploaded
    for k in range(3):
        s3.put(f"moving/part-{k}.npy", (root / f"part-{k}.npy").read_bytes())
    place = TokenPlace(ObjectURL("s3", s3.bucket, "", f"s3://{s3.bucket}"))
    try:
        names = [place.name(f"s3://{s3.bucket}/moving/part-{k}.npy") for k in range(3)]
        assert all(place.exists(n) for n in names) and place.changed(names) is None
        s3.put("moving/part-1.npy", (root / "part-0.npy").read_bytes())  # replaced
        assert place.changed(names) == names[1]
        s3.client.delete_object(Bucket=s3.bucket, Key="moving/part-0.npy")
        assert place.changed(names) == names[0]
    finally:
        place.close()


def test_with_block_checksums_windows_from_the_bucket_fetch_what_they_train(
    s3, uploaded, tokenizer_dir, capsys
):
    """--block-tokens 128 at seq_len 128: each window is read as its own block (with
    the next block's first token, as a block is checked), not a 65,536-token chunk."""
    _, corpus = uploaded
    url = f"s3://{s3.bucket}/stores/blocked"
    code = main(["prepare", f"{corpus}/part-*.npy", "--input-format", "numpy", "--tokenizer",
                 str(tokenizer_dir), "--output", url, "--block-tokens", "128"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    store = TokenStore.open(url)
    try:
        assert store.blocks is not None and int(store.blocks["block_tokens"]) == 128
        before = store.fetched_bytes
        ids = np.array([3, 17, 30])
        rows = store.windows(ids, 128)
        assert rows.shape == (3, 129)
        # each window: its block's 128 tokens and the next one's first, and its checksum
        assert store.fetched_bytes - before == 3 * (129 * 2 + 8)
    finally:
        store.close()
