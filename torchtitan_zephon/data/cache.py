"""Store values and the store cache: what a store value names, and token stores
built on first use, once, into a shared folder.

Role: the one place that turns a store value (the trainer's ``zephon.store``, a
mixture's ``[[source]] store``) into a token store folder (``store_location``):
``builtin:PART`` is a builtin store (``builtin.py``); a folder holding a store
(or a file in one) is that store; anything else names raw inputs (a file, a
folder of them, a glob pattern, a comma-separated list: ``readers.expand_input``)
which ``raw_store`` prepares into the cache. It also owns the cache folder
(``cache_root``) and the one way an entry is made (``build_once``): under an
exclusive ``fcntl.flock`` on ``<entry>.lock`` beside it, the holder builds the
store into a staging folder and renames it into place; every other process
waits on the lock (saying so every ~30 s) and then finds the entry.

Invariants:
- The store of raw inputs is ``prepare_store`` of the same value, tokenizer, text
  field and split: its fingerprint equals ``zephon prepare``'s, whatever the
  spelling of the inputs (names are canonical: ``readers.resolve_inputs``).
- Its entry is keyed by the inputs' canonical names, real paths, sizes and
  mtimes (``os.stat`` only), the tokenizer.json's sha256, the text field, the
  splits read of each DatasetDict (only where there is one: other keys are as
  before) and the store format version: a later run finds it without reading the
  corpus, and a changed file (size or mtime) makes another entry. On a hit the
  manifest's sources (names, sizes, splits) are checked against the listing; the
  entry's ``<entry>.json`` records the inputs and their content hashes.
- An entry that exists is complete: it appears by one rename, after its build
  succeeded. A build that fails leaves no entry and the lock is released (the
  kernel drops it if the process dies); prepare's finished parts stay in the
  staging folder ``.<entry>.building`` (its message names them), so the next
  holder continues where it stopped; with nothing finished the folder goes.
- Under the lock one process builds an entry: once per machine with the cache on
  local disk, once per cluster on a shared filesystem whose ``flock`` works
  across machines. Where ``flock`` is unavailable (the filesystem refuses it)
  every process builds into a staging folder of its own and the first rename
  wins; entries are deterministic, so the result is the same, only the work is
  repeated.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_zephon.data.readers import (
    GLOB_CHARS,
    PREPARE_OPTIONS,
    OptionNames,
    Source,
    expand_input,
    resolve_inputs,
    select_splits,
)
from torchtitan_zephon.data.store import (
    CHECKSUMS,
    DOC_OFFSETS,
    FORMAT_VERSION,
    MANIFEST,
    TOKENS,
    StoreError,
    is_store,
)

CACHE_ENV = "ZEPHON_CACHE"
STORE_FILES = (
    MANIFEST,
    TOKENS,
    DOC_OFFSETS,
    CHECKSUMS,
)  # an entry is complete when its manifest exists
"""Any of these in a folder makes it a (maybe broken) store, never raw inputs."""
BUILTIN_PREFIX = "builtin:"
RAW_KEY_FORMAT = "zephon-raw-inputs/1"
WAIT_REPORT_S = 30.0
"""How often a process waiting for another's build says so."""

Log = Callable[[str], None]


