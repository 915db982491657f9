"""check_job_config: settings TorchTitan would assert on are refused up front, clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.titan.expect import assert_refused
from tests.titan.launch import train03


@pytest.fixture
def parse():
    """The job's view of the tiny registry job (``llama3_tiny``) with ``--section.key value``
    overrides, parsed as the trainer's entry point parses them (tyro)."""
    from torchtitan_zephon.titan import platform

    platform.apply()
    from torchtitan_zephon.titan.settings.job_view import job_view
    from torchtitan_zephon.train import parse_config

    def job(*overrides: str):
        return job_view(
            parse_config(
                [
                    "--module",
                    "torchtitan_zephon.configs",
                    "--config",
                    "llama3_tiny",
                    *overrides,
                ]
            )
        )

    return job


def _refused(job, world: int) -> str:
    from torchtitan_zephon.titan.start.checks import check_job_config

    with pytest.raises(ValueError) as e:
        check_job_config(job, world_size=world)
    return str(e.value)


def test_accepts_the_test_and_example_layouts(parse):
    from torchtitan_zephon.titan.start.checks import check_job_config

    for world in (1, 2, 4, 8):
        check_job_config(parse(), world_size=world)
    check_job_config(parse("--parallelism.tensor_parallel_degree", "2"), world_size=4)
    check_job_config(parse("--parallelism.tensor_parallel_degree", "4"), world_size=4)
    check_job_config(parse("--parallelism.data_parallel_shard_degree", "2"), world_size=2)


def test_seq_len_must_split_over_tp_and_cp(parse):
    """TorchTitan 0.3's trainer asserts seq_len % (TP x (2 x CP when CP > 1)) == 0 (0.2.2's
    llama3 parallelize asked for TP x 2 x CP even at TP = CP = 1: an odd seq_len trains now)."""
    from torchtitan_zephon.titan.start.checks import check_job_config

    check_job_config(parse("--training.seq_len", "63"), world_size=1)
    msg = _refused(parse("--training.seq_len", "0"), 1)
    assert msg == "training.seq_len = 0: it must be >= 1. Set --training.seq_len."
    tp4 = parse("--training.seq_len", "62", "--parallelism.tensor_parallel_degree", "4")
    msg = _refused(tp4, 4)
    assert "training.seq_len = 62 must be a multiple of TP degree 4 = 4" in msg
    assert "--training.seq_len 60 or 64" in msg
    cp = parse("--training.seq_len", "62", "--parallelism.context_parallel_degree", "2")
    assert "TP degree 1 x 2 x CP degree 2 = 4" in _refused(cp, 2)


def test_tp_must_divide_the_heads(parse):
    msg = _refused(
        parse("--parallelism.tensor_parallel_degree", "3", "--training.seq_len", "66"), 3
    )
    assert "tensor_parallel_degree = 3 does not divide the 4 attention heads" in msg
    assert "llama3 flavor tiny" in msg and "TP degrees that work: [1, 2, 4]" in msg


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
        ("--metrics.log_freq", "metrics.log_freq"),
        ("--validator.freq", "validator.freq"),
        ("--training.local_batch_size", "training.local_batch_size"),
    ],
)
def test_zero_steps_and_sizes(parse, flag, name):
    """A zero frequency was a ZeroDivisionError at the first ``step % freq``."""
    msg = _refused(parse(flag, "0"), 1)
    assert msg.startswith(f"{name} = 0") and f"--{name}" in msg


def test_trainer_refuses_a_setting_before_building_anything(tmp_path: Path):
    """End to end: the job stops with the check's message, without a traceback, before
    TorchTitan (or the preflight) writes anything."""
    job = train03(tmp_path / "log", 1, "--dump_folder", str(tmp_path / "run"),
                  "--training.local_batch_size", "0")  # fmt: skip
    assert_refused(job, "Zephon refused to start: ValueError: training.local_batch_size = 0")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def parse_moe():
    """The job's view of the tiny MoE registry job (``deepseek_v3_debug``: 4 routed experts,
    4 attention heads) with overrides."""
    from torchtitan_zephon.titan import platform

    platform.apply()
    from torchtitan_zephon.titan.settings.job_view import job_view
    from torchtitan_zephon.train import parse_config

    def job(*overrides: str):
        return job_view(
            parse_config(
                [
                    "--module",
                    "torchtitan_zephon.configs",
                    "--config",
                    "deepseek_v3_debug",
                    *overrides,
                ]
            )
        )

    return job


