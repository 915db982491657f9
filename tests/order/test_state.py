"""The data state: one type, its JSON, its fingerprint and the resume rule."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.job.plans import first_correction
from torchtitan_zephon.order.data_config import DataConfig, DataStateMismatch
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.resume import check_resume, schedule_appended
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.store.format import fingerprint


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


# ---------------------------------------------------------------- mixtures


def mixture_config(entries, sizes=None, *, step=None, **kw) -> DataConfig:
    """A mixture's data config (as JobData.data_config makes it)."""
    from torchtitan_zephon.job.data import mixture_store_fingerprint
    from torchtitan_zephon.order.mixture.spec import MixtureSpec

    spec = MixtureSpec.build(sizes or {"code": 50, "web": 70}, entries)
    fields = dict(
        num_samples=sum((sizes or {"code": 50, "web": 70}).values()),
        store_fingerprint=mixture_store_fingerprint(spec),
        extra={"mixture": spec.to_json()},
    )
    fields.update(kw)
    return config(**fields)


weight_entries = st.lists(
    st.tuples(
        st.integers(2, 60),
        st.fixed_dictionaries({"code": st.integers(0, 3), "web": st.integers(1, 3)}),
    ),
    max_size=3,
    unique_by=lambda e: e[0],
).map(lambda es: [(1, {"code": 1, "web": 1})] + sorted(es))


def test_a_mixture_order_key_binds_its_sources_not_its_weights():
    a = mixture_config([(1, {"code": 1, "web": 3})])
    b = mixture_config([(1, {"code": 1, "web": 3}), (9, {"code": 1, "web": 0})])
    assert a.order_key == b.order_key and a.fingerprint != b.fingerprint
    assert [a.step_key(s) == b.step_key(s) for s in (1, 8, 9, 100)] == [True, True, False, False]
    assert b.step_key(9) == b.step_key(10) != b.step_key(8)
    assert mixture_config([(1, {"code": 1, "web": 3})], {"code": 50, "web": 71}).order_key != (
        a.order_key
    )
    plain = config()  # one store: the order key of every run logged so far, unchanged
    body = {k: v for k, v in plain.to_dict().items() if k != "schedule"}
    assert plain.order_key == fingerprint(body) == plain.step_key(5)


@settings(max_examples=200, deadline=None)
@given(old=weight_entries, new=weight_entries, next_step=st.integers(1, 70))
def test_a_mixture_resumes_freely_exactly_when_its_trained_steps_keep_their_weights(
    old, new, next_step
):
    """Entries that differ only for steps >= next_step are a continuation ("extended");
    any difference for a trained step is the field "mixture", refused unless allowed."""
    from torchtitan_zephon.order.mixture.spec import MixtureSpec, past_change

    a, b = mixture_config(old), mixture_config(new)
    state = DataState(a, next_step, a.batch_schedule().first_position(next_step))
    same_past = (
        past_change(
            MixtureSpec.from_json(a.mixture), MixtureSpec.from_json(b.mixture), next_step - 1
        )
        is None
    )
    if a == b:
        assert check_resume(state, b).extended == ()
    elif same_past:
        decision = check_resume(state, b)
        assert decision.extended == ("mixture",) and decision.anchor == (1, 0)
        for s in range(1, next_step):
            assert a.step_key(s) == b.step_key(s)  # the trained steps' records still verify
    else:
        with pytest.raises(
            DataStateMismatch, match=r"(?s)  mixture: .*allow_changes=\['mixture'\]"
        ):
            check_resume(state, b)
        assert check_resume(state, b, ["mixture"]).accepted == ("mixture",)


