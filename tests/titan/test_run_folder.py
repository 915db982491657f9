"""The run folder belongs to one job, a refused start changes nothing in it, and a
start never silently supersedes a history it does not resume (real torchrun jobs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
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
from tests.titan.launch import (
    REPO,
    Job,
    copy_run_until,
    job_env,
    kill_node,
    train,
    train_command,
)
from torchtitan_zephon.cli.inspect_run import describe_run
from torchtitan_zephon.run.holder import Holder, lock_path, read_holder
from torchtitan_zephon.run.process import Process
from torchtitan_zephon.tracker import read_log


def start_events(run: Path) -> list[dict]:
    return [
        e for e in read_log(run / "zephon" / "sequence_log.jsonl").events if e["event"] == "start"
    ]


def test_second_job_is_refused_while_the_folder_is_in_use(e2e_root: Path, reference: Path):
    """A live job holds the folder (here a process holding its lock): a job started in
    it fails at once, names the holder, and writes nothing."""
    run = copy_run_until(reference, e2e_root / "in_use", 4)
    code = (
        "import sys\n"
        "from torchtitan_zephon.run.lock import RunFolderLock\n"
        f"lock = RunFolderLock({str(run)!r}, lease_s=600)\n"
        "lock.acquire(); print('held', flush=True); sys.stdin.read(); lock.release()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree(run)
        job = train(run, 2, log=e2e_root / "in_use.log")
        assert_refused(job, "is in use by another job", f"pid {holder.pid}", "Nothing was written")
        assert_unchanged(before, tree(run))
    finally:
        holder.communicate("")


@pytest.mark.parametrize(
    "name, overrides, found, why",
    [
        (
            "checkpointing_off",
            ("--checkpoint.no-enable",),
            "checkpoints step-4, step-8 and a sequence log with steps 1..8",
            "checkpoint.enable is false",
        ),
        # another data config's log: the requeue of the same job starts again (below)
        (
            "log_without_checkpoint",
            ("--zephon.seed", "3"),
            "a sequence log with steps 1..8",
            "holds no complete",
        ),
    ],
)
def test_start_that_would_supersede_a_history_is_refused(
    e2e_root: Path, reference: Path, name, overrides, found, why
):
    run = copy_run_until(reference, e2e_root / f"history_{name}", 8)
    if name == "log_without_checkpoint":  # a run that died before its first checkpoint
        shutil.rmtree(run / "checkpoint")
        (run / "checkpoint").mkdir()
    before = tree(run)
    job = train(run, 2, *overrides, log=e2e_root / f"history_{name}.log")
    assert_refused(job, found, why, "--zephon.start_over", "Nothing was changed on disk")
    assert_unchanged(before, tree(run))


# slow (issue 44 part e): the decision in-process
# (tests/titan/test_preflight.py::test_a_requeue_that_checkpointed_nothing_starts_again), a
# real kill and restart by test_node_loss.py
@pytest.mark.slow
def test_a_requeue_after_a_kill_before_the_first_checkpoint_starts_again(
    e2e_root: Path, reference: Path
):
    """Issue 43 case 5: a job killed before its first checkpoint, started again with the
    same command (a scheduler's requeue: a new torchrun), recovers with nothing to
    decide: it starts from step 1, a second start event supersedes the killed attempt's
    steps, and it trains the reference's data."""
    run = e2e_root / "requeue"
    run.mkdir()
    args = ["--training.steps", "40", "--checkpoint.interval", "100", "--validation.no-enable"]
    with open(e2e_root / "requeue_killed.log", "w") as out:
        cmd = train_command(run, 2, args)
        agent = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=out, stderr=out)
    try:
        log = run / "zephon" / "sequence_log.jsonl"
        _wait_for(lambda: log.is_file() and log.read_text().count('"ids_digest"') >= 3, 300,
                  "third step")  # fmt: skip
    finally:
        kill_node(agent.pid)
        agent.wait(timeout=60)
    assert not any((run / "checkpoint").glob("step-*/.metadata")), "killed after a checkpoint"
    job = train(run, 2, *args).check()
    assert "(a requeue). It starts again from step 1" in job.output
    assert len(start_events(run)) == 2
    assert sorted(log_records(run)) == list(range(1, 41))
    assert_same_data(reference, run, range(1, 9))


