"""Phase 2 of a prepare: each rank makes (or reuses) the tokenized units of its units.

Role: ``assign_units`` gives each unit a rank; ``open_staging`` / ``check_shared``
set up the staging folder beside the output (``tokenized.staging_folder``) that all
ranks share; ``stage_units`` tokenizes this rank's units in order (``encode``'s
worker processes) into tokenized units, reusing an earlier run's intact tokenized units.

Invariants: a tokenized unit depends only on its unit's input bytes, the tokenizer, the text
field and the dtype (``_unit_identity``), never on the rank, the workers or the
chunking; an earlier tokenized unit is reused only when its identity and the hash of its
input bytes match. A source that changes while it is read (size or modification
time, checked before and after each unit) is an error carrying the unit's index.
"""

from __future__ import annotations

import heapq
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.ingest.encode import encode_in_order
from torchtitan_zephon.ingest.inputs import PREPARE_OPTIONS, InputFile, OptionError, OptionNames
from torchtitan_zephon.ingest.objects import fetch
from torchtitan_zephon.ingest.ranks import Ranks
from torchtitan_zephon.ingest.readers import iter_documents
from torchtitan_zephon.ingest.tokenized import (
    RANKS_FILE,
    TOKENIZED,
    TokenizedWriter,
    load_tokenized,
    unit_key,
)
from torchtitan_zephon.ingest.tokenizer import TokenizerInfo
from torchtitan_zephon.ingest.units import Unit, source_stat, unit_input_hash
from torchtitan_zephon.store.format import StoreError

CHUNK_CHARS = 1 << 20
CHUNK_DOCS = 2048
"""Prepare encodes a unit's documents in chunks: a chunk ends once it holds
``CHUNK_CHARS`` characters or ``CHUNK_DOCS`` documents (``zephon bench prepare`` cuts
them the same way)."""


@dataclass
class Work:
    """What every rank of a prepare works from (phase 1): the tokenizer, the store dtype,
    the sources and their units, and the identity of the inputs all ranks agree on."""

    info: TokenizerInfo
    dtype_name: str
    sources: list[InputFile]
    units: list[Unit]
    identity: dict[str, Any]  # what every rank must agree on
    names: OptionNames  # how the running command spells its options, for messages


def assign_units(units: list[Unit], world_size: int) -> list[int]:
    """The rank of each unit: largest first, each to the least loaded rank (lowest on
    ties); a pure function of the units and the world size."""
    load = [(0, r) for r in range(world_size)]
    heapq.heapify(load)
    owner = [0] * len(units)
    for u in sorted(units, key=lambda u: (-u.size, u.index)):
        work, r = heapq.heappop(load)
        owner[u.index] = r
        heapq.heappush(load, (work + u.size, r))
    return owner


def _unit_identity(work: Work, unit: Unit, text_field: str) -> dict[str, Any]:
    return {
        **unit.describe(work.sources[unit.source]),
        "tokenizer": work.info.sha256,
        "text_field": text_field,
        "dtype": work.dtype_name,
    }


def open_staging(ranks: Ranks, work: Work, staging: Path) -> None:
    """Rank 0 creates the staging folder (or finds an earlier run's), drops a killed
    run's unfinished files and writes the inputs' identity for the others to read."""
    if ranks.rank != 0:
        return
    folder = staging / TOKENIZED
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp-*"):
        stale.unlink(missing_ok=True)
    tmp = staging / f"{RANKS_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(work.identity, sort_keys=True) + "\n")
    os.replace(tmp, staging / RANKS_FILE)


def check_shared(ranks: Ranks, work: Work, staging: Path) -> None:
    """Every rank must see what rank 0 wrote into the staging folder."""
    try:
        shared = json.loads((staging / RANKS_FILE).read_text()) == work.identity
    except (OSError, ValueError):
        shared = False
    if not shared:
        raise StoreError(
            f"rank {ranks.rank} cannot see {staging / RANKS_FILE}, written by rank 0: a "
            "prepare over several ranks needs the output's parent folder on a filesystem "
            "all ranks share (e.g. Lustre, GPFS, NFS)."
        )


