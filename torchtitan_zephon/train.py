"""Entry point: ``python -m torchtitan_zephon.train --job.config_file FILE [--section.key value ...]``.

TorchTitan's own ``main`` with the Zephon trainer. Before TorchTitan reads the
command line, every relative path option on it is made absolute (``resolve_paths``)
against ``$ZEPHON_LAUNCH_DIR`` (the folder ``run_train.sh`` was run from; it works
in the repository) or the working directory; paths inside TOML files are left to
TorchTitan, which takes them relative to the working directory. Then the platform
layer runs (on a machine without an accelerator it switches TorchTitan to CPU +
gloo), the ``zephon_*`` train specs are registered, and the ``[zephon]`` config
section is added unless the command line or TOML already names a custom config
module.

Invariant: a refused start or a stopped job (the Zephon errors whose message says
it all) ends the worker with exit status 1 and one message, never a traceback:
logged, written as the worker's torchelastic error file (so torchrun's summary
names it as the root cause instead of "To enable traceback see: ..."), and, first
worker only, to ``$ZEPHON_ERROR_FILE`` when set (``run_train.sh`` prints it again
after torchrun's summary). Any other exception propagates as it is.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.config import CONFIG_MODULE

LAUNCH_DIR = "ZEPHON_LAUNCH_DIR"
"""Environment: the folder relative command-line paths are taken from (run_train.sh)."""
ERROR_FILE = "ZEPHON_ERROR_FILE"
"""Environment: a file the first worker that refuses or stops writes its message to."""

PATH_OPTIONS = frozenset(
    {
        "job.config_file",
        "job.dump_folder",
        "model.hf_assets_path",
        "model.tokenizer_path",
        "checkpoint.initial_load_path",
        "training.dataset_path",
        "validation.dataset_path",
        "parallelism.pipeline_parallel_schedule_csv",
        "zephon.store",
        "zephon.mixture",
        "zephon.cache_dir",
    }
)
"""Options whose value is a path TorchTitan or Zephon opens relative to the working
directory. Not here: paths TorchTitan takes inside the dump folder
(checkpoint.folder, metrics.save_tb_folder, profiling.*_folder,
comm.save_traces_folder, job.save_config_file)."""


def _option(arg: str) -> str:
    """The option an argument names, ``--job.config-file=x`` -> ``job.config_file`` ("" for
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


def _config_file(argv: list[str]) -> str | None:
    """The last ``--job.config_file`` (tyro's rule: the last value of an option wins)."""
    found = None
    for i, a in enumerate(argv):
        if _option(a) != "job.config_file":
            continue
        if "=" in a:
            found = a.split("=", 1)[1]
        elif i + 1 < len(argv):
            found = argv[i + 1]
    return found


def _only_last_config_file(argv: list[str]) -> list[str]:
    """TorchTitan reads the TOML of the *first* ``--job.config_file`` but tyro keeps the
    last: drop the earlier ones (run_train.sh passes CONFIG_FILE before the user's
    arguments), so the file read is the one named last."""
    spots = [i for i, a in enumerate(argv) if _option(a) == "job.config_file"]
    drop: set[int] = set()
    for i in spots[:-1]:
        drop.add(i)
        if "=" not in argv[i] and i + 1 < len(argv):
            drop.add(i + 1)
    return [a for i, a in enumerate(argv) if i not in drop]


def _with_zephon_config(argv: list[str]) -> list[str]:
    if any(_option(a) == "job.custom_config_module" for a in argv):
        return argv
    config_file = _config_file(argv)
    if config_file:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        try:
            with open(config_file, "rb") as f:
                if tomllib.load(f).get("job", {}).get("custom_config_module"):
                    return argv
        except (OSError, tomllib.TOMLDecodeError):
            pass  # TorchTitan reports the bad file itself
    return [*argv, "--job.custom_config_module", CONFIG_MODULE]


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


def main() -> None:
    argv = resolve_paths(sys.argv[1:], os.environ.get(LAUNCH_DIR) or os.getcwd())
    argv = _with_zephon_config(_only_last_config_file(argv))
    # Before torchtitan is imported: its ConfigManager.parse_args binds sys.argv[1:]
    # as a default argument at import time.
    sys.argv[1:] = argv
    config_file = _config_file(argv)
    if config_file is not None and not os.path.isfile(config_file):
        stop(
            f"Zephon refused to start: --job.config_file {config_file} is not a file; expected "
            "a TOML job config (e.g. train_configs/debug_model.toml of the repository). A "
            "relative path is taken from the folder the command was run in."
        )
    platform.apply()
    from torchtitan.train import main as titan_main

    from torchtitan_zephon.order.data_config import DataStateMismatch
    from torchtitan_zephon.ownership.lock import FolderInUse
    from torchtitan_zephon.store.format import StoreError
    from torchtitan_zephon.titan.preflight import StartRefused
    from torchtitan_zephon.titan.spec import register
    from torchtitan_zephon.titan.trainer import JobStopped, SettingRefused, ZephonTrainer
    from torchtitan_zephon.tracker import TrackerError

    refusals = (StartRefused, FolderInUse, DataStateMismatch, TrackerError, StoreError)

    register()
    try:
        titan_main(ZephonTrainer)
    except SettingRefused as e:  # the check's ValueError, as the check raised it
        cause = e.__cause__ or e
        stop(f"Zephon refused to start: {type(cause).__name__}: {cause}")
    except refusals as e:  # a refused start: the message says it all, no traceback
        stop(f"Zephon refused to start: {type(e).__name__}: {e}")
    except JobStopped as e:
        stop(f"Zephon stopped at step {e.step}: {e}")


if __name__ == "__main__":
    main()
