"""Packing a store in object storage (issue 31 part a3; job/packed_remote.py, the
remote path of job/packed.py and job/packing.py) against a real S3 API on loopback:
the index built from the fetched document offsets is the local store's, packed rows
read by range equal the local ones (chunk and block checksums, with and without the
node cache), a step read ahead is served without a request, the loader's batches on a
bucket are the local batches at any layout and across a resume, and bad document
offsets are refused before anything is packed; a mixture with a source in a bucket
packs as on local disk."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store
from tests.test_packed_data import dense
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.job.packed import PackedSource
from torchtitan_zephon.job.packing import index_folder, open_packing
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote import SPAN_GAP_BYTES, RemoteTokenStore
from torchtitan_zephon.store.remote_options import RemoteOptions
from torchtitan_zephon.store.urls import parse_url

SEQ_LENS = (16, 64, 100)


@pytest.fixture(scope="module")
def fine_store(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store with 64-token checksum chunks (many chunks, small reads)."""
    return copy_store(store_path, tmp_path_factory.mktemp("pfine") / "store", chunk_tokens=64)


@pytest.fixture(scope="module")
def blocked_store(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store with block checksums (512 tokens)."""
    path = copy_store(store_path, tmp_path_factory.mktemp("pblocked") / "store")
    add_block_checksums(path)
    return path


@pytest.fixture(scope="module")
def urls(s3, fine_store: Path, blocked_store: Path) -> dict[str, str]:
    return {
        "fine": s3.upload(fine_store, "packed/fine"),
        "blocked": s3.upload(blocked_store, "packed/blocked"),
    }


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A cache folder for the local stores' indexes and one for the remote stores' (the
    same fingerprint: one folder would share an index between them)."""
    return {k: str(tmp_path_factory.mktemp(f"index-{k}")) for k in ("local", "remote")}


_OPEN: dict[tuple, PackedSource] = {}


def _packed(source, seq_len: int, cache: str, node_cache: str | None = None) -> PackedSource:
    """PackedSource of a store (a local path or a URL; ``node_cache``: with a node cache
    in that folder), its index in ``cache``; kept for the module (fetches are counted)."""
    key = (str(source), seq_len, cache, node_cache)
    if key not in _OPEN:
        if isinstance(source, Path):
            store = TokenStore.open(source)
        elif node_cache is None:
            store = TokenStore.open(source)
        else:
            options = RemoteOptions(cache_bytes=1 << 20, cache_dir=node_cache)
            store = RemoteTokenStore.open_url(parse_url(source), options=options)
        _OPEN[key] = PackedSource(store, open_packing(store, seq_len, cache_dir=cache)[0])
    return _OPEN[key]


def test_the_index_of_a_bucket_is_the_local_one(urls, fine_store, caches) -> None:
    """Built from the fetched document offsets into the (node) cache, byte for byte the
    local store's index, under the same fingerprint; opening it again builds nothing."""
    for seq_len in SEQ_LENS:
        local = TokenStore.open(fine_store)
        remote = TokenStore.open(urls["fine"])
        a, folder_a = open_packing(local, seq_len, cache_dir=caches["local"])
        b, folder_b = open_packing(remote, seq_len, cache_dir=caches["remote"])
        assert folder_a.relative_to(caches["local"]) == folder_b.relative_to(caches["remote"])
        assert folder_b == index_folder(remote, seq_len, caches["remote"])
        for name in ("starts.npy", "pieces.npy", "manifest.json"):
            assert (folder_a / name).read_bytes() == (folder_b / name).read_bytes()
        assert np.array_equal(a.starts, b.starts) and np.array_equal(a.pieces, b.pieces)
        again = TokenStore.open(urls["fine"])
        opened = again.fetched_bytes
        open_packing(again, seq_len, cache_dir=caches["remote"])
        # the index is read from the cache: nothing of the store is fetched (issue 45
        # part c: the packed source reads the document offsets it needs by page; before,
        # opening fetched them whole, 8 bytes a document)
        assert again.fetched_bytes - opened == 0


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["fine", "blocked", "blocked+cache"]),
    seq_len=st.sampled_from(SEQ_LENS),
    data=st.data(),
)
def test_packed_rows_from_a_bucket_equal_the_local_ones(
    urls, fine_store, blocked_store, caches, tmp_path_factory, kind, seq_len, data
) -> None:
    """Rows, the inputs that train no label, and the loader's one-pass rows: the same
    from a bucket (by range, checked) as from local disk, for any packed samples."""
    local_path = fine_store if kind == "fine" else blocked_store
    node_cache = str(tmp_path_factory.getbasetemp() / "node-cache") if "cache" in kind else None
    local = _packed(local_path, seq_len, caches["local"])
    remote = _packed(urls[kind.split("+")[0]], seq_len, caches["remote"], node_cache)
    assert not remote.store.mapped
    n = local.packed.num_samples
    keys = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=24)))
    rows, ignored = local.windows(keys, seq_len), local.ignored(keys, seq_len)
    assert np.array_equal(remote.windows(keys, seq_len), rows)
    assert np.array_equal(remote.ignored(keys, seq_len), ignored)
    got, unlabelled = remote.rows(keys, seq_len)
    assert np.array_equal(got, rows) and np.array_equal(dense(unlabelled, keys, seq_len), ignored)
    assert remote.labelled_tokens(keys) == local.labelled_tokens(keys)


