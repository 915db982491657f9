"""Entry point: ``python -m torchtitan_zephon.train --module M --config FN [--section.key value ...]``
or ``python -m torchtitan_zephon.train --job.config_file F.toml [--section.key value ...]``.

TorchTitan 0.3's own entry point (``torchtitan.train``) with Zephon's trainer:
``--module torchtitan_zephon.configs --config llama3_debug`` (Zephon's registry),
or any TorchTitan registry (``--module llama3 --config llama3_debugmodel``), whose
dataloader and validator are replaced by Zephon's (the log says so). tyro
parses the overrides into ``ZephonTrainer.Config``.

Without ``--module`` / ``--config``, the command line is TorchTitan 0.2.2's (the
TOML front end, what ``run_train.sh`` runs): ``titan.configs.legacy_translate`` translates
the TOML file and the ``--section.key`` overrides (0.2.2 spellings, or the 0.3
spelling of a mapped path) through one table (``titan.configs.legacy_config``);
``model.name`` / ``model.flavor`` pick the job they are set on (``configs.TOML_JOBS``),
the command line wins over the file, and a key without a 0.3 equivalent is refused
before anything runs.

Order: every relative path option on the command line is made absolute
(``resolve_paths``) against ``$ZEPHON_LAUNCH_DIR`` (the folder ``run_train.sh`` was
run from) or the working directory; the platform layer runs (on a machine without
an accelerator it switches TorchTitan to CPU + gloo); the registry function's
config becomes Zephon's (``titan.configs.stock_config.zephon_config``) and gets the CPU defaults
(``platform.cpu_config_defaults``) *before* tyro parses, so an explicit flag wins;
after it, the chunked loss's chunk count is fitted to ``training.seq_len``
(``titan.configs.loss_chunks``: refused only when ``--loss.num_chunks`` is given).

Invariant: a refused start or a stopped job (the Zephon errors whose message says
it all, and an unknown ``--module`` / ``--config``) ends the worker with exit
status 1 and one message, never a traceback: logged, written as the worker's
torchelastic error file (so torchrun's summary names it as the root cause
instead of "To enable traceback see: ..."), and, first worker only, to
``$ZEPHON_ERROR_FILE`` when set (``run_train.sh`` prints it again after
torchrun's summary). Any other exception propagates as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from torchtitan_zephon.titan import platform

LAUNCH_DIR = "ZEPHON_LAUNCH_DIR"
"""Environment: the folder relative command-line paths are taken from (run_train.sh)."""
ERROR_FILE = "ZEPHON_ERROR_FILE"
"""Environment: a file the first worker that refuses or stops writes its message to."""

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


def _option(arg: str) -> str:
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
        option = _option(arg)
        if option not in PATH_OPTIONS:
            continue
        if eq:
            out[i] = f"{key}={_absolute(option, value, base)}"
        elif i + 1 < len(out) and not out[i + 1].startswith("--"):
            out[i + 1] = _absolute(option, out[i + 1], base)
    return out


def _write_error_files(message: str) -> None:
    """The message as this worker's torchelastic error file and, if no other worker wrote
    one first, in ``$ZEPHON_ERROR_FILE``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # torchrun names the failure with the earliest timestamp (whole seconds; a tie
        # goes to the lowest rank) as the root cause. The ranks that fail only because
        # this one left (a closed gloo connection) record theirs within the same
        # second, so this one is dated a second earlier to stay the root cause.
        stamp = str(int(time.time()) - 1)
        info = {"py_callstack": message, "timestamp": stamp}
        data = {"message": {"message": message, "extraInfo": info}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass  # torchrun then says only the exit code; the log line stays
    shared = os.environ.get(ERROR_FILE)
    if shared:
        try:
            with open(shared, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                if os.fstat(f.fileno()).st_size == 0:
                    f.write(message.rstrip("\n") + "\n")
        except OSError:
            pass


def stop(message: str) -> NoReturn:
    """End this worker with ``message`` and exit status 1, without a traceback."""
    _write_error_files(message)
    from torchtitan.tools.logging import init_logger, logger

    if not logger.handlers:
        init_logger()
    logger.error(message)
    raise SystemExit(1)


def parse_config(argv: list[str]) -> Any:
    """``--module M --config FN [overrides]`` as ``ZephonTrainer.Config``: TorchTitan's
    ConfigManager, with the registry function's config made Zephon's (logged) and
    adjusted for the platform before tyro parses the overrides."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import logger

    from torchtitan_zephon.titan.configs.stock_config import zephon_config

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

    told = io.StringIO()  # tyro's words, shown unless an unknown option is told in one line
    try:
        with contextlib.redirect_stderr(told):
            config = ZephonConfigManager().parse_args(argv)
    except SystemExit as e:
        unknown = unknown_options(argv, loaded[0]) if e.code and loaded else None
        if unknown is None:  # not an unknown option (a bad value, --help)
            sys.stderr.write(told.getvalue())
            raise
        raise ValueError(unknown) from None
    except BaseException:
        sys.stderr.write(told.getvalue())
        raise
    sys.stderr.write(told.getvalue())
    return config


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
    path through ``legacy_config.TABLE``, else the closest path); None when every
    option names a field (tyro failed for another reason)."""
    import difflib

    from torchtitan_zephon.titan.configs.legacy_config import TABLE

    paths = _leaf_paths(config)
    sections = {p.split(".", 1)[0] for p in paths}
    for arg in argv:
        key = _option(arg)
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
    return not any(_option(a) in ("module", "config") for a in argv)


def parse_toml(argv: list[str]) -> Any:
    """A 0.2.2 command line (``--job.config_file F`` and ``--section.key`` overrides) as
    ``ZephonTrainer.Config``: translated by ``legacy_translate`` onto the job that
    ``model.name`` / ``model.flavor`` select (0.2.2's defaults: llama3, "debugmodel"),
    adjusted for the platform, then parsed by tyro (TOML values first, the command
    line's after them). Raises ``LegacyConfigError`` for what cannot be carried."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import logger

    from torchtitan_zephon.titan.configs.config_registry import TOML_JOBS
    from torchtitan_zephon.titan.configs.legacy_translate import (
        LegacyConfigError,
        check_against,
        translate,
    )

    config_file = _last_config_file(argv)
    if config_file is not None and not os.path.isfile(config_file):
        raise LegacyConfigError(
            f"--job.config_file {config_file} is not a file; expected a TOML job config (e.g. "
            "train_configs/debug_model.toml of the repository). A relative path is taken from "
            "the folder the command was run in."
        )
    t = translate(argv)
    family, flavor = t.model or "llama3", t.flavor or "debugmodel"
    named = f"model.name {t.model_name!r}" if t.model_name else "model.name (unset: llama3)"
    job = TOML_JOBS.get(family)
    if job is None:
        raise LegacyConfigError(
            f"{named} selects the {family} family, which has no TOML job yet; expected one of "
            f"{', '.join(map(repr, TOML_JOBS))}, or run a config function: --module "
            "torchtitan_zephon.configs --config FN."
        )
    try:
        base = job(flavor)
    except ValueError as e:
        raise LegacyConfigError(f"model.flavor {flavor!r} ({named}): {e}.") from None
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

    return TomlConfigManager().parse_args(args)


def _last_config_file(argv: list[str]) -> str | None:
    """The last ``--job.config_file`` (the one the translation reads)."""
    found = None
    for i, a in enumerate(argv):
        if _option(a) != "job.config_file":
            continue
        if "=" in a:
            found = a.split("=", 1)[1]
        elif i + 1 < len(argv):
            found = argv[i + 1]
    return found


def main() -> None:
    argv = resolve_paths(sys.argv[1:], os.environ.get(LAUNCH_DIR) or os.getcwd())
    platform.apply()
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_zephon.order.data_config import DataStateMismatch
    from torchtitan_zephon.run.lock import FolderInUse
    from torchtitan_zephon.store.format import StoreError, error_kind
    from torchtitan_zephon.titan.components.trainer import JobStopped, SettingRefused
    from torchtitan_zephon.titan.configs.loss_chunks import fit_loss_chunks
    from torchtitan_zephon.titan.start.start_plan import StartRefused
    from torchtitan_zephon.tracker import TrackerError

    refusals = (StartRefused, FolderInUse, DataStateMismatch, TrackerError, StoreError)

    init_logger()
    try:
        config = parse_toml(argv) if toml_front_end(argv) else parse_config(argv)
        explicit = any(_option(a) == "loss.num_chunks" for a in argv)
        note = fit_loss_chunks(config, explicit=explicit)  # after --training.seq_len
        if note:
            logger.info(f"Zephon: {note}")
    except (ValueError, ImportError) as e:  # a TOML key 0.3 cannot carry (LegacyConfigError),
        stop(f"Zephon refused to start: {e}")  # an unknown --module / --config
    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                stop(
                    "Zephon refused to start: --checkpoint.create_seed_checkpoint needs a "
                    "single process (no sharding); launch it with one rank"
                )
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except SettingRefused as e:  # the check's ValueError, as the check raised it
        cause = e.__cause__ or e
        stop(f"Zephon refused to start: {type(cause).__name__}: {cause}")
    except refusals as e:  # a refused start: the message says it all, no traceback
        if trainer is not None:
            trainer.close()
        stop(f"Zephon refused to start: {error_kind(e)}: {e}")
    except JobStopped as e:
        if trainer is not None:
            trainer.close()
        stop(f"Zephon stopped at step {e.step}: {e}")
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
