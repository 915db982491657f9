"""Build a token store from raw text (``zephon prepare``), in one process or many.

Role: identify the tokenizer (a Hugging Face ``tokenizer.json`` and its EOS),
cut the inputs (``inputs.py``) into work units (``units.py``), tokenize each
unit into a part in a staging folder beside the output (``parts.py``; each rank
of a group, ``ranks.py``, its share of the units, with ``encode.py``'s worker
processes), then assemble the parts into a token store (``store/``): every
document's tokens followed by one EOS token, in input order.

Phases, the same code for one process or many (``Ranks``): (1) every rank
resolves the inputs and cuts them into units; ranks that see different inputs
are refused. (2) Units go to ranks by ``assign_units``; each rank makes the
parts of its units, reusing an earlier run's intact parts. (3) Rank 0 creates
the store's files at their final sizes; every rank writes its parts at their
offsets, then hashes a contiguous share of the checksum chunks and its share of
the sources (sha256 records). (4) Rank 0 writes the manifest and renames the
assembled store to the output; the staging folder is removed.

Invariants: the store's bytes depend only on the inputs' contents, their names
relative to the given inputs, the tokenizer, ``text_field`` and ``split`` (which
splits of a Hugging Face DatasetDict are read: ``inputs.select_splits``; the
manifest records them for such sources only); never on the
number of ranks or workers, the unit size, chunking, absolute paths, timing or
how many earlier runs were interrupted. The output path holds either nothing
or a complete store (renamed into place last). A prepare that fails or is
interrupted keeps its finished parts in ``.<name>.prepare`` beside the output
(its error names the folder); the same command run again reuses them. Two
prepares of one output never run at once: rank 0 holds ``WriterLock`` (flock)
throughout, and a second prepare is refused naming the holder. An input
that changes while a prepare reads it is an error (size and modification time
checked before and after each unit and at the end, the unit's bytes hashed).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.ingest.encode import encode_in_order, max_workers
from torchtitan_zephon.ingest.inputs import (
    PREPARE_OPTIONS,
    InputFile,
    OptionError,
    OptionNames,
    dataset_dict_splits,
    resolve_inputs,
    select_splits,
    source_record,
)
from torchtitan_zephon.ingest.parts import (
    ASSEMBLY,
    PARTS,
    RANKS_FILE,
    PartWriter,
    WriterLock,
    create_store_files,
    finished_parts,
    load_part,
    part_key,
    staging_folder,
    write_part_into_store,
)
from torchtitan_zephon.ingest.ranks import OneProcess, Ranks
from torchtitan_zephon.ingest.readers import iter_documents
from torchtitan_zephon.ingest.units import (
    UNIT_BYTES,
    Unit,
    input_identity,
    plan_units,
    source_stat,
    unit_input_hash,
)
from torchtitan_zephon.store.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    StoreError,
    content_section,
    fingerprint,
    manifest_fingerprint,
    num_chunks,
)
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_chunk_checksums

EOS_FALLBACKS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
_CHUNK_CHARS = 1 << 20
_CHUNK_DOCS = 2048


# ----------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TokenizerInfo:
    path: Path  # the tokenizer.json file
    sha256: str
    vocab_size: int
    eos_token: str
    eos_id: int


def load_tokenizer_info(tokenizer_dir: str | os.PathLike) -> TokenizerInfo:
    """Identify the tokenizer in ``tokenizer_dir`` (a folder with tokenizer.json) and its EOS."""
    from tokenizers import Tokenizer

    root = Path(tokenizer_dir)
    tj = root / "tokenizer.json" if root.is_dir() else root
    if not root.exists():
        raise StoreError(
            f"tokenizer folder {str(root)!r} does not exist; expected a folder holding "
            "a Hugging Face tokenizer.json."
        )
    if not tj.is_file() or tj.name != "tokenizer.json":
        raise StoreError(
            f"no tokenizer.json found in {str(root)!r}; expected a folder holding a Hugging "
            "Face tokenizer.json (e.g. from `tokenizer.save_pretrained(DIR)`)."
        )
    data = tj.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode())
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise StoreError(f"cannot load tokenizer {str(tj)!r}: {e}") from None
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    candidates: list[str] = []
    config = tj.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            candidates.append(eos)
    candidates.extend(EOS_FALLBACKS)
    for name in candidates:
        eos_id = tok.token_to_id(name)
        if eos_id is not None:
            return TokenizerInfo(tj, hashlib.sha256(data).hexdigest(), vocab_size, name, eos_id)
    raise StoreError(
        f"cannot determine the EOS token of {str(tj)!r}: tokenizer_config.json gives no "
        f"eos_token in the vocabulary and none of {list(EOS_FALLBACKS)} exists. Add "
        '"eos_token" to tokenizer_config.json.'
    )


def dtype_for_vocab(vocab_size: int) -> str:
    """Smallest store dtype holding every token id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise StoreError(
        f"vocabulary of {vocab_size} tokens is too large: a store holds ids up to 2**32 "
        "(uint32). Use a smaller tokenizer."
    )


