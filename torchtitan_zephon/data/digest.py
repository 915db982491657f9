"""Canonical JSON and the fingerprints built on it.

Role: one definition of "the bytes of a JSON value" for everything that
fingerprints one (store manifests, data configs, sequence-log records), so two
modules can never disagree about a fingerprint because they serialised a dict
differently.

Invariant: ``canonical_json(x) == canonical_json(y)`` exactly when ``x`` and
``y`` are equal JSON values (keys sorted, no whitespace, ASCII only), and
``fingerprint`` is the hex sha256 of those bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, ASCII only: the same value always gives the same bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def fingerprint(value: Any) -> str:
    """Hex sha256 of ``canonical_json(value)``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
