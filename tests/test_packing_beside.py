"""The packing index kept with the store (issue 45 part c): built at prepare (or for a
registered store) into the store's own folder, its chunks shared by any number of
ranks with the bytes of one process; a job opening the store maps it and builds nothing
in the cache; one that is not the store's is refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.ingest.test_prepare_distributed import _in_threads
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.job.packed import PackedSource
from torchtitan_zephon.job.packing import (
    MANIFEST,
    build_beside,
    document_lengths,
    open_packing,
)
from torchtitan_zephon.order.packing import CHUNK_DOCUMENTS, pack
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_derived_store


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def many_documents(store_path, tmp_path_factory) -> TokenStore:
    """A store of 2.5 chunks of documents (1 to 9 tokens each, EOS last), so ranks share
    chunks."""
    like = TokenStore.open(store_path)
    rng = np.random.default_rng(5)
    n = CHUNK_DOCUMENTS * 5 // 2
    lengths = rng.integers(1, 10, n)
    tokens = rng.integers(0, like.eos_id, int(lengths.sum())).astype(like.dtype)
    tokens[np.cumsum(lengths) - 1] = like.eos_id
    folder = tmp_path_factory.mktemp("many") / "store"
    folder.mkdir()
    offsets = np.cumsum(lengths) - lengths
    write_derived_store(
        folder, like, tokens.tobytes(), offsets, {"name": "synthetic", "kind": "test"}
    )
    return TokenStore.open(folder)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_ranks_share_the_chunks_and_write_the_bytes_of_one_process(many_documents, tmp_path):
    from torchtitan_zephon.store.writer import write_store_as

    copies = [write_store_as(many_documents, tmp_path / f"s{w}") for w in (1, 3)]
    folders = []
    for world, store in zip((1, 3), copies, strict=True):
        results = _in_threads(world, lambda ranks, s=store: build_beside(s, 64, ranks))
        assert not any(isinstance(r, BaseException) for r in results), results
        folders.append(results[0])
    assert folders[0].relative_to(copies[0].path) == Path("packing/best_fit-L64-v1")
    assert _files(folders[0]) == _files(folders[1])
    want = pack(document_lengths(many_documents), 64)
    assert np.array_equal(np.load(folders[0] / "starts.npy"), want.starts)
    assert np.array_equal(np.load(folders[0] / "pieces.npy"), want.pieces)
    assert not list(Path(copies[1].path, "packing").glob(".*"))  # the staging folder is gone


def test_a_job_maps_the_stores_own_index_and_builds_nothing(store, store_path, tmp_path, cache):
    from torchtitan_zephon.store.writer import write_store_as

    own = write_store_as(store, tmp_path / "own")
    folder = build_beside(own, 32)
    packed, found = open_packing(own, 32)
    assert found == folder and not cache.exists()  # nothing built in the cache
    want = pack(document_lengths(store), 32)  # what the note and warning say: recorded
    assert packed.recorded == (int(want.pieces[:, 2].sum()), want.split_documents())
    built, _ = open_packing(store, 32)  # the original store: packed into the cache
    assert cache.exists()
    assert np.array_equal(packed.pieces, built.pieces)
    keys = np.arange(packed.num_samples)
    a, b = PackedSource(own, packed), PackedSource(store, built)
    assert np.array_equal(a.windows(keys, 32), b.windows(keys, 32))


def test_an_index_that_is_not_the_stores_is_refused_naming_it(store, tmp_path, cache):
    from torchtitan_zephon.store.writer import write_store_as

    own = write_store_as(store, tmp_path / "own")
    folder = build_beside(own, 32)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["num_samples"] += 1
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        StoreError, match=f"the packing index {folder} does not hold what its manifest says"
    ):
        open_packing(own, 32)


def test_prepare_keeps_the_index_of_each_seq_len_asked(
    corpus_dir, tokenizer_dir, tmp_path, capsys, cache
):
    out = tmp_path / "store"
    code = main(["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output", str(out),
                 "--quiet", "--pack-seq-len", "32,64"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    for seq_len in (32, 64):
        assert (out / "packing" / f"best_fit-L{seq_len}-v1" / "manifest.json").is_file()
        assert f"packed at seq_len {seq_len}: " in printed
    store = TokenStore.open(out)
    assert open_packing(store, 64)[1] == out / "packing" / "best_fit-L64-v1"
    assert main(["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output",
                 str(tmp_path / "x"), "--pack-seq-len", "0"]) == 2  # fmt: skip
    assert "--pack-seq-len" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_inspect_check_hashes_the_indexes_the_store_keeps(store, tmp_path, cache, capsys):
    from torchtitan_zephon.store.writer import write_store_as

    own = write_store_as(store, tmp_path / "own")
    folder = build_beside(own, 32)
    assert main(["inspect", str(own.path), "--check", "--json"]) == 0
    pieces = folder / "pieces.npy"
    data = bytearray(pieces.read_bytes())
    data[-1] ^= 1  # the same size: only a hash finds it
    pieces.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["inspect", str(own.path), "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)["check"]
    assert any(
        "pieces.npy does not hash to what its manifest records" in p for p in report["problems"]
    )