# ----------------------------------------------------------------------------- prepare


class PrepareFailed(StoreError):
    """A prepare failed (on this rank or another): the message says why and, when finished
    parts were kept, where they are and how to continue."""


class EmptyCorpus(StoreError):
    """The inputs hold no document: nothing worth keeping for a second run."""


class PrepareInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a prepare; the message names the kept staging folder, if any."""


@dataclass
class _Plan:
    info: TokenizerInfo
    dtype_name: str
    sources: list[InputFile]
    units: list[Unit]
    identity: dict[str, Any]  # what every rank must agree on
    names: OptionNames  # how the running command spells its options, for messages


def prepare_store(
    inputs: list[str],
    tokenizer: str,
    output: str,
    *,
    workers: int = 1,
    text_field: str = "text",
    progress: bool = True,
    ranks: Ranks | None = None,
    unit_bytes: int = UNIT_BYTES,
    report: dict[str, Any] | None = None,
    split: str = "",
    names: OptionNames = PREPARE_OPTIONS,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> TokenStore:
    """Tokenize ``inputs`` into a new token store at ``output`` and open it.

    ``ranks``: the processes sharing the work (default: this one alone); every rank
    calls this with the same arguments and gets the same store. ``unit_bytes``: the
    target size of a work unit (the store does not depend on it). ``split``: the
    split of each Hugging Face DatasetDict to read (empty: ``train``; ``all``: every
    split, sorted). ``names``: how the caller spells ``--text-field`` / ``--split`` in
    its messages. ``report``, if given, receives a summary: units, parts reused from
    an earlier run, tokens, documents, seconds, the splits read. ``on_progress``, if
    given, is called on this rank with its progress (``phase``, ``units`` /
    ``units_done``, input ``bytes`` / ``bytes_done``, ``documents``), often: it
    should be cheap. A failed or interrupted prepare keeps its finished parts in
    the staging folder beside the output, and a second run reuses them.
    """
    ranks = ranks or OneProcess()
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    # Absolute and without . or ..: ``.`` (an empty current folder) has a parent to stage
    # beside, and the renames do not depend on the current folder, which is the output's.
    out = Path(os.path.abspath(output))
    staging = staging_folder(out)
    local: dict[str, _Plan] = {}

    def plan() -> str:
        local["plan"] = _plan(inputs, tokenizer, out, workers, text_field, unit_bytes, split, names)
        return fingerprint(local["plan"].identity)

    digests = _together(ranks, plan)
    mine = local["plan"]
    if len(set(digests)) > 1:  # rare: gather the whole views only to name the difference
        views = ranks.all_gather_object(mine.identity)
        differences = [_difference(views[0], v, r) for r, v in enumerate(views) if r > 0]
        raise StoreError(
            "the ranks of this prepare were given different inputs: "
            + "; ".join(d for d in differences if d)
            + ". Every rank must run the same command on the same files (a filesystem all "
            "ranks share)."
        )
    lock = WriterLock(out)
    _together(ranks, lambda: lock.acquire() if ranks.rank == 0 else None)
    try:
        _together(ranks, lambda: _open_staging(ranks, mine, staging))
        _together(ranks, lambda: _check_shared(ranks, mine, staging))
        stats = _together(
            ranks, lambda: _stage(ranks, mine, staging, workers, progress, on_progress)
        )
        if on_progress is not None:
            on_progress({"phase": "assembling"})
        store = _assemble(ranks, mine, out, staging, [s for st in stats for s in st[0]])
    except KeyboardInterrupt:
        note = _keep_or_remove(ranks, staging)
        raise PrepareInterrupted(note) from None
    except Exception as e:
        note = _keep_or_remove(ranks, staging, keep=not isinstance(e, EmptyCorpus))
        if not note and ranks.world_size == 1:
            raise
        raise PrepareFailed(f"{e}{' ' + note if note else ''}") from e
    finally:
        lock.release()
    cpu = sum(ranks.all_gather_object(_cpu_seconds() - cpu0))
    if report is not None:
        report.update(
            cpu_seconds=cpu,
            units=len(mine.units),
            reused=sum(st[1] for st in stats),
            tokenized=len(mine.units) - sum(st[1] for st in stats),
            tokens=store.num_tokens,
            documents=store.num_documents,
            world_size=ranks.world_size,
            seconds=time.perf_counter() - t0,
            splits=[
                {"source": s.name, "read": list(s.splits), "present": dataset_dict_splits(s.path)}
                for s in mine.sources
                if s.splits is not None
            ],
        )
    return store


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (tokenizer workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _keep_or_remove(ranks: Ranks, staging: Path, *, keep: bool = True) -> str:
    """After a failure: the staging folder stays if it holds finished parts worth reusing
    (the note saying so), else rank 0 removes it."""
    try:
        if keep and finished_parts(staging):
            return (
                f"The finished parts are kept in {staging}: run the same command again to "
                f"continue; delete {staging} to start over."
            )
        if ranks.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        pass
    return ""


def _together(ranks: Ranks, step: Callable[[], Any]) -> list[Any]:
    """Run ``step`` on every rank and gather the results; if any rank failed, raise its
    error on every rank (the failure of the earliest unit first, so the error is the one
    a single process would report), instead of leaving the others waiting."""
    try:
        mine: tuple[str, Any] = ("ok", step())
    except Exception as e:
        failure = e
        mine = ("failed", (getattr(e, "unit_index", -1), ranks.rank, f"{e}"))
    else:
        failure = None
    gathered = ranks.all_gather_object(mine)
    failed = sorted(v for k, v in gathered if k == "failed")
    if not failed:
        return [v for _, v in gathered]
    _, rank, message = failed[0]
    if ranks.world_size == 1:
        assert failure is not None
        raise failure
    if rank == ranks.rank and failure is not None:
        raise PrepareFailed(f"{message} (rank {rank} of {ranks.world_size})") from failure
    raise PrepareFailed(f"{message} (rank {rank} of {ranks.world_size})")


def _plan(
    inputs: list[str],
    tokenizer: str,
    out: Path,
    workers: int,
    text_field: str,
    unit_bytes: int,
    split: str,
    names: OptionNames,
) -> _Plan:
    """Phase 1 on each rank: check the arguments, identify the tokenizer, resolve the
    inputs and cut them into units."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise StoreError(
            f"output {str(out)!r} already exists; choose another path or delete it first."
        )
    most = max_workers()
    if not 1 <= workers <= most:
        raise StoreError(
            f"workers must be in [1, {most}] (4 tokenizer processes per CPU at most), got "
            f"{workers}."
        )
    if unit_bytes < 1:
        raise StoreError(f"unit_bytes must be >= 1, got {unit_bytes}.")
    info = load_tokenizer_info(tokenizer)
    dtype_name = dtype_for_vocab(info.vocab_size)
    sources = select_splits(resolve_inputs(inputs), split, names)
    units = plan_units(sources, unit_bytes)
    identity = {
        "output": str(out.resolve()),
        "tokenizer": info.sha256,
        "text_field": text_field,
        "split": split,
        "unit_bytes": unit_bytes,
        "sources": input_identity(sources),
    }
    return _Plan(info, dtype_name, sources, units, identity, names)


