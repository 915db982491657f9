"""Tokenize chunks of documents, in this process or in worker processes.

Role: turn ``(tag, texts)`` chunks into ``(tag, tokens, lengths)``: every
document's token ids followed by one EOS id (uint32), and each document's
length including its EOS.

Invariant: results come back in the order the chunks were given, and are the
same for any number of workers.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

_WORKER_TOKENIZER: Any = None
_WORKER_EOS: int = -1


def _init_worker(tokenizer_json: str, eos_id: int, limit_threads: bool) -> None:
    global _WORKER_TOKENIZER, _WORKER_EOS
    if limit_threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.from_file(tokenizer_json)
    _WORKER_EOS = eos_id


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (uint32, each document followed by EOS) and per-document lengths."""
    tok = _WORKER_TOKENIZER
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = [e.ids for e in encode(texts, add_special_tokens=False)]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    eos = [_WORKER_EOS]
    flat = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(x, eos) for x in ids),
        dtype=np.uint32,
        count=int(lengths.sum()),
    )
    return flat, lengths


def encode_in_order(
    chunks: Iterable[tuple[Any, list[str]]], tokenizer_json: str, eos_id: int, workers: int
) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
    """(tag, tokens, lengths) of each chunk, in input order, computed by ``workers`` processes."""
    if workers <= 1:
        _init_worker(tokenizer_json, eos_id, limit_threads=False)
        for k, texts in chunks:
            yield (k, *_encode_chunk(texts))
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(
        workers, initializer=_init_worker, initargs=(tokenizer_json, eos_id, True)
    ) as pool:
        pending: deque = deque()
        for k, texts in chunks:
            pending.append((k, pool.apply_async(_encode_chunk, (texts,))))
            if len(pending) >= 2 * workers:
                k0, res = pending.popleft()
                yield (k0, *res.get())
        while pending:
            k0, res = pending.popleft()
            yield (k0, *res.get())
