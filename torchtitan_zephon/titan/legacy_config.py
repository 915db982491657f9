"""The TOML front end: TorchTitan 0.2.2 spellings (a ``--job.config_file`` TOML and
``--section.key value`` overrides) translated onto the TorchTitan 0.3 config tree
(``Trainer.Config`` plus Zephon's ``zephon`` section), as tyro arguments.

Invariant: one table (``TABLE``) owns the mapping; every 0.2.2 key is mapped to a
0.3 path, subsumed (accepted, and reported in ``LegacyTranslation.consumed``), or
refused with a ``LegacyConfigError`` that names the key as the user spelled it,
where it came from, and its new spelling where one exists. Nothing is silently
ignored; an unknown key is refused with its close matches. Command-line values
win over the TOML file's.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan_zephon.titan.config import Zephon

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "COMPONENT_FIELDS",
    "CONFIG_MODULE",
    "MODEL_FAMILIES",
    "TABLE",
    "Entry",
    "LegacyConfigError",
    "LegacyTranslation",
    "Setting",
    "check_against",
    "translate",
    "translate_toml",
]


CONFIG_MODULE = "torchtitan_zephon.titan.config"
"""The ``job.custom_config_module`` of Zephon's 0.2.2 TOML files (its [zephon] section),
which ``ZephonTrainer.Config`` subsumes."""


class LegacyConfigError(ValueError):
    """A 0.2.2 config key or value that cannot be carried onto TorchTitan 0.3."""


Kind = Literal["map", "subsumed", "refused", "renamed", "special"]
_NO_NOOP = object()


@dataclass(frozen=True)
class Entry:
    """One 0.2.2 key. ``kind``: "map" -> ``path``; "subsumed": accepted, nothing to
    set; "refused": an error, unless the value equals ``noop`` (the 0.2.2 value that
    means "off", which 0.3 does anyway); "renamed": an error naming ``path``;
    "special": handled by ``_resolve`` (model selection, optimizer betas, the
    activation-checkpoint mode). ``value``: how the command line spells it."""

    key: str
    kind: Kind
    path: str = ""
    why: str = ""
    value: Literal["scalar", "flag", "list", "lists"] = "scalar"
    noop: Any = _NO_NOOP


def _map(section: str, keys: str, to: str | None = None, value: str = "scalar") -> list[Entry]:
    to = section if to is None else to
    return [
        Entry(f"{section}.{k}", "map", f"{to}.{k}" if to else k, value=value) for k in keys.split()
    ]


def _flags(section: str, keys: str, to: str | None = None) -> list[Entry]:
    return _map(section, keys, to, value="flag")


def _refuse(key: str, why: str, noop: Any = _NO_NOOP, value: str = "scalar") -> Entry:
    return Entry(key, "refused", why=why, noop=noop, value=value)  # type: ignore[arg-type]


_OPT = "optimizer.param_groups.0"
_QUANT = "quantization moved into the model: a config registry function passes converters to model_registry"
_FT = "TorchFT fault tolerance was removed; Zephon's elastic resume needs no replica groups"

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
            why="0.3 has no field for it: LegacyTranslation.description carries it",
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
                ("linear.float8.recipe_name", _NO_NOOP, "scalar"),
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
        _refuse("fault_tolerance.enable", _FT, noop=False, value="flag"),
        *[
            _refuse(f"fault_tolerance.{k}", _FT, noop=d)
            for k, d in [
                ("process_group", "gloo"),
                ("process_group_timeout_ms", 10000),
                ("replica_id", 0),
                ("group_size", 0),
                ("min_replica_size", 1),
                ("semi_sync_method", _NO_NOOP),
            ]
        ],
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
_AC_CLASS_MODES = {"SelectiveAC": "selective", "FullAC": "full", "MemoryBudgetAC": "memory_budget"}
_BETA_DEFAULTS = (0.9, 0.95)  # 0.2.2's, also default_adamw's


@dataclass(frozen=True)
class Setting:
    """One value for a 0.3 path. ``key``: the 0.2.2 key as spelled; ``origin``:
    "TOML file F" or "command line"."""

    path: str
    value: Any
    origin: str
    key: str


@dataclass(frozen=True)
class LegacyTranslation:
    """The 0.3 reading of a 0.2.2 TOML file and command line."""

    settings: tuple[Setting, ...]
    """In order, the TOML file's first, then the command line's (later wins)."""
    model: str | None = None
    """0.3 model family from model.name, e.g. "llama3"."""
    model_name: str | None = None
    """model.name as given, e.g. "zephon_llama3"."""
    flavor: str | None = None
    config_file: str | None = None
    description: str | None = None
    consumed: tuple[Setting, ...] = ()
    """Keys accepted with nothing to set (subsumed, or a no-op value); path "" ."""

    def values(self) -> dict[str, Any]:
        """Each path's final value, in order of first appearance."""
        out: dict[str, Any] = {}
        for s in self.settings:
            out[s.path] = s.value
        return out

    def tyro_args(self, base: Any = None) -> list[str]:
        """Arguments for tyro over the 0.3 config (``ConfigManager``'s parse): the
        options, then the activation-checkpoint subcommand and its options (tyro
        applies options to the subcommand they follow). ``base``: the loaded config,
        needed when activation-checkpoint options come without a mode, and for an
        empty list (0.3's comma-separated list rule cannot spell one: it is left out
        where ``base`` already holds it, refused otherwise)."""
        last = {s.path: s for s in self.settings}
        mode = last.pop("activation_checkpoint", None)
        ac = [s for p, s in last.items() if p.startswith("activation_checkpoint.")]
        args: list[str] = []
        for s in last.values():
            if s not in ac:
                args += _render(s, base)
        if ac and mode is None:
            args.append(AC_MODES[_base_ac_mode(base, ac[0])])
        elif mode is not None:
            args.append(AC_MODES[mode.value])
        for s in ac:
            args += _render(s, base)
        return args


