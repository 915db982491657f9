"""Tests of titan/settings/toml_table.py: 0.2.2 TOML keys and --section.key spellings
carried onto the TorchTitan 0.3 config tree, checked against the real 0.3
``Trainer.Config`` (runs in the 0.3 environment)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan.config.configurable", reason="needs TorchTitan 0.3")
import tyro  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.config.manager import ConfigManager, custom_registry  # noqa: E402
from torchtitan.distributed.activation_checkpoint import (  # noqa: E402
    FullAC,
    MemoryBudgetAC,
    SelectiveAC,
)
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from torchtitan_zephon.configs.toml_front import (  # noqa: E402
    TomlConfigError,
    check_against,
    translate,
    translate_toml,
)
from torchtitan_zephon.configs.toml_table import (  # noqa: E402
    COMPONENT_FIELDS,
    CONFIG_MODULE,
    TABLE,
)
from torchtitan_zephon.titan.settings.zephon_section import Zephon  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Every key of TorchTitan 0.2.2's JobConfig (torchtitan/config/job_config.py), by section.
JOB_CONFIG_022 = """
    job: config_file dump_folder description print_config save_config_file custom_config_module
    profiling: enable_profiling save_traces_folder profile_freq profiler_active profiler_warmup
        enable_memory_snapshot save_memory_snapshot_folder
    metrics: log_freq enable_tensorboard disable_color_printing save_tb_folder save_for_all_ranks
        enable_wandb
    model: name flavor hf_assets_path tokenizer_path converters print_after_conversion
    optimizer: name lr beta1 beta2 eps weight_decay implementation early_step_in_backward
    lr_scheduler: warmup_steps total_steps decay_ratio decay_type min_lr_factor
    training: dataset dataset_path local_batch_size global_batch_size seq_len max_norm steps
        enable_cpu_offload dtype mixed_precision_param mixed_precision_reduce gc_freq gc_debug
    training.dataloader: num_workers persistent_workers pin_memory prefetch_factor
    parallelism: data_parallel_replicate_degree data_parallel_shard_degree
        fsdp_reshard_after_forward tensor_parallel_degree disable_loss_parallel
        enable_async_tensor_parallel pipeline_parallel_degree module_fqns_per_model_part
        pipeline_parallel_first_stage_less_layers pipeline_parallel_last_stage_less_layers
        pipeline_parallel_layers_per_stage pipeline_parallel_schedule
        pipeline_parallel_schedule_csv pipeline_parallel_microbatch_size
        pipeline_parallel_expert_parallel_overlap context_parallel_degree
        context_parallel_load_balancer context_parallel_rotate_method expert_parallel_degree
        expert_tensor_parallel_degree expert_parallel_comm_backend
    checkpoint: enable enable_ft_dataloader_checkpoints folder interval initial_load_path
        initial_load_model_only initial_load_in_hf initial_load_in_hf_quantized
        last_save_model_only last_save_in_hf export_dtype async_mode keep_latest_k load_step
        exclude_from_loading enable_first_step_checkpoint create_seed_checkpoint load_only
    activation_checkpoint: mode selective_ac_option per_op_sac_force_recompute_mm_shapes_by_fqns
        early_stop memory_budget visualize_memory_budget_pareto preserve_rng_state
        determinism_check debug
    compile: enable components backend
    quantize.linear.float8: enable_fsdp_float8_all_gather
        precompute_float8_dynamic_scale_for_fsdp recipe_name filter_fqns emulate
    quantize.linear.mx: mxfp8_dim1_cast_kernel_choice recipe_name filter_fqns
    quantize.grouped_mm.float8: fqns
    quantize.grouped_mm.mx: recipe_name fqns
    comm: init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder
        save_traces_file_prefix mode
    memory_estimation: enable disable_fake_mode
    fault_tolerance: enable process_group process_group_timeout_ms replica_id group_size
        min_replica_size semi_sync_method
    experimental: custom_import custom_args_module
    validation: enable dataset dataset_path local_batch_size seq_len freq steps
    validation.dataloader: num_workers persistent_workers pin_memory prefetch_factor
    debug: seed deterministic deterministic_warn_only moe_force_load_balance