def test_mixture_sources_and_tokenizer_changes_are_named():
    entries = [(1, {"code": 1, "web": 1})]
    a = mixture_config(entries)
    state = DataState(a, 5, 16)
    for new, message in [
        (
            mixture_config(entries, {"code": 50, "web": 69}),
            "mixture: source 'web': num_samples was 70, now 69.",
        ),
        (
            mixture_config(
                [(1, {"code": 1, "web": 1, "math": 0})], {"code": 50, "web": 70, "math": 9}
            ),
            "mixture: source 'math' was added",
        ),
        (config(), "mixture: one store replaces a mixture of 2 sources"),
        (mixture_config(entries, tokenizer_hash="u" * 64), "tokenizer_hash: 'tttt"),
    ]:
        with pytest.raises(DataStateMismatch, match=re.escape(message)):
            check_resume(state, new)
    opened = check_resume(state, mixture_config(entries, {"code": 50, "web": 69}), ["mixture"])
    assert opened.accepted == ("mixture",)  # store_fingerprint and num_samples go with it


def test_a_rule_1_mixture_resumes_unless_the_new_rule_corrects_a_trained_step():
    """Mixture records of format 1 (before corrected steps) continue exactly when
    the current rule corrects no trained step of their schedule (a note says so);
    otherwise the change is named with the first corrected step and needs the opt-in."""
    from torchtitan_zephon.order.mixture.plan import MixturePlan
    from torchtitan_zephon.order.mixture.spec import MixtureSpec

    def old(cfg: DataConfig) -> DataConfig:
        rule1 = {**cfg.mixture, "format": "zephon-mixture/1"}
        return DataConfig.from_dict({**cfg.to_dict(), "mixture": rule1})

    sizes = {"a": 900, "b": 900, "c": 900, "d": 900}
    five = BatchSchedule([(1, 5)])
    calm = [(1, {"a": 1, "b": 1, "c": 1, "d": 1})]
    cfg = mixture_config(calm, sizes, schedule=five)
    decision = check_resume(DataState(old(cfg), 5, 20), cfg, first_correction=first_correction)
    assert decision.extended == () and decision.accepted == ()
    assert decision.notes == (
        "the mixture rule changed (zephon-mixture/1 -> zephon-mixture/2) but corrects no "
        "step of this schedule: every step draws the same samples; the run keeps "
        "zephon-mixture/1",
    )
    assert decision.config == old(cfg)  # the run goes on bound to the rule it started with
    w1 = {"a": "0.5", "b": "0.123", "c": "0.7"}
    w2 = {"a": 1, "b": "0.3", "c": "0.001"}
    w3 = {"a": "0.3", "b": "0.5", "c": 0}
    eleven = BatchSchedule([(1, 11)])
    for shift in (0, 100):  # the changes at steps 16 and 18, or 116 and 118
        entries = [(1, w1), (16 + shift, w2), (18 + shift, w3)]
        cfg = mixture_config(entries, dict.fromkeys("abc", 900), schedule=eleven)
        step = MixturePlan(MixtureSpec.from_json(cfg.mixture), 0, eleven).first_correction
        assert step is not None and shift < step
        trained = DataState(old(cfg), step, 11 * (step - 1))
        message = (
            "the mixture rule changed (zephon-mixture/1 -> zephon-mixture/2): the new rule "
            f"corrects step {step}, a trained step"
        )
        with pytest.raises(DataStateMismatch, match=re.escape(message)):
            check_resume(
                DataState(old(cfg), step + 1, 11 * step), cfg, first_correction=first_correction
            )
        assert check_resume(
            DataState(old(cfg), step + 1, 11 * step),
            cfg,
            ["mixture"],
            first_correction=first_correction,
        ).accepted
        # the corrected step not trained yet
        decision = check_resume(trained, cfg, first_correction=first_correction)
        assert decision.config is None  # the new rule plans the steps from there on
        assert decision.accepted == () and decision.notes == (
            "the mixture rule changed (zephon-mixture/1 -> zephon-mixture/2); its first "
            f"corrected step is {step}, after the trained ones: those keep their samples, "
            f"and steps from {step} on follow the new rule",
        )