def _difference(a: dict[str, Any], b: dict[str, Any], rank: int) -> str:
    """How rank ``rank``'s view of the inputs (``b``) differs from rank 0's (``a``)."""
    for key in ("output", "tokenizer", "text_field", "split", "unit_bytes"):
        if a[key] != b[key]:
            return f"rank 0 has {key} {a[key]!r}, rank {rank} has {b[key]!r}"
    sa = {s[0]: s for s in a["sources"]}
    sb = {s[0]: s for s in b["sources"]}
    for name in [*sa, *(n for n in sb if n not in sa)]:  # rank 0's order, then the rest
        if name not in sb:
            return f"{name!r} is an input on rank 0, not on rank {rank}"
        if name not in sa:
            return f"{name!r} is an input on rank {rank}, not on rank 0"
        if sa[name] != sb[name]:
            return (
                f"{name!r} is {sa[name][1]}, {sa[name][2]} bytes, modified at {sa[name][3]} ns "
                f"on rank 0 but {sb[name][1]}, {sb[name][2]} bytes, modified at {sb[name][3]} "
                f"ns on rank {rank}"
            )
    if a["sources"] != b["sources"]:
        return f"the inputs are in a different order on rank {rank} than on rank 0"
    return ""


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


def _unit_identity(plan: _Plan, unit: Unit, text_field: str) -> dict[str, Any]:
    return {
        **unit.describe(plan.sources[unit.source]),
        "tokenizer": plan.info.sha256,
        "text_field": text_field,
        "dtype": plan.dtype_name,
    }