def test_a_step_read_ahead_is_served_without_a_request(urls, fine_store, caches) -> None:
    """The pieces of a step announced ahead are fetched in the background, each checked
    chunk once; reading them makes no request, and their bytes are freed once served."""
    seq_len = 64
    local = _packed(fine_store, seq_len, caches["local"])
    store = TokenStore.open(urls["fine"])
    remote = PackedSource(store, open_packing(store, seq_len, cache_dir=caches["remote"])[0])
    assert remote.read_ahead_steps() == store.read_ahead_steps > 0
    assert local.read_ahead_steps() == 0
    steps = [np.array([5, 1, 30]), np.array([2, 31, 9, 17])]
    for keys in steps:
        remote.read_ahead(keys, seq_len)
    remote._remote.wait_for(np.concatenate(steps))  # announced from a thread of its own
    deadline = time.time() + 20
    while not all(s.future.done() for s in remote._remote._steps):
        assert time.time() < deadline
        time.sleep(0.01)
    held = remote._remote.held_bytes
    assert held > 0
    before, requests = store.fetched_bytes, store.requests
    for keys in steps:
        rows, unlabelled = remote.rows(keys, seq_len)
        want, _ = local.rows(keys, seq_len)
        assert np.array_equal(rows, want)
    assert (store.fetched_bytes, store.requests) == (before, requests)
    assert remote._remote.held_bytes == 0 and not remote._remote._steps
    # a step not announced is fetched when read; one dropped is forgotten
    remote.read_ahead(np.array([3, 4]), seq_len)
    remote.drop_read_ahead()
    assert remote._remote.held_bytes == 0
    assert np.array_equal(remote.windows(np.array([3, 4]), seq_len), local.windows([3, 4], seq_len))
    assert store.requests > requests


@pytest.mark.parametrize("d,b,workers", [(1, 4, 0), (2, 2, 1), (3, 1, 2)])
def test_the_loader_on_a_bucket_gives_the_local_batches_across_a_resume(
    urls, blocked_store, caches, d, b, workers
) -> None:
    """Every rank's micro-batches of 8 steps from a bucket (read ahead, by range) equal
    those from local disk; a loader resumed at step 5 continues with the same ones."""
    seq_len, gbs = 16, 12
    local = _packed(blocked_store, seq_len, caches["local"])
    store = TokenStore.open(urls["blocked"])
    remote = PackedSource(store, open_packing(store, seq_len, cache_dir=caches["remote"])[0])

    def loader(data, r):
        return ZephonLoader(
            JobData([data], seq_len), seq_len=seq_len, seed=3, schedule=BatchSchedule([(1, gbs)]), dp_rank=r,
            dp_degree=d, local_batch_size=b, num_workers=workers,
        )  # fmt: skip

    accum = gbs // (d * b)
    for r in range(d):
        with loader(local, r) as want, loader(remote, r) as got:
            assert got.read_ahead_steps > 0
            for _ in range(4 * accum):
                (x, y), (fx, fy) = next(got), next(want)
                assert torch.equal(x["input"], fx["input"]) and torch.equal(y, fy)
            state = want.data_state()
            assert state.next_step == 5
        with loader(local, r) as want, loader(remote, r) as got:
            got.load_state_dict(DataState.from_dict(json.loads(json.dumps(state.to_dict()))))
            want.load_state_dict(state)
            for _ in range(4 * accum):
                (x, y), (fx, fy) = next(got), next(want)
                assert torch.equal(x["input"], fx["input"]) and torch.equal(y, fy)


