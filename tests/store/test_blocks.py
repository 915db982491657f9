"""Block checksums (store/format.py, store/upgrade.add_block_checksums): added in place
by `zephon inspect --upgrade`, the fingerprint and local reads unchanged, checked by
`--check`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tests.conftest import copy_store, drop_block_checksums, edit_token
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.store.format import BLOCK_TOKENS, StoreError, num_blocks
from torchtitan_zephon.store.reader import TokenStore


def _expected_blocks(store: TokenStore) -> np.ndarray:
    """Block b: tokens [512 b, 512 b + 513) (the last ends with the store), xxh3-64 seeded
    with the fingerprint's first 64 bits: the definition in store/format.py, written out."""
    tokens = np.asarray(store.tokens)
    seed = int(store.fingerprint[:16], 16)
    n = -(-(store.num_tokens - 1) // 512)
    return np.array(
        [
            xxhash.xxh3_64_intdigest(tokens[512 * b : 512 * b + 513].tobytes(), seed)
            for b in range(n)
        ],
        dtype="<u8",
    )


def test_upgrade_adds_block_checksums_and_keeps_the_store(tmp_path: Path, store_path: Path):
    path = drop_block_checksums(
        copy_store(store_path, tmp_path / "s")
    )  # as before prepare wrote them
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    old = TokenStore.open(path)
    up, changed = add_block_checksums(path)
    assert changed and up.fingerprint == old.fingerprint
    after = {p.name: p.read_bytes() for p in path.iterdir()}
    assert sorted(set(after) - set(before)) == ["blocks.bin", "blocks.json"]
    assert all(after[name] == data for name, data in before.items())  # manifest included
    assert BLOCK_TOKENS == 512 and num_blocks(old.num_tokens, 512) == -(
        -(old.num_tokens - 1) // 512
    )
    assert after["blocks.bin"] == _expected_blocks(old).tobytes()
    info = json.loads(after["blocks.json"])
    assert info == {
        "format": "zephon-block-checksums",
        "version": 1,
        "algorithm": "xxh3_64",
        "block_tokens": 512,
        "seed": "fingerprint[:16]",
        "fingerprint": old.fingerprint,
        "num_blocks": num_blocks(old.num_tokens, 512),
        "blocks_xxh3_128": xxhash.xxh3_128_hexdigest(after["blocks.bin"]),
    }
    ids = np.arange(old.num_samples(16))
    np.testing.assert_array_equal(up.windows(ids, 16), old.windows(ids, 16))
    assert up.check().ok
    assert add_block_checksums(path)[1] is False  # once is enough


def test_block_checksums_are_written_from_checked_tokens_only(tmp_path: Path, store_path: Path):
    path = drop_block_checksums(
        copy_store(store_path, tmp_path / "s")
    )  # as before prepare wrote them
    edit_token(path, 700)  # chunk 0 of 65,536 tokens no longer matches
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(StoreError) as e:
        add_block_checksums(path)
    assert str(e.value).startswith(
        f"token store {str(path)!r}: no block checksums were added: 1 chunk(s) of tokens.bin "
        "do not match their checksums (first: chunk 0), and block checksums would vouch for "
        "them. Nothing was changed."
    )
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_check_reports_bad_blocks_and_a_foreign_blocks_file(tmp_path: Path, store_path: Path):
    path = drop_block_checksums(
        copy_store(store_path, tmp_path / "s")
    )  # as before prepare wrote them
    add_block_checksums(path)
    blocks = bytearray((path / "blocks.bin").read_bytes())
    blocks[8 * 3] ^= 1  # block 3's checksum
    (path / "blocks.bin").write_bytes(bytes(blocks))
    store = TokenStore.open(path)  # local reads check chunks: unaffected
    ids = np.arange(store.num_samples(8))
    np.testing.assert_array_equal(
        store.windows(ids, 8), TokenStore.open(store_path).windows(ids, 8)
    )
    problems = store.check().problems
    assert problems == [
        "blocks.bin does not match the xxh3-128 blocks.json records",
        "block 3 (tokens [1536, 2049)) of tokens.bin does not match its checksum in blocks.bin",
    ]
    info = json.loads((path / "blocks.json").read_text())
    info["fingerprint"] = "ab" * 32
    (path / "blocks.json").write_text(json.dumps(info))
    assert TokenStore.open(path).check().problems == [
        f"'{path / 'blocks.json'}' belongs to another version of the store: it names "
        f"fingerprint abababababababab..., the manifest's is {store.fingerprint[:16]}.... "
        f"Write it again with `zephon inspect {path} --upgrade`."
    ]
    assert add_block_checksums(path)[1] is True  # written afresh
    assert TokenStore.open(path).check().ok


def test_inspect_upgrade_adds_block_checksums(tmp_path: Path, store_path: Path, capsys):
    path = drop_block_checksums(
        copy_store(store_path, tmp_path / "s")
    )  # as before prepare wrote them
    fingerprint = TokenStore.open(path).fingerprint
    assert main(["inspect", str(path), "--upgrade", "--check"]) == 0
    out = capsys.readouterr().out
    assert (
        "upgrade:     block checksums added (blocks.bin, blocks.json), fingerprint unchanged" in out
    )
    assert f"fingerprint: {fingerprint}" in out and "check:       intact" in out
    assert main(["inspect", str(path), "--upgrade"]) == 0
    assert "upgrade:     nothing to do" in capsys.readouterr().out


def test_a_blocks_file_that_is_not_text_is_said_not_a_traceback(tmp_path: Path, store_path: Path):
    path = drop_block_checksums(
        copy_store(store_path, tmp_path / "s")
    )  # as before prepare wrote them
    add_block_checksums(path)
    (path / "blocks.json").write_bytes(bytes(range(256)))
    problems = TokenStore.open(path).check().problems
    assert len(problems) == 1 and problems[0].startswith(
        f"cannot read '{path / 'blocks.json'}': 'utf-8' codec can't decode byte 0x80"
    )


def _blocks_of(store: TokenStore, size: int) -> bytes:
    """Block b of ``size``: tokens [size b, size b + size + 1), seeded as above."""
    tokens, seed = np.asarray(store.tokens), int(store.fingerprint[:16], 16)
    n = max(1, -(-(store.num_tokens - 1) // size))
    return b"".join(
        xxhash.xxh3_64_intdigest(tokens[size * b : size * b + size + 1].tobytes(), seed).to_bytes(
            8, "little"
        )
        for b in range(n)
    )


def test_upgrade_switches_the_block_size_and_keeps_the_fingerprint(
    tmp_path: Path, store_path: Path, capsys
):
    path = copy_store(store_path, tmp_path / "s")  # blocks of 512, as prepare writes them
    store = TokenStore.open(path)
    kept = {p.name: p.read_bytes() for p in path.iterdir() if not p.name.startswith("blocks.")}
    assert main(["inspect", str(path), "--upgrade", "--block-tokens", "128", "--check"]) == 0
    out = capsys.readouterr().out
    assert (
        "upgrade:     block checksums rewritten: blocks of 128 tokens, were 512 (blocks.bin, "
        "blocks.json), fingerprint unchanged" in out
    )
    assert "check:       intact" in out and f"fingerprint: {store.fingerprint}" in out
    assert (
        f"blocks:      {num_blocks(store.num_tokens, 128):,} block checksums of 128 tokens" in out
    )
    info = json.loads((path / "blocks.json").read_text())
    assert info["block_tokens"] == 128 and info["num_blocks"] == num_blocks(store.num_tokens, 128)
    assert (path / "blocks.bin").read_bytes() == _blocks_of(store, 128)
    assert {n: (path / n).read_bytes() for n in kept} == kept  # manifest included
    up = TokenStore.open(path)
    assert up.fingerprint == store.fingerprint
    ids = np.arange(up.num_samples(128))
    np.testing.assert_array_equal(up.windows(ids, 128), store.windows(ids, 128))
    # the same size, or none asked: the blocks are kept as they are
    blocks = (path / "blocks.bin").read_bytes(), (path / "blocks.json").read_bytes()
    assert add_block_checksums(path, 128)[1] is False
    assert main(["inspect", str(path), "--upgrade"]) == 0
    assert "upgrade:     nothing to do" in capsys.readouterr().out
    assert ((path / "blocks.bin").read_bytes(), (path / "blocks.json").read_bytes()) == blocks
    # and back to the default size: the bytes prepare writes
    assert add_block_checksums(path, 512)[1] is True
    assert (path / "blocks.bin").read_bytes() == (store_path / "blocks.bin").read_bytes()
    assert (path / "blocks.json").read_bytes() == (store_path / "blocks.json").read_bytes()


@pytest.mark.parametrize("value", ["0", "-1", "65537", "2.5", "many"])
def test_a_bad_block_size_is_refused_and_nothing_written(
    tmp_path: Path, store_path: Path, capsys, value: str
):
    path = copy_store(store_path, tmp_path / "s")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    assert main(["inspect", str(path), "--upgrade", "--block-tokens", value]) == 2
    err = capsys.readouterr().err
    assert (
        f"argument --block-tokens: expected an integer in [1, 65536], got {value!r}"
        in err.splitlines()[-1]
    )
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_the_block_size_is_checked_by_upgrade_itself(tmp_path: Path, store_path: Path):
    path = copy_store(store_path, tmp_path / "s")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    for bad, shown in ((0, "0"), (65537, "65537"), (True, "True"), (2.0, "2.0")):
        with pytest.raises(StoreError) as e:
            add_block_checksums(path, bad)
        assert str(e.value) == (
            "--block-tokens must be an integer in [1, 65536] (tokens per block checksum; pick "
            f"seq_len or a divisor of it), got {shown}; nothing was written."
        )
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_block_tokens_without_upgrade_is_said(tmp_path: Path, store_path: Path, capsys):
    path = copy_store(store_path, tmp_path / "s")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    assert main(["inspect", str(path), "--block-tokens", "128"]) != 0
    err = capsys.readouterr().err
    assert (
        f"--block-tokens 128 chooses the block size --upgrade writes; add --upgrade "
        f"(`zephon inspect {path} --upgrade --block-tokens 128`)." in err
    )
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
