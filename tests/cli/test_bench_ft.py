"""``zephon bench ft``: the counts it compares (TorchTitan 0.3's torchft sharding applied
to a timeline, against what a run should train) and, under -m slow, the suite at tiny
sizes (keys and relations, no timing)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.bench.ft import slot_counts, tt_counts, twice_and_never
from torchtitan_zephon.cli.main import main


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.integers(1, 12))
def test_torchtitan_sharding_with_every_group_committing_trains_each_step_exactly(
    groups, inner, per_rank, steps
):
    """No kill, no failed commit: get_dp_info sharding trains the slots of B(1..S), once."""
    gbs = groups * inner * per_rank
    attempts = {g: [(s, True) for s in range(1, steps + 1)] for g in range(groups)}
    trained = tt_counts(attempts, groups, inner, gbs)
    intended = slot_counts(((s - 1) * gbs, gbs) for s in range(1, steps + 1))
    assert trained == intended
    assert twice_and_never(trained, intended) == {"twice": 0, "never": 0}


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 4),
    st.integers(1, 3),
    st.integers(6, 14),
    st.data(),
)
def test_torchtitan_sharding_loses_what_a_dead_group_and_a_failed_commit_would_train(
    groups, per_rank, steps, data
):
    """Group 1 is away for ``away`` steps and its first attempt is not committed: the
    failed attempt's batch is dropped, never read again, and by step S its shard is behind
    by ``away`` batches, which no other group trains (its committed attempts are S -
    away)."""
    gbs = groups * per_rank
    away = data.draw(st.integers(1, steps - 3))
    gone = data.draw(st.integers(2, steps - away))
    attempts = {g: [(s, True) for s in range(1, steps + 1)] for g in range(groups)}
    attempts[1] = [(s, True) for s in range(1, steps + 1) if not gone <= s < gone + away]
    attempts[1].insert(0, (1, False))  # its first attempt at step 1 failed to commit
    trained = tt_counts(attempts, groups, 1, gbs)
    intended = slot_counts(((s - 1) * gbs, gbs) for s in range(1, steps + 1))
    assert twice_and_never(trained, intended) == {"twice": 0, "never": away * per_rank}
    first_batch = [i * groups + 1 for i in range(per_rank)]  # group 1's shard, position 0
    assert all(trained[slot] == 0 for slot in first_batch)


def test_twice_counts_each_extra_time():
    trained = slot_counts([(0, 4), (2, 4), (2, 1)])  # slots 2, 3 twice; 2 three times
    assert twice_and_never(trained, slot_counts([(0, 8)])) == {"twice": 3, "never": 2}


@pytest.mark.slow  # two torchrun jobs, two replica groups and two quorum loops (~3 min)
def test_bench_ft_quick(capsys):
    assert main(["bench", "ft", "--quick", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["meets"]["zephon_exact"], r["counts"]
    assert r["meets"]["torchtitan_loses_samples"], r["counts"]
    assert set(r["verify"].values()) == {"match"}
    assert r["ft"]["kill_to_next_commit_s"] > 0 and r["restart"]["kill_to_next_step_s"] > 0
    restart = r["restart"]  # resumed from the last checkpoint (interval 4) before the kill
    ckpt = restart["resumed_from_checkpoint"]
    assert ckpt % 4 == 0 and 0 < ckpt <= restart["killed_after_step"] < ckpt + 4
    assert restart["steps_trained_again"] == restart["killed_after_step"] - ckpt
    assert r["counts"]["intended_samples"] == r["steps"] * r["global_batch_size"]
    assert r["recovery_ratio"] == pytest.approx(
        r["restart"]["kill_to_next_step_s"] / r["ft"]["kill_to_next_commit_s"]
    )
    q = r["quorum"]
    assert q["cost_pct"] == pytest.approx(
        100
        * (q["sync"]["step_s_median"] - q["async"]["step_s_median"])
        / q["async"]["step_s_median"]
    )
