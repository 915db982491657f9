"""Store values, and the store cache's entries of raw inputs.

Role: what a store value (the trainer's ``zephon.store``, a mixture's
``[[source]] store``) names (``names_store``; ``job.stores.store_location`` turns it
into a token store folder): ``builtin:PART`` is a builtin store (``builtin.py``);
a folder holding a store (or a file in one) is that store; anything else names
raw inputs (a file, a folder of them, a glob pattern, a comma-separated list:
``inputs.expand_input``) which ``raw_store`` prepares into the cache: it keys the
entry, has ``cache_folder.build_once`` build it on first use (once, under the
entry's lock) and checks it on every hit. What a cache folder holds is
``cache_contents``'s to say (``zephon inspect``).

Invariants:
- The store of raw inputs is ``prepare_store`` of the same value, tokenizer, text
  field and split: its fingerprint equals ``zephon prepare``'s, whatever the
  spelling of the inputs (names are canonical: ``inputs.resolve_inputs``).
- Its entry is keyed by the inputs' canonical names, real paths, sizes and
  mtimes (``os.stat`` only; raw inputs in object storage, by URL, size and ETag,
  from one listing: their objects are streamed to spool files in the cache's
  ``remote-inputs`` folder only to build the entry, then removed), the tokenizer.json's sha256, the text field, the
  splits read of each DatasetDict (only where there is one: other keys are as
  before) and the store format version: a later run finds it without reading the
  corpus, and a changed file (size or mtime) makes another entry. On a hit the
  manifest's sources (names, sizes, splits) are checked against the listing; the
  entry's ``<entry>.json`` records the inputs and their content hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.cache_folder import CACHE_ENV, Log, build_once, cache_root
from torchtitan_zephon.ingest.inputs import (
    GLOB_CHARS,
    PREPARE_OPTIONS,
    InputFile,
    OptionNames,
    expand_input,
    kind_of,
    resolve_inputs,
    select_splits,
)
from torchtitan_zephon.ingest.objects import SPOOL
from torchtitan_zephon.store.format import (
    BUILTIN_PREFIX,
    CHECKSUMS,
    DOC_OFFSETS,
    FORMAT_VERSION,
    MANIFEST,
    TOKENS,
    StoreError,
    is_store,
)
from torchtitan_zephon.store.urls import is_url, redact

STORE_FILES = (
    MANIFEST,
    TOKENS,
    DOC_OFFSETS,
    CHECKSUMS,
)  # an entry is complete when its manifest exists
"""Any of these in a folder makes it a (maybe broken) store, never raw inputs."""
RAW_KEY_FORMAT = "zephon-raw-inputs/1"


@dataclass(frozen=True)
class RawInputs:
    """How a store value that names raw inputs is prepared."""

    tokenizer: str
    """Folder holding the tokenizer.json to tokenize with."""
    text_field: str = "text"
    """The JSON / Parquet field that holds a document's text."""
    split: str = ""
    """The split of a Hugging Face DatasetDict to read (empty: train; "all": every split)."""
    names: OptionNames = PREPARE_OPTIONS
    """How the caller spells the text field and split options, in messages (the trainer:
    --zephon.text_field, --zephon.split)."""
    cache_dir: str = ""
    """The cache folder when ``$ZEPHON_CACHE`` is unset (empty: ``~/.cache``)."""
    workers: int = 1
    """Tokenizer processes of the process that prepares."""
    progress: bool = False
    """Show prepare's progress bar (in the process that prepares)."""
    log: Log | None = None
    """Where to say that this process prepares, or waits for another."""
    tokenizer_origin: str = "the tokenizer folder"
    """What set ``tokenizer``, for messages (the trainer: hf_assets_path)."""


def names_store(value: str) -> bool:
    """True when ``value`` names a token store (a builtin part, a folder holding a
    store, or a file in one) rather than raw inputs. A path that does not exist and
    is neither a pattern nor a list counts as a store (it is reported as a missing
    store)."""
    if value.startswith(BUILTIN_PREFIX):
        return True
    p = Path(value)
    if p.is_dir():
        return is_store(p) or any((p / f).exists() for f in STORE_FILES)
    if os.path.lexists(value):
        return p.name in STORE_FILES and is_store(p.parent)
    return "," not in value and not GLOB_CHARS & set(value)


