"""What opening a store checks: its manifest and checksums.bin, before anything is mapped.

Role: the checks ``reader.TokenStore.open`` makes of a store folder. The manifest
(``open_manifest``): a folder holding one, in the store format, of a readable version,
every field the reader uses well-formed (source records too), the recorded fingerprint
the one its contents hash to, at least one token. The content section
(``read_content``): the manifest's, or the content.json that ``migrate.old_stores.upgrade_store``
put beside a version-1 store. checksums.bin (``map_checksums``): the content section
well-formed, the file mapped at the size it implies and its xxh3-128 the one recorded.

Block checksums (``read_blocks_info`` / ``check_blocks_info``): blocks.json well-formed,
naming this manifest's fingerprint, and blocks.bin of the size it implies; blocks.bin
itself is read by range (``remote``) and checked block by block, never whole at open.

Invariant: each returns only what passed its checks, and raises a StoreError naming the
file, what is wrong and what to do otherwise; none reads tokens.bin or doc_offsets.bin
(the reader maps those, ``format.map_file`` checking their sizes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from torchtitan_zephon.store.format import (
    BLOCKS,
    BLOCKS_FORMAT,
    BLOCKS_INFO,
    CHECKSUM_ALGORITHM,
    CHECKSUMS,
    CONTENT,
    DTYPES,
    FORMAT,
    MANIFEST,
    READABLE_VERSIONS,
    REPREPARE,
    StoreError,
    check_file_size,
    manifest_fingerprint,
    map_file,
    num_blocks,
)


def open_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the store folder ``root``, checked (see the module docstring);
    StoreError when the store is not usable."""
    if not root.exists():
        raise StoreError(
            f"token store {str(root)!r} does not exist. Expected a folder made by "
            "`zephon prepare INPUT... --tokenizer DIR --output STORE`."
        )
    if not root.is_dir():
        raise StoreError(
            f"token store {str(root)!r} is a file, expected a folder made by `zephon prepare`."
        )
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise StoreError(
            f"token store {str(root)!r} has no {MANIFEST}; it is not a store or its "
            f"preparation did not finish. {REPREPARE}"
        )
    try:
        text = mpath.read_text()
    except (OSError, UnicodeDecodeError) as e:  # not text: a damaged or foreign file
        raise StoreError(f"cannot read {str(mpath)!r}: {e}. {REPREPARE}") from None
    return check_manifest(text, str(mpath), str(root))


def check_manifest(text: str, mpath: str, root: str) -> dict[str, Any]:
    """The manifest in ``text`` (read from ``mpath``, of the store ``root``: both as
    messages print them), checked: a local folder's and an object prefix's alike."""
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: deep JSON
        raise StoreError(f"cannot read {mpath!r}: {e}. {REPREPARE}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{mpath!r} is not a token store manifest (expected format {FORMAT!r}).")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS:
        raise StoreError(
            f"{mpath!r} has store format version {version!r}, this "
            f"version of zephon reads versions {list(READABLE_VERSIONS)}. {REPREPARE}"
        )
    try:
        expected = manifest["fingerprint"]
        if not isinstance(expected, str):
            raise TypeError(f"fingerprint is a {type(expected).__name__}, not text")
        DTYPES[manifest["dtype"]]
        num_tokens = int(manifest["num_tokens"])
        num_docs = int(manifest["num_documents"])
        if num_docs < 0:
            raise ValueError(f"num_documents is {num_docs}")
        int(manifest["tokenizer"]["vocab_size"]), manifest["tokenizer"]["sha256"]
        int(manifest["eos_id"])
        if version >= 2:
            manifest["content"]
        _check_sources(manifest.get("sources", []))
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # Overflow: 1e400
        raise StoreError(
            f"{mpath!r} is missing or has an invalid field ({e}). {REPREPARE}"
        ) from None
    actual = manifest_fingerprint(manifest)
    if actual != expected:
        raise StoreError(
            f"{mpath!r} was modified after preparation: recorded fingerprint "
            f"{expected[:16]}..., contents hash to {actual[:16]}.... {REPREPARE}"
        )
    if num_tokens < 1:
        raise StoreError(f"token store {root!r} holds no tokens. {REPREPARE}")
    return manifest


def read_content(root: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any] | None, Path]:
    """The content section of the store ``root`` (None: a version-1 store not upgraded)
    and the file it was read from, for messages."""
    if manifest["version"] >= 2:
        return manifest["content"], root / MANIFEST
    return _read_content(root), root / CONTENT


