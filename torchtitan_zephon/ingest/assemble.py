"""Phases 3 and 4 of a prepare: the tokenized units become one token store at the output.

Role: every rank copies its tokenized units into the store's files at their offsets (in
unit order) and hashes its share of the checksum chunks and of the sources; once
rank 0 has the fingerprint, every rank writes the block checksums of its share of
the blocks (``store.writer.write_block_range``: the seed of a block checksum is the
fingerprint, which covers every chunk checksum, so they cannot be computed in the
first pass); rank 0 writes blocks.json, then the manifest, and renames the
assembled store to the output.

Invariants: the store's bytes are every tokenized unit in input order, whatever rank
made it; the output path holds either nothing or a complete store (renamed into
place last, the staging folder removed after). Inputs holding no document are
``EmptyCorpus`` (nothing worth keeping for a second run).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.inputs import source_record
from torchtitan_zephon.ingest.objects import fetch
from torchtitan_zephon.ingest.ranks import Ranks, together
from torchtitan_zephon.ingest.stage import Work, assign_units, check_unchanged, unreadable
from torchtitan_zephon.ingest.tokenized import (
    ASSEMBLY,
    TOKENIZED,
    create_store_files,
    unit_shards,
    write_unit_documents,
    write_unit_into_store,
    write_unit_shards,
)
from torchtitan_zephon.ingest.units import Unit
from torchtitan_zephon.store.format import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TOKENS,
    StoreError,
    content_section,
    manifest_fingerprint,
    map_file,
    num_blocks,
    num_chunks,
)
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import ShardList, open_shards, write_shard_list
from torchtitan_zephon.store.writer import (
    create_block_file,
    write_block_info,
    write_block_range,
    write_chunk_checksums,
)


class EmptyCorpus(StoreError):
    """The inputs hold no document: nothing worth keeping for a second run."""


def _layout(
    records: dict[int, dict[str, Any]], units: list[Unit]
) -> tuple[list[int], list[int], int, int]:
    """First token and first document of each tokenized unit in the store; the totals."""
    token_starts, doc_starts = [], []
    tokens = docs = 0
    for u in units:
        token_starts.append(tokens)
        doc_starts.append(docs)
        tokens += int(records[u.index]["tokens"])
        docs += int(records[u.index]["documents"])
    return token_starts, doc_starts, tokens, docs


def assemble(
    ranks: Ranks,
    work: Work,
    out: Path,
    staging: Path,
    gathered: list[tuple[int, dict[str, Any]]],
    block_tokens: int,
    shard_bytes: int | None = None,
) -> TokenStore:
    """Phase 3: every rank copies its tokenized units into the store's files at their offsets and
    hashes its share of the checksum chunks and of the sources; rank 0 writes the
    manifest and renames the store to ``out``; block checksums of ``block_tokens``.

    ``shard_bytes``: a store of more token bytes is sharded (``store.shards``): each
    tokenized unit becomes its own shards (linked when it is one, cut at ``shard_bytes``
    otherwise) instead of being copied into tokens.bin, so its tokens are written once;
    the shards follow the units, the manifest (fingerprint) is the one-file store's."""
    records = dict(gathered)
    units, sources = work.units, work.sources
    token_starts, doc_starts, num_tokens, num_docs = _layout(records, units)
    if num_tokens == 0:
        raise EmptyCorpus(
            f"empty corpus: the inputs hold no documents with text (text field "
            f"{work.identity['text_field']!r}). Check the paths and {work.names.text_field}."
        )
    itemsize = 2 if work.dtype_name == "uint16" else 4
    chunks = num_chunks(num_tokens)
    assembly = staging / ASSEMBLY
    shard_tokens = max(1, shard_bytes // itemsize) if shard_bytes else 0
    sharded = bool(shard_tokens) and num_tokens > shard_tokens
    first_shard, counts = [], []  # per unit: its first shard; per shard: its tokens
    for u in units:
        first_shard.append(len(counts))
        if sharded:
            counts += unit_shards(records[u.index], shard_tokens)

    def create() -> None:
        if ranks.rank == 0:
            if assembly.exists():  # a killed run's
                shutil.rmtree(assembly)
            create_store_files(assembly, num_tokens, num_docs, chunks, itemsize, sharded=sharded)

    together(ranks, create)
    owner = assign_units(units, ranks.world_size)
    folder = staging / TOKENIZED

    def copy() -> None:
        for u in units:
            if owner[u.index] != ranks.rank:
                continue
            rec, start, doc = records[u.index], token_starts[u.index], doc_starts[u.index]
            if sharded:
                write_unit_shards(
                    assembly, folder, rec, first_shard[u.index], shard_tokens, itemsize
                )
                write_unit_documents(assembly, folder, rec, start, doc)
            else:
                write_unit_into_store(assembly, folder, rec, start, doc, itemsize)

    together(ranks, copy)

    def tokens() -> Any:  # the assembled tokens, once every rank wrote its share
        if sharded:
            return open_shards(assembly, ShardList(counts), DTYPES[work.dtype_name])
        return map_file(assembly / TOKENS, DTYPES[work.dtype_name], num_tokens)

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": {
            "sha256": work.info.sha256,
            "vocab_size": work.info.vocab_size,
            "eos_token": work.info.eos_token,
        },
        "dtype": work.dtype_name,
        "eos_id": work.info.eos_id,
        "num_tokens": num_tokens,
        "num_documents": num_docs,
        "text_field": work.identity["text_field"],
    }
    source_owner = assign_units(
        [Unit(k, k, None, (0, 0), s[2]) for k, s in enumerate(work.identity["sources"])],
        ranks.world_size,
    )

    def hash_share() -> tuple[int, list[tuple[int, dict[str, Any]]]]:
        r, w = ranks.rank, ranks.world_size
        first, stop = chunks * r // w, chunks * (r + 1) // w
        top = (
            write_chunk_checksums(assembly, manifest, first, stop, tokens=tokens())
            if stop > first
            else -1
        )
        recs = []
        for k, src in enumerate(sources):
            if source_owner[k] == r:
                try:
                    fetch(src)  # there already, unless its tokenized unit was an earlier run's
                    recs.append((k, source_record(src)))
                except OSError as e:
                    raise unreadable(src, e) from None
                check_unchanged(src, tuple(work.identity["sources"][k][2:]))
        return top, recs

    shares = together(ranks, hash_share)
    records_by_source = dict(rec for _, recs in shares for rec in recs)
    source_records = [records_by_source[k] for k in range(len(sources))]
    for rec in source_records:
        rec["documents"] = rec["tokens"] = 0
    for u in units:
        source_records[u.source]["documents"] += int(records[u.index]["documents"])
        source_records[u.source]["tokens"] += int(records[u.index]["tokens"])
    manifest["sources"] = source_records

    def seal() -> str | None:
        if ranks.rank != 0:
            return None
        top = max(t for t, _ in shares)
        manifest["content"] = content_section(assembly, top)
        manifest["fingerprint"] = manifest_fingerprint(manifest)
        create_block_file(assembly, num_tokens, block_tokens)
        return manifest["fingerprint"]

    manifest["fingerprint"] = together(ranks, seal)[0]

    def block_share() -> None:
        r, w, blocks = ranks.rank, ranks.world_size, num_blocks(num_tokens, block_tokens)
        write_block_range(
            assembly,
            tokens(),
            manifest["fingerprint"],
            blocks * r // w,
            blocks * (r + 1) // w,
            block_tokens,
        )

    together(ranks, block_share)

    def finish() -> None:
        if ranks.rank != 0:
            return
        write_block_info(assembly, manifest["fingerprint"], num_tokens, block_tokens)
        if sharded:
            write_shard_list(assembly, manifest["fingerprint"], counts)
        (assembly / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()  # an empty folder, checked at the start
        os.rename(assembly, out)
        shutil.rmtree(staging, ignore_errors=True)

    together(ranks, finish)
    return TokenStore.open(out)
