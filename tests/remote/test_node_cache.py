"""The node-local cache of remote stores (store/cache.py, used by store/remote.py)
against a real S3 API on loopback: hits are not fetched, a bad or partial file is never
served, the bound holds, the ranks of a node share it, and another store never reads it."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store, edit_token
from tests.remote.cache_reader import read
from tests.remote.conftest import SECRET, SESSION
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.store.cache import FOLDER, NodeCache
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote import RemoteTokenStore
from torchtitan_zephon.store.remote_options import RemoteOptions
from torchtitan_zephon.store.urls import parse_url

SEQ = 512  # a window is one block and the next block's first token


@pytest.fixture(scope="module")
def blocked(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store (~6k tokens) with block checksums (512 tokens)."""
    path = copy_store(store_path, tmp_path_factory.mktemp("cblocked") / "store")
    add_block_checksums(path)
    return path


@pytest.fixture(scope="module")
def blocked_url(s3, blocked: Path) -> str:
    return s3.upload(blocked, "cache/blocked")


@pytest.fixture(scope="module")
def fine_store(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store with 64-token chunks and no block checksums."""
    return copy_store(store_path, tmp_path_factory.mktemp("cfine") / "store", chunk_tokens=64)


@pytest.fixture(scope="module")
def fine_url(s3, fine_store: Path) -> str:
    return s3.upload(fine_store, "cache/fine")


def _open(url: str, root: Path, limit: int = 1 << 20, **kw) -> RemoteTokenStore:
    options = RemoteOptions(cache_bytes=limit, cache_dir=str(root), **kw)
    return RemoteTokenStore.open_url(parse_url(url), options=options)


def _block_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / FOLDER).rglob("*.bin"))


def test_a_restart_fetches_only_what_is_not_cached(blocked_url, blocked, tmp_path):
    """seq_len 512: sample i is block i (513 tokens, the last the next block's first)."""
    block = 513 * 2 + 8  # a block's tokens and its block checksum
    local = TokenStore.open(blocked)
    first = _open(blocked_url, tmp_path)
    opened = first.fetched_bytes
    ids = np.array([0, 3, 5])
    np.testing.assert_array_equal(first.windows(ids, SEQ), local.windows(ids, SEQ))
    assert first.fetched_bytes - opened == 3 * block
    assert first.cache.hits == 0 and first.cache.written == 3
    first.close()

    again = _open(blocked_url, tmp_path)  # a restart: same cache folder
    opened = again.fetched_bytes
    np.testing.assert_array_equal(again.windows(ids, SEQ), local.windows(ids, SEQ))
    assert again.fetched_bytes == opened  # every block from the cache
    assert again.cache.hits == 3 and again.cache.hit_bytes == 3 * block
    np.testing.assert_array_equal(
        again.windows(np.array([8]), SEQ), local.windows(np.array([8]), SEQ)
    )
    assert again.fetched_bytes - opened == block  # block 8: not cached, fetched alone
    before = again.fetched_bytes
    # seq_len 1024, sample 2 = blocks 4 and 5: only block 4 (not cached) is fetched
    np.testing.assert_array_equal(
        again.windows(np.array([2]), 1024), local.windows(np.array([2]), 1024)
    )
    assert again.fetched_bytes - before == block and again.cache.hits == 4
    before = again.fetched_bytes
    again.read_ahead(ids, SEQ)  # the loader's way: read ahead, then served
    np.testing.assert_array_equal(again.windows(ids, SEQ), local.windows(ids, SEQ))
    assert again.fetched_bytes == before and again.cache.hits == 7
    again.close()


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), seq_len=st.sampled_from([1, 7, 511, 512, 513, 1000]))
def test_cached_windows_equal_local_reads(blocked_url, blocked, tmp_path_factory, data, seq_len):
    """Property: any mix of cached, damaged and fetched blocks, at any seq_len, serves
    the local windows; a second read of the same ids fetches nothing."""
    root = tmp_path_factory.mktemp("prop")
    local = TokenStore.open(blocked)
    remote = _open(blocked_url, root)
    n = local.num_samples(seq_len)
    for _ in range(3):
        ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12)))
        np.testing.assert_array_equal(remote.windows(ids, seq_len), local.windows(ids, seq_len))
        before = remote.fetched_bytes
        np.testing.assert_array_equal(remote.windows(ids, seq_len), local.windows(ids, seq_len))
        assert remote.fetched_bytes == before
        files = _block_files(root)
        for path in files:  # damage some cached files: cut, flipped, emptied, misplaced
            how = data.draw(st.sampled_from(["keep", "keep", "cut", "flip", "empty", "other"]))
            raw = path.read_bytes()
            if not raw:  # damaged before and not read since
                continue
            if how == "other":  # another block's file under this one's name
                path.write_bytes(data.draw(st.sampled_from(files)).read_bytes())
            elif how == "cut":
                path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
            elif how == "flip":
                at = data.draw(st.integers(0, len(raw) - 1))
                path.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :])
            elif how == "empty":
                path.write_bytes(b"")
    remote.close()


