"""A sharded store in object storage (issue 45 part a1), against a real S3 API on loopback:
its shards read by range as one tokens.bin, the windows of the local one-file store, the
same fingerprint; a shard missing or short fails the read that needs it, naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import shard_name
from torchtitan_zephon.store.writer import write_store_as


@pytest.fixture(scope="module")
def one_file(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> TokenStore:
    """The shared store with chunks of 64 tokens (many chunks, small reads)."""
    root = tmp_path_factory.mktemp("shard-src")
    return TokenStore.open(copy_store(store_path, root / "store", chunk_tokens=64))


@pytest.fixture(scope="module")
def sharded_url(s3, one_file: TokenStore, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``one_file`` as shards of 500 tokens (1,000 bytes: samples cross shards), uploaded."""
    sharded = write_store_as(one_file, tmp_path_factory.mktemp("sharded") / "s", shard_tokens=500)
    return s3.upload(Path(sharded.path), "sharded/chunks")


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), seq_len=st.sampled_from([1, 7, 63, 64, 200, 499, 501]))
def test_windows_of_the_bucket_shards_equal_the_local_one_file_store(
    sharded_url: str, one_file: TokenStore, data, seq_len: int
) -> None:
    remote = _opened(sharded_url)
    assert remote.fingerprint == one_file.fingerprint and remote.shards > 1
    n = one_file.num_samples(seq_len)
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40)))
    np.testing.assert_array_equal(remote.windows(ids, seq_len), one_file.windows(ids, seq_len))


_OPEN: dict[str, TokenStore] = {}


def _opened(url: str) -> TokenStore:
    if url not in _OPEN:
        _OPEN[url] = TokenStore.open(url)
    return _OPEN[url]


def test_opening_a_sharded_store_reads_its_list_and_no_shard(
    sharded_url: str, one_file: TokenStore, tmp_path: Path
) -> None:
    remote = TokenStore.open(sharded_url)
    root = Path(one_file.path)
    shards_json = remote._files.sizes["shards.json"]
    expected = (root / "manifest.json").stat().st_size + (root / "checksums.bin").stat().st_size
    assert (remote.fetched_bytes, remote.requests) == (expected + shards_json, 3)
    report = remote.check()
    assert report.ok, report.problems


def test_a_sharded_store_with_block_checksums_reads_its_blocks(s3, one_file, tmp_path) -> None:
    blocked = copy_store(Path(one_file.path), tmp_path / "blocked")
    add_block_checksums(blocked, 64)
    sharded = write_store_as(TokenStore.open(blocked), tmp_path / "s", shard_tokens=333)
    remote = TokenStore.open(s3.upload(Path(sharded.path), "sharded/blocks"))
    assert remote.blocks is not None and remote.shards == -(-one_file.num_tokens // 333)
    ids = np.arange(one_file.num_samples(64))
    np.testing.assert_array_equal(remote.windows(ids, 64), one_file.windows(ids, 64))


def test_a_missing_shard_fails_the_read_naming_it(s3, one_file, tmp_path) -> None:
    sharded = write_store_as(one_file, tmp_path / "s", shard_tokens=500)
    url = s3.upload(Path(sharded.path), "sharded/missing", skip=(shard_name(3),))
    remote = TokenStore.open(url)  # opening reads no shard
    remote.windows(np.array([0]), 64)  # shard 0: there
    with pytest.raises(StoreError, match=r"tokens/000003\.bin"):
        remote.windows(np.array([1600 // 64]), 64)  # tokens [1600, 1665): shard 3


def test_a_short_shard_fails_the_read_naming_it(s3, one_file, tmp_path) -> None:
    sharded = write_store_as(one_file, tmp_path / "s", shard_tokens=500)
    root = Path(sharded.path)
    path = root / shard_name(2)
    path.write_bytes(path.read_bytes()[:-100])
    remote = TokenStore.open(s3.upload(root, "sharded/short"))
    with pytest.raises(StoreError, match=r"tokens/000002\.bin is shorter than the store says"):
        remote.windows(np.array([1490 // 10]), 10)  # tokens [1490, 1501): shard 2's end
    with pytest.raises(
        StoreError, match=r"tokens/000002\.bin: asked for bytes \[688, 944\), received 212"
    ):
        remote.windows(
            np.array([1400 // 10]), 10
        )  # chunks 21-22: tokens [1344, 1472), a short body
