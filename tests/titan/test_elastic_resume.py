"""Elastic resume: a checkpoint taken under one topology continues the exact data
stream under another (DP degree, local batch size, TP), and bad resumes are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_losses,
    assert_refused,
    assert_same_data,
    assert_unchanged,
    log_records,
    resume_events,
    tree,
)
from tests.titan.launch import copy_run_until, train
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.tracker import read_log


def show_json(run: Path, step: int) -> dict:
    """``zephon show RUN --step N --json``, as a user runs it."""
    from tests.titan.launch import REPO, job_env

    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", "show", str(run), "--step", str(step),
         "--json"],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


TP2 = ("--parallelism.tensor_parallel_degree", "2")
SLOW = pytest.mark.slow  # torchrun jobs of a minute or more: `scripts/test.sh -m slow`


@pytest.mark.parametrize(
    "name, nproc, overrides, dp_degree",
    [
        ("2_to_1", 1, (), 1),
        # long (4 ranks): -m slow; test_resume_fsdp_x_tp_to_fsdp keeps TP in the default suite
        pytest.param(
            "2_to_4_local_batch_1", 4, ("--training.local_batch_size", "1"), 4, marks=SLOW
        ),
        pytest.param("fsdp_to_fsdp_x_tp", 4, TP2, 2, marks=SLOW),
    ],
)
def test_resume_from_two_ranks(
    e2e_root: Path, reference: Path, request, name, nproc, overrides, dp_degree
):
    if name == "2_to_1":  # the shared run (tests/conftest.py): tests/cli reads it too
        run = request.getfixturevalue("resumed_on_one_rank")
    else:
        run = copy_run_until(reference, e2e_root / name, 4)
        train(run, nproc, *overrides).check()
    assert_same_data(reference, run, range(1, 9))
    assert_losses(reference, run, range(5, 9), rtol=TOPOLOGY_RTOL)
    (event,) = resume_events(run)
    assert (event["from_step"], event["world_size"], event["dp_degree"]) == (4, nproc, dp_degree)
    # zephon show: each step at the DP degree it was trained at (issue 28, item 2)
    for step, degree in ((2, 2), (6, dp_degree)):
        info = show_json(run, step)
        assert (info["dp_degree"], info["dp_degree_from"]) == (degree, "trained"), info
        assert [s["dp_rank"] for s in info["samples"]] == [i * degree // 8 for i in range(8)]
    val_ref = runs.read_scalars(reference, "validation_metrics/loss")
    val = runs.read_scalars(run, "validation_metrics/loss")
    assert abs(val[8] - val_ref[8]) <= TOPOLOGY_RTOL * val_ref[8], (val, val_ref)


# slow (issue 44 part e): the other direction (2 -> 1) by tests/cli/test_verify.py; the same
# rule
@pytest.mark.slow
def test_resume_one_rank_to_two(e2e_root: Path, reference: Path, reference_one_rank: Path):
    one = reference_one_rank
    assert_same_data(reference, one, range(1, 9))
    run = copy_run_until(one, e2e_root / "1_to_2", 4)
    train(run, 2).check()
    assert_same_data(reference, run, range(1, 9))
    assert_losses(one, run, range(5, 9), rtol=TOPOLOGY_RTOL)


# slow (issue 44 part e): TP x an elastic resume; TP by
# test_train_e2e.py::test_tp_two_ranks_trains_on_the_same_data, resumes on other degrees by
# tests/cli/test_verify.py
@pytest.mark.slow
def test_resume_fsdp_x_tp_to_fsdp(e2e_root: Path, reference_fsdp_tp: Path, reference: Path):
    run = copy_run_until(reference_fsdp_tp, e2e_root / "fsdp_x_tp_to_fsdp", 4)
    train(run, 2).check()
    assert_same_data(reference, run, range(1, 9))
    assert_losses(reference_fsdp_tp, run, range(5, 9), rtol=TOPOLOGY_RTOL)


# ------------------------------------------------------------ refused resumes


@pytest.fixture(scope="module")
def other_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with other contents, tokenized with the same shipped tokenizer."""
    import pydoc_data.topics

    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
    from torchtitan_zephon.ingest.prepare import prepare_store

    root = tmp_path_factory.mktemp("other_store")
    src = root / "text"
    src.mkdir()
    for k in sorted(pydoc_data.topics.topics)[:40]:
        (src / f"{k}.txt").write_text(pydoc_data.topics.topics[k] * 3)
    prepare_store([str(src)], str(TOKENIZER_DIR), str(root / "store"), progress=False)
    return root / "store"


# slow (issue 44 part e): a data config change refused end to end by test_mixture_e2e.py and
# test_packing_e2e.py, every field in-process
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, overrides, expected",
    [
        ("seed", ("--zephon.seed", "5"), ["seed: 0 -> 5"]),
        # the resume rule's refusals are unit-tested field by field (tests/order); -m slow
        pytest.param("seq_len", ("--training.seq_len", "32"), ["seq_len: 64 -> 32"], marks=SLOW),
        pytest.param("store", None, ["store_fingerprint"], marks=SLOW),
    ],
)
def test_changed_data_config_is_refused(
    e2e_root: Path, reference: Path, other_store: Path, name, overrides, expected
):
    run = copy_run_until(reference, e2e_root / f"refused_{name}", 4)
    if overrides is None:
        overrides = ("--zephon.store", str(other_store))
    before = tree(run)
    job = train(run, 2, *overrides, log=e2e_root / f"refused_{name}.log")
    assert_refused(job, "Differing fields", *expected, "allow_changes")
    assert_unchanged(before, tree(run))