def test_chunk_checked_stores_cache_chunks(fine_url, fine_store, tmp_path):
    local = TokenStore.open(fine_store)
    first = _open(fine_url, tmp_path)
    ids = np.array([1, 9])
    np.testing.assert_array_equal(first.windows(ids, 100), local.windows(ids, 100))
    assert all("chunks-64" in str(p) for p in _block_files(tmp_path))
    first.close()
    again = _open(fine_url, tmp_path)
    opened = again.fetched_bytes
    np.testing.assert_array_equal(again.windows(ids, 100), local.windows(ids, 100))
    assert again.fetched_bytes == opened and again.cache.hits == len(_block_files(tmp_path))
    again.close()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_bad_cache_file_is_refetched_never_served(blocked_url, blocked, tmp_path, damage):
    local = TokenStore.open(blocked)
    ids = np.array([2, 3])
    first = _open(blocked_url, tmp_path)
    first.windows(ids, SEQ)
    first.close()
    files = _block_files(tmp_path)
    assert len(files) == 2
    bad = files[0]
    data = bad.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(bytes(b ^ 0x5A for b in data))  # same size, other bytes
    else:
        bad.write_bytes(b"")
    again = _open(blocked_url, tmp_path)
    opened = again.fetched_bytes
    np.testing.assert_array_equal(again.windows(ids, SEQ), local.windows(ids, SEQ))
    assert again.fetched_bytes - opened == 513 * 2 + 8  # the bad block, fetched again
    assert again.cache.discarded == 1 and again.cache.hits == 1
    assert bad.read_bytes() == data  # and cached again, whole
    again.close()


@pytest.mark.parametrize("kind", ["blocks", "chunks"])
def test_a_file_under_another_blocks_name_is_refetched_never_served(
    blocked_url, blocked, fine_url, fine_store, tmp_path, kind
):
    """0.bin copied over 1.bin (a whole, well-formed file of the same size, checked
    good as block 0): read as block 1 it fails its check, is discarded and fetched."""
    url, path, seq = (blocked_url, blocked, SEQ) if kind == "blocks" else (fine_url, fine_store, 63)
    local = TokenStore.open(path)
    ids = np.array([0, 1, 2])
    first = _open(url, tmp_path)
    first.windows(ids, seq)
    first.close()
    zero, one = first.cache.path(0), first.cache.path(1)
    assert zero.stat().st_size == one.stat().st_size
    block = one.stat().st_size
    one.write_bytes(zero.read_bytes())
    again = _open(url, tmp_path)
    opened = again.fetched_bytes
    np.testing.assert_array_equal(again.windows(ids, seq), local.windows(ids, seq))
    assert again.cache.discarded == 1 and again.cache.hits == len(_block_files(tmp_path)) - 1
    assert again.fetched_bytes - opened == block  # block 1 alone, fetched again
    assert one.read_bytes() != zero.read_bytes()  # and cached again as itself
    again.close()


