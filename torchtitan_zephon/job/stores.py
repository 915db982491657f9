"""Where a job's stores are: a store value as a token store folder, a mixture's stores.

Role: a store value is a store folder, an object-storage URL of one (``s3://``,
``gs://``, ``az://``: read by range, ``store.remote``; ``file://``: a folder),
``builtin:PART`` (a part of the builtin corpus, built on first use) or raw inputs (a text/JSONL/Parquet file, a folder
of them, a glob pattern or a comma-separated list) that ``ingest.cache``
prepares into the cache on first use. ``store_location`` turns one into a store
folder; ``open_mixture_stores`` opens every source of a mixture.

Invariant: a value that names no store and no raw inputs, or raw inputs when no
tokenizer was given, is refused with what was expected and what to do; a URL is
never taken as a local path: a URL of raw inputs (``cache.names_raw_objects``: a
pattern, a list, a .jsonl/.json/.parquet object) is prepared into the same cache as
local raw inputs, any other URL is a store's prefix; a mixture's missing or broken
store names its source.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.builtin import builtin_store_path
from torchtitan_zephon.ingest.cache import RawInputs, names_raw_objects, names_store, raw_store
from torchtitan_zephon.order.mixture.config import MixtureConfig, MixtureError
from torchtitan_zephon.store.format import BUILTIN_PREFIX, StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.urls import is_url, parse_url, redact, refuse_mistyped_url


def store_location(
    value: str, raw: RawInputs | None = None, *, progress: bool = False
) -> Path | str:
    """The token store folder a store value names, built on first use where it is a
    builtin part (with a progress bar when ``progress``) or raw inputs (as ``raw``
    says; None: raw inputs are refused); an object-storage URL of a store is returned
    as it is (checked: scheme, bucket, prefix), for ``TokenStore.open``. A URL written
    with one slash (``s3:/b/q``) is refused, never taken as a local path."""
    for item in value.split(","):
        refuse_mistyped_url(item.strip(), "the store")
    if is_url(value) and not names_raw_objects(value):
        found = parse_url(value, "the store")
        return Path(found) if isinstance(found, str) else value
    if value.startswith(BUILTIN_PREFIX):
        return builtin_store_path(progress=progress, part=value[len(BUILTIN_PREFIX) :])
    if not is_url(value) and names_store(value):
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
            f"{redact(value)!r} names raw inputs, not a token store, and no tokenizer was "
            f"given to prepare them. Prepare them first (`zephon prepare {redact(value)} "
            "--tokenizer DIR "
            "--output STORE`) and name the store, or train on them directly: the trainer "
            "prepares raw inputs with the tokenizer at hf_assets_path (TOML: model.hf_assets_path)."
        )
    return raw_store(value, raw)


def open_mixture_stores(
    config: MixtureConfig, *, progress: bool = False, raw: Any = None, remote: Any = None
) -> dict[str, TokenStore]:
    """Open every source's TokenStore (``builtin:PART`` values are built on first use,
    with a progress bar when ``progress``; raw inputs are prepared as ``raw``, a
    ``cache.RawInputs``, says, or refused when it is None); a missing or broken store
    names its source."""
    stores = {}
    for s in config.sources:
        try:
            location = store_location(s.store, raw, progress=progress)
            stores[s.name] = TokenStore.open(location, remote=remote)
        except (StoreError, ValueError) as e:
            raise MixtureError(f"mixture source {s.name!r}: {e}") from None
    return stores


RAW_HINT = (  # said by the zephon commands that open a store by name
    "pass --tokenizer DIR (the trainer's hf_assets_path; TOML: model.hf_assets_path) and, when the text is not in "
    "the field 'text', --text-field F (the trainer's zephon.text_field): zephon plan then "
    "prepares them into the store cache as the trainer does"
)


def open_named_store(value: str, raw: RawInputs | None) -> TokenStore:
    """The store ``value`` names (``zephon plan --store``, ``show STORE``, a run's recorded
    store): a store folder, ``builtin:PART``, or raw inputs (prepared with ``raw``)."""
    if raw is None and not value.startswith("builtin:"):
        try:
            return TokenStore.open(value)
        except StoreError as e:
            if names_store(value):
                raise
            raise StoreError(f"{e} {value!r} names raw inputs: {RAW_HINT}.") from None
    return TokenStore.open(store_location(value, raw))
