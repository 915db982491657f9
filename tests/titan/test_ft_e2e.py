"""Replica groups under torchft train exactly what one group trains (issue 30 part a2),
end to end with real parts: a real ``torchft_lighthouse`` on loopback and each replica
group a real ``torchrun`` job with its own run folder, on gloo.

Replica groups of one rank each train 12 steps of the tiny Llama at a global batch of 8;
an uninterrupted one-group run without torchft trains the same 12 steps. Every group's sequence log must equal that run's (``zephon verify`` MATCH, and
token digests gathered over both groups at audit ``tokens``), the losses logged must be
that run's (the mean over all of B(s), within the tolerance the elastic-resume tests
use: the reduction order differs), and the groups' logs must match each other.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.titan.conftest import lighthouse_at
from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_losses,
    assert_same_data,
    assert_verify_match,
    resume_events,
)
from tests.titan.launch import REPO, copy_run_until, kill_after_step, train03
from torchtitan_zephon.run.recorded import losses as runs_losses
from torchtitan_zephon.titan.ft.launch import group_command, group_env, last_step

pytest.importorskip("torchft", reason="torchft (a dependency of the package)")

STEPS = ("--training.steps", "12")


def _group(run: Path, replica: int, groups: int, url: str, *extra: str) -> subprocess.Popen:
    """Replica group ``replica`` of ``groups`` as its own torchrun job (one rank), the
    tiny Llama for 12 steps unless ``extra`` says otherwise (later options win)."""
    run.mkdir(parents=True, exist_ok=True)
    command = group_command(run, replica, groups, *STEPS, *extra)
    log = open(run / "train.log", "w")  # noqa: SIM115 - closed by the caller's wait
    return subprocess.Popen(
        command, cwd=REPO, env=group_env(url), stdout=log, stderr=subprocess.STDOUT
    )


def _wait(procs: list[subprocess.Popen], runs: list[Path], timeout: int = 600) -> None:
    for p, run in zip(procs, runs, strict=True):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        finally:
            p.stdout and p.stdout.close()
        text = (run / "train.log").read_text()
        assert p.returncode == 0, text[-4000:]


@pytest.fixture(scope="module")
def one_group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted one-group run, without torchft, on one rank."""
    run = tmp_path_factory.mktemp("ft") / "one_group"
    train03(run, 1, *STEPS).check()
    return run


def _assert_trains_like(one: Path, run: Path) -> None:
    assert_same_data(one, run, range(1, 13))
    assert_losses(one, run, range(1, 13), rtol=TOPOLOGY_RTOL)
    assert_verify_match(one, run)


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two replica groups of one rank, 12 steps, each with its own run folder
    (checkpoints at 4, 8 and 12)."""
    root = tmp_path_factory.mktemp("ft2")
    runs = [root / f"group{r}" for r in range(2)]
    with lighthouse_at(1) as url:
        procs = [_group(run, r, 2, url) for r, run in enumerate(runs)]
        _wait(procs, runs)
    return runs


def test_two_groups_train_exactly_what_one_group_trains(
    two_groups: list[Path], one_group: Path
) -> None:
    parts = []
    for run in two_groups:
        text = (run / "train.log").read_text()
        assert "Zephon: torchft quorum of 2 group(s) from step 1: this group trains part" in text
        assert "(4 of the step's 8 samples)" in text
        assert "quorum of 1" not in text
        parts.append(text.count("trains part 0"))
        _assert_trains_like(one_group, run)
    assert_verify_match(two_groups[0], two_groups[1])
    assert sorted(parts) == [0, 1]  # one group trained part 0, the other part 1
    # the log says who trained which part, and that the run is a replica group (case 10)
    first = [_events(run, "quorum")[0] for run in two_groups]
    members = [1 - parts[0], parts[0]]  # replica ids in part order
    for r, q in enumerate(first):
        assert (q["step"], q["groups"], q["members"]) == (1, 2, members)
        assert q["part"] == members.index(r)
        (start,) = _events(two_groups[r], "start")
        assert (start["replica_id"], start["group_size"]) == (r, 2)


def _events(run: Path, kind: str) -> list[dict]:
    log = run / "zephon" / "sequence_log.jsonl"
    return [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == kind]


def test_a_group_started_alone_says_once_that_it_waits_and_for_how_long(tmp_path: Path) -> None:
    """Issue 43 case 9: a group started alone waited for its peers silently, while
    torchft logged every quorum request (1,021 lines in 60 s). It says once how many
    groups it waits for and for how long at most, asks less and less often, and then
    trains with the groups present."""
    run = tmp_path / "alone"
    with lighthouse_at(1) as url:
        proc = _group(run, 0, 2, url, "--training.steps", "2", "--comm.init_timeout_seconds", "10")
        _wait([proc], [run])
    text = (run / "train.log").read_text()
    said = [line for line in text.splitlines() if "waiting for 1 more" in line]
    assert len(said) == 1 and "1 of the 2 replica groups are in the quorum" in said[0]
    assert "at most 10 s (comm.init_timeout_seconds)" in said[0]
    assert "torchft quorum of 1 group(s) from step 1" in text
    assert len(text.splitlines()) < 300, len(text.splitlines())


def test_every_group_dies_after_a_checkpoint_and_all_restart_exactly(
    two_groups: list[Path], one_group: Path, tmp_path: Path
) -> None:
    """Issue 30 part b2: each group keeps its own checkpoints (the same state: the groups
    are replicas). Both die after checkpoint 8; restarted, each resumes from its own
    step-8 and steps 9-12 are the one-group run's."""
    runs = [copy_run_until(g, tmp_path / g.name, 8) for g in two_groups]
    with lighthouse_at(1) as url:
        procs = [_group(run, r, 2, url) for r, run in enumerate(runs)]
        _wait(procs, runs)
    for run in runs:
        (event,) = resume_events(run)
        assert event["from_step"] == 8
        _assert_trains_like(one_group, run)
    assert_verify_match(runs[0], runs[1])