def test_ep_must_divide_the_experts_and_the_ranks_it_borrows(parse_moe, parse):
    from torchtitan_zephon.titan.start.checks import check_job_config

    ep = "--parallelism.expert_parallel_degree"
    assert parse_moe().num_experts == 4 and parse().num_experts is None
    for world, degree in ((1, "1"), (2, "2"), (4, "2"), (4, "4"), (8, "4")):
        check_job_config(parse_moe(ep, degree), world_size=world)
    msg = _refused(parse_moe(ep, "8"), 8)
    assert msg == (
        "parallelism.expert_parallel_degree = 8 does not divide the 4 routed experts of "
        "deepseek_v3 flavor tiny: each EP rank must hold whole experts. EP degrees that work "
        "here: [1, 2, 4]."
    )
    msg = _refused(parse_moe(ep, "4"), 2)
    assert msg == (
        "parallelism.expert_parallel_degree = 4 does not divide data_parallel_shard 2 x "
        "context_parallel 1 x tensor_parallel 1 = 2 ranks, which expert parallelism takes its "
        "ranks from. EP degrees that work here: [1, 2]."
    )
    msg = _refused(parse(ep, "2"), 2)
    assert msg == (
        "parallelism.expert_parallel_degree = 2, but llama3 flavor tiny has no MoE layer (no "
        "experts to spread). Set --parallelism.expert_parallel_degree 1."
    )
    assert "expert_parallel_degree = 0: a parallelism degree must be >= 1" in _refused(
        parse_moe(ep, "0"), 1
    )


def test_tp_must_divide_the_moe_models_heads(parse_moe):
    msg = _refused(
        parse_moe("--parallelism.tensor_parallel_degree", "3", "--training.seq_len", "66"), 3
    )
    assert "tensor_parallel_degree = 3 does not divide the 4 attention heads" in msg
    assert "deepseek_v3 flavor tiny" in msg and "TP degrees that work: [1, 2, 4]" in msg


# slow (issue 44 part e): the EP check in-process
# (test_ep_must_divide_the_experts_and_the_ranks_it_borrows), the checks' refusal path end
# to end by default
@pytest.mark.slow
def test_trainer_refuses_an_ep_degree_before_building_anything(tmp_path: Path):
    """End to end: EP 2 on 1 rank stops with the check's message, nothing written."""
    job = train03(tmp_path / "log", 1, "--dump_folder", str(tmp_path / "run"),
                  "--parallelism.expert_parallel_degree", "2", config="deepseek_v3_debug")  # fmt: skip
    assert_refused(
        job,
        "Zephon refused to start: ValueError: parallelism.expert_parallel_degree = 2 does not "
        "divide data_parallel_shard 1 x context_parallel 1 x tensor_parallel 1 = 1 ranks",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("read_ahead_steps", "-1", "it must be a number of steps >= 0 (0: none)"),
        ("read_ahead_bytes", "-5", "it must be bytes >= 0 (0: one step at a time)"),
        ("cache_bytes", "-1", "it must be bytes >= 0 (0: no node cache)"),
    ],
)
def test_remote_settings_out_of_range_are_refused_for_a_local_store(parse, name, value, allowed):
    """Checked at start for every job (here the builtin, local store), not only when a
    remote store opens."""
    msg = _refused(parse(f"--zephon.{name}", value), 1)
    assert msg == f"zephon.{name} = {value}: {allowed}. Set --zephon.{name} 0 or more."


@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf"])
def test_a_request_timeout_must_be_positive_and_finite(parse, value):
    msg = _refused(parse("--zephon.request_timeout_s", value), 1)
    assert msg == (
        f"zephon.request_timeout_s = {float(value)}: it must be a finite number of seconds > 0 "
        "(the default is 30). Set --zephon.request_timeout_s."
    )


def test_the_remote_settings_in_range_pass(parse):
    from torchtitan_zephon.titan.start.checks import check_job_config

    check_job_config(
        parse(
            "--zephon.read_ahead_steps", "0", "--zephon.read_ahead_bytes", "0",
            "--zephon.request_timeout_s", "0.5", "--zephon.cache_bytes", "1000000",
        ),
        world_size=1,
    )  # fmt: skip


def test_a_cache_dir_url_is_refused_when_the_node_cache_is_on(parse):
    msg = _refused(
        parse("--zephon.cache_bytes", "1000", "--zephon.cache_dir", "s3://bucket/cache"), 1
    )
    assert "zephon.cache_dir" in msg and "s3://bucket/cache" in msg


def test_trainer_refuses_a_remote_setting_and_leaves_the_run_folder_unchanged(tmp_path: Path):
    """End to end, on the builtin (local) store: the job stops with the check's one-line
    message, no traceback, and an existing run folder is left as it was."""
    from tests.titan.expect import assert_unchanged, tree

    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("kept\n")
    before = tree(run)
    job = train03(tmp_path / "log", 1, "--dump_folder", str(run),
                  "--zephon.cache_bytes", "-1")  # fmt: skip
    assert_refused(
        job,
        "Zephon refused to start: ValueError: zephon.cache_bytes = -1: it must be bytes >= 0 "
        "(0: no node cache). Set --zephon.cache_bytes 0 or more.",
    )
    assert_unchanged(before, tree(run))


