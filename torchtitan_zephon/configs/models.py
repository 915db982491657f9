"""Model flavors Zephon adds to TorchTitan's, and the model specs of every family
Zephon's registry trains: llama3 "small" (the CPU default job) and "tiny"
(end-to-end tests); deepseek_v3 "tiny" (a DeepSeek-V3-style MoE that trains on
2 CPU ranks in seconds: MLA with a low-rank query, a dense first layer, routed
and shared experts, a softmax top-k router with auxiliary-loss-free load
balancing); qwen3 as TorchTitan ships it.

Invariant: a flavor here is built exactly as TorchTitan 0.3 builds its own
"debugmodel" of that family (same layer builder, initialisers, RoPE; only the
sizes differ), and its model spec keeps TorchTitan's callables (parallelize,
pipelining, the MoE load-balancing hook, state-dict adapter); ``llama3_model``,
``deepseek_v3_model`` and ``qwen3_model`` also return every flavor of
TorchTitan's family. TorchTitan exposes the builders and the initialisers only
as module-private names of ``torchtitan.models.<family>``: this module is the
one that imports them.

What determinism means for the MoE models (measured on deepseek_v3 "tiny"):
the data each step trains on (ids, order, tokens) is exact at any DP, TP and EP
degree, as for every model; the initial weights and buffers are bitwise the
same (``titan.weights.init``); the losses agree to reduction order, within the llama3
bound (relative 1e-5). Routing is a discrete function of float scores: a
token's top-k can flip between topologies when two experts' scores (plus
``expert_bias_E``) differ by less than the rounding that another reduction
order produces. The auxiliary-loss-free balancing adds to that: its token counts
are integers summed over DP (exact in float32 below 2**24 per expert and step,
so their sum does not depend on the order), but the bias moves by
``coeff * sign(mean - count)`` per step, so one flipped token can move an
expert's count across the mean and change its bias by ``coeff``; that bias then
steers later routing. Measured over 8 steps: the EP 2 runs' checkpointed
``expert_bias_E`` differs from the 1-rank run's by one such sign event (one
expert, one step), and the losses stay within 1e-6 relative. Flips are not
prevented (that would need a routing tie-break independent of rounding); a
longer run can drift further, the way any float-reduction difference can.
A resume loses no balancing state: ``expert_bias_E`` is a persistent buffer
(in the checkpoint) and ``tokens_per_expert_E`` (not saved) is zeroed at every
optimizer step, so it is zero at every checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT as _DSV3_EMBEDDING_INIT
from torchtitan.models.deepseek_v3 import _NORM_INIT as _DSV3_NORM_INIT
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_configs
from torchtitan.models.deepseek_v3 import _build_dsv3_layers as _build_deepseek_v3_layers
from torchtitan.models.deepseek_v3 import _output_linear_init as _dsv3_output_linear_init
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_registry
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    llama3_configs,
    model_registry,
)
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.models.qwen3 import model_registry as qwen3_registry
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.protocols.model_spec import ModelSpec


def _small_llama3(
    *, dim: int, n_layers: int, n_heads: int, vocab_size: int = 2048
) -> Callable[..., Llama3Model.Config]:
    """A small Llama 3 built as TorchTitan builds its "debugmodel" flavor."""

    def build(attn_backend: str, tp_gemm_backend: str = "default") -> Llama3Model.Config:
        return Llama3Model.Config(
            dim=dim,
            vocab_size=vocab_size,
            tok_embeddings=Embedding.Config(
                num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            lm_head=Linear.Config(
                in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)
            ),
            layers=_build_llama3_layers(
                fuse_qkv=True,
                n_layers=n_layers,
                dim=dim,
                n_heads=n_heads,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
                rope=ComplexRoPE.Config(
                    dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"
                ),
                attn_backend=attn_backend,
                tp_gemm_backend=tp_gemm_backend,
            ),
        )

    return build


ZEPHON_FLAVORS: dict[str, Callable[..., Llama3Model.Config]] = {
    # 1.6M parameters: the default CPU job (train_configs/debug_model.toml).
    "small": _small_llama3(dim=128, n_layers=4, n_heads=8),
    # 0.4M parameters: end-to-end tests.
    "tiny": _small_llama3(dim=64, n_layers=2, n_heads=4),
}


def llama3_model(flavor: str, attn_backend: str = "flex") -> ModelSpec:
    """The llama3 model spec of ``flavor``: Zephon's "small" / "tiny", or any of
    TorchTitan's llama3 flavors."""
    if flavor not in ZEPHON_FLAVORS:
        if flavor not in llama3_configs:
            raise ValueError(
                f"llama3 has no flavor {flavor!r}; flavors: "
                f"{sorted({*ZEPHON_FLAVORS, *llama3_configs})}"
            )
        return model_registry(flavor, attn_backend=attn_backend)
    base = model_registry("debugmodel", attn_backend=attn_backend)
    model = ZEPHON_FLAVORS[flavor](attn_backend=attn_backend)
    return dataclasses.replace(base, flavor=flavor, model=model)


