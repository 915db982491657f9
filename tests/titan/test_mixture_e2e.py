"""Mixtures end to end: a two-source mixture of the builtin corpus with a weight change.

A job trained 4 steps on 2 ranks under a mixture file, resumed on 3 ranks with an
entry appended for step 6, sees the data of an uninterrupted 1-rank run of the
final file (``zephon verify`` MATCH), and its per-source validation losses are
the reference's; a resume that edits the weights of trained steps is refused and
leaves the run folder unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_refused,
    assert_unchanged,
    log_records,
    resume_events,
    tree,
)
from tests.titan.launch import copy_run_until, train
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.run import recorded as runs

SOURCES = """
[[source]]
name = "stdlib"
store = "builtin:stdlib"

[[source]]
name = "docs"
store = "builtin:docs"

[[schedule]]
from_step = 1
weights = { docs = {w1}, stdlib = 0.25 }
"""
LATER = """
[[schedule]]
from_step = 6
weights = { docs = 0.25, stdlib = 0.75 }
"""
# 12 = 2 ranks x 2 x 3 micro-batches = 3 ranks x 2 x 2; 24 held-out samples per source.
MIX = ("--training.global_batch_size", "12", "--zephon.heldout_samples", "24")


@pytest.fixture(scope="module")
def mixture_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixtures")
    texts = {
        "first": SOURCES.replace("{w1}", "0.75"),  # the weights of steps 1-5 only
        "full": SOURCES.replace("{w1}", "0.75") + LATER,  # plus the change at step 6
        "past_edit": SOURCES.replace("{w1}", "0.5") + LATER,  # other weights for steps 1-5
    }
    for name, text in texts.items():
        (root / f"{name}.toml").write_text(text)
    return {name: root / f"{name}.toml" for name in texts}


@pytest.fixture(scope="module")
def mixture_reference(e2e_root: Path, mixture_files: dict[str, Path]) -> Path:
    """1 rank, 8 steps, the full mixture file from the start."""
    mix = ("--zephon.mixture", str(mixture_files["full"]), *MIX)
    return train(e2e_root / "mixture_reference", 1, *mix).check().run


def test_resume_on_three_ranks_across_a_weight_change_with_an_appended_entry(
    e2e_root: Path, mixture_files: dict[str, Path], mixture_reference: Path, capsys
):
    run = e2e_root / "mixture_appended"
    first = ("--zephon.mixture", str(mixture_files["first"]), *MIX)
    # a job of 4 steps with the learning-rate schedule of 8, as if it had died after 4
    train(run, 2, *first, "--training.steps", "4", "--lr_scheduler.total_steps", "8").check()
    job = train(run, 3, "--zephon.mixture", str(mixture_files["full"]), *MIX).check()
    assert "mixture gained entries for steps after 4: an exact continuation" in job.output
    (event,) = resume_events(run)
    assert (event["from_step"], event["dp_degree"], event["extended"]) == (4, 3, ["mixture"])

    assert main(["verify", str(mixture_reference), str(run)]) == 0
    assert "verdict: MATCH: both runs saw identical data at all 8 common steps" in (
        capsys.readouterr().out
    )
    ref, got = log_records(mixture_reference), log_records(run)
    for s in range(1, 9):
        assert got[s]["tokens_digest"] == ref[s]["tokens_digest"], s
    for name in ("docs", "stdlib"):
        tag = f"validation/loss/{name}"
        a, b = runs.read_scalars(mixture_reference, tag), runs.read_scalars(run, tag)
        assert set(a) >= {4, 8} and set(b) >= {8}, (a, b)
        assert abs(a[8] - b[8]) <= TOPOLOGY_RTOL * a[8], (name, a, b)
    overall = runs.read_scalars(mixture_reference, "validation_metrics/loss")
    docs = runs.read_scalars(mixture_reference, "validation/loss/docs")
    stdlib = runs.read_scalars(mixture_reference, "validation/loss/stdlib")
    # 24 held-out samples per source, the same token count: the overall loss is the mean
    assert overall[8] == pytest.approx((docs[8] + stdlib[8]) / 2, rel=1e-6)

    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "mixture at step 9 (2 sources" in out
    assert "docs       1/4" in out and "stdlib     3/4" in out, out


def test_a_resume_that_edits_trained_weights_is_refused(
    e2e_root: Path, mixture_files: dict[str, Path], mixture_reference: Path
):
    run = copy_run_until(mixture_reference, e2e_root / "mixture_past_edit", 4)
    before = tree(run)
    mix = ("--zephon.mixture", str(mixture_files["past_edit"]), *MIX)
    job = train(run, 1, *mix, log=e2e_root / "mixture_past_edit.log")
    expected = (
        "mixture: schedule entry 1 (from_step 1): weight of source 'docs' was 3/4, now 2/3 "
        "(normalized)."
    )
    assert_refused(job, "Differing fields", expected, "allow_changes=['mixture']")
    assert_unchanged(before, tree(run))
