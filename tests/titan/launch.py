"""Launch real ``torchrun`` jobs on CPU for the end-to-end tests.

Every job runs the tiny flavor with gloo, one intra-op thread per rank, and
writes its console output to ``<run>/train.log``: ``train`` as users launch a TOML
job (``--job.config_file tests/titan/tiny.toml`` and 0.2.2 ``--section.key``
overrides, through the trainer's TOML front end), ``train03`` as a config
function of the registry (``--module torchtitan_zephon.configs --config
llama3_tiny``, the same job, 0.3 spellings).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from torchtitan_zephon.run.process import kill_tree

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "titan" / "tiny.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 120.0) -> None:
    """Block until something listens on 127.0.0.1:port (a torchrun agent's rendezvous store)."""
    import time

    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout} s") from None
            time.sleep(0.05)


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", ZEPHON_DEVICE="cpu", PYTHONUNBUFFERED="1")
    return env


def train_command(
    run: Path, nproc: int, overrides: list[str], *, torchrun_args: list[str] | None = None
) -> list[str]:
    launcher = torchrun_args if torchrun_args is not None else ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *launcher,
        f"--nproc_per_node={nproc}",
        "-m", "torchtitan_zephon.train",
        "--job.config_file", str(TINY),
        "--job.dump_folder", str(run),
        *overrides,
    ]  # fmt: skip


@dataclass
class Job:
    run: Path
    returncode: int
    output: str

    def check(self) -> Job:
        assert self.returncode == 0, (
            f"job in {self.run} failed ({self.returncode}):\n{self.output[-6000:]}"
        )
        return self


def train(
    run: Path,
    nproc: int = 2,
    *overrides: str,
    timeout: int = 600,
    log: Path | None = None,
    torchrun_args: list[str] | None = None,
) -> Job:
    """Run one job to completion; its output is appended to ``log`` (default
    ``<run>/train.log``; tests that compare the run folder before and after put it
    elsewhere)."""
    if log is None:
        run.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        train_command(run, nproc, list(overrides), torchrun_args=torchrun_args),
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    with open(log or run / "train.log", "a") as f:
        f.write(proc.stdout)
    return Job(run, proc.returncode, proc.stdout)


def train03(
    run: Path,
    nproc: int = 2,
    *overrides: str,
    config: str = "llama3_tiny",
    timeout: int = 600,
    log: Path | None = None,
) -> Job:
    """Run one TorchTitan 0.3 job of Zephon's registry (``--module torchtitan_zephon.configs
    --config CONFIG``) to completion; its output is appended to ``log`` (default
    ``<run>/train.log``, as ``train``)."""
    if log is None:
        run.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}",
        "-m", "torchtitan_zephon.train",
        "--module", "torchtitan_zephon.configs", "--config", config,
        "--dump_folder", str(run),
        *overrides,
    ]  # fmt: skip
    proc = subprocess.run(
        command,
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    with open(log or run / "train.log", "a") as f:
        f.write(proc.stdout)
    return Job(run, proc.returncode, proc.stdout)


def copy_run_until(src: Path, dst: Path, step: int) -> Path:
    """A copy of run ``src`` as a job that died after checkpoint ``step``: later
    checkpoints are removed (the log and TensorBoard files stay, as they would)."""
    shutil.copytree(src, dst)
    for ck in (dst / "checkpoint").iterdir():
        if ck.name.startswith("step-") and int(ck.name.split("-")[1]) > step:
            shutil.rmtree(ck)
    return dst


def kill_node(pid: int) -> None:
    """Lose a "node": SIGKILL a torchrun agent and every process under it."""
    kill_tree(pid)


def kill_after_step(proc: subprocess.Popen, run: Path, step: int, timeout: float = 300) -> None:
    """Wait until the job ``proc`` (run folder ``run``) has logged ``step``, then kill its
    whole process tree and reap it; fails if it exits or takes ``timeout`` s first."""
    import time

    from torchtitan_zephon.titan.ft.launch import last_step

    deadline = time.time() + timeout
    while last_step(run) < step:
        assert proc.poll() is None and time.time() < deadline, f"no step {step} in {run}"
        time.sleep(0.02)
    kill_tree(proc.pid)
    proc.wait()
