"""scripts/gpu_check.sh on a machine without a GPU: which mode it picks and why, the
engine-level check on the CPU (ZEPHON_DEVICE=cpu: loader -> plain PyTorch bf16 step,
no TorchTitan), and the full check's two runs parsed as the trainer will parse them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list[str], out: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "ZEPHON_DEVICE"}
    environ.update(OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=environ, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_mode_choice_names_the_torch_found_and_needed():
    choose = _gpu_check_module().choose_mode
    mode, why = choose("2.11.0+cu126", "0.2.2", True)  # the borrowed GPU machine
    assert mode == "engine"
    assert "torch 2.11.0+cu126 is older than 2.14.1" in why and "the full check cannot run" in why
    assert choose("2.14.0", "0.3.0", True)[0] == "engine"
    assert choose("2.14.1+cu130", "0.3.0", True) == (
        "full",
        "torch 2.14.1+cu130 and TorchTitan 0.3.0 on CUDA",
    )
    assert choose("2.15.0", "0.3.1", True)[0] == "full"
    mode, why = choose("2.15.0", None, True)
    assert (
        mode == "engine"
        and "TorchTitan 0.3 is needed for the full check, found not installed" in why
    )
    mode, why = choose("2.14.1", "0.2.2", True)
    assert mode == "engine" and "found version 0.2.2" in why
    assert choose("2.14.1", "0.3.0", False) == (
        "engine",
        "no CUDA device: the full check trains on a GPU",
    )


def test_engine_check_on_cpu_reports_step_time_and_data_wait(tmp_path: Path):
    out = tmp_path / "out"
    r = _run(
        ["--mode", "engine", "--steps", "2", "--seq-len", "32", "--batch", "2", "--dim", "16",
         "--layers", "1", "--heads", "2"],
        out, ZEPHON_DEVICE="cpu",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gpu_check: mode engine: --mode engine" in r.stdout
    assert "engine check (no TorchTitan) on cpu" in r.stdout
    for name in ("zephon", "synthetic"):
        assert f"  {name:<9} step time " in r.stdout and "data wait" in r.stdout
    result = json.loads((out / "engine_check.json").read_text())
    assert result["mode"] == "engine" and result["dtype"] == "bfloat16 autocast"
    for name in ("zephon", "synthetic"):
        x = result[name]
        assert x["measured_steps"] == 2 and x["step_s_median"] > 0
        assert 0 <= x["data_wait_pct"] < 100 and x["data_wait_s_mean"] >= 0
    assert (out / "gpu_check.txt").read_text().startswith("gpu_check: mode engine")


def test_without_gpu_it_says_how_to_run_on_cpu(tmp_path: Path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = _run([], tmp_path)
    assert r.returncode == 2
    assert "gpu_check: mode engine: no CUDA device: the full check trains on a GPU" in r.stdout
    assert "set ZEPHON_DEVICE=cpu to run the engine-level check on the CPU" in r.stdout
    assert not (tmp_path / "engine_check.json").exists()


@pytest.mark.slow  # two torchrun jobs: `scripts/test.sh -m slow`
def test_full_check_dry_run_parses_both_runs(tmp_path: Path):
    r = _run(["--dry-run", "--mode", "full"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if "parses as:" in x]
    assert len(lines) == 5, r.stdout
    ref, resumed, fp32, exact, exact_resumed = lines
    assert "seq_len 2048, local batch 8 x 2 micro-batches = global batch 16" in ref
    assert "local batch 16 x 1 micro-batches = global batch 16" in resumed
    assert "mixed precision bfloat16" in ref and "mixed precision bfloat16" in resumed
    for line in (fp32, exact, exact_resumed):  # zephon.reproducible and its baseline
        assert "local batch 8 x 2 micro-batches" in line and "mixed precision float32" in line
    assert "--zephon.reproducible" in r.stdout
    for line in lines:
        assert "checkpoint every 10" in line
        assert "dataloader ZephonDataLoader.Config, validator ZephonValidator.Config" in line
