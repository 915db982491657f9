"""``zephon inspect PATH``: say what a path is and summarise it.

Dispatches on the kind of path through ``KINDS``: a list of
``(kind, detect(path) -> bool, describe(path) -> dict)``. Other kinds
(checkpoint folders, run folders) are added by appending to ``KINDS``.

A store also takes ``--check`` (hash all its content; list each bad chunk; exit
1 when anything is wrong, 0 when intact) and ``--upgrade`` (add content
checksums to a format-1 store in place, keeping its fingerprint).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_zephon.cli.inspect_run import RUN_KINDS
from torchtitan_zephon.data.store import TokenStore, UncheckedStoreWarning, is_store, upgrade_store


def _describe_store(path: Path) -> dict[str, Any]:
    with warnings.catch_warnings():  # said in the summary instead
        warnings.simplefilter("ignore", UncheckedStoreWarning)
        return TokenStore.open(path).describe()


def _content_line(info: dict[str, Any]) -> str:
    if info["chunk_tokens"] is None:
        return (
            f"none (format {info['format_version']}): reads are not checked; add checksums with "
            f"`zephon inspect {info['path']} --upgrade`"
        )
    return (
        f"{info['num_chunks']:,} chunks of {info['chunk_tokens']:,} tokens (xxh3 each), "
        f"max token id {info['max_token_id']:,}"
    )


def _format_store(info: dict[str, Any]) -> str:
    lines = [
        f"token store: {info['path']}",
        f"  fingerprint: {info['fingerprint']}",
        f"  tokens:      {info['num_tokens']:,}",
        f"  documents:   {info['num_documents']:,}",
        f"  dtype:       {info['dtype']}",
        f"  vocab size:  {info['vocab_size']:,} (eos id {info['eos_id']})",
        f"  checksums:   {_content_line(info)}",
        f"  tokenizer:   sha256 {info['tokenizer_sha256']}",
        f"  text field:  {info['text_field']}",
        f"  sources ({len(info['sources'])}):",
    ]
    shown = info["sources"][:20]
    for s in shown:
        lines.append(
            f"    {s['name']}  [{_kind(s)}] {s['size']:,} bytes, {s.get('documents', '?')} docs, "
            f"{s.get('tokens', '?')} tokens, sha256 {s['sha256'][:16]}"
        )
    if len(info["sources"]) > len(shown):
        lines.append(f"    ... and {len(info['sources']) - len(shown)} more (see --json)")
    if "upgrade" in info:
        lines.append(f"  upgrade:     {info['upgrade']}")
    check = info.get("check")
    if check and check["ok"]:
        lines.append(
            f"  check:       intact ({check['chunks']:,} chunks, max token id "
            f"{check['max_token_id']:,})"
        )
    elif check:
        lines.append(f"  check:       FAILED, {len(check['problems'])} problem(s):")
        lines.extend(f"    {problem}" for problem in check["problems"])
    return "\n".join(lines)


def _kind(source: dict[str, Any]) -> str:
    """A source's kind, with the splits read for a DatasetDict: "hf, split train"."""
    splits = source.get("splits")
    if not splits:
        return source["kind"]
    return f"{source['kind']}, split{'s' if len(splits) > 1 else ''} {', '.join(splits)}"


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
    p.add_argument(
        "--check",
        action="store_true",
        help="store: hash all token content, list bad chunks; exit 1 unless intact",
    )
    p.add_argument(
        "--upgrade",
        action="store_true",
        help="store of format 1: add content checksums in place (the fingerprint stays)",
    )
    return p


def _store_actions(path: Path, args: argparse.Namespace) -> int:
    """``inspect STORE [--upgrade] [--check]``: the exit status (1 when a check fails)."""
    upgrade = None
    if args.upgrade:
        changed = upgrade_store(path)[1]
        upgrade = "content checksums added, fingerprint unchanged" if changed else "nothing to do"
    info = _describe_store(path)
    if upgrade:
        info["upgrade"] = upgrade
    report = None
    if args.check:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UncheckedStoreWarning)
            report = TokenStore.open(path).check()
        info["check"] = report.to_dict()
    print(json.dumps(info, indent=2) if args.json else _format_store(info))
    return 1 if report is not None and not report.ok else 0


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.exists():
        raise ValueError(
            f"{str(path)!r} does not exist; expected a token store, a checkpoint folder "
            "(checkpoint/step-N) or a run folder (job.dump_folder)."
        )
    for kind, detect, describe, fmt in KINDS:
        if detect(path):
            if kind == "store":
                return _store_actions(path, args)
            if args.check or args.upgrade:
                raise ValueError(
                    f"--check and --upgrade apply to token stores; {str(path)!r} is a {kind} "
                    "folder. A store is a folder with manifest.json made by `zephon prepare`."
                )
            info = describe(path)
            print(json.dumps(info, indent=2) if args.json else fmt(info))
            return 0
    known = ", ".join(k for k, *_ in KINDS)
    raise ValueError(
        f"{str(path)!r} is not something zephon recognises (known kinds: {known}); a token "
        "store is a folder with manifest.json made by `zephon prepare`."
    )
