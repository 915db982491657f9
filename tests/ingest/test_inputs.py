"""Input expansion and canonical source names (``inputs.resolve_inputs``): a folder, a
glob of its files, a comma list and an explicit list of the same files name the same
sources, so they prepare the same store."""

from __future__ import annotations

import codecs
import gzip
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_zephon.ingest.inputs import (
    InputFile,
    OptionError,
    OptionNames,
    resolve_inputs,
    select_splits,
)
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.ingest.readers import iter_documents
from torchtitan_zephon.store.format import StoreError

# Names that sort differently as strings and level by level ("a-b/x" < "a/x" as
# strings), hidden names (skipped by walks and by "*"), and a glob character.
PARTS = ["a", "b", "a-b", "a.b", "B", ".h", "_", "c[1]"]


def _tree(paths: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The files of a tree from candidate paths: a path that is a folder of an
    earlier one (or has one as folder) is dropped."""
    files: list[tuple[str, ...]] = []
    for p in paths:
        if any(p[: len(f)] == f or f[: len(p)] == p for f in files):
            continue
        files.append(p)
    return files


trees = st.lists(
    st.lists(st.sampled_from(PARTS), min_size=1, max_size=3).map(tuple), min_size=1, max_size=8
).map(_tree)


def _write(root: Path, files: list[tuple[str, ...]]) -> None:
    for k, parts in enumerate(files):
        p = root.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"document {k}")


def _listing(sources) -> list[tuple[str, str]]:
    return [(s.name, os.path.realpath(s.path)) for s in sources]


def _escape(path: str) -> str:
    """``path`` with its glob characters matched literally."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(files=trees)
def test_folder_glob_and_lists_name_the_same_sources(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("tree") / "corpus"
    root.mkdir()
    _write(root, files)
    visible = [f for f in files if not any(part.startswith(".") for part in f)]
    if not visible:
        assert resolve_inputs([str(root)]) == []
        return
    walked = resolve_inputs([str(root)])
    # every visible file once, in walk order: sorted level by level
    assert sorted(os.path.realpath(s.path) for s in walked) == sorted(
        os.path.realpath(root.joinpath(*f)) for f in visible
    )
    assert [Path(s.path).relative_to(root).parts for s in walked] == sorted(
        Path(*f).parts for f in visible
    )
    expected = _listing(walked)
    paths = [str(s.path) for s in walked]
    assert _listing(resolve_inputs([_escape(str(root)) + "/*"])) == expected
    assert _listing(resolve_inputs([_escape(str(root)) + "/**"])) == expected  # overlaps: once
    assert _listing(resolve_inputs(paths)) == expected
    if not any("," in p for p in paths):
        assert _listing(resolve_inputs([",".join(paths)])) == expected
    # a relative spelling of the same folder
    rel = os.path.relpath(root)
    assert _listing(resolve_inputs([rel])) == expected
    # names do not depend on where the folder lives, only on what is inside it
    assert all(not s.name.startswith(("/", "..")) for s in walked)
    if len(walked) == 1:
        assert walked[0].name == Path(walked[0].path).name


def test_spellings_prepare_the_same_store(tmp_path, tokenizer_dir):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha beta")
    (corpus / "b.jsonl").write_text('{"text": "gamma delta"}\n')
    (corpus / "sub" / "c.txt").write_text("epsilon zeta")
    spellings = {
        "folder": [str(corpus)],
        "glob": [f"{corpus}/*"],
        "comma": [f"{corpus}/a.txt, {corpus}/b.jsonl,{corpus}/sub"],
        "files": [f"{corpus}/a.txt", f"{corpus}/b.jsonl", f"{corpus}/sub/c.txt"],
    }
    stores = {
        k: prepare_store(v, str(tokenizer_dir), str(tmp_path / f"s-{k}"), progress=False)
        for k, v in spellings.items()
    }
    assert {s.fingerprint for s in stores.values()} == {stores["folder"].fingerprint}
    assert [s["name"] for s in stores["folder"].manifest["sources"]] == [
        "a.txt",
        "b.jsonl",
        "sub/c.txt",
    ]


def test_a_literal_path_wins_over_commas_and_patterns(tmp_path):
    odd = tmp_path / "a,b[1].txt"
    odd.write_text("alpha")
    (tmp_path / "a").write_text("beta")
    assert [s.name for s in resolve_inputs([str(odd)])] == ["a,b[1].txt"]


@pytest.mark.parametrize(
    "value, message",
    [
        ("{d}/missing.txt", r"input '.*/missing.txt' does not exist; expected a text/JSONL"),
        ("{d}/*.parquet", r"input pattern '.*/\*.parquet' matches no file"),
        ("{d}/a.txt,{d}/nope.txt", r"input '.*/nope.txt' \(in '.*'\) does not exist"),
        ("{d}/a.txt,,{d}/a.txt", "has an empty item between commas"),
    ],
)
def test_bad_inputs_name_what_is_missing(tmp_path, value, message):
    (tmp_path / "a.txt").write_text("alpha")
    with pytest.raises(StoreError, match=message):
        resolve_inputs([value.format(d=tmp_path)])


# ----------------------------------------------------------------------------- issue 18


def _read(path: Path, kind: str, text_field: str = "text") -> list[str]:
    return list(iter_documents(InputFile(path.name, path, kind), text_field))


@pytest.mark.parametrize("name, kind", [("d.txt", "text"), ("d.jsonl", "jsonl"),
                                        ("d.jsonl.gz", "jsonl"), ("d.json", "json")])  # fmt: skip
def test_a_utf8_bom_opening_a_file_is_not_part_of_its_documents(tmp_path, name, kind):
    """Editors on Windows write a byte-order mark first: it is read (utf-8-sig), never
    refused as invalid JSON nor kept as a U+FEFF character in the first document."""
    lines = [{"text": f"döcument {k} ünicode"} for k in range(3)]
    if kind == "text":
        body = b"first line\nsecond line\n"
    elif kind == "json":
        body = json.dumps(lines).encode()
    else:
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines).encode()
    if name.endswith(".gz"):
        plain, marked = gzip.compress(body), gzip.compress(codecs.BOM_UTF8 + body)
    else:
        plain, marked = body, codecs.BOM_UTF8 + body
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / name).write_bytes(plain)
    (tmp_path / name).write_bytes(marked)
    expected = _read(tmp_path / "plain" / name, kind)
    assert expected and "\ufeff" not in "".join(expected)
    assert _read(tmp_path / name, kind) == expected


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("odd", [0, 3, 9])
def test_a_record_without_the_text_field_among_records_with_it_is_named_not_renamed(tmp_path, odd):
    """One record without the field (first, middle or last) is an error naming its line;
    it does not suggest choosing another field as if the whole file lacked this one."""
    records = [{"text": f"doc {k}", "id": k} for k in range(10)]
    records[odd] = {"body": "oops", "id": odd}
    path = _jsonl(tmp_path / "d.jsonl", records)
    for part in (None, (0, path.stat().st_size)):  # the whole-file and the range reader
        with pytest.raises(StoreError) as e:
            list(iter_documents(InputFile("d.jsonl", path, "jsonl"), "text", part))
        message = str(e.value)
        assert f"d.jsonl:{odd + 1}: this record has no field 'text'" in message
        assert "its fields: ['body', 'id']" in message
        assert "other records of the file have it" in message
        assert "Choose" not in message and "--text-field" not in message
        assert not isinstance(e.value, OptionError)
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps(records))
    with pytest.raises(StoreError, match=f"record {odd}: this record has no field 'text'"):
        _read(as_json, "json")