def test_a_leftover_temporary_file_is_never_used(blocked_url, blocked, tmp_path):
    """A crash mid-write leaves a temporary file (never under the final name): readers
    do not see it, the block is fetched, and the next writer removes it."""
    local = TokenStore.open(blocked)
    remote = _open(blocked_url, tmp_path)
    final = remote.cache.path(4)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-12345-deadbeef")
    tmp.write_bytes(b"\0" * (513 * 2 + 8))  # what a killed writer left
    opened = remote.fetched_bytes
    np.testing.assert_array_equal(
        remote.windows(np.array([4]), SEQ), local.windows(np.array([4]), SEQ)
    )
    assert remote.fetched_bytes - opened == 513 * 2 + 8 and remote.cache.hits == 0
    assert final.read_bytes()[:-8] == local.windows(np.array([4]), SEQ).tobytes()
    assert not tmp.exists()  # removed by the writer (the first write lists the folder)
    tmp.write_bytes(b"\0" * 10)  # another leftover, beside a cached block
    again = _open(blocked_url, tmp_path)
    np.testing.assert_array_equal(
        again.windows(np.array([4]), SEQ), local.windows(np.array([4]), SEQ)
    )
    assert again.cache.hits == 1 and tmp.exists()  # readers ignore it
    again.cache._evict(1 << 30)  # the next writer's listing removes it
    assert not tmp.exists() and final.exists()
    remote.close()
    again.close()


def test_eviction_keeps_the_cache_under_its_bound(blocked_url, blocked, tmp_path):
    """Each block file is 513 * 2 + 8 bytes; a bound of 5 files' worth holds at most 5,
    the least recently used going first."""
    block = 513 * 2 + 8
    limit = 5 * block + 100
    local = TokenStore.open(blocked)
    remote = _open(blocked_url, tmp_path, limit=limit)
    n = local.num_samples(SEQ)
    for i in range(n):
        np.testing.assert_array_equal(
            remote.windows(np.array([i]), SEQ), local.windows(np.array([i]), SEQ)
        )
        assert remote.cache.total_bytes() <= limit
    assert remote.cache.written > 5
    kept = {int(p.stem) for p in _block_files(tmp_path)}
    assert n - 1 in kept and len(kept) <= 5  # the last block read is the most recent
    remote.close()


@settings(max_examples=30, deadline=None)
@given(
    limit=st.integers(1, 20_000),
    puts=st.lists(
        st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3000)), min_size=1, max_size=6),
        min_size=1,
        max_size=12,
    ),
)
def test_the_bound_holds_for_any_writes(tmp_path_factory, limit, puts):
    """Property: after every put, the files under remote-blocks total at most the bound
    (two stores' caches in one folder share it), and every file holds what was put."""
    root = tmp_path_factory.mktemp("bound")
    caches = [NodeCache(root, f, "blocks-512", limit) for f in ("aa" * 32, "bb" * 32)]
    for k, batch in enumerate(puts):
        cache = caches[k % 2]
        cache.put_many((u, bytes([u % 251]) * size) for u, size in batch)
        assert cache.total_bytes() <= limit
        for u, _ in batch:
            got = cache.get(u)
            assert got is None or set(got) <= {u % 251}


def _new_version(store: Path, dst: Path) -> Path:
    """Another version of ``store`` (one token changed, checksums redone, as a new
    prepare would make it): another fingerprint."""
    edited = copy_store(store, dst.with_name(dst.name + "-edit"))
    for name in ("blocks.bin", "blocks.json"):
        (edited / name).unlink()
    edit_token(edited, 100)
    chunk = TokenStore.open(store).chunk_tokens
    out = copy_store(edited, dst, chunk_tokens=chunk)
    add_block_checksums(out)
    return out


