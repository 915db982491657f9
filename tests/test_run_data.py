"""zephon/run_data.json: what a run records of its job's data for Zephon's tools (the store
as given and opened, the tokenizer, the left-out list, the checkpoint folder, the data
config), with no secret in it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.run_data import (
    RUN_DATA,
    read_run_data,
    record_job,
    recorded,
    run_data_path,
    write_run_data,
)
from torchtitan_zephon.order.layout import BatchSchedule


def test_a_job_records_its_store_tokenizer_and_data_config(tmp_path: Path, store, store_path):
    data = JobData.of_store(store, 8)
    config = data.data_config(seed=3, schedule=BatchSchedule.parse("4"))
    zephon = SimpleNamespace(store="given/path", mixture="", exclude="")
    path = record_job(tmp_path / "run", zephon, tokenizer="tok", checkpoint_folder="ck",
                      data=data, data_config=config.to_dict())  # fmt: skip
    assert path == tmp_path / "run" / "zephon" / RUN_DATA
    got = read_run_data(tmp_path / "run")
    assert recorded(got, "store", "given") == "given/path"
    assert recorded(got, "store", "opened") == str(store_path)
    assert recorded(got, "tokenizer") == str(Path("tok").resolve())
    assert recorded(got, "exclude") == "" and got["mixture"] is None
    assert recorded(got, "checkpoint_folder") == "ck"
    assert got["data_config"] == config.to_dict()
    assert [p.name for p in path.parent.iterdir()] == [RUN_DATA]  # nothing left aside


def test_no_secret_reaches_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    write_run_data(
        tmp_path, store="s3://bucket/data?X-Amz-Signature=abcdef", opened="s3://bucket/data",
        mixture="", sources={}, tokenizer="/tok/s3cr3t-value", exclude="",
        checkpoint_folder="checkpoint", data_config={},
    )  # fmt: skip
    text = run_data_path(tmp_path).read_text()
    assert "abcdef" not in text and "s3cr3t-value" not in text
    assert recorded(json.loads(text), "store", "given") == "s3://bucket/data?<redacted>"


@pytest.mark.parametrize("content", [None, "", "{not json", '["a list"]', '{"format": "other"}'])
def test_a_missing_or_foreign_record_reads_as_empty(tmp_path: Path, content):
    if content is not None:
        run_data_path(tmp_path).parent.mkdir()
        run_data_path(tmp_path).write_text(content)
    assert read_run_data(tmp_path) == {}
    assert recorded({}, "store", "given") == ""
