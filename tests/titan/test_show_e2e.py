"""``zephon show`` / ``where`` / ``spikes`` on a run the trainer made (2 ranks, torchrun):
the ids show prints for a step are those the trainer logged (the ids digest of each
record, recomputed from show's ids), where finds a document at the step show shows it
at, and spikes reads TorchTitan 0.3's own event files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.tracker import read_log
from torchtitan_zephon.tracker.records import ids_digest


def _json(capsys, *argv: str) -> list[dict]:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


def test_show_where_and_spikes_on_a_trained_run(reference: Path, capsys):
    log = read_log(reference / "zephon" / "sequence_log.jsonl")
    config = DataConfig.from_dict(log.events[0]["data_config"])
    for step, record in sorted(log.records.items()):
        (info,) = _json(capsys, "show", str(reference), "--step", str(step), "--json")
        ids = np.array([s["sample"] for s in info["samples"]], dtype=np.int64)
        assert info["slots"][0] == record["first_position"]
        assert (
            ids_digest(ids, config.step_key(step), record["first_position"]) == record["ids_digest"]
        )
        assert info["status"] == "trained" and info["dp_degree"] == 2
        assert all(
            s["text"] and s["documents"] for s in info["samples"]
        )  # the builtin store, found
    (later,) = _json(capsys, "show", str(reference), "--step", "9", "--json")
    assert later["status"] == "planned"
    # the document of step 3's sample 5: where finds it there (rank 1, its second sample)
    (info,) = _json(capsys, "show", str(reference), "--step", "3", "--sample", "5", "--json")
    sample = info["samples"][0]
    hits = _json(
        capsys, "where", str(reference), "--doc", str(sample["documents"][0]["document"]), "--json"
    )
    assert {
        "epoch": 0, "sample": sample["sample"], "stream_position": 21, "status": "trained",
        "step": 3, "index": 5, "dp_rank": 1, "rank_index": 1,
    } in hits  # fmt: skip
    # TorchTitan's own event files: every logged step read, no spike in this short run
    assert main(["spikes", str(reference), "--window", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{reference}: 8 logged steps (1..8), ")
    assert len(runs.read_scalars(reference)) == 8


def test_the_run_folder_alone_is_enough_for_the_tools(tmp_path: Path):
    """A run on a prepared store, without TorchTitan's saved job config: `zephon show`
    finds the store and tokenizer from the run folder (zephon/run_data.json, written at
    the start), as a user runs it."""
    import subprocess
    import sys

    from tests.titan.launch import REPO, job_env, train
    from tests.titan.test_raw_inputs import write_jsonl
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR

    data = write_jsonl(tmp_path / "docs.jsonl", topics=40)
    store = tmp_path / "store"
    argv = ["prepare", str(data), "--tokenizer", str(TOKENIZER_DIR), "--output", str(store)]
    assert main([*argv, "--quiet", "--workers", "1"]) == 0
    run = tmp_path / "run"
    train(run, 1, "--zephon.store", str(store), "--training.steps", "2",
          "--validation.no-enable").check()  # fmt: skip
    assert not list(run.glob("*.json"))  # no saved job config
    recorded = json.loads((run / "zephon" / "run_data.json").read_text())
    assert recorded["store"] == {"given": str(store), "opened": str(store)}
    outputs = {}
    for command in (["show", str(run), "--step", "2", "--json"], ["inspect", str(run)]):
        out = subprocess.run(
            [sys.executable, "-m", "torchtitan_zephon", *command],
            cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0 and out.stderr == "", out.stderr  # no "not found" note
        outputs[command[0]] = out.stdout
    assert f"    store:     {store}\n" in outputs["inspect"]
    info = json.loads(outputs["show"])
    assert len(info["samples"]) == 8 and all(s["documents"] and s["text"] for s in info["samples"])
