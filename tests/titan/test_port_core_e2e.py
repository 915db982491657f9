"""End-to-end on TorchTitan 0.3: Zephon's registry job trains on 2 CPU ranks and
resumes exactly on 1 (``python -m torchtitan_zephon.train --module
torchtitan_zephon.configs --config llama3_tiny``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_losses,
    assert_refused,
    assert_same_data,
    assert_unchanged,
    assert_verify_match,
    resume_events,
    tree,
)
from tests.titan.launch import copy_run_until, train03

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 CPU ranks, 8 steps, checkpoints at 4 and 8."""
    run = tmp_path_factory.mktemp("port03") / "fresh"
    job = train03(run, 2).check()
    assert "CPU platform: 2 attention module(s) FlexAttention -> DocumentSDPA" in job.output
    return run


def test_resume_at_one_rank_matches_the_two_rank_run(fresh: Path, tmp_path: Path) -> None:
    resumed = copy_run_until(fresh, tmp_path / "resumed", 4)
    job = train03(resumed, 1).check()
    assert "Zephon: resuming at step 5 (position 32) under DP degree 1" in job.output
    (event,) = resume_events(resumed)
    assert (event["from_step"], event["world_size"], event["dp_degree"]) == (4, 1, 1)
    assert_same_data(fresh, resumed, range(1, 9))
    assert_losses(fresh, resumed, range(5, 9), rtol=TOPOLOGY_RTOL)
    assert_verify_match(fresh, resumed)


# slow (issue 44 part e): the same refusal end to end by default
# (tests/titan/test_run_folder.py::test_start_that_would_supersede_a_history_is_refused)
@pytest.mark.slow
def test_a_start_that_would_supersede_history_changes_nothing(fresh: Path) -> None:
    before = tree(fresh)
    job = train03(fresh.parent / "elsewhere-log", 1, "--dump_folder", str(fresh),
                  "--checkpoint.no-enable")  # fmt: skip
    assert_refused(job, f"the run folder {fresh} holds checkpoints step-4, step-8",
                   "--zephon.start_over")  # fmt: skip
    assert_unchanged(before, tree(fresh))


@pytest.mark.slow
def test_fresh_runs_at_one_and_two_ranks_follow_one_loss_curve(fresh: Path, tmp_path: Path) -> None:
    """Topology-free initial weights (TorchTitan 0.3's init_states under titan/weights/init.py):
    the same data and the same start, so the same losses up to reduction order."""
    one = tmp_path / "one_rank"
    train03(one, 1).check()
    assert_same_data(fresh, one, range(1, 9))
    assert_losses(fresh, one, range(1, 9), rtol=TOPOLOGY_RTOL)
