"""Faults between a remote store and the job (store/location.py), through a
fault-injecting proxy on loopback (tests/remote/faults.py) in front of moto's server:
transient ones are retried with backoff and the windows served are the local store's;
the others stop with an error naming the object and what to do, and no secret."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import copy_store
from tests.remote.conftest import SECRET, SESSION
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote import RemoteTokenStore
from torchtitan_zephon.store.remote_options import RemoteOptions
from torchtitan_zephon.store.urls import CREDENTIAL_VARIABLES, parse_url


@pytest.fixture(scope="module")
def blocked(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = copy_store(store_path, tmp_path_factory.mktemp("faults") / "store")
    add_block_checksums(path)
    return path


@pytest.fixture(scope="module")
def url(s3, blocked: Path) -> str:
    return s3.upload(blocked, "faults/store")


def _open(url: str, **kw) -> RemoteTokenStore:
    return RemoteTokenStore.open_url(parse_url(url), options=RemoteOptions(**kw))


def _no_secret(text: str) -> None:
    assert SECRET not in text and SESSION not in text and "X-Amz" not in text


IDS, SEQ = np.array([0, 4, 9]), 512


@pytest.mark.parametrize(
    "faults",
    [("503",), ("500", "503", "503"), ("reset",), ("truncate",), ("reset", "truncate", "503")],
)
def test_transient_faults_are_retried(proxy, url: str, blocked: Path, faults) -> None:
    store = _open(url)
    proxy.inject("tokens.bin", *faults)
    proxy.inject("blocks.bin", *faults)
    got = store.windows(IDS, SEQ)
    np.testing.assert_array_equal(got, TokenStore.open(blocked).windows(IDS, SEQ))
    assert sorted(proxy.faults_met()) == sorted(2 * faults)  # every fault met, then retried


def test_a_short_answer_is_retried_then_reported(proxy, url: str, blocked: Path) -> None:
    store = _open(url, retries=2)
    proxy.inject("tokens.bin", "short")
    np.testing.assert_array_equal(
        store.windows(IDS[:1], SEQ), TokenStore.open(blocked).windows(IDS[:1], SEQ)
    )
    proxy.inject("tokens.bin", "short", "short", "short")
    with pytest.raises(StoreError) as e:
        store.windows(IDS[1:2], SEQ)
    assert str(e.value) == (
        f"{url}/tokens.bin: asked for bytes [4096, 5122), received 513, 3 times: the object "
        "is shorter than the store's manifest says. Upload the store again."
    )


def test_throttling_that_does_not_stop(proxy, url: str) -> None:
    store = _open(url, retries=2)
    proxy.inject("tokens.bin", "503", "503", "503")
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        store.windows(IDS[:1], SEQ)
    assert time.monotonic() - t0 >= 0.1 + 0.2 * 0.5  # backed off (jitter: at least half)
    assert str(e.value) == (
        f"reading {url}/tokens.bin failed 3 times (retried with backoff): the endpoint "
        "answered 503 SlowDown. The service is failing or throttling this job: try again "
        "later, or read less at once (lower zephon.read_ahead_steps)."
    )
    _no_secret(str(e.value))


def test_resets_that_do_not_stop(proxy, url: str) -> None:
    store = _open(url, retries=1)
    proxy.inject("blocks.bin", "reset", "reset")
    with pytest.raises(StoreError) as e:
        store.windows(IDS[:1], SEQ)
    assert str(e.value) == (
        f"reading {url}/blocks.bin failed 2 times (retried with backoff): the connection "
        "was refused or reset, or an answer was cut short. Check the network and the "
        "endpoint (AWS_ENDPOINT_URL for an S3-compatible one)."
    )


def test_a_slow_endpoint_within_the_time_limit(proxy, url: str, blocked: Path) -> None:
    proxy.latency_s = 0.05
    store = _open(url)
    t0 = time.monotonic()
    np.testing.assert_array_equal(
        store.windows(IDS, SEQ), TokenStore.open(blocked).windows(IDS, SEQ)
    )
    assert time.monotonic() - t0 >= 0.05


def test_a_hung_attempt_is_retried_then_reported(proxy, url: str, blocked: Path) -> None:
    store = _open(url, request_timeout_s=1, retries=1)
    proxy.inject("tokens.bin", "hang")
    np.testing.assert_array_equal(
        store.windows(IDS[:1], SEQ), TokenStore.open(blocked).windows(IDS[:1], SEQ)
    )
    proxy.inject("tokens.bin", "hang", "hang")
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        store.windows(IDS[1:2], SEQ)
    assert 2 <= time.monotonic() - t0 < 6
    assert str(e.value).startswith(
        f"reading {url}/tokens.bin took longer than request_timeout_s=1 s, 2 times (retried "
        "with backoff): the endpoint, or the credential source, does not answer."
    )


def test_access_denied_stops_at_once(proxy, url: str) -> None:
    store = _open(url)
    proxy.inject("tokens.bin", "403")
    with pytest.raises(StoreError) as e:
        store.windows(IDS[:1], SEQ)
    assert proxy.faults_met() == ["403"]  # not retried
    assert str(e.value) == (
        f"access to {url}/tokens.bin was denied (403): the credentials found do not allow "
        "reading it. Grant them read access to the store's prefix, or give others (looked "
        f"for {CREDENTIAL_VARIABLES['s3']})."
    )
    _no_secret(str(e.value))


def test_a_missing_object_and_a_changed_one_stop(s3, proxy, blocked: Path) -> None:
    url = s3.upload(blocked, "faults/gone")
    store = _open(url)
    s3.client.delete_object(Bucket=s3.bucket, Key="faults/gone/blocks.bin")
    with pytest.raises(StoreError) as e:
        store.windows(IDS[:1], SEQ)
    assert str(e.value) == (
        f"{url}/blocks.bin does not exist any more: it was deleted after the store was "
        "opened. Upload the whole store again (manifest.json last) and restart the job."
    )
    s3.put("faults/gone/blocks.bin", (blocked / "blocks.bin").read_bytes())
    store = _open(url)
    s3.put("faults/gone/tokens.bin", (blocked / "tokens.bin").read_bytes() + b"\\0\\0")
    with pytest.raises(StoreError) as e:
        store.windows(IDS[1:2], SEQ)
    assert str(e.value).startswith(
        f"{url}/tokens.bin changed while this job reads it (its ETag is no longer the one "
        "recorded when the store was opened)"
    )
    assert not [f for f in proxy.faults_met()]


@pytest.fixture(scope="module")
def small_blocks(s3, blocked: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The store with blocks of 16 tokens (a request per sample of seq_len 16), uploaded."""
    small = copy_store(blocked, tmp_path_factory.mktemp("small") / "store")
    add_block_checksums(small, 16)
    return small, s3.upload(small, "faults/small")


