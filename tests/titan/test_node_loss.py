"""Node loss under torchrun: two agents (--nnodes=2, c10d rendezvous on localhost)
train; one "node" is SIGKILLed after a checkpoint; the job continues on one node,
by a human restart or by torchrun's elastic agent, and sees exactly the data of an
uninterrupted run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.titan.expect import TOPOLOGY_RTOL, assert_losses, assert_same_data, resume_events
from tests.titan.launch import (
    REPO,
    free_port,
    job_env,
    kill_node,
    train,
    train_command,
)
from torchtitan_zephon.tracker import TrackerError, read_log

# A slower flavor than the other tests so the node dies mid-run, not after the end.
JOB = ("--model.flavor", "small", "--training.seq_len", "128", "--training.steps", "24")
STEPS = range(1, 25)
KILL_AFTER = 8


@pytest.fixture(scope="module")
def uninterrupted(e2e_root: Path) -> Path:
    return train(e2e_root / "node_loss_reference", 2, *JOB).check().run


def two_nodes_lose_one(
    run: Path, *, nnodes: str, agent_args: tuple[str, ...] = (), before_checkpoint: bool = False
) -> subprocess.Popen:
    """Start two single-rank agents; SIGKILL the second agent and its worker right after
    checkpoint KILL_AFTER completes (``before_checkpoint``: as soon as step 2 is logged,
    before any checkpoint). Returns the surviving agent's process."""
    port = free_port()
    args = list(agent_args)
    conf = args.pop(args.index("--rdzv-conf") + 1) if "--rdzv-conf" in args else ""
    args = [a for a in args if a != "--rdzv-conf"]
    run.mkdir(parents=True)
    agents = []
    for i in range(2):
        # the second agent (the one lost) must not host the rendezvous store
        node_conf = ",".join(c for c in (conf, "is_host=false" if i else "") if c)
        launcher = [f"--nnodes={nnodes}", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=node_loss_test", *args,
                    *(["--rdzv-conf", node_conf] if node_conf else [])]  # fmt: skip
        log = open(run / f"agent{i}.log", "w")
        cmd = train_command(run, 1, list(JOB), torchrun_args=launcher)
        agents.append(
            subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT)
        )
        time.sleep(0.5)
    done = run / "checkpoint" / f"step-{KILL_AFTER}" / ".metadata"

    def time_to_kill() -> bool:
        if not before_checkpoint:
            return done.exists()
        try:
            return 2 in read_log(run / "zephon" / "sequence_log.jsonl").records
        except TrackerError:
            return False

    deadline = time.time() + 300
    while not time_to_kill():
        assert time.time() < deadline, (
            "no checkpoint within 300 s:\n" + (run / "agent0.log").read_text()[-3000:]
        )
        assert agents[1].poll() is None, "the second node ended before it could be lost"
        time.sleep(0.02)
    kill_node(agents[1].pid)
    agents[1].wait()
    if before_checkpoint:
        assert not (run / "checkpoint").exists(), "a checkpoint was written before the kill"
    assert not (run / "checkpoint" / "step-24").exists(), (
        "the job finished before the node was lost"
    )
    return agents[0]


# slow (issue 44 part e): a real node loss (test_lose_a_node_elastic_agent_resumes_alone) x
# a resume on fewer ranks (tests/cli/test_verify.py), each proven by default
@pytest.mark.slow
def test_lose_a_node_and_restart_on_one(e2e_root: Path, uninterrupted: Path):
    run = e2e_root / "node_loss_manual"
    survivor = two_nodes_lose_one(run, nnodes="2")
    assert survivor.wait(timeout=300) != 0  # its peer is gone: the job fails
    train(run, 1, *JOB).check()  # the human restarts with --nnodes=1
    assert_same_data(uninterrupted, run, STEPS)
    assert_losses(uninterrupted, run, STEPS, rtol=TOPOLOGY_RTOL)
    events = resume_events(run)
    assert events[-1]["world_size"] == 1 and events[-1]["nnodes"] == 1
    assert events[-1]["from_step"] >= KILL_AFTER


def test_lose_a_node_elastic_agent_resumes_alone(e2e_root: Path, uninterrupted: Path):
    run = e2e_root / "node_loss_elastic"
    survivor = two_nodes_lose_one(
        run, nnodes="1:2", agent_args=("--max-restarts=1", "--rdzv-conf", "last_call_timeout=2")
    )
    assert survivor.wait(timeout=300) == 0, (run / "agent0.log").read_text()[-3000:]
    assert_same_data(uninterrupted, run, STEPS)
    assert_losses(uninterrupted, run, STEPS, rtol=TOPOLOGY_RTOL)
    (event,) = resume_events(run)
    assert (event["world_size"], event["nnodes"], event["dp_degree"]) == (1, 1, 1)


@pytest.mark.slow
def test_elastic_restart_before_the_first_checkpoint_starts_over(
    e2e_root: Path, uninterrupted: Path
):
    """A node is lost at step 2, before any checkpoint: the elastic agent restarts the job
    alone. Its new rank 0 runs under one of the agents recorded in the run folder's lock,
    so it is the same job and is not refused: it starts again from step 1, its start
    event supersedes the steps of the first attempt, and the data is the reference's."""
    run = e2e_root / "node_loss_before_checkpoint"
    survivor = two_nodes_lose_one(
        run,
        nnodes="1:2",
        agent_args=("--max-restarts=1", "--rdzv-conf", "last_call_timeout=2"),
        before_checkpoint=True,
    )
    assert survivor.wait(timeout=300) == 0, (run / "agent0.log").read_text()[-3000:]
    assert (
        "an elastic restart of this job before it could resume" in (run / "agent0.log").read_text()
    )
    log = read_log(run / "zephon" / "sequence_log.jsonl")
    starts = [e for e in log.events if e["event"] == "start"]
    assert [(e["world_size"], e["nnodes"]) for e in starts] == [(2, 2), (1, 1)]
    assert_same_data(uninterrupted, run, STEPS)