def map_checksums(root: Path, content: dict[str, Any], where: Path, num_tokens: int) -> np.ndarray:
    """Map checksums.bin after checking the content section (from ``where``) and the file's
    own hash against it."""
    chunk_tokens, recorded = check_content(content, str(where))
    checksums = map_file(root / CHECKSUMS, np.dtype("<u8"), -(-num_tokens // chunk_tokens))
    check_checksums(checksums, recorded, str(root / CHECKSUMS), where.name)
    return checksums


def check_content(content: dict[str, Any], where: str) -> tuple[int, str]:
    """(chunk_tokens, the recorded xxh3-128 of checksums.bin) of a well-formed content
    section (read from ``where``, as messages print it)."""
    try:
        chunk_tokens = int(content["chunk_tokens"])
        int(content["max_token_id"])
        recorded = str(content["checksums_xxh3_128"])
        str(content["doc_offsets_xxh3_128"])
        if content["algorithm"] != CHECKSUM_ALGORITHM or chunk_tokens < 1:
            raise ValueError(
                f"algorithm {content['algorithm']!r}, chunk_tokens {chunk_tokens}; expected "
                f"{CHECKSUM_ALGORITHM!r} and >= 1"
            )
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(
            f"{where!r}: the content section is missing or has an invalid field ({e}). {REPREPARE}"
        ) from None
    return chunk_tokens, recorded


def check_checksums(checksums: np.ndarray, recorded: str, file: str, where: str) -> None:
    """Refuse checksums (read from ``file``) whose xxh3-128 is not the one ``where``
    records."""
    found = xxhash.xxh3_128_hexdigest(checksums)
    if found != recorded:
        raise StoreError(
            f"store file {file!r} was modified after preparation: "
            f"{where} records xxh3-128 {recorded[:16]}..., the file hashes to "
            f"{found[:16]}.... {REPREPARE}"
        )


def read_blocks_info(root: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The checked blocks.json of the store folder ``root`` (None: it has none), its
    blocks.bin present at the size it implies."""
    path = root / BLOCKS_INFO
    if not path.exists():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(f"cannot read {str(path)!r}: {e}.") from None
    redo = f"Write it again with `zephon inspect {root} --upgrade`."
    info = check_blocks_info(text, str(path), manifest, redo)
    blocks = root / BLOCKS
    size = blocks.stat().st_size if blocks.is_file() else 0
    check_file_size(str(blocks), size, np.dtype("<u8"), int(info["num_blocks"]))
    return info


def check_blocks_info(text: str, where: str, manifest: dict[str, Any], redo: str) -> dict[str, Any]:
    """The block-checksum section in ``text`` (read from ``where``), checked against the
    store's ``manifest``; ``redo`` says how to write it afresh."""
    try:
        info = json.loads(text)
        if not isinstance(info, dict) or info.get("format") != BLOCKS_FORMAT:
            raise ValueError(f"expected a JSON object of format {BLOCKS_FORMAT!r}")
        block_tokens = int(info["block_tokens"])
        if info["algorithm"] != CHECKSUM_ALGORITHM or info["version"] != 1 or block_tokens < 1:
            raise ValueError(
                f"version {info['version']!r}, algorithm {info['algorithm']!r}, block_tokens "
                f"{block_tokens}; expected 1, {CHECKSUM_ALGORITHM!r} and >= 1"
            )
        str(info["blocks_xxh3_128"])
        found, expected = str(info["fingerprint"]), manifest["fingerprint"]
        count, want = int(info["num_blocks"]), num_blocks(int(manifest["num_tokens"]), block_tokens)
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise StoreError(f"cannot read {where!r} ({e}). {redo}") from None
    if found != expected:
        raise StoreError(
            f"{where!r} belongs to another version of the store: it names fingerprint "
            f"{found[:16]}..., the manifest's is {expected[:16]}.... {redo}"
        )
    if count != want:
        raise StoreError(
            f"{where!r} records {count} blocks, the store's {manifest['num_tokens']} tokens "
            f"make {want}. {redo}"
        )
    return info


def _read_content(root: Path) -> dict[str, Any] | None:
    """The content section a version-1 store gained by ``upgrade_store``, if any."""
    path = root / CONTENT
    if not path.exists():
        return None
    try:
        content = json.loads(path.read_text())
        if not isinstance(content, dict):
            raise ValueError(f"expected a JSON object, found {type(content).__name__}")
    except (OSError, ValueError) as e:
        raise StoreError(
            f"cannot read {str(path)!r}: {e}. Delete it and run `zephon inspect {root} "
            "--upgrade` again."
        ) from None
    return content


def _check_sources(sources: Any) -> None:
    """Source records as prepare writes them (inspect prints these fields)."""
    if not isinstance(sources, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("name"), str)
        and isinstance(s.get("sha256"), str)
        and isinstance(s.get("size"), int)
        and "kind" in s
        for s in sources
    ):
        raise TypeError("sources is not a list of {name, kind, sha256, size} records")
