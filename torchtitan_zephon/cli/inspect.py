"""``zephon inspect PATH``: say what a path is and summarise it.

Dispatches on the kind of path through ``KINDS``: a list of
``(kind, detect(path) -> bool, describe(path) -> dict)``. Other kinds
(checkpoint folders, run folders) are added by appending to ``KINDS``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_zephon.cli.inspect_run import RUN_KINDS
from torchtitan_zephon.data.store import TokenStore, is_store


def _describe_store(path: Path) -> dict[str, Any]:
    return TokenStore.open(path).describe()


def _format_store(info: dict[str, Any]) -> str:
    lines = [
        f"token store: {info['path']}",
        f"  fingerprint: {info['fingerprint']}",
        f"  tokens:      {info['num_tokens']:,}",
        f"  documents:   {info['num_documents']:,}",
        f"  dtype:       {info['dtype']}",
        f"  vocab size:  {info['vocab_size']:,} (eos id {info['eos_id']})",
        f"  tokenizer:   sha256 {info['tokenizer_sha256']}",
        f"  text field:  {info['text_field']}",
        f"  sources ({len(info['sources'])}):",
    ]
    shown = info["sources"][:20]
    for s in shown:
        lines.append(
            f"    {s['name']}  [{s['kind']}] {s['size']:,} bytes, {s.get('documents', '?')} docs, "
            f"{s.get('tokens', '?')} tokens, sha256 {s['sha256'][:16]}"
        )
    if len(info["sources"]) > len(shown):
        lines.append(f"    ... and {len(info['sources']) - len(shown)} more (see --json)")
    return "\n".join(lines)


# (kind, detect, describe, format for humans)
KINDS: list[tuple[str, Callable[[Path], bool], Callable[[Path], dict], Callable[[dict], str]]] = [
    ("store", is_store, _describe_store, _format_store),
    *RUN_KINDS,  # checkpoint folders, then run folders
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect", help="describe a store (or checkpoint / run folder)", description=__doc__
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.exists():
        raise ValueError(
            f"{str(path)!r} does not exist; expected a token store, a checkpoint folder "
            "(checkpoint/step-N) or a run folder (job.dump_folder)."
        )
    for _kind, detect, describe, fmt in KINDS:
        if detect(path):
            info = describe(path)
            print(json.dumps(info, indent=2) if args.json else fmt(info))
            return 0
    known = ", ".join(k for k, *_ in KINDS)
    raise ValueError(
        f"{str(path)!r} is not something zephon recognises (known kinds: {known}); a token "
        "store is a folder with manifest.json made by `zephon prepare`."
    )