def test_a_rule_1_note_under_an_accepted_batch_schedule_change_names_no_trained_step():
    """Rule 2 corrects nothing under the saved batch size but step 20 under the new
    one: resuming at step 30 with the schedule change accepted says so truthfully."""
    entries = [
        (1, {"a": "0.5", "b": "0.123", "c": "0.7"}),
        (16, {"a": 1, "b": "0.3", "c": "0.001"}),
        (18, {"a": "0.3", "b": "0.5", "c": 0}),
    ]
    saved = mixture_config(entries, dict.fromkeys("abc", 900), schedule=BatchSchedule([(1, 12)]))
    rule1 = {**saved.mixture, "format": "zephon-mixture/1"}
    old = DataConfig.from_dict({**saved.to_dict(), "mixture": rule1})
    current = mixture_config(entries, dict.fromkeys("abc", 900), schedule=BatchSchedule([(1, 11)]))
    decision = check_resume(
        DataState(old, 30, 12 * 29), current, ["schedule"], first_correction=first_correction
    )
    assert decision.accepted == ("schedule",) and decision.config is None
    assert decision.notes == (
        "the mixture rule changed (zephon-mixture/1 -> zephon-mixture/2); under the new batch "
        "schedule it first corrects step 20: the trained steps kept the old batch schedule's "
        "samples, and the steps from here on follow the new rule",
    )


# ---------------------------------------------------------------- whole changes (issue 18)


def refusal(state: DataState, current: DataConfig, allow=()) -> str:
    with pytest.raises(DataStateMismatch) as e:
        check_resume(state, current, allow)
    return str(e.value)


def test_a_seq_len_change_is_named_once_with_what_follows_under_one_opt_in():
    """One store: the sample count that changes with seq_len is on the seq_len line, and
    allow_changes=['seq_len'] accepts both."""
    state = DataState(config(seq_len=8, num_samples=1000), 5, 16)
    new = config(seq_len=16, num_samples=499)
    msg = refusal(state, new)
    assert (
        "  seq_len: 8 -> 16 (every sample is another window of the same store, so num_samples "
        "1000 -> 499)\nTo accept, opt in with allow_changes=['seq_len'] (or 'all')."
    ) in msg
    assert "  num_samples:" not in msg
    assert check_resume(state, new, ["seq_len"]).accepted == ("num_samples", "seq_len")
    # with another store too, the counts are the store's doing: named apart, as before
    other = config(seq_len=16, num_samples=499, store_fingerprint="o" * 64)
    msg = refusal(state, other)
    assert "  num_samples: 1000 -> 499\n" in msg and "  seq_len: 8 -> 16\n" in msg
    with pytest.raises(DataStateMismatch, match="num_samples"):
        check_resume(state, other, ["seq_len"])
    assert check_resume(state, other, ["seq_len", "store"]).accepted


def test_a_mixture_seq_len_change_names_every_source_once_under_one_opt_in():
    """A mixture's seq_len change: every source's new count on the seq_len line (not
    'mixture: source ...' for the first one), and 'seq_len' alone accepts it."""
    entries = [(1, {"code": 1, "web": 3, "gz": 0})]
    state = DataState(mixture_config(entries, {"code": 50, "web": 70, "gz": 9}, seq_len=8), 5, 16)
    new = mixture_config(entries, {"code": 25, "web": 35, "gz": 4}, seq_len=16)
    msg = refusal(state, new)
    assert (
        "  seq_len: 8 -> 16 (every sample is another window of the same stores, so the "
        "sources' training samples: 'code' 50 -> 25, 'gz' 9 -> 4, 'web' 70 -> 35)\n"
        "To accept, opt in with allow_changes=['seq_len'] (or 'all')."
    ) in msg
    assert "mixture:" not in msg and "num_samples:" not in msg
    decision = check_resume(state, new, ["seq_len"])
    assert "seq_len" in decision.accepted and decision.anchor == (1, 0)
    # another change besides it stays a change of its own, named without the counts
    weights = [(1, {"code": 1, "web": 1, "gz": 0})]
    edited = mixture_config(weights, {"code": 25, "web": 35, "gz": 4}, seq_len=16)
    msg = refusal(state, edited)
    assert (
        "  mixture: schedule entry 1 (from_step 1): weight of source 'code' was 1/4, now 1/2" in msg
    )
    assert "num_samples was" not in msg and "allow_changes=['mixture', 'seq_len']" in msg
    with pytest.raises(DataStateMismatch, match="mixture"):
        check_resume(state, edited, ["seq_len"])
    assert check_resume(state, edited, ["seq_len", "mixture"]).accepted


