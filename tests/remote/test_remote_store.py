"""Stores in object storage (store/location.py, store/remote.py) against a real S3 API
on loopback (moto's server, tests/remote/conftest.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import copy_store, edit_token
from tests.remote.conftest import SECRET, SESSION
from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote import RemoteTokenStore
from torchtitan_zephon.store.remote_options import RemoteOptions
from torchtitan_zephon.store.urls import parse_url, redact, scrub


@pytest.fixture(scope="module")
def fine_store(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store with checksum chunks of 64 tokens (many chunks, small reads)."""
    return copy_store(store_path, tmp_path_factory.mktemp("fine") / "store", chunk_tokens=64)


@pytest.fixture(scope="module")
def fine_url(s3, fine_store: Path) -> str:
    return s3.upload(fine_store, "stores/fine")


@pytest.fixture(scope="module")
def plain_url(s3, store_path: Path) -> str:
    return s3.upload(store_path, "stores/plain")


def _no_secret(text: str) -> None:
    assert SECRET not in text and SESSION not in text


def test_same_fingerprint_and_description(plain_url: str, store_path: Path) -> None:
    local = TokenStore.open(store_path)
    remote = TokenStore.open(plain_url)
    assert isinstance(remote, RemoteTokenStore)
    assert remote.fingerprint == local.fingerprint
    a, b = local.describe(), remote.describe()
    assert b.pop("path") == plain_url and a.pop("path") == str(store_path)
    assert a == b


def test_opening_reads_no_tokens(fine_url: str, fine_store: Path) -> None:
    remote = TokenStore.open(fine_url)
    expected = (fine_store / "manifest.json").stat().st_size + (
        fine_store / "checksums.bin"
    ).stat().st_size
    assert remote.fetched_bytes == expected
    assert remote.requests == 2


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), seq_len=st.sampled_from([1, 7, 32, 63, 64, 65, 200]))
def test_windows_equal_local_reads(fine_url: str, fine_store: Path, data, seq_len: int) -> None:
    local = TokenStore.open(fine_store)
    remote = _opened(fine_url)
    n = local.num_samples(seq_len)
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40)))
    np.testing.assert_array_equal(remote.windows(ids, seq_len), local.windows(ids, seq_len))
    i = int(ids[0])
    np.testing.assert_array_equal(remote.window(i, seq_len), local.window(i, seq_len))


_OPEN: dict[str, RemoteTokenStore] = {}


def _opened(url: str) -> RemoteTokenStore:
    if url not in _OPEN:
        _OPEN[url] = TokenStore.open(url)
    return _OPEN[url]


def test_read_ahead_fetches_what_is_read(fine_url: str, fine_store: Path) -> None:
    """Windows announced ahead are served from the background fetch: no request when they
    are read, and the bytes fetched are the windows rounded to whole checksum chunks."""
    local = TokenStore.open(fine_store)
    remote = TokenStore.open(fine_url)
    ids = np.array([3, 4, 5, 40, 41, 90])
    seq_len = 32
    remote.read_ahead(ids, seq_len)
    deadline = time.time() + 10
    while remote._steps[0].fetch.future.running() or not remote._steps[0].fetch.future.done():
        assert time.time() < deadline
        time.sleep(0.01)
    before, requests = remote.fetched_bytes, remote.requests
    np.testing.assert_array_equal(remote.windows(ids, seq_len), local.windows(ids, seq_len))
    assert (remote.fetched_bytes, remote.requests) == (before, requests)
    # 3..5 share chunks: [96, 193) -> chunks 1..3; 40, 41: [1280, 1345) -> 20..21;
    # 90: [2880, 2913) -> 45 (chunk 64 tokens, uint16)
    assert (
        before - remote._files.sizes["manifest.json"] - remote._files.sizes["checksums.bin"]
        == (3 + 2 + 1) * 64 * 2
    )
    assert remote._held == 0 and not remote._steps


