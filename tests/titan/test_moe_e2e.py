"""End-to-end on TorchTitan 0.3 for the MoE model: Zephon's ``deepseek_v3_debug`` (the tiny
DeepSeek-V3-style MoE of ``configs.models``) trains on 2 gloo CPU ranks with expert
parallelism 2 (tokens cross ranks through the platform's all_to_all) and resumes at 1
rank (EP 1) on the same data, with the same losses within ``TOPOLOGY_RTOL``.

Tolerance: 1e-5 relative, the llama3 bound. Measured (8 steps, fresh runs, against 2
ranks EP 1): 1 rank 6.0e-8, 4 ranks 6.0e-8, 2 ranks EP 2 7.8e-7, 4 ranks EP 2 9.6e-7;
resumed at 1 rank after step 4: 6.0e-8 (from EP 1) and 1.2e-7 (from EP 2). Routing does
flip between topologies: the checkpointed ``expert_bias_E`` of the EP runs differs from
the 1-rank run's by one load-balancing sign event (one expert, one step, one layer;
token counts are integers, so their sum over DP is exact and only a token whose top-k
changed can move it), and the losses stay within 1e-6 of each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_losses,
    assert_same_data,
    assert_verify_match,
    resume_events,
)
from tests.titan.launch import copy_run_until, train03

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")

MOE = "deepseek_v3_debug"


@pytest.fixture(scope="module")
def fresh_ep2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 CPU ranks, FSDP 2 x EP 2, 8 steps, checkpoints at 4 and 8."""
    run = tmp_path_factory.mktemp("moe") / "fresh_ep2"
    job = train03(run, 2, "--parallelism.expert_parallel_degree", "2", config=MOE).check()
    assert "Building deepseek_v3 tiny" in job.output
    assert "dp_shard=2, cp=1, tp=1, ep=2" in job.output
    return run


def test_moe_resume_at_one_rank_matches_the_two_rank_ep_run(
    fresh_ep2: Path, tmp_path: Path
) -> None:
    resumed = copy_run_until(fresh_ep2, tmp_path / "resumed", 4)
    job = train03(resumed, 1, config=MOE).check()
    assert "Zephon: resuming at step 5 (position 32) under DP degree 1" in job.output
    (event,) = resume_events(resumed)
    assert (event["from_step"], event["world_size"], event["dp_degree"]) == (4, 1, 1)
    assert_same_data(fresh_ep2, resumed, range(1, 9))
    assert_losses(fresh_ep2, resumed, range(5, 9), rtol=TOPOLOGY_RTOL)
    assert_verify_match(fresh_ep2, resumed)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [(1, ()), (4, ()), (4, ("--parallelism.expert_parallel_degree", "2"))],
    ids=["1rank", "4ranks", "4ranks_ep2"],
)
def test_fresh_moe_runs_follow_one_loss_curve(
    fresh_ep2: Path, tmp_path: Path, nproc: int, overrides: tuple[str, ...]
) -> None:
    """Topology-free initial weights (router, experts, shared experts, MLA norms included)
    and the same data: the same losses up to reduction order and rare routing flips."""
    run = tmp_path / f"fresh_{nproc}"
    train03(run, nproc, *overrides, config=MOE).check()
    assert_same_data(fresh_ep2, run, range(1, 9))
    assert_losses(fresh_ep2, run, range(1, 9), rtol=TOPOLOGY_RTOL)


# slow (issue 44 part e): packing x the MoE, each proven alone by default
@pytest.mark.slow
def test_a_packed_moe_run_resumed_at_one_rank_matches_the_two_rank_ep_run(
    tmp_path: Path,
) -> None:
    """The MoE with ``zephon.packing best_fit`` (issue 31): whole documents, labels only
    within a document, a 2-rank EP 2 run cut after step 4 and resumed at 1 rank (EP 1)
    trains the same packed samples with the same losses within ``TOPOLOGY_RTOL``."""
    from tests.conftest import PACKED

    packed = (*PACKED[2:], "--training.steps", "6")  # steps 5-6 resumed
    ep2 = tmp_path / "packed_ep2"
    job = train03(ep2, 2, *packed, "--parallelism.expert_parallel_degree", "2", config=MOE)
    assert "packing best_fit:" in job.check().output
    resumed = copy_run_until(ep2, tmp_path / "resumed", 4)
    train03(resumed, 1, *packed, config=MOE).check()
    (event,) = resume_events(resumed)
    assert (event["from_step"], event["dp_degree"]) == (4, 1)
    assert event["data_config"]["packing"]["method"] == "best_fit"
    assert_same_data(ep2, resumed, range(1, 7))
    assert_losses(ep2, resumed, range(5, 7), rtol=TOPOLOGY_RTOL)
    assert_verify_match(ep2, resumed)
