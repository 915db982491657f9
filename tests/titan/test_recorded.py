"""What main recorded before the house refactor, checked on the code under test.

Three jobs (the default job, a mixture with a weight change and a batch-size schedule,
a raw-input job) were trained on main at 2 ranks; their sequence logs are in
``tests/titan/recorded_main/`` (see ``tests/titan/recorded.py``). Here the same jobs
train at 1 rank and ``zephon verify`` must say MATCH at every step: the same ordered
sample ids, token digests and data config. Store fingerprints and ``zephon plan``
output at near and far steps (10^6, 10^8) must equal the recorded values too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.titan import recorded
from tests.titan.launch import train
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.tracker import read_log


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recorded_inputs")
    recorded.write_mixture(root)
    recorded.write_raw(root)
    return root


def start_event(run: Path) -> dict:
    (start,) = [e for e in read_log(run / "zephon" / "sequence_log.jsonl").events
                if e["event"] == "start"]  # fmt: skip
    return start


def assert_matches_recorded(job: str, run: Path, capsys: pytest.CaptureFixture) -> None:
    expected = recorded.RECORDED / job
    assert start_event(run)["data_config"] == start_event(expected)["data_config"]
    capsys.readouterr()
    code = main(["verify", str(expected), str(run), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert (report["steps_compared"], report["tokens_compared"], report["matches"]) == (8, 8, 8)


def test_the_default_job_sees_what_main_recorded(reference_one_rank: Path, capsys):
    assert_matches_recorded("default", reference_one_rank, capsys)


@pytest.mark.parametrize("job", ["mixture", "raw"])
def test_a_job_sees_what_main_recorded(
    job: str, inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))  # a fresh raw-input entry
    run = train(tmp_path / job, 1, *recorded.job_overrides(job, inputs)).check().run
    assert_matches_recorded(job, run, capsys)


def test_fingerprints_and_plans_are_what_main_recorded(inputs: Path, tmp_path: Path, capsys):
    expected = json.loads((recorded.RECORDED / "plans.json").read_text())
    store = tmp_path / "store"
    assert recorded.prepare_store(inputs / "corpus.jsonl", store) == expected["store_fingerprint"]
    capsys.readouterr()
    plans = recorded.plan_outputs(store, inputs / "mixture.toml")
    for name, _ in recorded.PLANS:
        assert plans[name] == expected[name], f"zephon plan {name} differs from main's"