def cache_root(configured: str = "") -> Path:
    """``$ZEPHON_CACHE``, else ``configured`` (the trainer's ``zephon.cache_dir``), else
    ``~/.cache/torchtitan_zephon``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "torchtitan_zephon"


def _holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


# flock refused by the filesystem (not "held by another process").
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}


def _wait_for_lock(fh, what: str, log: Log | None) -> bool:  # noqa: ANN001 - a file object
    """Take the exclusive lock, reporting the holder while waiting. False: no flock here."""
    start = time.monotonic()
    reported: float | None = None
    delay = 0.05
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno in _NO_FLOCK:
                return False
            raise
        now = time.monotonic()
        if log is not None and (reported is None or now - reported >= WAIT_REPORT_S):
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            log(
                f"waiting for {holder} to prepare {what} "
                f"({now - start:.0f} s so far; its lock: {fh.name})"
            )
            reported = now
        time.sleep(delay)
        delay = min(1.0, delay * 2)


def build_once(
    out: Path,
    build: Callable[[Path], None],
    *,
    what: str = "a store",
    log: Log | None = None,
    work: str = "",
) -> Path:
    """The entry ``out`` (a store folder in the cache), built by ``build(dest)`` on first use.

    ``work`` names the lock and the staging folder (default: the entry's name): entries
    that are versions of the same inputs share them, so a build after a failed one of
    an earlier version finds its finished work.

    ``build`` must create a complete store at ``dest`` (a path that does not exist
    yet) or raise; the store is then renamed to ``out``. ``what`` and ``log`` name
    the work in the messages of processes that wait for it.
    """
    if (out / MANIFEST).is_file():
        return out
    root = out.parent
    work = work or out.name
    try:
        root.mkdir(parents=True, exist_ok=True)
        fh = open(root / f"{work}.lock", "a+")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise StoreError(
            f"cannot create the cache folder {root} or write in it ({e.strerror}: "
            f"{e.filename}); set {CACHE_ENV} (the trainer: zephon.cache_dir) to a folder "
            "this process can write."
        ) from None
    with fh:
        locked = _wait_for_lock(fh, what, log)
        try:
            if (out / MANIFEST).is_file():  # another process built it meanwhile
                return out
            if locked:
                fh.seek(0)
                fh.truncate()
                fh.write(_holder() + "\n")
                fh.flush()
                # Only the holder writes here: a build killed or failed midway leaves its
                # work for the next holder (prepare reuses its finished parts; it says so).
                staging = root / f".{work}.building"
            else:
                if log is not None:
                    log(
                        f"the filesystem of {root} refuses file locks (flock): this process "
                        f"prepares {what} on its own; the first to finish wins. Put the "
                        "cache on local disk (ZEPHON_CACHE) or prepare ahead with `zephon "
                        "prepare` to do the work once."
                    )
                staging = root / f".{work}.building-{uuid.uuid4().hex}"
            _build_into(staging, out, build, keep_on_failure=locked)
        finally:
            if locked:
                fcntl.flock(fh, fcntl.LOCK_UN)
    return out


def _build_into(
    staging: Path, out: Path, build: Callable[[Path], None], *, keep_on_failure: bool
) -> None:
    """Build into ``staging``/store and rename it to ``out``. After a failure the staging
    folder stays for the next holder when ``keep_on_failure`` and the build left work
    in it (prepare's finished parts), else it is removed."""
    dest = staging / "store"
    if dest.exists():  # complete but never moved: a holder died between the two renames
        shutil.rmtree(dest)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        build(dest)
        try:
            os.rename(dest, out)
        except OSError:
            if not (out / MANIFEST).is_file():  # not a lost race with another builder
                raise
    except BaseException:
        if not (keep_on_failure and staging.is_dir() and any(staging.iterdir())):
            shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)


# ------------------------------------------------------------------ store values


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
    """What set ``tokenizer``, for messages (the trainer: model.hf_assets_path)."""


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


def store_location(value: str, raw: RawInputs | None = None, *, progress: bool = False) -> Path:
    """The token store folder a store value names, built on first use where it is a
    builtin part (with a progress bar when ``progress``) or raw inputs (as ``raw``
    says; None: raw inputs are refused)."""
    if value.startswith(BUILTIN_PREFIX):
        from torchtitan_zephon.data.builtin import builtin_store_path

        return builtin_store_path(progress=progress, part=value[len(BUILTIN_PREFIX) :])
    if names_store(value):
        if not os.path.lexists(value):
            raise StoreError(
                f"token store {value!r} does not exist; expected a folder made by `zephon "
                "prepare INPUT... --tokenizer DIR --output STORE`, or raw inputs to prepare "
                "on first use: a text/JSONL/Parquet file, a folder of them, a glob pattern "
                "or a comma-separated list."
            )
        return Path(value)
    if raw is None:
        raise StoreError(
            f"{value!r} names raw inputs, not a token store, and no tokenizer was given to "
            f"prepare them. Prepare them first (`zephon prepare {value} --tokenizer DIR "
            "--output STORE`) and name the store, or train on them directly: the trainer "
            "prepares raw inputs with the tokenizer at model.hf_assets_path."
        )
    return raw_store(value, raw)


def rebase(value: str, base: Path) -> str:
    """``value`` with its relative paths (or each relative item of a comma list) taken
    relative to ``base`` (a mixture file's folder); builtin parts stay."""
    if value.startswith(BUILTIN_PREFIX) or os.path.isabs(value):
        return value
    if os.path.lexists(base / value) or "," not in value:
        return str(base / value)
    return ",".join(
        p if os.path.isabs(p.strip()) else str(base / p.strip()) for p in value.split(",")
    )


_located: dict[tuple[str, ...], Path] = {}
"""Raw store values already located by this process (the preflight, the dataloader
and the validator all ask): value, cwd, tokenizer, text field, cache root -> entry."""


def raw_store(value: str, raw: RawInputs) -> Path:
    """The cache entry holding ``prepare_store([value], raw.tokenizer, ...)``, built
    on first use (once, under the entry's lock; see the module docstring)."""
    root = cache_root(raw.cache_dir)
    memo = (value, os.getcwd(), os.path.abspath(raw.tokenizer), raw.text_field, raw.split,
            str(root))  # fmt: skip
    if memo in _located:
        return _located[memo]
    tokenizer_json = Path(raw.tokenizer) / "tokenizer.json"
    if not tokenizer_json.is_file():
        found = (
            f"it holds {sorted(p.name for p in Path(raw.tokenizer).iterdir())[:8]}"
            if Path(raw.tokenizer).is_dir()
            else "it does not exist"
        )
        raise StoreError(
            f"the store value {value!r} names raw inputs, which are tokenized with the "
            f"tokenizer.json in {raw.tokenizer_origin} = {raw.tokenizer!r}, but {found}. "
            "Point it at a folder holding a Hugging Face tokenizer.json, or name a store "
            "prepared with `zephon prepare`."
        )
    sources = select_splits(resolve_inputs([value]), raw.split, raw.names)
    if not sources:
        raise StoreError(
            f"the raw inputs {value!r} hold no files (hidden names are skipped); expected "
            "text/JSONL/Parquet files or Hugging Face dataset folders."
        )
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
    # after a failure (a corrupt file, since fixed) reuses the parts already finished.
    key["files"] = [row[:3] for row in listing]
    work = "raw-work-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    if not (out / MANIFEST).is_file():

        def build(dest: Path) -> None:
            from torchtitan_zephon.data.prepare import prepare_store

            if raw.log is not None:
                raw.log(
                    f"preparing the raw inputs {value!r} ({len(sources)} sources"
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
            )
            if stat_listing(sources) != listing:
                raise StoreError(
                    f"the raw inputs {value!r} changed while they were being prepared (a "
                    "file's size or modification time); nothing was cached. Run again once "
                    "they stay put."
                )
            _check_entry(store.manifest, sources, listing, dest, value)
            if raw.log is not None:
                raw.log(
                    f"prepared {value!r} in {time.monotonic() - start:.1f} s: "
                    f"{store.num_tokens} tokens, fingerprint {store.fingerprint[:16]}..."
                )

        build_once(out, build, what=f"the raw inputs {value!r}", log=raw.log, work=work)
    manifest = _read_manifest(out)
    _check_entry(manifest, sources, listing, out, value)
    if manifest.get("tokenizer", {}).get("sha256") != tokenizer_sha or (
        manifest.get("text_field") != raw.text_field
    ):
        raise _stale(out, "its tokenizer or text field differs from its key")
    _write_record(out, value, {**key, "work": work}, manifest)
    _located[memo] = out
    return out


def _splits_note(sources: list[Source]) -> str:
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


def stat_listing(sources: list[Source]) -> list[list[Any]]:
    """[name, file within the source, real path, size, mtime_ns] of every file the
    sources read (a dataset folder: each of its files), from ``os.stat`` only."""
    out: list[list[Any]] = []
    for src in sources:
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


def _read_manifest(out: Path) -> dict[str, Any]:
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
    manifest: dict[str, Any], sources: list[Source], listing: list[list[Any]], out: Path, value: str
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
