"""check_job_config: settings TorchTitan would assert on are refused up front, clearly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.titan.launch import TINY, train


@pytest.fixture(scope="module")
def base_job():
    """tests/titan/tiny.toml parsed once by TorchTitan's ConfigManager."""
    import torchtitan_zephon.titan  # noqa: F401 - the triton stub, before torchtitan
    from torchtitan_zephon.titan import platform

    platform.apply()
    from torchtitan.config import ConfigManager

    from torchtitan_zephon.titan.spec import register

    register()
    return ConfigManager().parse_args(["--job.config_file", str(TINY)])


@pytest.fixture
def parse(base_job):
    """A copy of the tiny job with ``--section.key value`` overrides applied."""

    def job(*overrides: str):
        cfg = copy.deepcopy(base_job)
        for flag, value in zip(overrides[::2], overrides[1::2], strict=True):
            section, key = flag.removeprefix("--").split(".")
            old = getattr(getattr(cfg, section), key)
            setattr(getattr(cfg, section), key, type(old)(value))
        return cfg

    return job


def _refused(job, world: int) -> str:
    from torchtitan_zephon.titan.checks import check_job_config

    with pytest.raises(ValueError) as e:
        check_job_config(job, world_size=world)
    return str(e.value)


def test_accepts_the_test_and_example_layouts(parse):
    from torchtitan_zephon.titan.checks import check_job_config

    for world in (1, 2, 4, 8):
        check_job_config(parse(), world_size=world)
    check_job_config(parse("--parallelism.tensor_parallel_degree", "2"), world_size=4)
    check_job_config(parse("--parallelism.tensor_parallel_degree", "4"), world_size=4)
    check_job_config(parse("--parallelism.data_parallel_shard_degree", "2"), world_size=2)


def test_odd_seq_len(parse):
    """TorchTitan's llama3 parallelize asserts seq_len % (TP x 2 x CP) == 0, so an odd
    seq_len failed at every TP/CP degree with an AssertionError about TP 1 and CP 1."""
    msg = _refused(parse("--training.seq_len", "63"), 1)
    assert "training.seq_len = 63 must be a multiple of TP degree 1 x 2 x CP degree 1 = 2" in msg
    assert "--training.seq_len 62 or 64" in msg
    assert "--training.seq_len 2." in _refused(parse("--training.seq_len", "1"), 1)
    tp4 = parse("--training.seq_len", "60", "--parallelism.tensor_parallel_degree", "4")
    assert "= 8" in _refused(tp4, 4) and "56 or 64" in _refused(tp4, 4)


def test_tp_must_divide_the_heads(parse):
    msg = _refused(
        parse("--parallelism.tensor_parallel_degree", "3", "--training.seq_len", "66"), 3
    )
    assert "tensor_parallel_degree = 3 does not divide the 4 attention heads" in msg
    assert "zephon_llama3 flavor tiny" in msg and "TP degrees that work: [1, 2, 4]" in msg


def test_degrees_must_fit_the_world(parse):
    msg = _refused(parse("--parallelism.tensor_parallel_degree", "2"), 3)
    assert "the job has 3 ranks, which is not a multiple of" in msg and "= 2" in msg
    msg = _refused(parse("--parallelism.data_parallel_shard_degree", "2"), 4)
    assert "data_parallel_shard 2 = 2, but the job has 4 ranks" in msg
    assert "must be >= 1" in _refused(parse("--parallelism.tensor_parallel_degree", "0"), 1)
    msg = _refused(parse("--parallelism.data_parallel_shard_degree", "0"), 1)
    assert "must be -1" in msg


@pytest.mark.parametrize(
    "flag, name",
    [
        ("--checkpoint.interval", "checkpoint.interval"),
        ("--metrics.log_freq", "metrics.log_freq"),
        ("--validation.freq", "validation.freq"),
        ("--training.local_batch_size", "training.local_batch_size"),
    ],
)
def test_zero_steps_and_sizes(parse, flag, name):
    """A zero frequency was a ZeroDivisionError at the first ``step % freq``."""
    msg = _refused(parse(flag, "0"), 1)
    assert msg.startswith(f"{name} = 0") and f"--{name}" in msg


def test_unknown_flavor(parse):
    msg = _refused(parse("--model.flavor", "huge"), 1)
    assert "model.flavor = 'huge' is not a flavor of zephon_llama3" in msg and "'tiny'" in msg


def test_trainer_refuses_odd_seq_len_before_building_anything(tmp_path: Path):
    """End to end: the job stops with the check's message (was a bare AssertionError from
    TorchTitan's parallelize, after the store, tokenizer and model were built)."""
    job = train(tmp_path / "run", 1, "--training.seq_len", "63", "--training.steps", "2")
    assert job.returncode != 0
    assert "ValueError: training.seq_len = 63 must be a multiple of" in job.output
    assert "AssertionError" not in job.output
    assert not (tmp_path / "run" / "zephon").exists()  # no sequence log was started