def names_raw_objects(value: str) -> bool:
    """True when the object-storage URL ``value`` names raw inputs rather than a store's
    prefix: a glob pattern, a comma-separated list, or one object whose name is an
    input kind's (.jsonl, .jsonl.gz, .ndjson, .json, .parquet)."""
    path = value.split("?", 1)[0]
    if "," in path or GLOB_CHARS & set(path.split("://", 1)[-1]):
        return True
    return kind_of(path.rstrip("/").rsplit("/", 1)[-1]) != "text"


def raw_store(value: str, raw: RawInputs) -> Path:
    """The cache entry holding ``prepare_store([value], raw.tokenizer, ...)``, built
    on first use (once, under the entry's lock: ``cache_folder.build_once``)."""
    root = cache_root(raw.cache_dir)
    shown = redact(value)  # a URL's query string (a SAS token) is never printed or stored
    tokenizer_json = Path(raw.tokenizer) / "tokenizer.json"
    if not tokenizer_json.is_file():
        found = (
            f"it holds {sorted(p.name for p in Path(raw.tokenizer).iterdir())[:8]}"
            if Path(raw.tokenizer).is_dir()
            else "it does not exist"
        )
        raise StoreError(
            f"the store value {shown!r} names raw inputs, which are tokenized with the "
            f"tokenizer.json in {raw.tokenizer_origin} = {raw.tokenizer!r}, but {found}. "
            "Point it at a folder holding a Hugging Face tokenizer.json, or name a store "
            "prepared with `zephon prepare`."
        )
    sources = select_splits(resolve_inputs([value], root / SPOOL), raw.split, raw.names)
    if not sources:
        raise StoreError(
            f"the raw inputs {shown!r} hold no files (hidden names are skipped); expected "
            "text/JSONL/Parquet files or Hugging Face dataset folders."
        )
    if not is_url(value):
        _check_cache_outside(value, root)
    tokenizer_sha = hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    listing = stat_listing(sources)
    key = {
        "format": RAW_KEY_FORMAT,
        "store_version": FORMAT_VERSION,
        "tokenizer_sha256": tokenizer_sha,
        "text_field": raw.text_field,
        "files": listing,
    }
    splits = [[s.name, list(s.splits)] for s in sources if s.splits is not None]
    if splits:  # only where a DatasetDict is read: the keys of other inputs stay as they were
        key["splits"] = splits
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    out = root / f"raw-{digest[:24]}"
    # The same inputs at any sizes and mtimes: one lock and staging folder, so a build
    # after a failure (a corrupt file, since fixed) reuses the tokenized units already finished.
    key["files"] = [row[:3] for row in listing]
    work = "raw-work-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    if not (out / MANIFEST).is_file():

        def build(dest: Path, tell: Callable[[dict[str, Any]], None]) -> None:
            from torchtitan_zephon.ingest.prepare import prepare_store

            if raw.log is not None:
                raw.log(
                    f"preparing the raw inputs {shown!r} ({len(sources)} sources"
                    f"{_splits_note(sources)}) with {raw.workers} tokenizer process(es) into "
                    f"{out}"
                )
            start = time.monotonic()
            store = prepare_store(
                [value],
                raw.tokenizer,
                str(dest),
                workers=raw.workers,
                text_field=raw.text_field,
                progress=raw.progress,
                split=raw.split,
                names=raw.names,
                on_progress=tell,
                cache_dir=raw.cache_dir,
            )
            if stat_listing(sources) != listing:
                raise StoreError(
                    f"the raw inputs {shown!r} changed while they were being prepared (a "
                    "file's size or modification time); nothing was cached. Run again once "
                    "they stay put."
                )
            _check_entry(store.manifest, sources, listing, dest, shown)
            if raw.log is not None:
                raw.log(
                    f"prepared {shown!r} in {time.monotonic() - start:.1f} s: "
                    f"{store.num_tokens} tokens, fingerprint {store.fingerprint[:16]}..."
                )

        build_once(out, build, what=f"the raw inputs {shown!r}", log=raw.log, work=work)
    manifest = read_manifest(out)
    _check_entry(manifest, sources, listing, out, shown)
    if manifest.get("tokenizer", {}).get("sha256") != tokenizer_sha or (
        manifest.get("text_field") != raw.text_field
    ):
        raise _stale(out, "its tokenizer or text field differs from its key")
    _write_record(out, shown, {**key, "work": work}, manifest)
    return out


