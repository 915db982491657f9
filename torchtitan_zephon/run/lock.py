"""Taking a run folder: one job at a time, and a dead job never blocks for long.

Role: ``RunFolderLock`` is the lock of one run folder as one would-be holder
(global rank 0) sees it: ``check`` decides without writing, ``acquire`` takes
the folder and keeps the lease alive from a heartbeat thread, ``release`` gives
it back on a clean exit. The lock file's contents are ``holder.Holder``.

Invariants:
- At most one live job holds a folder. A job that finds a lock held by a live
  job of another launch refuses to start, naming the holder, and writes nothing.
- A lock left by a dead job (SIGKILL, node loss) blocks a restart for at most one
  lease period of the holder: on the holder's own machine the pid is checked at
  once; from another machine the waiter watches the heartbeat counter and calls
  the holder dead when it has not changed for one lease period *as timed by the
  waiter*, so no clock synchronisation between nodes is needed.
- An elastic restart of the same job (a worker whose torchrun agent, identified
  by host, machine id, pid and start time, is one of the holder's agents, under
  the same torchrun run id) takes over at once.
- A holder whose lock was taken over (it missed heartbeats for a whole lease)
  notices at its next heartbeat (``lost``) and must stop writing.

What it relies on: creating a file with ``link()`` fails when the name exists,
and ``rename()`` replaces atomically, on the filesystem of the run folder (local
filesystems, NFSv3+, Lustre, GPFS); a reader that opens the file sees what the
last writer closed (NFS close-to-open consistency). Two waiters that both find a
dead holder replace the lock; each confirms a moment later (``CONFIRM_S``) that its
own token is still there, and only the last one keeps it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from torchtitan_zephon.run.holder import LOCK_NAME, Holder, lease_seconds, lock_path
from torchtitan_zephon.run.process import Process, torchrun_agent

# The name log lines carry since before the move to run/ (kept: users filter on it).
logger = logging.getLogger("torchtitan_zephon.ownership")

BEATS_PER_LEASE = 6
"""The holder beats this many times per lease: a dead holder is one whose counter did
not change over ``BEATS_PER_LEASE`` beat intervals."""
CONFIRM_S = 2.0
"""How long a job that took over a dead holder's lock waits before it checks that its
own token is still there (another waiter may have replaced the lock at the same time);
at most one beat interval."""


class FolderInUse(RuntimeError):
    """Another live job holds the run folder."""


@dataclass
class Verdict:
    """What ``RunFolderLock.check`` found: the folder is ``free``, its holder is ``dead``,
    or the holder is this ``same_job`` (an elastic restart)."""

    kind: str
    holder: Holder | None = None
    observed: str | None = None
    """The lock file's text when the verdict was reached (None: no file)."""
    waited_s: float = 0.0

    @property
    def same_job(self) -> bool:
        return self.kind == "same_job"


