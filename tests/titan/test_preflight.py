"""The preflight, without torchrun: which checkpoint a job resumes (TorchTitan's rule, corrupt
and incomplete ones skipped), what it refuses, and that deciding writes nothing."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan.expect import assert_unchanged, tree
from torchtitan_zephon import runs
from torchtitan_zephon.data.plan import BatchSchedule
from torchtitan_zephon.data.state import DataConfig, DataState, DataStateMismatch
from torchtitan_zephon.titan import preflight
from torchtitan_zephon.titan.preflight import StartRefused, choose_checkpoint, plan_start
from torchtitan_zephon.tracker import SequenceTracker, log_path

CONFIG = DataConfig.make(
    seq_len=64,
    seed=0,
    schedule=BatchSchedule([(1, 8)]),
    sample_offset=0,
    num_samples=1000,
    store_fingerprint="f" * 64,
    tokenizer_hash="t" * 64,
)
TOPOLOGY = {"world_size": 1, "dp_degree": 1, "nnodes": 1}


def job(run: Path, **checkpoint) -> SimpleNamespace:
    ck = dict(
        enable=True,
        folder="checkpoint",
        load_step=-1,
        initial_load_path=None,
        initial_load_model_only=True,
        initial_load_in_hf=False,
        exclude_from_loading=[],
    )
    ck.update(checkpoint)
    zephon = SimpleNamespace(
        allow_changes=[], ignore_log_mismatch=False, start_over=False, audit="ids"
    )
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(run)),
        checkpoint=SimpleNamespace(**ck),
        zephon=zephon,
    )


def write_log(run: Path, steps: int) -> list[dict]:
    """A log of ``steps`` steps under CONFIG; returns each step's chain head."""
    tracker = SequenceTracker(log_path(run), config=CONFIG, writer=True)
    tracker.start(TOPOLOGY)
    heads = []
    for s in range(1, steps + 1):
        tracker.record(s, (s - 1) * 8, np.arange((s - 1) * 8, s * 8))
        heads.append(tracker.head())
    return heads


