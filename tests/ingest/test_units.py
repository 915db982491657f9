"""Work units: cut by the inputs alone, and their documents concatenate to the source's."""

import codecs
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import corpus_text
from torchtitan_zephon.ingest.inputs import InputFile
from torchtitan_zephon.ingest.json_readers import read_jsonl
from torchtitan_zephon.ingest.readers import iter_documents
from torchtitan_zephon.ingest.units import cut_units, jsonl_boundaries, unit_input_hash
from torchtitan_zephon.store.format import StoreError

_line = st.one_of(
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=40)),
    st.builds(lambda t: json.dumps({"text": t}, ensure_ascii=False), st.text(max_size=40)),
    st.sampled_from(["", "   ", "\t", '{"text": ""}', '{"text": "a"}  ']),
)
_sep = st.sampled_from(["\n", "\r\n", "\r", "\n\n"])
_jsonl = st.lists(st.tuples(_line, _sep), max_size=30).map(
    lambda pairs: "".join(a + b for a, b in pairs).encode()
)


def _units_docs(src: InputFile, unit_bytes: int) -> list[str]:
    units = cut_units([src], unit_bytes)
    assert [u.index for u in units] == list(range(len(units)))
    spans = [u.span for u in units]
    size = src.path.stat().st_size
    assert spans[0][0] == 0 and spans[-1][1] == size  # the spans partition the file
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    return [d for u in units for d in iter_documents(src, "text", u.extent)]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_jsonl, unit_bytes=st.integers(1, 64), tail=st.sampled_from([b"", b"\n", b"\r", b"x"]))
def test_units_concatenate_to_the_whole_file(tmp_path, data, unit_bytes, tail):
    """For any JSON lines bytes (\\n, \\r\\n and lone \\r line ends, blank lines, non-ASCII)
    and any unit size, the documents of the units in order are the file's documents as
    the whole-file reader gives them; or both refuse the file, naming the same line."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(data + tail)
    src = InputFile("d.jsonl", path, "jsonl")
    try:
        whole = list(read_jsonl(src, "text"))
    except StoreError as e:
        with pytest.raises(StoreError) as got:
            _units_docs(src, unit_bytes)
        assert str(got.value).split(": ")[0] == str(e).split(": ")[0]  # FILE:LINE
        return
    assert _units_docs(src, unit_bytes) == whole


def test_boundaries_are_line_starts_at_or_after_each_multiple(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": corpus_text(k, 3 + k % 11)}) + "\n" for k in range(200)]
    data = "".join(lines).encode()
    path.write_bytes(data)
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line.encode()))
    for unit in (1, 7, 100, 1000, len(data), 10 * len(data)):
        cuts = jsonl_boundaries(path, len(data), unit)
        expected = sorted({min((s for s in starts if s >= k * unit), default=len(data))
                           for k in range(-(-len(data) // unit))} | {len(data)})  # fmt: skip
        assert cuts == expected, unit


def test_parquet_runs_of_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [corpus_text(k, 40) for k in range(300)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=20)  # 15 row groups
    src = InputFile("d.parquet", path, "parquet")
    for unit_bytes in (1, 3000, 1 << 30):
        units = cut_units([src], unit_bytes)
        assert units[0].extent[0] == 0 and units[-1].extent[1] == 15
        assert all(a.extent[1] == b.extent[0] for a, b in zip(units, units[1:], strict=False))
        assert _units_docs(src, unit_bytes) == texts
    assert len(cut_units([src], 1)) == 15 and len(cut_units([src], 1 << 30)) == 1


def test_unit_input_hash_follows_its_bytes_only(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(json.dumps({"text": f"doc {k}"}).encode() + b"\n" for k in range(50)))
    src = InputFile("d.jsonl", path, "jsonl")
    before = [unit_input_hash(src, u) for u in cut_units([src], 100)]
    data = bytearray(path.read_bytes())
    data[-5] = ord("9") if data[-5] != ord("9") else ord("8")  # a digit in the last line
    path.write_bytes(bytes(data))
    after = [unit_input_hash(src, u) for u in cut_units([src], 100)]
    assert after[:-1] == before[:-1] and after[-1] != before[-1]


def test_whole_units_for_unsplittable_kinds(tmp_path):
    import gzip

    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000))
    (tmp_path / "b.txt").write_text("alpha " * 1000)
    (tmp_path / "c.json").write_text(json.dumps([{"text": "a"}] * 1000))
    srcs = [InputFile(p, tmp_path / p, k) for p, k in
            [("a.jsonl.gz", "jsonl"), ("b.txt", "text"), ("c.json", "json")]]  # fmt: skip
    units = cut_units(srcs, 10)
    assert [(u.source, u.extent) for u in units] == [(0, None), (1, None), (2, None)]
    assert [u.span for u in units] == [(0, Path(tmp_path / s.name).stat().st_size) for s in srcs]


_maybe_field = st.one_of(
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=20)),
    st.builds(lambda t: json.dumps({"body": t}), st.text(max_size=20)),
    st.sampled_from(["", "  "]),
)
_mixed = st.lists(st.tuples(_maybe_field, _sep), max_size=20).map(
    lambda pairs: "".join(a + b for a, b in pairs).encode()
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_mixed, unit_bytes=st.integers(1, 48), bom=st.booleans())
def test_units_read_a_bom_and_a_missing_field_as_the_whole_file_does(
    tmp_path, data, unit_bytes, bom
):
    """Issue 18: a byte-order mark opening the file is skipped by the first unit only (the
    others cannot see it), so the units' documents are those of the file without it; a
    record without the text field gets, from the units, exactly the message the whole-file
    reader gives (another field is suggested only when no record has this one)."""
    path = tmp_path / "d.jsonl"
    path.write_bytes((codecs.BOM_UTF8 if bom else b"") + data)
    src = InputFile("d.jsonl", path, "jsonl")
    (tmp_path / "plain").mkdir(exist_ok=True)
    plain = tmp_path / "plain" / "d.jsonl"
    plain.write_bytes(data)
    try:
        whole = list(read_jsonl(InputFile("d.jsonl", plain, "jsonl"), "text"))
    except StoreError as e:
        with pytest.raises(StoreError) as got:
            _units_docs(src, unit_bytes)
        assert str(got.value).replace(str(path), "F") == str(e).replace(str(plain), "F")
        return
    assert _units_docs(src, unit_bytes) == whole
    assert list(read_jsonl(src, "text")) == whole
