"""Initial weights: the same values under any topology, TorchTitan's distributions.

The sharded checks run real gloo process groups (4 CPU processes, one spawn)
through TorchTitan's own parallelize / pipelining functions, gather every
parameter with ``full_tensor()`` and compare it bitwise with an unsharded model
built in the same process.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.titan.launch import TINY, free_port
from torchtitan_zephon.titan import init as zinit
from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.init import canonical_name, draw_flat, parameter_seed

platform.apply()

from torchtitan_zephon.titan.spec import (  # noqa: E402
    ZephonTransformer,
    ZephonTransformerArgs,
    zephon_llama3_args,
)

# An odd flavor: vocab 2051 and dim 40 split unevenly over 4 FSDP ranks (513, 513, 513, 512).
ODD = ZephonTransformerArgs(dim=40, n_layers=2, n_heads=4, vocab_size=2051, rope_theta=500000)


def args_for(flavor: str | ZephonTransformerArgs, seed: int = 7, init: str = "zephon"):
    a = copy.deepcopy(zephon_llama3_args[flavor] if isinstance(flavor, str) else flavor)
    a.init, a.init_seed, a.max_seq_len = init, seed, 64
    return a


def build(args: ZephonTransformerArgs, wrap=None) -> ZephonTransformer:
    with torch.device("meta"):
        model = ZephonTransformer(args)
    if wrap is not None:
        model = wrap(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p.detach() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ one process


def test_canonical_name_drops_wrapper_parts():
    assert (
        canonical_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight")
        == "layers.0.attention.wq.weight"
    )
    assert canonical_name("_fsdp_wrapped_module.output.weight") == "output.weight"


@settings(max_examples=150, deadline=None)
@given(
    chunk=st.integers(1, 40),
    numel=st.integers(0, 200),
    span=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    fill=st.sampled_from(["normal_", "uniform_", "trunc_normal_"]),
)
def test_a_range_of_the_flat_draw_is_the_same_range_of_the_full_draw(chunk, numel, span, fill):
    """What a rank draws for its rows equals those rows of the full draw, for any
    chunk size and any range (chunk boundaries inside rows included)."""
    lo, hi = sorted(int(f * numel) for f in span)
    fn = getattr(torch.nn.init, fill)

    def draw(a: int, b: int) -> torch.Tensor:
        return draw_flat(
            numel, a, b, lambda t, g: fn(t, generator=g),
            lambda c: torch.Generator().manual_seed(parameter_seed(1, "w", 0, c)),
            dtype=torch.float32, device=torch.device("cpu"),
        )  # fmt: skip

    saved, zinit.CHUNK_ELEMENTS = zinit.CHUNK_ELEMENTS, chunk
    try:
        full = draw(0, numel)
        part = draw(lo, hi)
    finally:
        zinit.CHUNK_ELEMENTS = saved
    assert full.shape == (numel,)
    assert torch.equal(part, full[lo:hi])


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (params(build(args_for("tiny", seed=s))) for s in (7, 7, 8))
    assert all(torch.equal(a[n], b[n]) for n in a)
    random = [n for n in a if not n.endswith("norm.weight")]
    assert all(not torch.equal(a[n], c[n]) for n in random)
    assert parameter_seed(7, "output.weight", 0) != parameter_seed(7, "output.weight", 1)


def test_wrappers_do_not_change_the_initial_weights():
    """torch.compile (``_orig_mod``) and activation checkpointing
    (``_checkpoint_wrapped_module``) insert names; the values stay the same."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrap(model):
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(checkpoint_wrapper(block))
        return model

    plain = build(args_for("tiny"))
    wrapped = build(args_for("tiny"), wrap)
    names = [n for n, _ in wrapped.named_parameters()]
    assert any("_orig_mod" in n and "_checkpoint_wrapped_module" in n for n in names), names
    a, b = params(plain), params(wrapped)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_bf16_parameters_get_the_fp32_draws_rounded():
    """TorchTitan's trunc_normal_ initialises ``param.float()`` and copies it back:
    the copy is followed, and no value comes from torch's global generator."""
    fp32 = params(build(args_for("tiny")))
    bf16 = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        with torch.device("meta"), _default_dtype(torch.bfloat16):
            model = ZephonTransformer(args_for("tiny"))
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        bf16.append(params(model))
    for name, p in bf16[0].items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, bf16[1][name]), name
        if name != "tok_embeddings.weight":  # nn.init.normal_ draws in bf16 directly
            assert torch.equal(p, fp32[name].to(torch.bfloat16)), name


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def expected_std(name: str, args: ZephonTransformerArgs) -> tuple[float, float]:
    """(std of TorchTitan's distribution for this parameter, its truncation bound)."""
    if name == "tok_embeddings.weight":
        return 1.0, math.inf
    if name == "output.weight":
        s = args.dim**-0.5
        return s * 0.9866, 3 * s  # N(0, s) truncated at 3 s has std 0.9866 s
    layer = int(name.split(".")[1])
    depth_std = 0.02 / (2 * (layer + 1)) ** 0.5
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight")):
        return 0.02, 2.0
    return depth_std, 2.0


def test_distributions_are_torchtitans():
    """Per parameter: ours and TorchTitan's sample std agree with the distribution's
    within 5 standard errors; norms are ones; values stay inside the truncation."""
    args = args_for("small")
    ours = params(build(args))
    torch.manual_seed(0)
    titan = params(build(args_for("small", init="torchtitan")))
    assert sorted(ours) == sorted(titan)
    for name, p in ours.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)) and torch.equal(titan[name], p), name
            continue
        std, bound = expected_std(name, args)
        tol = 5 * std / math.sqrt(2 * p.numel())
        for label, value in (("zephon", p), ("torchtitan", titan[name])):
            assert abs(float(value.std()) - std) <= tol, (name, label, float(value.std()), std)
            assert abs(float(value.mean())) <= 5 * std / math.sqrt(p.numel()), (name, label)
            assert float(value.abs().max()) <= bound, (name, label)


