"""The one translation table: TorchTitan 0.2.2 config keys (a ``--job.config_file``
TOML's ``[section] key`` and the ``--section.key`` options) -> paths of the TorchTitan
0.3 config tree (``Trainer.Config`` plus Zephon's ``zephon`` section).

Invariant: ``TABLE`` owns the mapping. Every key of 0.2.2's JobConfig and every field
of ``Zephon`` has exactly one ``Entry``: mapped to a 0.3 path, subsumed, renamed,
refused (with the reason, and the 0.2.2 value accepted as a no-op, if any), or
special (model selection, optimizer betas, the activation-checkpoint mode). This
module is data; ``toml_front`` reads TOML files and command lines through it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan_zephon.titan.settings.zephon_section import Zephon

__all__ = [
    "AC_MODES",
    "COMPONENT_FIELDS",
    "CONFIG_MODULE",
    "MODEL_FAMILIES",
    "NO_NOOP",
    "TABLE",
    "Entry",
]


CONFIG_MODULE = "torchtitan_zephon.titan.config"
"""The ``job.custom_config_module`` of Zephon's 0.2.2 TOML files (its [zephon] section),
which ``ZephonTrainer.Config`` subsumes."""


Kind = Literal["map", "subsumed", "refused", "renamed", "special"]
NO_NOOP = object()
"""An ``Entry.noop`` meaning "no value is accepted": the key is always refused."""


@dataclass(frozen=True)
class Entry:
    """One 0.2.2 key. ``kind``: "map" -> ``path``; "subsumed": accepted, nothing to
    set; "refused": an error, unless the value equals ``noop`` (the 0.2.2 value that
    means "off", which 0.3 does anyway); "renamed": an error naming ``path``;
    "special": handled by ``toml_front`` (model selection, optimizer betas, the
    activation-checkpoint mode). ``value``: how the command line spells it."""

    key: str
    kind: Kind
    path: str = ""
    why: str = ""
    value: Literal["scalar", "flag", "list", "lists"] = "scalar"
    noop: Any = NO_NOOP


def _map(section: str, keys: str, to: str | None = None, value: str = "scalar") -> list[Entry]:
    to = section if to is None else to
    return [
        Entry(f"{section}.{k}", "map", f"{to}.{k}" if to else k, value=value) for k in keys.split()
    ]


def _flags(section: str, keys: str, to: str | None = None) -> list[Entry]:
    return _map(section, keys, to, value="flag")


def _refuse(key: str, why: str, noop: Any = NO_NOOP, value: str = "scalar") -> Entry:
    return Entry(key, "refused", why=why, noop=noop, value=value)  # type: ignore[arg-type]


_OPT = "optimizer.param_groups.0"
_QUANT = "quantization moved into the model: a config registry function passes converters to model_registry"
_FT = "Zephon's data state is one record, the same for every replica group: no per-replica dataloader checkpoints"

# The 0.2.2 key -> 0.3 path table. Keys are 0.2.2 JobConfig paths plus Zephon's
# [zephon] section; paths are fields of the 0.3 Trainer.Config tree, where
# COMPONENT_FIELDS marks those that Zephon's dataloader / validator configs carry.
TABLE: dict[str, Entry] = {
    e.key: e
    for e in [
        # [job]
        Entry("job.config_file", "subsumed", why="the TOML file itself"),
        Entry("job.dump_folder", "map", "dump_folder"),
        Entry(
            "job.description",
            "subsumed",
            why="0.3 has no field for it: TomlTranslation.description carries it",
        ),
        Entry("job.print_config", "map", "debug.print_config", value="flag"),
        Entry("job.save_config_file", "map", "debug.save_config_file"),
        Entry("job.custom_config_module", "special", why=f"subsumed when it is {CONFIG_MODULE!r}"),
        # [profiling] -> profiler
        *_flags("profiling", "enable_profiling enable_memory_snapshot", "profiler"),
        *_map(
            "profiling",
            "save_traces_folder profile_freq profiler_active profiler_warmup save_memory_snapshot_folder",
            "profiler",
        ),
        # [metrics]
        Entry("metrics.log_freq", "map", "metrics.log_freq"),
        Entry("metrics.save_tb_folder", "map", "metrics.save_tb_folder"),
        *_flags(
            "metrics", "enable_tensorboard disable_color_printing save_for_all_ranks enable_wandb"
        ),
        # [model]: name and flavor select the config; they are not config paths
        Entry("model.name", "special", why="selects the model family (MODEL_FAMILIES)"),
        Entry("model.flavor", "special", why="selects the model flavor"),
        Entry("model.hf_assets_path", "map", "hf_assets_path"),
        Entry(
            "model.tokenizer_path", "renamed", "model.hf_assets_path", why="0.2.2 had deprecated it"
        ),
        _refuse("model.converters", _QUANT, noop=[], value="list"),
        _refuse("model.print_after_conversion", _QUANT, noop=False, value="flag"),
        # [optimizer] -> the one catch-all parameter group of 0.3's OptimizersContainer
        Entry("optimizer.name", "map", f"{_OPT}.optimizer_name"),
        Entry("optimizer.lr", "map", f"{_OPT}.optimizer_kwargs.lr"),
        Entry("optimizer.eps", "map", f"{_OPT}.optimizer_kwargs.eps"),
        Entry("optimizer.weight_decay", "map", f"{_OPT}.optimizer_kwargs.weight_decay"),
        Entry("optimizer.beta1", "special", f"{_OPT}.optimizer_kwargs.betas", why="betas[0]"),
        Entry("optimizer.beta2", "special", f"{_OPT}.optimizer_kwargs.betas", why="betas[1]"),
        Entry("optimizer.implementation", "map", "optimizer.implementation"),
        _refuse(
            "optimizer.early_step_in_backward",
            "0.3 steps the optimizer after backward",
            noop=False,
            value="flag",
        ),
        # [lr_scheduler]
        *_map("lr_scheduler", "warmup_steps total_steps decay_ratio decay_type min_lr_factor"),
        # [training]
        *_map(
            "training",
            "local_batch_size global_batch_size seq_len max_norm steps dtype mixed_precision_param "
            "mixed_precision_reduce gc_freq",
        ),
        *_flags("training", "enable_cpu_offload gc_debug"),
        _refuse("training.dataset", "Zephon reads zephon.store (or zephon.mixture)"),
        _refuse("training.dataset_path", "Zephon reads zephon.store (or zephon.mixture)"),
        Entry("training.dataloader.num_workers", "map", "dataloader.num_workers"),
        Entry("training.dataloader.pin_memory", "map", "dataloader.pin_memory", value="flag"),
        _refuse(
            "training.dataloader.persistent_workers",
            "Zephon's loader does not use it",
            noop=False,
            value="flag",
        ),
        _refuse(
            "training.dataloader.prefetch_factor", "Zephon's loader reads ahead by zephon.prefetch"
        ),
        # [parallelism]
        *_map(
            "parallelism",
            "data_parallel_replicate_degree data_parallel_shard_degree fsdp_reshard_after_forward "
            "tensor_parallel_degree pipeline_parallel_degree pipeline_parallel_first_stage_less_layers "
            "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
            "pipeline_parallel_schedule pipeline_parallel_schedule_csv pipeline_parallel_microbatch_size "
            "context_parallel_degree context_parallel_load_balancer expert_parallel_degree",
        ),
        Entry(
            "parallelism.module_fqns_per_model_part",
            "map",
            "parallelism.module_fqns_per_model_part",
            value="lists",
        ),
        Entry(
            "parallelism.enable_async_tensor_parallel",
            "map",
            "compile.enable_async_tensor_parallel",
            value="flag",
        ),
        _refuse(
            "parallelism.disable_loss_parallel",
            "0.3 computes the loss on sharded logits itself",
            noop=False,
            value="flag",
        ),
        _refuse(
            "parallelism.pipeline_parallel_expert_parallel_overlap",
            "0.3 schedules PP and EP communication itself",
            noop=True,
            value="flag",
        ),
        _refuse(
            "parallelism.context_parallel_rotate_method",
            "0.3's context parallelism has one method",
            noop="allgather",
        ),
        _refuse(
            "parallelism.expert_tensor_parallel_degree",
            "expert tensor parallelism (ETP) was removed",
            noop=1,
        ),
        _refuse(
            "parallelism.expert_parallel_comm_backend",
            "the token dispatcher (e.g. DeepEP / HybridEP) is part of the model config in a config registry function",
            noop="standard",
        ),
        # [checkpoint]
        *_map(
            "checkpoint",
            "folder interval initial_load_path export_dtype keep_latest_k load_step async_mode",
        ),
        Entry(
            "checkpoint.exclude_from_loading",
            "map",
            "checkpoint.exclude_from_loading",
            value="list",
        ),
        *_flags(
            "checkpoint",
            "enable initial_load_model_only initial_load_in_hf initial_load_in_hf_quantized last_save_model_only "
            "last_save_in_hf enable_first_step_checkpoint create_seed_checkpoint load_only",
        ),
        _refuse("checkpoint.enable_ft_dataloader_checkpoints", _FT, noop=True, value="flag"),
        # [activation_checkpoint]: mode selects the 0.3 config class (a tyro subcommand)
        Entry(
            "activation_checkpoint.mode",
            "special",
            "activation_checkpoint",
            why="selects the AC config class",
        ),
        Entry(
            "activation_checkpoint.selective_ac_option",
            "special",
            why='"op" is what 0.3 selective AC does',
        ),
        Entry(
            "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
            "map",
            "activation_checkpoint.force_recompute_mm_shapes_by_fqns",
            value="list",
        ),
        Entry("activation_checkpoint.memory_budget", "map", "activation_checkpoint.memory_budget"),
        Entry(
            "activation_checkpoint.determinism_check",
            "map",
            "activation_checkpoint.determinism_check",
        ),
        *_flags("activation_checkpoint", "visualize_memory_budget_pareto preserve_rng_state debug"),
        _refuse(
            "activation_checkpoint.early_stop",
            "0.3 does not stop recomputation early",
            noop=False,
            value="flag",
        ),
        # [compile]
        Entry("compile.enable", "map", "compile.enable", value="flag"),
        Entry("compile.components", "map", "compile.components", value="list"),
        Entry("compile.backend", "map", "compile.backend"),
        # [quantize.*]
        *[
            _refuse(f"quantize.{k}", _QUANT, noop=d, value=v)
            for k, d, v in [
                ("linear.float8.enable_fsdp_float8_all_gather", False, "flag"),
                ("linear.float8.precompute_float8_dynamic_scale_for_fsdp", False, "flag"),
                ("linear.float8.recipe_name", NO_NOOP, "scalar"),
                ("linear.float8.filter_fqns", [], "list"),
                ("linear.float8.emulate", False, "flag"),
                ("linear.mx.mxfp8_dim1_cast_kernel_choice", "triton", "scalar"),
                ("linear.mx.recipe_name", "mxfp8_cublas", "scalar"),
                ("linear.mx.filter_fqns", ["output"], "list"),
                ("grouped_mm.float8.fqns", [], "list"),
                ("grouped_mm.mx.recipe_name", "mxfp8", "scalar"),
                ("grouped_mm.mx.fqns", [], "list"),
            ]
        ],
        # [comm]
        *_map(
            "comm", "init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder"
        ),
        *_map("comm", "save_traces_file_prefix mode"),
        # [memory_estimation], [fault_tolerance], [experimental]
        _refuse(
            "memory_estimation.enable", "the memory estimator was removed", noop=False, value="flag"
        ),
        _refuse(
            "memory_estimation.disable_fake_mode",
            "the memory estimator was removed",
            noop=False,
            value="flag",
        ),
        # [fault_tolerance]: TorchTitan 0.3's torchft section on Zephon's trainer (its
        # checks: titan.ft.settings)
        *_flags("fault_tolerance", "enable"),
        *_map(
            "fault_tolerance",
            "process_group process_group_timeout_ms replica_id group_size min_replica_size "
            "semi_sync_method",
        ),
        _refuse(
            "experimental.custom_import",
            "0.3 imports the module named by --module (a config registry) instead",
            noop="",
        ),
        Entry(
            "experimental.custom_args_module",
            "special",
            why="0.2.2's old name of job.custom_config_module",
        ),
        # [validation] -> validator
        Entry("validation.enable", "map", "validator.enable", value="flag"),
        Entry("validation.freq", "map", "validator.freq"),
        Entry("validation.steps", "map", "validator.steps"),
        Entry("validation.local_batch_size", "map", "validator.microbatch_size"),
        _refuse("validation.seq_len", "validation uses training.seq_len"),
        _refuse(
            "validation.dataset", "validation reads the zephon.heldout_samples of zephon.store"
        ),
        _refuse(
            "validation.dataset_path", "validation reads the zephon.heldout_samples of zephon.store"
        ),
        _refuse(
            "validation.dataloader.num_workers", "Zephon's validator reads in the trainer", noop=0
        ),
        _refuse(
            "validation.dataloader.persistent_workers",
            "Zephon's validator reads in the trainer",
            noop=False,
            value="flag",
        ),
        _refuse(
            "validation.dataloader.pin_memory",
            "Zephon's validator reads in the trainer",
            noop=False,
            value="flag",
        ),
        _refuse("validation.dataloader.prefetch_factor", "Zephon's validator reads in the trainer"),
        # [debug]
        Entry("debug.seed", "map", "debug.seed"),
        *_flags("debug", "deterministic deterministic_warn_only moe_force_load_balance"),
        # [zephon]: every field of Zephon, unchanged
        *[
            Entry(
                f"zephon.{f.name}",
                "map",
                f"zephon.{f.name}",
                value="flag"
                if f.type in (bool, "bool")
                else "list"
                if str(f.type).startswith("list")
                else "scalar",
            )
            for f in dataclasses.fields(Zephon)
        ],
    ]
}

# Paths the table maps to that stock 0.3 configs lack: Zephon's dataloader and
# validator configs carry them (0.3's validator batches by training.local_batch_size).
COMPONENT_FIELDS: dict[str, str] = {
    "dataloader.num_workers": "Zephon's dataloader config",
    "dataloader.pin_memory": "Zephon's dataloader config",
    "validator.microbatch_size": "Zephon's validator config (0.2.2: validation.local_batch_size)",
}

# model.name (0.2.2 TrainSpec name) -> 0.3 model family (the --module of a config registry)
MODEL_FAMILIES: dict[str, str] = {
    "zephon_llama3": "llama3",
    "llama3": "llama3",
    "zephon_deepseek_v3": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "zephon_qwen3": "qwen3",
    "qwen3": "qwen3",
}

# activation_checkpoint.mode -> the tyro subcommand that selects 0.3's AC config class
AC_MODES: dict[str, str] = {
    "selective": "activation-checkpoint:selective",
    "full": "activation-checkpoint:full",
    "memory_budget": "activation-checkpoint:memory-budget",
    "none": "activation-checkpoint:none",
}
