"""Zephon's config registry: ``--module torchtitan_zephon.configs --config FN``.

Each function returns a whole job, every value in sight (as TorchTitan 0.3's
``models/*/config_registry.py`` do), on Zephon's trainer: Zephon's dataloader and
validator, the ``zephon`` section, topology-free initial weights. The command
line overrides any value (``--training.steps 8``, ``--zephon.store PATH``, ...).

* ``llama3_debug``: the CPU default job (``train_configs/debug_model.toml``):
  Llama 3 flavor "small" on the builtin store.
* ``llama3_tiny``: the end-to-end test job (``tests/titan/tiny.toml``): flavor "tiny".
* ``llama3_8b``: TorchTitan 0.3's Llama 3 8B on a Zephon store
  (``train_configs/llama3_8b.toml``'s job).
* ``deepseek_v3_debug``: the tiny DeepSeek-V3-style MoE (``configs.models`` flavor
  "tiny") on the builtin store, 2 CPU ranks in seconds
  (``train_configs/deepseek_v3_debug.toml``).
* ``deepseek_v3_16b``: TorchTitan 0.3's DeepSeek-V3 16B job on a Zephon store.
* ``qwen3_debug``: TorchTitan 0.3's Qwen3 "debugmodel" on the builtin store.
* ``qwen3_0_6b``: TorchTitan 0.3's Qwen3 0.6B job on a Zephon store.

The large jobs keep TorchTitan's model, optimizer and parallelism settings and
name a ``zephon.store`` made with the model's tokenizer (``hf_assets_path``);
``--zephon.store PATH`` points them at yours.

``TOML_JOBS`` is the one table of which job a TOML job config (``--job.config_file``,
the 0.2.2 spelling) starts from: its ``[model] name`` (through
``configs.toml_table.MODEL_FAMILIES``) picks the family, its ``flavor`` the model;
the job is TorchTitan's defaults (0.2.2's JobConfig defaults, as far as 0.3 kept
them) around that model, its loss and one catch-all AdamW parameter group, and the
TOML's keys are set on it as overrides. Every family and flavor a config function
here trains has its entry (tests/titan/test_init.py).

Invariant: every public lowercase callable of this module is a config function
(TorchTitan lists them when ``--config`` names none of them); the model flavors
are ``configs.models``'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torchtitan.components.optimizer as optim
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_zephon.configs import models
from torchtitan_zephon.job import settings
from torchtitan_zephon.titan.components.dataloader import ZephonDataLoader
from torchtitan_zephon.titan.components.trainer import ZephonTrainer
from torchtitan_zephon.titan.components.validate import ZephonValidator
from torchtitan_zephon.titan.settings.zephon_section import Zephon

DEFAULT_NOTE = "initial_load_model_only=True has no effect without an initial_load_path"
"""What TorchTitan logs each time a checkpoint section is made with its own default
(``initial_load_model_only`` True) and no initial checkpoint: every job, several times,
and every bench. Dropped from TorchTitan's logger (the root logger) once this registry,
which every Zephon job and bench starts from, is imported."""


class DropDefaultNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return DEFAULT_NOTE not in str(record.msg)


if not any(isinstance(f, DropDefaultNote) for f in logging.getLogger().filters):
    logging.getLogger().addFilter(DropDefaultNote())


def _loss(model_spec: ModelSpec) -> ChunkedLossWrapper.Config:
    return ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size)
    )


def llama3_debug() -> ZephonTrainer.Config:
    """The CPU default job: Llama 3 "small" on the builtin store (Python's own docs and
    standard-library sources), 2 CPU ranks via ./run_train.sh, or GPUs unchanged."""
    model_spec = models.llama3_model("small")
    return ZephonTrainer.Config(
        dump_folder="./outputs/debug_model",
        # the tokenizer the builtin store is tokenized with (shipped in the package)
        hf_assets_path=str(settings.builtin_tokenizer()[0]),
        model_spec=model_spec,
        loss=_loss(model_spec),
        optimizer=optim.default_adamw(lr=3e-3, eps=1e-8),
        lr_scheduler=optim.LRSchedulersContainer.Config(
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
    config.model_spec = models.llama3_model("tiny")
    config.loss = _loss(config.model_spec)
    config.dump_folder = "./outputs/tiny"
    config.optimizer = optim.default_adamw(lr=1e-2)
    config.lr_scheduler = optim.LRSchedulersContainer.Config(warmup_steps=2)
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


def llama3_8b() -> ZephonTrainer.Config:
    """TorchTitan 0.3's Llama 3 8B (flavor "8B") on a Zephon store made with the
    Llama 3.1 tokenizer: the job of ``train_configs/llama3_8b.toml``."""
    config = llama3_debug()
    config.model_spec = models.llama3_model("8B")
    config.loss = _loss(config.model_spec)
    config.dump_folder = "./outputs/llama3_8b"
    config.hf_assets_path = "./assets/hf/Llama-3.1-8B"
    config.metrics = MetricsProcessor.Config(
        log_freq=10, enable_tensorboard=True, save_tb_folder="tb"
    )
    config.optimizer = optim.default_adamw(lr=3e-4, eps=1e-8)
    config.lr_scheduler = optim.LRSchedulersContainer.Config(warmup_steps=200)
    config.training = TrainingConfig(
        local_batch_size=1,
        global_batch_size=1024,  # fixed: DP degrees dividing 1024 / local_batch_size resume exactly
        seq_len=8192,
        max_norm=1.0,
        steps=20000,
        dtype="float32",
        mixed_precision_param="bfloat16",
    )
    config.checkpoint = CheckpointManager.Config(
        enable=True, interval=500, last_save_model_only=False, export_dtype="float32",
        keep_latest_k=3,
    )  # fmt: skip
    config.activation_checkpoint = SelectiveAC.Config()
    config.compile = CompileConfig(enable=True, components=["model", "loss"])
    config.dataloader = ZephonDataLoader.Config(pin_memory=True)
    config.validator = ZephonValidator.Config(enable=True, freq=500, microbatch_size=1, steps=4)
    config.debug = DebugConfig(seed=0)
    config.zephon = Zephon(
        store="/shared/stores/corpus-llama3", seed=1234, audit="ids", heldout_samples=4096
    )
    return config


def deepseek_v3_debug() -> ZephonTrainer.Config:
    """The tiny DeepSeek-V3-style MoE (``configs.models`` deepseek_v3 flavor "tiny") on the
    builtin store: 2 CPU ranks (``--parallelism.expert_parallel_degree 2`` for EP), fp32,
    deterministic; the job of ``train_configs/deepseek_v3_debug.toml``."""
    config = llama3_tiny()
    config.model_spec = models.deepseek_v3_model("tiny")
    config.loss = _loss(config.model_spec)
    config.dump_folder = "./outputs/deepseek_v3_debug"
    config.optimizer = optim.default_adamw(lr=3e-3, eps=1e-8)
    config.parallelism = ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=1)
    return config


def deepseek_v3_16b() -> ZephonTrainer.Config:
    """TorchTitan 0.3's DeepSeek-V3 16B job (flavor "16B": 64 routed experts, EP 8,
    interleaved 1F1B pipeline) on a Zephon store made with its tokenizer."""
    config = llama3_debug()
    config.model_spec = models.deepseek_v3_model("16B")
    config.loss = _loss(config.model_spec)
    config.dump_folder = "./outputs/deepseek_v3_16b"
    config.hf_assets_path = "./assets/hf/deepseek-moe-16b-base"
    config.metrics = MetricsProcessor.Config(
        log_freq=10, enable_tensorboard=True, save_tb_folder="tb"
    )
    config.optimizer = optim.default_adamw(lr=2.2e-4)
    config.lr_scheduler = optim.LRSchedulersContainer.Config(
        decay_ratio=0.8, decay_type="cosine", min_lr_factor=0.1
    )
    config.training = TrainingConfig(
        local_batch_size=4,
        global_batch_size=512,  # fixed: DP degrees dividing 512 / local_batch_size resume exactly
        seq_len=4096,
        steps=1000,
        disable_cuda_graphs=True,
    )
    config.parallelism = ParallelismConfig(
        pipeline_parallel_schedule="Interleaved1F1B", expert_parallel_degree=8
    )
    config.checkpoint = CheckpointManager.Config(
        enable=True, interval=10, last_save_model_only=False, keep_latest_k=3
    )
    config.activation_checkpoint = SelectiveAC.Config()
    config.compile = CompileConfig(enable=True, components=["loss"])
    config.validator = ZephonValidator.Config(enable=True, freq=500, microbatch_size=4, steps=4)
    config.debug = DebugConfig(seed=0)
    config.zephon = Zephon(
        store="/shared/stores/corpus-deepseek-v3", seed=1234, audit="ids", heldout_samples=4096
    )
    return config


def qwen3_debug() -> ZephonTrainer.Config:
    """TorchTitan 0.3's Qwen3 "debugmodel" (8 layers, dim 256, tied embeddings, q/k
    norms; 32M parameters) on the builtin store, fp32, deterministic."""
    config = llama3_tiny()
    config.model_spec = models.qwen3_model("debugmodel")
    config.loss = _loss(config.model_spec)
    config.dump_folder = "./outputs/qwen3_debug"
    config.optimizer = optim.default_adamw(lr=8e-4)
    return config


def qwen3_0_6b() -> ZephonTrainer.Config:
    """TorchTitan 0.3's Qwen3 0.6B job (flavor "0.6B") on a Zephon store made with the
    Qwen3 tokenizer."""
    config = llama3_debug()
    config.model_spec = models.qwen3_model("0.6B")
    config.loss = _loss(config.model_spec)
    config.dump_folder = "./outputs/qwen3_0_6b"
    config.hf_assets_path = "./assets/hf/Qwen3-0.6B"
    config.optimizer = optim.default_adamw(lr=3e-4)
    config.lr_scheduler = optim.LRSchedulersContainer.Config(warmup_steps=2)
    config.training = TrainingConfig(
        local_batch_size=4,
        global_batch_size=256,  # fixed: DP degrees dividing 256 / local_batch_size resume exactly
        seq_len=4096,
        steps=10,
    )
    config.checkpoint = CheckpointManager.Config(
        enable=True, interval=500, last_save_model_only=False, export_dtype="float16",
        keep_latest_k=3,
    )  # fmt: skip
    config.activation_checkpoint = SelectiveAC.Config()
    config.validator = ZephonValidator.Config(enable=True, freq=500, microbatch_size=4, steps=4)
    config.debug = DebugConfig(seed=0)
    config.zephon = Zephon(
        store="/shared/stores/corpus-qwen3", seed=1234, audit="ids", heldout_samples=4096
    )
    return config


def _toml_job(model_spec: ModelSpec) -> ZephonTrainer.Config:
    """What a TOML job config starts from: TorchTitan's defaults with ``model_spec``."""
    return ZephonTrainer.Config(
        model_spec=model_spec, loss=_loss(model_spec), optimizer=optim.default_adamw()
    )


TOML_JOBS: dict[str, Callable[[str], ZephonTrainer.Config]] = {
    "llama3": lambda flavor: _toml_job(models.llama3_model(flavor)),
    "deepseek_v3": lambda flavor: _toml_job(models.deepseek_v3_model(flavor)),
    "qwen3": lambda flavor: _toml_job(models.qwen3_model(flavor)),
}
"""Model family (``toml_table.MODEL_FAMILIES``' values) -> flavor -> the job a TOML
file's keys are set on (the flavors: ``configs.models``', Zephon's and TorchTitan's); a
flavor the family lacks raises ``ValueError``."""
