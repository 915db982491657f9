"""torchft's annotations in the sequence log (issue 30, the proof): a ``quorum`` event
before the first step a new quorum trains and a ``retry`` event for an attempt that was
not committed. They change no record and no chain (a torchft group's history equals a
one-group run's), a redone step keeps one record, and an edited or moved annotation is
reported like an edited skip event."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.tracker import LogReader, SequenceTracker, read_log

TOPO = {"world_size": 1, "dp_degree": 1, "nnodes": 1}


def tracker(path) -> SequenceTracker:
    cfg = DataConfig.make(
        seq_len=8, seed=0, schedule=BatchSchedule.parse("4"), sample_offset=0,
        num_samples=1000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip
    return SequenceTracker(path, config=cfg, writer=True)


def ids(step: int) -> np.ndarray:
    return np.arange(step * 4, step * 4 + 4)


def write(path, steps: int, notes: dict[int, list[str]]) -> None:
    """A log of ``steps`` records; before the record of step s, the annotations
    ``notes[s]`` (``quorum`` or ``retry``)."""
    t = tracker(path)
    t.start(TOPO)
    for s in range(1, steps + 1):
        for kind in notes.get(s, []):
            t.annotate(kind, s, {"groups": 2, "quorum_id": s})
        t.record(s, (s - 1) * 4, ids(s))


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_quorum_and_retry_events_annotate_the_step_after_them(tmp_path):
    path = tmp_path / "log.jsonl"
    write(path, 4, {1: ["quorum"], 3: ["quorum", "retry", "quorum"]})
    log = lines(path)
    kinds = [e.get("event", e.get("step")) for e in log]
    assert kinds == ["start", "quorum", 1, 2, "quorum", "retry", "quorum", 3, 4]
    retry = log[5]
    assert {k: retry[k] for k in ("from_step", "step", "chain", "groups")} == {
        "from_step": 2, "step": 3, "chain": log[3]["chain"], "groups": 2,
    }  # fmt: skip
    contents = read_log(path)
    assert contents.problems == [] and sorted(contents.records) == [1, 2, 3, 4]
    records = [line for line in log if "event" not in line]
    assert len(records) == 4  # the retried step 3: one record
    assert [e["event"] for e in contents.events] == ["start", "quorum", "quorum", "retry", "quorum"]
    assert LogReader(path).event_for(4)["event"] == "start"


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.integers(1, 6),
        st.lists(st.sampled_from(["quorum", "retry"]), min_size=1, max_size=3),
        max_size=6,
    )
)
def test_annotations_never_change_a_record_or_a_chain(tmp_path_factory, notes):
    """Any annotations anywhere: the records (chains included) are those of the log
    without any, so ``verify`` and a resume see one history."""
    root = tmp_path_factory.mktemp("ann")
    write(root / "plain.jsonl", 6, {})
    write(root / "noted.jsonl", 6, notes)
    plain, noted = read_log(root / "plain.jsonl"), read_log(root / "noted.jsonl")
    assert noted.problems == [] and noted.records == plain.records
    fast, slow = LogReader(root / "noted.jsonl"), LogReader(root / "noted.jsonl", fast=False)
    assert [r["chain"] for r in fast.records()] == [r["chain"] for r in slow.records()]
    assert slow.problems == []


@pytest.mark.parametrize("field, value", [("from_step", 1), ("step", 4), ("chain", "0" * 64)])
def test_an_edited_retry_event_is_an_event_problem(tmp_path, field, value):
    path = tmp_path / "log.jsonl"
    write(path, 4, {3: ["retry"]})
    log = path.read_text().splitlines()
    event = json.loads(log[3])
    assert event["event"] == "retry"
    event[field] = value
    log[3] = json.dumps(event, sort_keys=True)
    path.write_text("\n".join(log) + "\n")
    for fast in (True, False):
        problems = LogReader(path, fast=fast).check().problems
        assert [(p.line, p.kind) for p in problems][:1] == [(4, "event")], problems
        assert problems[0].message.startswith(
            f"line 4: a retry event for step {event['step']} (from_step {event['from_step']}) "
            "that does not follow the log's step 2 before it"
        )


def test_an_annotation_names_the_step_after_the_last_record(tmp_path):
    t = tracker(tmp_path / "log.jsonl")
    t.start(TOPO)
    t.record(1, 0, ids(1))
    with pytest.raises(ValueError, match="a retry event for step 3 after the record of step 1"):
        t.annotate("retry", 3, {})
    with pytest.raises(ValueError, match="annotation 'resume': expected one of"):
        t.annotate("resume", 2, {})
    assert [e.get("event", e.get("step")) for e in lines(tmp_path / "log.jsonl")] == ["start", 1]
