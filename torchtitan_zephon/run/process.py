"""Processes named so that a reused pid is not mistaken for them, on any machine.

Role: ``Process`` names a process by host, machine id (the kernel's boot id and
the PID namespace), pid and start time, and tells whether it still runs (asked on
its own machine); ``torchrun_agent`` names this worker's torchrun agent;
``kill_tree`` SIGKILLs a process and everything under it, as a lost node would
lose them (for the node-loss demo and tests; the trainer never calls it).

Invariant: a ``Process`` that records its start time is alive only while its pid
runs with that start time: a pid reused by another process is never taken for it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def machine_id() -> str:
    """What tells two machines (or PID namespaces on one machine) apart: the kernel's
    boot id and this process's PID namespace. Empty where /proc does not say."""
    boot = _read("/proc/sys/kernel/random/boot_id") or ""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = ""
    return f"{boot}/{ns}" if boot or ns else ""


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first)."""
    text = _read(f"/proc/{pid}/stat")
    return text.rsplit(")", 1)[-1].split() if text else None


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a live or zombie process."""
    fields = _stat_fields(pid)
    return (fields[0], fields[19]) if fields and len(fields) > 19 else None


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it, as a lost node would lose them.

    torchrun starts each worker in a session of its own, so killing the agent's
    process group would miss them. Every process of the tree (found in /proc) is
    stopped first, so none can start another or finish its work meanwhile, then
    all are killed. For the node-loss demo and tests; the trainer never calls it.
    """
    import signal

    tree, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:  # already gone
            continue
        tree.append(p)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                fields = _stat_fields(int(entry.name))
                if fields and len(fields) > 1 and fields[1] == str(p):
                    frontier.append(int(entry.name))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class Process:
    """A process, named so that a reused pid is not mistaken for it."""

    host: str
    machine: str
    pid: int
    started: str = ""
    """Start time in clock ticks since boot ("" where unknown)."""

    @classmethod
    def of(cls, pid: int) -> Process:
        st = _stat(pid)
        return cls(socket.gethostname(), machine_id(), int(pid), st[1] if st else "")

    def on_this_machine(self) -> bool:
        return self.host == socket.gethostname() and self.machine == machine_id()

    def alive(self) -> bool:
        """Whether this process still runs (ask only on its own machine)."""
        st = _stat(self.pid)
        if st is not None:
            state, started = st
            return state not in ("Z", "X") and (not self.started or started == self.started)
        try:  # no /proc: ask the kernel
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}"


def torchrun_agent() -> tuple[Process | None, str | None, int]:
    """(this worker's torchrun agent, run id, restart count); (None, None, 0) outside torchrun.

    torchrun's run id is ``none`` for every job started without ``--rdzv-id``, so it
    does not tell jobs apart alone; the agent process does.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None, None, 0
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return Process.of(os.getppid()), run_id, restarts