def test_torchtitan_init_opt_out_is_torchtitans_own():
    from torchtitan.models.llama3.model.model import Transformer

    args = args_for("tiny", init="torchtitan")
    torch.manual_seed(3)
    ours = params(build(args))
    with torch.device("meta"):
        stock = Transformer(args)
    stock.to_empty(device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        stock.init_weights()
    theirs = params(stock)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_parameter_initialised_another_way_is_refused():
    from torchtitan_zephon.titan.init import init_weights_topology_free

    model = torch.nn.Linear(4, 3)

    def init_weights():
        torch.nn.init.normal_(model.weight)
        model.bias.copy_(torch.randn(3))

    with pytest.raises(
        RuntimeError, match=r"copy_ from another tensor: bias.*--zephon.init torchtitan"
    ):
        init_weights_topology_free(model, 0, init_weights)
    with pytest.raises(RuntimeError, match=r"never initialised through torch.nn.init: bias"):
        init_weights_topology_free(model, 0, lambda: torch.nn.init.normal_(model.weight))


def test_zephon_jobs_default_to_a_fixed_seed_and_zephon_init():
    from torchtitan.config import ConfigManager

    from torchtitan_zephon.titan.config import CONFIG_MODULE

    cfg = ConfigManager().parse_args(["--job.custom_config_module", CONFIG_MODULE])
    assert cfg.debug.seed == 0 and cfg.zephon.init == "zephon"
    args = copy.deepcopy(zephon_llama3_args["tiny"])
    cfg.debug.seed = 11
    cfg.zephon.init = "torchtitan"
    args.update_from_config(cfg)
    assert (args.init_seed, args.init) == (11, "torchtitan")


# ------------------------------------------------------------------ 4 processes

# (name, flavor, init, dp_replicate, dp_shard, tp, pp, extra config overrides)
LAYOUTS = [
    ("fsdp4_uneven", ODD, "zephon", 1, 4, 1, 1, []),
    ("fsdp2_x_tp2_ac", "tiny", "zephon", 1, 2, 2, 1, ["--activation_checkpoint.mode", "full"]),
    (
        "hsdp2x2",
        "tiny",
        "zephon",
        2,
        2,
        1,
        1,
        ["--parallelism.data_parallel_replicate_degree", "2"],
    ),
    ("pp2_x_fsdp2", "tiny", "zephon", 1, 2, 1, 2, ["--parallelism.pipeline_parallel_degree", "2"]),
    ("fsdp4_torchtitan", "tiny", "torchtitan", 1, 4, 1, 1, []),
]


def _sharded_init_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), ZEPHON_DEVICE="cpu",
    )  # fmt: skip
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from torchtitan_zephon.titan.config import CONFIG_MODULE
    from torchtitan_zephon.titan.spec import zephon_train_spec

    dist.init_process_group("gloo", rank=rank, world_size=world)
    # Small chunks: shards start and end inside chunks and inside rows.
    zinit.CHUNK_ELEMENTS = 1000
    spec = zephon_train_spec()
    differing = {}
    for name, flavor, init, dp_rep, dp_shard, tp, pp, extra in LAYOUTS:
        job_config = ConfigManager().parse_args(
            ["--job.config_file", str(TINY), "--job.custom_config_module", CONFIG_MODULE,
             "--parallelism.tensor_parallel_degree", str(tp), *extra]
        )  # fmt: skip
        dims = ParallelDims(
            dp_replicate=dp_rep, dp_shard=dp_shard, cp=1, tp=tp, pp=pp, ep=1, etp=1,
            world_size=world,
        )  # fmt: skip
        args = args_for(flavor, init=init)
        with torch.device("meta"):
            model = ZephonTransformer(args)
        if pp > 1:
            loss_fn = spec.build_loss_fn(job_config, parallel_dims=dims)
            _, parts, _, _ = spec.pipelining_fn(
                model, dims, job_config, torch.device("cpu"), args, spec.parallelize_fn, loss_fn
            )
        else:
            parts = [spec.parallelize_fn(model, dims, job_config)]
        got = {}
        for part in parts:
            part.to_empty(device="cpu")
            torch.manual_seed(7)
            with torch.no_grad():
                part.init_weights()
            for fqn, p in part.named_parameters():
                got[canonical_name(fqn)] = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.manual_seed(7)
        reference = params(build(args))
        assert set(got) <= set(reference), sorted(set(got) - set(reference))
        differing[name] = sorted(n for n in got if not torch.equal(got[n], reference[n]))
    dist.destroy_process_group()
    torch.save(differing, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow  # one spawn of 4 processes: ~30 s idle, 75-150 s on a loaded 2-core machine
def test_sharded_init_is_bitwise_the_unsharded_one(tmp_path: Path):
    """FSDP (uneven shards), FSDP x TP with activation checkpointing, HSDP and
    PP x FSDP give every parameter exactly the value it has on one rank; TorchTitan's
    own init under FSDP does not (the check can fail)."""
    import torch.multiprocessing as mp

    mp.spawn(_sharded_init_worker, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        differing = torch.load(tmp_path / f"rank{rank}.pt")
        for name, *_ in LAYOUTS[:-1]:
            assert differing[name] == [], (rank, name, differing[name])
        assert len(differing["fsdp4_torchtitan"]) > 10, differing["fsdp4_torchtitan"]
