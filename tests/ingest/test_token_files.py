"""Corpora already tokenized, read in place (issue 45 part b): a Megatron-LM indexed
dataset and OLMo numpy token files, written here in those formats from the tokens of a
store prepared from text, register as a store (only metadata written, the files named
where they are) with the same samples, documents and order; bad files are refused in
one line naming the file, nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.token_files import MEGATRON_HEADER, register_store
from torchtitan_zephon.job.packed import PackedSource
from torchtitan_zephon.job.packing import open_packing
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore


def write_megatron(
    prefix: Path, tokens: np.ndarray, doc_lengths: list[int], *, split=False, code=8
):
    """A Megatron-LM indexed dataset (MMapIndexedDataset, version 1) of ``tokens`` whose
    documents have ``doc_lengths``; ``split``: each document of 2+ tokens as 2 sequences."""
    dtype = {8: "<u2", 4: "<i4"}[code]
    prefix.with_suffix(".bin").write_bytes(np.asarray(tokens).astype(dtype).tobytes())
    lengths, indices = [], [0]
    for n in doc_lengths:
        parts = [n // 2, n - n // 2] if split and n >= 2 else [n]
        lengths += parts
        indices.append(len(lengths))
    lengths_a = np.array(lengths, dtype="<i4")
    pointers = (np.cumsum(lengths_a, dtype=np.int64) - lengths_a) * np.dtype(dtype).itemsize
    head = MEGATRON_HEADER + struct.pack("<QBQQ", 1, code, len(lengths), len(indices))
    prefix.with_suffix(".idx").write_bytes(
        head + lengths_a.tobytes() + pointers.astype("<i8").tobytes()
        + np.array(indices, dtype="<i8").tobytes()
    )  # fmt: skip
    return str(prefix)


@pytest.fixture(scope="module")
def text_store(store_path) -> TokenStore:
    return TokenStore.open(store_path)


def documents_of(store: TokenStore) -> tuple[np.ndarray, list[int]]:
    tokens = np.asarray(store.tokens)
    offsets = np.asarray(store.doc_offsets)
    return tokens, np.diff(np.append(offsets, tokens.size)).tolist()


def _same_samples(a: TokenStore, b: TokenStore, tmp_path: Path) -> None:
    assert (a.num_tokens, a.num_documents, a.dtype) == (b.num_tokens, b.num_documents, b.dtype)
    assert np.array_equal(np.asarray(a.doc_offsets), np.asarray(b.doc_offsets))
    for seq_len in (1, 64, 333):
        ids = np.arange(a.num_samples(seq_len))
        assert np.array_equal(a.windows(ids, seq_len), b.windows(ids, seq_len))
    packed = [
        PackedSource(s, open_packing(s, 64, cache_dir=str(tmp_path / f"p{k}"))[0])
        for k, s in enumerate((a, b))
    ]
    keys = np.arange(packed[0].available)
    assert np.array_equal(packed[0].windows(keys, 64), packed[1].windows(keys, 64))
    assert b.check().ok


@pytest.mark.parametrize("split", [False, True], ids=["a document a sequence", "several"])
def test_a_megatron_dataset_gives_the_samples_of_the_same_text(
    text_store, tokenizer_dir, tmp_path, split
):
    tokens, lengths = documents_of(text_store)
    half = sum(lengths[: len(lengths) // 2])  # two datasets: the first documents, the rest
    a = write_megatron(tmp_path / "a", tokens[:half], lengths[: len(lengths) // 2], split=split)
    b = write_megatron(tmp_path / "b", tokens[half:], lengths[len(lengths) // 2 :], split=split)
    store = register_store([a + ".bin", b], "megatron", str(tokenizer_dir), str(tmp_path / "s"))
    assert store.shards == 2 and store.fingerprint != text_store.fingerprint
    written = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert written == ["checksums.bin", "doc_offsets.bin", "manifest.json", "shards.json"]
    files = json.loads((tmp_path / "s" / "shards.json").read_text())["files"]
    assert files == [str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]  # read in place
    _same_samples(text_store, store, tmp_path)


def test_olmo_numpy_files_give_the_samples_of_the_same_text(text_store, tokenizer_dir, tmp_path):
    tokens, lengths = documents_of(text_store)
    cuts = np.cumsum(lengths)[[10, 50]]  # three files, cut at document ends
    names = []
    for k, part in enumerate(np.split(tokens, cuts)):
        path = tmp_path / f"part-{k}.npy"
        part.astype("<u2").tofile(path)
        names.append(str(path))
    store = register_store(names, "numpy", str(tokenizer_dir), str(tmp_path / "s"))
    assert store.shards == 3
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "s").iterdir()}
    assert sorted(sizes) == ["checksums.bin", "doc_offsets.bin", "manifest.json", "shards.json"]
    assert sizes["doc_offsets.bin"] == 8 * len(lengths)  # what grows with the corpus
    _same_samples(text_store, store, tmp_path)


def test_the_command_registers_and_says_so(text_store, tokenizer_dir, tmp_path, capsys):
    tokens, lengths = documents_of(text_store)
    a = write_megatron(tmp_path / "a", tokens, lengths)
    code = main(["prepare", a, "--input-format", "megatron", "--tokenizer", str(tokenizer_dir),
                 "--output", str(tmp_path / "s")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "in 1 megatron file(s) read in place" in out
    assert TokenStore.open(tmp_path / "s").num_documents == text_store.num_documents


# ---------------------------------------------------------------- refusals


def _refused(capsys, tmp_path, argv, *texts):
    code = main(["prepare", *argv, "--output", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in texts:
        assert text in err, err
    assert not (tmp_path / "s").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".s.tmp")]


@pytest.fixture
def megatron_args(text_store, tokenizer_dir, tmp_path):
    tokens, lengths = documents_of(text_store)
    prefix = write_megatron(tmp_path / "ds", tokens, lengths)
    return (
        prefix,
        ["--input-format", "megatron", "--tokenizer", str(tokenizer_dir)],
        tokens,
        lengths,
    )


def test_an_index_whose_counts_disagree_with_its_bin_is_refused(megatron_args, tmp_path, capsys):
    prefix, flags, _, _ = megatron_args
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[:-2])
    _refused(capsys, tmp_path, [prefix, *flags], "ds.idx: its counts disagree with ds.bin")


def test_a_missing_index_and_a_foreign_file_are_refused(megatron_args, tmp_path, capsys):
    prefix, flags, _, _ = megatron_args
    Path(prefix + ".idx").write_bytes(b"not an index")
    _refused(capsys, tmp_path, [prefix, *flags], "ds.idx: not a Megatron-LM index")
    Path(prefix + ".idx").unlink()
    _refused(capsys, tmp_path, [prefix, *flags], "ds.idx: not found")


def test_documents_without_eod_are_refused(text_store, tokenizer_dir, tmp_path, capsys):
    tokens, lengths = documents_of(text_store)
    ends = np.cumsum(lengths) - 1
    keep = np.ones(tokens.size, dtype=bool)
    keep[ends] = False  # preprocess_data.py without --append-eod
    prefix = write_megatron(tmp_path / "noeod", tokens[keep], [n - 1 for n in lengths])
    _refused(capsys, tmp_path, [prefix, "--input-format", "megatron", "--tokenizer", str(tokenizer_dir)],
             "noeod.bin: ", "documents do not end with the tokenizer's EOS id", "--append-eod")  # fmt: skip


def test_an_unsupported_dtype_code_is_refused(text_store, tokenizer_dir, tmp_path, capsys):
    tokens, lengths = documents_of(text_store)
    prefix = write_megatron(tmp_path / "ds", tokens, lengths)
    data = bytearray(Path(prefix + ".idx").read_bytes())
    data[len(MEGATRON_HEADER) + 8] = 6  # float64
    Path(prefix + ".idx").write_bytes(bytes(data))
    _refused(capsys, tmp_path, [prefix, "--input-format", "megatron", "--tokenizer", str(tokenizer_dir)],
             "ds.idx: token dtype code 6")  # fmt: skip


def test_numpy_files_that_are_not_olmos_are_refused(text_store, tokenizer_dir, tmp_path, capsys):
    tokens, _ = documents_of(text_store)
    flags = ["--input-format", "numpy", "--tokenizer", str(tokenizer_dir)]
    np.save(tmp_path / "header.npy", tokens)
    _refused(
        capsys,
        tmp_path,
        [str(tmp_path / "header.npy"), *flags],
        "header.npy: an .npy file with a header",
    )
    tokens[:-1].astype("<u2").tofile(tmp_path / "cut.npy")
    _refused(
        capsys,
        tmp_path,
        [str(tmp_path / "cut.npy"), *flags],
        "cut.npy: its last token is",
        "not the tokenizer's EOS",
    )
    big = tokens.astype("<u2").copy()
    big[5] = text_store.vocab_size + 3
    big.tofile(tmp_path / "big.npy")
    _refused(capsys, tmp_path, [str(tmp_path / "big.npy"), *flags],
             f"big.npy: token id {text_store.vocab_size + 3} is outside the tokenizer's vocabulary")  # fmt: skip


def test_int32_megatron_tokens_read_as_uint32_and_a_moved_file_is_named(
    text_store, tokenizer_dir, tmp_path
):
    tokens, lengths = documents_of(text_store)
    prefix = write_megatron(tmp_path / "wide", tokens, lengths, code=4)
    store = register_store([prefix], "megatron", str(tokenizer_dir), str(tmp_path / "s"))
    assert store.manifest["dtype"] == "uint32"
    ids = np.arange(text_store.num_samples(64))
    assert np.array_equal(store.windows(ids, 64), text_store.windows(ids, 64).astype(np.uint32))
    Path(prefix + ".bin").rename(tmp_path / "elsewhere.bin")
    with pytest.raises(StoreError, match=r"wide\.bin' is missing"):
        TokenStore.open(tmp_path / "s")


@pytest.mark.slow  # a 2-rank torchrun job; the ranks' packing is build_beside's, tested
# by default under prepare (tests/test_packing_beside.py)
def test_two_ranks_register_and_pack_the_bytes_of_one_process(text_store, tokenizer_dir, tmp_path):
    """Under torchrun rank 0 registers the files and every rank packs its share of the
    chunks (--pack-seq-len): the store and its kept index are the one process's, byte
    for byte."""
    from tests.ingest.test_prepare_distributed import _torchrun

    tokens, lengths = documents_of(text_store)
    a = write_megatron(tmp_path / "a", tokens, lengths)
    args = [a, "--input-format", "megatron", "--tokenizer", str(tokenizer_dir),
            "--pack-seq-len", "64,100"]  # fmt: skip
    assert main(["prepare", *args, "--output", str(tmp_path / "one")]) == 0
    res = _torchrun(2, *args, "--output", str(tmp_path / "two"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("registered ") == 1  # rank 0 says so
    one = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in (tmp_path / "one").rglob("*") if p.is_file()}  # fmt: skip
    two = {p.relative_to(tmp_path / "two"): p.read_bytes() for p in (tmp_path / "two").rglob("*") if p.is_file()}  # fmt: skip
    assert sorted(one) == sorted(two) and len(one) == 4 + 2 * 4  # two indexes, 4 files each
    assert all(one[k] == two[k] for k in one)


def test_block_checksums_when_asked_are_those_of_the_store_upgraded(
    text_store, tokenizer_dir, tmp_path
):
    """--block-tokens N (registration: none unless asked): blocks.bin and blocks.json are
    byte for byte what adding block checksums to the registered store writes."""
    import shutil

    from torchtitan_zephon.migrate.old_stores import add_block_checksums

    tokens, lengths = documents_of(text_store)
    a = write_megatron(tmp_path / "a", tokens, lengths)
    plain = register_store([a], "megatron", str(tokenizer_dir), str(tmp_path / "plain"))
    assert not (tmp_path / "plain" / "blocks.bin").exists()
    blocked = register_store(
        [a], "megatron", str(tokenizer_dir), str(tmp_path / "blocked"), block_tokens=100
    )
    shutil.copytree(tmp_path / "plain", tmp_path / "upgraded")
    add_block_checksums(tmp_path / "upgraded", 100)
    for name in ("blocks.bin", "blocks.json", "manifest.json"):
        assert (tmp_path / "blocked" / name).read_bytes() == (
            tmp_path / "upgraded" / name
        ).read_bytes(), name
    assert blocked.fingerprint == plain.fingerprint and blocked.check().ok