def _splits_note(sources: list[InputFile]) -> str:
    """ "; split 'train' of the DatasetDict 'dd'", for the sources that have splits."""
    read = [f"split {', '.join(s.splits)} of the DatasetDict {s.name!r}"
            for s in sources if s.splits is not None]  # fmt: skip
    return "; " + "; ".join(read) if read else ""


def _check_cache_outside(value: str, root: Path) -> None:
    """Refuse a cache folder inside an input folder (where a walk would see it): the
    cache's own files would become inputs of the next run, which never matches."""
    cache = root.resolve()
    for given in expand_input(value):
        folder = Path(given).resolve()
        if not folder.is_dir():
            continue
        try:
            inner = cache.relative_to(folder)
        except ValueError:
            continue
        if not any(part.startswith(".") for part in inner.parts):
            raise StoreError(
                f"the cache folder {root} is inside the input folder {given!r} of {value!r}: "
                "its entries and locks would be read as inputs. Set "
                f"{CACHE_ENV} (the trainer: zephon.cache_dir) to a folder outside the "
                "inputs, or to a hidden one (a name starting with a dot) within them."
            )


def stat_listing(sources: list[InputFile]) -> list[list[Any]]:
    """[name, file within the source, real path, size, mtime_ns] of every file the
    sources read (a dataset folder: each of its files), from ``os.stat`` only; of an
    object in object storage, [name, "", its URL (redacted), size, ETag], from the
    listing."""
    out: list[list[Any]] = []
    for src in sources:
        if src.remote is not None:
            out.append([src.name, "", src.remote.shown, src.remote.size, src.remote.e_tag])
            continue
        files = (
            sorted((p for p in src.path.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
            if src.path.is_dir()
            else [src.path]
        )
        for f in files:
            st = f.stat()
            inner = f.relative_to(src.path).as_posix() if src.path.is_dir() else ""
            out.append([src.name, inner, os.path.realpath(f), st.st_size, st.st_mtime_ns])
    return out


def read_manifest(out: Path) -> dict[str, Any]:
    """The manifest of the cache entry ``out``: a JSON object, else a StoreError saying
    the entry is not what its key promises."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise _stale(out, f"its manifest cannot be read ({e})") from None
    if not isinstance(manifest, dict):
        raise _stale(out, "its manifest is not a JSON object")
    return manifest


def _stale(out: Path, why: str) -> StoreError:
    return StoreError(
        f"the cache entry {out} does not hold what its key promises: {why}. It was edited, "
        f"or the cache is corrupt. Delete {out} (and {out.name}.json beside it); the next "
        "run prepares it again."
    )


def _check_entry(
    manifest: dict[str, Any],
    sources: list[InputFile],
    listing: list[list[Any]],
    out: Path,
    value: str,
) -> None:
    """The manifest's sources (names, sizes, DatasetDict splits) agree with the stat
    listing and the splits chosen."""
    sizes: dict[str, int] = {}
    for name, _, _, size, _ in listing:
        sizes[name] = sizes.get(name, 0) + size
    expected = [[s.name, sizes[s.name], None if s.splits is None else list(s.splits)]
                for s in sources]  # fmt: skip
    recorded = [
        [r.get("name"), r.get("size"), r.get("splits")] for r in manifest.get("sources", [])
    ]
    if recorded != expected:
        first = next(
            (f"{a} vs {b}" for a, b in zip(recorded, expected, strict=False) if a != b),
            f"{len(recorded)} sources vs {len(expected)}",
        )
        raise _stale(
            out, f"its sources (name, size, splits) differ from the inputs {value!r}: {first}"
        )


def _write_record(out: Path, value: str, key: dict[str, Any], manifest: dict[str, Any]) -> None:
    """``<entry>.json`` beside the entry: what it was prepared from (once)."""
    path = out.parent / f"{out.name}.json"
    if path.exists():
        return
    record = {
        "inputs": value,
        "fingerprint": manifest.get("fingerprint"),
        **key,
        "sources": [
            {k: r[k] for k in ("name", "kind", "size", "sha256", "splits") if k in r}
            for r in manifest.get("sources", [])
        ],
    }
    tmp = out.parent / f".{out.name}.json.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
