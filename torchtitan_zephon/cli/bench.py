"""``zephon bench SUITE``: the data path measured side by side with stock TorchTitan.

Suites: loader, step, resume, scale, prepare, mixture, remote, accounting, ft, packing (see
``torchtitan_zephon.bench``),
or ``all``, which runs every suite and writes ``docs/bench_results.json``.
Each suite prints a table (``--json``: one JSON object instead) and, with
``--out``, saves the JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from torchtitan_zephon.bench import SUITES
from torchtitan_zephon.cli.args import int_in, positive_float

ALL_OUT = "docs/bench_results.json"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark the data path against stock TorchTitan",
        description=(
            "Measure the Zephon data path and stock TorchTitan side by side, in one run on "
            "this machine: loader tokens/s, restore time and state size (loader), training "
            "steps/s and data wait (step), cold start to first batch (resume), per-rank plan "
            "cost vs world size (scale), tokenization throughput (prepare), many sources vs "
            "one store (mixture), a store in a loopback bucket at 0/20/50 ms per request vs "
            "local disk (remote), the per-source accounting's cost on a step (accounting), "
            "replica groups under torchft against a whole-job restart and TorchTitan's "
            "torchft sharding (ft), whole-document packing against windows and first-fit "
            "(packing), one rank reading a virtual 10^13-token corpus from a loopback bucket "
            "against a real store of 10^6 documents (corpus). "
            f"`all` runs every suite and writes {ALL_OUT}."
        ),
    )
    p.add_argument(
        "suite", choices=[*SUITES, "all"], metavar="SUITE", help=" | ".join([*SUITES, "all"])
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    p.add_argument(
        "--out", metavar="FILE.json", help=f"save the JSON here (all: default {ALL_OUT})"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes (smoke test, not a measurement)"
    )
    p.add_argument(
        "--seconds",
        type=positive_float,
        help="measuring time per loader (loader, mixture, packing)",
    )
    p.add_argument(
        "--seq-len",
        dest="seq_len",
        type=int_in(1),
        help="tokens per sample (loader, resume, mixture)",
    )
    p.add_argument("--batch", type=int_in(1), help="local batch size (loader, resume, mixture)")
    p.add_argument("--workers", type=int_in(0), help="loader workers for the second round (loader)")
    p.add_argument("--steps", type=int_in(1), help="training steps per run (step)")
    p.add_argument(
        "--nproc",
        type=int_in(1, max(8, 4 * (os.cpu_count() or 1))),
        help="ranks per training run (step; at most 4 per CPU)",
    )
    p.add_argument("--levels", help="comma-separated audit levels to run, of off,ids,tokens (step)")
    p.add_argument(
        "--reproducible",
        metavar="RANKS",
        help="comma-separated rank counts at which to run the job with and without "
        "zephon.reproducible (step; default 1,2, --quick 1; 'none': skip)",
    )
    p.add_argument(
        "--slow",
        action="store_true",
        help="also the slow cases (scale: a 10,000,000-step sequence log, written once and cached)",
    )
    return p


def machine() -> dict[str, Any]:
    import numpy
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": _version("torchtitan"),
        "numpy": numpy.__version__,
        "load_average": round(os.getloadavg()[0], 2),
    }


def _version(package: str) -> str | None:
    """The installed version of ``package`` (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run_suite(name: str, opts: dict[str, Any]) -> dict[str, Any]:
    module = importlib.import_module(f"torchtitan_zephon.bench.{name}")
    t0 = time.perf_counter()
    result = module.run(opts)
    result["bench_seconds"] = round(time.perf_counter() - t0, 2)
    result["machine"] = machine()
    return result


def print_table(name: str, result: dict[str, Any]) -> None:
    module = importlib.import_module(f"torchtitan_zephon.bench.{name}")
    rows = [(str(a), str(b), str(c)) for a, b, c in module.rows(result)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    title = f"zephon bench {name}  ({result['bench_seconds']:.0f} s, {os.cpu_count()} CPUs)"
    print(title)
    print("-" * len(title))
    for a, b, c in rows:
        print(f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c}".rstrip())
    print()


def run(args: argparse.Namespace) -> int:
    opts = {
        k: getattr(args, k)
        for k in (
            "quick",
            "seconds",
            "seq_len",
            "batch",
            "workers",
            "steps",
            "nproc",
            "levels",
            "reproducible",
            "slow",
        )  # fmt: skip
    }
    names = SUITES if args.suite == "all" else [args.suite]
    results = {}
    for name in names:
        results[name] = run_suite(name, opts)
        if not args.json:
            print_table(name, results[name])
            sys.stdout.flush()
    skipped = results[args.suite].get("skipped") if args.suite != "all" else None
    if skipped:  # a suite asked for by name that cannot run here: say why, exit 1
        print(f"zephon bench {args.suite}: not run: {skipped}", file=sys.stderr)
        return 1
    if args.suite == "all":
        output: dict[str, Any] = {
            "command": "zephon bench all" + (" --quick" if args.quick else ""),
            "machine": machine(),
            "suites": results,
        }
    else:
        output = results[args.suite]
    out = args.out or (ALL_OUT if args.suite == "all" else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(output, indent=2, sort_keys=True) + "\n")
        if not args.json:
            print(f"saved {out}")
    if args.json:
        print(json.dumps(output, sort_keys=True))
    return 0
