"""TrainSpec registration: ``model.name = "zephon_llama3"``.

Invariant: the spec is TorchTitan's llama3 spec with exactly four seams
changed: the dataloader (Zephon, one DP rank's slice of the global order), the
validator (held-out samples, DP-independent), the model's ``init_weights``
(TorchTitan's, run under ``titan/init.py`` so the initial weights depend on
``debug.seed`` and the model config only, unless ``zephon.init = "torchtitan"``),
and on CPU the parallelize function (FSDP reductions forced to plain sums, which
gloo supports). The model's layers, its flavors and everything else are
TorchTitan's own, plus two small flavors for CPU work ("small" for the default
job, "tiny" for tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.tools import utils as titan_utils

from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.dataloader import build_zephon_dataloader
from torchtitan_zephon.titan.init import init_weights_topology_free
from torchtitan_zephon.titan.validate import build_zephon_validator

NAME = "zephon_llama3"


@dataclass
class ZephonTransformerArgs(TransformerModelArgs):
    """TorchTitan's llama3 args plus how to initialise the weights (from the job)."""

    init: str = "zephon"
    init_seed: int = 0

    def update_from_config(self, job_config: Any, **kwargs: Any) -> None:
        super().update_from_config(job_config, **kwargs)
        self.init = job_config.zephon.init
        seed = job_config.debug.seed
        self.init_seed = 0 if seed is None else int(seed)


class ZephonTransformer(Transformer):
    """TorchTitan's llama3 Transformer whose ``init_weights`` is topology-free."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        args = self.model_args
        if getattr(args, "init", "zephon") == "torchtitan":
            super().init_weights(buffer_device=buffer_device)
            return
        # Values are drawn on the job's device type even where the parameters live
        # on the CPU (training.enable_cpu_offload), so offloading does not change them.
        init_weights_topology_free(
            self,
            getattr(args, "init_seed", 0),
            lambda: super(ZephonTransformer, self).init_weights(buffer_device=buffer_device),
            device=torch.device(titan_utils.device_type),
        )


def _zephon_args(args: TransformerModelArgs) -> ZephonTransformerArgs:
    return ZephonTransformerArgs(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    )


zephon_llama3_args = {
    name: _zephon_args(args)
    for name, args in {
        **llama3_args,
        # 1.6M parameters: the default CPU job (train_configs/debug_model.toml).
        "small": TransformerModelArgs(
            dim=128, n_layers=4, n_heads=8, vocab_size=2048, rope_theta=500000
        ),
        # 0.4M parameters: end-to-end tests.
        "tiny": TransformerModelArgs(
            dim=64, n_layers=2, n_heads=4, vocab_size=2048, rope_theta=500000
        ),
    }.items()
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
        model_cls=ZephonTransformer,
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
