"""zephon compare: losses from TensorBoard events aligned by step, tolerance, plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.cli.test_verify import real_runs, write_log  # noqa: F401 (fixture)
from torchtitan_zephon.cli.compare import PLOT_DPI, PLOT_SIZE
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.run.recorded import LOSS_TAG

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def curve(step: int) -> float:
    return 8.0 * math.exp(-0.05 * step) + 1.0


def write_events(
    run: Path, values: dict[int, float], *, job: str = "a", walltime: float = 1000.0
) -> Path:
    """One TensorBoard event file, as one job of the run writes it."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run / "tb" / job))
    for step, value in sorted(values.items()):
        writer.add_scalar(LOSS_TAG, value, step, walltime=walltime + step)
    writer.close()
    return run


def compare(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["compare", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def compare_json(capsys, *argv) -> tuple[int, dict]:
    rc, out, _ = compare(capsys, *argv, "--json")
    return rc, json.loads(out)


def test_identical_curves_pass(tmp_path, capsys):
    values = {s: curve(s) for s in range(1, 11)}
    a, b = write_events(tmp_path / "a", values), write_events(tmp_path / "b", values)
    rc, out, _ = compare(capsys, a, b)
    assert rc == 0 and "PASS" in out and "max |diff| 0" in out
    rc, report = compare_json(capsys, a, b)
    (pair,) = report["comparisons"]
    assert pair["steps_compared"] == 10 and pair["overall"]["max_abs"] == 0.0
    assert report["verdict"] == "pass" and report["rtol"] == 1e-5 and report["atol"] == 0.0


def test_one_step_outside_the_tolerance_fails(tmp_path, capsys):
    values = {s: curve(s) for s in range(1, 11)}
    a = write_events(tmp_path / "a", values)
    b = write_events(tmp_path / "b", {**values, 7: values[7] * (1 + 1e-3)})
    rc, out, _ = compare(capsys, a, b)
    assert rc == 1 and "FAIL" in out and "first at step 7" in out
    rc, report = compare_json(capsys, a, b)
    (pair,) = report["comparisons"]
    assert pair["failing_steps"] == 1 and pair["first_failing_step"] == 7
    assert pair["overall"]["max_rel_step"] == 7
    assert pair["overall"]["max_rel"] == pytest.approx(1e-3, rel=1e-3)
    # a looser tolerance accepts it: |b - a| <= atol + rtol * |a|
    assert compare(capsys, a, b, "--rtol", "2e-3")[0] == 0
    assert compare(capsys, a, b, "--rtol", "0", "--atol", "0.01")[0] == 0


def test_resume_in_the_middle_last_writer_wins_and_is_reported(tmp_path, capsys):
    values = {s: curve(s) for s in range(1, 13)}
    ref = write_events(tmp_path / "ref", values)
    write_log(ref, 12)
    # the first job wrote steps 1..8 (7 and 8 wrong, after its checkpoint at 6) and died;
    # the resumed job rewrote 7..12 later: the later values win
    res = tmp_path / "res"
    first = {s: (v if s <= 6 else v + 1.0) for s, v in values.items() if s <= 8}
    write_events(res, first, job="first", walltime=1000.0)
    resumed = {s: v * (1 + 2e-6) for s, v in values.items() if s > 6}
    write_events(res, resumed, job="second", walltime=5000.0)
    write_log(res, 12, resume_at=6, died_at=8)
    rc, out, _ = compare(capsys, ref, res)
    assert rc == 0, out
    assert "after resume at step 6 (6 steps)" in out
    rc, report = compare_json(capsys, ref, res)
    (pair,) = report["comparisons"]
    assert report["resume_points"] == {"ref": [], "res": [6]}
    (after,) = pair["after_resume"]
    assert after["from_step"] == 6 and after["steps"] == 6
    assert after["max_rel"] == pytest.approx(2e-6, rel=0.1)  # float32 events
    assert pair["overall"]["max_rel"] == after["max_rel"]


def test_three_runs_and_no_overlap(tmp_path, capsys):
    a = write_events(tmp_path / "a", {s: curve(s) for s in range(1, 6)})
    b = write_events(tmp_path / "b", {s: curve(s) for s in range(1, 6)})
    c = write_events(tmp_path / "c", {s: curve(s) for s in range(6, 9)})
    rc, out, _ = compare(capsys, a, b, c)
    assert rc == 1 and "no step in common" in out
    rc, report = compare_json(capsys, a, b, c)
    assert [p["verdict"] for p in report["comparisons"]] == ["pass", "no-overlap"]


def test_falls_back_to_train_log(tmp_path, capsys):
    a = write_events(tmp_path / "a", {s: round(curve(s), 5) for s in range(1, 4)})
    b = tmp_path / "b"
    b.mkdir()
    (b / "train.log").write_text(
        "".join(
            f"[titan] INFO - step: {s:2d}  loss: {curve(s):8.5f}  grad_norm: 1.0\n"
            for s in range(1, 4)
        )
    )
    rc, report = compare_json(capsys, a, b)
    assert rc == 0 and report["sources"]["b"] == str(b / "train.log")


@pytest.mark.parametrize("problem", ["missing", "no_losses", "one_run", "negative_tol"])
def test_bad_input_exits_2(tmp_path, capsys, problem):
    a = write_events(tmp_path / "a", {1: 1.0, 2: 0.5})
    b = tmp_path / "b"
    argv = [a, b]
    if problem == "no_losses":
        b.mkdir()
    elif problem == "one_run":
        argv = [a]
    elif problem == "negative_tol":
        argv = [a, a, "--rtol", "-1"]
    rc, out, err = compare(capsys, *argv)
    assert rc == 2 and err.startswith("zephon compare: error: ")
    expected = {
        "missing": "does not exist",
        "no_losses": "no losses",
        "one_run": "at least two runs",
        "negative_tol": ">= 0",
    }[problem]
    assert expected in err


def _check_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as im:
        assert im.size == (int(PLOT_SIZE[0] * PLOT_DPI), int(PLOT_SIZE[1] * PLOT_DPI))


def test_plot_is_a_png_of_the_expected_size(tmp_path, capsys):
    values = {s: curve(s) for s in range(1, 9)}
    a = write_events(tmp_path / "a", values)
    b = write_events(tmp_path / "b", {s: v * (1 + 1e-6 * s) for s, v in values.items()})
    c = write_events(tmp_path / "c", values)
    write_log(b, 8, resume_at=4, died_at=5)
    png = tmp_path / "out" / "curves.png"
    rc, out, _ = compare(capsys, a, b, c, "--plot", png)
    assert rc == 0 and f"plot: {png}" in out
    _check_png(png)


# ---------------------------------------------------------------- zephon.reproducible

EXACT = {"reproducible": True}


def _pair(tmp_path, values_b: dict[int, float], topo_b: dict | None = EXACT, **log_b):
    """Run a (zephon.reproducible, 2 ranks then 1 from step 6, local batch size 2) and run
    b (a 2-rank run with ``topo_b`` over the same data unless ``log_b`` says otherwise)."""
    values = {s: curve(s) for s in range(1, 11)}
    a = write_log(tmp_path / "a", 10, resume_at=5, died_at=7, topology=EXACT)
    write_events(a, values)
    b = write_log(tmp_path / "b", 10, topology=topo_b, **log_b)
    write_events(b, {**values, **values_b})
    return a, b


def test_two_reproducible_runs_are_expected_equal_to_the_bit(tmp_path, capsys):
    a, b = _pair(tmp_path, {})
    rc, out, _ = compare(capsys, a, b)
    assert rc == 0, out
    assert "both ran with zephon.reproducible at one micro-batch size and one data config: " in out
    assert "equal to the bit expected (|b - a| <= 0 + 0 * |a|)" in out
    assert "the same bits at every common step" in out
    assert "verdict: PASS: all curves agree within |b - a| <= 0 + 0 * |a| (to the bit)" in out
    rc, report = compare_json(capsys, a, b)
    (pair,) = report["comparisons"]
    assert (pair["expected"], pair["rtol"], pair["atol"]) == ("bits", 0.0, 0.0)
    assert pair["training"] == {
        "a": "zephon.reproducible, local batch size 2",
        "b": "zephon.reproducible, local batch size 2",
    }


def test_a_reproducible_pair_that_differs_by_one_ulp_fails_and_says_it_is_not_summation_order(
    tmp_path, capsys
):
    values = {s: curve(s) for s in range(1, 11)}
    import numpy as np

    below = np.nextafter(np.float32(values[5]), np.float32(0.0))  # TensorBoard keeps float32
    a, b = _pair(tmp_path, {5: float(below)})
    rc, out, _ = compare(capsys, a, b)
    assert rc == 1, out
    assert "the curves separate at step 5 (its losses differ in their bits)" in out
    assert (
        "the data is the same (verify: MATCH) and both runs are reproducible: a difference in "
        "the bits is not summation order but a change in what was trained" in out
    )
    assert "1 step(s) outside |b - a| <= 0 + 0 * |a|, first at step 5" in out
    assert compare(capsys, a, b, "--rtol", "1e-6")[0] == 0  # a tolerance given is used


@pytest.mark.parametrize(
    "topo_b, why",
    [
        ({}, "b ran without zephon.reproducible"),
        ({"reproducible": True, "local_batch_size": 4},
         "the micro-batch size differs (a: 2; b: 4), outside zephon.reproducible's guarantee"),
    ],
)  # fmt: skip
def test_other_pairs_keep_the_tolerance_and_say_the_difference_is_summation_order(
    tmp_path, capsys, topo_b, why
):
    values = {s: curve(s) for s in range(1, 11)}
    a, b = _pair(tmp_path, {s: values[s] * (1 + 1e-7) for s in range(4, 11)}, topo_b)
    rc, out, _ = compare(capsys, a, b)
    assert rc == 0, out  # within the default 1e-5
    assert "equal to the bit expected" not in out
    assert "the curves separate at step 4 (its losses differ in their bits)" in out
    assert (
        "the data is the same (verify: MATCH): the difference is the summation order of the "
        f"gradients, not the data ({why})" in out
    )
    rc, report = compare_json(capsys, a, b)
    assert report["comparisons"][0]["expected"] == "tolerance"


def test_curves_over_other_data_are_not_called_summation_order(tmp_path, capsys):
    values = {s: curve(s) for s in range(1, 11)}
    a, b = _pair(tmp_path, {s: values[s] * 1.01 for s in range(3, 11)}, {}, differ_at=(3,))
    rc, out, _ = compare(capsys, a, b)
    assert rc == 1
    assert "the curves separate at step 3" in out
    assert "the data is not shown to be the same (verify: MISMATCH): run `zephon verify " in out
    assert "summation order" not in out


# ---------------------------------------------------------------- real runs


def test_real_resume_on_fewer_ranks_losses_agree(real_runs, capsys, tmp_path):  # noqa: F811
    png = tmp_path / "real.png"
    rc, report = compare_json(capsys, real_runs.ref, real_runs.resumed, "--plot", png)
    assert rc == 0, report
    (pair,) = report["comparisons"]
    assert pair["steps_compared"] == 8 and pair["overall"]["max_rel"] <= 1e-5
    assert report["resume_points"]["resumed"] == [4]
    assert report["sources"]["ref"] == "tensorboard"
    _check_png(png)
    # another seed: other data, other losses
    rc, report = compare_json(capsys, real_runs.ref, real_runs.other_seed)
    assert rc == 1 and report["comparisons"][0]["first_failing_step"] == 1