def test_document_offsets_that_do_not_match_the_manifest_are_refused(
    s3, fine_store, tmp_path
) -> None:
    """A store whose doc_offsets.bin was changed after preparation (same size: opening
    accepts it) is not packed, from a bucket or from local disk; nothing is left in the
    cache."""
    bad = copy_store(fine_store, tmp_path / "bad")
    offsets = np.fromfile(bad / "doc_offsets.bin", dtype="<i8")
    offsets[3] += 1
    offsets.tofile(bad / "doc_offsets.bin")
    url = s3.upload(bad, "packed/bad-offsets")
    for source in (url, bad):
        store = TokenStore.open(source)
        cache = tmp_path / f"cache-{isinstance(source, Path)}"
        with pytest.raises(StoreError, match="doc_offsets.bin of the store .* does not match"):
            open_packing(store, 16, cache_dir=str(cache))
        assert not index_folder(store, 16, str(cache)).exists()


def test_a_mixture_with_a_source_in_a_bucket_packs_as_on_local_disk(
    urls, fine_store, blocked_store, caches
) -> None:
    """A packed mixture whose source ``web`` is in the bucket: every rank's batches equal
    those of the same mixture on local disk; the bucket source reads its pieces ahead
    (never windows: the store's own read-ahead of windows stays empty)."""
    seq_len, d, b = 16, 2, 2

    def mixture(web: str) -> JobData:
        text = (
            f'[[source]]\nname = "code"\nstore = "{fine_store}"\n'
            f'[[source]]\nname = "web"\nstore = "{web}"\n'
            "[[schedule]]\nfrom_step = 1\nweights = { web = 0.6, code = 0.4 }\n"
        )
        return JobData.open_mixture(
            MixtureConfig.loads(text),
            seq_len,
            packing="best_fit",
            default_heldout=2,
            cache_dir=caches["remote"],
        )

    local, remote = mixture(str(blocked_store)), mixture(urls["blocked"])
    bucket = remote.stores[remote.names.index("web")]
    web = remote.sources[remote.names.index("web")]
    assert not bucket.mapped and remote.read_ahead_steps() == bucket.read_ahead_steps > 0
    for r in range(d):
        loaders = [
            ZephonLoader(
                data,
                seq_len=seq_len,
                seed=3,
                schedule=BatchSchedule([(1, 8)]),
                dp_rank=r,
                dp_degree=d,
                local_batch_size=b,
                num_workers=1,
            )  # fmt: skip
            for data in (local, remote)
        ]
        with loaders[0] as want, loaders[1] as got:
            for _ in range(12):
                (x, y), (fx, fy) = next(got), next(want)
                assert torch.equal(x["input"], fx["input"]) and torch.equal(y, fy)
                assert not bucket._steps and not bucket._queued  # no window read ahead
            assert web._remote.held_bytes > 0  # the pieces of the steps ahead, fetched


