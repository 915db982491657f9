"""End to end: real torchrun on CPU trains with FSDP, TP and FSDP x TP, checkpoints,
and resumes exactly under the same world size."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.titan.expect import assert_losses, assert_same_data, log_records, resume_events
from tests.titan.launch import copy_run_until, train
from torchtitan_zephon.run import recorded as runs


def assert_trained(run: Path, steps: int = 8) -> None:
    losses, source = runs.losses(run)
    assert source == "tensorboard"
    assert sorted(losses) == list(range(1, steps + 1))
    first, last = losses[1], losses[steps]
    assert last < first - 0.3, f"loss did not decrease: {first} -> {last}"
    cks = {c.step: c for c in runs.checkpoints(run)}
    assert cks[4].complete and cks[steps].complete, cks
    state = runs.read_data_state(cks[steps].path).to_dict()
    assert state["next_step"] == steps + 1 and state["tracker"]["step"] == steps
    assert sorted(log_records(run)) == list(range(1, steps + 1))
    val = runs.read_scalars(run, "validation_metrics/loss")
    assert sorted(val) == [1, 4, 8], val


def test_fsdp_two_ranks_trains_and_checkpoints(reference: Path):
    assert_trained(reference)
    log = (reference / "train.log").read_text()
    assert log.count("Training completed") == 2  # and no rank sleeps 2 s, nor says so
    assert "Sleeping 2 seconds" not in log


def test_tp_two_ranks_trains_on_the_same_data(e2e_root: Path, reference: Path):
    run = train(e2e_root / "tp2", 2, "--parallelism.tensor_parallel_degree", "2").check().run
    assert_trained(run)
    # DP degree 1 here, 2 in the reference: the data is the same all the same.
    assert_same_data(reference, run, range(1, 9))


# slow (issue 44 part e): FSDP x TP on 4 ranks; TP on 2 ranks by
# test_tp_two_ranks_trains_on_the_same_data
@pytest.mark.slow
def test_fsdp_tp_four_ranks_trains_on_the_same_data(reference_fsdp_tp: Path, reference: Path):
    assert_trained(reference_fsdp_tp)
    assert_same_data(reference, reference_fsdp_tp, range(1, 9))


# slow (issue 44 part e): a resume at the same degree, exact, by
# test_ft_e2e.py::test_every_group_dies_after_a_checkpoint_and_all_restart_exactly
@pytest.mark.slow
def test_resume_same_world_size_is_exact(e2e_root: Path, reference: Path):
    run = copy_run_until(reference, e2e_root / "resume_same", 4)
    train(run, 2).check()
    assert_same_data(reference, run, range(1, 9))
    assert_losses(reference, run, range(1, 9), rtol=0)
    (event,) = resume_events(run)
    assert event["from_step"] == 4 and event["world_size"] == 2 and event["dp_degree"] == 2