def save(run: Path, step: int, *, head: dict | None = None, model_only: bool = False) -> Path:
    """A DCP checkpoint like TorchTitan's: model weights, and unless ``model_only`` the
    optimizer, train state and Zephon data state of ``step``."""
    state: dict = {"tok_embeddings.weight": torch.arange(4096.0).reshape(64, 64)}
    if not model_only:
        data = DataState(CONFIG, step + 1, step * 8, tracker=head)
        state["optimizer"] = {"state.tok_embeddings.weight.exp_avg": torch.zeros(64, 64)}
        state["train_state"] = {"step": step}
        state["dataloader"] = {"zephon": data.to_json()}
    path = run / "checkpoint" / f"step-{step}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def shard(path: Path) -> Path:
    (found,) = path.glob("*.distcp")
    return found


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder: log of 8 steps, full checkpoints at 4 and 8."""
    heads = write_log(tmp_path, 8)
    save(tmp_path, 4, head=heads[3])
    save(tmp_path, 8, head=heads[7])
    return tmp_path


@pytest.fixture
def current_config(monkeypatch: pytest.MonkeyPatch) -> DataConfig:
    """Stand in for the store and train-spec checks (tested end to end elsewhere)."""
    monkeypatch.setattr(preflight, "_check_job", lambda job_config: CONFIG)
    return CONFIG


# ---------------------------------------------------------------- verifying checkpoints


def test_verify_checkpoint_finds_short_and_missing_shards_and_a_bad_metadata(run: Path):
    ck8 = run / "checkpoint" / "step-8"
    ok = runs.checkpoints(run, verify=True)
    assert [(c.step, c.status, c.holds) for c in ok] == [
        (4, "complete", "training"),
        (8, "complete", "training"),
    ]
    size = shard(ck8).stat().st_size
    os.truncate(shard(ck8), size - 1)
    (c8,) = [c for c in runs.checkpoints(run, verify=True) if c.step == 8]
    assert c8.status == "corrupt" and not c8.resumable
    assert c8.problem == (
        f"shard {shard(ck8).name} is truncated: {size - 1} bytes, its .metadata needs at "
        f"least {size}"
    )
    shard(ck8).unlink()
    (c8,) = [c for c in runs.checkpoints(run, verify=True) if c.step == 8]
    assert c8.problem == "shard __0_0.distcp is missing"
    os.truncate(ck8 / ".metadata", 10)
    (c8,) = [c for c in runs.checkpoints(run, verify=True) if c.step == 8]
    assert c8.status == "corrupt" and c8.problem.startswith(".metadata is unreadable")


# ---------------------------------------------------------------- choosing


def test_newest_good_checkpoint_is_chosen_and_pinned(run: Path):
    os.truncate(shard(run / "checkpoint" / "step-8"), 100)
    j = job(run)
    before = tree(run)
    chosen, plan, _ = choose_checkpoint(j)
    assert chosen.step == 4 and j.checkpoint.load_step == 4  # TorchTitan loads what was checked
    assert [(c.step, c.status) for c in plan.skipped] == [(8, "corrupt")]
    assert_unchanged(before, tree(run))
    # the same files give every rank the same choice
    j2 = job(run)
    assert choose_checkpoint(j2)[0].step == 4 and j2.checkpoint.load_step == 4


def test_incomplete_newest_checkpoint_is_skipped(run: Path):
    (run / "checkpoint" / "step-8" / ".metadata").unlink()
    chosen, plan, _ = choose_checkpoint(job(run))
    assert chosen.step == 4 and [(c.step, c.status) for c in plan.skipped] == [(8, "incomplete")]


def test_no_loadable_checkpoint_is_refused(run: Path):
    for step in (4, 8):
        os.truncate(shard(run / "checkpoint" / f"step-{step}"), 100)
    with pytest.raises(StartRefused, match="no checkpoint in .* can be loaded .*step-4: shard"):
        choose_checkpoint(job(run))


def test_explicit_load_step_of_a_corrupt_checkpoint_is_refused(run: Path):
    os.truncate(shard(run / "checkpoint" / "step-8"), 100)
    with pytest.raises(StartRefused, match="--checkpoint.load_step=8 names .* which is corrupt"):
        choose_checkpoint(job(run, load_step=8))
    with pytest.raises(StartRefused, match="--checkpoint.load_step=6 but .* does not exist"):
        choose_checkpoint(job(run, load_step=6))
    chosen, _, _ = choose_checkpoint(job(run, load_step=4))
    assert chosen.step == 4


def test_checkpointing_off_or_nothing_saved_resumes_nothing(run: Path, tmp_path_factory):
    assert choose_checkpoint(job(run, enable=False))[0] is None
    fresh = tmp_path_factory.mktemp("fresh")
    chosen, _, why = choose_checkpoint(job(fresh))
    assert chosen is None and "no checkpoint folder" in why


# ---------------------------------------------------------------- refusing


def test_model_only_checkpoint_names_the_last_full_one(run: Path, current_config):
    import shutil

    shutil.rmtree(run / "checkpoint" / "step-8")
    save(run, 8, model_only=True)
    before = tree(run)
    with pytest.raises(StartRefused) as e:
        plan_start(job(run), writer=True)
    assert "step-8 holds only the model" in str(e.value)
    assert "--checkpoint.load_step 4 (steps 5..8 trained again" in str(e.value)
    assert "--checkpoint.no-last_save_model_only" in str(e.value)
    assert_unchanged(before, tree(run))
    assert plan_start(job(run, load_step=4), writer=True).resume.step == 4


def test_resume_checks_the_data_config_and_the_log_without_writing(run: Path, current_config):
    j = job(run)
    plan = plan_start(j, writer=True)
    assert plan.resume.step == 8 and plan.state.next_step == 9
    # another log (its step 8 has another chain), without the index sidecars: the check
    # reads the whole log and must not rebuild the index (a refused start writes nothing)
    log_path(run).unlink()
    for sidecar in log_path(run).parent.glob("*.jsonl.*"):
        sidecar.unlink()
    other = SequenceTracker(log_path(run), config=CONFIG, writer=True)
    other.start(TOPOLOGY)
    for s in range(1, 9):
        other.record(s, (s - 1) * 8, np.arange(s, s + 8))
    for sidecar in log_path(run).parent.glob("*.jsonl.*"):
        sidecar.unlink()
    before = tree(run)
    with pytest.raises(StartRefused, match="does not match the checkpoint of step 8"):
        plan_start(job(run), writer=True)
    assert_unchanged(before, tree(run))
    j = job(run)
    j.zephon.ignore_log_mismatch = True  # accepted here; the dataloader warns and marks it
    assert plan_start(j, writer=True).resume.step == 8
    assert plan_start(job(run), writer=False).resume.step == 8  # the log is rank 0's


def test_changed_data_config_is_refused_with_the_trainer_hint(run: Path, monkeypatch):
    import dataclasses

    monkeypatch.setattr(preflight, "_check_job", lambda j: dataclasses.replace(CONFIG, seed=3))
    with pytest.raises(DataStateMismatch, match="(?s)seed: 0 -> 3.*--zephon.allow_changes"):
        plan_start(job(run), writer=False)
    j = job(run)
    j.zephon.allow_changes = ["seed"]
    assert plan_start(j, writer=False).resume.step == 8


@pytest.mark.parametrize("exclude", ["dataloader", "train_state"])
def test_excluding_the_data_or_trainer_state_is_refused(run: Path, current_config, exclude):
    with pytest.raises(StartRefused, match=f"'{exclude}' is in checkpoint.exclude_from_loading"):
        plan_start(job(run, exclude_from_loading=[exclude]), writer=False)


def test_history_not_resumed_is_refused_unless_start_over_or_same_job(run: Path, current_config):
    before = tree(run)
    with pytest.raises(StartRefused) as e:
        plan_start(job(run, enable=False), writer=True)
    message = str(e.value)
    assert "holds checkpoints step-4, step-8 and a sequence log with steps 1..8" in message
    assert "(checkpoint.enable is false)" in message and "--zephon.start_over" in message
    assert_unchanged(before, tree(run))
    assert plan_start(job(run, enable=False), writer=False).notes == []  # rank 0 decides
    j = job(run, enable=False)
    j.zephon.start_over = True
    assert "zephon.start_over" in plan_start(j, writer=True).notes[0]
    plan = plan_start(job(run, enable=False), writer=True, same_job=True)
    assert "an elastic restart of this job" in plan.notes[0]


def test_log_with_steps_and_no_checkpoint_is_refused(tmp_path: Path, current_config):
    write_log(tmp_path, 3)
    with pytest.raises(StartRefused, match="holds a sequence log with steps 1..3"):
        plan_start(job(tmp_path), writer=True)
    # a log with a start event only (a job that died before its first step) is no history
    log_path(tmp_path).unlink()
    for sidecar in log_path(tmp_path).parent.glob("*.jsonl.*"):
        sidecar.unlink()
    SequenceTracker(log_path(tmp_path), config=CONFIG, writer=True).start(TOPOLOGY)
    assert plan_start(job(tmp_path), writer=True).resume is None
