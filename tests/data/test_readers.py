"""Input expansion and canonical source names (``readers.resolve_inputs``): a folder, a
glob of its files, a comma list and an explicit list of the same files name the same
sources, so they prepare the same store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_zephon.data.prepare import prepare_store
from torchtitan_zephon.data.readers import resolve_inputs
from torchtitan_zephon.data.store import StoreError

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
