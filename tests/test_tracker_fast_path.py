"""The reader's stretch fast path (tracker/fast_path.py) against the per-line reading.

``LogReader(fast=False)`` takes every line on its own: the reference. Hypothesis
tampers with real logs (deletes, repeats, swaps, edits bytes, inserts blank
lines, cuts the tail) and reads them in stretches of random sizes; the one-log and
two-log ``zephon verify`` reports (verdict, counts, first problem, first
mismatch, ranges) and any error must be the same both ways.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_zephon.cli.verify import check_log, compare_logs
from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.tracker import SequenceTracker, TrackerError, reader
from torchtitan_zephon.tracker.compare import _Ranges
from torchtitan_zephon.tracker.fast_path import RecordRun
from torchtitan_zephon.tracker.forked import ForkedLogReader
from torchtitan_zephon.tracker.reader import LogReader
from torchtitan_zephon.tracker.records import RECORD_LINE, record_line
from torchtitan_zephon.tracker.stretches import count_lines, has_event

TOPO = {"world_size": 2, "dp_degree": 2, "nnodes": 1}
STEPS = 40


def _config() -> DataConfig:
    return DataConfig.make(
        seq_len=8, seed=0, schedule=BatchSchedule.parse("8"), sample_offset=0,
        num_samples=10_000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip


@functools.cache
def base_log(variant: str) -> bytes:
    """The bytes of a log written by the real tracker. Sample counts change at step 20
    (8 -> 16) and positions cross 100 and 1000, so lines come in several lengths.
    ``tokens``: with token digests; ``resume``: a job died after step 30 and one
    resumed from step 25; ``other``: other ids from step 33 on."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sequence_log.jsonl"
        t = SequenceTracker(path, config=_config(), writer=True)
        t.start(TOPO)
        heads, first = {}, 0

        def record(s: int, seed: int = 0) -> None:
            nonlocal first
            n = 8 if s < 20 else 16
            ids = np.random.default_rng([seed, s]).integers(0, 10_000, size=n)
            t.record(s, first, ids, ids.tobytes() if "tokens" in variant else None)
            first += n

        for s in range(1, (30 if "resume" in variant else STEPS) + 1):
            record(s, seed=1 if "other" in variant and s >= 33 else 0)
            heads[s] = (t.head(), first)
        if "resume" in variant:
            head, first = heads[25]
            t = SequenceTracker(path, config=_config(), writer=True)
            t.resume(head, {**TOPO, "world_size": 1, "dp_degree": 1})
            for s in range(26, STEPS + 1):
                record(s)
        return path.read_bytes()


VARIANTS = ("plain", "tokens", "resume", "tokens-resume", "other", "tokens-other")

_edit = st.one_of(
    st.tuples(st.just("delete"), st.integers(0, 60)),
    st.tuples(st.just("repeat"), st.integers(0, 60)),
    st.tuples(st.just("swap"), st.integers(0, 60), st.integers(0, 60)),
    st.tuples(
        st.just("byte"),
        st.integers(0, 60),
        st.integers(-80, 400) | st.integers(-76, -67) | st.sampled_from([-1, -2, 0, 1]),
        st.sampled_from(list(b'0123456789abcdefF"{}:,v \r\t') + [0x0B]),
    ),
    st.tuples(st.just("blank"), st.integers(0, 60), st.sampled_from([b"", b" ", b"\r"])),
    st.tuples(st.just("take"), st.integers(0, 60), st.sampled_from(VARIANTS)),
)


def forge_chains(lines: list[bytes]) -> list[bytes]:
    """Recompute every chain after the edits, as a forger would: only step order and
    resume links can tell then."""
    out, prev = [], None
    for line in lines:
        if RECORD_LINE.fullmatch(line) and prev is not None:
            chain, line = record_line(prev, json.loads(line[:-76] + b"}"))
            prev = chain
        elif b'"event"' in line:
            try:
                prev = json.loads(line).get("chain")
            except ValueError:
                prev = None
        out.append(line)
    return out