"""


def _keys_022() -> list[str]:
    keys, section = [], ""
    for line in JOB_CONFIG_022.strip("\n").splitlines():
        if not line.startswith("        "):
            section, _, line = line.strip().partition(": ")
        keys += [f"{section}.{k}" for k in line.split()]
    return keys


# --- the 0.3 side: a config with a zephon section, as the port builds it ----------


@dataclass(kw_only=True, slots=True)
class ValidatorStandIn(Validator.Config):
    """Stand-in for Zephon's validator config: 0.3's Validator.Config plus the field
    COMPONENT_FIELDS promises (0.3 validates with training.local_batch_size)."""

    microbatch_size: int = 0


@dataclass(kw_only=True, slots=True)
class Config(Trainer.Config):
    zephon: Zephon = field(default_factory=Zephon)


def _base(**changes: Any) -> Config:
    """llama3_debugmodel (a real 0.3 registry config: HuggingFaceTextDataLoader, DCP
    checkpointer, default_adamw, selective AC) as a Config with a zephon section."""
    stock = llama3_debugmodel()
    values = {f.name: getattr(stock, f.name) for f in dataclasses.fields(stock)}
    v = stock.validator
    values["validator"] = ValidatorStandIn(
        enable=v.enable, freq=v.freq, steps=v.steps, dataloader=v.dataloader
    )
    return Config(**{**values, **changes})


def _parse(args: list[str], base: Config | None = None) -> Config:
    ConfigManager()  # registers the comma-separated list[str] rule, as 0.3's parse does
    base = _base() if base is None else base
    return tyro.cli(Config, args=args, default=base, registry=custom_registry)


def _get(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node[part]
        else:
            node = getattr(node, part)
    return node


def _paths(node: Any, prefix: str = "") -> set[str]:
    """Every settable leaf path of a config instance (runtime types, as tyro sees them)."""
    out: set[str] = set()
    if dataclasses.is_dataclass(node):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list) and node and dataclasses.is_dataclass(node[0]):
        items = [(str(i), v) for i, v in enumerate(node)]
    else:
        return {prefix[:-1]}
    for name, value in items:
        if name != "model_spec":
            out |= _paths(value, f"{prefix}{name}.")
    return out


def _tree_03() -> set[str]:
    """The 0.3 paths: the stock registry config's tree, each activation-checkpoint
    class's fields, and the sections Zephon's trainer config adds: zephon and
    fault_tolerance (TorchTitan's torchft section)."""
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance

    paths = _paths(llama3_debugmodel()) | {"activation_checkpoint"}
    for ac in (SelectiveAC.Config(), FullAC.Config(), MemoryBudgetAC.Config()):
        paths |= _paths(ac, "activation_checkpoint.")
    paths |= {f"fault_tolerance.{f.name}" for f in dataclasses.fields(FaultTolerance)}
    return paths | {f"zephon.{f.name}" for f in dataclasses.fields(Zephon)}


def _normalise(spelling: str) -> tuple[str, bool]:
    """A --section.key spelling (0.2.2's, or the 0.3 path one 0.2.2 key maps to, which
    the TOML front end accepts too) -> (0.2.2 key, negated)."""
    by_path = {}
    for k, e in TABLE.items():
        if e.kind == "map":
            by_path.setdefault(e.path, k)
    key = spelling.removeprefix("--").replace("-", "_")
    key = by_path.get(key, key)
    head, _, leaf = key.rpartition(".")
    if key not in TABLE and leaf.startswith("no_"):
        key = f"{head}.{leaf[3:]}"
        return by_path.get(key, key), True
    return key, False


# --- the spellings in the repository --------------------------------------------

PLACEHOLDERS = {"--section.key", "--zephon.KEY"}  # README prose, not keys
# deliberate unknown keys: test_toml_front.py's, test_launcher.py's
MISSPELLED = {"--training.stepz", "--trainning.seq_len", "--zzz.qqq"}
# 0.3 paths with no 0.2.2 key: registry jobs (--module/--config) only; the TOML front end
# refuses them as unknown keys (test_a_03_only_option_is_refused_by_the_toml_front_end)
ONLY_03 = {"--loss.num_chunks"}
SPELLING = re.compile(r"--[a-z_]+(?:\.[A-Za-z0-9_-]+)+")


def _job_tomls() -> list[Path]:
    return sorted((ROOT / "train_configs").glob("*.toml")) + [ROOT / "tests/titan/tiny.toml"]


def _repo_spellings() -> set[str]:
    files = [ROOT / "README.md", ROOT / "run_train.sh"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())
    files += sorted((ROOT / "tests").rglob("*.py"))
    found: set[str] = set()
    for path in files:
        if path.name == "test_toml_table.py":
            continue  # its own deliberate misspellings
        for m in SPELLING.finditer(path.read_text(errors="replace")):
            found.add(m.group(0).rstrip(".-"))
    for path in _job_tomls():
        found |= {"--" + k for k in _toml_keys(path)}
    return found - PLACEHOLDERS - MISSPELLED - ONLY_03


def test_a_03_only_option_is_a_03_path_the_toml_front_end_refuses():
    tree = _tree_03()
    for s in ONLY_03:
        key = s.removeprefix("--")
        assert key in tree and key not in TABLE, s
        with pytest.raises(TomlConfigError, match=re.escape(key)):
            translate(["--job.config_file", str(ROOT / "tests/titan/tiny.toml"), s, "2"])


def _toml_keys(path: Path) -> list[str]:
    def flat(d: dict, prefix: str = "") -> list[str]:
        out = []
        for k, v in d.items():
            out += flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
        return out

    return flat(tomllib.loads(path.read_text()))


def test_every_022_key_is_in_the_table():
    assert sorted(_keys_022()) == sorted(k for k in TABLE if not k.startswith("zephon."))
    assert {k for k in TABLE if k.startswith("zephon.")} == {
        f"zephon.{f.name}" for f in dataclasses.fields(Zephon)
    }


# The bool keys of 0.2.2's JobConfig: command-line flags (--key / --section.no-key).
BOOLS_022 = """
    job.print_config profiling.enable_profiling profiling.enable_memory_snapshot
    metrics.enable_tensorboard metrics.disable_color_printing metrics.save_for_all_ranks
    metrics.enable_wandb model.print_after_conversion optimizer.early_step_in_backward
    training.enable_cpu_offload training.gc_debug training.dataloader.persistent_workers
    training.dataloader.pin_memory parallelism.disable_loss_parallel
    parallelism.enable_async_tensor_parallel
    parallelism.pipeline_parallel_expert_parallel_overlap checkpoint.enable
    checkpoint.enable_ft_dataloader_checkpoints checkpoint.initial_load_model_only
    checkpoint.initial_load_in_hf checkpoint.initial_load_in_hf_quantized
    checkpoint.last_save_model_only checkpoint.last_save_in_hf
    checkpoint.enable_first_step_checkpoint checkpoint.create_seed_checkpoint
    checkpoint.load_only activation_checkpoint.early_stop
    activation_checkpoint.visualize_memory_budget_pareto
    activation_checkpoint.preserve_rng_state activation_checkpoint.debug compile.enable
    quantize.linear.float8.enable_fsdp_float8_all_gather
    quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
    quantize.linear.float8.emulate memory_estimation.enable
    memory_estimation.disable_fake_mode fault_tolerance.enable validation.enable
    validation.dataloader.persistent_workers validation.dataloader.pin_memory
    debug.deterministic debug.deterministic_warn_only debug.moe_force_load_balance
"""


def test_the_022_bools_are_flags_and_nothing_else_is():
    bools = set(BOOLS_022.split()) | {
        f"zephon.{f.name}" for f in dataclasses.fields(Zephon) if f.type in (bool, "bool")
    }
    assert {k for k, e in TABLE.items() if e.value == "flag"} == bools
    assert translate(["--validation.dataloader.no-pin_memory"]).settings == ()  # its no-op


def test_every_mapped_path_is_a_03_field():
    tree = _tree_03()
    targets = {e.path for e in TABLE.values() if e.kind == "map"}
    # the one path no stock 0.3 config has: Zephon's validator carries it
    assert targets - tree == {"validator.microbatch_size"}
    assert targets - tree <= set(COMPONENT_FIELDS)
    assert {"dataloader.num_workers", "dataloader.pin_memory"} <= tree  # HF loader; Zephon's too


def test_every_spelling_in_the_repo_maps():
    spellings = _repo_spellings()
    # the issue's list, and proof the collection reads each kind of file
    for s in [
        "--checkpoint.interval",
        "--checkpoint.load_step",
        "--checkpoint.keep_latest_k",
        "--validation.local_batch_size",
        "--metrics.log_freq",
        "--lr_scheduler.warmup_steps",
        "--comm.init_timeout_seconds",
        "--debug.no-deterministic",
        "--job.config_file",
        "--job.dump_folder",
        "--validation.no-enable",
        "--model.flavor",
        "--model.hf_assets_path",
        "--zephon.store",
        "--debug.seed",  # train_configs/*.toml
        "--training.dataloader.pin_memory",  # llama3_8b.toml
    ]:
        assert s in spellings, s
    tree = _tree_03()
    for s in sorted(spellings):
        key, negated = _normalise(s)
        assert key in TABLE, f"{s} is not a 0.2.2 key"
        entry = TABLE[key]
        assert entry.kind in ("map", "subsumed", "special"), f"{s} is {entry.kind}"
        if negated:
            assert entry.value == "flag", s
        if entry.kind == "map":
            assert entry.path in tree or entry.path in COMPONENT_FIELDS, f"{s} -> {entry.path}"
    assert len(spellings) >= 60


# --- explicit mappings ------------------------------------------------------------

EXPECTED = {
    # (0.2.2 command line) -> {0.3 path: value}
    ("--job.dump_folder", "out"): {"dump_folder": "out"},
    ("--model.hf_assets_path", "hf"): {"hf_assets_path": "hf"},
    ("--checkpoint.enable",): {"checkpoint.enable": True},
    ("--checkpoint.no-enable",): {"checkpoint.enable": False},
    ("--checkpoint.interval", "7"): {"checkpoint.interval": "7"},
    ("--checkpoint.load_step=3",): {"checkpoint.load_step": "3"},
    ("--checkpoint.keep-latest-k", "2"): {"checkpoint.keep_latest_k": "2"},
    ("--checkpoint.no-last_save_model_only",): {"checkpoint.last_save_model_only": False},
    ("--validation.enable",): {"validator.enable": True},
    ("--validation.no-enable",): {"validator.enable": False},
    ("--validation.freq", "5"): {"validator.freq": "5"},
    ("--validation.steps", "-1"): {"validator.steps": "-1"},
    ("--validation.local_batch_size", "3"): {"validator.microbatch_size": "3"},
    ("--metrics.log_freq", "2"): {"metrics.log_freq": "2"},
    ("--lr_scheduler.warmup_steps", "1"): {"lr_scheduler.warmup_steps": "1"},
    ("--lr_scheduler.total_steps", "9"): {"lr_scheduler.total_steps": "9"},
    ("--lr_scheduler.decay_ratio", "0.5"): {"lr_scheduler.decay_ratio": "0.5"},
    ("--lr_scheduler.decay_type", "cosine"): {"lr_scheduler.decay_type": "cosine"},
    ("--lr_scheduler.min_lr_factor", "0.1"): {"lr_scheduler.min_lr_factor": "0.1"},
    ("--comm.init_timeout_seconds", "60"): {"comm.init_timeout_seconds": "60"},
    ("--comm.train_timeout_seconds", "61"): {"comm.train_timeout_seconds": "61"},
    ("--comm.trace_buf_size", "5"): {"comm.trace_buf_size": "5"},
    ("--comm.save_traces_folder", "ct"): {"comm.save_traces_folder": "ct"},
    ("--comm.save_traces_file_prefix", "r"): {"comm.save_traces_file_prefix": "r"},
    ("--comm.mode", "fake_backend"): {"comm.mode": "fake_backend"},
    ("--debug.seed", "5"): {"debug.seed": "5"},
    ("--debug.no-deterministic",): {"debug.deterministic": False},
    ("--debug.deterministic_warn_only",): {"debug.deterministic_warn_only": True},
    ("--debug.moe_force_load_balance",): {"debug.moe_force_load_balance": True},
    ("--job.print_config",): {"debug.print_config": True},
    ("--training.dataloader.num_workers", "2"): {"dataloader.num_workers": "2"},
    ("--parallelism.enable_async_tensor_parallel",): {"compile.enable_async_tensor_parallel": True},
    ("--profiling.profile_freq", "4"): {"profiler.profile_freq": "4"},
    ("--optimizer.lr", "0.1"): {"optimizer.param_groups.0.optimizer_kwargs.lr": "0.1"},
    ("--optimizer.beta2", "0.99"): {"optimizer.param_groups.0.optimizer_kwargs.betas": (0.9, 0.99)},
    ("--zephon.allow_changes", "seed,store"): {"zephon.allow_changes": ["seed", "store"]},
    ("--zephon.cache-dir", "c"): {"zephon.cache_dir": "c"},
    ("--zephon.no-start_over",): {"zephon.start_over": False},
    ("--parallelism.module_fqns_per_model_part", "a,b", "c"): {
        "parallelism.module_fqns_per_model_part": [["a", "b"], ["c"]]
    },
    ("--activation_checkpoint.mode", "full"): {"activation_checkpoint": "full"},
}


@pytest.mark.parametrize("argv", list(EXPECTED), ids=lambda a: " ".join(a))
def test_command_line_spelling_maps(argv):
    t = translate(list(argv))
    assert t.values() == EXPECTED[argv]
    assert all(s.origin == "command line" for s in t.settings)


def test_the_issue_sections_map_whole():
    # every key of these sections maps to the same name in the 0.3 section
    for section in ("lr_scheduler", "comm", "debug", "zephon", "checkpoint", "training"):
        for key, entry in TABLE.items():
            if key.startswith(section + ".") and key not in REFUSED_IN_THESE_SECTIONS:
                if not key.startswith("training.dataloader."):
                    assert (entry.kind, entry.path) == ("map", key), key
    for key, entry in TABLE.items():
        if key.startswith("parallelism.") and key not in REFUSED_IN_THESE_SECTIONS:
            assert entry.kind == "map", key
    assert {k for k in REFUSED_IN_THESE_SECTIONS if TABLE[k].kind != "refused"} == set()


REFUSED_IN_THESE_SECTIONS = {
    "training.dataset",
    "training.dataset_path",
    "checkpoint.enable_ft_dataloader_checkpoints",
    "parallelism.disable_loss_parallel",
    "parallelism.pipeline_parallel_expert_parallel_overlap",
    "parallelism.context_parallel_rotate_method",
    "parallelism.expert_tensor_parallel_degree",
    "parallelism.expert_parallel_comm_backend",
}


def test_the_03_spelling_is_accepted_and_means_the_same():
    assert translate(["--validator.no-enable", "--dump_folder", "d"]).values() == {
        "validator.enable": False,
        "dump_folder": "d",
    }
    # a 0.2.2 key that is also a mapped path maps onto itself: the two spellings never clash
    targets = {e.path: k for k, e in TABLE.items() if e.kind == "map"}
    for key in set(targets) & set(TABLE):
        assert TABLE[key].kind == "map" and TABLE[key].path == key, key


def test_model_selection_and_subsumed_keys():
    t = translate_toml(str(ROOT / "train_configs/debug_model.toml"))
    assert (t.model, t.model_name, t.flavor) == ("llama3", "zephon_llama3", "small")
    assert t.description == "Llama 3 small debug training on the builtin Zephon store"
    assert {s.key for s in t.consumed} == {"job.description", "job.custom_config_module"}
    t = translate(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"])
    assert (t.model, t.flavor, t.settings) == ("deepseek_v3", "debugmodel", ())
    assert translate(["--job.custom_config_module", CONFIG_MODULE]).settings == ()


# --- refusals: exact messages -----------------------------------------------------


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_unknown_toml_key_names_key_file_and_close_match(tmp_path):
    path = _toml(tmp_path, "[validation]\nfrq = 3\n")
    with pytest.raises(TomlConfigError) as e:
        translate_toml(path)
    assert str(e.value) == (
        f"Unknown key validation.frq in TOML file {path}. Did you mean validation.freq?"
    )


def test_unknown_option_names_close_matches_with_dashes():
    with pytest.raises(TomlConfigError) as e:
        translate(["--checkpoint.intervall", "3"])
    assert str(e.value) == (
        "Unknown option --checkpoint.intervall on the command line. "
        "Did you mean --checkpoint.interval?"
    )
    with pytest.raises(TomlConfigError) as e:
        translate(["--no-validation.enable"])
    assert str(e.value) == (
        "Unknown option --no-validation.enable on the command line. "
        "A flag is turned off as --validation.no-enable."
    )
    with pytest.raises(TomlConfigError, match="No known key is spelled like it"):
        translate(["--zzz.qqq", "1"])


def test_key_without_equivalent_names_key_file_and_reason(tmp_path):
    path = _toml(tmp_path, "[parallelism]\nexpert_tensor_parallel_degree = 2\n")
    with pytest.raises(TomlConfigError) as e:
        translate_toml(path)
    assert str(e.value) == (
        f"parallelism.expert_tensor_parallel_degree = 2 in TOML file {path} has no equivalent "
        "in TorchTitan 0.3: expert tensor parallelism (ETP) was removed (only 1, its 0.2.2 "
        "default, is accepted); remove it."
    )
    with pytest.raises(TomlConfigError) as e:
        translate(["--training.dataset", "c4"])
    assert str(e.value) == (
        "--training.dataset c4 on the command line has no equivalent in TorchTitan 0.3: "
        "Zephon reads zephon.store (or zephon.mixture); remove it."
    )


def test_a_noop_value_of_a_removed_key_is_accepted_and_reported(tmp_path):
    path = _toml(tmp_path, "[parallelism]\nexpert_tensor_parallel_degree = 1\n")
    t = translate_toml(path)
    assert t.settings == ()
    assert [(s.key, s.value, s.origin) for s in t.consumed] == [
        ("parallelism.expert_tensor_parallel_degree", 1, f"TOML file {path}")
    ]


def test_renamed_and_foreign_keys_give_the_new_spelling(tmp_path):
    path = _toml(tmp_path, '[model]\ntokenizer_path = "tok"\n')
    with pytest.raises(TomlConfigError) as e:
        translate_toml(path)
    assert str(e.value) == (
        f"model.tokenizer_path in TOML file {path} is now model.hf_assets_path "
        "(0.2.2 had deprecated it); rename it."
    )
    path = _toml(tmp_path, '[job]\ncustom_config_module = "my.module"\n')
    with pytest.raises(TomlConfigError) as e:
        translate_toml(path)
    assert str(e.value).startswith(
        f"job.custom_config_module = 'my.module' in TOML file {path}: TorchTitan 0.3 has no "
        "custom config modules; a job is a config registry function (--module M --config FN"
    )
    with pytest.raises(TomlConfigError) as e:
        translate(["--activation_checkpoint.selective_ac_option", "2"])
    assert "its selective activation checkpointing is per-op" in str(e.value)
    with pytest.raises(TomlConfigError) as e:
        translate(["--model.name", "gpt9"])
    assert str(e.value).startswith(
        "--model.name gpt9 on the command line is not a model Zephon trains; expected one of"
    )


def test_bad_flag_spellings_and_values(tmp_path):
    with pytest.raises(TomlConfigError) as e:
        translate(["--checkpoint.enable=false"])
    assert str(e.value) == (
        "--checkpoint.enable on the command line is a flag and takes no value: spell "
        "--checkpoint.enable to turn it on, --checkpoint.no-enable to turn it off."
    )
    path = _toml(tmp_path, '[checkpoint]\nenable = "yes"\n')
    with pytest.raises(TomlConfigError) as e:
        translate_toml(path)
    assert str(e.value) == f"checkpoint.enable = 'yes' in TOML file {path}: expected true or false."
    with pytest.raises(TomlConfigError) as e:
        translate(["--training.steps"])
    assert (
        str(e.value)
        == "--training.steps on the command line needs a value: --training.steps VALUE."
    )
    with pytest.raises(TomlConfigError) as e:
        translate(["--job.config_file", str(tmp_path / "missing.toml")])
    assert str(e.value).startswith(
        f"The config file {tmp_path / 'missing.toml'} (--job.config_file) does not exist"
    )


# --- TOML + command line, parsed by tyro against the real 0.3 config ---------------


def test_command_line_wins_over_toml():
    argv = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml")]
    t = translate(
        argv + ["--training.steps", "3", "--validation.no-enable", "--optimizer.beta1=0.8"]
    )
    steps = [s for s in t.settings if s.path == "training.steps"]
    assert [(s.value, s.origin) for s in steps] == [
        (40, f"TOML file {ROOT / 'train_configs/debug_model.toml'}"),
        ("3", "command line"),
    ]
    assert t.values()["training.steps"] == "3" and t.values()["validator.enable"] is False
    config = _parse(t.tyro_args())
    assert config.training.steps == 3 and config.validator.enable is False
    assert config.optimizer.param_groups[0].optimizer_kwargs["betas"] == (0.8, 0.95)
    assert config.training.seq_len == 128  # from the TOML


@pytest.mark.parametrize(
    "name",
    ["debug_model.toml", "llama3_8b.toml", "mixture_example.toml", "../tests/titan/tiny.toml"],
)
def test_repo_toml_translates_fully_and_parses(name):
    path = ROOT / "train_configs" / name
    t = translate_toml(str(path))
    accounted = (
        {s.key for s in t.settings} | {s.key for s in t.consumed} | {"model.name", "model.flavor"}
    )
    assert set(_toml_keys(path)) == accounted
    base = _base()
    check_against(base, t)
    config = _parse(t.tyro_args(base), base)
    for s in t.settings:
        if s.path == "activation_checkpoint":
            want = {"none": type(None), "selective": SelectiveAC.Config, "full": FullAC.Config}
            assert type(config.activation_checkpoint) is want[s.value]
        else:
            assert _get(config, s.path) == s.value, s


def test_tyro_spelling_of_flags_lists_and_tuples():
    t = translate(
        [
            "--validation.no-enable",
            "--checkpoint.enable",
            "--compile.components",
            "model",
            "--checkpoint.exclude_from_loading",
            "optimizer,lr_scheduler",
            "--zephon.allow_changes",
            "seed",
            "--parallelism.module_fqns_per_model_part",
            "tok,layers.0",
            "layers.1,norm,output",
            "--optimizer.beta1",
            "0.8",
            "--optimizer.beta2",
            "0.9",
            "--zephon.store",
            "",
            "--activation_checkpoint.preserve_rng_state",
        ]
    )
    base = _base()
    args = t.tyro_args(base)
    assert args == [
        "--validator.no-enable",
        "--checkpoint.enable",
        "--compile.components", "model",
        "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler",
        "--zephon.allow_changes", "seed",
        "--parallelism.module_fqns_per_model_part", "tok,layers.0", "layers.1,norm,output",
        "--optimizer.param_groups.0.optimizer_kwargs.betas", "0.8", "0.9",
        "--zephon.store", "",
        "activation-checkpoint:selective",  # the base config's mode: tyro needs the subcommand
        "--activation_checkpoint.preserve_rng_state",
    ]  # fmt: skip
    config = _parse(args, base)
    assert config.validator.enable is False and config.checkpoint.enable is True
    assert config.compile.components == ["model"]
    assert config.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler"]
    assert config.zephon.allow_changes == ["seed"]
    assert config.parallelism.module_fqns_per_model_part == [
        ["tok", "layers.0"],
        ["layers.1", "norm", "output"],
    ]
    assert config.optimizer.param_groups[0].optimizer_kwargs["betas"] == (0.8, 0.9)
    assert isinstance(config.activation_checkpoint, SelectiveAC.Config)


def test_activation_checkpoint_mode_selects_the_03_class():
    for mode, cls in [("full", FullAC.Config), ("none", type(None))]:
        t = translate(["--activation_checkpoint.mode", mode, "--training.steps", "2"])
        config = _parse(t.tyro_args())
        assert type(config.activation_checkpoint) is cls and config.training.steps == 2
    t = translate(
        [
            "--activation_checkpoint.mode",
            "memory_budget",
            "--activation_checkpoint.memory_budget",
            "0.3",
            "--compile.enable",
        ]
    )
    config = _parse(t.tyro_args())
    assert config.activation_checkpoint.memory_budget == 0.3
    t = translate(["--activation_checkpoint.debug"])
    with pytest.raises(TomlConfigError, match="without activation_checkpoint.mode"):
        t.tyro_args()
    with pytest.raises(TomlConfigError, match="has no activation checkpointing"):
        t.tyro_args(_base(activation_checkpoint=None))


def test_an_empty_list_is_left_to_the_base_or_refused():
    t = translate(["--zephon.allow_changes", ""])
    assert t.values() == {"zephon.allow_changes": []}
    base = _base()
    assert t.tyro_args(base) == []  # the base holds [] already
    assert _parse(t.tyro_args(base), base).zephon.allow_changes == []
    t = translate(["--compile.components", ""])
    with pytest.raises(TomlConfigError) as e:
        t.tyro_args(base)  # base: ["model", "loss"]
    assert str(e.value) == (
        "--compile.components '' on the command line: TorchTitan 0.3's command line cannot "
        "spell an empty list for compile.components, and the selected config does not hold "
        "one; set it in the config registry function, or remove the key."
    )


def test_check_against_refuses_a_config_without_the_path():
    t = translate(["--validation.local_batch_size", "2"])
    check_against(_base(), t)
    with pytest.raises(TomlConfigError) as e:
        check_against(llama3_debugmodel(), t)  # stock 0.3 validator: no microbatch_size
    assert str(e.value) == (
        "--validation.local_batch_size on the command line maps to validator.microbatch_size, "
        "but the selected config has no validator.microbatch_size (found Validator.Config) "
        "(Zephon's validator config (0.2.2: validation.local_batch_size) has it); choose a "
        "config that has it, or remove the key."
    )
