"""The builtin default store: training data that needs no download.

Text that ships with every CPython: the documentation topics of ``pydoc_data``
(English prose) and the top-level standard-library sources (code), tokenized
with the BPE tokenizer shipped in ``torchtitan_zephon/assets/tokenizer``.
Besides the whole store, each half is a store of its own (``PARTS``: "docs",
"stdlib"), named ``builtin:docs`` / ``builtin:stdlib`` where a store path is
expected in a mixture file (``job.stores.store_location``), so a two-source mixture needs
no data either.

Invariant: a store is a pure function of (this Python's text files, the shipped
tokenizer, the part); it is built once into a cache folder keyed by a hash of
these (``cache_folder.build_once``), so every rank and every later run on the machine
opens the same bytes.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.cache_folder import build_once, cache_root
from torchtitan_zephon.store.format import BUILTIN_PREFIX

__all__ = ["PARTS", "TOKENIZER_DIR", "builtin_store_path", "cache_root", "corpus_documents"]

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"


PARTS = {"docs": "pydoc_topics/", "stdlib": "stdlib/"}
"""The halves of the builtin corpus: part name -> prefix of its document names."""


def corpus_documents(part: str = "all") -> list[tuple[str, str]]:
    """(name, text) of every builtin document (of one of ``PARTS``), in a fixed order."""
    if part != "all":
        prefix = _part_prefix(part)
        return [d for d in corpus_documents() if d[0].startswith(prefix)]
    import pydoc_data.topics

    docs = [
        (f"pydoc_topics/{k}.txt", pydoc_data.topics.topics[k])
        for k in sorted(pydoc_data.topics.topics)
    ]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        docs.append((f"stdlib/{path.name}", path.read_text(encoding="utf-8", errors="replace")))
    return docs


def _key(docs: list[tuple[str, str]]) -> str:
    from torchtitan_zephon.store.format import FORMAT_VERSION

    # "canonical-names": sources are named relative to their deepest common folder
    # (inputs.resolve_inputs) since the builtin entries of this key were built.
    h = hashlib.sha256(f"store-format-{FORMAT_VERSION}\0canonical-names\0".encode())
    h.update((TOKENIZER_DIR / "tokenizer.json").read_bytes())
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode("utf-8", errors="replace") + b"\0")
    return h.hexdigest()[:16]


def _part_prefix(part: str) -> str:
    if part not in PARTS:
        raise ValueError(
            f"unknown builtin store part {part!r}; expected one of {sorted(PARTS)} "
            f'(e.g. store = "{BUILTIN_PREFIX}docs" in a mixture file).'
        )
    return PARTS[part]


def builtin_store_path(*, progress: bool = False, part: str = "all") -> Path:
    """Path of the builtin store (or of one of its ``PARTS``), building it on first use
    (``cache_folder.build_once``), with a progress bar when ``progress``. Each call hashes the
    corpus (~5 MB of text) to find its folder: a job asks once (``job.stores.store_location``)."""
    from torchtitan_zephon.ingest.prepare import prepare_store

    docs = corpus_documents(part)
    out = cache_root() / (
        f"builtin-{_key(docs)}" if part == "all" else f"builtin-{part}-{_key(docs)}"
    )

    def build(dest: Path, tell: Callable[[dict[str, Any]], None]) -> None:
        # A fixed folder name: the manifest names sources relative to it.
        corpus = (
            dest.parent
            / "corpus"
            / ("python-docs-and-stdlib" if part == "all" else f"python-{part}")
        )
        for name, text in docs:
            p = corpus / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
        prepare_store(
            [str(corpus)], str(TOKENIZER_DIR), str(dest), workers=1, progress=progress,
            on_progress=tell,
        )  # fmt: skip

    return build_once(out, build, what=f"the builtin store ({part})")