def _render(s: Setting, base: Any) -> list[str]:
    path, value = s.path, s.value
    if value == []:
        if base is not None and _held(base, path) == []:
            return []
        raise LegacyConfigError(
            f"{_where(s, True)}: TorchTitan 0.3's command line cannot spell an empty list for "
            f"{path}, and the selected config does not hold one; set it in the config registry "
            "function, or remove the key."
        )
    if isinstance(value, bool):
        head, _, leaf = path.rpartition(".")
        return [f"--{path}" if value else f"--{head + '.' if head else ''}no-{leaf}"]
    if isinstance(value, tuple):
        return [f"--{path}", *(str(v) for v in value)]
    if isinstance(value, list):
        if all(isinstance(v, list) for v in value) and value:
            return [f"--{path}", *(",".join(v) for v in value)]
        return [f"--{path}", ",".join(str(v) for v in value)]
    return [f"--{path}", str(value)]


def _base_ac_mode(base: Any, first: Setting) -> str:
    where = _where(first)
    if base is None:
        raise LegacyConfigError(
            f"{where} sets an activation-checkpoint option without activation_checkpoint.mode; "
            'set activation_checkpoint.mode ("selective", "full" or "memory_budget") as well.'
        )
    ac = getattr(base, "activation_checkpoint", None)
    if ac is None:
        raise LegacyConfigError(
            f"{where} sets an activation-checkpoint option, but the selected config has no activation "
            'checkpointing; set activation_checkpoint.mode ("selective", "full" or "memory_budget") as well.'
        )
    name = type(ac).__qualname__.split(".")[0]
    if name not in _AC_CLASS_MODES:
        raise LegacyConfigError(
            f"{where}: the selected config's activation checkpointing ({type(ac).__qualname__}) is not one of "
            f"{', '.join(_AC_CLASS_MODES)}; set activation_checkpoint.mode."
        )
    return _AC_CLASS_MODES[name]


def _where(s: Setting, with_value: bool = False) -> str:
    """Where a setting came from, as the user spelled it: "--training.dataset c4 on
    the command line", "training.dataset = 'c4' in TOML file F"."""
    if s.origin == "command line":
        shown = f" {_cli_text(s.value)}" if with_value and not isinstance(s.value, bool) else ""
        return f"--{s.key}{shown} on the command line"
    return f"{s.key}{f' = {s.value!r}' if with_value else ''} in {s.origin}"


def _cli_text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(",".join(v) if isinstance(v, list) else str(v) for v in value) or "''"
    return str(value) if value != "" else "''"


