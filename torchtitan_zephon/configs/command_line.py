"""The command line as a job config: TorchTitan 0.3's config managers, made Zephon's.

Role: ``parse_config`` reads ``--module M --config FN [overrides]`` (a registry job,
made Zephon's by ``stock_config`` and given the CPU defaults before tyro parses, so an
explicit flag wins); ``parse_toml`` reads TorchTitan 0.2.2's command line
(``--job.config_file F.toml`` and ``--section.key`` overrides, through
``toml_front``'s one table onto the job ``TOML_JOBS`` picks);
``toml_front_end`` says which of the two a command line is; ``resolve_paths`` makes
every relative path option absolute against the folder the command was run in;
``unknown_options`` names an option the job's config has no field for, in one line.
The entry point (``torchtitan_zephon.train``) calls them.

Invariant: an unknown option is one line naming it and the closest valid spelling
(tyro's box held back); any other tyro failure shows tyro's own words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
from pathlib import Path
from typing import Any

from torchtitan_zephon.titan import platform

PATH_OPTIONS = frozenset(
    {
        "job.config_file",  # 0.2.2 spellings (the TOML front end)
        "job.dump_folder",
        "model.hf_assets_path",
        "dump_folder",
        "hf_assets_path",
        "checkpoint.initial_load_path",
        "dataloader.dataset_path",
        "parallelism.pipeline_parallel_schedule_csv",
        "zephon.store",
        "zephon.mixture",
        "zephon.cache_dir",
        "zephon.exclude",
    }
)
"""Options whose value is a path TorchTitan or Zephon opens relative to the working
directory. Not here: paths TorchTitan takes inside the dump folder
(checkpoint.folder, metrics.save_tb_folder, profiler.*_folder,
comm.save_traces_folder, debug.save_config_file)."""


def option_name(arg: str) -> str:
    """The option an argument names, ``--hf-assets-path=x`` -> ``hf_assets_path`` ("" for
    a value)."""
    key = arg.split("=", 1)[0]
    return key[2:].replace("-", "_") if key.startswith("--") else ""


def _absolute(option: str, value: str, base: Path) -> str:
    if not value or os.path.isabs(value):
        return value
    if option == "zephon.store":  # raw inputs: each relative item of a comma list
        from torchtitan_zephon.order.mixture.config import rebase

        return rebase(value, base)
    return str(base / value)


def resolve_paths(argv: list[str], base: str | os.PathLike) -> list[str]:
    """``argv`` with the relative value of every ``PATH_OPTIONS`` option (``--key value``
    or ``--key=value``, ``_`` or ``-`` in the key) joined to ``base``; ``zephon.store``
    keeps ``builtin:...`` and rebases each relative item of a comma list (as a mixture
    file's stores are rebased on the file's folder)."""
    base = Path(base)
    out = list(argv)
    for i, arg in enumerate(out):
        key, eq, value = arg.partition("=")
        option = option_name(arg)
        if option not in PATH_OPTIONS:
            continue
        if eq:
            out[i] = f"{key}={_absolute(option, value, base)}"
        elif i + 1 < len(out) and not out[i + 1].startswith("--"):
            out[i + 1] = _absolute(option, out[i + 1], base)
    return out


LIST_OPTIONS = ("zephon.allow_changes",)
"""Options whose value is a list: given as ``--key A B``, ``--key A --key B`` or
``--key A,B`` on either front end, all mean ``[A, B]`` (``merge_list_options``)."""


def merge_list_options(argv: list[str]) -> list[str]:
    """``argv`` with every ``LIST_OPTIONS`` option's values (after each of its flags,
    up to the next option, or after ``=``; comma lists split) as one ``--key A,B`` where
    the option first stood: repeating the flag adds to the list, and several values
    follow one flag, on both front ends (tyro would keep the last flag, and the TOML front
    end takes one value)."""
    out: list[str | tuple[str, list[str]]] = []
    lists: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        option = option_name(argv[i])
        if option not in LIST_OPTIONS:
            out.append(argv[i])
            i += 1
            continue
        _, eq, value = argv[i].partition("=")
        values, i = ([value], i + 1) if eq else ([], i + 1)
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if option not in lists:
            lists[option] = []
            out.append((option, lists[option]))
        lists[option] += [v for text in values for v in text.split(",") if v]
    merged: list[str] = []
    for item in out:
        if isinstance(item, tuple):
            merged += [f"--{item[0]}", ",".join(item[1])] if item[1] else [f"--{item[0]}"]
        else:
            merged.append(item)
    return merged


def parse_config(argv: list[str]) -> Any:
    """``--module M --config FN [overrides]`` as ``ZephonTrainer.Config``: TorchTitan's
    ConfigManager, with the registry function's config made Zephon's (logged) and
    adjusted for the platform before tyro parses the overrides."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import logger

    from torchtitan_zephon.configs.stock_config import zephon_config

    argv = merge_list_options(argv)
    loaded: list[Any] = []

    class ZephonConfigManager(ConfigManager):
        def _load_config(self, args: list[str]) -> tuple[object, list[str]]:
            base, rest = super()._load_config(args)
            config, notes = zephon_config(base)
            for note in notes:
                logger.info(f"Zephon: {note}")
            for change in platform.cpu_config_defaults(config):
                logger.info(f"CPU platform: {change}")
            loaded.append(config)
            return config, rest

    return _tyro(
        lambda: ZephonConfigManager().parse_args(argv),
        lambda: unknown_options(argv, loaded[0]) if loaded else None,
    )


