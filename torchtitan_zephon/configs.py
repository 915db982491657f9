"""Zephon's config registry: ``--module torchtitan_zephon.configs --config FN``.

Each function returns a whole job, every value in sight (as TorchTitan 0.3's
``models/*/config_registry.py`` do), on Zephon's trainer: Zephon's dataloader and
validator, the ``zephon`` section, topology-free initial weights. The command
line overrides any value (``--training.steps 8``, ``--zephon.store PATH``, ...).

* ``llama3_debug``: the CPU default job (``train_configs/debug_model.toml``):
  Llama 3 flavor "small" on the builtin store.
* ``llama3_tiny``: the end-to-end test job (``tests/titan/tiny.toml``): flavor "tiny".

``TOML_JOBS`` holds what a TOML job config (``--job.config_file``, the 0.2.2
spelling) starts from, by model family: TorchTitan's defaults (0.2.2's JobConfig
defaults, as far as 0.3 kept them) around the flavor's model, its loss and one
catch-all AdamW parameter group; the TOML's keys are set on it as overrides.

Invariant: every public lowercase callable of this module is a config function
(TorchTitan lists them when ``--config`` names none of them); the model flavors
are ``titan.models``'.
"""

from __future__ import annotations

from collections.abc import Callable

import torchtitan.components.optimizer as optim
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CommConfig, DebugConfig
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_zephon.job import settings
from torchtitan_zephon.titan import models
from torchtitan_zephon.titan.config import Zephon
from torchtitan_zephon.titan.dataloader import ZephonDataLoader
from torchtitan_zephon.titan.trainer import ZephonTrainer
from torchtitan_zephon.titan.validate import ZephonValidator


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


def _toml_job(model_spec: ModelSpec) -> ZephonTrainer.Config:
    """What a TOML job config starts from: TorchTitan's defaults with ``model_spec``."""
    return ZephonTrainer.Config(
        model_spec=model_spec, loss=_loss(model_spec), optimizer=optim.default_adamw()
    )


TOML_JOBS: dict[str, Callable[[str], ZephonTrainer.Config]] = {
    "llama3": lambda flavor: _toml_job(models.llama3_model(flavor)),
}
"""Model family (``legacy_config.MODEL_FAMILIES``' values) -> flavor -> the job a TOML
file's keys are set on; a flavor the family lacks raises ``ValueError``."""
