"""What a store cache folder holds, for ``zephon inspect CACHE``.

Role: tell a cache folder from any other folder (``is_cache``) and list what it holds
(``describe_cache``): its stores (builtin parts, raw-input entries with what they were
prepared from), builds in progress or kept after a failure (with their finished tokenized units),
lock files (held or free), the folders object storage keeps there (the node cache
``remote-blocks``, prepare's ``remote-inputs`` spool and ``remote-output`` stores) and
anything else, each with its size in bytes. It reads the
names ``cache_folder.build_once`` and ``cache.raw_store`` give what they write
(``builtin-*``, ``raw-*`` and its ``raw-*.json`` record, ``.<work>.building``,
``<work>.lock``).

Invariant: it only reads: nothing in the folder changes, and a lock is probed by a
shared lock taken and dropped at once, never held (a builder waiting on it retries).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.cache import read_manifest
from torchtitan_zephon.ingest.cache_folder import cache_root
from torchtitan_zephon.store.format import StoreError, is_store


def is_cache(path: Path) -> bool:
    """Whether ``path`` is a store cache folder: the configured one (``cache_root()``),
    or a folder holding entries, builds or locks named as this module names them."""
    if not path.is_dir():
        return False
    try:
        if path.resolve() == cache_root().resolve():
            return True
        return any(_cache_kind(p) not in ("other", "record") for p in path.iterdir())
    except OSError:
        return False


def _remote_folders() -> dict[str, str]:
    """The folders object storage keeps in the store cache, and what each holds."""
    from torchtitan_zephon.ingest.objects import OUTPUT, SPOOL
    from torchtitan_zephon.store.cache import FOLDER

    return {
        FOLDER: "the node cache of blocks read from object storage (zephon.cache_bytes), "
        "one folder per store fingerprint and block size; bounded by cache_bytes, safe to "
        "delete when no job reads through it",
        SPOOL: "spool files of raw objects a prepare is reading; removed when it ends, left "
        "only by one killed: safe to delete when no prepare runs",
        OUTPUT: "stores `zephon prepare --output URL` built here to upload; removed once "
        "uploaded, left by a failed upload: safe to delete when no prepare runs",
    }


def _cache_kind(p: Path) -> str:
    name = p.name
    if p.is_dir() and name in _remote_folders():
        return "remote"
    if p.is_dir() and name.startswith(("builtin-", "raw-")) and is_store(p):
        return "builtin" if name.startswith("builtin-") else "raw"
    if p.is_dir() and name.startswith(".") and ".building" in name:
        return "building"
    if p.is_file() and name.startswith(("builtin-", "raw-")) and name.endswith(".lock"):
        return "lock"
    if p.is_file() and name.startswith("raw-") and name.endswith(".json"):
        return "record"
    return "other"


def _size(path: Path) -> int:
    """Bytes of the files under ``path`` (or of the file)."""
    try:
        if not path.is_dir():
            return path.lstat().st_size
        total = 0
        for folder, _, files in os.walk(path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(folder, f)).st_size
                except OSError:
                    pass
        return total
    except OSError:
        return 0


def _holder_of(lock: Path) -> str | None:
    """Who holds the lock file ``lock`` (its holder line), or None when it is free. A
    shared lock taken and dropped at once tells (a builder waiting on it retries)."""
    try:
        with open(lock) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return fh.read().strip() or "another process"
            except OSError:  # no locks on this filesystem: nobody can hold it
                return None
            fcntl.flock(fh, fcntl.LOCK_UN)
            return None
    except OSError:
        return None


def describe_cache(root: Path) -> dict[str, Any]:
    """What the cache folder ``root`` holds, for ``zephon inspect``: its stores (builtin,
    raw inputs with what they were prepared from), builds in progress or kept after a
    failure (with their finished tokenized units), lock files (held or free), anything else;
    every item with its size in bytes. Reads only (a lock is probed, never held)."""
    from torchtitan_zephon.ingest.tokenized import finished_units, staging_folder

    items: dict[str, list[dict[str, Any]]] = {
        "builtin": [], "raw": [], "building": [], "locks": [], "remote": [], "other": []
    }  # fmt: skip
    children = sorted(root.iterdir(), key=lambda p: p.name)
    names = {p.name for p in children}
    for p in children:
        kind = _cache_kind(p)
        item: dict[str, Any] = {"name": p.name, "size_bytes": _size(p)}
        if kind in ("builtin", "raw"):
            try:
                manifest = read_manifest(p)
            except StoreError:
                manifest = {}
            item.update(
                fingerprint=manifest.get("fingerprint"),
                tokens=manifest.get("num_tokens"),
                documents=manifest.get("num_documents"),
            )
            if kind == "builtin":
                part = p.name[len("builtin-") :].rpartition("-")[0]
                item["part"] = part or "all"
            else:
                item.update(_raw_origin(p, manifest))
                item["size_bytes"] += _size(root / f"{p.name}.json")  # its record, if any
        elif kind == "record":
            if p.name[: -len(".json")] in names:
                continue  # shown with its entry
            kind = "other"
        elif kind == "building":
            work = p.name[1:].split(".building")[0]
            lock = root / f"{work}.lock"
            holder = _holder_of(lock) if lock.is_file() and p.name.endswith(".building") else None
            item.update(
                work=work,
                parts=finished_units(staging_folder(p / "store")),
                holder=holder,
                shared=p.name.endswith(".building"),
                sources=_building_sources(staging_folder(p / "store")),
            )
        elif kind == "lock":
            item["holder"] = _holder_of(p)
        elif kind == "remote":
            item["what"] = _remote_folders()[p.name]
            item["files"] = sum(len(files) for _, _, files in os.walk(p))
        items["locks" if kind == "lock" else kind].append(item)
    return {
        "kind": "cache",
        "path": str(root),
        "size_bytes": sum(i["size_bytes"] for group in items.values() for i in group),
        **items,
    }


def _building_sources(staging: Path) -> list[str]:
    """The names of the sources a build prepares (its prepare's identity file), if known."""
    from torchtitan_zephon.ingest.tokenized import RANKS_FILE

    try:
        identity = json.loads((staging / RANKS_FILE).read_text())
        return [str(row[0]) for row in identity["sources"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return []


def _raw_origin(entry: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What a raw entry was prepared from: its record beside it, else its manifest."""
    try:
        record = json.loads((entry.parent / f"{entry.name}.json").read_text())
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict):
        record = {}
    sources = record.get("sources") or manifest.get("sources") or []
    return {
        "inputs": record.get("inputs"),
        "text_field": record.get("text_field", manifest.get("text_field")),
        "sources": [
            {k: s.get(k) for k in ("name", "kind", "size", "splits") if k in s}
            for s in sources
            if isinstance(s, dict)
        ],
    }