def _tyro(parse: Any, unknown: Any) -> Any:
    """``parse()``, with tyro's words shown unless what failed is said in one line: an
    unknown option (``unknown()``), or a value a config section refuses (TorchTitan's
    ``ValueError`` in a box, e.g. ``checkpoint.keep_latest_k = 1``)."""
    told = io.StringIO()
    try:
        with contextlib.redirect_stderr(told):
            config = parse()
    except SystemExit as e:
        said = (unknown() or refused_value(told.getvalue())) if e.code else None
        if said is None:  # --help, or a failure tyro's words say best
            sys.stderr.write(told.getvalue())
            raise
        raise ValueError(said) from None
    except BaseException:
        sys.stderr.write(told.getvalue())
        raise
    sys.stderr.write(told.getvalue())
    return config


HINTS = {
    "We need to maintain at least 2 checkpoint replicas": (
        "checkpoint.keep_latest_k = 1: TorchTitan keeps at least 2 checkpoints (the newest "
        "may still be being written). Set --checkpoint.keep_latest_k 2 or more, or 0 to keep "
        "every checkpoint."
    ),
}
"""What to do, for a refusal of TorchTitan's whose words do not name the setting."""


def refused_value(told: str) -> str | None:
    """One line for tyro's "Value error" box (a config section's ``__post_init__``
    refused a value), None for any other failure."""
    if "Value error" not in told:
        return None
    lines = [ln.strip().strip("│").strip() for ln in told.splitlines()]
    start = next(i for i, ln in enumerate(lines) if "Value error" in ln) + 1
    body = []
    for ln in lines[start:]:
        if not ln or ln.startswith(("─", "╰")):
            break
        body.append(ln)
    text = " ".join(body).removeprefix("Error parsing ")
    section, _, why = text.partition(": ")
    hint = next((h for k, h in HINTS.items() if k in why), None)
    return hint or f"a --{section}.* setting is refused by TorchTitan: {why or text}"


def _leaf_paths(node: Any, prefix: str = "") -> set[str]:
    """Every settable leaf path of a config (``section.key``; nested dataclasses walked)."""
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return {prefix[:-1]}
    out: set[str] = set()
    for f in dataclasses.fields(node):
        if f.init and f.name != "model_spec":
            out |= _leaf_paths(getattr(node, f.name, None), f"{prefix}{f.name}.")
    return out