def test_a_file_without_the_text_field_suggests_choosing_one(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"body": f"doc {k}"} for k in range(5)])
    with pytest.raises(OptionError) as e:
        _read(path, "jsonl")
    assert "d.jsonl:1: unknown text field 'text'; fields present: ['body']" in str(e.value)
    assert str(e.value).endswith("Choose one with --text-field.")
    trainer = OptionNames(text_field="--zephon.text_field", split="--zephon.split")
    assert str(e.value.spelled(trainer)).endswith("Choose one with --zephon.text_field.")


def _dataset_dict(path: Path, **splits: int) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict(
                {"text": [f"{name} {k}" for k in range(n)]}, split=name
            )
            for name, n in splits.items()
        }
    ).save_to_disk(str(path))
    return path


def test_a_dataset_dict_reads_its_train_split_unless_told(tmp_path):
    dd = _dataset_dict(tmp_path / "dd", validation=2, train=3, test=1)
    (src,) = resolve_inputs([str(dd)])
    assert src.kind == "hf" and src.splits is None

    def read(split: str) -> list[str]:
        (chosen,) = select_splits([src], split)
        return list(iter_documents(chosen, "text"))

    assert read("") == ["train 0", "train 1", "train 2"]
    assert read("validation") == ["validation 0", "validation 1"]
    assert read("all") == ["test 0", "train 0", "train 1", "train 2", "validation 0",
                           "validation 1"]  # fmt: skip
    assert list(iter_documents(src, "text")) == read("")  # unselected: the default too
    assert select_splits([src], "all")[0].splits == ("test", "train", "validation")
    with pytest.raises(OptionError) as e:
        select_splits([src], "dev")
    assert str(e.value) == (
        f"{dd} is a Hugging Face DatasetDict with the splits ['test', 'train', 'validation']; "
        "it has no split 'dev'. Choose one with --split NAME, or --split all to read every "
        "split."
    )
    other = OptionNames(split="--zephon.split")
    with pytest.raises(
        OptionError, match="Choose one with --zephon.split NAME, or --zephon.split all"
    ):
        select_splits([src], "dev", other)


