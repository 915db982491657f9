"""Upgrading a store in place: checksums beside the unchanged manifest.

Role: ``zephon inspect STORE --upgrade`` runs both: ``upgrade_store`` adds checksums.bin
and content.json to a store written before checksums (format version 1);
``add_block_checksums`` adds blocks.bin and blocks.json (the finer check level that
reads from object storage use, ``format``) to a store that has content checksums, or
rewrites them for another block size (``--block-tokens``).

Invariant: the manifest, hence the fingerprint and every checkpoint and sequence
log that names it, stays byte for byte the same; a store whose content is already
inconsistent is refused and left as it was (content.json, blocks.json are written last).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

from torchtitan_zephon.store.format import (
    BLOCK_TOKENS,
    BLOCKS_INFO,
    CHECKSUMS,
    CONTENT,
    REPREPARE,
    TOKENS,
    StoreError,
    UncheckedStoreWarning,
    check_block_tokens,
    content_checksums,
)
from torchtitan_zephon.store.opening import read_blocks_info
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_block_checksums, write_checksums


def upgrade_store(path: str | os.PathLike) -> tuple[TokenStore, bool]:
    """Add content checksums to a version-1 store in place; (the store, whether it changed).

    Writes checksums.bin and content.json; the manifest, hence the fingerprint, stays
    byte for byte the same. The content is first checked as far as it can be without
    checksums (ids within the vocabulary, document offsets, EOS at document ends); a
    store failing that is refused and left as it was. A store that already has
    checksums is left alone.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncheckedStoreWarning)
        store = TokenStore.open(path)
    if store.checksums is not None:
        return store, False
    content = write_checksums(store.path, store.manifest)
    problems = store.structure_problems(content["max_token_id"])
    if problems:
        (store.path / CHECKSUMS).unlink(missing_ok=True)
        raise StoreError(
            f"token store {str(store.path)!r} was not upgraded: its content is already "
            f"inconsistent ({'; '.join(problems)}), and checksums would vouch for it. "
            f"Nothing was changed. {REPREPARE}"
        )
    tmp = store.path / f".{CONTENT}.tmp"
    tmp.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, store.path / CONTENT)  # last: until here the store is unchanged
    return TokenStore.open(store.path), True


def add_block_checksums(
    path: str | os.PathLike, block_tokens: int | None = None
) -> tuple[TokenStore, bool]:
    """Add block checksums (blocks.bin, then blocks.json: ``format``) of ``block_tokens``
    to a store that has content checksums; (the store, whether it changed). The
    manifest, hence the fingerprint, stays byte for byte the same, and so do reads of the
    local store (its reads check whole chunks, as before).

    ``block_tokens`` None: a store with block checksums for its fingerprint keeps them
    (whatever their size); one without gets blocks of ``BLOCK_TOKENS``. Given: blocks
    of another size are rewritten, blocks of that size kept. It must be an integer in
    [1, ``MAX_BLOCK_TOKENS``] (checked before anything is read or written).

    Block checksums are written only from tokens that matched every chunk checksum: a
    store with a bad chunk is refused and left as it was. blocks.json naming another
    fingerprint (left by an earlier version of the store) is replaced.
    """
    if block_tokens is not None:
        block_tokens = check_block_tokens(block_tokens, "--block-tokens")
    store = TokenStore.open(path)
    root = Path(store.path)
    if store.checksums is None:
        raise StoreError(
            f"token store {str(root)!r} has no content checksums: block checksums are "
            "written from checked tokens only. Add content checksums first "
            f"(`zephon inspect {root} --upgrade` does both)."
        )
    try:
        info = read_blocks_info(root, store.manifest)
    except StoreError:
        info = None  # blocks of another version of the store, or broken: written afresh
    if info is not None and block_tokens in (None, int(info["block_tokens"])):
        return store, False
    size = BLOCK_TOKENS if block_tokens is None else block_tokens
    sums = content_checksums(store.tokens, store.chunk_tokens)[0]
    bad = np.flatnonzero(sums != np.asarray(store.checksums))
    if bad.size:
        raise StoreError(
            f"token store {str(root)!r}: no block checksums were added: {bad.size} chunk(s) "
            f"of {TOKENS} do not match their checksums (first: chunk {int(bad[0])}), and "
            f"block checksums would vouch for them. Nothing was changed. Run `zephon inspect "
            f"{root} --check` to list them. {REPREPARE}"
        )
    (root / BLOCKS_INFO).unlink(missing_ok=True)  # a stale one never names the new blocks.bin
    write_block_checksums(root, store.tokens, store.fingerprint, size)  # blocks.json last
    return TokenStore.open(root), True
