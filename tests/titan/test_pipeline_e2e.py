"""Pipeline parallelism trains the model DP trains: the same data, the same initial
weights, the loss normalised over the step's labelled tokens, whatever the pipeline
schedule's micro-batches (issue 43, case 1), and validation runs under PP (case 3).

Each case trains 2 steps on 2 CPU ranks as PP 2 (DP 1) and as DP 2, with validation at
step 1, and compares the step losses, the gradient norms and the validation loss
within ``TOPOLOGY_RTOL`` (the two layouts sum gradients in another order: measured
0 to 1.2e-7 on the losses, 6e-6 on the gradient norm). Every rank logs the loss of the
last stage: the console line of rank 0 (the first stage) is the real loss, never
TorchTitan's -1 marker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.titan.expect import TOPOLOGY_RTOL, assert_losses, assert_same_data
from tests.titan.launch import train, train03
from torchtitan_zephon.run import recorded as runs

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")

STEPS = ("--training.steps", "2", "--checkpoint.interval", "2")
PP2 = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def assert_same_model(reference: Path, run: Path, output: str) -> None:
    """Same data; losses, gradient norms and validation loss within TOPOLOGY_RTOL;
    no stage logs a negative loss."""
    assert_same_data(reference, run, range(1, 3))
    assert_losses(reference, run, range(1, 3), rtol=TOPOLOGY_RTOL)
    for tag in ("grad_norm", "validation_metrics/loss"):
        a, b = runs.read_scalars(reference, tag), runs.read_scalars(run, tag)
        assert a and set(a) == set(b), f"{tag}: reference steps {sorted(a)}, run {sorted(b)}"
        for s in a:
            assert abs(a[s] - b[s]) <= TOPOLOGY_RTOL * abs(a[s]), (
                f"{tag} step {s}: {b[s]} vs {a[s]}"
            )
    lines = [line for line in _ANSI.sub("", output).splitlines() if "validate" not in line]
    logged = [float(m) for m in re.findall(r"step:\s+\d+\s+loss:\s+(\S+)", "\n".join(lines))]
    assert len(logged) == 4 and min(logged) > 0, f"every rank logs the real loss: {logged}"


REFERENCES = {"windows": (), "packing": ("--zephon.packing", "best_fit")}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory):
    """The DP 2 references, local batch 2: windows and packed samples, each trained when
    a test first asks for it (the packed one serves only the slow case)."""
    root = tmp_path_factory.mktemp("dp2")
    runs: dict[str, Path] = {}

    def reference(kind: str) -> Path:
        if kind not in runs:
            runs[kind] = train(root / kind, 2, *STEPS, *REFERENCES[kind]).check().run
        return runs[kind]

    return reference


@pytest.mark.parametrize(
    ("reference", "overrides"),
    [
        pytest.param("windows", (), id="windows"),
        # packing x PP: each part is proven in the default suite (slow: issue 44 part e)
        pytest.param(
            "packing", ("--zephon.packing", "best_fit"), id="packing", marks=pytest.mark.slow
        ),
        # 8 samples per step in 4 pipeline micro-batches of 2: one accumulation step
        pytest.param(
            "windows",
            (
                "--training.local_batch_size",
                "8",
                "--parallelism.pipeline_parallel_microbatch_size",
                "2",
            ),
            id="local_batch_8",
            marks=pytest.mark.slow,  # micro-batches of PP: the windows case (issue 44 part e)
        ),  # fmt: skip
    ],
)
def test_pipeline_parallel_trains_the_model_dp_trains(
    dp2, reference: str, overrides: tuple[str, ...], tmp_path: Path
) -> None:
    pp = train(tmp_path / "pp2", 2, *STEPS, *PP2, *overrides).check()
    assert "Using pipeline schedule" in pp.output
    assert_same_model(dp2(reference), pp.run, pp.output)


@pytest.mark.slow  # MoE x PP: each part is proven in the default suite (issue 44 part e)
def test_pipeline_parallel_moe_trains_the_model_dp_trains(tmp_path: Path) -> None:
    """The MoE (``deepseek_v3_debug``) split into 2 stages against DP 2."""
    dp = train03(tmp_path / "dp2", 2, *STEPS, config="deepseek_v3_debug").check()
    pp = train03(tmp_path / "pp2", 2, *STEPS, *PP2, config="deepseek_v3_debug").check()
    assert "Using pipeline schedule" in pp.output
    assert_same_model(dp.run, pp.run, pp.output)
