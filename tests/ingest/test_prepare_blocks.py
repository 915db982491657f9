"""prepare writes block checksums (store/format.py's blocks.bin, blocks.json) for every
store, the bytes ``inspect --upgrade`` writes, whatever the number of ranks; the
fingerprint stays what it was before prepare wrote them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import drop_block_checksums
from tests.ingest.test_prepare_distributed import _in_threads
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.store.format import StoreError, num_blocks
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import create_block_file, write_block_info, write_block_range


def _definition(tokens: np.ndarray, fingerprint: str) -> bytes:
    """Block b: tokens [512 b, 512 b + 513), xxh3-64 seeded with the fingerprint's first
    64 bits, one at a time (format.py's definition, written out)."""
    seed = int(fingerprint[:16], 16)
    n = max(1, -(-(tokens.size - 1) // 512))
    return b"".join(
        xxhash.xxh3_64_intdigest(tokens[512 * b : 512 * b + 513].tobytes(), seed).to_bytes(
            8, "little"
        )
        for b in range(n)
    )


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_prepare_writes_the_block_checksums_upgrade_writes(
    tmp_path: Path, store_path: Path, capsys
) -> None:
    store = TokenStore.open(store_path)
    assert store.num_tokens > 3 * 512  # several blocks
    files = _files(store_path)
    assert files["blocks.bin"] == _definition(np.asarray(store.tokens), store.fingerprint)
    again = tmp_path / "again"
    again.mkdir()
    for name, data in files.items():
        (again / name).write_bytes(data)
    drop_block_checksums(again)
    assert add_block_checksums(again)[1] is True
    assert _files(again) == files  # blocks.json included: one definition, shared code
    assert main(["inspect", str(store_path), "--check"]) == 0
    assert "check:       intact" in capsys.readouterr().out


def test_the_fingerprint_is_the_one_before_block_checksums(tmp_path: Path) -> None:
    """The pinned fingerprint of tests/ingest/test_prepare.py's corpus, with blocks written."""
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR

    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("alpha beta gamma\n")
    (tmp_path / "c" / "sub" / "b.jsonl").write_text(
        '{"text": "delta epsilon"}\n{"text": "zeta eta theta"}\n'
    )
    s = prepare_store([str(tmp_path / "c")], str(TOKENIZER_DIR), str(tmp_path / "s"),
                      progress=False)  # fmt: skip
    assert s.fingerprint == "e70bb69c19bb2b565f31a26b2ecf3c32862c4a8ee29e0d682efe5eedf40b92b3"
    assert (tmp_path / "s" / "blocks.json").is_file()
    assert (tmp_path / "s" / "blocks.bin").read_bytes() == _definition(
        np.asarray(s.tokens), s.fingerprint
    )
    assert s.check().ok


def test_ranks_write_their_share_of_the_blocks(tmp_path: Path, store_path: Path) -> None:
    """Three thread ranks (each writing a third of the blocks) write the store's files,
    block checksums included, byte for byte as one process."""
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR

    corpus = tmp_path / "in"
    corpus.mkdir()
    for k in range(7):
        (corpus / f"{k}.txt").write_text(" ".join(f"w{k}{j % 97}" for j in range(300 + 90 * k)))
    one = prepare_store([str(corpus)], str(TOKENIZER_DIR), str(tmp_path / "one"), progress=False)
    assert num_blocks(one.num_tokens, 512) >= 6
    out = tmp_path / "three"
    results = _in_threads(
        3,
        lambda r: prepare_store(
            [str(corpus)],
            str(TOKENIZER_DIR),
            str(out),
            progress=False,
            ranks=r,
            workers=1,
            unit_bytes=500,
        ),  # fmt: skip
    )
    assert all(isinstance(x, TokenStore) for x in results), results
    assert _files(out) == _files(one.path)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4000),
    cuts=st.lists(st.floats(0, 1), max_size=5),
    fp=st.text("0123456789abcdef", min_size=16, max_size=16),
)
def test_disjoint_block_ranges_write_the_definition(n: int, cuts: list[float], fp: str) -> None:
    """Any split of [0, num_blocks) into ranges, written in any order, gives the blocks
    of the definition (one checksum per block, one at a time)."""
    import tempfile

    tokens = (np.arange(n, dtype=np.int64) * 2654435761 % 50_000).astype("<u2")
    blocks = num_blocks(n, 512)
    edges = sorted({0, blocks, *(int(c * blocks) for c in cuts)})
    with tempfile.TemporaryDirectory() as d:
        create_block_file(d, n, 512)
        for lo, hi in reversed(list(zip(edges, edges[1:], strict=False))):
            write_block_range(d, tokens, fp, lo, hi, 512)
        write_block_info(d, fp, n, 512)
        assert (Path(d) / "blocks.bin").read_bytes() == _definition(tokens, fp)


def _definition_of(tokens: np.ndarray, fingerprint: str, size: int) -> bytes:
    """Block b of ``size``: tokens [size b, size b + size + 1), one at a time."""
    seed = int(fingerprint[:16], 16)
    n = max(1, -(-(tokens.size - 1) // size))
    return b"".join(
        xxhash.xxh3_64_intdigest(tokens[size * b : size * b + size + 1].tobytes(), seed).to_bytes(
            8, "little"
        )
        for b in range(n)
    )


def test_prepare_block_tokens_changes_the_blocks_only(
    tmp_path: Path, store_path: Path, corpus_dir: Path, tokenizer_dir: Path, capsys
) -> None:
    """`prepare --block-tokens 128`: the store of the default prepare (same fingerprint,
    same tokens, same files) but blocks of 128 tokens; `inspect --check` passes."""
    out = tmp_path / "b128"
    argv = ["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
    assert main([*argv, "--block-tokens", "128", "--quiet", "--workers", "1"]) == 0
    default, mine = TokenStore.open(store_path), TokenStore.open(out)
    assert f"fingerprint {default.fingerprint}" in capsys.readouterr().out
    assert mine.fingerprint == default.fingerprint
    a, b = _files(store_path), _files(out)
    assert {k: v for k, v in a.items() if not k.startswith("blocks.")} == {
        k: v for k, v in b.items() if not k.startswith("blocks.")
    }
    info = json.loads(b["blocks.json"])
    assert info["block_tokens"] == 128 and info["num_blocks"] == num_blocks(mine.num_tokens, 128)
    assert b["blocks.bin"] == _definition_of(np.asarray(mine.tokens), mine.fingerprint, 128)
    assert main(["inspect", str(out), "--check"]) == 0
    assert "check:       intact" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-5", "65537", "1e3", "x"])
def test_prepare_refuses_a_bad_block_size_and_writes_nothing(
    tmp_path: Path, corpus_dir: Path, tokenizer_dir: Path, capsys, value: str
) -> None:
    out = tmp_path / "out"
    argv = ["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
    assert main([*argv, "--block-tokens", value, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "zephon prepare: error: argument --block-tokens: expected an integer in [1, 65536], "
        f"got {value!r}"
    )
    assert list(tmp_path.iterdir()) == []


def test_prepare_store_checks_the_block_size_before_anything(
    tmp_path: Path, corpus_dir: Path, tokenizer_dir: Path
) -> None:
    with pytest.raises(StoreError, match=r"^block_tokens must be an integer in \[1, 65536\]"):
        prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "o"),
                      progress=False, block_tokens=0)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_ranks_write_their_share_of_blocks_of_any_size(tmp_path: Path) -> None:
    """Three thread ranks with --block-tokens 100 write the bytes of one process."""
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR

    corpus = tmp_path / "in"
    corpus.mkdir()
    for k in range(5):
        (corpus / f"{k}.txt").write_text(" ".join(f"v{k}{j % 89}" for j in range(200 + 70 * k)))
    one = prepare_store([str(corpus)], str(TOKENIZER_DIR), str(tmp_path / "one"),
                        progress=False, block_tokens=100)  # fmt: skip
    assert num_blocks(one.num_tokens, 100) >= 9
    out = tmp_path / "three"
    results = _in_threads(
        3,
        lambda r: prepare_store(
            [str(corpus)],
            str(TOKENIZER_DIR),
            str(out),
            progress=False,
            ranks=r,
            workers=1,
            unit_bytes=500,
            block_tokens=100,
        ),  # fmt: skip
    )
    assert all(isinstance(x, TokenStore) for x in results), results
    assert _files(out) == _files(one.path)
    assert json.loads(_files(out)["blocks.json"])["block_tokens"] == 100


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    size=st.integers(1, 700),
    cuts=st.lists(st.floats(0, 1), max_size=4),
)
def test_disjoint_ranges_of_any_block_size_write_the_definition(
    n: int, size: int, cuts: list[float]
) -> None:
    import tempfile

    fp = "0123456789abcdef" * 4
    tokens = (np.arange(n, dtype=np.int64) * 2654435761 % 50_000).astype("<u2")
    blocks = num_blocks(n, size)
    edges = sorted({0, blocks, *(int(c * blocks) for c in cuts)})
    with tempfile.TemporaryDirectory() as d:
        create_block_file(d, n, size)
        for lo, hi in reversed(list(zip(edges, edges[1:], strict=False))):
            write_block_range(d, tokens, fp, lo, hi, size)
        write_block_info(d, fp, n, size)
        assert (Path(d) / "blocks.bin").read_bytes() == _definition_of(tokens, fp, size)
        assert json.loads((Path(d) / "blocks.json").read_text())["num_blocks"] == blocks


def test_two_ranks_under_torchrun_write_blocks_of_the_size_asked(
    tmp_path: Path, corpus_dir: Path, tokenizer_dir: Path
) -> None:
    """`torchrun --nproc-per-node 2 -m torchtitan_zephon prepare --block-tokens 128`:
    each rank writes its share of the 128-token blocks; the store is byte for byte the
    one process's with the same size."""
    from tests.ingest.test_prepare_distributed import _torchrun

    one = prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "one"),
                        progress=False, block_tokens=128)  # fmt: skip
    assert num_blocks(one.num_tokens, 128) >= 20
    res = _torchrun(2, str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output",
                    str(tmp_path / "two"), "--workers", "1", "--quiet", "--unit-bytes", "2000",
                    "--block-tokens", "128")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(2 ranks)" in res.stdout, res.stdout
    assert _files(tmp_path / "two") == _files(one.path)
    assert json.loads((tmp_path / "two" / "blocks.json").read_text())["block_tokens"] == 128