def test_a_kept_index_in_the_bucket_is_read_by_page_and_nothing_is_built(s3, store_path, tmp_path):
    """Issue 45 part c: the packing index kept with the store, uploaded with it: a node
    opening the store in the bucket reads the index and the document offsets by page,
    only what its samples need, and builds nothing in its cache."""
    from torchtitan_zephon.job.packing import build_beside
    from torchtitan_zephon.store.paged import PAGE_BYTES
    from torchtitan_zephon.store.writer import write_store_as

    local = write_store_as(TokenStore.open(store_path), tmp_path / "kept")
    build_beside(local, 64)
    url = s3.upload(Path(local.path), "kept/store")
    remote = TokenStore.open(url)
    cache = tmp_path / "cache"
    packed, where = open_packing(remote, 64, cache_dir=str(cache))
    assert where == f"{url}/packing/best_fit-L64-v1" and not cache.exists()
    want, _ = open_packing(local, 64)
    source, reference = PackedSource(remote, packed), PackedSource(local, want)
    keys = np.array([3, 0, 7, want.num_samples - 1])
    for a, b in zip(source.rows(keys, 64), reference.rows(keys, 64), strict=True):
        assert (a is None and b is None) or np.array_equal(
            np.asarray(a, dtype=object), np.asarray(b, dtype=object)
        )
    assert np.array_equal(source.windows(keys, 64), reference.windows(keys, 64))
    assert source.documents(3) == reference.documents(3)
    assert remote._doc_offsets is None  # never fetched whole: read by page
    assert packed.starts.size == want.starts.size and len(packed.pieces._pages) <= 8
    assert remote.fetched_bytes < 64 * PAGE_BYTES  # the pages looked up, not the files


def test_prepare_into_a_bucket_keeps_the_index_there(
    s3, corpus_dir, tokenizer_dir, tmp_path, capsys, monkeypatch
):
    from torchtitan_zephon.cli.main import main

    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    url = f"s3://{s3.bucket}/kept/prepared"
    code = main(["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output", url,
                 "--quiet", "--workers", "1", "--pack-seq-len", "32"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and f"index kept in {url}/packing/best_fit-L32-v1" in out
    remote = TokenStore.open(url)
    packed, where = open_packing(remote, 32, cache_dir=str(tmp_path / "node"))
    assert where.startswith(url) and not (tmp_path / "node").exists()
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # staging removed


@pytest.fixture(scope="module")
def kept(s3, store_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """The shared store with its packing index at seq_len 64 kept beside it (spans
    included), local and uploaded; (URL, local store)."""
    from torchtitan_zephon.job.packing import build_beside
    from torchtitan_zephon.store.writer import write_store_as

    local = write_store_as(TokenStore.open(store_path), tmp_path_factory.mktemp("spans") / "s")
    build_beside(local, 64)
    return s3.upload(Path(local.path), "spans/store"), local


def test_kept_spans_are_each_pieces_tokens_and_their_checksum(kept) -> None:
    """job.packing.piece_spans: per piece, its first token (x2, +1 when it reads the
    next token too) and the xxh3-64 of exactly what it reads, seeded by the store."""
    import xxhash

    from torchtitan_zephon.store.format import block_seed

    _, local = kept
    packed, _ = open_packing(local, 64)
    spans = np.asarray(packed.spans)
    pieces = np.asarray(packed.pieces)
    offsets = np.asarray(local.doc_offsets, dtype=np.int64)
    lengths = np.diff(np.append(offsets, local.num_tokens))
    assert spans.shape == (packed.num_pieces, 3)
    assert np.array_equal(spans[:, 1], pieces[:, 2])
    begin, extra = spans[:, 0] >> 1, spans[:, 0] & 1
    assert np.array_equal(begin, offsets[pieces[:, 0]] + pieces[:, 1])
    assert np.array_equal(extra == 0, pieces[:, 1] + pieces[:, 2] == lengths[pieces[:, 0]])
    tokens, seed = np.asarray(local.tokens), block_seed(local.fingerprint)
    for k in range(0, packed.num_pieces, 97):  # a sample of them: each hashed again
        b, t = int(begin[k]), int(pieces[k, 2] + extra[k])
        assert int(spans[k, 2]) & (2**64 - 1) == xxhash.xxh3_64_intdigest(tokens[b : b + t], seed)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_bucket_reads_each_piece_exactly_by_its_kept_span(kept, data) -> None:
    """Issue 45 part c: with the spans kept with the index, packed rows from the bucket
    equal the local ones for any samples, the tokens fetched are the pieces' and the
    gaps under SPAN_GAP_BYTES between them (no block rounding), and no document offset
    is looked up."""
    url, local = kept
    remote = TokenStore.open(url)
    try:
        packed, _ = open_packing(remote, 64)
        want, _ = open_packing(local, 64)
        source, reference = PackedSource(remote, packed), PackedSource(local, want)
        assert source._kept_spans is not None
        n = want.num_samples
        keys = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12)))
        before = remote.fetched_bytes
        got, unlabelled = source.rows(keys, 64)
        rows, expected_unlabelled = reference.rows(keys, 64)
        assert np.array_equal(got, rows)
        want_mask = reference.ignored(keys, 64)
        assert np.array_equal(_unlabelled_mask(unlabelled, keys.size, 64), want_mask)
        assert np.array_equal(_unlabelled_mask(expected_unlabelled, keys.size, 64), want_mask)
        # What was fetched: the index rows of these samples and their pieces' tokens.
        starts, pieces, spans = (np.asarray(a) for a in (want.starts, want.pieces, want.spans))
        first = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in np.unique(keys)])
        take = pieces[first, 2] + (spans[first, 0] & 1)
        runs: list[list[int]] = []  # one request per run: ranges closer than the gap join
        gap = SPAN_GAP_BYTES // 2
        for b, t in sorted(zip((spans[first, 0] >> 1).tolist(), take.tolist(), strict=True)):
            if runs and b <= runs[-1][1] + gap:
                runs[-1][1] = max(runs[-1][1], b + t)
            else:
                runs.append([b, b + t])
        index = 8 * np.unique(np.concatenate([keys, keys + 1])).size + 24 * first.size
        assert remote.fetched_bytes - before == 2 * sum(b - a for a, b in runs) + index
        assert not source._doc_offsets._pages  # no document offset looked up
    finally:
        remote.close()


