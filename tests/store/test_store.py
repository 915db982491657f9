"""TokenStore: windows are the documented slices; opening refuses broken stores; reads
check the content checksums; format-1 stores open with a warning and upgrade in place."""

import json
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store, edit_token, make_v1
from torchtitan_zephon.migrate.old_stores import upgrade_store
from torchtitan_zephon.store.format import StoreError, UncheckedStoreWarning, manifest_fingerprint
from torchtitan_zephon.store.group import StoreGroup
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_checksums


def test_store_basics(store):
    assert store.tokens.dtype == np.uint16
    assert not store.tokens.flags.writeable
    assert store.num_tokens == len(store.tokens)
    assert store.doc_offsets.dtype == np.int64 and store.doc_offsets[0] == 0
    # every document ends with EOS right before the next one starts
    ends = np.append(store.doc_offsets[1:], store.num_tokens) - 1
    assert (store.tokens[ends] == store.eos_id).all()
    assert len(store.fingerprint) == 64 and store.manifest["fingerprint"] == store.fingerprint
    info = store.describe()
    assert info["kind"] == "store" and info["num_documents"] == store.num_documents
    # content checksums: one per chunk, the recorded max id is the real one
    assert store.version == 2 and store.chunk_tokens == 1 << 16
    assert store.num_chunks == -(-store.num_tokens // store.chunk_tokens) == len(store.checksums)
    assert store.max_token_id == int(store.tokens.max()) < store.vocab_size
    assert store.check().ok


@pytest.mark.parametrize("seq_len", [1, 7, 64, 100])
def test_windows_match_slices(store, seq_len):
    n = store.num_samples(seq_len)
    assert n == (store.num_tokens - 1) // seq_len
    ids = np.array([0, n - 1, n // 2, 3 % n, 0])
    w = store.windows(ids, seq_len)
    assert w.shape == (5, seq_len + 1)
    for row, i in zip(w, ids, strict=True):
        assert np.array_equal(row, store.tokens[i * seq_len : i * seq_len + seq_len + 1])
        assert np.array_equal(row, store.window(int(i), seq_len))
    with pytest.raises(IndexError):
        store.windows(np.array([n]), seq_len)
    with pytest.raises(IndexError):
        store.window(-1, seq_len)


def test_document_ids(store):
    docs = store.document_ids(0, store.num_tokens)
    assert docs[0] == 0 and docs[-1] == store.num_documents - 1
    assert np.array_equal(np.searchsorted(docs, np.arange(store.num_documents)), store.doc_offsets)


@pytest.fixture
def broken(tmp_path, store_path):
    dst = tmp_path / "copy"
    shutil.copytree(store_path, dst)
    return dst


def test_open_missing_folder(tmp_path):
    with pytest.raises(StoreError, match="does not exist.*zephon prepare"):
        TokenStore.open(tmp_path / "nope")


def test_open_without_manifest(broken):
    (broken / "manifest.json").unlink()
    with pytest.raises(StoreError, match="no manifest.json"):
        TokenStore.open(broken)


@pytest.mark.parametrize("name", ["tokens.bin", "doc_offsets.bin"])
def test_open_truncated_empty_missing(broken, name):
    f = broken / name
    data = f.read_bytes()
    f.write_bytes(data[:-2])
    with pytest.raises(StoreError, match=f"{name}.*truncated.*Re-run `zephon prepare`"):
        TokenStore.open(broken)
    f.write_bytes(b"")
    with pytest.raises(StoreError, match="is empty"):
        TokenStore.open(broken)
    f.unlink()
    with pytest.raises(StoreError, match=f"{name}' is missing"):
        TokenStore.open(broken)


def test_open_edited_manifest(broken):
    m = json.loads((broken / "manifest.json").read_text())
    m["eos_id"] = 0
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="modified after preparation"):
        TokenStore.open(broken)
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="cannot read"):
        TokenStore.open(broken)


def test_open_edited_or_missing_checksums(broken):
    sums = broken / "checksums.bin"
    data = bytearray(sums.read_bytes())
    data[3] ^= 1
    sums.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksums.bin' was modified after preparation"):
        TokenStore.open(broken)
    sums.unlink()
    with pytest.raises(StoreError, match="checksums.bin' is missing"):
        TokenStore.open(broken)
    m = json.loads((broken / "manifest.json").read_text())
    m["content"]["max_token_id"] = 1  # the fingerprint covers the content section
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="modified after preparation"):
        TokenStore.open(broken)
    del m["content"]  # a version-2 manifest must have one
    m["fingerprint"] = manifest_fingerprint(m)
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="invalid field \\('content'\\)"):
        TokenStore.open(broken)
    m["version"], m["content"] = 2, {"algorithm": "sha1"}
    m["fingerprint"] = manifest_fingerprint(m)
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="content section is missing or has an invalid field"):
        TokenStore.open(broken)