def test_a_read_waited_for_goes_before_the_reads_ahead(
    proxy, small_blocks: tuple[Path, str]
) -> None:
    """Samples not read ahead (validation, a reset) are fetched before the requests of
    the steps read ahead still queued: they wait for a slot, not for the queue."""
    small, url = small_blocks
    proxy.latency_s = 0.02
    store = _open(url, max_requests=2, read_ahead_bytes=1 << 30)
    seq = 16
    n = store.num_samples(seq)
    rng = np.random.default_rng(1)
    before = len(proxy.seen)
    try:
        for _ in range(6):
            store.read_ahead(np.sort(rng.choice(n, 16, replace=False)), seq)
        queued = sum(2 * (int(x.fetch.request.max()) + 1) for x in store._steps)
        ids = np.array([n - 1, 0])
        got = store.windows(ids, seq)
        sent = len(proxy.seen) - before  # requests sent until the read returned
        np.testing.assert_array_equal(got, TokenStore.open(small).windows(ids, seq))
        assert queued > 150 and sent <= 2 + 2 + 4, (queued, sent)  # in flight, the read's
    finally:
        store.close()


def test_a_silent_endpoint_fails_the_read_waited_for_within_the_bound(
    proxy, small_blocks: tuple[Path, str]
) -> None:
    """The endpoint stops answering (as under kill -STOP) after 2 steps, with 12 more
    steps read ahead (hundreds of requests queued behind 16 slots): the read a step
    waits for raises the timeout error within limit_s, not (requests queued / 16) x
    limit_s, and so do the steps read ahead; nothing hangs."""
    small, url = small_blocks
    proxy.hang_s = 20.0
    store = _open(url, request_timeout_s=0.5, retries=1, read_ahead_bytes=1 << 30)
    limit = store._files.limit_s  # 2 x (0.5 + 2) + 1 = 6 s
    seq = 16
    n = store.num_samples(seq)
    rng = np.random.default_rng(0)
    steps = [np.sort(rng.choice(n, 16, replace=False)) for _ in range(14)]
    local = TokenStore.open(small)
    for ids in steps[:2]:
        store.read_ahead(ids, seq)
    for ids in steps[:2]:
        np.testing.assert_array_equal(store.windows(ids, seq), local.windows(ids, seq))
    proxy.inject("/", *["hang"] * 100_000)
    for ids in steps[2:]:
        store.read_ahead(ids, seq)
    outcome: dict[str, object] = {}

    def read(ids: np.ndarray) -> None:
        t0 = time.monotonic()
        try:
            store.windows(ids, seq)
        except StoreError as e:
            outcome["error"] = str(e)
        outcome["s"] = time.monotonic() - t0

    try:
        for ids in (np.array([n - 1, 3]), steps[-1]):  # a read on the spot, the last step
            outcome.clear()
            thread = threading.Thread(target=read, args=(ids,), daemon=True)
            thread.start()
            thread.join(3 * limit)
            assert not thread.is_alive(), f"the read still waits after {3 * limit:g} s"
            assert outcome["s"] < 2 * limit, outcome  # the bound, x2 for a loaded machine
            assert str(outcome["error"]).startswith(f"reading {url}/"), outcome
            assert "took longer than request_timeout_s=0.5 s, 2 times" in str(outcome["error"])
            _no_secret(str(outcome["error"]))
        assert len(proxy.faults_met()) < 200  # the queued requests were never sent
    finally:
        store.close()


