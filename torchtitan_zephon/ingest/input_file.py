"""One input of a prepare, as resolved: a local file or folder (``InputFile``), or an
object in object storage (its ``RemoteObject`` listing entry, read from a spool file),
and the kind of reader a file's name selects (``KINDS``, ``kind_of``).

Invariant: a source's kind depends only on its name (``kind_of``), so a file on disk
and the same file in a bucket are read by the same reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RemoteObject:
    """Where a source in object storage is (``objects.list_inputs``): its listing entry."""

    scheme: str
    bucket: str
    prefix: str  # the URL's fixed prefix; ``name`` is below it
    url: str  # the prefix's URL as given (may hold a query string: never printed)
    shown: str  # the object's URL as messages print it (redacted)
    name: str
    size: int
    e_tag: str | None
    mtime_ns: int


@dataclass(frozen=True)
class InputFile:
    """One input file (or Hugging Face dataset folder) of a prepare, as resolved."""

    name: str  # relative, stable name recorded in the manifest
    path: Path  # for an object in object storage: its spool file (``objects.fetch``)
    kind: str  # a key of READERS
    splits: tuple[str, ...] | None = None
    """The splits read, for a Hugging Face DatasetDict folder (``select_splits``); None
    for any other source (a single Dataset folder is read whole)."""
    remote: RemoteObject | None = None
    """The object this source is, when it is in object storage (read from ``path`` once
    ``objects.fetch`` has streamed it there); None for a local file."""

    @property
    def shown(self) -> str:
        """How messages name the source: its path, or its object's URL."""
        return self.remote.shown if self.remote is not None else str(self.path)


KINDS: list[tuple[tuple[str, ...], str]] = [
    ((".jsonl", ".jsonl.gz", ".ndjson"), "jsonl"),
    ((".json",), "json"),
    ((".parquet",), "parquet"),
]


def kind_of(name: str) -> str:
    """The kind (a key of ``readers.READERS``) of a file or object named ``name``."""
    name = name.lower()
    for suffixes, kind in KINDS:
        if name.endswith(suffixes):
            return kind
    return "text"


GLOB_CHARS = frozenset("*?[")