def test_two_processes_share_the_cache(s3, blocked_url, blocked, tmp_path):
    """Two processes of a node read the same blocks at once through one cache folder:
    both get the local bytes; a third, after them, fetches nothing but the opening."""
    local = TokenStore.open(blocked)
    ids = list(range(local.num_samples(SEQ)))
    ctx = multiprocessing.get_context("spawn")  # fork: obstore's runtime does not survive it
    out = ctx.Queue()
    procs = [
        ctx.Process(target=read, args=(blocked_url, str(tmp_path), ids, SEQ, s3.endpoint, out))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    want = local.windows(np.array(ids), SEQ).tobytes()
    assert all(r[0] == want for r in results)
    third = _open(blocked_url, tmp_path)
    opened = third.fetched_bytes
    assert third.windows(np.array(ids), SEQ).tobytes() == want
    assert third.fetched_bytes == opened and third.cache.misses == 0
    third.close()


def test_a_replaced_store_under_the_same_prefix_is_not_served_from_the_cache(s3, blocked, tmp_path):
    """Another store uploaded where a cached one was has another fingerprint: its
    blocks come from the bucket, and its windows are its own."""
    url = s3.upload(blocked, "cache/replaced")
    ids = np.array([0, 1])
    first = _open(url, tmp_path / "cache")
    first.windows(ids, SEQ)
    first.close()
    replaced = _new_version(blocked, tmp_path / "new")
    s3.upload(replaced, "cache/replaced")
    again = _open(url, tmp_path / "cache")
    assert again.fingerprint != TokenStore.open(blocked).fingerprint
    opened = again.fetched_bytes
    np.testing.assert_array_equal(
        again.windows(ids, SEQ), TokenStore.open(replaced).windows(ids, SEQ)
    )
    assert again.fetched_bytes > opened and again.cache.hits == 0
    again.close()


def test_a_token_object_replaced_under_an_unchanged_manifest(s3, blocked, tmp_path):
    """Same fingerprint, tokens.bin changed in the bucket: the blocks cached before the
    change (checked when fetched) are the store's own bytes and are served; a block not
    cached fails its check as it would without a cache."""
    url = s3.upload(blocked, "cache/edited")
    first = _open(url, tmp_path)
    first.windows(np.array([0]), SEQ)  # blocks 0, 1 cached
    first.close()
    bad = copy_store(blocked, tmp_path / "bad")
    edit_token(bad, 100)  # block 0
    edit_token(bad, 512 * 6 + 3)  # block 6
    s3.put("cache/edited/tokens.bin", (bad / "tokens.bin").read_bytes())
    again = _open(url, tmp_path)
    local = TokenStore.open(blocked)
    np.testing.assert_array_equal(
        again.windows(np.array([0]), SEQ), local.windows(np.array([0]), SEQ)
    )
    with pytest.raises(StoreError, match="block 6 of tokens.bin"):
        again.windows(np.array([6]), SEQ)
    again.close()


def test_cache_files_hold_no_credentials(blocked_url, tmp_path):
    remote = _open(blocked_url, tmp_path)
    remote.windows(np.arange(4), SEQ)
    remote.close()
    files = [p for p in (tmp_path / FOLDER).rglob("*") if p.is_file()]
    assert files
    for p in files:
        data = p.read_bytes()
        assert SECRET.encode() not in data and SESSION.encode() not in data, p
        assert SECRET not in str(p) and SESSION not in str(p)


def test_the_job_settings_put_the_cache_under_the_store_cache(monkeypatch, tmp_path):
    """zephon.cache_bytes > 0: the node cache lives under $ZEPHON_CACHE, else
    zephon.cache_dir (the store cache of raw inputs); 0: no cache folder at all."""
    from types import SimpleNamespace

    from torchtitan_zephon.job.settings import remote_options
    from torchtitan_zephon.titan.settings.zephon_section import Zephon

    def job(**kw):
        return SimpleNamespace(zephon=Zephon(**kw))

    monkeypatch.delenv("ZEPHON_CACHE", raising=False)
    assert Zephon().cache_bytes == 0 and remote_options(job()).cache_bytes == 0
    assert remote_options(job()).cache_dir == ""
    options = remote_options(job(cache_bytes=123, cache_dir=str(tmp_path / "c")))
    assert (options.cache_bytes, options.cache_dir) == (123, str(tmp_path / "c"))
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "env"))
    assert remote_options(job(cache_bytes=1, cache_dir="elsewhere")).cache_dir == str(
        tmp_path / "env"
    )
    assert not (tmp_path / "env").exists()  # made when a remote store opens, not before


def test_a_bound_below_one_block_warns_that_the_cache_holds_nothing(blocked_url, tmp_path):
    """cache_bytes smaller than one cached block (a 513-token block and its sum) is a
    cache that can never hold anything: said once at open, naming the setting."""
    with pytest.warns(UserWarning, match=r"zephon.cache_bytes = 1 is smaller than one cached"):
        _open(blocked_url, tmp_path / "tiny", limit=1).close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _open(blocked_url, tmp_path / "enough", limit=1 << 20).close()
