"""The sequence log: chain, effective history, truncated tails, resume checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.order.data_config import DataConfig
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.tracker import SequenceTracker, TrackerError, genesis, read_log

TOPO = {"world_size": 2, "dp_degree": 2, "nnodes": 1}


def config(store="s", seq_len=8, seed=0, schedule="4"):
    return DataConfig.make(
        seq_len=seq_len, seed=seed, schedule=BatchSchedule.parse(schedule), sample_offset=0,
        num_samples=1000, store_fingerprint=store * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip


def tracker(path, writer=True, **cfg):
    return SequenceTracker(path, config=config(**cfg), writer=writer)


def ids(step):
    return np.arange(step * 4, step * 4 + 4)


def test_chain_depends_on_data_only_not_on_restarts(tmp_path):
    a = tracker(tmp_path / "a.jsonl")
    a.start(TOPO)
    for s in range(1, 7):
        a.record(s, (s - 1) * 4, ids(s), b"x" * 16)
    b = tracker(tmp_path / "b.jsonl")
    b.start(TOPO)
    for s in range(1, 5):
        b.record(s, (s - 1) * 4, ids(s), b"x" * 16)
    head = b.head()
    # the job "dies" after step 5 without a checkpoint of it
    b.record(5, 16, ids(5), b"x" * 16)
    c = tracker(tmp_path / "b.jsonl")
    c.resume(head, {**TOPO, "world_size": 1, "dp_degree": 1})
    for s in (5, 6):
        c.record(s, (s - 1) * 4, ids(s), b"x" * 16)
    ra, rb = read_log(tmp_path / "a.jsonl"), read_log(tmp_path / "b.jsonl")
    assert ra.records == rb.records and sorted(rb.records) == list(range(1, 7))
    assert [e["event"] for e in rb.events] == ["start", "resume"]


def test_different_ids_change_digest_and_chain(tmp_path):
    a, b = tracker(tmp_path / "a"), tracker(tmp_path / "b")
    ra = a.record(1, 0, np.array([0, 1, 2, 3]))
    rb = b.record(1, 0, np.array([0, 1, 3, 2]))
    assert ra["ids_digest"] != rb["ids_digest"] and ra["chain"] != rb["chain"]
    assert a.head()["chain"] != genesis(config().fingerprint)


def test_steps_must_be_recorded_in_order(tmp_path):
    t = tracker(tmp_path / "log")
    t.record(1, 0, ids(1))
    with pytest.raises(TrackerError, match="expected step 2, got 3"):
        t.record(3, 8, ids(3))


def test_truncated_last_line_is_tolerated_and_reported(tmp_path):
    path = tmp_path / "log.jsonl"
    t = tracker(path)
    t.start(TOPO)
    t.record(1, 0, ids(1))
    with open(path, "a") as f:
        f.write('{"step": 2, "chain": "ab')  # a crash mid-write
    contents = read_log(path)
    assert contents.truncated_tail and sorted(contents.records) == [1]


def test_corrupt_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "start", "from_step": 0}\nnot json\n{"step": 1, "chain": "x"}\n')
    with pytest.raises(TrackerError, match=":2: not valid JSON"):
        read_log(path)


def test_resume_against_a_foreign_log_is_refused_and_appends_nothing(tmp_path):
    ours = tracker(tmp_path / "ours.jsonl")
    ours.start(TOPO)
    ours.record(1, 0, ids(1))
    head = ours.head()
    foreign = tmp_path / "foreign.jsonl"
    other = tracker(foreign, store="t")
    other.start(TOPO)
    other.record(1, 0, ids(1))
    before = foreign.read_bytes()
    with pytest.raises(TrackerError, match="does not match the checkpoint of step 1"):
        tracker(foreign).resume(head, TOPO)
    assert foreign.read_bytes() == before
    with pytest.raises(TrackerError, match="no sequence log"):
        tracker(tmp_path / "missing.jsonl").resume(head, TOPO)
    t = tracker(tmp_path / "missing.jsonl")
    t.resume(head, TOPO, ignore_mismatch=True)
    last = json.loads((tmp_path / "missing.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "resume" and last["from_step"] == 1


def test_only_the_writer_touches_the_file(tmp_path):
    t = tracker(tmp_path / "log", writer=False)
    t.start(TOPO)
    t.record(1, 0, ids(1))
    assert not (tmp_path / "log").exists() and t.head()["step"] == 1


def test_append_after_a_truncated_line_keeps_the_log_valid(tmp_path):
    path = tmp_path / "log.jsonl"
    t = tracker(path)
    t.start(TOPO)
    t.record(1, 0, ids(1))
    head = t.head()
    t.record(2, 4, ids(2))
    with open(path, "a") as f:
        f.write('{"step": 3, "chain": "ab')  # the job died mid-write
    again = tracker(path)
    again.resume(head, TOPO)
    again.record(2, 4, ids(2))
    contents = read_log(path)
    assert not contents.truncated_tail and sorted(contents.records) == [1, 2]


# ---------------------------------------------------------------- O(1) resume


@settings(max_examples=60, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 12), st.integers(1, 8), st.booleans()), min_size=1, max_size=6
    ),
    damage=st.sampled_from(["none", "no_index", "no_events", "truncated_tail", "foreign_index"]),
)
def test_index_lookup_agrees_with_a_full_read(tmp_path_factory, plan, damage):
    """Jobs that resume from random earlier heads, die after random steps and leave
    damaged sidecars: the O(1) lookup accepts exactly the heads the full read accepts."""
    import shutil

    from torchtitan_zephon.tracker.index import events_path, index_path

    tmp = tmp_path_factory.mktemp("idx")
    path = tmp / "log.jsonl"
    heads = [{"step": 0, "chain": genesis(config().fingerprint)}]
    t = tracker(path)
    t.start(TOPO)
    for s in range(1, 4):
        t.record(s, (s - 1) * 4, ids(s))
        heads.append(t.head())
    for back, steps, other_data in plan:
        head = heads[min(back, len(heads) - 1)]
        job = tracker(path, seed=1 if other_data else 0)
        if job.cannot_continue(head) is not None:
            continue
        job.resume(head, TOPO)
        for s in range(head["step"] + 1, head["step"] + steps + 1):
            job.record(s, (s - 1) * 4, ids(s) + other_data)
            heads.append(job.head())
    if damage == "no_index":
        index_path(path).unlink()
    elif damage == "no_events":
        events_path(path).unlink()
    elif damage == "truncated_tail":
        with open(path, "a") as f:
            f.write('{"step": 99, "chai')
    elif damage == "foreign_index":
        other = tmp / "other.jsonl"
        o = tracker(other, store="x")
        o.start(TOPO)
        for s in range(1, 20):
            o.record(s, 0, ids(s))
        shutil.copy(index_path(other), index_path(path))
    for head in heads[1:]:  # step 0 is a fresh start: nothing to look up
        fast = tracker(path).cannot_continue(head)
        slow = tracker(path)._cannot_continue_by_reading(head["step"], head["chain"])
        assert (fast is None) == (slow is None), (head, fast, slow)


def test_resume_reads_only_the_index_when_it_can(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    t = tracker(path)
    t.start(TOPO)
    for s in range(1, 50):
        t.record(s, (s - 1) * 4, ids(s))
        if s == 20:
            head = t.head()
    import torchtitan_zephon.tracker.writer as writer

    def no_full_read(*a, **k):
        raise AssertionError("the full log was read")

    monkeypatch.setattr(writer.SequenceTracker, "_cannot_continue_by_reading", no_full_read)
    assert tracker(path).cannot_continue(head) is None
    monkeypatch.undo()
    (tmp_path / "log.jsonl.idx").unlink()  # lost: one full read rebuilds it
    assert tracker(path).cannot_continue(head) is None
    monkeypatch.setattr(writer.SequenceTracker, "_cannot_continue_by_reading", no_full_read)
    assert tracker(path).cannot_continue(head) is None


def _reordered(tmp_path, order: list[int], *, resume_at: int | None = None):
    """A log of steps 1..10 whose record lines come in ``order`` (line 1: the start
    event; with ``resume_at``, a resume event after the records)."""
    path = tmp_path / "log.jsonl"
    t = tracker(path)
    t.start(TOPO)
    heads = {}
    for s in range(1, 11):
        t.record(s, (s - 1) * 4, ids(s))
        heads[s] = t.head()
    lines = path.read_text().splitlines()
    body = [lines[0]] + [lines[s] for s in order]
    path.write_text("\n".join(body) + "\n")
    if resume_at is not None:
        tracker(path).resume(heads[resume_at], TOPO)
    return read_log(path).problems


def test_a_record_moved_later_is_out_of_order_and_what_never_came_is_missing(tmp_path):
    problems = _reordered(tmp_path, [1, 2, 3, 4, 7, 8, 9, 10, 5])  # 5 moved, 6 deleted
    assert problems[0].step == 5 and problems[0].kind == "order"
    assert problems[0].message == (
        "line 6: out of order (step 5 after step 10): the record of step 5 belongs before "
        "this line's record of step 7 but is at line 10; step 6 is missing (deleted?)"
    )
    assert "line 10: out of order (step 5 after step 10)" in [p.message for p in problems]


def test_a_repeated_record_is_called_repeated(tmp_path):
    problems = _reordered(tmp_path, [1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10])
    assert problems[0].step == 3
    assert problems[0].message == (
        "line 7: record of step 3 follows step 5: step 3 is repeated (its record came "
        "earlier in the log)"
    )


def test_a_resume_forgets_the_gaps_of_the_steps_it_supersedes(tmp_path):
    """Step 7 lost by the first job, then a job resumed from step 5: the first problem is
    the gap; the resumed job's records of steps 6.. are in order, not out of order."""
    path = tmp_path / "log.jsonl"
    _reordered(tmp_path, [1, 2, 3, 4, 5, 6, 8, 9, 10], resume_at=5)
    t = tracker(path)
    t.step, t.chain = 5, read_log(path).records[5]["chain"]
    for s in range(6, 9):
        t.record(s, (s - 1) * 4, ids(s))
    problems = read_log(path).problems
    assert [p.message for p in problems if p.kind == "order"] == [
        "line 8: step 7 is missing before the record of step 8 (deleted?)"
    ]