def test_a_piece_that_does_not_match_its_kept_checksum_is_refused(kept, s3, tmp_path) -> None:
    """A span checksum that the tokens in the bucket do not match (an object changed or
    corrupted after preparation) fails the read that needs it, naming the tokens."""
    import shutil

    from torchtitan_zephon.job.packing import SPANS

    _, local = kept
    copy = tmp_path / "bad"
    shutil.copytree(local.path, copy)
    spans_file = copy / "packing" / "best_fit-L64-v1" / SPANS
    spans = np.load(spans_file)
    spans[5, 2] ^= 1
    np.save(spans_file, spans)
    remote = TokenStore.open(s3.upload(copy, "spans/bad"))
    try:
        packed, _ = open_packing(remote, 64)
        key = int(np.searchsorted(np.asarray(packed.starts), 5, side="right") - 1)
        with pytest.raises(StoreError, match=r"do not match their checksum in the packing index"):
            PackedSource(remote, packed).windows(np.array([key]), 64)
    finally:
        remote.close()


def test_an_index_kept_without_spans_is_read_through_the_document_offsets(
    kept, s3, tmp_path
) -> None:
    """An index kept by an earlier version (no spans.npy) reads as before: through the
    document offsets, rounded out to the store's checksummed chunks."""
    import shutil

    from torchtitan_zephon.job.packing import SPANS

    _, local = kept
    copy = tmp_path / "older"
    shutil.copytree(local.path, copy)
    folder = copy / "packing" / "best_fit-L64-v1"
    (folder / SPANS).unlink()
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["spans_xxh3_128"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    remote = TokenStore.open(s3.upload(copy, "spans/older"))
    try:
        packed, _ = open_packing(remote, 64)
        assert packed.spans is None
        source, reference = (
            PackedSource(remote, packed),
            PackedSource(local, open_packing(local, 64)[0]),
        )
        keys = np.array([2, 9, 0])
        assert np.array_equal(source.windows(keys, 64), reference.windows(keys, 64))
        assert source._doc_offsets._pages  # looked up
    finally:
        remote.close()


def _unlabelled_mask(unlabelled, n: int, seq_len: int) -> np.ndarray:
    """The inputs an ``Unlabelled`` (job.source) leaves untrained, as ``ignored`` gives
    them: each listed position, and each listed row from its used tokens on."""
    mask = np.zeros((n, seq_len), dtype=bool)
    if unlabelled is not None:
        ends, rows, used = unlabelled
        mask.reshape(-1)[np.asarray(ends, dtype=np.int64)] = True
        for r, u in zip(rows, used, strict=True):
            mask[r, u:] = True
    return mask