def _tiny_deepseek_v3(
    attn_backend: str, moe_comm_backend: str = "standard"
) -> DeepSeekV3Model.Config:
    """DeepSeek-V3 in miniature, built as TorchTitan builds its "debugmodel": 3 layers
    (1 dense, 2 MoE), MLA with q_lora_rank > 0 (so wq_a / q_norm / wq_b and kv_norm
    exist), 4 routed experts (EP 1, 2 and 4 divide them), top-2 softmax routing, 1
    shared expert; 0.4M parameters."""
    dim, vocab_size, rope_dim = 64, 2048, 16
    return DeepSeekV3Model.Config(
        vocab_size=vocab_size,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_DSV3_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_DSV3_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab_size, param_init=_dsv3_output_linear_init(dim)
        ),
        layers=_build_deepseek_v3_layers(
            n_layers=3,
            n_dense_layers=1,
            dim=dim,
            n_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=rope_dim,
            v_head_dim=16,
            mscale=0.70,
            dense_hidden_dim=128,
            moe_hidden_dim=32,
            num_experts=4,
            num_shared_experts=1,
            router_top_k=2,
            router_score_func="softmax",
            attn_backend=attn_backend,
            moe_comm_backend=moe_comm_backend,
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(
                dim=rope_dim,
                max_seq_len=4096,
                theta=10000.0,
                scaling="yarn",
                rope_factor=40.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_seq_len=4096,
            ),
        ),
    )


DEEPSEEK_V3_FLAVORS: dict[str, Callable[..., DeepSeekV3Model.Config]] = {
    # 0.4M parameters (of which 25k per MoE layer in experts): CPU tests and the MoE TOML.
    "tiny": _tiny_deepseek_v3,
}


def deepseek_v3_model(flavor: str, attn_backend: str = "flex") -> ModelSpec:
    """The deepseek_v3 model spec of ``flavor``: Zephon's "tiny", or any of
    TorchTitan's deepseek_v3 flavors ("debugmodel", "16B", ...)."""
    if flavor not in DEEPSEEK_V3_FLAVORS:
        if flavor not in deepseekv3_configs:
            raise ValueError(
                f"deepseek_v3 has no flavor {flavor!r}; flavors: "
                f"{sorted({*DEEPSEEK_V3_FLAVORS, *deepseekv3_configs})}"
            )
        return deepseek_v3_registry(flavor, attn_backend=attn_backend)
    base = deepseek_v3_registry("debugmodel", attn_backend=attn_backend)
    model = DEEPSEEK_V3_FLAVORS[flavor](attn_backend=attn_backend)
    return dataclasses.replace(base, flavor=flavor, model=model)


def qwen3_model(flavor: str, attn_backend: str = "flex") -> ModelSpec:
    """The qwen3 model spec of one of TorchTitan's qwen3 flavors ("debugmodel", "0.6B", ...)."""
    if flavor not in qwen3_configs:
        raise ValueError(f"qwen3 has no flavor {flavor!r}; flavors: {sorted(qwen3_configs)}")
    return qwen3_registry(flavor, attn_backend=attn_backend)
