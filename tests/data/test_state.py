"""The data state: one type, its JSON, its fingerprint and the resume rule."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.data.digest import fingerprint
from torchtitan_zephon.data.plan import BatchSchedule
from torchtitan_zephon.data.state import (
    DataConfig,
    DataState,
    DataStateMismatch,
    check_resume,
    schedule_appended,
)


def config(**kw) -> DataConfig:
    base = dict(
        seq_len=8, seed=0, schedule=BatchSchedule.parse("1:4,10:8"), sample_offset=0,
        num_samples=1000, store_fingerprint="s" * 64, tokenizer_hash="t" * 64,
    )  # fmt: skip
    base.update(kw)
    return DataConfig.make(**base)


schedules = st.lists(
    st.tuples(st.integers(2, 200), st.integers(1, 64)), max_size=4, unique_by=lambda e: e[0]
).map(lambda es: BatchSchedule([(1, 4)] + sorted(es)))


@settings(max_examples=200, deadline=None)
@given(
    seq_len=st.integers(1, 4096),
    seed=st.integers(0, 2**63 - 1),
    schedule=schedules,
    num_samples=st.integers(1, 10**12),
    step=st.integers(1, 10**6),
    head=st.one_of(st.none(), st.text("0123456789abcdef", min_size=64, max_size=64)),
)
def test_state_round_trips_through_json(seq_len, seed, schedule, num_samples, step, head):
    cfg = config(seq_len=seq_len, seed=seed, schedule=schedule, num_samples=num_samples)
    tracker = None if head is None else {"step": step - 1, "chain": head}
    state = DataState(cfg, step, schedule.first_position(step), (1, 0), tracker)
    assert DataState.from_json(state.to_json()) == state
    assert DataState.from_dict(json.loads(state.to_json())).config.fingerprint == cfg.fingerprint
    assert len(state.to_json()) < 4096
    decision = check_resume(state, cfg)  # its own config always resumes, without opt-in
    assert decision.anchor == (1, 0) and not decision.accepted


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(
        ["seq_len", "seed", "num_samples", "store_fingerprint", "tokenizer_hash"]
    ),
    allow=st.lists(st.sampled_from(["seed", "seq_len", "store", "tokenizer", "num_samples"])),
)
def test_a_changed_field_resumes_exactly_when_allowed(field, allow):
    old = config()
    new = config(**{field: {"seq_len": 16, "seed": 1, "num_samples": 999}.get(field, "x" * 64)})
    state = DataState(old, 5, 16)
    opens = {"store": {"store_fingerprint", "num_samples"}, "tokenizer": {"tokenizer_hash"}}
    allowed = set().union(*(opens.get(a, {a}) for a in allow))
    if field in allowed:
        assert check_resume(state, new, allow).accepted == (field,)
    else:
        with pytest.raises(DataStateMismatch, match=rf"(?s){field}: .* -> .*allow_changes"):
            check_resume(state, new, allow)


@settings(max_examples=300, deadline=None)
@given(old=schedules, extra=schedules, next_step=st.integers(1, 300))
def test_a_schedule_extended_for_untrained_steps_is_a_continuation(old, extra, next_step):
    """Appending entries at steps >= next_step keeps every trained step's positions;
    anything else that changes the schedule needs the opt-in."""
    last = old.entries[-1][0]
    appended = BatchSchedule(
        old.entries + [(s + max(last, next_step - 1), g) for s, g in extra.entries[1:]]
    )
    state = DataState(config(schedule=old), next_step, old.first_position(next_step))
    new = config(schedule=appended)
    if appended.entries != old.entries:
        assert schedule_appended(old, appended, next_step)
        decision = check_resume(state, new)
        assert decision.extended == ("schedule",) and decision.anchor == (1, 0)
        for s in range(1, next_step + 1):
            assert appended.first_position(s) == old.first_position(s)
    if not schedule_appended(old, extra, next_step):
        with pytest.raises(DataStateMismatch, match="schedule"):
            check_resume(state, config(schedule=extra))


def test_a_dropped_or_edited_past_entry_is_refused():
    state = DataState(config(schedule=BatchSchedule.parse("1:4,10:8")), 12, 4 * 9 + 8 * 2)
    for text in ("4", "1:4,10:16", "1:4,11:8", "1:4,10:8,12:4", "1:4,10:8,11:2"):
        new = config(schedule=BatchSchedule.parse(text))
        refused = text not in ("1:4,10:8,12:4",)
        if refused:
            with pytest.raises(DataStateMismatch, match="schedule: "):
                check_resume(state, new)
        else:
            assert check_resume(state, new).extended == ("schedule",)


def test_format_1_records_still_load():
    """A record written before this module (format 1: no order_format) resumes."""
    cfg = config()
    old_config = {k: v for k, v in cfg.to_dict().items() if k != "order_format"}
    record = {
        "format": 1,
        "store_fingerprint": cfg.store_fingerprint,
        "data_config": old_config,
        "data_config_fingerprint": fingerprint(old_config),
        "next_step": 3,
        "consumed_positions": 8,
        "position_anchor": [1, 0],
        "tracker": {"step": 2, "chain": "c" * 64},
    }
    state = DataState.from_dict(record)
    assert state.config == cfg and state.tracker == {"step": 2, "chain": "c" * 64}
    assert check_resume(state, cfg).anchor == (1, 0)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(format=99), "unsupported data state format 99"),
        (lambda r: r.pop("data_config"), "no data_config"),
        (lambda r: r["data_config"].update(seed=5), "does not hash to its recorded"),
        (lambda r: r.update(next_step=0), "next_step=0"),
        (
            lambda r: r.update(consumed_positions=9),
            "inconsistent: step 3 should start at position 8",
        ),
        (lambda r: r.update(store_fingerprint="z"), "store_fingerprint disagrees"),
        (lambda r: r.update(next_step="x"), "invalid field"),
    ],
)
def test_corrupt_records_are_refused_naming_the_problem(edit, message):
    cfg = config()
    record = json.loads(DataState(cfg, 3, 8).to_json())
    edit(record)
    with pytest.raises(DataStateMismatch, match=message):
        check_resume(DataState.from_dict(record), cfg)
    with pytest.raises(DataStateMismatch, match="not valid JSON"):
        DataState.from_json("{")


def test_order_key_ignores_the_schedule_only():
    a = config()
    assert a.order_key == config(schedule=BatchSchedule.parse("64")).order_key
    assert a.fingerprint != config(schedule=BatchSchedule.parse("64")).fingerprint
    for change in ({"seq_len": 9}, {"seed": 1}, {"num_samples": 5}, {"sample_offset": 1}):
        assert config(**change).order_key != a.order_key
