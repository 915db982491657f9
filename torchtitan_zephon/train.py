"""Entry point: ``python -m torchtitan_zephon.train --module M --config FN [--section.key value ...]``
or ``python -m torchtitan_zephon.train --job.config_file F.toml [--section.key value ...]``.

TorchTitan 0.3's own entry point (``torchtitan.train``) with Zephon's trainer:
``--module torchtitan_zephon.configs --config llama3_debug`` (Zephon's registry),
or any TorchTitan registry (``--module llama3 --config llama3_debugmodel``), whose
dataloader and validator are replaced by Zephon's (the log says so). tyro
parses the overrides into ``ZephonTrainer.Config``.

Without ``--module`` / ``--config``, the command line is TorchTitan 0.2.2's (the
TOML front end, what ``run_train.sh`` runs): ``configs.toml_front`` translates
the TOML file and the ``--section.key`` overrides (0.2.2 spellings, or the 0.3
spelling of a mapped path) through one table (``configs.toml_table``);
``model.name`` / ``model.flavor`` pick the job they are set on (``configs.TOML_JOBS``),
the command line wins over the file, and a key without a 0.3 equivalent is refused
before anything runs.

The config managers that read both command lines live in
``configs.command_line`` (importable from here too). Order: every relative
path option on the command line is made absolute
(``resolve_paths``) against ``$ZEPHON_LAUNCH_DIR`` (the folder ``run_train.sh`` was
run from) or the working directory; the platform layer runs (on a machine without
an accelerator it switches TorchTitan to CPU + gloo); the registry function's
config becomes Zephon's (``configs.stock_config.zephon_config``) and gets the CPU defaults
(``platform.cpu_config_defaults``) *before* tyro parses, so an explicit flag wins;
after it, the chunked loss's chunk count is fitted to ``training.seq_len``
(``titan.settings.loss_chunks``: refused only when ``--loss.num_chunks`` is given),
and the settings no flag can ask of a CPU are mapped (``platform.cpu_parsed_settings``).

Invariant: a refused start or a stopped job (the Zephon errors whose message says
it all, and an unknown ``--module`` / ``--config``) ends the worker with exit
status 1 and one message, never a traceback: logged, written as the worker's
torchelastic error file (so torchrun's summary names it as the root cause
instead of "To enable traceback see: ..."), and, first worker only, to
``$ZEPHON_ERROR_FILE`` when set (``run_train.sh`` prints it again after
torchrun's summary). Any other exception propagates as it is.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # a worker process: see ``exit_quickly``
    gc.disable()

import fcntl
import json
import os
import sys
import time
from typing import NoReturn

from torchtitan_zephon.configs.command_line import (  # noqa: F401  (importable from here)
    PATH_OPTIONS,
    option_name,
    parse_config,
    parse_toml,
    resolve_paths,
    toml_front_end,
    unknown_options,
)
from torchtitan_zephon.titan import platform

LAUNCH_DIR = "ZEPHON_LAUNCH_DIR"
"""Environment: the folder relative command-line paths are taken from (run_train.sh)."""
ERROR_FILE = "ZEPHON_ERROR_FILE"
"""Environment: a file the first worker that refuses or stops writes its message to."""


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
    platform.apply()
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_zephon.order.data_config import DataStateMismatch
    from torchtitan_zephon.run.lock import FolderInUse
    from torchtitan_zephon.store.format import StoreError, error_kind
    from torchtitan_zephon.titan.components.trainer import JobStopped, SettingRefused
    from torchtitan_zephon.titan.settings.loss_chunks import fit_loss_chunks
    from torchtitan_zephon.titan.start.decision import StartRefused
    from torchtitan_zephon.tracker import TrackerError

    refusals = (StartRefused, FolderInUse, DataStateMismatch, TrackerError, StoreError)
    gc.freeze()  # the imports' objects live as long as the process: see ``exit_quickly``

    init_logger()
    try:
        config = parse_toml(argv) if toml_front_end(argv) else parse_config(argv)
        explicit = any(option_name(a) == "loss.num_chunks" for a in argv)
        note = fit_loss_chunks(config, explicit=explicit)  # after --training.seq_len
        if note:
            logger.info(f"Zephon: {note}")
        for change in platform.cpu_parsed_settings(config):  # what no flag can ask of a CPU
            if int(os.environ.get("RANK", "0")) == 0:
                logger.info(f"CPU platform: {change}")
    except (ValueError, ImportError) as e:  # a TOML key 0.3 cannot carry (TomlConfigError),
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


def exit_quickly() -> None:
    """A worker's process costs: automatic garbage collection is off from its first
    import until TorchTitan's trainer takes it over (its ``GarbageCollection`` turns it
    off again and collects every ``training.gc_freq`` steps), which saves ~0.7 s of
    imports. Once the trainer's modules are imported, ``main`` freezes what they made
    (it lives as long as the process), so no collection traverses torch's and
    TorchTitan's objects again: TorchTitan's initial collection took ~1 s a process
    without it. At exit one full collection finalizes every unreachable object (files
    are flushed and closed as before), then the survivors are frozen, so the
    interpreter's teardown does not traverse them either (~1.7 s a process on a CPU
    core)."""
    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    try:
        main()
    finally:
        exit_quickly()