def test_the_dp_degree_is_torchtitans_on_every_small_layout(parse):
    """Issue 29 (c2): ``JobView.dp_degree`` is the one place Zephon derives the DP degree
    (the preflight's batch check, the expert check, torchft's inner degree). Over every
    small layout it equals what TorchTitan's ParallelDims builds, and is None exactly
    when ParallelDims refuses the degrees."""
    import dataclasses
    import itertools

    from torchtitan.distributed.parallel_dims import ParallelDims

    base = parse()
    compared = 0
    for rep, shard, cp, tp, pp in itertools.product(
        (1, 2, 3), (-1, 1, 2, 3, 4), (1, 2), (1, 2, 3), (1, 2)
    ):
        view = dataclasses.replace(base, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp)
        for world in range(1, 37):
            try:
                dims = ParallelDims(dp_shard=shard, dp_replicate=rep, cp=cp, tp=tp, pp=pp,
                                    ep=1, world_size=world)  # fmt: skip
                titan = dims.dp_replicate * dims.dp_shard
            except (AssertionError, ValueError):
                titan = None
            assert view.dp_degree(world) == titan, (rep, shard, cp, tp, pp, world)
            compared += titan is not None
    assert compared > 100


def test_reproducible_accepts_fsdp_on_any_number_of_ranks(parse):
    from torchtitan_zephon.titan.start.checks import check_job_config

    for world in (1, 2, 3, 4):
        check_job_config(parse("--zephon.reproducible"), world_size=world)
    hsdp = parse("--zephon.reproducible", "--parallelism.data_parallel_replicate_degree", "2")
    check_job_config(hsdp, world_size=4)  # HSDP: 2 replicas of 2 shards


@pytest.mark.parametrize(
    "overrides, world, text",
    [
        (("--parallelism.data_parallel_replicate_degree", "2"), 2,
         "zephon.reproducible covers HSDP with a shard group of 2 ranks or more, not "
         "parallelism.data_parallel_replicate_degree = 2 over shards of one rank: set "
         "--parallelism.data_parallel_shard_degree -1 (FSDP over every rank), or turn "
         "zephon.reproducible off"),
        (("--parallelism.context_parallel_degree", "2"), 2,
         "zephon.reproducible covers data parallelism (FSDP, HSDP) only, not "
         "parallelism.context_parallel_degree = 2: set --parallelism.context_parallel_degree "
         "1, or turn zephon.reproducible off"),
        (("--parallelism.tensor_parallel_degree", "2"), 2, "not parallelism.tensor_parallel_degree = 2"),
        (("--parallelism.pipeline_parallel_degree", "2"), 2, "not parallelism.pipeline_parallel_degree = 2"),
        (("--training.mixed_precision_param", "bfloat16"), 2,
         "zephon.reproducible is built and tested for float32 compute, not "
         "training.mixed_precision_param = bfloat16 yet"),
        (("--debug.no-deterministic",), 1,
         "zephon.reproducible needs debug.deterministic = true: a kernel that adds in whatever "
         "order its threads finish (a GPU's atomics) computes another gradient on every run. "
         "Set --debug.deterministic"),
    ],
)  # fmt: skip
def test_reproducible_refuses_what_it_does_not_cover_in_one_line(parse, overrides, world, text):
    msg = _refused(parse("--zephon.reproducible", *overrides), world)
    assert text in msg and "\n" not in msg, msg


def test_reproducible_refuses_ep_torchft_groups_of_many_ranks_and_other_optimizers(
    parse, parse_moe
):
    import dataclasses

    from torchtitan_zephon.titan.start.checks import check_job_config

    check_job_config(parse_moe("--zephon.reproducible"), world_size=2)  # EP 1
    msg = _refused(
        parse_moe("--zephon.reproducible", "--parallelism.expert_parallel_degree", "2"), 2
    )
    assert msg.startswith(
        "zephon.reproducible covers MoE models at expert_parallel_degree 1 only, not "
        "parallelism.expert_parallel_degree = 2"
    ), msg
    ft = dataclasses.replace(parse("--zephon.reproducible").fault_tolerance, enable=True)
    job = dataclasses.replace(parse("--zephon.reproducible"), fault_tolerance=ft)
    from torchtitan_zephon.titan.reproducible.coverage import check_reproducible

    check_reproducible(job, 1)  # groups of one rank each
    with pytest.raises(
        ValueError, match="covers torchft replica groups of one rank each, not groups of 2 ranks"
    ):
        check_reproducible(job, 2)
    muon = dataclasses.replace(parse("--zephon.reproducible"), optimizers=("DistMuon",))
    with pytest.raises(ValueError, match="computes Adam and AdamW updates exactly, not DistMuon"):
        check_reproducible(muon, 1)
    ams = dataclasses.replace(
        parse("--zephon.reproducible"), optimizer_flags=frozenset({"amsgrad"})
    )
    with pytest.raises(ValueError, match="without amsgrad"):
        check_reproducible(ams, 1)
    assert parse().optimizers == ("AdamW",) and not parse().optimizer_flags
    check_reproducible(dataclasses.replace(muon, zephon=parse().zephon), 1)  # off: nothing checked
