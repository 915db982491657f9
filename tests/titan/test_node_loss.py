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

# A slower flavor than the other tests so the node dies mid-run, not after the end.
JOB = ("--model.flavor", "small", "--training.seq_len", "128", "--training.steps", "24")
STEPS = range(1, 25)
KILL_AFTER = 8


@pytest.fixture(scope="module")
def uninterrupted(e2e_root: Path) -> Path:
    return train(e2e_root / "node_loss_reference", 2, *JOB).check().run


def two_nodes_lose_one(
    run: Path, *, nnodes: str, agent_args: tuple[str, ...] = ()
) -> subprocess.Popen:
    """Start two single-rank agents; SIGKILL the second agent and its worker right after
    checkpoint KILL_AFTER completes. Returns the surviving agent's process."""
    port = free_port()
    launcher = [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=node_loss_test", *agent_args]  # fmt: skip
    run.mkdir(parents=True)
    agents = []
    for i in range(2):
        log = open(run / f"agent{i}.log", "w")
        cmd = train_command(run, 1, list(JOB), torchrun_args=launcher)
        agents.append(
            subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT)
        )
        time.sleep(0.5)  # the first agent hosts the rendezvous store
    done = run / "checkpoint" / f"step-{KILL_AFTER}" / ".metadata"
    deadline = time.time() + 300
    while not done.exists():
        assert time.time() < deadline, (
            "no checkpoint within 300 s:\n" + (run / "agent0.log").read_text()[-3000:]
        )
        assert agents[1].poll() is None, "the second node ended before it could be lost"
        time.sleep(0.02)
    kill_node(agents[1].pid)
    agents[1].wait()
    assert not (run / "checkpoint" / "step-24").exists(), (
        "the job finished before the node was lost"
    )
    return agents[0]


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