def test_a_dataset_dict_without_a_train_split_needs_a_choice(tmp_path):
    dd = _dataset_dict(tmp_path / "dd", validation=2)
    with pytest.raises(OptionError, match=r"splits \['validation'\]; it has no 'train' split, "
                       "which is read by default. Choose one with --split NAME"):  # fmt: skip
        select_splits(resolve_inputs([str(dd)]))


def test_a_single_dataset_is_read_whole_and_refuses_a_split_it_was_not_saved_as(tmp_path):
    _dataset_dict(tmp_path / "dd", train=2, validation=1)
    train = tmp_path / "dd" / "train"  # a DatasetDict's split folder: a Dataset saved as "train"
    (src,) = resolve_inputs([str(train)])
    for split in ("", "train", "all"):
        (chosen,) = select_splits([src], split)
        assert chosen.splits is None and list(iter_documents(chosen, "text")) == [
            "train 0", "train 1"]  # fmt: skip
    with pytest.raises(
        OptionError,
        match=r"single Hugging Face Dataset saved as split 'train' "
        r"\(not a DatasetDict\), so --split validation cannot select from it",
    ):
        select_splits([src], "validation")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(str(tmp_path / "plain"))
    (unnamed,) = select_splits(resolve_inputs([str(tmp_path / "plain")]), "validation")
    assert list(iter_documents(unnamed, "text")) == ["x"]  # saved without a split name
    (jsonl,) = select_splits([InputFile("a", _jsonl(tmp_path / "a.jsonl", [{"text": "y"}]),
                                     "jsonl")], "validation")  # fmt: skip
    assert jsonl.splits is None  # other inputs are not affected


def test_a_text_field_of_another_json_kind_is_named_in_json_words(tmp_path):
    """Issue 18 (no Python-isms): a null, number, array or object where the text should be
    is said as JSON says it, never as a Python type name (NoneType, int, list, dict)."""
    from torchtitan_zephon.ingest.readers import iter_documents

    for value, kind in ((None, "null"), (3, "a number"), ([1], "an array"),
                        ({"a": 1}, "an object"), (True, "a boolean")):  # fmt: skip
        path = tmp_path / "d.jsonl"
        path.write_text(json.dumps({"text": value}) + "\n")
        (src,) = resolve_inputs([str(path)])
        with pytest.raises(StoreError) as e:
            list(iter_documents(src, "text"))
        assert str(e.value).endswith(f"field 'text' should be a string, found {kind}."), e.value
    path.write_text("7\n")
    (src,) = resolve_inputs([str(path)])
    with pytest.raises(
        StoreError, match="expected a JSON object with field 'text', found a number"
    ):
        list(iter_documents(src, "text"))
