"""A real S3 API on loopback: moto's server, started on a free port for the session.

``s3`` sets the standard AWS variables (endpoint, region, marker credentials) for the
session and uploads stores made by the shared fixtures (tests/conftest.py) with boto3.
Not a mock of the client library: obstore speaks HTTP to the server.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("obstore")
moto_server = pytest.importorskip("moto.server")

SECRET = "zephonSECRETmarker0123456789"
SESSION = "zephonSESSIONmarker9876543210"
BUCKET = "zephon-test"


@dataclass
class S3:
    endpoint: str
    client: object
    bucket: str = BUCKET

    def upload(self, store: Path, prefix: str, *, skip: tuple[str, ...] = ()) -> str:
        """Upload the files of ``store`` under ``prefix`` (a sharded store's shard files
        too, manifest.json last); its URL."""
        files = sorted(
            p
            for p in store.rglob("*")
            if p.is_file() and p.relative_to(store).as_posix() not in skip
        )
        files.sort(key=lambda p: p.name == "manifest.json")
        for p in files:
            key = f"{prefix}/{p.relative_to(store).as_posix()}"
            self.client.put_object(Bucket=self.bucket, Key=key, Body=p.read_bytes())
        return f"s3://{self.bucket}/{prefix}"

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3():
    import logging

    import boto3

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "AKIAZEPHONTEST",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_SESSION_TOKEN": SESSION,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    try:
        yield S3(endpoint, client)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def proxy(s3, monkeypatch):
    """A fault-injecting proxy (tests/remote/faults.py) in front of the session's moto
    server, made the S3 endpoint for the test."""
    from tests.remote.faults import FaultProxy

    p = FaultProxy(s3.endpoint, hang_s=4.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    try:
        yield p
    finally:
        p.close()
