"""``zephon prepare``'s inputs, resolved to canonically named sources in a fixed order.

Role: expand inputs (files, folders, Hugging Face ``save_to_disk`` folders, glob
patterns, comma-separated lists of these) into sources (``InputFile``), each of a
kind ``KINDS`` recognises (text, JSONL (.jsonl, .jsonl.gz, .ndjson), JSON,
Parquet, HF) and read by the reader ``readers.READERS`` names for it; a new input
kind is a new entry in both. ``select_splits`` says which splits of a Hugging Face
``DatasetDict`` folder are read: ``train`` unless asked (``all``: every split).
``source_record`` is a source's manifest entry. Inputs that are object-storage URLs
are listed by ``objects`` and become sources whose ``remote`` says where they are
(read from a spool file once fetched), named by the same rule as local files.

Invariants: the order of sources depends only on the inputs as given and the
names and contents of the files: folders are walked sorted by name, hidden
entries skipped, glob matches sorted the same way, every real file and folder
visited once (symbolic-link loops end). A source's name is its path relative to
the deepest folder holding every source, whatever the spelling of the inputs (a
folder, a glob of its files, a list of them). Input that another value of an
option would fix (the text field, the split) is an ``OptionError``, spelled for
the command that runs (``zephon prepare``'s ``--text-field``, the trainer's
``--zephon.text_field``: ``OptionNames``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import posixpath
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest import objects
from torchtitan_zephon.ingest.input_file import (
    GLOB_CHARS,
    InputFile,
    kind_of,
)
from torchtitan_zephon.store.format import StoreError, is_store


@dataclass(frozen=True)
class OptionNames:
    """How the running command spells the options that choose what is read, for its
    messages: ``zephon prepare``'s (``PREPARE_OPTIONS``) or the trainer's
    (``--zephon.text_field``, ``--zephon.split``)."""

    text_field: str = "--text-field"
    split: str = "--split"


PREPARE_OPTIONS = OptionNames()


class OptionError(StoreError):
    """Bad input that another value of an option fixes (``option``: a field of
    ``OptionNames``); ``spelled`` gives the same message naming the option as another
    command spells it."""

    def __init__(
        self, message: Callable[[str], str], option: str, names: OptionNames = PREPARE_OPTIONS
    ) -> None:
        self.message, self.option = message, option
        super().__init__(message(getattr(names, option)))

    def spelled(self, names: OptionNames) -> OptionError:
        return OptionError(self.message, self.option, names)


ALL_SPLITS = "all"
"""The ``split`` value that reads every split of a DatasetDict (Hugging Face reserves
the name ``all`` for the same meaning)."""
DEFAULT_SPLIT = "train"


# (name suffixes, kind), tried in order; anything else is read as text.
def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        (path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def dataset_dict_splits(path: Path) -> list[str] | None:
    """The splits a DatasetDict folder holds (its dataset_dict.json); None for a folder
    that is a single Dataset."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return None
    try:
        splits = json.loads(index.read_text(encoding="utf-8"))["splits"]
        if not (isinstance(splits, list) and all(isinstance(x, str) for x in splits)):
            raise ValueError("'splits' is not a list of names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(
            f"{path}: cannot read this Hugging Face dataset folder (dataset_dict.json: {e}): "
            "it is incomplete or corrupt. Save it again with `DatasetDict.save_to_disk`."
        ) from None
    return splits


def _saved_split(path: Path) -> str | None:
    """The split a single Dataset folder was saved as (its state.json), if it says."""
    try:
        split = json.loads((path / "state.json").read_text(encoding="utf-8")).get("_split")
    except (OSError, ValueError, AttributeError):
        return None
    return split if isinstance(split, str) else None


