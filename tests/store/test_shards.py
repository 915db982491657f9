"""A store of many shards (issue 45 part a1): the same tokens as one file or as shards of
any sizes give the same fingerprint, samples, order and data config; a shard missing,
short, of another store or in the wrong place is refused or caught by the checksums."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.packed import PackedSource
from torchtitan_zephon.job.packing import open_packing
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.store.format import TOKENS, StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import SHARDS, ShardedTokens, byte_ranges, shard_name
from torchtitan_zephon.store.writer import write_store_as


@pytest.fixture(scope="module")
def small_chunks(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> TokenStore:
    """The test store with chunks of 256 tokens: many chunks, so shards cut through them."""
    return TokenStore.open(
        copy_store(store_path, tmp_path_factory.mktemp("s") / "store", chunk_tokens=256)
    )


def _sharded(store: TokenStore, shard_tokens: int, where: Path) -> TokenStore:
    return write_store_as(store, where / f"sharded-{shard_tokens}", shard_tokens=shard_tokens)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shard_tokens=st.one_of(st.integers(1, 40), st.integers(41, 7000)),
    seq_len=st.sampled_from([1, 7, 64, 100, 333]),
    data=st.data(),
)
def test_any_shard_sizes_give_the_same_samples_order_and_fingerprint(
    small_chunks: TokenStore, shard_tokens: int, seq_len: int, data
) -> None:
    one = small_chunks
    with tempfile.TemporaryDirectory() as tmp:
        sharded = _sharded(one, shard_tokens, Path(tmp))
        assert sharded.shards == -(-one.num_tokens // shard_tokens)
        assert sharded.fingerprint == one.fingerprint
        assert (Path(sharded.path) / "manifest.json").read_bytes() == (
            Path(one.path) / "manifest.json"
        ).read_bytes()
        n = one.num_samples(seq_len)
        assert sharded.num_samples(seq_len) == n
        ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=70)))
        assert np.array_equal(sharded.windows(ids, seq_len), one.windows(ids, seq_len))
        i = int(ids[0])
        assert np.array_equal(sharded.window(i, seq_len), one.window(i, seq_len))
        # every sample of an epoch, the ones across a shard boundary included
        every = np.arange(n)
        assert np.array_equal(sharded.windows(every, seq_len), one.windows(every, seq_len))
        starts = np.array(
            data.draw(st.lists(st.integers(0, one.num_tokens - seq_len - 1), max_size=20))
        )
        assert np.array_equal(
            sharded.token_rows(starts, seq_len + 1), one.token_rows(starts, seq_len + 1)
        )
        # the job's data config, hence the plan and every digest that names it
        schedule = BatchSchedule.parse("4")
        configs = [
            JobData.of_store(s, seq_len).data_config(seed=3, schedule=schedule)
            for s in (one, sharded)
        ]
        assert configs[0].fingerprint == configs[1].fingerprint
        report = sharded.check()
        assert report.ok, report.problems
        assert report.max_token_id == one.max_token_id


def test_a_sharded_store_written_back_as_one_file_is_the_original(small_chunks, tmp_path):
    sharded = _sharded(small_chunks, 1000, tmp_path)
    back = write_store_as(sharded, tmp_path / "one")
    assert back.shards == 0
    assert (Path(back.path) / TOKENS).read_bytes() == (
        Path(small_chunks.path) / TOKENS
    ).read_bytes()
    assert sorted(p.name for p in Path(back.path).iterdir()) == sorted(
        p.name for p in Path(small_chunks.path).iterdir()
    )


@pytest.mark.parametrize("seq_len", [16, 100])
def test_packed_samples_of_a_sharded_store_are_the_one_files(small_chunks, tmp_path, seq_len):
    sharded = _sharded(small_chunks, 777, tmp_path)
    packed = {}
    for name, s in (("one", small_chunks), ("sharded", sharded)):
        index, _ = open_packing(s, seq_len, cache_dir=str(tmp_path / f"cache-{name}"))
        packed[name] = PackedSource(s, index)
    keys = np.arange(packed["one"].available)
    for a, b in zip(
        packed["one"].rows(keys, seq_len), packed["sharded"].rows(keys, seq_len), strict=True
    ):
        if a is None:
            assert b is None
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b)
        else:
            assert a == b
    assert np.array_equal(
        packed["one"].windows(keys, seq_len), packed["sharded"].windows(keys, seq_len)
    )


def test_a_mixture_of_sharded_stores_reads_as_one_of_one_files(store_path, tmp_path):
    from torchtitan_zephon.store.group import StoreGroup
    from torchtitan_zephon.store.writer import slice_store

    base = TokenStore.open(store_path)
    half = base.num_tokens // 2
    parts = [
        slice_store(base, 0, half, tmp_path / "a"),
        slice_store(base, half, base.num_tokens, tmp_path / "b"),
    ]
    sharded = [_sharded(p, 301, tmp_path / f"s{k}") for k, p in enumerate(parts)]
    sources = np.array([0, 1, 1, 0, 1])
    ids = np.array([0, 3, 1, 2, 0])
    assert np.array_equal(
        StoreGroup(sharded).windows(sources, ids, 32), StoreGroup(parts).windows(sources, ids, 32)
    )


def test_sharded_tokens_read_as_the_concatenation():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, n).astype("<u2") for n in (5, 1, 17, 3)]
    whole = np.concatenate(parts)
    tokens = ShardedTokens(parts)
    assert len(tokens) == whole.size and np.array_equal(np.asarray(tokens), whole)
    for a in range(whole.size + 1):
        for b in range(a, whole.size + 2):
            assert np.array_equal(tokens[a:b], whole[a:b])
    index = rng.integers(0, whole.size, (4, 6))
    assert np.array_equal(tokens[index], whole[index])
    assert tokens[-1] == whole[-1] and tokens[6] == whole[6]
    assert np.array_equal(
        tokens.rows(np.array([0, 4, 20]), 6), np.stack([whole[s : s + 6] for s in (0, 4, 20)])
    )
    bounds = [0, 10, 12, 40]
    assert byte_ranges(bounds, 8, 30) == [(0, 8, 10), (1, 0, 2), (2, 0, 18)]


# ---------------------------------------------------------------- bad shards


def _damaged(small_chunks: TokenStore, tmp_path: Path) -> Path:
    return Path(_sharded(small_chunks, 1000, tmp_path).path)


def test_a_missing_shard_is_refused_naming_it(small_chunks, tmp_path):
    root = _damaged(small_chunks, tmp_path)
    (root / shard_name(2)).unlink()
    with pytest.raises(StoreError, match=r"tokens/000002\.bin' is missing"):
        TokenStore.open(root)


def test_a_truncated_shard_is_refused_naming_it(small_chunks, tmp_path):
    root = _damaged(small_chunks, tmp_path)
    path = root / shard_name(1)
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(StoreError, match=r"tokens/000001\.bin' is truncated: expected 2000 bytes"):
        TokenStore.open(root)


def test_a_shard_list_of_another_store_is_refused(small_chunks, tmp_path):
    root = _damaged(small_chunks, tmp_path)
    info = json.loads((root / SHARDS).read_text())
    info["fingerprint"] = "0" * 64
    (root / SHARDS).write_text(json.dumps(info))
    with pytest.raises(StoreError, match="belongs to another store"):
        TokenStore.open(root)


def test_a_shard_list_that_does_not_add_up_is_refused(small_chunks, tmp_path):
    root = _damaged(small_chunks, tmp_path)
    info = json.loads((root / SHARDS).read_text())
    info["tokens"][0] -= 1
    (root / SHARDS).write_text(json.dumps(info))
    with pytest.raises(StoreError, match=f"lists {small_chunks.num_tokens - 1} tokens"):
        TokenStore.open(root)


def test_tokens_bin_beside_shards_is_refused(small_chunks, tmp_path):
    root = _damaged(small_chunks, tmp_path)
    shutil.copyfile(Path(small_chunks.path) / TOKENS, root / TOKENS)
    with pytest.raises(StoreError, match="holds both tokens.bin and shards.json"):
        TokenStore.open(root)


def test_shards_swapped_fail_at_the_first_read_of_a_moved_chunk(small_chunks, tmp_path):
    root = _damaged(small_chunks, tmp_path)
    a, b = root / shard_name(0), root / shard_name(1)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    store = TokenStore.open(root)  # the sizes agree: opening reads no tokens
    with pytest.raises(StoreError, match="chunk 0 of tokens.bin .* does not match its checksum"):
        store.windows(np.array([0]), 16)
    assert not store.check().ok