CHUNK = 64  # tokens per checksum chunk in the edited-store tests (the fixture has ~6k tokens)


def test_edited_token_fails_reads_of_its_chunk_only(tmp_path, store_path, store):
    path = copy_store(store_path, tmp_path / "edited", chunk_tokens=CHUNK)
    bad = 10
    edit_token(path, bad * CHUNK + 5)
    s = TokenStore.open(path)  # opening stays cheap: nothing is hashed but checksums.bin
    seq = 16
    inside = (bad * CHUNK) // seq  # a sample starting in the bad chunk
    before = (bad * CHUNK - seq - 1) // seq  # the last sample ending before it
    after = ((bad + 1) * CHUNK) // seq  # the first sample starting after it
    ok = np.array([0, before, after, s.num_samples(seq) - 1])
    assert np.array_equal(s.windows(ok, seq), store.windows(ok, seq))
    for read in (lambda: s.windows(np.array([0, inside]), seq), lambda: s.window(inside, seq)):
        with pytest.raises(StoreError) as e:
            read()
        msg = str(e.value)
        assert str(path) in msg and "tokens.bin" in msg and "checksums.bin" in msg
        assert f"chunk {bad} of tokens.bin (tokens [{bad * CHUNK}, {(bad + 1) * CHUNK}))" in msg
        assert "zephon inspect" in msg
    # a sample whose label token alone lies in the bad chunk fails too
    with pytest.raises(StoreError, match=f"chunk {bad} "):
        s.windows(np.array([(bad * CHUNK - 1) // seq]), seq)
    assert np.array_equal(s.windows(ok, seq), store.windows(ok, seq))  # still fine
    # unchecked reads (benchmarks only) do not look
    TokenStore.open(path, verify=False).windows(np.array([inside]), seq)


def test_edited_tail_is_found_when_read_after_everything_before_it_was_checked(
    tmp_path, store_path, store
):
    # held-out samples at the end: training reads everything below them, the tail stays
    # unchecked; a read that reaches it is still checked, before and after the others
    path = copy_store(store_path, tmp_path / "tail", chunk_tokens=CHUNK)
    s = TokenStore.open(path)
    last = s.num_chunks - 1
    edit_token(path, last * CHUNK + 1)
    seq = 16
    below = np.arange((last * CHUNK - 1) // seq)  # samples ending before the last chunk
    for k in range(0, below.size, 7):
        assert np.array_equal(
            s.windows(below[k : k + 7], seq), store.windows(below[k : k + 7], seq)
        )
    assert s.unchecked_chunks == 1
    for ids in ([below[-1] + 1], [0, below[-1] + 1], [s.num_samples(seq) - 1, 3]):
        with pytest.raises(StoreError, match=f"chunk {last} of tokens.bin"):
            s.windows(np.array(ids), seq)
    assert np.array_equal(s.windows(below[::-5], seq), store.windows(below[::-5], seq))
    assert s.unchecked_chunks == 1


def test_long_windows_check_every_chunk_they_span(tmp_path, store_path):
    path = copy_store(store_path, tmp_path / "edited", chunk_tokens=8)
    edit_token(path, 60)  # chunk 7, strictly inside sample 1 of seq_len 40 (tokens [40, 81))
    s = TokenStore.open(path)
    s.windows(np.array([0, 2]), 40)  # tokens [0, 41) and [80, 121): chunks 0-5 and 10-15
    with pytest.raises(StoreError, match="chunk 7 "):
        s.windows(np.array([1]), 40)


def test_check_lists_every_bad_chunk(tmp_path, store_path):
    path = copy_store(store_path, tmp_path / "edited", chunk_tokens=CHUNK)
    s = TokenStore.open(path)
    assert s.check().ok
    edit_token(path, 3 * CHUNK)
    edit_token(path, 7 * CHUNK + CHUNK - 1, value=60_000)  # outside the vocabulary too
    offsets = path / "doc_offsets.bin"
    data = bytearray(offsets.read_bytes())
    data[8] ^= 1
    offsets.write_bytes(bytes(data))
    report = TokenStore.open(path).check()
    assert not report.ok
    assert report.bad_chunks == [
        {"index": 3, "start": 3 * CHUNK, "stop": 4 * CHUNK},
        {"index": 7, "start": 7 * CHUNK, "stop": 8 * CHUNK},
    ]
    text = "\n".join(report.problems)
    assert "chunk 3 (tokens [192, 256))" in text and "chunk 7 (tokens [448, 512))" in text
    assert "largest token id is 60000" in text
    assert "doc_offsets.bin does not match its recorded checksum" in text
    assert "token id 60000 is outside the tokenizer's vocabulary" in text
    assert "max_token_id" in text and report.max_token_id == 60_000


def test_v1_store_opens_with_warning_and_upgrade_keeps_fingerprint(tmp_path, store_path, store):
    path = copy_store(store_path, tmp_path / "old")
    fingerprint = make_v1(path)
    with pytest.warns(UncheckedStoreWarning, match="--upgrade"):
        old = TokenStore.open(path)
    assert old.version == 1 and old.checksums is None and old.max_token_id is None
    assert old.fingerprint == fingerprint
    ids = np.arange(old.num_samples(8))
    assert np.array_equal(old.windows(ids, 8), store.windows(ids, 8))
    report = old.check()  # nothing to check the tokens against
    assert not report.ok and "no content checksums" in report.problems[0]
    manifest_before = (path / "manifest.json").read_text()

    up, changed = upgrade_store(path)
    assert changed and up.fingerprint == fingerprint and up.version == 1
    assert (path / "manifest.json").read_text() == manifest_before  # untouched
    assert sorted(p.name for p in path.iterdir()) == [
        "checksums.bin",
        "content.json",
        "doc_offsets.bin",
        "manifest.json",
        "tokens.bin",
    ]
    assert (path / "checksums.bin").read_bytes() == (store_path / "checksums.bin").read_bytes()
    assert up.content == store.content
    assert up.max_token_id == store.max_token_id and up.check().ok
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning any more
        again = TokenStore.open(path)
    assert upgrade_store(path)[1] is False  # once is enough
    edit_token(path, 5)
    with pytest.raises(StoreError, match="chunk 0 "):
        TokenStore.open(path).windows(np.array([0]), 8)
    del again


def test_upgrade_refuses_inconsistent_content(tmp_path, store_path):
    path = copy_store(store_path, tmp_path / "old")
    make_v1(path)
    edit_token(path, 100, value=50_000)  # beyond the tokenizer's vocabulary
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(StoreError, match="not upgraded.*50000 is outside.*Nothing was changed"):
        upgrade_store(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_concurrent_readers_get_checked_content(tmp_path, store_path, store):
    path = copy_store(store_path, tmp_path / "c", chunk_tokens=CHUNK)
    s = TokenStore.open(path)
    assert s.unchecked_chunks == s.num_chunks > 50
    seq = 8
    ids = np.arange(s.num_samples(seq))
    errors = []

    def read(part):
        try:
            for k in range(0, len(part), 3):
                assert np.array_equal(
                    s.windows(part[k : k + 3], seq), store.windows(part[k : k + 3], seq)
                )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(np.roll(ids, 37 * t),)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert s.unchecked_chunks == 0


def _tiny_store(root: Path, tokens: np.ndarray, chunk_tokens: int) -> Path:
    """A store holding ``tokens`` (one document), with checksums over ``chunk_tokens``."""
    root.mkdir()
    (root / "tokens.bin").write_bytes(tokens.astype("<u2").tobytes())
    (root / "doc_offsets.bin").write_bytes(np.zeros(1, dtype="<i8").tobytes())
    m = {
        "format": "zephon-token-store",
        "version": 2,
        "tokenizer": {"sha256": "0" * 64, "vocab_size": 1000, "eos_token": "<eos>"},
        "dtype": "uint16",
        "eos_id": 0,
        "num_tokens": int(tokens.size),
        "num_documents": 1,
        "text_field": "text",
        "sources": [],
    }
    m["content"] = write_checksums(root, m, chunk_tokens=chunk_tokens)
    m["fingerprint"] = manifest_fingerprint(m)
    (root / "manifest.json").write_text(json.dumps(m))
    return root


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_tokens=st.integers(2, 400),
    chunk_tokens=st.integers(1, 50),
    seq_len=st.integers(1, 60),
)
def test_property_reads_fail_iff_they_cover_the_edited_chunk(
    data, num_tokens, chunk_tokens, seq_len
):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(0, 1000, num_tokens)
    n = (num_tokens - 1) // seq_len
    if n < 1:
        seq_len, n = 1, num_tokens - 1
    edited = data.draw(st.integers(0, num_tokens - 1), label="edited token")
    bad = edited // chunk_tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_store(Path(tmp) / "s", tokens, chunk_tokens)
        edit_token(path, edited)
        s = TokenStore.open(path)
        reads = data.draw(
            st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=70), max_size=6),
            label="reads",
        )
        for ids in reads:
            covers = any(
                i * seq_len // chunk_tokens <= bad <= (i * seq_len + seq_len) // chunk_tokens
                for i in ids
            )
            if covers:
                with pytest.raises(StoreError, match=f"chunk {bad} of tokens.bin"):
                    s.windows(np.array(ids), seq_len)
            else:
                got = s.windows(np.array(ids), seq_len)
                want = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in ids])
                assert np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), seq_len=st.integers(1, 40))