def select_splits(
    sources: list[InputFile], split: str = "", names: OptionNames = PREPARE_OPTIONS
) -> list[InputFile]:
    """``sources`` with the splits each Hugging Face DatasetDict folder reads: ``split``
    (empty: ``train``), or every split in sorted order for ``all``. A DatasetDict without
    that split is an ``OptionError`` listing the splits it has. A single Dataset folder
    is read whole; an explicit ``split`` other than the one it was saved as (when its
    state.json records one) is refused. Other sources are unchanged."""
    out: list[InputFile] = []
    for src in sources:
        present = dataset_dict_splits(src.path) if src.kind == "hf" else None
        if src.kind != "hf":
            out.append(src)
        elif present is None:
            saved = _saved_split(src.path)
            if split and split != ALL_SPLITS and saved is not None and saved != split:
                raise OptionError(
                    lambda o, src=src, saved=saved: (
                        f"{src.path} is a single Hugging Face Dataset saved as split {saved!r} "
                        f"(not a DatasetDict), so {o} {split} cannot select from it. Give the "
                        f"folder of the {split!r} split, or drop {o} (a single Dataset is read "
                        "whole)."
                    ),
                    "split",
                    names,
                )
            out.append(src)
        elif split == ALL_SPLITS:
            out.append(replace(src, splits=tuple(sorted(present))))
        elif (split or DEFAULT_SPLIT) in present:
            out.append(replace(src, splits=(split or DEFAULT_SPLIT,)))
        else:
            which = (
                f"no split {split!r}"
                if split
                else f"no {DEFAULT_SPLIT!r} split, which is read by default"
            )
            raise OptionError(
                lambda o, src=src, present=present, which=which: (
                    f"{src.path} is a Hugging Face DatasetDict with the splits "
                    f"{sorted(present)}; it has {which}. Choose one with {o} NAME, or {o} "
                    f"{ALL_SPLITS} to read every split."
                ),
                "split",
                names,
            )
    return out


def _kind_of(path: Path) -> str:
    return kind_of(path.name)


def expand_input(raw: str) -> list[str]:
    """The paths one input names: itself when it exists; else, split at commas, each
    piece itself (when it exists) or a glob pattern's matches, sorted as a folder walk
    sorts (by name, level by level; ``**`` spans folders). An error names a piece that
    does not exist and a pattern that matches nothing."""
    if not raw:
        raise StoreError("an input is empty; expected a file, a folder or a glob pattern.")
    if os.path.lexists(raw):
        return [raw]
    pieces = [p.strip() for p in raw.split(",")] if "," in raw else [raw]
    out: list[str] = []
    for piece in pieces:
        if not piece:
            raise StoreError(
                f"input {raw!r} has an empty item between commas; expected a comma-separated "
                "list of files, folders or glob patterns."
            )
        if os.path.lexists(piece):
            out.append(piece)
        elif GLOB_CHARS & set(piece):
            matches = glob.glob(piece, recursive=True)
            if not matches:
                raise StoreError(
                    f"input pattern {piece!r} matches no file; expected a glob pattern of "
                    "text/JSONL/Parquet files or folders (hidden names match only a pattern "
                    "that starts with a dot)."
                )
            out.extend(sorted(matches, key=lambda m: Path(m).parts))
        else:
            within = f" (in {raw!r})" if piece != raw else ""
            raise StoreError(
                f"input {piece!r}{within} does not exist; expected a text/JSONL/Parquet file, "
                "a folder, a glob pattern or a Hugging Face dataset saved with save_to_disk."
            )
    return out


