"""Entry point: ``python -m torchtitan_zephon.train --job.config_file FILE [--section.key value ...]``.

TorchTitan's own ``main`` with the Zephon trainer. The platform layer runs first
(on a machine without an accelerator it switches TorchTitan to CPU + gloo), the
``zephon_*`` train specs are registered, and the ``[zephon]`` config section is
added unless the command line or TOML already names a custom config module.
"""

from __future__ import annotations

import sys

from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.config import CONFIG_MODULE


def _with_zephon_config(argv: list[str]) -> list[str]:
    if any(
        a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module")
        for a in argv
    ):
        return argv
    config_file = None
    for i, a in enumerate(argv):
        if a.startswith(("--job.config_file=", "--job.config-file=")):
            config_file = a.split("=", 1)[1]
        elif a in ("--job.config_file", "--job.config-file") and i + 1 < len(argv):
            config_file = argv[i + 1]
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


def main() -> None:
    # Before torchtitan is imported: its ConfigManager.parse_args binds sys.argv[1:]
    # as a default argument at import time.
    sys.argv[1:] = _with_zephon_config(sys.argv[1:])
    platform.apply()
    from torchtitan.train import main as titan_main

    from torchtitan_zephon.data.state import DataStateMismatch
    from torchtitan_zephon.ownership import FolderInUse
    from torchtitan_zephon.titan.preflight import StartRefused
    from torchtitan_zephon.titan.spec import register
    from torchtitan_zephon.titan.trainer import ZephonTrainer
    from torchtitan_zephon.tracker import TrackerError

    refusals = (StartRefused, FolderInUse, DataStateMismatch, TrackerError)

    register()
    try:
        titan_main(ZephonTrainer)
    except refusals as e:  # a refused start: the message says it all, no traceback
        from torchtitan.tools.logging import logger

        logger.error(f"Zephon refused to start: {type(e).__name__}: {e}")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
