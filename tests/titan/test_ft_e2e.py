"""Replica groups under torchft train exactly what one group trains (issue 30 part a2),
end to end with real parts: a real ``torchft_lighthouse`` on loopback and each replica
group a real ``torchrun`` job with its own run folder, on gloo.

Two groups of one rank each train 4 steps of the tiny Llama at a global batch of 8 (4
samples each per step); an uninterrupted one-group run without torchft trains the same
4 steps. Every group's sequence log must equal that run's (``zephon verify`` MATCH, and
token digests gathered over both groups at audit ``tokens``), the losses logged must be
that run's (the mean over all of B(s), within the tolerance the elastic-resume tests
use: the reduction order differs), and the groups' logs must match each other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.titan.conftest import lighthouse_at
from tests.titan.expect import TOPOLOGY_RTOL, assert_losses, assert_same_data, assert_verify_match
from tests.titan.launch import REPO, job_env, train03

pytest.importorskip("torchft", reason="torchft (a dependency of the package)")

STEPS = ("--training.steps", "4")


def _group(run: Path, replica: int, groups: int, url: str) -> subprocess.Popen:
    run.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "torchtitan_zephon.train", "--module", "torchtitan_zephon.configs",
        "--config", "llama3_tiny", "--dump_folder", str(run), *STEPS,
        "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica),
        "--fault_tolerance.group_size", str(groups), "--fault_tolerance.min_replica_size", "1",
    ]  # fmt: skip
    env = {**job_env(), "TORCHFT_LIGHTHOUSE": url}
    log = open(run / "train.log", "w")  # noqa: SIM115 - closed by the caller's wait
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


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


def test_two_groups_train_exactly_what_one_group_trains(tmp_path: Path) -> None:
    runs = [tmp_path / f"group{r}" for r in range(2)]
    with lighthouse_at(2) as url:
        procs = [_group(run, r, 2, url) for r, run in enumerate(runs)]
        _wait(procs, runs)
    one = tmp_path / "one_group"
    train03(one, 1, *STEPS).check()
    for run in runs:
        text = (run / "train.log").read_text()
        assert "Zephon: torchft quorum of 2 group(s) from step 1: this group trains part" in text
        assert "(4 of the step's 8 samples)" in text
        assert_same_data(one, run, range(1, 5))
        assert_losses(one, run, range(1, 5), rtol=TOPOLOGY_RTOL)
        assert_verify_match(one, run)
    assert_verify_match(runs[0], runs[1])
    parts = {
        os.path.basename(r): (r / "train.log").read_text().count("trains part 0") for r in runs
    }
    assert sorted(parts.values()) == [0, 1], parts  # one group trains part 0, the other part 1