def _suggest(key: str, prefix: str = "") -> str:
    scored = sorted(
        ((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in TABLE), reverse=True
    )
    close = [k for r, k in scored[:3] if r >= 0.6 and r >= scored[0][0] - 0.05]  # the nearest only
    if not close:
        return "No known key is spelled like it; TorchTitan 0.2.2 keys are [section] key names (see README)."
    return "Did you mean " + " or ".join(prefix + c for c in close) + "?"


# 0.3 spellings accepted on the command line too: each path that one 0.2.2 key maps to
_BY_PATH: dict[str, str] = {}
for _e in TABLE.values():
    if _e.kind == "map":
        _BY_PATH.setdefault(_e.path, _e.key)


def _lookup(name: str) -> tuple[Entry, bool] | None:
    """The entry for a command-line option name (hyphens as underscores, 0.3
    paths allowed) and whether it is negated (``--section.no-key``)."""
    norm = name.replace("-", "_")
    for cand in (norm, _BY_PATH.get(norm, "")):
        if cand in TABLE:
            return TABLE[cand], False
    head, _, leaf = norm.rpartition(".")
    if leaf.startswith("no_"):
        found = _lookup(f"{head}.{leaf[3:]}" if head else leaf[3:])
        if found and found[0].value == "flag" and not found[1]:
            return found[0], True
    return None


def _parse_cli(argv: Sequence[str]) -> list[Setting]:
    """The command line as raw (key, value) settings; ``path`` holds the 0.2.2 key."""
    out: list[Setting] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise LegacyConfigError(
                f"{tok!r} on the command line is not an option: options are spelled --section.key VALUE."
            )
        name, eq, inline = tok[2:].partition("=")
        found = _lookup(name)
        if found is None:
            norm = name.replace("-", "_")
            hint = _suggest(norm, "--")
            if norm.startswith("no_") and (flag := _lookup(norm[3:])) and flag[0].value == "flag":
                section, _, leaf = flag[0].key.rpartition(".")
                hint = f"A flag is turned off as --{section}.no-{leaf}."
            raise LegacyConfigError(f"Unknown option --{name} on the command line. {hint}")
        entry, negated = found
        i += 1
        if entry.value == "flag":
            if eq:
                raise LegacyConfigError(
                    f"--{name} on the command line is a flag and takes no value: spell --{name} to turn it on, "
                    f"--{_negation(name)} to turn it off."
                )
            value: Any = not negated
        elif entry.value == "lists":
            parts = [inline] if eq else []
            while not eq and i < len(argv) and not argv[i].startswith("--"):
                parts.append(argv[i])
                i += 1
            value = [p.split(",") for p in parts]
        else:
            if eq:
                value = inline
            elif i < len(argv) and not argv[i].startswith("--"):
                value = argv[i]
                i += 1
            else:
                raise LegacyConfigError(
                    f"--{name} on the command line needs a value: --{name} VALUE."
                )
            if entry.value == "list":
                value = value.split(",") if value else []
        out.append(Setting(entry.key, value, "command line", name))
    return out


def _negation(name: str) -> str:
    head, _, leaf = name.rpartition(".")
    return f"{head}.no-{leaf}" if head else f"no-{leaf}"


def _flatten(table: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in table.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _read_toml(path: str) -> list[Setting]:
    origin = f"TOML file {path}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise LegacyConfigError(
            f"The config file {path} (--job.config_file) does not exist; give the path of a TOML job config, "
            "e.g. train_configs/debug_model.toml."
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LegacyConfigError(
            f"The config file {path} (--job.config_file) is not readable TOML: {e}."
        ) from None
    out = []
    for key, value in _flatten(data):
        if key not in TABLE:
            raise LegacyConfigError(f"Unknown key {key} in {origin}. {_suggest(key)}")
        if key == "job.config_file":
            raise LegacyConfigError(
                f"{key} in {origin}: a TOML file cannot name another; remove it (give the file with --job.config_file)."
            )
        if TABLE[key].value == "flag" and not isinstance(value, bool):
            raise LegacyConfigError(f"{key} = {value!r} in {origin}: expected true or false.")
        out.append(Setting(key, value, origin, key))
    return out


def _same(value: Any, noop: Any) -> bool:
    if isinstance(value, str) and not isinstance(noop, str):
        return value == str(noop) or (isinstance(noop, list) and value == ",".join(noop))
    return type(value) is type(noop) and value == noop


def _resolve(raw: list[Setting], config_file: str | None) -> LegacyTranslation:
    settings: list[Setting] = []
    consumed: list[Setting] = []
    picked: dict[str, Setting] = {}
    for s in raw:
        entry = TABLE[s.path]
        where = _where(s)
        if entry.kind == "map":
            settings.append(Setting(entry.path, s.value, s.origin, s.key))
        elif entry.kind == "subsumed":
            consumed.append(Setting("", s.value, s.origin, s.key))
        elif entry.kind == "renamed":
            raise LegacyConfigError(f"{where} is now {entry.path} ({entry.why}); rename it.")
        elif entry.kind == "refused":
            if entry.noop is not _NO_NOOP and _same(s.value, entry.noop):
                consumed.append(Setting("", s.value, s.origin, s.key))
                continue
            keep = (
                ""
                if entry.noop is _NO_NOOP
                else f" (only {entry.noop!r}, its 0.2.2 default, is accepted)"
            )
            raise LegacyConfigError(
                f"{_where(s, True)} has no equivalent in TorchTitan 0.3: {entry.why}{keep}; remove it."
            )
        else:
            picked[entry.key] = s  # later wins
            if entry.key in ("job.custom_config_module", "experimental.custom_args_module"):
                if s.value not in (CONFIG_MODULE, ""):
                    raise LegacyConfigError(
                        f"{_where(s, True)}: TorchTitan 0.3 has no custom config modules; a job is a config "
                        f"registry function (--module M --config FN returning a Trainer.Config subclass). Only "
                        f"{CONFIG_MODULE!r}, which the Zephon configs subsume, is accepted; remove it."
                    )
                consumed.append(Setting("", s.value, s.origin, s.key))
            elif entry.key == "activation_checkpoint.mode":
                if s.value not in AC_MODES:
                    raise LegacyConfigError(
                        f"{_where(s, True)}: expected one of {', '.join(map(repr, AC_MODES))}."
                    )
                settings.append(Setting("activation_checkpoint", s.value, s.origin, s.key))
            elif entry.key == "activation_checkpoint.selective_ac_option":
                if s.value != "op":
                    raise LegacyConfigError(
                        f"{_where(s, True)} has no equivalent in TorchTitan 0.3: its selective activation "
                        'checkpointing is per-op ("op"), not every N-th block; set it to "op", or '
                        'activation_checkpoint.mode = "full", or remove it.'
                    )
                consumed.append(Setting("", s.value, s.origin, s.key))
            elif entry.key in ("optimizer.beta1", "optimizer.beta2"):
                try:
                    float(s.value)
                except (TypeError, ValueError):
                    raise LegacyConfigError(
                        f"{_where(s, True)}: expected a number, e.g. 0.9."
                    ) from None
                b1, b2 = picked.get("optimizer.beta1"), picked.get("optimizer.beta2")
                betas = (
                    float(b1.value) if b1 else _BETA_DEFAULTS[0],
                    float(b2.value) if b2 else _BETA_DEFAULTS[1],
                )
                settings.append(Setting(entry.path, betas, s.origin, s.key))
    name, flavor = picked.get("model.name"), picked.get("model.flavor")
    family = None
    if name is not None:
        family = MODEL_FAMILIES.get(str(name.value))
        if family is None:
            raise LegacyConfigError(
                f"{_where(name, True)} is not a model Zephon trains; expected one of "
                f"{', '.join(map(repr, MODEL_FAMILIES))}."
            )
    desc = next((str(s.value) for s in reversed(raw) if s.path == "job.description"), None)
    return LegacyTranslation(
        settings=tuple(settings),
        model=family,
        model_name=None if name is None else str(name.value),
        flavor=None if flavor is None else str(flavor.value),
        config_file=config_file,
        description=desc,
        consumed=tuple(consumed),
    )


def translate_toml(path: str) -> LegacyTranslation:
    """The 0.3 reading of a 0.2.2 TOML job config."""
    return _resolve(_read_toml(path), path)


def translate(argv: Sequence[str]) -> LegacyTranslation:
    """The 0.3 reading of a 0.2.2 command line: the TOML named by
    ``--job.config_file`` (if any) first, then the options, which win."""
    cli = _parse_cli(argv)
    files = [s for s in cli if s.path == "job.config_file"]
    config_file = str(files[-1].value) if files else None
    toml = _read_toml(config_file) if config_file else []
    return _resolve(toml + cli, config_file)


def _step(node: Any, part: str) -> tuple[bool, Any]:
    if isinstance(node, list):
        ok = part.isdigit() and int(part) < len(node)
        return ok, node[int(part)] if ok else None
    if isinstance(node, dict):
        return part in node, node.get(part)
    names = {f.name for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else set()
    return part in names, getattr(node, part, None)


def _held(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        ok, node = _step(node, part)
        if not ok:
            return None
    return node


def check_against(config: Any, translation: LegacyTranslation) -> None:
    """Refuse, naming the 0.2.2 key, any setting whose 0.3 path the loaded config
    (a ``Trainer.Config`` instance, e.g. a registry function's) does not have: a
    stock dataloader or validator without Zephon's fields, an optimizer without one
    catch-all parameter group, an activation-checkpoint option of another mode."""
    values = translation.values()
    mode = values.get("activation_checkpoint")
    for s in translation.settings:
        if s.path == "activation_checkpoint" or (
            mode is not None and s.path.startswith("activation_checkpoint.")
        ):
            continue  # the subcommand replaces the AC config; tyro checks its options
        node: Any = config
        for depth, part in enumerate(s.path.split(".")):
            ok, nxt = _step(node, part)
            if not ok:
                have = type(node).__qualname__
                missing = ".".join(s.path.split(".")[: depth + 1])
                extra = (
                    f" ({COMPONENT_FIELDS[s.path]} has it)" if s.path in COMPONENT_FIELDS else ""
                )
                raise LegacyConfigError(
                    f"{_where(s)} maps to {s.path}, but the selected config has no {missing} (found {have})"
                    f"{extra}; choose a config that has it, or remove the key."
                )
            node = nxt
