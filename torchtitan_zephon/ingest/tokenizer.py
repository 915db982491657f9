"""The tokenizer of a prepare: a Hugging Face ``tokenizer.json``, its EOS and the store dtype.

Role: ``load_tokenizer_info`` identifies the tokenizer of a folder (the sha256 of
its ``tokenizer.json``, which the manifest records), its vocabulary size and its
EOS token (``tokenizer_config.json``'s ``eos_token``, else the first of
``EOS_FALLBACKS`` in the vocabulary); ``dtype_for_vocab`` picks the store dtype.

Invariant: the same ``tokenizer.json`` bytes and ``tokenizer_config.json`` give the
same ``TokenizerInfo`` (path aside) wherever the folder is; a folder without a
readable tokenizer or an EOS token is a ``StoreError`` saying what to add.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from torchtitan_zephon.store.format import StoreError

EOS_FALLBACKS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


@dataclass(frozen=True)
class TokenizerInfo:
    path: Path  # the tokenizer.json file
    sha256: str
    vocab_size: int
    eos_token: str
    eos_id: int


def load_tokenizer_info(tokenizer_dir: str | os.PathLike) -> TokenizerInfo:
    """Identify the tokenizer in ``tokenizer_dir`` (a folder with tokenizer.json) and its EOS."""
    from tokenizers import Tokenizer

    root = Path(tokenizer_dir)
    tj = root / "tokenizer.json" if root.is_dir() else root
    if not root.exists():
        raise StoreError(
            f"tokenizer folder {str(root)!r} does not exist; expected a folder holding "
            "a Hugging Face tokenizer.json."
        )
    if not tj.is_file() or tj.name != "tokenizer.json":
        raise StoreError(
            f"no tokenizer.json found in {str(root)!r}; expected a folder holding a Hugging "
            "Face tokenizer.json (e.g. from `tokenizer.save_pretrained(DIR)`)."
        )
    data = tj.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode())
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise StoreError(f"cannot load tokenizer {str(tj)!r}: {e}") from None
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    candidates: list[str] = []
    config = tj.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            candidates.append(eos)
    candidates.extend(EOS_FALLBACKS)
    for name in candidates:
        eos_id = tok.token_to_id(name)
        if eos_id is not None:
            return TokenizerInfo(tj, hashlib.sha256(data).hexdigest(), vocab_size, name, eos_id)
    raise StoreError(
        f"cannot determine the EOS token of {str(tj)!r}: tokenizer_config.json gives no "
        f"eos_token in the vocabulary and none of {list(EOS_FALLBACKS)} exists. Add "
        '"eos_token" to tokenizer_config.json.'
    )


def dtype_for_vocab(vocab_size: int) -> str:
    """Smallest store dtype holding every token id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise StoreError(
        f"vocabulary of {vocab_size} tokens is too large: a store holds ids up to 2**32 "
        "(uint32). Use a smaller tokenizer."
    )
