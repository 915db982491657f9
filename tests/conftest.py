"""Fixtures shared by the tests: a tiny deterministic tokenizer, corpus and store."""

from __future__ import annotations

import json
import shutil
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


def _manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def _write_manifest(store: Path, manifest: dict) -> None:
    (store / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def copy_store(src: Path, dst: Path, *, chunk_tokens: int | None = None) -> Path:
    """Copy a store; with ``chunk_tokens``, re-cut its checksums into chunks of that size
    (as if prepare had used it), so small test stores have many chunks."""
    from torchtitan_zephon.store.format import manifest_fingerprint
    from torchtitan_zephon.store.writer import write_checksums

    shutil.copytree(src, dst)
    if chunk_tokens is not None:
        drop_block_checksums(dst)  # they name the fingerprint the re-cut changes
        m = _manifest(dst)
        m["content"] = write_checksums(dst, m, chunk_tokens=chunk_tokens)
        m["fingerprint"] = manifest_fingerprint(m)
        _write_manifest(dst, m)
    return dst


def drop_block_checksums(store: Path) -> Path:
    """Remove the block checksums prepare writes (blocks.bin, blocks.json): the store as
    it was before them, or before ``inspect --upgrade`` adds them."""
    for name in ("blocks.bin", "blocks.json"):
        (store / name).unlink(missing_ok=True)
    return store


def edit_token(store: Path, index: int, value: int | None = None) -> int:
    """Overwrite token ``index`` of tokens.bin in place (the file keeps its size); return the
    new value (default: the next id within the vocabulary, so always a change)."""
    m = _manifest(store)
    itemsize = 2 if m["dtype"] == "uint16" else 4
    with open(store / "tokens.bin", "r+b") as f:
        f.seek(index * itemsize)
        old = int.from_bytes(f.read(itemsize), "little")
        new = (old + 1) % m["tokenizer"]["vocab_size"] if value is None else value
        f.seek(index * itemsize)
        f.write(new.to_bytes(itemsize, "little"))
    return new


def make_v1(store: Path) -> str:
    """Rewrite a store as store format version 1 wrote it (no checksums); its fingerprint."""
    from torchtitan_zephon.store.format import manifest_fingerprint

    m = _manifest(store)
    del m["content"]
    m["version"] = 1
    m["fingerprint"] = manifest_fingerprint(m)
    _write_manifest(store, m)
    (store / "checksums.bin").unlink()
    drop_block_checksums(store)  # version 1 had none
    return m["fingerprint"]


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
    from torchtitan_zephon.ingest.prepare import prepare_store

    out = tmp_path_factory.mktemp("stores") / "store"
    prepare_store([str(corpus_dir)], str(tokenizer_dir), str(out), progress=False)
    return out


@pytest.fixture(scope="session")
def store(store_path: Path):
    from torchtitan_zephon.store.reader import TokenStore

    return TokenStore.open(store_path)


# ---------------------------------------------------------------- shared torchrun runs
# One training run serves every test that reads it (tests/titan and tests/cli): a run
# folder is never written by a test that did not make it (they copy it first).


@pytest.fixture(scope="session")
def e2e_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


PACKED_SEQ = 256  # the builtin docs at 256 tokens: steps 5-7 hold samples of several documents
PACKED = ("--training.steps", "8", "--zephon.packing", "best_fit", "--zephon.store",
          "builtin:docs", "--training.seq_len", str(PACKED_SEQ))  # fmt: skip
"""The packed job (tests/titan/test_packing_e2e.py, tests/remote/test_train_on_bucket.py)."""


@pytest.fixture(scope="session")
def packed_one_rank(e2e_root: Path) -> Path:
    """The uninterrupted packed run on one rank (``PACKED``)."""
    from tests.titan.launch import train03

    run = e2e_root / "packing_one_rank"
    train03(run, 1, *PACKED).check()
    return run


@pytest.fixture(scope="session")
def reference(e2e_root: Path) -> Path:
    """2 CPU ranks, FSDP, 8 steps, checkpoints at 4 and 8: the uninterrupted run."""
    from tests.titan.launch import train

    return train(e2e_root / "ref", 2).check().run  # "ref": compare names runs by folder


@pytest.fixture(scope="session")
def resumed_on_one_rank(e2e_root: Path, reference: Path) -> Path:
    """The reference as a job that died after checkpoint 4, resumed on 1 rank (DP 2 -> 1):
    steps 5-8 trained again there."""
    from tests.titan.launch import copy_run_until, train

    run = copy_run_until(reference, e2e_root / "resumed", 4)
    return train(run, 1).check().run
