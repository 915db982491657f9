"""End to end on TorchTitan 0.3: a torchrun job whose ``zephon.store`` is a glob of raw
JSONL objects in the loopback bucket prepares them into the node-local cache
(``zephon.cache_dir`` / ZEPHON_CACHE) and trains on exactly the data of main's recorded
run on the same file on local disk (tests/titan/recorded_main/raw): ``zephon verify``
says MATCH."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.remote.conftest import SECRET, SESSION
from tests.titan import recorded
from tests.titan.launch import REPO, train03
from torchtitan_zephon.cli.main import main

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")


@pytest.mark.slow  # ~90 s wall on the shared 2-core machine (27 s of CPU): torchrun start-up
def test_a_job_on_raw_objects_in_the_bucket_trains_on_the_data_of_the_local_file(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    corpus = recorded.write_raw(tmp_path / "inputs")
    s3.put("e2e-raw/corpus.jsonl", corpus.read_bytes())
    cache = tmp_path / "cache"
    monkeypatch.setenv("ZEPHON_CACHE", str(cache))  # the job inherits it
    run = tmp_path / "run"
    job = train03(run, 1, "--zephon.store", f"s3://{s3.bucket}/e2e-raw/*.jsonl",
                  "--training.steps", "3").check()  # fmt: skip
    assert job.output.count("Zephon: preparing the raw inputs") == 1, job.output[-3000:]
    assert not (REPO / "s3:").exists()
    capsys.readouterr()
    code = main(["verify", str(recorded.RECORDED / "raw"), str(run), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["matches"] == report["steps_compared"] == 3, report
    (entry,) = [p for p in cache.iterdir() if p.name.startswith("raw-") and p.is_dir()]
    assert (entry / "blocks.json").is_file()  # prepare's block checksums, in the cache too
    assert not [p for p in (cache / "remote-inputs").rglob("*") if p.is_file()]
    for text in (job.output,):
        assert SECRET not in text and SESSION not in text
    for p in [*run.rglob("*"), *cache.rglob("*")]:
        if p.is_file():
            data = p.read_bytes()
            assert SECRET.encode() not in data and SESSION.encode() not in data, p
