"""A process that reads windows of a remote store through the node cache (the
two-process test of test_node_cache.py spawns it; kept light to start fast)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from torchtitan_zephon.store.remote import RemoteTokenStore
from torchtitan_zephon.store.remote_options import RemoteOptions
from torchtitan_zephon.store.urls import parse_url


def read(url: str, root: str, ids: list[int], seq_len: int, endpoint: str, out) -> None:  # noqa: ANN001
    """Put (the windows' bytes, bytes fetched, cache hits) of ``ids`` on the queue ``out``."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    options = RemoteOptions(cache_bytes=1 << 20, cache_dir=str(Path(root)))
    store = RemoteTokenStore.open_url(parse_url(url), options=options)
    windows = store.windows(np.array(ids), seq_len)
    out.put((windows.tobytes(), store.fetched_bytes, store.cache.hits))
    store.close()