# slow (issue 44 part e): torchft groups x an elastic resume on another degree, each proven
# alone by default
@pytest.mark.slow
def test_a_group_folder_resumes_without_torchft_on_another_degree(
    two_groups: list[Path], one_group: Path, tmp_path: Path
) -> None:
    """Issue 30 part b2: a group's run folder is a run like any other: restarted without
    --fault_tolerance.enable on 2 ranks from its checkpoint 4, steps 5-12 are exact."""
    run = copy_run_until(two_groups[0], tmp_path / "plain", 4)
    train03(run, 2, *STEPS).check()
    (event,) = resume_events(run)
    assert (event["from_step"], event["dp_degree"]) == (4, 2)
    _assert_trains_like(one_group, run)


# slow (issue 44 part e): a group killed while the others step on is proven by
# test_a_killed_group_returns_heals_from_its_peer_and_takes_part_again, parts of 3, 3 and 2
# by test_ft_quorum.py
@pytest.mark.slow
def test_three_groups_then_one_killed_the_others_step_on_exactly(
    tmp_path: Path, one_group: Path
) -> None:
    """Issue 30 part a3: three groups at a global batch of 8 (parts of 3, 3 and 2
    samples, token weighted); one group's whole process tree is killed after step 3; the
    other two keep stepping without a restart (a quorum of two after the heartbeat
    timeout, parts of 4 and 4), and a step whose reduction the kill cut is trained
    again. Both survivors' logs are the uninterrupted one-group run's, and each other's."""

    runs = [tmp_path / f"group{r}" for r in range(3)]
    with lighthouse_at(1, heartbeat_timeout_ms=1000) as url:
        # A survivor may hang in the cut reduction until the collective timeout (30 s
        # here, 120 s by default) while the other waits for it in the quorum
        # (titan.ft.quorum: the survivors of a kill meet again).
        timeout = ("--comm.train_timeout_seconds", "30")
        procs = [_group(run, r, 3, url, *timeout) for r, run in enumerate(runs)]
        kill_after_step(procs[2], runs[2], 3)
        _wait(procs[:2], runs[:2])
    killed_at = last_step(runs[2])
    assert 3 <= killed_at < 12
    for run in runs[:2]:
        text = (run / "train.log").read_text()
        assert "Zephon: torchft quorum of 3 group(s) from step 1" in text
        alone = text.split("Zephon: torchft quorum of 2 group(s) from step ")[1]
        assert int(alone.split(":")[0]) > killed_at  # the two went on after the kill
        assert "(4 of the step's 8 samples)" in alone
        _assert_trains_like(one_group, run)
        _assert_annotated(run, text, killed_at)
    assert_verify_match(runs[0], runs[1])


