"""How a store in object storage is read: ``RemoteOptions`` (read-ahead, request time
limit, node cache), the one owner of what those settings allow.

Invariant: constructing one refuses a value out of range (``ValueError``, one line
naming the setting); the defaults are the trainer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan_zephon.store.object_client import MAX_REQUESTS, REQUEST_TIMEOUT_S, RETRIES

READ_AHEAD_STEPS = 4
READ_AHEAD_BYTES = 256 << 20
CACHE_BYTES = 0


@dataclass(frozen=True)
class RemoteOptions:
    """How a remote store is read (the trainer's zephon.read_ahead_steps,
    zephon.read_ahead_bytes, zephon.request_timeout_s, zephon.cache_bytes and the folder
    zephon.cache_dir names). The one owner of what these settings allow: constructing
    one refuses a value out of range (``ValueError``, one line naming the setting), which
    the trainer does at start for every job (``titan.start.checks``), remote store or not."""

    read_ahead_steps: int = READ_AHEAD_STEPS
    """Steps whose windows each rank fetches ahead of the step it trains (0: none)."""
    read_ahead_bytes: int = READ_AHEAD_BYTES
    """Bytes of fetched windows a store holds at most, per process (0: one step at a
    time)."""
    request_timeout_s: float = REQUEST_TIMEOUT_S
    """Time limit of one attempt of a request (credential discovery included)."""
    max_requests: int = MAX_REQUESTS
    """Range requests in flight per store, at most."""
    retries: int = RETRIES
    """Attempts after the first for a transient failure (``location.RETRIES``)."""
    cache_bytes: int = CACHE_BYTES
    """Bound of the node-local cache (``store.cache``) in bytes; 0: no cache."""
    cache_dir: str = ""
    """The store cache folder the node cache lives under (its ``remote-blocks``
    subfolder); needed when ``cache_bytes`` > 0."""

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("read_ahead_steps", self.read_ahead_steps, "a number of steps >= 0 (0: none)"),
            ("read_ahead_bytes", self.read_ahead_bytes, "bytes >= 0 (0: one step at a time)"),
            ("cache_bytes", self.cache_bytes, "bytes >= 0 (0: no node cache)"),
        ):
            if value < 0:
                raise ValueError(
                    f"zephon.{name} = {value}: it must be {allowed}. Set --zephon.{name} 0 or more."
                )
        timeout = self.request_timeout_s
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(
                f"zephon.request_timeout_s = {timeout}: it must be a finite number of seconds "
                f"> 0 (the default is {REQUEST_TIMEOUT_S:g}). Set --zephon.request_timeout_s."
            )
        if self.cache_bytes > 0 and not self.cache_dir:
            raise ValueError("zephon.cache_bytes > 0 needs the cache folder (cache_dir).")
