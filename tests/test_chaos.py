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
