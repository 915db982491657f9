"""``zephon prepare --shard-bytes`` (issue 45 part a2): a store of more token bytes is
written as shards, each unit's tokens once (a part of one shard is linked, not copied),
with the fingerprint, tokens and every other file of the one-file store; the same bytes
for any number of ranks; into a bucket, each rank uploads its own shards."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.ingest.test_prepare_distributed import _in_threads
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest import tokenized as tokenized_module
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import SHARD_BYTES

UNIT = 2000  # input bytes per unit: the corpus (~40 files, one JSONL) makes many units


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def one_file(corpus_dir, tokenizer_dir, tmp_path_factory) -> TokenStore:
    out = tmp_path_factory.mktemp("one") / "store"
    return prepare_store([str(corpus_dir)], str(tokenizer_dir), str(out), progress=False,
                         unit_bytes=UNIT, shard_bytes=None)  # fmt: skip


def test_a_store_over_the_shard_size_is_sharded_with_the_one_file_stores_fingerprint(
    corpus_dir, tokenizer_dir, tmp_path, one_file
):
    sharded = prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "s"),
                            progress=False, unit_bytes=UNIT, shard_bytes=600)  # fmt: skip
    assert sharded.shards > 10 and sharded.fingerprint == one_file.fingerprint
    assert np.array_equal(np.asarray(sharded.tokens), np.asarray(one_file.tokens))
    assert np.array_equal(sharded.windows(np.arange(40), 64), one_file.windows(np.arange(40), 64))
    mine, theirs = _files(Path(sharded.path)), _files(Path(one_file.path))
    shard_files = [n for n in mine if n.startswith("tokens/")]
    assert len(shard_files) == sharded.shards
    assert all(len(mine[n]) <= 600 for n in shard_files)
    del theirs["tokens.bin"]
    assert {n: b for n, b in mine.items() if n != "shards.json" and n not in shard_files} == theirs
    assert sharded.check().ok


def test_a_store_within_one_shard_is_one_tokens_bin(corpus_dir, tokenizer_dir, tmp_path, one_file):
    store = prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "s"),
                          progress=False, unit_bytes=UNIT)  # fmt: skip
    assert one_file.num_tokens * 2 < SHARD_BYTES
    assert store.shards == 0 and _files(Path(store.path)) == _files(Path(one_file.path))


def test_each_part_of_one_shard_is_linked_not_copied(
    corpus_dir, tokenizer_dir, tmp_path, one_file, monkeypatch
):
    """The tokens are written once: a part that is one shard becomes it by a link; only a
    part over the shard size is cut (written again)."""
    linked, cut = [], []
    real_link, real_write = os.link, tokenized_module.write_unit_shards

    def link(src, dst, *a, **k):
        linked.append(Path(dst).name)
        return real_link(src, dst, *a, **k)

    def write(store, parts, record, first, shard_tokens, itemsize):
        if len(tokenized_module.unit_shards(record, shard_tokens)) > 1:
            cut.append(record["key"])
        return real_write(store, parts, record, first, shard_tokens, itemsize)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr("torchtitan_zephon.ingest.assemble.write_unit_shards", write)
    big = prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "big"),
                        progress=False, unit_bytes=UNIT, shard_bytes=4096)  # fmt: skip
    assert big.shards == len(linked) > 1 and not cut
    assert big.fingerprint == one_file.fingerprint


def test_two_ranks_write_the_bytes_of_one(corpus_dir, tokenizer_dir, tmp_path):
    def run(out):
        return lambda ranks: prepare_store(
            [str(corpus_dir)], str(tokenizer_dir), str(out), progress=False, ranks=ranks,
            unit_bytes=UNIT, shard_bytes=700,
        )  # fmt: skip

    one = _in_threads(1, run(tmp_path / "one"))[0]
    two = _in_threads(2, run(tmp_path / "two"))
    assert not any(isinstance(r, BaseException) for r in [one, *two]), [one, *two]
    assert one.shards > 1
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_a_bad_shard_size_is_refused_before_anything_is_written(
    corpus_dir, tokenizer_dir, tmp_path, capsys
):
    with pytest.raises(StoreError, match="shard_bytes must be an integer >= 1"):
        prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "s"),
                      progress=False, shard_bytes=0)  # fmt: skip
    assert main(["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir),
                 "--output", str(tmp_path / "c"), "--shard-bytes", "0"]) == 2  # fmt: skip
    assert "--shard-bytes" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