def test_a_changed_chunk_is_refused(s3, fine_store: Path, tmp_path: Path) -> None:
    bad = copy_store(fine_store, tmp_path / "bad")
    edit_token(bad, 64 * 10 + 5)  # chunk 10; the manifest and checksums stay the original's
    url = s3.upload(bad, "stores/bad")
    remote = TokenStore.open(url)
    seq_len = 32
    good = remote.windows(np.array([0, 1]), seq_len)  # chunks 0..1: intact
    assert good.shape == (2, 33)
    with pytest.raises(StoreError) as e:
        remote.windows(np.array([0, 20]), seq_len)  # sample 20: tokens [640, 673), chunk 10
    assert f"token store '{url}': chunk 10 of tokens.bin (tokens [640, 704))" in str(e.value)
    assert "does not match its checksum" in str(e.value)


def test_an_object_replaced_while_read_is_refused(s3, fine_store: Path, tmp_path: Path) -> None:
    url = s3.upload(fine_store, "stores/replaced")
    remote = TokenStore.open(url)
    remote.windows(np.array([1]), 16)
    changed = bytearray((fine_store / "tokens.bin").read_bytes())
    changed[0] ^= 1
    s3.put("stores/replaced/tokens.bin", bytes(changed))
    with pytest.raises(StoreError) as e:
        remote.windows(np.array([2]), 16)
    assert str(e.value).startswith(
        f"{url}/tokens.bin changed while this job reads it (its ETag is no longer the one "
        "recorded when the store was opened)"
    )


# ---------------------------------------------------------------- bad input


def test_a_prefix_without_a_manifest(s3, store_path: Path) -> None:
    url = s3.upload(store_path, "stores/halfway", skip=("manifest.json",))
    with pytest.raises(StoreError) as e:
        TokenStore.open(url)
    text = str(e.value)
    assert text.startswith(f"{url} holds no token store: it has no manifest.json (it holds ")
    assert "'tokens.bin'" in text
    assert "if an upload is under way, wait for it" in text
    with pytest.raises(StoreError, match="nothing is stored under it"):
        TokenStore.open("s3://zephon-test/stores/nothing-here")


def test_a_missing_bucket(s3) -> None:
    with pytest.raises(StoreError) as e:
        TokenStore.open("s3://no-such-bucket-zephon/store")
    assert str(e.value).startswith(
        "the bucket of s3://no-such-bucket-zephon/store does not exist (or is not visible "
        "with these credentials)"
    )


@pytest.mark.parametrize(
    "url, expected",
    [
        (
            "ftp://host/store",
            "has the URL scheme 'ftp', which zephon does not read: expected "
            "one of s3://, gs://, az://, file://, or a local path.",
        ),
        ("s3:///store", "names no bucket: expected s3://BUCKET/PREFIX."),
        ("s3://bucket", "names a whole bucket, not a store in it: expected s3://bucket/PREFIX"),
        ("az://container/", "names a whole container, not a store in it"),
        ("s3://bucket/stores/*", "is a pattern; a store is one prefix"),
    ],
)
def test_bad_urls(url: str, expected: str) -> None:
    with pytest.raises(StoreError) as e:
        TokenStore.open(url)
    assert expected in str(e.value)


def test_file_urls_are_local_paths(store_path: Path) -> None:
    store = TokenStore.open(f"file://{store_path}")
    assert store.mapped and store.path == store_path
    assert parse_url(f"file://{store_path}") == str(store_path)


def test_query_strings_are_redacted() -> None:
    url = "az://acct/container/store?sv=2024&sig=SASMARKER"
    assert redact(f"see {url} now") == "see az://acct/container/store?<redacted> now"
    with pytest.raises(StoreError) as e:
        parse_url("ftp://h/s?sig=SASMARKER")
    assert "SASMARKER" not in str(e.value) and "ftp://h/s?<redacted>" in str(e.value)