def unknown_options(argv: list[str], config: Any) -> str | None:
    """One line naming the first ``--section.key`` of ``argv`` that ``config`` has no
    field for, with the closest valid spelling (TorchTitan 0.2.2's spelling of a 0.3
    path through ``toml_table.TABLE``, else the closest path); None when every
    option names a field (tyro failed for another reason)."""
    import difflib

    from torchtitan_zephon.configs.toml_table import TABLE

    paths = _leaf_paths(config)
    sections = {p.split(".", 1)[0] for p in paths}
    for arg in argv:
        key = option_name(arg)
        if not key or key in ("module", "config", "help", "h") or key in paths:
            continue
        head, _, leaf = key.rpartition(".")
        if leaf.startswith("no_") and f"{head}.{leaf[3:]}".lstrip(".") in paths:
            continue  # a boolean flag's negation
        if key in sections or any(p.startswith(f"{key}.") for p in paths):
            continue  # a whole section (tyro's subcommand-like options)
        if any(key.startswith(f"{p}.") for p in paths):
            continue  # under a field whose type a subcommand picks (activation_checkpoint)
        entry = TABLE.get(key)
        if entry is not None and entry.kind == "map" and entry.path in paths:
            close = [entry.path]
        else:
            close = difflib.get_close_matches(key, sorted(paths), n=1, cutoff=0.6)
        hint = f"; did you mean --{close[0]}?" if close else "; `--help` lists the options."
        return (
            f"unknown option {arg.split('=', 1)[0]}: the job's config has no {key}{hint} "
            "(TorchTitan 0.3 spellings with --module / --config)"
        )
    return None


def toml_front_end(argv: list[str]) -> bool:
    """Whether ``argv`` is a 0.2.2 command line (no ``--module`` / ``--config``)."""
    return not any(option_name(a) in ("module", "config") for a in argv)


def parse_toml(argv: list[str]) -> Any:
    """A 0.2.2 command line (``--job.config_file F`` and ``--section.key`` overrides) as
    ``ZephonTrainer.Config``: translated by ``toml_front`` onto the job that
    ``model.name`` / ``model.flavor`` select (0.2.2's defaults: llama3, "debugmodel"),
    adjusted for the platform, then parsed by tyro (TOML values first, the command
    line's after them). Raises ``TomlConfigError`` for what cannot be carried."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import logger

    from torchtitan_zephon.configs.config_registry import TOML_JOBS
    from torchtitan_zephon.configs.toml_front import (
        TomlConfigError,
        check_against,
        translate,
    )

    argv = merge_list_options(argv)
    config_file = _last_config_file(argv)
    if config_file is not None and not os.path.isfile(config_file):
        raise TomlConfigError(
            f"--job.config_file {config_file} is not a file; expected a TOML job config (e.g. "
            "train_configs/debug_model.toml of the repository). A relative path is taken from "
            "the folder the command was run in."
        )
    t = translate(argv)
    family, flavor = t.model or "llama3", t.flavor or "debugmodel"
    named = f"model.name {t.model_name!r}" if t.model_name else "model.name (unset: llama3)"
    job = TOML_JOBS.get(family)
    if job is None:
        raise TomlConfigError(
            f"{named} selects the {family} family, which has no TOML job yet; expected one of "
            f"{', '.join(map(repr, TOML_JOBS))}, or run a config function: --module "
            "torchtitan_zephon.configs --config FN."
        )
    try:
        base = job(flavor)
    except ValueError as e:
        raise TomlConfigError(f"model.flavor {flavor!r} ({named}): {e}.") from None
    check_against(base, t)
    args = t.tyro_args(base)
    consumed = ", ".join(s.key for s in t.consumed) or "none"
    logger.info(
        f"Zephon: TOML front end: {config_file or 'no --job.config_file'}; {named}, model.flavor "
        f"{flavor!r} -> {family} {flavor!r}; {len(t.settings)} key(s) translated onto the 0.3 "
        f"config, consumed: {consumed}"
    )
    if t.description:
        logger.info(f"Zephon: job description: {t.description}")

    class TomlConfigManager(ConfigManager):
        def _load_config(self, rest: list[str]) -> tuple[object, list[str]]:
            for change in platform.cpu_config_defaults(base):
                logger.info(f"CPU platform: {change}")
            return base, rest

    return _tyro(lambda: TomlConfigManager().parse_args(args), lambda: None)


def _last_config_file(argv: list[str]) -> str | None:
    """The last ``--job.config_file`` (the one the translation reads)."""
    found = None
    for i, a in enumerate(argv):
        if option_name(a) != "job.config_file":
            continue
        if "=" in a:
            found = a.split("=", 1)[1]
        elif i + 1 < len(argv):
            found = argv[i + 1]
    return found
