"""The benchmark corpus: the builtin store's source documents, as files other
loaders can read.

Invariant: the JSONL file holds exactly ``ingest.builtin.corpus_documents()``
in order, one ``{"text": ...}`` per line, so the stock TorchTitan loader, the
prepare benchmark and the builtin Zephon store all see the same text.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR, builtin_store_path, corpus_documents
from torchtitan_zephon.store.reader import TokenStore

__all__ = ["TOKENIZER_DIR", "builtin_store", "write_jsonl"]


def write_jsonl(folder: Path, *, max_docs: int | None = None, repeat: int = 1) -> Path:
    """Write the corpus (or its first ``max_docs`` documents) ``repeat`` times over to
    ``folder/corpus.jsonl`` (or ``corpus-xR.jsonl``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("corpus.jsonl" if repeat == 1 else f"corpus-x{repeat}.jsonl")
    docs = corpus_documents()
    if max_docs is not None:
        docs = docs[:max_docs]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(repeat):
            for name, text in docs:
                f.write(json.dumps({"text": text, "name": name}) + "\n")
    return path


def builtin_store() -> TokenStore:
    """The builtin store (built on first use)."""
    return TokenStore.open(builtin_store_path())
