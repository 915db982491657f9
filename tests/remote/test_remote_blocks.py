"""Reads from object storage checked block by block (store/remote.py with the block
checksums of store/format.py), against a real S3 API on loopback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store, edit_token
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore


@pytest.fixture(scope="module")
def blocked(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store (chunks of 65,536 tokens) with block checksums."""
    path = copy_store(store_path, tmp_path_factory.mktemp("blocked") / "store")
    add_block_checksums(path)
    return path


@pytest.fixture(scope="module")
def blocked_url(s3, blocked: Path) -> str:
    return s3.upload(blocked, "blocks/store")


def _wait(future) -> None:
    deadline = time.time() + 10
    while not future.done():
        assert time.time() < deadline
        time.sleep(0.01)


def test_opening_reads_the_manifest_and_blocks_json_only(blocked_url: str, blocked: Path):
    remote = TokenStore.open(blocked_url)
    assert remote.fingerprint == TokenStore.open(blocked).fingerprint
    assert remote.blocks is not None and remote.checksums is None  # checksums.bin: not read
    sizes = {p.name: p.stat().st_size for p in blocked.iterdir()}
    assert remote.fetched_bytes == sizes["manifest.json"] + sizes["blocks.json"]
    assert remote.requests == 2
    assert remote.describe()["num_chunks"] == TokenStore.open(blocked).num_chunks


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), seq_len=st.sampled_from([1, 7, 511, 512, 513, 1024, 2000]))
def test_windows_equal_local_reads(blocked_url: str, blocked: Path, data, seq_len: int) -> None:
    local = TokenStore.open(blocked)
    remote = _opened(blocked_url)
    n = local.num_samples(seq_len)
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=20)))
    np.testing.assert_array_equal(remote.windows(ids, seq_len), local.windows(ids, seq_len))


_OPEN: dict[str, TokenStore] = {}


def _opened(url: str) -> TokenStore:
    if url not in _OPEN:
        _OPEN[url] = TokenStore.open(url)
    return _OPEN[url]


def test_aligned_windows_fetch_their_own_tokens_and_block_checksums(blocked_url: str):
    """seq_len a multiple of 512: a window is its 512-token blocks, the label token the
    last block's overlap; so the bytes fetched are the window's tokens plus 8 bytes per
    block, read ahead in one request for the tokens and one for their checksums."""
    remote = TokenStore.open(blocked_url)
    opened, requests = remote.fetched_bytes, remote.requests
    seq_len = 1024
    ids = np.array([0, 3])  # tokens [0, 1025) and [3072, 4097): not adjacent
    remote.read_ahead(ids, seq_len)
    _wait(remote._steps[0].fetch.future)
    assert remote.fetched_bytes - opened == 2 * (1025 * 2 + 2 * 8)
    assert remote.requests - requests == 4
    before = remote.fetched_bytes
    assert remote.windows(ids, seq_len).shape == (2, 1025)
    assert remote.fetched_bytes == before  # served from the read-ahead
    # neighbours share a run: samples 1 and 2 are tokens [1024, 3073), blocks 2..5
    remote.windows(np.array([1, 2]), seq_len)
    assert remote.fetched_bytes - before == 2049 * 2 + 4 * 8


def test_a_changed_block_is_refused_before_it_is_served(s3, blocked: Path, tmp_path: Path):
    bad = copy_store(blocked, tmp_path / "bad")
    edit_token(bad, 512 * 5 + 100)  # block 5; manifest, checksums and blocks are the original's
    url = s3.upload(bad, "blocks/bad")
    remote = TokenStore.open(url)
    seq_len = 512
    assert remote.windows(np.array([0, 3]), seq_len).shape == (2, 513)  # blocks 0 and 3: intact
    remote.read_ahead(np.array([5]), seq_len)
    with pytest.raises(StoreError) as e:
        remote.windows(np.array([5]), seq_len)
    assert str(e.value) == (
        f"token store '{url}': block 5 of tokens.bin (tokens [2560, 3073)) does not match its "
        "checksum in blocks.bin; an object was changed or corrupted after preparation. Run "
        f"`zephon inspect {url} --check` to list every bad chunk and block, and upload the "
        "store again from an intact copy."
    )
    report = remote.check()
    assert not report.ok and report.bad_chunks[0]["index"] == 0
    assert (
        "block 5 (tokens [2560, 3073)) of tokens.bin does not match its checksum in blocks.bin"
        in report.problems
    )


def test_blocks_of_another_store_version_are_refused(s3, blocked: Path, tmp_path: Path):
    other = copy_store(blocked, tmp_path / "other")
    info = json.loads((other / "blocks.json").read_text())
    info["fingerprint"] = "cd" * 32
    (other / "blocks.json").write_text(json.dumps(info))
    url = s3.upload(other, "blocks/other")
    with pytest.raises(StoreError) as e:
        TokenStore.open(url)
    fp = info["fingerprint"]
    assert str(e.value) == (
        f"'{url}/blocks.json' belongs to another version of the store: it names fingerprint "
        f"{fp[:16]}..., the manifest's is {TokenStore.open(blocked).fingerprint[:16]}.... "
        "Run `zephon inspect STORE --upgrade` on the local copy and upload its blocks.bin "
        "and blocks.json again (blocks.json last)."
    )
    url = s3.upload(blocked, "blocks/no-bin", skip=("blocks.bin",))
    with pytest.raises(StoreError, match=r"store file '.*/no-bin/blocks.bin' is missing \(blocks"):
        TokenStore.open(url)