# slow (issue 44 part e): the opt-in in-process (tests/order/test_state.py), a resume across
# a data config change by test_mixture_e2e.py
@pytest.mark.slow
def test_changed_seed_accepted_with_explicit_opt_in(e2e_root: Path, reference: Path):
    run = copy_run_until(reference, e2e_root / "seed_opt_in", 4)
    train(run, 2, "--zephon.seed", "5", "--zephon.allow_changes", "seed").check()
    (event,) = resume_events(run)
    assert event["from_step"] == 4


@pytest.mark.slow
def test_log_from_another_run_is_refused_unless_ignored(e2e_root: Path, reference: Path):
    other = (
        train(e2e_root / "other_seed", 1, "--zephon.seed", "9", "--training.steps", "4").check().run
    )
    run = copy_run_until(reference, e2e_root / "foreign_log", 4)
    (run / "zephon" / "sequence_log.jsonl").write_bytes(
        (other / "zephon" / "sequence_log.jsonl").read_bytes()
    )
    before = tree(run)
    job = train(run, 2, log=e2e_root / "foreign_log.log")
    assert_refused(job, "does not match the checkpoint of step 4")
    assert_unchanged(before, tree(run))
    # --zephon.ignore_log_mismatch: the job continues, warns, and the resume event says so
    job = train(run, 1, "--zephon.ignore_log_mismatch").check()
    assert "continuing because zephon.ignore_log_mismatch is set" in job.output
    (event,) = resume_events(run)
    assert event["from_step"] == 4 and "record of step 4 has chain" in event["log_mismatch_ignored"]
    assert sorted(log_records(run)) == [1, 2, 3, 4, 5, 6, 7, 8]  # 1-4: the foreign run's
    assert_same_data(reference, run, range(5, 9))


@pytest.mark.slow
def test_incomplete_last_checkpoint_is_skipped_with_a_warning(e2e_root: Path, reference: Path):
    """A job died while writing checkpoint 8: resume from 4, warn, same data."""
    run = copy_run_until(reference, e2e_root / "incomplete_checkpoint", 8)
    (run / "checkpoint" / "step-8" / ".metadata").unlink()
    job = train(run, 1).check()
    assert "checkpoint" in job.output and "is incomplete" in job.output
    assert resume_events(run)[-1]["from_step"] == 4
    assert_same_data(reference, run, range(1, 9))


@pytest.mark.slow
def test_batch_schedule_changes_gradient_accumulation_and_resumes(e2e_root: Path):
    """GBS 8 for steps 1-4, 16 from step 5: positions are accounted exactly, the trainer
    accumulates 2x the micro-batches, and a 2 -> 1 rank resume inside it continues."""
    sched = ("--zephon.batch_schedule", "1:8,5:16")
    ref = train(e2e_root / "schedule_ref", 2, *sched).check().run
    records = log_records(ref)
    assert [records[s]["num_samples"] for s in range(1, 9)] == [8] * 4 + [16] * 4
    assert [records[s]["first_position"] for s in range(1, 9)] == [0, 8, 16, 24, 32, 48, 64, 80]
    run = copy_run_until(ref, e2e_root / "schedule_resumed", 4)
    train(run, 1, *sched).check()
    assert_same_data(ref, run, range(1, 9))
    assert_losses(ref, run, range(5, 9), rtol=TOPOLOGY_RTOL)
    refused = train(copy_run_until(ref, e2e_root / "schedule_dropped", 4), 2)
    assert refused.returncode != 0 and "schedule" in refused.output


def test_trainer_state_without_data_state_is_refused(e2e_root: Path, reference: Path):
    run = copy_run_until(reference, e2e_root / "no_data_state", 4)
    before = tree(run)
    job = train(run, 1, "--checkpoint.exclude_from_loading", "dataloader", log=e2e_root / "nds.log")
    assert_refused(job, "restore the trainer at step 4 but no Zephon data state")
    assert_unchanged(before, tree(run))


def test_resume_onto_edited_store_content_fails_at_the_step_reading_it(
    e2e_root: Path, reference: Path
):
    """One token edited in place (same size, same fingerprint): the resume is accepted,
    and the job stops at step 5, whose first micro-batch reads the edited chunk, naming
    it; no step after 4 is logged or checkpointed."""
    from tests.conftest import copy_store, edit_token
    from torchtitan_zephon.ingest.builtin import builtin_store_path
    from torchtitan_zephon.order.layout import BatchSchedule
    from torchtitan_zephon.order.stream import DataPlan
    from torchtitan_zephon.store.reader import TokenStore

    store = copy_store(builtin_store_path(), e2e_root / "edited_store")
    num_samples = TokenStore.open(store).num_samples(64) - 16  # tiny.toml: seq_len, heldout
    sample = int(DataPlan(num_samples, 0, BatchSchedule([(1, 8)])).global_ids(5)[0])
    token = sample * 64 + 10
    edit_token(store, token)
    run = copy_run_until(reference, e2e_root / "edited_store_resume", 4)
    job = train(run, 1, "--zephon.store", str(store))
    assert job.returncode != 0
    assert f"chunk {token // 65536} of tokens.bin" in job.output, job.output[-3000:]
    assert str(store) in job.output
    assert resume_events(run)[-1]["from_step"] == 4  # accepted: the manifest is unchanged
    log = read_log(run / "zephon" / "sequence_log.jsonl")
    assert max(log.records) == 4, sorted(log.records)  # the old 5..8 are superseded
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-4"]