class RunFolderLock:
    """The lock of one run folder, as seen by one would-be holder (global rank 0)."""

    def __init__(
        self,
        dump_folder: str | os.PathLike,
        *,
        lease_s: float | None = None,
        process: Process | None = None,
        agent: Process | None = None,
        run_id: str | None = None,
        restart_count: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``process`` / ``agent`` / ``run_id`` default to this process and its torchrun agent."""
        self.folder = Path(dump_folder)
        self.path = lock_path(dump_folder)
        self.lease_s = lease_seconds() if lease_s is None else float(lease_s)
        if process is None:
            agent, run_id, restart_count = torchrun_agent()
        self.process = process or Process.of(os.getpid())
        self.agent, self.run_id, self.restart_count = agent, run_id, restart_count
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.lost: str | None = None
        """Set by the heartbeat when another job took the lock over: stop writing."""
        self._holder: Holder | None = None
        self._stop = threading.Event()
        self._write = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def beat_s(self) -> float:
        return self.lease_s / BEATS_PER_LEASE

    # -- deciding (reads only) -------------------------------------------
    def _read_text(self) -> str | None:
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def _in_use(self, holder: Holder | None, how: str) -> FolderInUse:
        who = holder.describe() if holder else "a job whose lock file cannot be parsed"
        return FolderInUse(
            f"the run folder {self.folder} is in use by another job: {who} ({how}). Two jobs "
            "in one folder would interleave their sequence logs and checkpoints. Wait for it "
            "to end or stop it, or use another --job.dump_folder. Nothing was written. (A "
            f"lock left by a dead job is taken over: at once on its machine, after "
            f"{holder.lease_s if holder else self.lease_s:g} s from another; lock file "
            f"{self.path})"
        )

    def check(self) -> Verdict:
        """Decide whether this job may take the folder, without writing anything.

        Returns at once when the folder is free, its holder is this job (an elastic
        restart) or a process of this machine that is dead; raises FolderInUse at once
        for a live holder on this machine. A holder on another machine is watched: its
        heartbeat changing means alive (FolderInUse within one beat interval); no change
        for one lease period means dead.
        """
        start = self.clock()
        text = self._read_text()
        if text is None:
            return Verdict("free")
        holder = _parse(text)
        if holder is not None:
            if self._same_job(holder):
                return Verdict("same_job", holder, text)
            if holder.process.on_this_machine():
                if holder.process.alive():
                    raise self._in_use(holder, "alive on this machine")
                return Verdict("dead", holder, text)
        lease = holder.lease_s if holder else self.lease_s
        poll = min(0.5, lease / (4 * BEATS_PER_LEASE))
        logger.warning(
            f"Zephon: {self.path} names a job on another machine "
            f"({holder.describe() if holder else 'unreadable lock'}); watching its heartbeat "
            f"for up to {lease:g} s to tell whether it is alive"
        )
        while self.clock() - start < lease:
            time.sleep(poll)
            now = self._read_text()
            if now is None:
                return Verdict("free", waited_s=self.clock() - start)
            if now != text:
                raise self._in_use(_parse(now) or holder, "its heartbeat is advancing")
        return Verdict("dead", holder, text, waited_s=self.clock() - start)

    def _same_job(self, holder: Holder) -> bool:
        return (
            self.agent is not None
            and holder.run_id == self.run_id
            and any(a == self.agent for a in holder.agents)
        )

    # -- taking (writes) ---------------------------------------------------
    def acquire(self, verdict: Verdict | None = None) -> Verdict:
        """Take the folder (after ``check``), then keep the lease alive from a thread.

        Raises FolderInUse when another job took it since ``check``.
        """
        verdict = verdict or self.check()
        self._holder = Holder(
            token=self.token,
            process=self.process,
            agents=[self.agent] if self.agent else [],
            run_id=self.run_id,
            restart_count=self.restart_count,
            lease_s=self.lease_s,
            acquired=time.strftime("%Y-%m-%d %H:%M:%S %z"),
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp()
        tmp.write_text(self._holder.to_json(), encoding="utf-8")
        try:
            if verdict.kind == "free":
                try:
                    os.link(tmp, self.path)  # fails when the name exists: atomic create
                except FileExistsError:
                    return self.acquire(self.check())
                except OSError:  # no hard links here (some FUSE mounts): O_EXCL create
                    try:
                        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    except FileExistsError:
                        return self.acquire(self.check())
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(self._holder.to_json())
            else:
                if self._read_text() != verdict.observed:  # changed since we decided
                    return self.acquire(self.check())
                os.replace(tmp, self.path)
                if verdict.kind == "dead":  # another waiter may have replaced it too
                    time.sleep(min(CONFIRM_S, self.beat_s))
                    now = self._read_text()
                    if now is None or _token(now) != self.token:
                        raise self._in_use(_parse(now or ""), "it took over the same dead lock")
        finally:
            tmp.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._heartbeat, name="zephon-lock", daemon=True)
        self._thread.start()
        return verdict

    def _tmp(self) -> Path:
        return self.path.with_name(f".{LOCK_NAME}.{self.token}.tmp")

    def _store(self) -> bool:
        """Write the holder with the next beat unless another job took the lock."""
        with self._write:
            assert self._holder is not None
            now = self._read_text()
            if now is None or _token(now) != self.token:
                other = _parse(now or "")
                self.lost = (
                    f"the lock {self.path} was taken over by "
                    f"{other.describe() if other else 'another job'}"
                    if now
                    else f"the lock {self.path} was removed"
                )
                return False
            self._holder.beat += 1
            tmp = self._tmp()
            tmp.write_text(self._holder.to_json(), encoding="utf-8")
            os.replace(tmp, self.path)
            return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                if not self._store():
                    return
            except OSError:  # a filesystem hiccup: try again at the next beat
                continue

    def set_agents(self, agents: Iterable[Process]) -> None:
        """Record the torchrun agents of every rank (after the process group exists):
        an elastic restart whose rank 0 lands under any of them is the same job."""
        if self._holder is None:
            return
        self._holder.agents = sorted(set(agents), key=lambda a: (a.host, a.pid))
        self._store()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (clean exit only)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._write:
            text = self._read_text()
            if text is not None and _token(text) == self.token:
                self.path.unlink(missing_ok=True)
        self._holder = None


def _parse(text: str) -> Holder | None:
    try:
        return Holder.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None


def _token(text: str) -> str | None:
    h = _parse(text)
    return h.token if h else None