def tamper(data: bytes, edits: list, cut: int | None, rechain: bool = False) -> bytes:
    lines = data.split(b"\n")[:-1]
    for edit in edits:
        i = edit[1] % len(lines) if lines else 0
        if not lines:
            break
        if edit[0] == "delete":
            del lines[i]
        elif edit[0] == "repeat":
            lines.insert(i, lines[i])
        elif edit[0] == "swap":
            j = edit[2] % len(lines)
            lines[i], lines[j] = lines[j], lines[i]
        elif edit[0] == "byte" and lines[i]:
            p = edit[2] % len(lines[i])  # negative: from the end (the chain, its keys)
            lines[i] = lines[i][:p] + bytes([edit[3]]) + lines[i][p + 1 :]
        elif edit[0] == "blank":
            lines.insert(i, edit[2])
        elif edit[0] == "take":  # the same line of another log: valid alone, foreign here
            other = base_log(edit[2]).split(b"\n")[:-1]
            lines[i] = other[i % len(other)]
    if rechain:
        lines = forge_chains(lines)
    out = b"".join(line + b"\n" for line in lines)
    if cut is not None and out:
        out = out[: len(out) - 1 - cut % max(1, len(lines[-1]) + 1)]  # a crash mid-write
    return out


def outcome(fn, *paths: Path, fast: bool):
    try:
        return fn(*(LogReader(p, fast=fast) for p in paths))
    except TrackerError as e:
        return ("error", str(e))


def both_ways(fn, *paths: Path, size: int):
    with mock.patch.object(reader, "STRETCH_BYTES", size):
        return outcome(fn, *paths, fast=True), outcome(fn, *paths, fast=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    variant_a=st.sampled_from(VARIANTS),
    variant_b=st.sampled_from(VARIANTS),
    edits=st.lists(_edit, max_size=4),
    cut=st.none() | st.integers(0, 300),
    rechain=st.booleans(),
    size=st.sampled_from([1, 200, 700, 2500, 1 << 20]),
)
def test_fast_path_reports_what_the_per_line_reading_reports(
    variant_a, variant_b, edits, cut, rechain, size
):
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a.jsonl", Path(tmp) / "b.jsonl"
        a.write_bytes(tamper(base_log(variant_a), edits, cut, rechain))
        b.write_bytes(base_log(variant_b))
        fast, ref = both_ways(check_log, a, size=size)
        assert fast == ref
        fast, ref = both_ways(compare_logs, a, b, size=size)
        assert fast == ref
        fast, ref = both_ways(compare_logs, b, a, size=size)
        assert fast == ref


def test_untouched_logs_take_the_fast_path_and_match(tmp_path):
    for variant in VARIANTS:
        path = tmp_path / f"{variant}.jsonl"
        path.write_bytes(base_log(variant))
        batches = list(LogReader(path).batches())
        assert batches and all(isinstance(b, RecordRun) for b in batches), variant
        lengths = {len(line) for line in base_log(variant).split(b"\n")[1:-1]}
        assert len(lengths) > 2  # several line lengths: several runs per stretch
    a, b = tmp_path / "tokens.jsonl", tmp_path / "tokens-resume.jsonl"
    report = compare_logs(LogReader(a), LogReader(b))
    assert report["verdict"] == "match" and report["steps_compared"] == STEPS
    assert report["tokens_compared"] == STEPS and report["matches"] == STEPS
    report = compare_logs(LogReader(a), LogReader(tmp_path / "tokens-other.jsonl"))
    assert report["verdict"] == "mismatch" and report["first_mismatch"]["step"] == 33
    assert report["matches"] == 32
    assert report["first_mismatch"]["fields"] == ["ids_digest", "tokens_digest"]


def test_a_forked_reader_sends_the_same_batches(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(base_log("tokens-resume"))
    b.write_bytes(base_log("tokens-other"))
    forked = compare_logs(ForkedLogReader(a), ForkedLogReader(b))
    assert forked == compare_logs(LogReader(a, fast=False), LogReader(b, fast=False))
    assert forked["verdict"] == "mismatch"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.lists(st.sampled_from([b'"event"', b"v", b"e", b'"', b"\n", b"x"])).map(b"".join))  # fmt: skip
def test_event_search_and_line_count_agree_with_bytes_methods(stretch):
    assert has_event(stretch) == (b'"event"' in stretch)
    assert count_lines(stretch) == stretch.count(b"\n")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), max_size=12),
    st.integers(0, 3),
)
def test_a_range_folds_like_its_steps_one_by_one(ranges, cap):
    bulk, single = _Ranges(cap), _Ranges(cap)
    for first, n in ranges:
        bulk.add_range(first, first + n)
        for s in range(first, first + n + 1):
            single.add(s)
        assert bulk.items == single.items