def _assert_annotated(run: Path, train_log: str, killed_at: int) -> None:
    """The log says what torchft did: a ``quorum`` event of 3 groups before step 1 and
    one of 2 after the kill; a ``retry`` event for every step not committed (the train
    log's warnings), trained again under one record: every step has one record line."""
    lines = [json.loads(line) for line in (run / "zephon" / "sequence_log.jsonl").open()]
    quorums = [(e["step"], e["groups"]) for e in lines if e.get("event") == "quorum"]
    assert quorums[0] == (1, 3) and quorums[-1][1] == 2 and quorums[-1][0] > killed_at
    retried = sorted(e["step"] for e in lines if e.get("event") == "retry")
    warned = sorted(
        int(w.split(" was not committed")[0].rsplit(" ", 1)[1])
        for w in train_log.splitlines()
        if "was not committed" in w
    )
    assert retried == warned
    records = [e["step"] for e in lines if "event" not in e]
    assert records == list(range(1, 13))


def _expert_biases(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The experts' bias of every MoE layer in checkpoint ``step`` of ``run``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run.parent / f"{run.name}-step{step}.pt"
    dcp_to_torch_save(run / "checkpoint" / f"step-{step}", out)
    state = torch.load(out, weights_only=False)
    flat = {}

    def walk(d: dict, prefix: str = "") -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif "expert_bias" in k and isinstance(v, torch.Tensor):
                flat[prefix + k] = v

    walk(state)
    return flat


# slow (issue 44 part e): the MoE x torchft groups; each proven alone by default
# (test_moe_e2e.py, the groups here)
@pytest.mark.slow
def test_two_moe_groups_train_and_balance_experts_as_one_group(tmp_path: Path) -> None:
    """Issue 30 part a3, the MoE: the expert-balancing token counts are summed over the
    groups, so the experts' bias (moved by the sign of each expert's count against the
    mean) is after 4 steps exactly the one-group run's, as are the data and the losses."""
    moe = ("--config", "deepseek_v3_debug", "--training.steps", "4")
    runs = [tmp_path / f"moe{r}" for r in range(2)]
    with lighthouse_at(1) as url:
        procs = [_group(run, r, 2, url, *moe) for r, run in enumerate(runs)]
        _wait(procs, runs)
    one = tmp_path / "moe_one"
    train03(one, 1, "--training.steps", "4", config="deepseek_v3_debug").check()
    want = _expert_biases(one, 4)
    assert want and any(bool(b.abs().sum() > 0) for b in want.values())  # the bias moved
    for run in runs:
        assert "(4 of the step's 8 samples)" in (run / "train.log").read_text()
        assert_same_data(one, run, range(1, 5))
        assert_losses(one, run, range(1, 5), rtol=TOPOLOGY_RTOL)
        got = _expert_biases(run, 4)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)


def test_a_killed_group_returns_heals_from_its_peer_and_takes_part_again(
    tmp_path: Path, one_group: Path
) -> None:
    """Issue 30 part b1: group 1 is killed after step 3 and restarted into its own run
    folder (no checkpoint of its own yet: not refused for what the folder holds); it
    heals from group 0 at the first quorum (weights, optimizer, data state and the log
    records it missed) and trains its part again. Its log is group 0's history (which
    from step 1 is the one-group run's) and its losses after healing are group 0's."""

    long = ("--training.steps", "240", "--checkpoint.interval", "120",
            "--validator.freq", "120")  # fmt: skip
    runs = [tmp_path / f"group{r}" for r in range(2)]
    with lighthouse_at(1, heartbeat_timeout_ms=1000) as url:
        procs = [_group(run, r, 2, url, *long) for r, run in enumerate(runs)]
        kill_after_step(procs[1], runs[1], 3)
        procs[1] = _group(runs[1], 1, 2, url, *long)  # returns, into its own folder
        _wait(procs, runs)
    back = (runs[1] / "train.log").read_text()
    assert "Zephon: torchft healed this group from its peers at step" in back
    healed_at = int(back.split("healed this group from its peers at step ")[1].split(" ")[0])
    assert 3 < healed_at < 240
    assert "Zephon: torchft quorum of 2 group(s)" in back.split("healed this group")[1]
    assert_same_data(runs[0], runs[1], range(1, 241))
    assert_verify_match(runs[0], runs[1])
    assert_same_data(one_group, runs[1], range(1, 13))  # the history from step 1
    trained, _ = runs_losses(runs[1])  # the returned group logged the steps it trained
    assert set(range(healed_at + 1, 241)) <= set(trained)
    assert_losses(runs[0], runs[1], range(healed_at + 1, 241), rtol=TOPOLOGY_RTOL)
