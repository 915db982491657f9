"""TrainSpec registration: ``model.name = "zephon_llama3"``.

Invariant: the spec is TorchTitan's llama3 spec with exactly three seams
changed: the dataloader (Zephon, one DP rank's slice of the global order), the
validator (held-out samples, DP-independent), and on CPU the parallelize
function (FSDP reductions forced to plain sums, which gloo supports). The model,
its flavors and everything else are TorchTitan's own, plus two small flavors
for CPU work ("small" for the default job, "tiny" for tests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.dataloader import build_zephon_dataloader
from torchtitan_zephon.titan.validate import build_zephon_validator

NAME = "zephon_llama3"

zephon_llama3_args = {
    **llama3_args,
    # 1.6M parameters: the default CPU job (train_configs/debug_model.toml).
    "small": TransformerModelArgs(
        dim=128, n_layers=4, n_heads=8, vocab_size=2048, rope_theta=500000
    ),
    # 0.4M parameters: end-to-end tests.
    "tiny": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048, rope_theta=500000),
}


def _cpu_safe(parallelize_fn: Any) -> Any:
    def parallelize(model: Any, parallel_dims: Any, job_config: Any) -> Any:
        model = parallelize_fn(model, parallel_dims, job_config)
        if platform.on_cpu():
            platform.force_sum_reductions([model])
        return model

    return parallelize


def zephon_train_spec() -> TrainSpec:
    base = llama3_train_spec()
    return dataclasses.replace(
        base,
        model_args=zephon_llama3_args,
        parallelize_fn=_cpu_safe(base.parallelize_fn),
        build_dataloader_fn=build_zephon_dataloader,
        build_validator_fn=build_zephon_validator,
    )


def register() -> None:
    """Register ``zephon_llama3`` once (idempotent)."""
    try:
        get_train_spec(NAME)
    except ValueError:
        register_train_spec(NAME, zephon_train_spec())
