"""Raw inputs in object storage, and a prepared store written to it.

Role: an input URL (``s3://bucket/corpus/*.jsonl.gz``, a prefix, one object, a
comma-separated list of them) becomes sources (``inputs.InputFile`` with ``remote``
set) by one listing: ``list_inputs``. An object is read by the local readers from a
spool file on node-local disk (``fetch``: streamed there a chunk at a time, so
memory stays bounded by ``object_client.DOWNLOAD_CHUNK``; the disk holds the objects a
rank reads, removed by ``release`` once the store is written). ``check_output`` and
``upload_store`` are ``prepare --output URL``'s: the prefix must hold no store, and
the store's files are uploaded with manifest.json last.

Invariants:
- The objects an input names, and their order, are what ``inputs.expand_input``
  gives the same files on local disk: one object as itself; a prefix walked as a
  folder (key order, hidden names skipped, prefixes holding a store skipped); a glob
  pattern matched component by component (``*`` never crosses ``/``, ``**`` spans
  prefixes, hidden names only match a pattern component that starts with a dot),
  matches in key order. So a store prepared from a bucket has the fingerprint of the
  store prepared from the same files locally.
- A spool file is ``<spool>/<sha256 of URL, ETag and size>/<base name>``: written
  under a temporary name and renamed when complete (a killed download is never read),
  read with ``If-Match`` its ETag (an object replaced while read is an error), its
  modification time the object's (so every rank sees the same input identity).
- A prefix that holds a manifest.json is never written to; one that holds other
  objects than a store's files (left by an interrupted upload) is refused as a
  non-empty local output folder is. manifest.json is uploaded last: until it is
  there, the prefix holds no store (``TokenStore.open`` says so).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import uuid
from pathlib import Path

from torchtitan_zephon.ingest.input_file import GLOB_CHARS, InputFile, RemoteObject, kind_of
from torchtitan_zephon.store.format import (
    MANIFEST,
    SHARD_FOLDER,
    SHARDS,
    STORE_FILES,
    StoreError,
)
from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.shards import shard_name
from torchtitan_zephon.store.urls import ObjectURL, parse_url, redact

SPOOL = "remote-inputs"
"""The cache's folder of spool files (objects being read by a prepare)."""
OUTPUT = "remote-output"
"""The store cache's folder of stores ``prepare --output URL`` builds before uploading."""
_HF_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
CHANGED_INPUT = (
    "An input object must stay put while prepare reads it: run the same command again "
    "once it does (finished parts are reused; the object is read as it is then)."
)


def is_object_url(value: str) -> bool:
    """True for an object-storage URL (``file://`` URLs are local paths)."""
    from torchtitan_zephon.store.urls import is_url

    return is_url(value) and not value.lower().startswith("file://")


def _split(value: str) -> tuple[ObjectURL, str]:
    """(the URL of the fixed prefix, the pattern below it: '' for no pattern)."""
    text, query = (value.split("?", 1) + [""])[:2]
    scheme, rest = text.split("://", 1)
    bucket, _, path = rest.partition("/")
    path = path.strip("/")
    cut = min((path.find(c) for c in GLOB_CHARS if c in path), default=-1)
    base, pattern = (path, "") if cut < 0 else (path[: path.rfind("/", 0, cut) + 1], path)
    base = base.strip("/")
    if cut >= 0:
        pattern = path[len(base) :].lstrip("/")
    checked = parse_url(value, "input", pattern=True)  # scheme, credentials, bucket
    assert isinstance(checked, ObjectURL)
    url = f"{scheme}://{bucket}/{base}" + (f"?{query}" if query else "")
    return ObjectURL(checked.scheme, bucket, base, url), pattern