def test_a_past_weight_edit_lists_every_changed_weight_and_source():
    sizes = {"code": 50, "web": 70, "math": 30}
    old = [(1, {"code": 1, "web": 2, "math": 1}), (3, {"code": 1, "web": 1, "math": 0})]
    new = [(1, {"code": 1, "web": 1, "math": 2}), (3, {"code": 0, "web": 1, "math": 1})]
    state = DataState(mixture_config(old, sizes), 5, 16)
    msg = refusal(state, mixture_config(new, {"code": 50, "web": 69, "math": 31}))
    lines = [
        "schedule entry 1 (from_step 1): weight of source 'math' was 1/4, now 1/2 (normalized).",
        "schedule entry 1 (from_step 1): weight of source 'web' was 1/2, now 1/4 (normalized).",
        "schedule entry 2 (from_step 3): weight of source 'code' was 1/2, now 0/1 (normalized).",
        "schedule entry 2 (from_step 3): weight of source 'math' was 0/1, now 1/2 (normalized).",
        "source 'math': num_samples was 30, now 31.",
        "source 'web': num_samples was 70, now 69.",
    ]
    assert "  mixture: " + "\n    ".join(lines) + "\n" in msg, msg
    assert "'code' was 1/4" not in msg  # an unchanged weight is not a change


def test_saved_records_are_named_in_json_words_never_python():
    cfg = config()
    record = json.loads(DataState(cfg, 3, 8).to_json())
    cases = [
        (None, "the data state is null, not a JSON object"),
        ([1, 2], "the data state is [1, 2], not a JSON object"),
        ({**record, "format": None}, "unsupported data state format null; expected 2"),
        ({**record, "format": True}, "unsupported data state format true"),
        (
            {**record, "next_step": "x"},
            "has an invalid field 'next_step': 'x', expected an integer",
        ),
        ({**record, "next_step": None}, "the data state has no field 'next_step'"),
        ({**record, "position_anchor": 3}, "invalid field 'position_anchor': 3, expected [step"),
        ({**record, "tracker": {"step": 1}}, "invalid field 'tracker': { step = 1 }"),
    ]
    bad_config = {k: v for k, v in record["data_config"].items() if k != "seq_len"}
    cases.append(({**record, "data_config": bad_config}, "has no field 'seq_len'"))
    schedule = {**record["data_config"], "schedule": [[1, None]]}
    cases.append(({**record, "data_config": schedule}, "invalid field 'schedule': [[1, null]]"))
    for value, message in cases:
        with pytest.raises(DataStateMismatch) as e:
            DataState.from_dict(value)
        text = str(e.value)
        assert message in text, text
        for python in ("NoneType", "None", "True", "KeyError", "ValueError", "list", "int("):
            assert python not in text, text


def test_config_text_writes_values_as_toml_and_json_do():
    from decimal import Decimal
    from fractions import Fraction

    from torchtitan_zephon.order.data_config import config_text

    for value, text in [
        (Decimal("1.5"), "1.5"), (Decimal("NaN"), "nan"), (Decimal("-Infinity"), "-inf"),
        (float("inf"), "inf"), (None, "null"), (True, "true"), (3, "3"), (Fraction(3, 4), "3/4"),
        ("web", "'web'"), ("it's", '"it\'s"'), ([1, None], "[1, null]"),
        ({"a": Decimal("0.7"), "b": [False]}, "{ a = 0.7, b = [false] }"), ({}, "{}"),
    ]:  # fmt: skip
        assert config_text(value) == text
    assert config_text(list(range(1000))).endswith(" ...") and len(config_text("x" * 999)) < 210
