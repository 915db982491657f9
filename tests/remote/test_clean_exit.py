"""A refused remote store ends the command cleanly (store/location.py ``ObjectFiles``
thread and loop, store/remote.py ``open_url``): real ``python -m torchtitan_zephon``
processes against the moto server print the one refusal line, exit 2, and nothing else
(no abort at interpreter exit, no ``Exception ignored`` from a loop left open).

The processes run with ``-X dev``: it reports an event loop left unclosed (a
ResourceWarning) and dumps the threads of a fatal signal, so a leak shows on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.urls import parse_url

ROOT = Path(__file__).resolve().parents[2]


def _zephon(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-X", "dev", "-m", "torchtitan_zephon", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def _one_line(res: subprocess.CompletedProcess, command: str, starts: str) -> None:
    err = res.stderr
    assert res.returncode == 2, (res.returncode, err)
    assert err.startswith(f"zephon {command}: error: {starts}"), err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # the refusal, nothing after it
    for noise in ("Traceback", "Exception ignored", "Fatal Python error", "ResourceWarning"):
        assert noise not in err, err


@pytest.fixture(scope="module")
def raw_prefix(s3) -> str:
    """A prefix holding raw objects and no manifest.json."""
    for k in range(5):
        s3.put(f"exit/corpus/{k}.jsonl", b'{"text": "hello world"}\n')
    return f"s3://{s3.bucket}/exit/corpus"


def test_inspect_and_plan_refuse_raw_objects_and_exit_2(raw_prefix: str) -> None:
    starts = f"{raw_prefix} holds no token store: it has no manifest.json (it holds '0.jsonl'"
    # the abort at exit (obstore's threads under interpreter teardown: cli.main.run)
    # came in about one run of four before the process left with os._exit
    for _ in range(4):
        _one_line(_zephon("inspect", raw_prefix), "inspect", starts)
        plan = ("plan", "--store", raw_prefix, "--seq-len", "128", "--global-batch-size", "8",
                "--seed", "0", "--steps", "1:1")  # fmt: skip
        _one_line(_zephon(*plan), "plan", starts)


def test_a_missing_bucket_exits_2(s3) -> None:
    url = "s3://no-such-bucket-zephon-exit/store"
    _one_line(_zephon("inspect", url), "inspect", f"the bucket of {url} does not exist")


def test_a_second_prepare_into_a_store_exits_2(
    s3, store_path: Path, tokenizer_dir: Path, corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    url = s3.upload(store_path, "exit/store")
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    res = _zephon("prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output", url,
                  "--quiet")  # fmt: skip
    _one_line(res, "prepare", f"output {url} already holds a token store (manifest.json)")


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zephon-fetch"]


def test_a_refused_open_leaves_no_thread(raw_prefix: str) -> None:
    before = _fetch_threads()
    with pytest.raises(StoreError, match="holds no token store"):
        TokenStore.open(raw_prefix)
    assert _fetch_threads() == before


def test_close_stops_the_thread_and_closes_its_loop(raw_prefix: str) -> None:
    url = parse_url(raw_prefix)
    files = ObjectFiles(url)
    assert "'0.jsonl'" in files.missing_store_reason()
    loop, thread = files._loop, files._thread
    assert loop is not None and thread is not None and thread.is_alive()
    files.close()
    assert not thread.is_alive() and loop.is_closed()
    files.close()  # idempotent
    assert [m["name"] for m in files.listing()][:1] == ["0.jsonl"]  # usable again: a new loop
    files.close()
