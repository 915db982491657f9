"""Upgrading a version-1 store in place: content checksums beside the unchanged manifest.

Role: ``upgrade_store`` (``zephon inspect STORE --upgrade``) adds checksums.bin and
content.json to a store written before checksums.

Invariant: the manifest, hence the fingerprint and every checkpoint and sequence
log that names it, stays byte for byte the same; a store whose content is already
inconsistent is refused and left as it was (content.json is written last).
"""

from __future__ import annotations

import json
import os
import warnings

from torchtitan_zephon.store.format import (
    CHECKSUMS,
    CONTENT,
    REPREPARE,
    StoreError,
    UncheckedStoreWarning,
)
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_checksums


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
