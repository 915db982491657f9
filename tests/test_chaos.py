"""scripts/chaos.sh in short: killed twice, resumed at random topologies, still exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # kills and resumes that tests/titan (node loss, elastic resume) cover
def test_short_chaos_run_verifies_and_losses_agree(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos.py"), "--cycles", "2", "--steps", "8",
         "--seed", "3", "--max-ranks", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    verdict = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert verdict.startswith("chaos: PASS: cycles 2, kills "), verdict
    summary = json.loads((tmp_path / "chaos.json").read_text())
    assert summary["steps_verified"] == 8 and summary["divergent_steps"] == 0
    assert summary["max_loss_rel_diff"] <= 1e-4
    assert len(summary["history"]) >= 1


def test_bad_arguments_are_refused():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos.py"), "--cycles", "-1"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 2 and "--cycles must be >= 0" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # replica groups killed and returning: tests/titan/test_ft_e2e.py in short
def test_torchft_chaos_run_verifies_every_group(tmp_path: Path):
    """scripts/chaos_ft.py: three replica groups, five drawn kills, returns and whole-job
    kills; every group's log MATCHes the one-group reference and group 0's."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos_ft.py"), "--cycles", "5", "--groups", "3",
         "--seed", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=1500, cwd=REPO,
    )  # fmt: skip
    verdict = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert verdict.startswith("chaos_ft: PASS: cycles "), verdict
    summary = json.loads((tmp_path / "chaos_ft.json").read_text())
    assert summary["divergent_steps"] == 0 and summary["max_loss_rel_diff"] <= 1e-4
    for group in summary["groups_verified"].values():
        assert group["verify"] == group["verify_group0"] == "match"
        assert group["steps_verified"] == summary["steps"]


def test_torchft_chaos_bad_arguments_are_refused():
    for argv, message in ((["--cycles", "-1"], "--cycles must be >= 0"),
                          (["--cycles", "1", "--groups", "1"], "--groups must be >= 2")):  # fmt: skip
        out = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "chaos_ft.py"), *argv],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert out.returncode == 2 and message in out.stderr
        assert "Traceback" not in out.stderr