def stage_units(
    ranks: Ranks,
    work: Work,
    staging: Path,
    workers: int,
    progress: bool,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """Phase 2 on each rank: make (or reuse) the tokenized units of this rank's units; their
    records by unit index, and how many were reused. ``on_progress`` hears of every
    chunk and unit done."""
    folder = staging / TOKENIZED
    text_field = work.identity["text_field"]
    dtype = np.dtype("<u2" if work.dtype_name == "uint16" else "<u4")
    owner = assign_units(work.units, ranks.world_size)
    mine = [u for u in work.units if owner[u.index] == ranks.rank]
    stats = {u.source: tuple(s[2:]) for u in mine for s in [work.identity["sources"][u.source]]}
    records: list[tuple[int, dict[str, Any]]] = []
    hashes: dict[int, str] = {}
    identities = {u.index: _unit_identity(work, u, text_field) for u in mine}
    sizes = {u.index: u.size for u in mine}
    state = {"phase": "tokenizing", "units": len(mine), "bytes": sum(sizes.values())}
    state.update(units_done=0, bytes_done=0, documents=0)

    def told(unit: int | None = None, documents: int = 0) -> None:
        if on_progress is None:
            return
        state["documents"] += documents
        if unit is not None:
            state["units_done"] += 1
            state["bytes_done"] += sizes[unit]
        on_progress(dict(state))

    told()

    def reuse(u: Unit) -> bool:
        """Keep an earlier run's tokenized ``u`` if intact and its input unchanged."""
        i = identities[u.index]
        rec = load_tokenized(folder, unit_key(i), i, hashes[u.index], dtype.itemsize)
        if rec is not None:
            records.append((u.index, rec))
            told(u.index, int(rec["documents"]))
        return rec is not None

    made_here: set[int] = set()
    bar = _progress_bar(progress and ranks.rank == 0)
    writer: TokenizedWriter | None = None
    try:
        chunks = _unit_chunks(mine, work.sources, text_field, stats, hashes, reuse, work.names)
        info = work.info
        for (index, last), flat, lengths in encode_in_order(
            chunks, str(info.path), info.eos_id, workers
        ):
            if writer is None:
                writer = TokenizedWriter(folder, unit_key(identities[index]), dtype)
            writer.add(flat, lengths)
            bar.update(int(lengths.size))
            if last:
                records.append((index, writer.finish(identities[index], hashes[index])))
                made_here.add(index)
                writer = None
                bar.set_postfix(units=f"{len(records)}/{len(mine)}", refresh=False)
            told(index if last else None, int(lengths.size))
    finally:
        if writer is not None:
            writer.abort()
        bar.close()
    return records, len(records) - len(made_here)


def unreadable(src: InputFile, e: OSError) -> StoreError:
    return StoreError(f"{src.path}: cannot read this input ({e.strerror or e}). Check the file.")


def check_unchanged(src: InputFile, stat: tuple[int, ...]) -> None:
    try:
        now = source_stat(src)
    except OSError as e:
        raise unreadable(src, e) from None
    if tuple(now) != tuple(stat):
        raise StoreError(
            f"input {str(src.path)!r} changed while prepare was running (it was {stat[0]} "
            f"bytes, modified at {stat[1]} ns; now {now[0]} bytes, modified at {now[1]} ns). "
            "Run prepare again once the inputs are complete and no longer written."
        )


def _unit_chunks(
    units: list[Unit],
    sources: list[InputFile],
    text_field: str,
    stats: dict[int, tuple[int, ...]],
    hashes: dict[int, str],
    reuse: Callable[[Unit], bool],
    names: OptionNames = PREPARE_OPTIONS,
) -> Iterator[tuple[tuple[int, bool], list[str]]]:
    """((unit index, last chunk of the unit?), documents) chunks of the units to make, in
    order; each ends with a chunk marked last (maybe empty). Each unit's input is hashed
    (into ``hashes``) just before it is read, so an intact earlier tokenized unit is reused
    (``reuse``) instead, and the read mostly hits the page cache. The source must be
    unchanged since the start before and after the read; an error carries the unit's
    index (and names options as ``names`` spells them)."""
    for u in units:
        src = sources[u.source]
        chunk: list[str] = []
        chars = 0
        try:
            fetch(src)  # an object in object storage: streamed to its spool file first
            hashes[u.index] = unit_input_hash(src, u)
            check_unchanged(src, stats[u.source])
            if reuse(u):
                continue
            for text in iter_documents(src, text_field, u.extent):
                chunk.append(text)
                chars += len(text)
                if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
                    yield (u.index, False), chunk
                    chunk, chars = [], 0
            check_unchanged(src, stats[u.source])
        except OSError as e:
            err = _named(unreadable(src, e), src)
            err.unit_index = u.index  # type: ignore[attr-defined]
            raise err from None
        except OptionError as e:
            err = _named(e.spelled(names), src, names)
            err.unit_index = u.index  # type: ignore[attr-defined]
            raise err from None
        except StoreError as e:
            err = _named(e, src)
            err.unit_index = u.index  # type: ignore[attr-defined]
            raise err from None
        yield (u.index, True), chunk


def _named(err: StoreError, src: InputFile, names: OptionNames = PREPARE_OPTIONS) -> StoreError:
    """``err`` naming an object in object storage by its URL, not its spool file."""
    if src.remote is None or str(src.path) not in str(err):
        return err
    spool, url = str(src.path), src.shown
    if isinstance(err, OptionError):
        message = err.message
        return OptionError(lambda o: message(o).replace(spool, url), err.option, names)
    return type(err)(str(err).replace(spool, url))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm  # a declared dependency: the bar never silently disappears

    return tqdm(desc="zephon prepare", unit=" docs", file=sys.stderr, dynamic_ncols=True)
