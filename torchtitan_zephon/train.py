"""Entry point: ``python -m torchtitan_zephon.train --module M --config FN [--section.key value ...]``.

TorchTitan 0.3's own entry point (``torchtitan.train``) with Zephon's trainer:
``--module torchtitan_zephon.configs --config llama3_debug`` (Zephon's registry),
or any TorchTitan registry (``--module llama3 --config llama3_debugmodel``), whose
dataloader and validator are replaced by Zephon's (the log says so). tyro
parses the overrides into ``ZephonTrainer.Config``.

Order: every relative path option on the command line is made absolute
(``resolve_paths``) against ``$ZEPHON_LAUNCH_DIR`` (the folder ``run_train.sh`` was
run from) or the working directory; the platform layer runs (on a machine without
an accelerator it switches TorchTitan to CPU + gloo); the registry function's
config becomes Zephon's (``trainer.zephon_config``) and gets the CPU defaults
(``platform.cpu_config_defaults``) *before* tyro parses, so an explicit flag wins.

Invariant: a refused start or a stopped job (the Zephon errors whose message says
it all, and an unknown ``--module`` / ``--config``) ends the worker with exit
status 1 and one message, never a traceback: logged, written as the worker's
torchelastic error file (so torchrun's summary names it as the root cause
instead of "To enable traceback see: ..."), and, first worker only, to
``$ZEPHON_ERROR_FILE`` when set (``run_train.sh`` prints it again after
torchrun's summary). Any other exception propagates as it is.
"""

from __future__ import annotations

import fcntl
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
        "dump_folder",
        "hf_assets_path",
        "checkpoint.initial_load_path",
        "dataloader.dataset_path",
        "parallelism.pipeline_parallel_schedule_csv",
        "zephon.store",
        "zephon.mixture",
        "zephon.cache_dir",
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

    from torchtitan_zephon.titan.trainer import zephon_config

    class ZephonConfigManager(ConfigManager):
        def _load_config(self, args: list[str]) -> tuple[object, list[str]]:
            loaded, rest = super()._load_config(args)
            config, notes = zephon_config(loaded)
            for note in notes:
                logger.info(f"Zephon: {note}")
            for change in platform.cpu_config_defaults(config):
                logger.info(f"CPU platform: {change}")
            return config, rest

    return ZephonConfigManager().parse_args(argv)


def main() -> None:
    argv = resolve_paths(sys.argv[1:], os.environ.get(LAUNCH_DIR) or os.getcwd())
    platform.apply()
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_zephon.order.data_config import DataStateMismatch
    from torchtitan_zephon.ownership.lock import FolderInUse
    from torchtitan_zephon.store.format import StoreError
    from torchtitan_zephon.titan.preflight import StartRefused
    from torchtitan_zephon.titan.trainer import JobStopped, SettingRefused
    from torchtitan_zephon.tracker import TrackerError

    refusals = (StartRefused, FolderInUse, DataStateMismatch, TrackerError, StoreError)

    init_logger()
    try:
        config = parse_config(argv)
    except (ValueError, ImportError) as e:  # --module / --config unknown or missing
        stop(f"Zephon refused to start: {e}")
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
        stop(f"Zephon refused to start: {type(e).__name__}: {e}")
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