def test_start_over_supersedes_the_log(e2e_root: Path, reference: Path):
    run = copy_run_until(reference, e2e_root / "start_over", 8)
    job = train(
        run, 1, "--checkpoint.no-enable", "--zephon.start_over", "--training.steps", "2"
    ).check()
    assert "zephon.start_over: starting from step 1" in job.output
    assert len(start_events(run)) == 2
    assert sorted(log_records(run)) == [1, 2]
    assert_same_data(reference, run, range(1, 3))
    assert sorted(c.name for c in (run / "checkpoint").iterdir()) == ["step-4", "step-8"]


def test_dead_jobs_lock_and_truncated_checkpoint(e2e_root: Path, reference: Path):
    """A job on another node was lost while writing checkpoint 8 after its .metadata: its
    lock stays and a shard is cut short. The restart takes the lock over within one
    lease, skips step 8 with a warning (inspect calls it corrupt), resumes from 4."""
    run = copy_run_until(reference, e2e_root / "dead_and_truncated", 8)
    shard = run / "checkpoint" / "step-8" / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    lease = 3.0
    dead = Holder("gone", Process("node-lost", "another-machine", 4242, "1"), lease_s=lease)
    lock_path(run).write_text(dead.to_json())
    info = describe_run(run)
    (ck8,) = [c for c in info["checkpoints"] if c["step"] == 8]
    assert ck8["status"] == "corrupt" and "__1_0.distcp is truncated" in ck8["problem"]
    assert info["latest_complete_checkpoint"] == 4
    assert info["owner"]["host"] == "node-lost"
    t0 = time.monotonic()
    job = train(run, 1).check()
    assert time.monotonic() - t0 > lease
    assert "taken over from a dead job (host node-lost, pid 4242" in job.output
    assert "step-8 is corrupt (shard __1_0.distcp is truncated" in job.output
    assert "resuming from step 4" in job.output
    assert resume_events(run)[-1]["from_step"] == 4
    assert_same_data(reference, run, range(1, 9))
    assert_losses(reference, run, range(5, 9), rtol=TOPOLOGY_RTOL)
    assert not lock_path(run).exists()  # released at the clean end


# slow (issue 44 part e): the refusal in-process
# (tests/titan/test_preflight.py::test_model_only_checkpoint_names_the_last_full_one), a
# resume refused end to end by default
@pytest.mark.slow
def test_model_only_last_checkpoint_says_what_to_do(e2e_root: Path):
    """TorchTitan's default saves the last step model-only: a longer run cannot resume
    from it; the refusal names the last full checkpoint, which then resumes."""
    run = e2e_root / "model_only"
    short = ("--training.steps", "2", "--checkpoint.interval", "1", "--validation.no-enable")
    train(run, 1, *short, "--checkpoint.last_save_model_only").check()
    holds = {c["step"]: c["holds"] for c in describe_run(run)["checkpoints"]}
    assert holds == {1: "training", 2: "model"}
    longer = ("--training.steps", "3", "--checkpoint.interval", "1", "--validation.no-enable")
    before = tree(run)
    job = train(run, 1, *longer, log=e2e_root / "model_only.log")
    assert_refused(
        job,
        "step-2 holds only the model",
        "--checkpoint.load_step 1",
        "--checkpoint.no-last_save_model_only",
    )
    assert_unchanged(before, tree(run))
    train(run, 1, *longer, "--checkpoint.load_step", "1").check()
    assert resume_events(run)[-1]["from_step"] == 1
    assert sorted(log_records(run)) == [1, 2, 3]


# ------------------------------------------------------------ real concurrency (slow)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_two_jobs_started_in_one_folder(e2e_root: Path, reference: Path):
    """Two real jobs started together in one folder: one fails naming the other's rank 0,
    the other runs to the end with one start event and the reference's data."""
    run = e2e_root / "two_jobs"
    run.mkdir()
    logs = [e2e_root / f"two_jobs_{i}.log" for i in range(2)]
    jobs = []
    for log in logs:
        with open(log, "w") as out:
            cmd = train_command(run, 2, [])
            jobs.append(subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=out, stderr=out))
    _wait_for(lambda: read_holder(run) is not None, 300, "lock")
    holder = read_holder(run).process.pid
    codes = [job.wait(timeout=600) for job in jobs]
    assert sorted(c == 0 for c in codes) == [False, True], codes
    loser = Job(run, 1, logs[codes.index(1) if 1 in codes else 1 - codes.index(0)].read_text())
    assert_refused(loser, "is in use by another job", f"pid {holder}")
    assert len(start_events(run)) == 1
    assert_same_data(reference, run, range(1, 9))
