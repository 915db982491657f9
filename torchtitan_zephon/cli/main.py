"""The ``zephon`` command: dispatches to one module per subcommand.

Role: parse the command line and run a subcommand. Each subcommand lives in
``torchtitan_zephon/cli/<name>.py`` and exposes ``add_parser(subparsers)`` and
``run(args) -> int``; register a new one by adding its module name to
``COMMANDS``.

Invariant: bad input never produces a traceback: it prints
``zephon <cmd>: error: <message>`` on stderr and exits with status 2 (argparse's
usage errors too; ``main(argv)`` returns the status instead of exiting). Errors
are classified where they are raised: the data engine, run readers and
subcommands raise ValueError subclasses (StoreError, RunError, ...) or OSError
(a missing file; a prepare worker that died is a ChildProcessError), which this
module reports. tests/cli/test_fuzz.py holds every subcommand to this.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from torchtitan_zephon import __version__

# Subcommand modules under torchtitan_zephon.cli, in help order.
COMMANDS = ["prepare", "inspect", "plan", "show", "where", "spikes", "verify", "compare", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon",
        description="Zephon: elastically deterministic data for TorchTitan.",
    )
    parser.add_argument("--version", action="version", version=f"zephon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"torchtitan_zephon.cli.{name}")
        sub_parser = module.add_parser(sub)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``zephon`` with ``argv`` (default: sys.argv[1:]); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed usage and the error (2), or --help (0)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except (ValueError, OSError) as e:  # StoreError, RunError, DataStateMismatch; WorkerLost
        print(f"zephon {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # prepare's says where its finished work is kept
        note = f". {e}" if str(e) else ""
        print(f"zephon {args.command}: interrupted{note}", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The ``zephon`` process (console script, ``python -m torchtitan_zephon``): exit
    with ``main``'s status. A process that used object storage exits without the
    interpreter's teardown (streams flushed, then ``os._exit``): obstore's runtime
    threads can still be running then, and tearing the interpreter down under them
    aborted about one such exit in ten (SIGABRT, after the command's own output)."""
    rc = main()
    from torchtitan_zephon.store.location import object_storage_used

    if object_storage_used():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing to flush
                pass
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    run()