# ------------------------------------------------------ skip events (issue 22)


def skip_tracker(path, skips: str, writer: bool = True) -> SequenceTracker:
    from torchtitan_zephon.order.data_config import data_extra

    cfg = DataConfig.make(
        seq_len=8, seed=0, schedule=BatchSchedule.parse("4"), sample_offset=0,
        num_samples=1000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
        extra=data_extra(skip_steps=skips),
    )  # fmt: skip
    return SequenceTracker(path, config=cfg, writer=writer)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_skip_event_precedes_the_record_of_its_step_and_links_to_the_one_before(tmp_path):
    from torchtitan_zephon.tracker import LogReader

    path = tmp_path / "log.jsonl"
    t = skip_tracker(path, "3:2,7:1")
    t.start(TOPO)
    for s in range(1, 9):
        t.record(s, (s - 1) * 4, ids(s))
    log = lines(path)
    kinds = [e.get("event", e.get("step")) for e in log]
    assert kinds == ["start", 1, 2, "skip", 3, 4, 5, 6, "skip", 7, 8]
    skip3, skip7 = log[3], log[8]
    assert {k: skip3[k] for k in ("from_step", "step", "steps", "chain")} == {
        "from_step": 2, "step": 3, "steps": 2, "chain": log[2]["chain"],
    }  # fmt: skip
    assert skip3["text"].startswith("at step 3, skip the data of 2 steps (3..4): step 3 trains")
    assert (skip7["from_step"], skip7["step"], skip7["steps"]) == (6, 7, 1)
    assert skip7["text"].startswith("at step 7, skip the data of 1 step (7..7)")
    contents = read_log(path)
    assert contents.problems == [] and sorted(contents.records) == list(range(1, 9))
    assert [e["event"] for e in contents.events] == ["start", "skip", "skip"]
    slow = LogReader(path, fast=False)
    assert [r["chain"] for r in slow.records()] == [
        log[i]["chain"] for i in (1, 2, 4, 5, 6, 7, 9, 10)
    ]
    assert slow.problems == [] and slow.event_for(5)["event"] == "start"


