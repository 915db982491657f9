"""Build a token store from raw text (``zephon prepare``), in one process or many.

Role: identify the tokenizer (a Hugging Face ``tokenizer.json`` and its EOS:
``tokenizer.py``), cut the inputs (``inputs.py``) into work units (``units.py``),
tokenize each unit into a tokenized unit in a staging folder beside the output
(``stage.py``, ``tokenized.py``; each rank of a group, ``ranks.py``, its share of the
units, with ``encode.py``'s worker processes), then assemble the tokenized units into a
token store (``assemble.py``, ``store/``): every document's tokens followed by
one EOS token, in input order. This module runs the phases below in turn.

Phases, the same code for one process or many (``Ranks``): (1) every rank
resolves the inputs and cuts them into units; ranks that see different inputs
are refused. (2) Units go to ranks by ``assign_units``; each rank makes the
tokenized units of its units, reusing an earlier run's intact tokenized units. (3) Rank 0 creates
the store's files at their final sizes; every rank writes its tokenized units at their
offsets, then hashes a contiguous share of the checksum chunks and its share of
the sources (sha256 records). (4) Rank 0 computes the fingerprint; every rank
writes the block checksums of a contiguous share of the blocks (seeded with the
fingerprint); rank 0 writes blocks.json, the manifest, and renames the assembled
store to the output; the staging folder is removed.

Invariants: the store's bytes depend only on the inputs' contents, their names
relative to the given inputs, the tokenizer, ``text_field`` and ``split`` (which
splits of a Hugging Face DatasetDict are read: ``inputs.select_splits``; the
manifest records them for such sources only); never on the
number of ranks or workers, the unit size, chunking, absolute paths, timing or
how many earlier runs were interrupted, nor on whether the inputs are read from
local disk or object storage (``objects``). The one exception: a store of more than
``shard_bytes`` of tokens is sharded (``store.shards``), each tokenized unit becoming its
own shards (its tokens written once), so which shard file holds which tokens follows
the units (the unit size, ``shard_bytes``), still never the ranks or workers; the
tokens, the manifest and the fingerprint are those of the one-file store. The output path holds either nothing
or a complete store (renamed into place last; an output URL: manifest.json
uploaded last, so a prefix without it is no store). A prepare that fails or is
interrupted keeps its finished tokenized units in ``.<name>.prepare`` beside the output
(its error names the folder); the same command run again reuses them. Two
prepares of one output never run at once: rank 0 holds ``WriterLock`` (flock)
throughout, and a second prepare is refused naming the holder. An input
that changes while a prepare reads it is an error (size and modification time
checked before and after each unit and at the end, the unit's bytes hashed).
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.assemble import EmptyCorpus, assemble
from torchtitan_zephon.ingest.cache_folder import cache_root
from torchtitan_zephon.ingest.encode import max_workers
from torchtitan_zephon.ingest.inputs import (
    PREPARE_OPTIONS,
    OptionNames,
    dataset_dict_splits,
    resolve_inputs,
    select_splits,
)
from torchtitan_zephon.ingest.objects import (
    OUTPUT,
    SPOOL,
    check_output,
    is_object_url,
    output_url,
    release,
    upload_shards,
    upload_store,
)
from torchtitan_zephon.ingest.ranks import OneProcess, PrepareFailed, Ranks, together
from torchtitan_zephon.ingest.stage import Work, check_shared, open_staging, stage_units
from torchtitan_zephon.ingest.tokenized import WriterLock, finished_units, staging_folder
from torchtitan_zephon.ingest.tokenizer import dtype_for_vocab, load_tokenizer_info
from torchtitan_zephon.ingest.units import UNIT_BYTES, cut_units, input_identity
from torchtitan_zephon.store.format import (
    BLOCK_TOKENS,
    StoreError,
    check_block_tokens,
    fingerprint,
)
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import SHARD_BYTES
from torchtitan_zephon.store.urls import ObjectURL


class PrepareInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a prepare; the message names the kept staging folder, if any."""


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
    cache_dir: str = "",
    block_tokens: int = BLOCK_TOKENS,
    shard_bytes: int | None = SHARD_BYTES,
) -> TokenStore:
    """Tokenize ``inputs`` into a new token store at ``output`` and open it.

    ``ranks``: the processes sharing the work (default: this one alone); every rank
    calls this with the same arguments and gets the same store. ``unit_bytes``: the
    target size of a work unit (the store does not depend on it). ``split``: the
    split of each Hugging Face DatasetDict to read (empty: ``train``; ``all``: every
    split, sorted). ``names``: how the caller spells ``--text-field`` / ``--split`` in
    its messages. ``report``, if given, receives a summary: units, tokenized units reused from
    an earlier run, tokens, documents, seconds, the splits read. ``on_progress``, if
    given, is called on this rank with its progress (``phase``, ``units`` /
    ``units_done``, input ``bytes`` / ``bytes_done``, ``documents``), often: it
    should be cheap. A failed or interrupted prepare keeps its finished tokenized units in
    the staging folder beside the output, and a second run reuses them.
    ``block_tokens``: tokens per block checksum (``store.format``: pick the jobs'
    seq_len or a divisor of it); an integer in [1, ``MAX_BLOCK_TOKENS``], checked before
    anything is read or written. Blocks are not part of the manifest: the fingerprint
    does not depend on it. ``shard_bytes``: a store of more token bytes keeps its tokens
    in shards of at most that many bytes (``store.shards``: each tokenized unit one shard or
    more, its tokens written once), not one tokens.bin; None: one tokens.bin always.
    Shards are not part of the manifest either.

    Inputs and ``output`` may be object-storage URLs (``objects``): objects are
    streamed to spool files in ``<cache>/remote-inputs`` and removed when the prepare
    ends (written, failed or interrupted); a store for a URL is built in ``<cache>/remote-output/<digest>/store``
    (staging beside it) and uploaded with manifest.json last, then the local copy is
    removed. ``<cache>`` is ``cache_folder.cache_root(cache_dir)``; under torchrun the
    ranks must share it when the output is a URL (they share the staging folder).
    """
    block_tokens = check_block_tokens(block_tokens)
    if shard_bytes is not None and (type(shard_bytes) is not int or shard_bytes < 1):
        raise StoreError(
            f"shard_bytes must be an integer >= 1 (the most token bytes of one shard file), "
            f"or None for one tokens.bin; got {shard_bytes!r}; nothing was written."
        )
    ranks = ranks or OneProcess()
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    remote = output_url(output) if is_object_url(output) else None
    if remote is not None:
        digest = hashlib.sha256(remote.text.encode()).hexdigest()[:24]
        out = cache_root(cache_dir) / OUTPUT / digest / "store"
    else:
        # Absolute and without . or ..: ``.`` (an empty current folder) has a parent to
        # stage beside, and the renames do not depend on the current folder, the output's.
        out = Path(os.path.abspath(output))
    staging = staging_folder(out)
    spool = cache_root(cache_dir) / SPOOL
    local: dict[str, Work] = {}

    def phase_one() -> str:
        local["work"] = _set_up(
            inputs, tokenizer, out, workers, text_field, unit_bytes, split, names, remote, spool
        )
        return fingerprint(local["work"].identity)

    digests = together(ranks, phase_one)
    mine = local["work"]
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

    def take() -> None:
        if ranks.rank == 0:
            lock.acquire()
            if remote is not None and out.exists():  # left by an upload that failed
                shutil.rmtree(out)

    together(ranks, take)
    try:
        together(ranks, lambda: open_staging(ranks, mine, staging))
        together(ranks, lambda: check_shared(ranks, mine, staging))
        stats = together(
            ranks, lambda: stage_units(ranks, mine, staging, workers, progress, on_progress)
        )
        if on_progress is not None:
            on_progress({"phase": "assembling"})
        store = assemble(
            ranks, mine, out, staging, [s for st in stats for s in st[0]], block_tokens,
            shard_bytes,
        )  # fmt: skip
        if remote is not None:
            if on_progress is not None:
                on_progress({"phase": "uploading"})
            together(ranks, lambda: upload_shards(out, remote, ranks.rank, ranks.world_size))
            together(ranks, lambda: upload_store(out, remote) if ranks.rank == 0 else None)
            together(ranks, lambda: shutil.rmtree(out) if ranks.rank == 0 else None)
            store = TokenStore.open(remote.text)
        together(ranks, lambda: release(mine.sources))
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
        release(mine.sources)  # this rank's spool files, whether the prepare ended well or not
        if remote is not None and ranks.rank == 0:
            try:
                out.parent.rmdir()  # empty once the store is uploaded (kept tokenized units stay)
            except OSError:
                pass
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
    """After a failure: the staging folder stays if it holds finished tokenized units worth reusing
    (the note saying so), else rank 0 removes it."""
    try:
        if keep and finished_units(staging):
            return (
                f"The finished parts are kept in {staging}: run the same command again to "
                f"continue; delete {staging} to start over."
            )
        if ranks.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        pass
    return ""


def _set_up(
    inputs: list[str],
    tokenizer: str,
    out: Path,
    workers: int,
    text_field: str,
    unit_bytes: int,
    split: str,
    names: OptionNames,
    remote: ObjectURL | None = None,
    spool: Path | None = None,
) -> Work:
    """Phase 1 on each rank: check the arguments, identify the tokenizer, resolve the
    inputs and cut them into units."""
    if remote is not None:
        check_output(remote)
    elif out.exists() and not (out.is_dir() and not any(out.iterdir())):
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
    sources = select_splits(resolve_inputs(inputs, spool), split, names)
    units = cut_units(sources, unit_bytes)
    identity = {
        "output": remote.shown if remote is not None else str(out.resolve()),
        "tokenizer": info.sha256,
        "text_field": text_field,
        "split": split,
        "unit_bytes": unit_bytes,
        "sources": input_identity(sources),
    }
    return Work(info, dtype_name, sources, units, identity, names)


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