def test_a_read_sent_after_a_silence_failed_the_reads_fails_within_the_same_bound(
    proxy, small_blocks: tuple[Path, str]
) -> None:
    """Issue 43 case 6: the endpoint goes silent with a step read ahead in flight. Its
    read fails within limit_s of the silence; a read sent next (the job's following
    step, samples never read ahead) fails at once with the same error instead of
    waiting a whole limit_s more, so the job stops within one bound of the silence. Once
    the endpoint has had limit_s without requests, a read tries it afresh."""
    small, url = small_blocks
    proxy.hang_s = 20.0
    store = _open(url, request_timeout_s=0.5, retries=1)
    limit = store._files.limit_s  # 2 x (0.5 + 2) + 1 = 6 s
    seq = 16
    n = store.num_samples(seq)
    local = TokenStore.open(small)
    ids = np.arange(0, 64, 4)
    try:
        store.read_ahead(ids[:8], seq)
        np.testing.assert_array_equal(store.windows(ids[:8], seq), local.windows(ids[:8], seq))
        proxy.inject("/", *["hang"] * 100_000)
        t0 = time.monotonic()
        store.read_ahead(ids[8:], seq)  # in flight when the endpoint goes silent
        with pytest.raises(StoreError):
            store.windows(ids[8:], seq)
        first = time.monotonic() - t0
        with pytest.raises(StoreError) as e:
            store.windows(np.array([n - 1]), seq)  # never read ahead: sent now
        then = time.monotonic() - t0 - first
        assert first < 1.5 * limit and then < 1.0, (first, then, limit)
        assert str(e.value).startswith(f"reading {url}/")
        assert "took longer than request_timeout_s=0.5 s, 2 times" in str(e.value)
        _no_secret(str(e.value))
        proxy.clear()
        time.sleep(limit + 0.2)
        got = store.windows(np.array([n - 1]), seq)
        np.testing.assert_array_equal(got, local.windows(np.array([n - 1]), seq))
    finally:
        store.close()


def test_a_request_unanswered_on_every_attempt_fails_the_reads_queued(
    proxy, small_blocks: tuple[Path, str]
) -> None:
    """One slot, a read in it that the endpoint never answers, 8 reads queued: once it
    failed twice (its attempts), the queued reads fail with its error, never sent."""
    small, url = small_blocks
    proxy.hang_s = 20.0
    files = _open(url, request_timeout_s=0.5, retries=1, max_requests=1)._files
    try:
        proxy.inject("tokens.bin", *["hang"] * 100)
        first = files.submit("tokens.bin", [0], [64])
        time.sleep(0.2)  # it holds the slot
        queued = [files.submit("tokens.bin", [64 * k], [64 * k + 64]) for k in range(1, 9)]
        t0 = time.monotonic()
        for future in (first, *queued):
            with pytest.raises(StoreError) as e:
                future.result(timeout=3 * files.limit_s)
            assert str(e.value).startswith(
                f"reading {url}/tokens.bin took longer than request_timeout_s=0.5 s, 2 times"
            )
        assert time.monotonic() - t0 < 2 * files.limit_s
        assert proxy.faults_met() == ["hang", "hang"]  # the first read's attempts only
    finally:
        files.close()


def test_a_failed_request_cancels_the_rest_of_its_read(
    proxy, small_blocks: tuple[Path, str]
) -> None:
    """A read of 3 ranges through one slot: the first is denied (403), so the read
    fails and its 2 other requests are never sent."""
    small, url = small_blocks
    files = _open(url, max_requests=1)._files
    try:
        proxy.inject("tokens.bin", "403")
        before = len(proxy.seen)
        with pytest.raises(StoreError) as e:
            files.submit("tokens.bin", [0, 64, 128], [32, 96, 160]).result(timeout=30)
        assert str(e.value).startswith(f"access to {url}/tokens.bin was denied (403)")
        time.sleep(0.5)  # what would still be sent is sent by now
        assert len(proxy.seen) - before == 1
    finally:
        files.close()