def _matches(parts: list[str], pattern: list[str]) -> bool:
    """Whether the key components ``parts`` match the glob components ``pattern``."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":  # any number of components; at the end, at least one (a file)
        return any(
            _matches(parts[k:], rest)
            for k in range(0 if rest else 1, len(parts) + 1)
            if not any(p.startswith(".") for p in parts[:k])
        )
    if not parts or (parts[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _matches(parts[1:], rest)


def _listing(url: ObjectURL) -> list[dict]:
    files = ObjectFiles(url)
    try:
        return files.listing()
    finally:
        files.close()


def _head(url: ObjectURL, name: str) -> dict | None:
    """The listing entry of the one object ``name`` under ``url`` (None: there is none)."""
    from torchtitan_zephon.store.object_faults import MissingBucket, MissingObject

    files = ObjectFiles(url)
    try:
        size = files.open_file(name)
    except MissingBucket:
        raise
    except MissingObject:
        return None
    finally:
        files.close()
    return {
        "name": name,
        "size": size,
        "e_tag": files.etags.get(name),
        "mtime_ns": files.mtimes.get(name, 0),
    }


def _walkable(names: list[str]) -> list[str]:
    """The names of a prefix walked as a folder: hidden components skipped, and the
    objects of a prefix holding a store (a manifest.json) skipped."""
    stores = {posixpath.dirname(n) for n in names if posixpath.basename(n) == MANIFEST}
    out = []
    for n in names:
        parts = n.split("/")
        if any(p.startswith(".") for p in parts) or n.endswith("/"):
            continue
        if any("/".join(parts[:k]) in stores for k in range(len(parts))):
            continue
        out.append(n)
    return out


def list_inputs(value: str, spool: Path) -> list[tuple[str, InputFile]]:
    """(the object's place as ``/scheme/bucket/key``, its source, not yet named) for every
    object the input URL ``value`` (or each URL of a comma-separated list) names, in the
    order a local folder walk or glob gives the same files; spool files under ``spool``."""
    out: list[tuple[str, InputFile]] = []
    for piece in [p.strip() for p in value.split(",")]:
        if not piece:
            raise StoreError(
                f"input {redact(value)!r} has an empty item between commas; expected a "
                "comma-separated list of URLs."
            )
        url, pattern = _split(piece)
        listed = _listing(url)
        by_name = {m["name"]: m for m in listed}
        if pattern:
            chosen = [n for n in by_name if _matches(n.split("/"), pattern.split("/"))]
            if not chosen:
                raise StoreError(
                    f"input pattern {redact(piece)!r} matches no object ({len(listed)} "
                    f"under {url.shown}/); expected a glob pattern of text/JSONL/Parquet "
                    "objects (hidden names match only a pattern that starts with a dot)."
                )
        elif listed:  # a prefix: walked as a folder
            if MANIFEST in by_name:
                raise StoreError(
                    f"input {redact(piece)!r} is a token store (made by zephon prepare), not "
                    f"raw text; train on it as it is (--zephon.store {redact(piece)}), or "
                    "prepare the raw files it was made from."
                )
            chosen = _walkable(list(by_name))
        else:  # one object, or nothing
            parent = ObjectURL(
                url.scheme, url.bucket, posixpath.dirname(url.prefix),
                url.text.replace(url.prefix, posixpath.dirname(url.prefix), 1),
            )  # fmt: skip
            one = _head(parent, posixpath.basename(url.prefix)) if url.prefix else None
            if one is None:
                raise StoreError(
                    f"input {redact(piece)!r} holds no object (nothing is stored under it); "
                    "expected a text/JSONL/Parquet object, a prefix of them or a glob pattern."
                )
            url, chosen, by_name = parent, [one["name"]], {one["name"]: one}
        hf = [n for n in chosen if posixpath.basename(n) in _HF_FILES]
        if hf:
            raise StoreError(
                f"input {redact(piece)!r} holds a Hugging Face dataset folder "
                f"({posixpath.dirname(hf[0]) or url.shown}); prepare reads those from local "
                "disk only: copy it there, or export it as JSONL/Parquet objects."
            )
        for n in sorted(chosen, key=lambda n: n.split("/")):
            m = by_name[n]
            key = f"{url.prefix}/{n}" if url.prefix else n
            obj = RemoteObject(
                scheme=url.scheme,
                bucket=url.bucket,
                prefix=url.prefix,
                url=url.text,
                shown=url.child(n),
                name=n,
                size=m["size"],
                e_tag=m["e_tag"],
                mtime_ns=m["mtime_ns"],
            )
            digest = hashlib.sha256(
                f"{url.scheme}://{url.bucket}/{key}\0{m['e_tag']}\0{m['size']}".encode()
            ).hexdigest()[:32]
            path = spool / digest / posixpath.basename(n)
            out.append(
                (f"/{url.scheme}/{url.bucket}/{key}", InputFile("", path, kind_of(n), remote=obj))
            )
    return out


def fetch(src: InputFile) -> None:
    """Stream the object of a remote source to its spool file, unless it is there."""
    obj = src.remote
    if obj is None or (src.path.is_file() and src.path.stat().st_size == obj.size):
        return
    src.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = src.path.parent / f".{src.path.name}.{uuid.uuid4().hex}.tmp"
    files = ObjectFiles(ObjectURL(obj.scheme, obj.bucket, obj.prefix, obj.url))
    try:
        files.download(obj.name, tmp, obj.size, obj.e_tag, redo=CHANGED_INPUT)
        os.utime(tmp, ns=(obj.mtime_ns, obj.mtime_ns))
        os.replace(tmp, src.path)
    finally:
        files.close()
        tmp.unlink(missing_ok=True)


def release(sources: list[InputFile]) -> None:
    """Remove the spool files of remote sources (after the store is written)."""
    for src in sources:
        if src.remote is not None:
            src.path.unlink(missing_ok=True)
            try:
                src.path.parent.rmdir()
            except OSError:
                pass


def output_url(value: str) -> ObjectURL:
    """The checked URL of ``prepare --output URL`` (no pattern, a bucket and a prefix)."""
    found = parse_url(value, "--output")
    assert isinstance(found, ObjectURL)
    return found


def check_output(url: ObjectURL) -> None:
    """Refuse an output prefix that holds a store, or objects that are not a store's
    files (what a non-empty local output folder is); a prefix holding only a store's
    files without manifest.json (an interrupted upload) is written over."""
    names = [m["name"] for m in _listing(url)]
    if MANIFEST in names:
        raise StoreError(
            f"output {url.shown} already holds a token store (manifest.json); choose another "
            "prefix or delete it first."
        )
    other = [n for n in names if n not in STORE_FILES and not n.startswith(f"{SHARD_FOLDER}/")]
    if other:
        shown = ", ".join(repr(n) for n in other[:5])
        raise StoreError(
            f"output {url.shown} already exists: it holds {len(other)} object(s) ({shown}); "
            "choose another prefix or delete them first."
        )


def upload_shards(folder: Path, url: ObjectURL, rank: int, world_size: int) -> None:
    """Upload this rank's shards of the sharded store ``folder`` (shard k is rank k mod
    ``world_size``'s: each rank writes whole shards of its own) under ``url``; none for a
    one-file store. Before ``upload_store``, which writes shards.json and the manifest."""
    if not (folder / SHARDS).is_file():
        return
    count = len(json.loads((folder / SHARDS).read_text())["tokens"])
    files = ObjectFiles(url)
    try:
        for k in range(rank, count, world_size):
            files.upload(shard_name(k), folder / shard_name(k))
    finally:
        files.close()


def upload_store(folder: Path, url: ObjectURL) -> None:
    """Upload the store files of ``folder`` under ``url``, manifest.json last (a sharded
    store's shards first: ``upload_shards``)."""
    files = ObjectFiles(url)
    try:
        for name in STORE_FILES:
            if (folder / name).is_file():
                files.upload(name, folder / name)
    finally:
        files.close()