def _open_staging(ranks: Ranks, plan: _Plan, staging: Path) -> None:
    """Rank 0 creates the staging folder (or finds an earlier run's), drops a killed
    run's unfinished files and writes the inputs' identity for the others to read."""
    if ranks.rank != 0:
        return
    parts = staging / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    for stale in parts.glob("*.tmp-*"):
        stale.unlink(missing_ok=True)
    tmp = staging / f"{RANKS_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(plan.identity, sort_keys=True) + "\n")
    os.replace(tmp, staging / RANKS_FILE)


def _check_shared(ranks: Ranks, plan: _Plan, staging: Path) -> None:
    """Every rank must see what rank 0 wrote into the staging folder."""
    try:
        shared = json.loads((staging / RANKS_FILE).read_text()) == plan.identity
    except (OSError, ValueError):
        shared = False
    if not shared:
        raise StoreError(
            f"rank {ranks.rank} cannot see {staging / RANKS_FILE}, written by rank 0: a "
            "prepare over several ranks needs the output's parent folder on a filesystem "
            "all ranks share (e.g. Lustre, GPFS, NFS)."
        )


def _stage(
    ranks: Ranks,
    plan: _Plan,
    staging: Path,
    workers: int,
    progress: bool,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """Phase 2 on each rank: make (or reuse) the parts of this rank's units; their
    records by unit index, and how many were reused. ``on_progress`` hears of every
    chunk and unit done."""
    parts = staging / PARTS
    text_field = plan.identity["text_field"]
    dtype = np.dtype("<u2" if plan.dtype_name == "uint16" else "<u4")
    owner = assign_units(plan.units, ranks.world_size)
    mine = [u for u in plan.units if owner[u.index] == ranks.rank]
    stats = {u.source: tuple(s[2:]) for u in mine for s in [plan.identity["sources"][u.source]]}
    records: list[tuple[int, dict[str, Any]]] = []
    hashes: dict[int, str] = {}
    identities = {u.index: _unit_identity(plan, u, text_field) for u in mine}
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
        """Keep an earlier run's part of ``u`` if intact and its input unchanged."""
        i = identities[u.index]
        rec = load_part(parts, part_key(i), i, hashes[u.index], dtype.itemsize)
        if rec is not None:
            records.append((u.index, rec))
            told(u.index, int(rec["documents"]))
        return rec is not None

    made_here: set[int] = set()
    bar = _progress_bar(progress and ranks.rank == 0)
    writer: PartWriter | None = None
    try:
        chunks = _unit_chunks(mine, plan.sources, text_field, stats, hashes, reuse, plan.names)
        info = plan.info
        for (index, last), flat, lengths in encode_in_order(
            chunks, str(info.path), info.eos_id, workers
        ):
            if writer is None:
                writer = PartWriter(parts, part_key(identities[index]), dtype)
            writer.add(flat, lengths)
            bar.update(int(lengths.size))
            if last:
                records.append((index, writer.finish(identities[index], hashes[index])))
                made_here.add(index)
                writer = None
                bar.set_postfix(parts=f"{len(records)}/{len(mine)}", refresh=False)
            told(index if last else None, int(lengths.size))
    finally:
        if writer is not None:
            writer.abort()
        bar.close()
    return records, len(records) - len(made_here)


def _unreadable(src: InputFile, e: OSError) -> StoreError:
    return StoreError(f"{src.path}: cannot read this input ({e.strerror or e}). Check the file.")


def _check_unchanged(src: InputFile, stat: tuple[int, ...]) -> None:
    try:
        now = source_stat(src)
    except OSError as e:
        raise _unreadable(src, e) from None
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
    (into ``hashes``) just before it is read, so an intact earlier part is reused
    (``reuse``) instead, and the read mostly hits the page cache. The source must be
    unchanged since the start before and after the read; an error carries the unit's
    index (and names options as ``names`` spells them)."""
    for u in units:
        src = sources[u.source]
        chunk: list[str] = []
        chars = 0
        try:
            hashes[u.index] = unit_input_hash(src, u)
            _check_unchanged(src, stats[u.source])
            if reuse(u):
                continue
            for text in iter_documents(src, text_field, u.part):
                chunk.append(text)
                chars += len(text)
                if chars >= _CHUNK_CHARS or len(chunk) >= _CHUNK_DOCS:
                    yield (u.index, False), chunk
                    chunk, chars = [], 0
            _check_unchanged(src, stats[u.source])
        except OSError as e:
            err = _unreadable(src, e)
            err.unit_index = u.index  # type: ignore[attr-defined]
            raise err from None
        except OptionError as e:
            err = e.spelled(names)
            err.unit_index = u.index  # type: ignore[attr-defined]
            raise err from None
        except StoreError as e:
            e.unit_index = u.index  # type: ignore[attr-defined]
            raise
        yield (u.index, True), chunk


def _layout(
    records: dict[int, dict[str, Any]], units: list[Unit]
) -> tuple[list[int], list[int], int, int]:
    """First token and first document of each unit's part in the store; the totals."""
    token_starts, doc_starts = [], []
    tokens = docs = 0
    for u in units:
        token_starts.append(tokens)
        doc_starts.append(docs)
        tokens += int(records[u.index]["tokens"])
        docs += int(records[u.index]["documents"])
    return token_starts, doc_starts, tokens, docs


def _assemble(
    ranks: Ranks,
    plan: _Plan,
    out: Path,
    staging: Path,
    gathered: list[tuple[int, dict[str, Any]]],
) -> TokenStore:
    """Phase 3: every rank copies its parts into the store's files at their offsets and
    hashes its share of the checksum chunks and of the sources; rank 0 writes the
    manifest and renames the store to ``out``."""
    records = dict(gathered)
    units, sources = plan.units, plan.sources
    token_starts, doc_starts, num_tokens, num_docs = _layout(records, units)
    if num_tokens == 0:
        raise EmptyCorpus(
            f"empty corpus: the inputs hold no documents with text (text field "
            f"{plan.identity['text_field']!r}). Check the paths and {plan.names.text_field}."
        )
    itemsize = 2 if plan.dtype_name == "uint16" else 4
    chunks = num_chunks(num_tokens)
    assembly = staging / ASSEMBLY

    def create() -> None:
        if ranks.rank == 0:
            if assembly.exists():  # a killed run's
                shutil.rmtree(assembly)
            create_store_files(assembly, num_tokens, num_docs, chunks, itemsize)

    _together(ranks, create)
    owner = assign_units(units, ranks.world_size)
    parts = staging / PARTS

    def copy() -> None:
        for u in units:
            if owner[u.index] == ranks.rank:
                write_part_into_store(
                    assembly, parts, records[u.index], token_starts[u.index],
                    doc_starts[u.index], itemsize,
                )  # fmt: skip

    _together(ranks, copy)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": {
            "sha256": plan.info.sha256,
            "vocab_size": plan.info.vocab_size,
            "eos_token": plan.info.eos_token,
        },
        "dtype": plan.dtype_name,
        "eos_id": plan.info.eos_id,
        "num_tokens": num_tokens,
        "num_documents": num_docs,
        "text_field": plan.identity["text_field"],
    }
    source_owner = assign_units(
        [Unit(k, k, None, (0, 0), s[2]) for k, s in enumerate(plan.identity["sources"])],
        ranks.world_size,
    )

    def hash_share() -> tuple[int, list[tuple[int, dict[str, Any]]]]:
        r, w = ranks.rank, ranks.world_size
        first, stop = chunks * r // w, chunks * (r + 1) // w
        top = write_chunk_checksums(assembly, manifest, first, stop) if stop > first else -1
        recs = []
        for k, src in enumerate(sources):
            if source_owner[k] == r:
                try:
                    recs.append((k, source_record(src)))
                except OSError as e:
                    raise _unreadable(src, e) from None
                _check_unchanged(src, tuple(plan.identity["sources"][k][2:]))
        return top, recs

    shares = _together(ranks, hash_share)
    records_by_source = dict(rec for _, recs in shares for rec in recs)
    source_records = [records_by_source[k] for k in range(len(sources))]
    for rec in source_records:
        rec["documents"] = rec["tokens"] = 0
    for u in units:
        source_records[u.source]["documents"] += int(records[u.index]["documents"])
        source_records[u.source]["tokens"] += int(records[u.index]["tokens"])
    manifest["sources"] = source_records

    def finish() -> None:
        if ranks.rank != 0:
            return
        top = max(t for t, _ in shares)
        manifest["content"] = content_section(assembly, top)
        manifest["fingerprint"] = manifest_fingerprint(manifest)
        (assembly / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()  # an empty folder, checked at the start
        os.rename(assembly, out)
        shutil.rmtree(staging, ignore_errors=True)

    _together(ranks, finish)
    return TokenStore.open(out)


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