def test_inspect_check_of_a_url_with_blocks(capsys, blocked_url: str) -> None:
    assert main(["inspect", blocked_url, "--check"]) == 0
    assert "check:       intact" in capsys.readouterr().out


@pytest.fixture(scope="module")
def sized_stores(
    store, s3, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, tuple[str, Path]]:
    """A synthetic store of 2**18 random tokens (documents of 1,000), with block checksums
    of 128 tokens (the default job's seq_len) and, as a copy, of 512 (the default), each
    in the bucket; block size -> (URL, local copy)."""
    from torchtitan_zephon.store.writer import write_derived_store

    num_tokens = 1 << 18
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, store.eos_id, size=num_tokens, dtype=np.uint16)
    starts = np.arange(0, num_tokens, 1000, dtype=np.int64)
    tokens[np.append(starts[1:], num_tokens) - 1] = store.eos_id
    root = tmp_path_factory.mktemp("sized")
    out = {}
    for size in (128, 512):
        folder = root / f"b{size}"
        folder.mkdir()
        write_derived_store(folder, store, tokens.tobytes(), starts, {"name": "s", "kind": "test"})
        assert add_block_checksums(folder, size)[1]
        out[size] = (s3.upload(folder, f"sized/b{size}"), folder)
    return out


def test_windows_of_seq_len_from_blocks_of_seq_len_fetch_their_own_bytes(sized_stores) -> None:
    """The default job's shape (seq_len 128, local batch 4, the trainer's prefetch,
    read_ahead_steps 4, 40 steps, last_step 40) from a store whose blocks are 128 tokens:
    each 129-token window is one block and its overlap, so bytes fetched (opening and
    block checksums included) are at most 1.1 per byte trained; 512-token blocks fetch
    a whole block per window (about 4)."""
    from tests.remote.test_read_ahead_bound import _fetched_per_trained

    ratios = {
        size: _fetched_per_trained(url, local, 40, 40, seq_len=128, batch=4)
        for size, (url, local) in sized_stores.items()
    }
    assert ratios[128] <= 1.1, ratios
    assert ratios[512] > 3, ratios  # what the block size saves
    # same fingerprint, same windows, whatever the block size
    a, b = (TokenStore.open(sized_stores[s][0]) for s in (128, 512))
    assert a.fingerprint == b.fingerprint and a.blocks["block_tokens"] == 128
    ids = np.array([0, 5, 6, 1000, 2046])
    np.testing.assert_array_equal(a.windows(ids, 128), b.windows(ids, 128))
    np.testing.assert_array_equal(
        a.windows(ids, 128), TokenStore.open(sized_stores[128][1]).windows(ids, 128)
    )


def test_a_block_size_that_does_not_divide_seq_len_is_said_once(
    sized_stores, tmp_path: Path, caplog
) -> None:
    """Opening a job's store whose blocks do not divide seq_len logs one info line with
    the cost and the fix; blocks that divide it (or a local store) log nothing."""
    import logging

    from tests.titan.test_dataloader import job
    from torchtitan_zephon.titan.start.job_data import block_rounding_note, resolve_data

    (url512, local512), (url128, _) = sized_stores[512], sized_stores[128]
    with caplog.at_level(logging.INFO):
        data = resolve_data(job(tmp_path, store=url512))  # seq_len 32
    notes = [r.getMessage() for r in caplog.records if "block checksums of" in r.getMessage()]
    ratio = 513 / 33  # a window in [32 k, 32 k + 33) lies in one block: [512 b, 512 b + 513)
    assert notes == [
        f"Zephon: the store {url512} has block checksums of 512 tokens and seq_len 32 is not "
        f"a multiple of it: each 33-token sample window fetches {ratio:.2f}x its bytes (whole "
        "blocks). To fetch only its own, rewrite them on the local copy (`zephon inspect STORE "
        "--upgrade --block-tokens 32`, or `zephon prepare ... --block-tokens 32`) and upload it "
        "again: the fingerprint stays."
    ]
    assert data.windows(np.array([3]), 32).shape == (1, 33)  # reads still work
    remote128 = TokenStore.open(url128)
    assert remote128.window_fetch_ratio(128) == remote128.window_fetch_ratio(384) == 1.0
    assert remote128.window_fetch_ratio(64) == 129 / 65  # half a block and its overlap
    assert block_rounding_note(remote128, 256) is None  # 128 divides 256
    assert "--block-tokens 96" in block_rounding_note(remote128, 96)
    assert block_rounding_note(TokenStore.open(local512), 32) is None  # local: reads chunks
