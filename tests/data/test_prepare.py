"""prepare_store: all input kinds, byte-identical across worker counts, clear errors."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from torchtitan_zephon.data.prepare import dtype_for_vocab, prepare_store
from torchtitan_zephon.data.store import StoreError, TokenStore

from .conftest import EOS, build_tokenizer, corpus_text


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_identical_bytes_for_any_worker_count(tmp_path, tokenizer_dir, corpus_dir, store_path):
    two = prepare_store(
        [str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "w2"), workers=2, progress=False
    )
    assert _files(store_path) == _files(two.path)
    assert set(_files(two.path)) == {
        "manifest.json",
        "tokens.bin",
        "doc_offsets.bin",
        "checksums.bin",
    }
    assert two.content == TokenStore.open(store_path).content  # checksums and max token id


def test_documents_are_tokens_plus_eos(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer

    (tmp_path / "a.txt").write_text("the quick brown fox")
    (tmp_path / "b.md").write_text("lazy dog zzz")  # zzz -> <unk>
    s = prepare_store(
        [str(tmp_path / "a.txt"), str(tmp_path / "b.md")],
        str(tokenizer_dir),
        str(tmp_path / "s"),
        progress=False,
    )
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    expected = []
    for text in ["the quick brown fox", "lazy dog zzz"]:
        expected += tok.encode(text, add_special_tokens=False).ids + [eos]
    assert s.tokens.tolist() == expected
    assert s.doc_offsets.tolist() == [0, 5]
    assert [src["name"] for src in s.manifest["sources"]] == ["a.txt", "b.md"]


def test_all_input_kinds_give_the_same_tokens(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [corpus_text(k, 20 + k) for k in range(12)]
    (tmp_path / "t").mkdir()
    for k, t in enumerate(texts):
        (tmp_path / "t" / f"{k:02d}.txt").write_text(t)
    lines = "".join(json.dumps({"text": t, "n": k}) + "\n" for k, t in enumerate(texts))
    (tmp_path / "d.jsonl").write_text(lines)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(lines)
    pq.write_table(pa.table({"text": texts, "n": list(range(12))}), tmp_path / "d.parquet")

    ref = None
    for name in ["t", "d.jsonl", "d.jsonl.gz", "d.parquet"]:
        s = prepare_store(
            [str(tmp_path / name)], str(tokenizer_dir), str(tmp_path / f"s-{name}"), progress=False
        )
        assert s.num_documents == 12
        if ref is None:
            ref = np.array(s.tokens)
        assert np.array_equal(s.tokens, ref), name


def test_hf_dataset_input(tmp_path, tokenizer_dir):
    datasets = pytest.importorskip("datasets")
    texts = [corpus_text(k, 15) for k in range(9)]
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "hf"))
    s = prepare_store(
        [str(tmp_path / "hf")],
        str(tokenizer_dir),
        str(tmp_path / "s"),
        text_field="body",
        progress=False,
    )
    assert s.num_documents == 9 and s.manifest["sources"][0]["kind"] == "hf"
    with pytest.raises(StoreError, match=r"unknown text field 'text'.*\['body'\]"):
        prepare_store([str(tmp_path / "hf")], str(tokenizer_dir), str(tmp_path / "s2"))


def test_changed_input_changes_fingerprint(tmp_path, tokenizer_dir):
    f = tmp_path / "in" / "a.txt"
    f.parent.mkdir()
    f.write_text("alpha beta gamma")
    a = prepare_store([str(f.parent)], str(tokenizer_dir), str(tmp_path / "a"), progress=False)
    b = prepare_store([str(f.parent)], str(tokenizer_dir), str(tmp_path / "b"), progress=False)
    assert a.fingerprint == b.fingerprint
    f.write_text("alpha beta delta")  # same token count, different content
    c = prepare_store([str(f.parent)], str(tokenizer_dir), str(tmp_path / "c"), progress=False)
    assert c.num_tokens == a.num_tokens and c.fingerprint != a.fingerprint


def test_eos_fallback_and_large_vocab(tmp_path):
    tok = build_tokenizer(tmp_path / "tok", extra_vocab=70_000, eos_in_config=False)
    (tmp_path / "a.txt").write_text("w69999 alpha w0")
    s = prepare_store([str(tmp_path / "a.txt")], str(tok), str(tmp_path / "s"), progress=False)
    assert s.tokens.dtype == np.uint32 and s.manifest["dtype"] == "uint32"
    assert s.tokens[-1] == s.eos_id == 1
    assert int(s.tokens[0]) > 65535
    w = s.windows(np.array([2, 0]), 1)
    assert w.dtype == np.uint32 and w.tolist() == [s.tokens[2:4].tolist(), s.tokens[0:2].tolist()]


def test_vocab_dtype_limits():
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"
    with pytest.raises(StoreError, match="too large"):
        dtype_for_vocab(2**32 + 1)


def test_errors(tmp_path, tokenizer_dir, corpus_dir):
    out = str(tmp_path / "out")
    with pytest.raises(StoreError, match="'missing.txt' does not exist"):
        prepare_store(["missing.txt"], str(tokenizer_dir), out)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    with pytest.raises(StoreError, match="empty corpus"):
        prepare_store([str(tmp_path / "empty")], str(tokenizer_dir), out, progress=False)
    assert not Path(out).exists() and not list(tmp_path.glob(".out.tmp*"))
    (tmp_path / "notok").mkdir()
    with pytest.raises(StoreError, match="no tokenizer.json"):
        prepare_store([str(corpus_dir)], str(tmp_path / "notok"), out)
    with pytest.raises(StoreError, match=r"unknown text field 'body'.*\['id', 'text'\]"):
        prepare_store([str(corpus_dir)], str(tokenizer_dir), out, text_field="body")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(StoreError, match="already exists; choose another path or delete"):
        prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "taken"))


def test_no_eos_is_an_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("a a")
    with pytest.raises(StoreError, match="cannot determine the EOS token"):
        prepare_store([str(tmp_path / "a.txt")], str(tmp_path / "tok"), str(tmp_path / "s"))


def test_reopen_equals_returned(store_path, store):
    again = TokenStore.open(store_path)
    assert again.fingerprint == store.fingerprint
    assert np.array_equal(again.tokens, store.tokens)


def test_json_file_and_dataset_dict(tmp_path, tokenizer_dir):
    texts = [corpus_text(k, 10) for k in range(6)]
    (tmp_path / "a.json").write_text(json.dumps([{"text": t} for t in texts]))
    a = prepare_store([str(tmp_path / "a.json")], str(tokenizer_dir), str(tmp_path / "sa"))
    assert a.num_documents == 6 and a.manifest["sources"][0]["kind"] == "json"
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"text": texts[3:]}),
            "train": datasets.Dataset.from_dict({"text": texts[:3]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    b = prepare_store([str(tmp_path / "dd")], str(tokenizer_dir), str(tmp_path / "sb"))
    assert np.array_equal(a.tokens, b.tokens)  # splits in sorted order: train, validation


def test_hf_without_datasets_package(tmp_path, tokenizer_dir, monkeypatch):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text("{}")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(StoreError, match="`datasets` package is not installed"):
        prepare_store([str(tmp_path / "hf")], str(tokenizer_dir), str(tmp_path / "s"))


def test_progress_bar_on_stderr(tmp_path, tokenizer_dir, corpus_dir, capfd):
    prepare_store([str(corpus_dir)], str(tokenizer_dir), str(tmp_path / "s"), progress=True)
    captured = capfd.readouterr()
    assert "zephon prepare" in captured.err and captured.out == ""


def test_dirty_inputs(tmp_path, tokenizer_dir):
    """Lone surrogates become U+FFFD; non-text columns and binary files are refused."""
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "alpha \ud800 beta"}) + "\n")
    s = prepare_store([str(jl)], str(tokenizer_dir), str(tmp_path / "s"), progress=False)
    assert s.num_documents == 1 and s.num_tokens > 2
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(StoreError, match="is a int, not text"):
        prepare_store([str(tmp_path / "n.parquet")], str(tokenizer_dir), str(tmp_path / "s2"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tokens.bin").write_bytes(b"\x00\x01\x02abc")
    with pytest.raises(StoreError, match="looks binary"):
        prepare_store([str(tmp_path / "bin")], str(tokenizer_dir), str(tmp_path / "s3"))
    assert not (tmp_path / "s2").exists() and not (tmp_path / "s3").exists()
