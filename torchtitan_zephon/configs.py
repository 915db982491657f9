"""Zephon's config registry: ``--module torchtitan_zephon.configs --config FN``.

Each function returns a whole job, every value in sight (as TorchTitan 0.3's
``models/*/config_registry.py`` do), on Zephon's trainer: Zephon's dataloader and
validator, the ``zephon`` section, topology-free initial weights. The command
line overrides any value (``--training.steps 8``, ``--zephon.store PATH``, ...).

* ``llama3_debug``: the CPU default job (``train_configs/debug_model.toml``):
  Llama 3 flavor "small" on the builtin store.
* ``llama3_tiny``: the end-to-end test job (``tests/titan/tiny.toml``): flavor "tiny".

Invariant: the model flavors are TorchTitan's llama3 (``llama3_model`` accepts
every flavor of ``llama3_configs``) plus "small" and "tiny", built with the
same layer builder, initialisers and RoPE as TorchTitan's "debugmodel"; the
model spec's callables (parallelize, pipelining, state-dict adapter) are
TorchTitan's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common import compute_ffn_hidden_dim
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

from torchtitan_zephon.job.settings import builtin_tokenizer
from torchtitan_zephon.titan.config import Zephon
from torchtitan_zephon.titan.dataloader import ZephonDataLoader
from torchtitan_zephon.titan.trainer import ZephonTrainer
from torchtitan_zephon.titan.validate import ZephonValidator


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


def _loss(model_spec: ModelSpec) -> ChunkedLossWrapper.Config:
    return ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size)
    )


def llama3_debug() -> ZephonTrainer.Config:
    """The CPU default job: Llama 3 "small" on the builtin store (Python's own docs and
    standard-library sources), 2 CPU ranks via ./run_train.sh, or GPUs unchanged."""
    model_spec = llama3_model("small")
    return ZephonTrainer.Config(
        dump_folder="./outputs/debug_model",
        # the tokenizer the builtin store is tokenized with (shipped in the package)
        hf_assets_path=str(builtin_tokenizer()[0]),
        model_spec=model_spec,
        loss=_loss(model_spec),
        optimizer=default_adamw(lr=3e-3, eps=1e-8),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=5, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1
        ),
        training=TrainingConfig(
            local_batch_size=4,
            global_batch_size=8,  # fixed for the run: any DP degree dividing it resumes exactly
            seq_len=128,
            max_norm=1.0,
            steps=40,
            dtype="float32",
            mixed_precision_param="float32",
        ),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        checkpoint=CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=10,
            last_save_model_only=False,  # keep the last checkpoint resumable
            keep_latest_k=0,
        ),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        metrics=MetricsProcessor.Config(log_freq=1, enable_tensorboard=True, save_tb_folder="tb"),
        dataloader=ZephonDataLoader.Config(),
        validator=ZephonValidator.Config(enable=True, freq=10, microbatch_size=4, steps=1),
        debug=DebugConfig(seed=42, deterministic=True),
        zephon=Zephon(store="", seed=0, audit="tokens", heldout_samples=64),
    )


def llama3_tiny() -> ZephonTrainer.Config:
    """The end-to-end test job: Llama 3 "tiny" on the builtin store, fp32, deterministic."""
    config = llama3_debug()
    config.model_spec = llama3_model("tiny")
    config.loss = _loss(config.model_spec)
    config.dump_folder = "./outputs/tiny"
    config.optimizer = default_adamw(lr=1e-2)
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=2)
    config.training = TrainingConfig(
        local_batch_size=2,
        global_batch_size=8,
        seq_len=64,
        steps=8,
        dtype="float32",
        mixed_precision_param="float32",
    )
    config.checkpoint = CheckpointManager.Config(
        enable=True, interval=4, last_save_model_only=False, keep_latest_k=0
    )
    config.comm = CommConfig(init_timeout_seconds=120, train_timeout_seconds=120)
    config.validator = ZephonValidator.Config(enable=True, freq=4, microbatch_size=2, steps=-1)
    config.debug = DebugConfig(seed=7, deterministic=True)
    config.zephon = Zephon(audit="tokens", heldout_samples=16)
    return config
