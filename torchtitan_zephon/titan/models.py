"""Model flavors Zephon adds to TorchTitan's: llama3 "small" (the CPU default job) and
"tiny" (end-to-end tests).

Invariant: a flavor here is built exactly as TorchTitan 0.3 builds its llama3
"debugmodel" (same layer builder, initialisers, RoPE; only the sizes differ), and
its model spec keeps TorchTitan's callables (parallelize, pipelining, state-dict
adapter); ``llama3_model`` also returns every flavor of TorchTitan's llama3.
TorchTitan exposes the builder and the initialisers only as module-private names
of ``torchtitan.models.llama3``: this module is the one that imports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    llama3_configs,
    model_registry,
)
from torchtitan.models.llama3.model import Llama3Model
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
