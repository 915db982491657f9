"""zephon inspect on run folders and DCP checkpoint folders."""

from __future__ import annotations

import json
import shutil

from tests.cli.test_verify import real_runs, write_log  # noqa: F401 (fixture)
from torchtitan_zephon.cli.main import main


def inspect(capsys, path, *flags) -> tuple[int, str, str]:
    rc = main(["inspect", str(path), *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_real_run_folder(real_runs, capsys):  # noqa: F811
    rc, out, _ = inspect(capsys, real_runs.resumed)
    assert rc == 0
    assert out.startswith(f"run folder: {real_runs.resumed}")
    assert "config: not saved" in out
    assert "step-4" in out and "step-8" in out and "complete" in out
    assert "latest complete checkpoint: step 8" in out
    assert "next step:          9" in out and "consumed positions: 64" in out
    assert "resumed from step 4: world_size 1, dp_degree 1" in out
    assert "loss (tensorboard, 2 event files): steps 1..8" in out
    rc, out, _ = inspect(capsys, real_runs.resumed, "--json")
    info = json.loads(out)
    assert info["kind"] == "run" and info["latest_complete_checkpoint"] == 8
    assert [(c["step"], c["complete"]) for c in info["checkpoints"]] == [(4, True), (8, True)]
    state = info["data_state"]
    assert state["next_step"] == 9 and state["consumed_positions"] == 64
    assert state["data_config"]["seq_len"] == 64 and state["store_fingerprint"]
    log = info["sequence_log"]
    assert log["records"] == 8 and log["last_step"] == 8 and log["tokens_digests"]
    assert log["head"]["chain"] == state["tracker"]["chain"]  # the checkpoint matches its log
    assert [r["from_step"] for r in log["resumes"]] == [4]
    assert info["loss"]["steps"] == 8 and info["loss"]["source"] == "tensorboard"


def test_checkpoint_folder_and_an_incomplete_one(real_runs, capsys, tmp_path):  # noqa: F811
    ck = real_runs.ref / "checkpoint" / "step-4"
    rc, out, _ = inspect(capsys, ck)
    assert rc == 0 and out.startswith(f"checkpoint: {ck}")
    assert "status: complete" in out and "next step:          5" in out
    rc, out, _ = inspect(capsys, ck, "--json")
    info = json.loads(out)
    assert info["kind"] == "checkpoint" and info["step"] == 4 and info["complete"]
    assert info["data_state"]["tracker"]["step"] == 4
    assert info["data_state"]["consumed_positions"] == 32

    # a run whose last checkpoint was interrupted: no .metadata
    run = tmp_path / "run"
    shutil.copytree(real_runs.ref, run)
    (run / "checkpoint" / "step-8" / ".metadata").unlink()
    rc, out, _ = inspect(capsys, run / "checkpoint" / "step-8")
    assert rc == 0 and "INCOMPLETE" in out and "data state: unavailable" in out
    rc, out, _ = inspect(capsys, run)
    assert rc == 0 and "latest complete checkpoint: step 4" in out
    assert "INCOMPLETE (no .metadata" in out and "next step:          5" in out


def test_corrupt_checkpoint_and_the_folder_owner(real_runs, capsys, tmp_path):  # noqa: F811
    """A shard cut short after .metadata was written: inspect calls the checkpoint corrupt
    (as the trainer does, which skips it) and names the job holding the folder."""
    import dataclasses
    import os
    import subprocess
    import sys

    from torchtitan_zephon.run.holder import Holder, lock_path
    from torchtitan_zephon.run.process import Process

    run = tmp_path / "run"
    shutil.copytree(real_runs.ref, run)
    shard = run / "checkpoint" / "step-8" / "__0_0.distcp"
    os.truncate(shard, 100)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_path(run).write_text(
        Holder("t", dataclasses.replace(Process.of(os.getpid()), pid=dead.pid)).to_json()
    )
    rc, out, _ = inspect(capsys, run)
    assert rc == 0
    assert "step-8" in out and "CORRUPT (shard __0_0.distcp is truncated: 100 bytes" in out
    assert "latest complete checkpoint: step 4" in out and "next step:          5" in out
    assert f"owner: host {Process.of(os.getpid()).host}, pid {dead.pid} (dead" in out
    rc, out, _ = inspect(capsys, run / "checkpoint" / "step-8")
    assert rc == 0 and "status: CORRUPT" in out and "data state: unavailable (corrupt" in out
    rc, out, _ = inspect(capsys, run, "--json")
    info = json.loads(out)
    assert [(c["step"], c["status"]) for c in info["checkpoints"]] == [
        (4, "complete"),
        (8, "corrupt"),
    ]
    assert info["checkpoints"][0]["holds"] == "training"
    assert info["owner"]["state"] == "dead" and info["owner"]["pid"] == dead.pid


def test_run_with_only_a_log_and_a_saved_config(tmp_path, capsys):
    run = write_log(tmp_path / "run", 5, resume_at=2, died_at=3)
    config = {
        "job": {"description": "x"},
        "training": {"steps": 5, "global_batch_size": 8},
        "zephon": {"seed": 3},
    }
    (run / "job_config.json").write_text(json.dumps(config))
    rc, out, _ = inspect(capsys, run)
    assert rc == 0
    assert "training.steps = 5" in out and "zephon.seed = 3" in out
    assert "checkpoints (0):" in out and "data state: none" in out
    assert "5 effective records, steps 1..5" in out and "resumed from step 2" in out
    assert "loss: unavailable (no losses" in out
    rc, out, _ = inspect(capsys, run, "--json")
    info = json.loads(out)
    assert info["config"]["summary"]["training.global_batch_size"] == 8
    assert info["data_state"] is None and "error" in info["loss"]


def test_corrupt_log_is_reported_not_raised(tmp_path, capsys):
    run = write_log(tmp_path / "run", 3)
    log = run / "zephon" / "sequence_log.jsonl"
    log.write_text("garbage\n" + log.read_text())
    rc, out, _ = inspect(capsys, run)
    assert rc == 0 and "sequence log: unavailable" in out and "not valid JSON" in out


def test_missing_and_unknown_paths_exit_2(tmp_path, capsys):
    rc, _, err = inspect(capsys, tmp_path / "nope")
    assert rc == 2 and "does not exist" in err and "run folder" in err
    rc, _, err = inspect(capsys, tmp_path)
    assert rc == 2 and "not something zephon recognises" in err


def test_a_run_lists_the_skips_that_took_effect(tmp_path, capsys):
    """Issue 22: the skip events of the effective history; a rollback before a skip drops
    it (a kept entry is logged again when its step is trained again)."""
    import numpy as np

    from tests.cli.test_verify import skip_log
    from torchtitan_zephon.order.data_config import DataConfig, data_extra
    from torchtitan_zephon.order.layout import BatchSchedule
    from torchtitan_zephon.tracker import SequenceTracker, log_path, read_log

    run = skip_log(tmp_path / "rolled", "", resume=(4, "5:3"))
    rc, out, _ = inspect(capsys, run)
    assert rc == 0 and "\n    skipped at step 5: the data of 3 steps (5..7)\n" in out
    # rolled back to step 4 again, the skip moved to step 6 (a continuation)
    config = DataConfig.make(
        seq_len=8, seed=0, schedule=BatchSchedule.parse("8"), sample_offset=0,
        num_samples=10_000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
        extra=data_extra(skip_steps="6:1"),
    )  # fmt: skip
    tracker = SequenceTracker(log_path(run), config=config, writer=True)
    tracker.resume({"step": 4, "chain": read_log(log_path(run)).records[4]["chain"]}, {})
    for s in range(5, 9):
        tracker.record(s, (s - 1) * 8, np.arange(s * 8, s * 8 + 8))
    rc, out, _ = inspect(capsys, run, "--json")
    assert json.loads(out)["sequence_log"]["skips"] == [{"step": 6, "steps": 1, "from_step": 5}]
    rc, out, _ = inspect(capsys, run)
    assert "skipped at step 5" not in out
    assert "\n    skipped at step 6: the data of 1 step (6..6)\n" in out