def test_a_rollback_logs_its_added_skip_when_the_step_is_trained_again(tmp_path):
    path = tmp_path / "log.jsonl"
    first = skip_tracker(path, "")
    first.start(TOPO)
    heads = {}
    for s in range(1, 7):
        first.record(s, (s - 1) * 4, ids(s))
        heads[s] = first.head()
    rolled = skip_tracker(path, "5:2")  # rolled back to checkpoint 4, skip added
    rolled.resume(heads[4], TOPO)
    for s in range(5, 9):
        rolled.record(s, (s - 1) * 4, ids(s + 2))
    again = skip_tracker(path, "5:2")  # a later resume past the skip logs none
    again.resume(rolled.head(), TOPO)
    contents = read_log(path)
    assert [(e["event"], e["from_step"]) for e in contents.events] == [
        ("start", 0), ("resume", 4), ("skip", 4), ("resume", 8),
    ]  # fmt: skip
    assert contents.problems == [] and sorted(contents.records) == list(range(1, 9))
    assert contents.records[4]["chain"] == heads[4]["chain"]
    assert contents.events[2]["chain"] == heads[4]["chain"]


@pytest.mark.parametrize("field, value", [("from_step", 1), ("step", 4), ("chain", "0" * 64)])
def test_an_edited_skip_event_is_an_event_problem(tmp_path, field, value):
    from torchtitan_zephon.tracker import LogReader

    path = tmp_path / "log.jsonl"
    t = skip_tracker(path, "3:2")
    t.start(TOPO)
    for s in range(1, 6):
        t.record(s, (s - 1) * 4, ids(s))
    log = path.read_text().splitlines()
    event = json.loads(log[3])
    assert event["event"] == "skip"
    event[field] = value
    log[3] = json.dumps(event, sort_keys=True)
    path.write_text("\n".join(log) + "\n")
    for fast in (True, False):
        problems = LogReader(path, fast=fast).check().problems
        assert [(p.line, p.kind) for p in problems][:1] == [(4, "event")], problems
        assert problems[0].message.startswith(
            f"line 4: a skip event for step {event['step']} (from_step {event['from_step']}) "
            "that does not follow the log's step 2 before it"
        )


