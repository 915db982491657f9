"""Fixtures for the data engine tests: a tiny deterministic tokenizer and store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORDS = (
    "the quick brown fox jumps over lazy dog a an and or but if then else "
    "data store token sample step rank batch epoch seed plan loader zephon titan "
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
    "omicron pi rho sigma tau upsilon phi chi psi omega one two three four five"
).split()
EOS = "<|end_of_text|>"


def build_tokenizer(folder: Path, *, extra_vocab: int = 0, eos_in_config: bool = True) -> Path:
    """Save a WordLevel tokenizer (whitespace split, <unk>, EOS) into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, EOS: 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    for k in range(extra_vocab):
        vocab[f"w{k}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if eos_in_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder


def corpus_text(k: int, length: int) -> str:
    """Deterministic pseudo-text, document ``k``."""
    return " ".join(WORDS[(k * 7 + i * i + i) % len(WORDS)] for i in range(length))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of 40 text files and one JSONL file (~6k tokens)."""
    root = tmp_path_factory.mktemp("corpus") / "corpus"
    (root / "sub").mkdir(parents=True)
    for k in range(40):
        (root / ("sub" if k % 3 else ".") / f"doc{k:02d}.txt").write_text(
            corpus_text(k, 50 + 7 * k % 90)
        )
    with open(root / "extra.jsonl", "w") as f:
        for k in range(40, 80):
            f.write(json.dumps({"text": corpus_text(k, 30 + k % 17), "id": k}) + "\n")
    return root


@pytest.fixture(scope="session")
def store_path(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, corpus_dir: Path):
    from torchtitan_zephon.data.prepare import prepare_store

    out = tmp_path_factory.mktemp("stores") / "store"
    prepare_store([str(corpus_dir)], str(tokenizer_dir), str(out), progress=False)
    return out


@pytest.fixture(scope="session")
def store(store_path: Path):
    from torchtitan_zephon.data.store import TokenStore

    return TokenStore.open(store_path)
