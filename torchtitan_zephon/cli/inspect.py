"""``zephon inspect PATH``: say what a path is and summarise it.

Dispatches on the kind of path through ``KINDS``: a list of
``(kind, detect(path) -> bool, describe(path) -> dict)``. Other kinds
(checkpoint folders, run folders, the store cache) are added by appending to
``KINDS``. A store cache (``ZEPHON_CACHE``) lists its stores (builtin, raw inputs
with what they were prepared from), builds in progress or kept after a failure,
lock files (held or free) and anything else, each with its size.

PATH may be the URL of a store in object storage (``s3://BUCKET/PREFIX``, ``gs://``,
``az://``; ``file://`` is a local path): it is opened with the checks of a local store
(its fingerprint is the local original's) and described, with what opening fetched.

A store also takes ``--check`` (hash all its content; list each bad chunk; exit
1 when anything is wrong, 0 when intact) and ``--upgrade`` (add content
checksums to a format-1 store, and block checksums to any store, in place, keeping
its fingerprint; ``--block-tokens N`` rewrites block checksums of another size).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_zephon.cli.args import int_in
from torchtitan_zephon.cli.inspect_run import RUN_KINDS
from torchtitan_zephon.ingest.cache_contents import describe_cache, is_cache
from torchtitan_zephon.job.packing import check_beside
from torchtitan_zephon.migrate.old_stores import add_block_checksums, upgrade_store
from torchtitan_zephon.store.format import (
    BLOCK_TOKENS,
    BLOCKS,
    BLOCKS_INFO,
    MAX_BLOCK_TOKENS,
    StoreError,
    UncheckedStoreWarning,
    is_store,
    num_blocks,
)
from torchtitan_zephon.store.opening import read_blocks_info
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.urls import is_url, parse_url, redact, refuse_mistyped_url


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


def _block_line(info: dict[str, Any]) -> str:
    size = info["block_tokens"]
    if size is None:
        return (
            "none: reads from object storage check whole chunks; add block checksums with "
            f"`zephon inspect {info['path']} --upgrade`"
        )
    return (
        f"{num_blocks(info['num_tokens'], size):,} block checksums of {size:,} tokens (reads "
        "from object storage fetch whole blocks: best when seq_len is a multiple)"
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
        *([f"  blocks:      {_block_line(info)}"] if "block_tokens" in info else []),
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
    if "fetched_bytes" in info:
        what = (
            "the manifest, the checksums and, for --check, every token"
            if "check" in info
            else "the manifest and checksums: opening reads no tokens"
        )
        lines.append(
            f"  fetched:     {info['fetched_bytes']:,} bytes in {info['requests']} requests "
            f"({what})"
        )
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


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} bytes"


def _format_cache(info: dict[str, Any]) -> str:
    lines = [f"store cache: {info['path']} ({_size(info['size_bytes'])} in all)"]

    def group(title: str, items: list[dict[str, Any]], line: Callable[[dict], str]) -> None:
        if items:
            lines.append(f"  {title} ({len(items)}):")
            lines.extend(
                f"    {item['name']}  {_size(item['size_bytes'])}, {line(item)}" for item in items
            )

    def store(item: dict[str, Any]) -> str:
        tokens = f"{item['tokens']:,}" if isinstance(item.get("tokens"), int) else "?"
        return f"{tokens} tokens, fingerprint {(item.get('fingerprint') or '?')[:16]}"

    def raw(item: dict[str, Any]) -> str:
        sources = item.get("sources", [])
        shown = ", ".join(
            f"{s['name']}" + (f" [split {', '.join(s['splits'])}]" if s.get("splits") else "")
            for s in sources[:5]
        )
        more = f", ... {len(sources) - 5} more" if len(sources) > 5 else ""
        inputs = item.get("inputs")
        origin = f"from {inputs!r}" if inputs else "inputs not recorded"
        return (
            f"{store(item)}, {origin} (text field {item.get('text_field')!r}; "
            f"{len(sources)} source{'s' if len(sources) != 1 else ''}: {shown}{more})"
        )

    def building(item: dict[str, Any]) -> str:
        parts = f"{item['parts']} finished part{'s' if item['parts'] != 1 else ''}"
        names = item.get("sources") or []
        if names:
            more = f", ... {len(names) - 5} more" if len(names) > 5 else ""
            parts += f" of {', '.join(names[:5])}{more}"
        if item.get("holder"):
            return f"being built now by {item['holder']} ({parts})"
        if not item.get("shared"):
            return f"a build without file locks, or left by one killed ({parts}); delete it if no job runs"
        return (
            f"left by a build that failed or was killed ({parts}): the next run of the same "
            "inputs continues from it; delete it to start over"
        )

    def lock(item: dict[str, Any]) -> str:
        if item.get("holder"):
            return f"held by {item['holder']}"
        return "free (left by a killed process or an older zephon): safe to delete"

    group("builtin stores", info["builtin"], lambda i: f"part {i['part']}, {store(i)}")
    group("stores of raw inputs", info["raw"], raw)
    group("builds", info["building"], building)
    group("locks", info["locks"], lock)
    group(
        "object storage",
        info.get("remote", []),
        lambda i: f"{i['files']} file{'s' * (i['files'] != 1)}: {i['what']}",
    )
    group("other", info["other"], lambda i: "not made by zephon's cache")
    if len(lines) == 1:
        lines.append("  empty")
    return "\n".join(lines)


# (kind, detect, describe, format for humans)
KINDS: list[tuple[str, Callable[[Path], bool], Callable[[Path], dict], Callable[[dict], str]]] = [
    ("store", is_store, _describe_store, _format_store),
    *RUN_KINDS,  # checkpoint folders, then run folders
    ("cache", is_cache, describe_cache, _format_cache),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect",
        help="describe a store (or checkpoint / run folder, or the store cache)",
        description=__doc__,
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
        help="store: add content checksums (format 1) and block checksums (for reads from "
        "object storage) in place; the fingerprint stays",
    )
    p.add_argument(
        "--block-tokens",
        type=int_in(1, MAX_BLOCK_TOKENS),
        metavar="N",
        help="with --upgrade: block checksums of N tokens (pick the jobs' seq_len or a "
        "divisor of it); blocks of another size are rewritten, the fingerprint stays "
        f"(default: keep the store's blocks; {BLOCK_TOKENS} for a store without)",
    )
    return p


def _store_actions(path: Path, args: argparse.Namespace) -> int:
    """``inspect STORE [--upgrade] [--check]``: the exit status (1 when a check fails)."""
    upgrade = None
    if args.upgrade:
        done = []
        if upgrade_store(path)[1]:
            done.append("content checksums added, fingerprint unchanged")
        before = _block_tokens(path)
        if add_block_checksums(path, args.block_tokens)[1]:
            if before is None:
                done.append(
                    f"block checksums added ({BLOCKS}, {BLOCKS_INFO}), fingerprint unchanged"
                )
            else:
                done.append(
                    f"block checksums rewritten: blocks of {args.block_tokens} tokens, were "
                    f"{before} ({BLOCKS}, {BLOCKS_INFO}), fingerprint unchanged"
                )
        upgrade = "; ".join(done) or "nothing to do"
    info = _describe_store(path)
    info["block_tokens"] = _block_tokens(path)
    if upgrade:
        info["upgrade"] = upgrade
    report = None
    if args.check:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UncheckedStoreWarning)
            store = TokenStore.open(path)
            report = store.check()
        report.problems.extend(check_beside(store))  # the packing indexes it keeps
        info["check"] = report.to_dict()
    print(json.dumps(info, indent=2) if args.json else _format_store(info))
    return 1 if report is not None and not report.ok else 0


def _block_tokens(path: Path) -> int | None:
    """The block size of the store's block checksums (None: it has none, or unusable ones,
    which ``--upgrade`` writes afresh)."""
    try:
        with warnings.catch_warnings():  # a format-1 store: said in the summary instead
            warnings.simplefilter("ignore", UncheckedStoreWarning)
            info = read_blocks_info(path, TokenStore.open(path).manifest)
    except StoreError:
        return None
    return None if info is None else int(info["block_tokens"])


def _remote_store(args: argparse.Namespace) -> int:
    """``inspect URL [--check]``: a store in object storage."""
    if args.upgrade:
        raise ValueError(
            f"--upgrade writes into a store; {redact(args.path)!r} is in object storage. "
            "Upgrade the local copy (`zephon inspect STORE --upgrade`) and upload it again: "
            "the fingerprint stays the same."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncheckedStoreWarning)
        store = TokenStore.open(args.path)
    info = store.describe()
    info["block_tokens"] = int(store.blocks["block_tokens"]) if store.blocks else None
    info["fetched_bytes"] = store.fetched_bytes
    info["requests"] = store.requests
    report = None
    if args.check:  # one pass over the whole store, fetched into memory
        report = store.check()
        info["check"] = report.to_dict()
        info["fetched_bytes"], info["requests"] = store.fetched_bytes, store.requests
    print(json.dumps(info, indent=2) if args.json else _format_store(info))
    return 1 if report is not None and not report.ok else 0


def run(args: argparse.Namespace) -> int:
    if args.block_tokens is not None and not args.upgrade:
        raise ValueError(
            f"--block-tokens {args.block_tokens} chooses the block size --upgrade writes; "
            f"add --upgrade (`zephon inspect {args.path} --upgrade --block-tokens "
            f"{args.block_tokens}`)."
        )
    refuse_mistyped_url(args.path, "PATH")
    if is_url(args.path):
        found = parse_url(args.path, "PATH")
        if not isinstance(found, str):
            return _remote_store(args)
        args.path = found
    path = Path(args.path)
    if not path.exists():
        raise ValueError(
            f"{str(path)!r} does not exist; expected a token store, a checkpoint folder "
            "(checkpoint/step-N), a run folder (job.dump_folder) or the store cache "
            "(ZEPHON_CACHE)."
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
