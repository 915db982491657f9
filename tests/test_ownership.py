"""One job per run folder: the lock refuses a live holder, takes over a dead one within one
lease, recognises an elastic restart of the same job, and refusing writes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.titan.expect import tree
from torchtitan_zephon.run.holder import (
    LEASE_ENV,
    Holder,
    lease_seconds,
    lock_path,
    read_holder,
)
from torchtitan_zephon.run.lock import FolderInUse, RunFolderLock
from torchtitan_zephon.run.process import Process

REPO = Path(__file__).resolve().parents[1]
# Slack for a loaded 2-core machine: takeovers must happen within one lease, plus this.
SLACK_S = 4.0


def remote(pid: int = 4242, host: str = "node-a") -> Process:
    """A process on another machine (another host name and machine id)."""
    return Process(host, "another-machine", pid, "1")


def hold(run: Path, lease: float, host: str | None = None) -> subprocess.Popen:
    """A holder in a process of its own (named as on ``host`` when given), heartbeating."""
    who = f"Process({host!r}, 'another-machine', os.getpid(), '1')" if host else "None"
    code = (
        "import os, sys\n"
        "from torchtitan_zephon.run.lock import RunFolderLock\n"
        "from torchtitan_zephon.run.process import Process\n"
        f"lock = RunFolderLock({str(run)!r}, lease_s={lease}, process={who})\n"
        "lock.acquire()\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
        "lock.release()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_free_folder_is_taken_and_released(tmp_path: Path):
    lock = RunFolderLock(tmp_path, lease_s=30)
    assert lock.acquire().kind == "free"
    holder = read_holder(tmp_path)
    assert holder.process.pid == os.getpid() and holder.token == lock.token
    lock.release()
    assert not lock_path(tmp_path).exists()


def test_live_holder_on_this_machine_is_refused_at_once_and_nothing_is_written(tmp_path: Path):
    holder = hold(tmp_path, lease=600)  # beats every 100 s: the lock file stays still
    try:
        before = tree(tmp_path)
        t0 = time.monotonic()
        with pytest.raises(FolderInUse) as e:
            RunFolderLock(tmp_path, lease_s=600).check()
        assert time.monotonic() - t0 < 2.0
        assert f"pid {holder.pid}" in str(e.value) and "in use by another job" in str(e.value)
        assert "Nothing was written" in str(e.value)
        assert tree(tmp_path) == before
    finally:
        holder.communicate("")
    assert not lock_path(tmp_path).exists()  # released on its clean exit


def test_dead_holder_on_this_machine_is_taken_over_at_once(tmp_path: Path):
    holder = hold(tmp_path, lease=600)
    holder.kill()  # SIGKILL: the lock stays behind
    holder.wait()
    assert read_holder(tmp_path).process.pid == holder.pid
    lock = RunFolderLock(tmp_path, lease_s=600)
    t0 = time.monotonic()
    verdict = lock.check()
    assert verdict.kind == "dead" and time.monotonic() - t0 < 2.0
    lock.acquire(verdict)
    assert read_holder(tmp_path).token == lock.token
    lock.release()


def test_live_holder_on_another_machine_is_seen_by_its_heartbeat(tmp_path: Path):
    lease = 3.0
    holder = hold(tmp_path, lease=lease, host="node-a")
    try:
        before = {k: v for k, v in tree(tmp_path).items() if not k.startswith("zephon")}
        t0 = time.monotonic()
        with pytest.raises(FolderInUse) as e:
            RunFolderLock(tmp_path, lease_s=lease).check()
        # the heartbeat advances every lease/6: seen well before a whole lease
        assert time.monotonic() - t0 < lease
        assert f"host node-a, pid {holder.pid}" in str(e.value)
        assert "heartbeat is advancing" in str(e.value)
        after = {k: v for k, v in tree(tmp_path).items() if not k.startswith("zephon")}
        assert after == before
        assert read_holder(tmp_path).process.host == "node-a"
    finally:
        holder.communicate("")


def test_dead_holder_on_another_machine_blocks_for_one_lease_at_most(tmp_path: Path):
    lease = 2.0
    lock_path(tmp_path).parent.mkdir(parents=True)
    lock_path(tmp_path).write_text(Holder("t0", remote(), lease_s=lease, beat=17).to_json())
    lock = RunFolderLock(tmp_path, lease_s=30)
    t0 = time.monotonic()
    verdict = lock.check()
    waited = time.monotonic() - t0
    assert verdict.kind == "dead" and verdict.holder.process.host == "node-a"
    assert lease <= waited < lease + SLACK_S, waited  # the holder's lease, timed here
    lock.acquire(verdict)
    assert read_holder(tmp_path).token == lock.token
    lock.release()


def test_elastic_restart_of_the_same_job_takes_over_at_once(tmp_path: Path):
    agent = Process.of(os.getppid())
    lock_path(tmp_path).parent.mkdir(parents=True)
    old = Holder("t0", remote(), agents=[remote(9), agent], run_id="none", lease_s=600)
    lock_path(tmp_path).write_text(old.to_json())
    me = RunFolderLock(tmp_path, process=Process.of(os.getpid()), agent=agent, run_id="none")
    t0 = time.monotonic()
    verdict = me.check()
    assert verdict.same_job and time.monotonic() - t0 < 1.0
    me.acquire(verdict)
    assert read_holder(tmp_path).token == me.token
    me.release()
    # another launch (another agent, or another run id) is not the same job
    lock_path(tmp_path).write_text(old.to_json())
    other = RunFolderLock(
        tmp_path, lease_s=1, process=Process.of(os.getpid()), agent=remote(7), run_id="none"
    )
    assert not other._same_job(old)
    renamed = RunFolderLock(
        tmp_path, lease_s=1, process=Process.of(os.getpid()), agent=agent, run_id="job-2"
    )
    assert not renamed._same_job(old)


def test_two_waiters_for_a_dead_lock_one_wins(tmp_path: Path):
    lock_path(tmp_path).parent.mkdir(parents=True)
    lock_path(tmp_path).write_text(Holder("t0", remote(), lease_s=0.6).to_json())
    locks = [RunFolderLock(tmp_path, lease_s=1.2) for _ in range(2)]
    verdicts = [lock.check() for lock in locks]  # both decide "dead" before either takes
    assert [v.kind for v in verdicts] == ["dead", "dead"]
    results: list[object] = [None, None]

    def take(i: int) -> None:
        try:
            locks[i].acquire(verdicts[i])
            results[i] = "won"
        except FolderInUse as e:
            results[i] = e

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r == "won" for r in results) == [False, True], results
    winner = locks[results.index("won")]
    assert read_holder(tmp_path).token == winner.token
    winner.release()


def test_a_holder_whose_lock_was_taken_over_notices(tmp_path: Path):
    lock = RunFolderLock(tmp_path, lease_s=0.6)
    lock.acquire()
    lock_path(tmp_path).write_text(Holder("thief", remote(99, "node-b"), lease_s=30).to_json())
    deadline = time.monotonic() + 0.6 + SLACK_S
    while lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.lost is not None and "host node-b, pid 99" in lock.lost
    lock.release()
    assert read_holder(tmp_path).token == "thief"  # not ours: left alone


def test_heartbeat_advances_and_agents_are_recorded(tmp_path: Path):
    lock = RunFolderLock(tmp_path, lease_s=0.6)
    lock.acquire()
    try:
        lock.set_agents([remote(5), remote(6, "node-b")])
        first = read_holder(tmp_path).beat
        time.sleep(0.6)
        holder = read_holder(tmp_path)
        assert holder.beat > first
        assert {(a.host, a.pid) for a in holder.agents} == {("node-a", 5), ("node-b", 6)}
    finally:
        lock.release()


def test_lease_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(LEASE_ENV, raising=False)
    assert lease_seconds() == 30.0
    monkeypatch.setenv(LEASE_ENV, "2.5")
    assert lease_seconds() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(LEASE_ENV, bad)
        with pytest.raises(ValueError, match=f"{LEASE_ENV}={bad!r}: expected a number"):
            lease_seconds()


def test_a_reused_pid_is_not_the_dead_holder():
    me = Process.of(os.getpid())
    assert me.alive()
    assert not Process(me.host, me.machine, me.pid, str(int(me.started) + 1)).alive()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc = Process.of(child.pid)
    assert proc.alive()
    os.kill(child.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert not proc.alive()  # a zombie (not yet reaped) is dead too
    child.wait()


def test_a_filesystem_without_hard_links_still_gets_an_exclusive_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def no_links(*_):
        raise PermissionError("hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    first = RunFolderLock(tmp_path, lease_s=600)
    first.acquire()
    assert read_holder(tmp_path).token == first.token
    with pytest.raises(FolderInUse):  # alive on this machine (this very process)
        RunFolderLock(tmp_path, lease_s=600).acquire()
    first.release()
    assert not lock_path(tmp_path).exists()