def test_credentials_in_a_url_are_refused_and_never_printed(capsys, tmp_path) -> None:
    """user:password@ in a URL: redacted wherever the URL is printed, and refused as a
    store or as raw inputs (zephon reads credentials from the environment only)."""
    from torchtitan_zephon.cli.main import main

    url = "s3://AKIAMARKER:SECRETMARKER@bucket/store"
    assert redact(f"see {url} now") == "see s3://<redacted>@bucket/store now"
    with pytest.raises(StoreError) as e:
        TokenStore.open(url)
    assert "holds credentials" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)
    assert "MARKER" not in str(e.value)
    assert main(["inspect", url]) != 0
    inspected = capsys.readouterr()
    assert "MARKER" not in inspected.out + inspected.err and "holds credentials" in inspected.err
    tok = ["--tokenizer", str(TOKENIZER_DIR)]
    assert main(["prepare", f"{url}/*.jsonl", "--output", str(tmp_path / "out"), *tok]) != 0
    out = capsys.readouterr()
    assert "MARKER" not in out.out + out.err and "holds credentials" in out.err
    assert "Traceback" not in out.err and not (tmp_path / "out").exists()


def test_raw_inputs_without_a_bucket_name_the_value_given(capsys, tmp_path) -> None:
    from torchtitan_zephon.cli.main import main

    out = str(tmp_path / "out")
    assert main(["prepare", "s3://", "--output", out, "--tokenizer", str(TOKENIZER_DIR)]) != 0
    err = capsys.readouterr().err
    assert "'s3://' names no bucket" in err and "/x" not in err


def test_scrub_removes_secret_values(s3) -> None:
    assert scrub(f"key {SECRET} token {SESSION}") == (
        "key <AWS_SECRET_ACCESS_KEY> token <AWS_SESSION_TOKEN>"
    )


def test_plain_http_elsewhere_than_loopback_needs_opt_in(s3, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.11.12.13:9000")
    with pytest.raises(StoreError) as e:
        TokenStore.open("s3://zephon-test/stores/fine")
    assert str(e.value) == (
        "AWS_ENDPOINT_URL 'http://10.11.12.13:9000' is plain http on a host that is not "
        "loopback: the store would be read unencrypted. Use https, or set "
        "AWS_ALLOW_HTTP=true to accept it."
    )


def test_missing_credentials_name_the_variables(s3, monkeypatch, plain_url: str) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        RemoteTokenStore.open_url(parse_url(plain_url), options=RemoteOptions(request_timeout_s=3))
    assert time.monotonic() - t0 < 10
    text = str(e.value)
    assert "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN)" in text
    assert "instance metadata service" in text


def test_a_hung_endpoint_times_out(s3, monkeypatch) -> None:
    """A server that accepts connections and never answers: an error within the limit."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as e:
            RemoteTokenStore.open_url(
                parse_url("s3://zephon-test/stores/fine"),
                options=RemoteOptions(request_timeout_s=1),
            )
        assert time.monotonic() - t0 < 16  # 5 attempts of 1 s, with backoff
    finally:
        stop.set()
        thread.join()
        server.close()
        for c in accepted:
            c.close()
    assert str(e.value).startswith(
        "reading s3://zephon-test/stores/fine/manifest.json took longer than "
        "request_timeout_s=1 s, 5 times (retried with backoff)"
    )


def test_no_secret_in_any_error(s3, store_path: Path, monkeypatch) -> None:
    """Every refusal above, collected: none prints a secret or a query string."""
    texts = []
    for url in (
        "s3://no-such-bucket-zephon/store",
        "s3://zephon-test/stores/nothing-here",
        "s3://zephon-test/x?X-Amz-Signature=" + SECRET,
    ):
        try:
            TokenStore.open(url)
        except StoreError as e:
            texts.append(str(e))
    assert len(texts) == 3
    for text in texts:
        _no_secret(text)
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET


def test_a_prefix_without_a_manifest_says_how_to_upload_manifest_last(s3, store_path) -> None:
    url = s3.upload(store_path, "stores/cut", skip=("manifest.json",))
    with pytest.raises(StoreError) as e:
        TokenStore.open(url)
    text = str(e.value)
    assert f"`zephon prepare --output {url}`" in text
    assert f"`aws s3 cp --recursive STORE {url} --exclude manifest.json`" in text
    assert f"then `aws s3 cp STORE/manifest.json {url}/`" in text
    assert "sync" not in text and "if one was cut, run it again" in text