def resolve_inputs(inputs: list[str], spool: Path | None = None) -> list[InputFile]:
    """Expand inputs into sources, in the given order; folders walked sorted, hidden skipped.

    Every input is expanded (``expand_input``: a path, a glob pattern or a
    comma-separated list of them) into entries: a file is one entry, a Hugging
    Face dataset folder is one entry, any other folder is walked into its files
    (and dataset folders). Every real file and folder is visited once, at its
    first place: a symbolic link to something already visited (a loop such as
    ``sub/up -> ..``, a second name of a file, a file listed twice or reached by
    two inputs) is skipped, and so are links that lead nowhere.

    A token store (a folder ``zephon prepare`` made) holds no raw text: inside a
    folder input it is skipped (a store prepared next to its corpus does not break
    the next prepare of that folder); given as an input it is refused.

    Names are canonical: each entry is named by its path relative to the deepest
    folder that holds every entry (one file: its base name). So a folder, a glob of
    its files and a list of the same files give the same names, and the same store.

    Inputs in object storage (URLs: ``objects.list_inputs``) are named the same way by
    their keys, so the same files in a bucket give the same store; their spool files
    lie under ``spool`` (the cache's ``remote-inputs`` folder when None). A prepare
    reads either local inputs or object-storage ones, not both.
    """
    if not inputs:
        raise StoreError("no inputs given; pass at least one file or folder to prepare.")
    urls = [raw for raw in inputs if _is_object_url(raw)]
    if urls:
        return _resolve_objects(inputs, urls, spool)
    entries: list[tuple[str, Path, str]] = []  # (absolute path as reached, path, kind)
    seen: set[Path] = set()
    for raw in inputs:
        for given in expand_input(raw):
            path = Path(given)
            try:
                real = path.resolve(strict=True)
            except (OSError, RuntimeError):
                raise StoreError(
                    f"input {given!r} is a link that leads nowhere (or a loop of links); "
                    "expected a text/JSONL/Parquet file, a folder or a Hugging Face dataset."
                ) from None
            if real in seen:
                continue
            seen.add(real)
            if path.is_dir() and is_store(path):
                raise StoreError(
                    f"input {given!r} is a token store (made by zephon prepare), not raw "
                    f"text; train on it as it is (--zephon.store {given}), or prepare "
                    "the raw files it was made from."
                )
            if _is_hf_dataset(path):
                entries.append((os.path.abspath(given), path, "hf"))
            elif path.is_dir():
                entries.extend(_walk(path, os.path.abspath(given), seen))
            else:
                entries.append((os.path.abspath(given), path, _kind_of(path)))
    if not entries:
        return []
    root = os.path.commonpath([os.path.dirname(a) for a, _, _ in entries])
    return [InputFile(Path(os.path.relpath(a, root)).as_posix(), p, k) for a, p, k in entries]


def _is_object_url(value: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", value)) and not value.lower().startswith(
        "file://"
    )


def _resolve_objects(inputs: list[str], urls: list[str], spool: Path | None) -> list[InputFile]:
    """``resolve_inputs`` of inputs in object storage (every one of them a URL)."""
    from torchtitan_zephon.ingest.cache_folder import cache_root
    from torchtitan_zephon.store.urls import redact

    local = [raw for raw in inputs if raw not in urls]
    if local:
        raise StoreError(
            f"the inputs mix local paths ({local[0]!r}) and object-storage URLs "
            f"({redact(urls[0])!r}); a prepare reads one or the other. Copy the local "
            "files to the bucket, or the objects to local disk."
        )
    spool = spool if spool is not None else cache_root() / objects.SPOOL
    entries: list[tuple[str, InputFile]] = []
    seen: set[str] = set()
    for raw in inputs:
        for place, src in objects.list_inputs(raw, spool):
            if place not in seen:  # an object named twice is read once, at its first place
                seen.add(place)
                entries.append((place, src))
    root = posixpath.commonpath([posixpath.dirname(p) for p, _ in entries])
    return [replace(src, name=posixpath.relpath(p, root)) for p, src in entries]


def _walk(folder: Path, at: str, seen: set[Path]) -> Iterator[tuple[str, Path, str]]:
    """(absolute path as reached, path, kind) of the entries under ``folder`` (reached
    as ``at``) sorted by name, level by level; ``seen`` holds the real paths visited."""
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        try:
            real = entry.resolve(strict=True)
        except (OSError, RuntimeError):  # a dangling link, or a loop of links
            continue
        if real in seen:
            continue
        name = os.path.join(at, entry.name)
        if _is_hf_dataset(entry):
            seen.add(real)
            yield name, entry, "hf"
        elif entry.is_dir() and is_store(entry):  # prepared tokens, not raw text: skipped
            seen.add(real)
        elif entry.is_dir():
            seen.add(real)
            yield from _walk(entry, name, seen)
        elif entry.is_file():
            seen.add(real)
            yield name, entry, _kind_of(entry)


def _source_files(src: InputFile) -> list[Path]:
    if src.path.is_dir():
        return sorted((p for p in src.path.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    return [src.path]


def source_record(src: InputFile) -> dict[str, Any]:
    """Manifest entry: name, kind, sha256 of the content, size in bytes; for a
    DatasetDict, the splits read."""
    h = hashlib.sha256()
    size = 0
    for f in _source_files(src):
        if src.path.is_dir():
            h.update(f.relative_to(src.path).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
                size += len(block)
    record = {"name": src.name, "kind": src.kind, "sha256": h.hexdigest(), "size": size}
    if src.splits is not None:  # only DatasetDict sources: other manifests stay as they were
        record["splits"] = list(src.splits)
    return record