def test_property_a_store_group_reads_what_each_store_reads(data, seq_len):
    """StoreGroup.windows (one gather across all stores) gives row k = the window of
    ``ids[k]`` of ``stores[sources[k]]``; a read fails naming the edited chunk iff one of
    its rows touches it (checked stores only), whatever the stores checked before on their
    own; out-of-range sources or ids are refused, never read."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="rng"))
    k = data.draw(st.integers(1, 5), label="stores")
    with tempfile.TemporaryDirectory() as tmp:
        tokens, chunks, paths = [], [], []
        for i in range(k):
            tokens.append(rng.integers(0, 1000, data.draw(st.integers(seq_len + 1, 300))))
            chunks.append(data.draw(st.integers(1, 50), label=f"chunk_tokens {i}"))
            paths.append(_tiny_store(Path(tmp) / f"s{i}", tokens[i], chunks[i]))
        bad_store = data.draw(st.integers(0, k - 1), label="edited store")
        bad_token = data.draw(st.integers(0, len(tokens[bad_store]) - 1), label="edited token")
        tokens[bad_store][bad_token] = edit_token(paths[bad_store], bad_token)  # served unchecked
        bad = bad_token // chunks[bad_store]
        verify = [data.draw(st.booleans(), label=f"verify {i}") for i in range(k)]
        stores = [TokenStore.open(p, verify=v) for p, v in zip(paths, verify, strict=True)]
        counts = [s.num_samples(seq_len) for s in stores]
        pair = st.integers(0, k - 1).flatmap(
            lambda i: st.tuples(st.just(i), st.integers(0, counts[i] - 1))
        )

        def covers(rows):  # some row of a checked store spans the edited chunk
            return any(
                verify[i]
                and i == bad_store
                and j * seq_len // chunks[i] <= bad <= (j * seq_len + seq_len) // chunks[i]
                for i, j in rows
            )

        for i, j in data.draw(st.lists(pair, max_size=5), label="read by the stores first"):
            if not covers([(i, j)]):
                stores[i].windows(np.array([j]), seq_len)
        group = StoreGroup(stores)
        for rows in data.draw(st.lists(st.lists(pair, max_size=40), max_size=6), label="reads"):
            src = np.array([i for i, _ in rows], dtype=np.int64)
            ids = np.array([j for _, j in rows], dtype=np.int64)
            if covers(rows):
                with pytest.raises(StoreError, match=f"chunk {bad} of tokens.bin") as e:
                    group.windows(src, ids, seq_len)
                assert str(paths[bad_store]) in str(e.value)
            else:
                got = group.windows(src, ids, seq_len)
                want = [tokens[i][j * seq_len : j * seq_len + seq_len + 1] for i, j in rows]
                assert got.dtype == np.uint16 and got.shape == (len(rows), seq_len + 1)
                assert np.array_equal(got, np.array(want).reshape(got.shape))
        for src, ids, match in (
            ([0], [counts[0]], r"sample id \d+ outside \[0, \d+\) for seq_len"),
            ([0], [-1], r"sample id -1 outside"),
            ([k], [0], f"sources in \\[{k}, {k}\\], the mixture has {k} sources"),
            ([0, -1], [0, 0], "sources in \\[-1, 0\\]"),
        ):
            with pytest.raises(IndexError, match=match):
                group.windows(np.array(src), np.array(ids), seq_len)


def test_a_slice_is_a_store_of_its_own(store, tmp_path):
    """The whole documents within a token range, as a checked store of their own."""
    from torchtitan_zephon.store.writer import slice_store

    a = slice_store(store, 100, 900, tmp_path / "a")
    (part,) = a.manifest["sources"]
    first, last = part["start"], part["stop"]
    assert 100 <= first < last <= 900 and first in store.doc_offsets.tolist()
    assert np.array_equal(np.asarray(a.tokens), np.asarray(store.tokens[first:last]))
    assert a.window(3, 8).tolist() == store.tokens[first + 24 : first + 33].tolist()
    assert a.tokenizer_hash == store.tokenizer_hash
    assert a.check().ok  # every document ends with EOS, checksums hold
    b = slice_store(store, 0, 900, tmp_path / "b")
    assert len({a.fingerprint, b.fingerprint, store.fingerprint}) == 3
    with pytest.raises(StoreError, match="holds no whole document"):
        slice_store(store, 5, 6, tmp_path / "c")
    with pytest.raises(StoreError, match="already exists"):
        slice_store(store, 0, 900, tmp_path / "a")
