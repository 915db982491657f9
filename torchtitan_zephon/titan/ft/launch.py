"""A torchft lighthouse and replica groups on this machine, as a user starts them: for
``scripts/chaos_ft.py``, ``zephon bench ft`` and the tests.

Role: ``local_lighthouse`` runs the ``torchft_lighthouse`` installed with the package
(beside this Python) on a free loopback port and yields its ``TORCHFT_LIGHTHOUSE``
address (the loopback IP: the lighthouse itself advertises the host name);
``group_command`` is the ``torchrun`` command of replica group ``I`` of ``N``, a job
of the registry (``--module torchtitan_zephon.configs``) with its own run folder and
``--standalone`` rendezvous (a port of its own: groups on one machine never collide);
``group_env`` the environment a CPU group runs with; ``last_step`` the last step a run's
sequence log holds so far.

Invariant: a lighthouse started here is stopped (terminated, then killed) when the
``with`` block ends, whatever ends it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REGISTRY = "torchtitan_zephon.configs"


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"torchft_lighthouse exited ({proc.returncode}) before listening on "
                    f"127.0.0.1:{port}"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"torchft_lighthouse does not listen on 127.0.0.1:{port} after {timeout} s"
                ) from None
            time.sleep(0.05)


def lighthouse_binary() -> Path:
    """The ``torchft_lighthouse`` of this environment (torchft is a dependency)."""
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    if not binary.exists():
        raise FileNotFoundError(
            f"no torchft_lighthouse beside {sys.executable}: install the package "
            "(pip install -e .), which installs torchft and its lighthouse."
        )
    return binary


@contextmanager
def local_lighthouse(
    min_replicas: int = 1, heartbeat_timeout_ms: int = 5000, timeout_s: float = 30.0
) -> Iterator[str]:
    """A real lighthouse on a free loopback port, forming quorums of at least
    ``min_replicas`` groups and dropping a group silent for ``heartbeat_timeout_ms``;
    yields its address, stops it afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [
            str(lighthouse_binary()),
            "--min_replicas",
            str(min_replicas),
            "--bind",
            f"127.0.0.1:{port}",
            "--heartbeat_timeout_ms",
            str(heartbeat_timeout_ms),
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, proc, timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def job_command(run: Path, *extra: str, config: str = "llama3_tiny", nproc: int = 1) -> list[str]:
    """The ``torchrun`` command of the registry job ``config`` on ``nproc`` ranks writing
    ``run``, with ``extra`` options (a job without torchft: the one-group reference)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}",
        "-m", "torchtitan_zephon.train", "--module", REGISTRY, "--config", config,
        "--dump_folder", str(run), *extra,
    ]  # fmt: skip


def group_command(
    run: Path,
    replica: int,
    groups: int,
    *extra: str,
    config: str = "llama3_tiny",
    nproc: int = 1,
    min_replica_size: int = 1,
) -> list[str]:
    """The ``torchrun`` command of replica group ``replica`` of ``groups``: ``job_command``
    and the fault-tolerance options after ``extra`` (later options win)."""
    return [
        *job_command(run, *extra, config=config, nproc=nproc),
        "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica),
        "--fault_tolerance.group_size", str(groups),
        "--fault_tolerance.min_replica_size", str(min_replica_size),
    ]  # fmt: skip


def group_env(lighthouse: str | None = None) -> dict[str, str]:
    """This environment for a CPU job (one intra-op thread per rank, unbuffered output),
    with ``TORCHFT_LIGHTHOUSE`` when ``lighthouse`` is given."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", ZEPHON_DEVICE="cpu", PYTHONUNBUFFERED="1")
    if lighthouse is not None:
        env["TORCHFT_LIGHTHOUSE"] = lighthouse
    return env


def last_step(run: Path) -> int:
    """The step of the last record in ``run``'s sequence log so far (0: none yet): after
    a resume that rolled back, the step trained again last. A line being written (no
    newline yet) and events are not counted."""
    path = run / "zephon" / "sequence_log.jsonl"
    try:
        data = path.read_bytes()
    except OSError:
        return 0
    for line in reversed(data.split(b"\n")[:-1]):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "event" not in record:
            step = record.get("step")
            if isinstance(step, int):
                return step
    return 0
