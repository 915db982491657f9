"""The loopback bucket of ``zephon bench remote``: moto's S3 server in a process of its
own, a store made and uploaded to it, the naive whole-store download, a request's time,
and one rank's loader over a store (also what the bench's child processes run).

Invariant: the bucket's store is the same bytes as the local one (same fingerprint);
nothing here measures: the suite (``bench.remote``) times what it calls.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.store.format import STORE_FILES

BUCKET = "zephon-bench"


# ---------------------------------------------------------------- the bucket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MOTO = r"""
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def background_process(argv: list[str]) -> Iterator[str]:
    """A child process that prints one line when ready and stops when its stdin closes;
    that line."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line:
            raise RuntimeError(f"{argv[1:3]} did not start: {proc.stderr.read()[-2000:]}")
        yield line
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bucket_env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables for the loopback server (marker credentials)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "zephon-bench",
        "AWS_SECRET_ACCESS_KEY": "zephon-bench",
    }


def make_store(folder: Path, num_tokens: int, block_tokens: int = 512) -> Path:
    """The builtin store's tokens (and documents) repeated to ``num_tokens`` tokens, in
    ``folder``, with block checksums of ``block_tokens``."""
    from torchtitan_zephon.bench.builtin_corpus import builtin_store
    from torchtitan_zephon.migrate.old_stores import add_block_checksums
    from torchtitan_zephon.store.writer import write_derived_store

    base = builtin_store()
    n = base.num_tokens
    tokens = np.resize(np.asarray(base.tokens), num_tokens)
    reps = -(-num_tokens // n)
    starts = np.concatenate([np.asarray(base.doc_offsets) + k * n for k in range(reps)])
    starts = starts[starts < num_tokens]
    folder.mkdir(parents=True, exist_ok=True)
    source = {"name": f"builtin x{num_tokens / n:.1f}", "kind": "bench"}
    write_derived_store(folder, base, tokens.tobytes(), starts, source)
    add_block_checksums(folder, block_tokens)
    return folder


def with_block_tokens(store: Path, folder: Path, block_tokens: int) -> Path:
    """A copy of ``store`` in ``folder`` whose block checksums are rewritten for
    ``block_tokens`` (``inspect --upgrade --block-tokens``): same fingerprint, same tokens."""
    import shutil

    from torchtitan_zephon.migrate.old_stores import add_block_checksums

    shutil.copytree(store, folder)
    add_block_checksums(folder, block_tokens)
    return folder


def upload(endpoint: str, folder: Path, prefix: str) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **_boto_keys())
    client.create_bucket(Bucket=BUCKET)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    files.sort(key=lambda p: p.name == "manifest.json")  # the manifest last
    for p in files:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{p.name}", Body=p.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def _boto_keys() -> dict[str, str]:
    return {
        "region_name": "us-east-1",
        "aws_access_key_id": "zephon-bench",
        "aws_secret_access_key": "zephon-bench",
    }


def download_store(url: str, folder: Path) -> int:
    """The naive way: every file of the store at ``url`` downloaded whole into
    ``folder`` (one GET each); the bytes fetched."""
    from torchtitan_zephon.store.location import ObjectFiles
    from torchtitan_zephon.store.object_faults import MissingObject
    from torchtitan_zephon.store.urls import parse_url

    files = ObjectFiles(parse_url(url))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for name in STORE_FILES:
            try:
                data = files.read(name)
            except MissingObject:
                continue
            (folder / name).write_bytes(data)
        return files.fetched_bytes
    finally:
        files.close()


def request_ms(url: str, gets: int) -> float:
    """Median time of ``gets`` single range GETs of 4 KiB of tokens.bin at ``url``, one
    at a time (what one request costs: the added latency plus the server's own time)."""
    from torchtitan_zephon.store.location import ObjectFiles
    from torchtitan_zephon.store.urls import parse_url

    files = ObjectFiles(parse_url(url))
    try:
        size = files.open_file("tokens.bin")
        times = []
        for k in range(gets):
            a = (k * 7919 * 4096) % max(1, size - 4096)
            t0 = time.perf_counter()
            files.submit("tokens.bin", [a], [a + 4096]).result()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    finally:
        files.close()


# ---------------------------------------------------------------- one rank's stream


def rank_loader(store: Any, seq_len: int, batch: int, **kw: Any) -> Any:
    from torchtitan_zephon.job.loader import ZephonLoader
    from torchtitan_zephon.order.layout import BatchSchedule

    d = kw.pop("dp_degree", 1)
    return ZephonLoader(
        store,
        seq_len=seq_len,
        seed=kw.pop("seed", 0),
        schedule=BatchSchedule.parse(f"1:{kw.pop('gbs', batch * d)}"),
        dp_rank=kw.pop("dp_rank", 0),
        dp_degree=d,
        local_batch_size=batch,
        **kw,
    )


def wait_in_flight(store: Any) -> None:
    """Let what the store has in flight land (it counts as fetched)."""
    deadline = time.time() + 120
    while getattr(store, "_queued", None) or any(
        not s.fetch.future.done() for s in getattr(store, "_steps", ())
    ):
        if time.time() > deadline:
            raise RuntimeError("remote bench: read-ahead still in flight after 120 s")
        time.sleep(0.005)