def test_only_the_writer_logs_a_skip(tmp_path):
    t = skip_tracker(tmp_path / "log.jsonl", "1:1", writer=False)
    t.start(TOPO)
    t.record(1, 0, ids(1))
    assert not (tmp_path / "log.jsonl").exists()


def test_a_healed_log_appends_the_peers_records_and_is_their_history(tmp_path):
    """torchft healing (issue 30 part b1): a group behind at step 2 takes a peer's
    records 3..6 after a resume event marked healed; its log is then the peer's history,
    and it records on from there."""
    peer = tracker(tmp_path / "peer.jsonl")
    peer.start(TOPO)
    for s in range(1, 7):
        peer.record(s, (s - 1) * 4, ids(s), b"x" * 16)
    behind = tracker(tmp_path / "behind.jsonl")
    behind.start(TOPO)
    for s in range(1, 3):
        behind.record(s, (s - 1) * 4, ids(s), b"x" * 16)
    records = [read_log(tmp_path / "peer.jsonl").records[s] for s in range(1, 7)]
    lines = behind.missed_lines(records, peer.head())
    assert [json.loads(line)["step"] for line in lines] == [3, 4, 5, 6]
    behind.healed(2, lines, peer.head(), TOPO)
    assert behind.head() == peer.head()
    for t in (peer, behind):
        t.record(7, 24, ids(7), b"x" * 16)
    a, b = read_log(tmp_path / "peer.jsonl"), read_log(tmp_path / "behind.jsonl")
    assert a.records == b.records and sorted(b.records) == list(range(1, 8))
    (healed,) = [e for e in b.events if e.get("healed")]
    assert (healed["event"], healed["from_step"]) == ("resume", 2)
    assert not b.problems


def test_healing_from_another_history_is_refused_and_writes_nothing(tmp_path):
    peer = tracker(tmp_path / "peer.jsonl", seed=1)  # another data config: another chain
    peer.start(TOPO)
    for s in range(1, 5):
        peer.record(s, (s - 1) * 4, ids(s), b"x" * 16)
    behind = tracker(tmp_path / "behind.jsonl")
    behind.start(TOPO)
    behind.record(1, 0, ids(1), b"x" * 16)
    before = (tmp_path / "behind.jsonl").read_bytes()
    records = [read_log(tmp_path / "peer.jsonl").records[s] for s in range(1, 5)]
    with pytest.raises(TrackerError, match="does not continue the sequence log"):
        behind.missed_lines(records, peer.head())
    short = [r for r in records if r["step"] != 4]
    with pytest.raises(TrackerError, match="does not reach their chain head at step 4"):
        tracker(tmp_path / "x.jsonl", seed=1).missed_lines(short, peer.head())
    assert (tmp_path / "behind.jsonl").read_bytes() == before
