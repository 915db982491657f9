"""Initial weights on TorchTitan 0.3: the same values under any topology, for every model
Zephon's registry trains (llama3, the DeepSeek-V3-style MoE, qwen3), parameters and buffers.

The sharded checks run real gloo process groups (2 CPU processes per layout, one spawn
each: TorchTitan caches meshes per process) through TorchTitan's own ``parallelize_fn``
of each model, gather every parameter and buffer with ``full_tensor()`` and compare it
bitwise with an unsharded model built in the same process. The large configs (8B, 16B,
0.6B) run the same init on the meta device: every parameter reaches an initialiser and
every buffer is set, with nothing allocated.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")

from tests.titan.launch import free_port  # noqa: E402
from torchtitan_zephon.titan import platform  # noqa: E402
from torchtitan_zephon.titan.weights import init_draw as zinit  # noqa: E402

platform.apply()

from torchtitan_zephon.configs import config_registry as configs  # noqa: E402
from torchtitan_zephon.titan.weights.init import (  # noqa: E402
    init_weights_topology_free,
    topology_free_parallelize,
)
from torchtitan_zephon.titan.weights.init_coverage import NotTopologyFree  # noqa: E402
from torchtitan_zephon.titan.weights.init_draw import (  # noqa: E402
    canonical_name,
    draw_flat,
    parameter_seed,
)

SEED = 7
DEBUG_JOBS = ("llama3_tiny", "deepseek_v3_debug", "qwen3_debug")


def job(fn: str, dp_shard: int = -1, tp: int = 1, ep: int = 1):  # noqa: ANN201
    """The registry job ``fn`` with these degrees, CPU defaults applied, and its model
    config updated from the job as TorchTitan's trainer does (RoPE length, sharding)."""
    config = getattr(configs, fn)()
    p = config.parallelism
    p.data_parallel_shard_degree, p.tensor_parallel_degree, p.expert_parallel_degree = (
        dp_shard, tp, ep,
    )  # fmt: skip
    platform.cpu_config_defaults(config)
    config.model_spec.model.update_from_config(config=config)
    return config


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by canonical name, full (gathered) values."""
    out = {}
    for fqn, t in [*model.named_parameters(), *model.named_buffers()]:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[canonical_name(fqn)] = full.detach().clone()
    return out


def build(
    fn: str, seed: int = SEED, wrap: Callable | None = None, *, zephon: bool = True
) -> torch.nn.Module:
    """One unsharded model of job ``fn`` on the CPU, initialised as the trainer does."""
    spec = job(fn).model_spec
    with torch.device("meta"):
        model = spec.model.build()
    if wrap is not None:
        model = wrap(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        if zephon:
            init_weights_topology_free(
                model, seed, lambda: model.init_weights(buffer_device=None), torch.device("cpu")
            )
        else:
            model.init_weights(buffer_device=None)
    return model


# ------------------------------------------------------------------ one process


def test_canonical_name_drops_wrapper_parts() -> None:
    assert (
        canonical_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wo.weight")
        == "layers.0.attention.wo.weight"
    )
    assert canonical_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"


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
    saved, zinit.CHUNK_ELEMENTS = zinit.CHUNK_ELEMENTS, chunk
    try:
        init = getattr(torch.nn.init, fill)

        def gen(c: int) -> torch.Generator:
            return torch.Generator().manual_seed(parameter_seed(1, "w", 0, c))

        def draw(t: torch.Tensor, g: torch.Generator) -> None:
            init(t, generator=g)

        kw = dict(dtype=torch.float32, device=torch.device("cpu"))
        full = draw_flat(numel, 0, numel, draw, gen, **kw)
        part = draw_flat(numel, lo, hi, draw, gen, **kw)
    finally:
        zinit.CHUNK_ELEMENTS = saved
    assert full.shape == (numel,)
    assert torch.equal(part, full[lo:hi])


@pytest.mark.parametrize("fn", DEBUG_JOBS)
def test_same_seed_same_state_other_seed_other_weights(fn: str) -> None:
    """Parameters and buffers (RoPE caches, the MoE's expert_bias_E and
    tokens_per_expert_E) are a function of the seed, not of torch's global RNG."""
    torch.manual_seed(1)
    a = state(build(fn, SEED))
    torch.manual_seed(2)
    b = state(build(fn, SEED))
    c = state(build(fn, SEED + 1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    drawn = {n for n in a if not torch.equal(a[n], c[n])}
    fixed = {n for n in a if n.endswith(("norm.weight", "rope.cache", "_E")) or "rope" in n}
    assert drawn == set(a) - fixed, sorted(drawn ^ (set(a) - fixed))


def test_moe_state_names_cover_router_experts_and_balancing_buffers() -> None:
    names = set(state(build("deepseek_v3_debug")))
    for needed in (
        "layers.1.moe.router.gate.weight",
        "layers.1.moe.routed_experts.inner_experts.w1_EFD",
        "layers.1.moe.routed_experts.inner_experts.w2_EDF",
        "layers.1.moe.routed_experts.inner_experts.w3_EFD",
        "layers.1.moe.shared_experts.w2.weight",
        "layers.1.moe.expert_bias_E",
        "layers.1.moe.tokens_per_expert_E",
        "layers.1.attention.q_norm.weight",
        "layers.1.attention.kv_norm.weight",
        "layers.0.feed_forward.w1.weight",
    ):
        assert needed in names, needed


def test_wrappers_do_not_change_the_initial_weights() -> None:
    """torch.compile (``_orig_mod``) and activation checkpointing
    (``_checkpoint_wrapped_module``) insert names; the values stay the same."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(checkpoint_wrapper(block))
        return model

    plain, wrapped = build("deepseek_v3_debug"), build("deepseek_v3_debug", wrap=wrap)
    names = [n for n, _ in wrapped.named_parameters()]
    assert any("_orig_mod" in n and "_checkpoint_wrapped_module" in n for n in names), names
    a, b = state(plain), state(wrapped)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(3, 4))
        self.register_buffer("counts", torch.empty(4))


def test_parameter_initialised_another_way_is_refused() -> None:
    model = torch.nn.Linear(4, 3)

    def init_weights() -> None:
        torch.nn.init.normal_(model.weight)
        model.bias.copy_(torch.randn(3))

    with pytest.raises(
        NotTopologyFree, match=r"copy_ from another tensor: bias.*--zephon.init torchtitan"
    ):
        init_weights_topology_free(model, 0, init_weights)
    with pytest.raises(NotTopologyFree, match=r"never initialised through torch.nn.init: bias"):
        init_weights_topology_free(model, 0, lambda: torch.nn.init.normal_(model.weight))


def test_a_param_init_that_leaves_values_unset_is_refused() -> None:
    """A TorchTitan 0.3 ``param_init`` entry that writes only part of the tensor would hand
    over uninitialised memory (different on every rank and run)."""
    model = torch.nn.Linear(4, 3, bias=False)
    model._param_init = {"weight": lambda p: torch.nn.init.zeros_(p[:1])}

    def init_weights() -> None:
        model._param_init["weight"](model.weight)

    with pytest.raises(NotTopologyFree, match=r"left \(partly\) unset by their param_init: weight"):
        init_weights_topology_free(model, 0, init_weights)


def test_buffers_left_unset_or_drawn_at_random_are_refused() -> None:
    model = _WithBuffer()
    with pytest.raises(
        NotTopologyFree, match=r"buffers init_weights never set \(they would keep to_empty"
    ) as e:
        init_weights_topology_free(model, 0, lambda: torch.nn.init.normal_(model.weight))
    assert str(e.value).count("counts") == 1
    with pytest.raises(NotTopologyFree, match=r"buffers drawn at random: counts"):
        init_weights_topology_free(
            model, 0, lambda: (torch.nn.init.normal_(model.weight), model.counts.uniform_())
        )
    with pytest.raises(
        NotTopologyFree,
        match=r"random draws outside any parameter's initialiser .*torch.rand \(1 call\)",
    ):
        init_weights_topology_free(
            model,
            0,
            lambda: (torch.nn.init.normal_(model.weight), setattr(model, "counts", torch.rand(4))),
        )
    # re-made deterministically (as _init_self_buffers does) or written in place: accepted
    init_weights_topology_free(
        model, 0, lambda: (torch.nn.init.normal_(model.weight), model.counts.zero_())
    )
    init_weights_topology_free(
        model,
        0,
        lambda: (torch.nn.init.normal_(model.weight), setattr(model, "counts", torch.zeros(4))),
    )


@pytest.mark.parametrize("fn", ["llama3_8b", "deepseek_v3_16b", "qwen3_0_6b"])
def test_large_configs_initialise_every_parameter_and_buffer_on_meta(fn: str) -> None:
    """Zephon's init runs the model's own init_states on the meta device: every parameter
    reaches an initialiser (the check raises otherwise), every buffer is set, and
    nothing is allocated."""
    config = job(fn)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    meta = torch.device("meta")
    interceptor = init_weights_topology_free(
        model, 0, lambda: model.init_weights(buffer_device=meta), meta
    )
    names = {canonical_name(n) for n, _ in model.named_parameters()}
    assert set(interceptor.names) == names and names <= set(interceptor.calls)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert sum(p.numel() for p in model.parameters()) > 5 * 10**8
    if fn == "deepseek_v3_16b":
        assert "layers.26.moe.routed_experts.inner_experts.w2_EDF" in names
        assert "layers.26.moe.expert_bias_E" in {
            canonical_name(n) for n, _ in model.named_buffers()
        }


REGISTRY = sorted(
    name
    for name, value in vars(configs).items()
    if callable(value) and not name.startswith("_") and name.islower()
    and getattr(value, "__module__", "") == configs.__name__
)  # fmt: skip


def test_the_registry_lists_every_model_family() -> None:
    assert {"llama3_debug", "llama3_tiny", "llama3_8b", "deepseek_v3_debug", "deepseek_v3_16b",
            "qwen3_debug", "qwen3_0_6b"} <= set(REGISTRY)  # fmt: skip


def _shapes(spec) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
    with torch.device("meta"):
        model = spec.model.build()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fn", REGISTRY)
def test_a_toml_of_the_model_of_each_config_function_starts_from_that_model(fn: str) -> None:
    """configs.TOML_JOBS, the one table a TOML's [model] name / flavor select a job
    from, has every family and flavor the registry trains, and builds that model."""
    from torchtitan_zephon.configs.toml_table import MODEL_FAMILIES

    spec = getattr(configs, fn)().model_spec
    assert spec.name in MODEL_FAMILIES.values() and spec.name in configs.TOML_JOBS, fn
    base = configs.TOML_JOBS[spec.name](spec.flavor).model_spec
    assert (base.name, base.flavor) == (spec.name, spec.flavor), fn
    assert _shapes(base) == _shapes(spec), fn


@pytest.mark.parametrize("fn", REGISTRY)
def test_every_registry_function_builds(fn: str) -> None:
    """Every config function of ``torchtitan_zephon.configs`` returns a Zephon job whose
    model builds (on the meta device) under its own model config."""
    from torchtitan_zephon.titan.components.trainer import ZephonTrainer

    config = getattr(configs, fn)()
    assert isinstance(config, ZephonTrainer.Config)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    assert config.model_spec.model.vocab_size >= 2048
    assert sum(p.numel() for p in model.parameters()) > 0


# ------------------------------------------------------------------ 2 processes

# (job, data_parallel_shard, tensor_parallel, expert_parallel)
LAYOUTS = {
    "llama3_fsdp2": ("llama3_tiny", 2, 1, 1),
    "llama3_tp2": ("llama3_tiny", 1, 2, 1),
    "moe_fsdp2": ("deepseek_v3_debug", 2, 1, 1),
    "moe_fsdp2_ep2": ("deepseek_v3_debug", 2, 1, 2),
    "moe_tp2": ("deepseek_v3_debug", 1, 2, 1),
    "qwen3_fsdp2": ("qwen3_debug", 2, 1, 1),
    "qwen3_tp2": ("qwen3_debug", 1, 2, 1),
}


def _sharded_init_worker(
    rank: int, world: int, port: int, out: str, layout: str, zephon: bool
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), ZEPHON_DEVICE="cpu",
    )  # fmt: skip
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    dist.init_process_group("gloo", rank=rank, world_size=world)
    zinit.CHUNK_ELEMENTS = 1000  # shards start and end inside chunks and inside rows
    fn, dp_shard, tp, ep = LAYOUTS[layout]
    config = job(fn, dp_shard, tp, ep)
    dims = ParallelDims.from_config(config.parallelism, world)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    spec = config.model_spec
    with torch.device("meta"):
        model = spec.model.build()
    parallelize = (
        topology_free_parallelize(spec.parallelize_fn, SEED) if zephon else spec.parallelize_fn
    )
    model = parallelize(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint,
        dump_folder=tempfile.mkdtemp(),
    )  # fmt: skip
    sharded = [
        n
        for n, p in model.named_parameters()
        if hasattr(p, "to_local") and p.to_local().shape != p.shape
    ]
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    got = state(model)
    torch.manual_seed(SEED)
    reference = state(build(fn))
    dist.destroy_process_group()
    torch.save(
        {
            "names": (sorted(got), sorted(reference)),
            "sharded": sharded,
            "differing": sorted(n for n in got if not torch.equal(got[n], reference[n])),
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


# one spawn of 2 processes each: 20-40 s idle, 60-120 s on a loaded 2-core machine; the
# MoE's FSDP x EP layout is the one that runs by default
@pytest.mark.parametrize(
    "layout",
    [
        name if name == "moe_fsdp2_ep2" else pytest.param(name, marks=pytest.mark.slow)
        for name in LAYOUTS
    ],
)
def test_sharded_init_is_bitwise_the_unsharded_one(tmp_path: Path, layout: str) -> None:
    """FSDP 2, TP 2 and (MoE) FSDP 2 x EP 2 through each model's own parallelize_fn give
    every parameter and buffer exactly its 1-rank value."""
    import torch.multiprocessing as mp

    mp.spawn(
        _sharded_init_worker,
        args=(2, free_port(), str(tmp_path), layout, True),
        nprocs=2,
        join=True,
    )
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        got, reference = result["names"]
        assert got == reference
        assert len(result["sharded"]) > 5, result["sharded"]  # the layout really shards
        if "ep2" in layout:
            assert any("inner_experts" in n for n in result["sharded"])
        assert result["differing"] == [], (rank, result["differing"])


@pytest.mark.slow
def test_torchtitans_own_init_under_fsdp_differs(tmp_path: Path) -> None:
    """The check can fail: TorchTitan's init (global RNG on each rank's shard) under
    FSDP 2 does not give the 1-rank values."""
    import torch.multiprocessing as mp

    mp.spawn(
        _sharded_init_worker, args=(2, free_port(), str(tmp_path), "moe_fsdp2", False),
        nprocs=2, join=True,
    )  # fmt: skip
    differing = torch.load(tmp_path / "rank0.pt")["differing"]
    assert len(differing) > 10, differing
