"""The virtual corpus of ``zephon bench corpus`` (bench/virtual_corpus.py) is a real store:
small enough to write, it is byte for byte what Zephon's writers write for its tokens
and documents; at 10^10 documents, a reader opens it through the loopback S3 API
(bench/object_server.py) and reads the tokens and packed samples it defines."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_zephon.bench.bucket import bucket_env
from torchtitan_zephon.bench.object_server import Folder, ObjectServer
from torchtitan_zephon.bench.virtual_corpus import LARGE, NOT_COMPUTED, TOKENIZER, VirtualCorpus
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.packing import build_beside, open_packing
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.order.packing import CHUNK_DOCUMENTS, pack
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_derived_store, write_store_as

pytest.importorskip("obstore")


def written_by_zephon(corpus: VirtualCorpus, root: Path) -> Path:
    """The store of ``corpus``'s tokens and documents as Zephon writes it: the store, its
    block checksums, cut into shards, each packing index kept beside it."""
    one = root / "one"
    one.mkdir()
    like = types.SimpleNamespace(manifest=TOKENIZER, dtype=np.dtype("<u4"))
    tokens = corpus.tokens(0, corpus.num_tokens)
    offsets = corpus.offsets(0, corpus.num_documents)
    write_derived_store(one, like, tokens.tobytes(), offsets, {"name": corpus.describe(), "kind": "bench"})  # fmt: skip
    add_block_checksums(one, corpus.block_tokens)
    out = write_store_as(TokenStore.open(one), root / "sharded", shard_tokens=corpus.shard_tokens)
    for seq_len in corpus.pack_seq_lens:
        build_beside(out, seq_len)
    return root / "sharded"


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    chunks=st.integers(1, 2),
    mean_tokens=st.integers(2, 12),
    block_tokens=st.sampled_from([1, 7, 64, 512]),
    shard_bytes=st.sampled_from([1 << 16, 1 << 20, 1 << 30]),
    pack_seq_lens=st.sampled_from([(), (16,), (64, 5)]),
    reads=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 5000)), min_size=1, max_size=6),
)
def test_small_it_is_byte_for_byte_what_zephon_writes(
    tmp_path_factory, chunks, mean_tokens, block_tokens, shard_bytes, pack_seq_lens, reads
):
    corpus = VirtualCorpus(
        chunks, mean_tokens=mean_tokens, block_tokens=block_tokens, shard_bytes=shard_bytes,
        pack_seq_lens=pack_seq_lens, computed=True,
    )  # fmt: skip
    real = written_by_zephon(corpus, tmp_path_factory.mktemp("store"))
    files = sorted(p.relative_to(real).as_posix() for p in real.rglob("*") if p.is_file())
    assert files == sorted(corpus.names())
    for name in files:
        data = (real / name).read_bytes()
        assert corpus.size(name) == len(data)
        assert corpus.read(name, 0, len(data)) == data, name
        for at, length in reads:  # any range, as a server answers one
            a = int(at * len(data))
            assert corpus.read(name, a, a + length) == data[a : a + length], (name, a, length)
    assert TokenStore.open(real).fingerprint == corpus.fingerprint


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The bench's virtual corpus (packed at seq_len 64) and a small written one, on one
    loopback S3 API."""
    large = VirtualCorpus(LARGE, pack_seq_lens=(64,))
    small = VirtualCorpus(2, mean_tokens=6, pack_seq_lens=(64,), computed=True)
    real = written_by_zephon(small, tmp_path_factory.mktemp("real"))
    server = ObjectServer({"virtual": large, "real": Folder(real)})
    yield server, large, small
    server.close()


@pytest.fixture
def on_server(served, monkeypatch):
    server = served[0]
    for k, v in bucket_env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    return served


def test_a_reader_opens_ten_billion_documents_and_reads_their_tokens(on_server):
    server, large, _ = on_server
    store = TokenStore.open(server.url("virtual"))
    try:
        assert (store.num_documents, store.num_tokens) == (large.num_documents, large.num_tokens)
        assert store.num_documents == LARGE * CHUNK_DOCUMENTS > 10**10
        assert store.shards == len(large.counts) and store.blocks is not None
        seq_len = 4096
        last = (store.num_tokens - 1) // seq_len - 1
        across = large.shard_tokens // seq_len  # the sample that starts the second shard's
        ids = np.array([0, 1, across - 1, across, 10**9, last], dtype=np.int64)
        want = np.stack([large.tokens(i * seq_len, i * seq_len + seq_len + 1) for i in ids])
        assert np.array_equal(store.windows(ids, seq_len), want)  # checked against blocks
        assert store.fetched_bytes < 2 << 20  # what was read, not the corpus
        eos = large.period_ends[:3]  # the first documents end with EOS
        assert (large.tokens(0, int(eos[-1]) + 1)[eos] == TOKENIZER["eos_id"]).all()
    finally:
        store.close()


def test_its_packed_samples_are_the_ones_packing_makes(on_server):
    server, large, _ = on_server
    store = TokenStore.open(server.url("virtual"))
    try:
        packed, where = open_packing(store, 64)
        assert str(where).endswith("/packing/best_fit-L64-v1")
        period = pack(np.tile(large.lengths, 2), 64)  # two chunks packed as packing packs
        per = period.num_samples // 2
        assert packed.num_samples == LARGE * per
        for i in (0, per - 1, per, 2 * per - 1):
            assert np.array_equal(packed.sample(i), period.sample(i))
        far = (LARGE - 1) * per + 5  # the last chunk: chunk 0's samples, shifted
        shifted = period.sample(5).copy()
        shifted[:, 0] += (LARGE - 1) * CHUNK_DOCUMENTS
        assert np.array_equal(packed.sample(far), shifted)
        data = JobData.of_store(store, 64, packed=packed)
        rows, _ = data.rows(np.array([far]), 64)
        doc, start, length = shifted[0]
        begin = int(large.offsets(doc, doc + 1)[0]) + int(start)
        assert np.array_equal(rows[0, :length], large.tokens(begin, begin + length))
    finally:
        store.close()


def test_a_store_written_to_disk_is_served_as_it_is_and_a_missing_one_is_refused(on_server):
    server, _, small = on_server
    store = TokenStore.open(server.url("real"))
    try:
        assert store.fingerprint == small.fingerprint
        ids = np.arange(0, store.num_tokens // 65 - 1, 997, dtype=np.int64)
        want = np.stack([small.tokens(i * 64, i * 64 + 65) for i in ids])
        assert np.array_equal(store.windows(ids, 64), want)
    finally:
        store.close()
    assert small.manifest["content"]["checksums_xxh3_128"] != NOT_COMPUTED
    missing = server.url("nothing-here")
    with pytest.raises(StoreError, match="holds no token store"):
        TokenStore.open(missing)
