"""Left-out samples end to end (issue 22, point 2): a run with ``--zephon.exclude FILE``
never trains the listed ids from their step on (its sequence log holds the digests of a
plan without them), and the reference rolled back to checkpoint 4 and resumed on one
rank with the list verifies MATCH against a fresh 2-rank run with the list from the
start. Bad lists are refused at the trainer's start (the preflight), saying the line,
with the run folder unchanged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.titan.expect import assert_refused, assert_unchanged, log_records, resume_events, tree
from tests.titan.launch import copy_run_until, train, train03
from tests.titan.test_preflight import data_job
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.job.plans import plan_of
from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD, Exclusions
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.titan.start.decision import StartRefused
from torchtitan_zephon.titan.start.preflight import decide_start
from torchtitan_zephon.tracker import ids_digest


def test_left_out_ids_never_train_and_a_rollback_on_one_rank_matches(
    e2e_root: Path, reference: Path, capsys
):
    plain = runs.read_data_state(reference / "checkpoint" / "step-8").config
    reference_plan = plan_of(plain)
    left = reference_plan.global_ids(6)[:3].tolist() + reference_plan.global_ids(7)[-1:].tolist()
    exclude = e2e_root / "left_out.jsonl"
    exclude.write_text(json.dumps({"ids": left, "from_step": 5}) + "\n")
    fresh = train03(
        e2e_root / "exclude_fresh", 2, "--zephon.exclude", str(exclude),
        "--debug.save_config_file", "config.json",
    ).check().run  # fmt: skip
    rolled = copy_run_until(reference, e2e_root / "exclude_rolled", 4)
    train(rolled, 1, "--zephon.exclude", str(exclude)).check()
    (event,) = resume_events(rolled)
    assert event["from_step"] == 4 and event["extended"] == [EXCLUDE_FIELD]
    assert event["notes"][0].startswith("exclude gained an entry: from step 5, 4 ids (sha256 ")
    assert main(["verify", str(fresh), str(rolled)]) == 0
    assert "verdict: MATCH: both runs saw identical data at all 8 common steps" in (
        capsys.readouterr().out
    )
    # the log holds the steps of the plan without the left-out ids, from step 5 on
    config = runs.read_data_state(fresh / "checkpoint" / "step-8").config
    assert config.exclude == Exclusions.load(str(exclude)).to_json()
    plan = plan_of(config, exclusions=Exclusions.load(str(exclude)))
    records = log_records(fresh)
    for step in range(1, 9):
        ids = plan.global_ids(step)
        first = plan.step_positions(step)[0]
        assert records[step]["ids_digest"] == ids_digest(ids, config.step_key(step), first)
        if step >= 5:
            assert not set(ids.tolist()) & set(left), step
    ref = log_records(reference)
    assert [ref[s]["ids_digest"] == records[s]["ids_digest"] for s in range(1, 9)] == [
        *[True] * 4,
        *[False] * 4,
    ]
    assert main(["verify", str(reference), str(fresh)]) == 1
    assert "where their left-out samples differ: at step 5" in capsys.readouterr().out
    assert main(["inspect", str(fresh)]) == 0  # the left-out list the data config binds
    out = capsys.readouterr().out
    assert "    left out:           from step 5, 4 ids (sha256 " in out
    assert "    skip_steps:         (none)\n" in out
    # show and where read the list from the job config the run saved (zephon.exclude)
    assert main(["show", str(fresh), "--step", "6", "--json"]) == 0, capsys.readouterr().err
    shown = json.loads(capsys.readouterr().out)["samples"]
    assert [s["sample"] for s in shown] == plan.global_ids(6).tolist()
    assert main(["show", str(reference), "--step", "6", "--sample", "0", "--json"]) == 0
    (was,) = json.loads(capsys.readouterr().out)["samples"]  # left[0], trained there before
    assert was["sample"] == left[0]
    doc = was["documents"][0]["document"]
    assert main(["where", str(fresh), "--doc", str(doc), "--json"]) == 0
    hits = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    (mine,) = [h for h in hits if h["sample"] == left[0] and h["epoch"] == 0]
    assert (mine["status"], mine["left_out_from"], mine["step"]) == ("left out", 5, None)


def test_a_list_that_edits_a_trained_step_is_refused_with_the_folder_unchanged(
    e2e_root: Path, reference: Path
):
    run = copy_run_until(reference, e2e_root / "exclude_past", 4)
    exclude = e2e_root / "left_out_past.jsonl"
    exclude.write_text(json.dumps({"ids": [1, 2], "from_step": 3}))
    before = tree(run)
    job = train(run, 1, "--zephon.exclude", str(exclude), log=e2e_root / "exclude_past.log")
    assert_refused(
        job,
        "  exclude: the left-out entries at or before step 4 differ from step 3 on (saved: "
        "(none); current: from step 3, 2 ids (sha256 ",
        "allow_changes=['exclude']",
    )
    assert_unchanged(before, tree(run))


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"ids": [3], "from_step": 2}\n{"ids": [1],', "line 2 is not JSON"),
        ('{"ids": [3], "from_step": 0}', "line 1: from_step is 0; steps are 1-based"),
        ('{"ids": [99999999], "from_step": 2}', "line 1: id 99999999 is not a sample of the store"),
        ('{"ids": [3], "from_step": 2, "source": "web"}', 'names "source": "web"'),
        (None, "cannot read zephon.exclude file"),
    ],
)
def test_a_bad_list_is_refused_at_the_start_with_nothing_written(tmp_path: Path, text, message):
    path = tmp_path / "left_out.jsonl"
    if text is not None:
        path.write_text(text)
    run = tmp_path / "run"
    view = data_job(run, exclude=str(path), dump_folder=str(run))
    with pytest.raises(StartRefused) as e:
        decide_start(view, writer=True)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not run.exists()


def test_a_held_out_id_is_refused_at_the_start(tmp_path: Path):
    run = tmp_path / "run"
    view = data_job(run, dump_folder=str(run))
    source = decide_start(view, writer=True).data
    first_held = source.sample_offset + source.num_samples
    path = tmp_path / "left_out.jsonl"
    path.write_text(json.dumps({"ids": [1, first_held], "from_step": 3}))
    with pytest.raises(StartRefused, match=f"id {first_held} is a held-out \\(validation\\)"):
        decide_start(dataclass_with(view, exclude=str(path)), writer=True)


def dataclass_with(view, **zephon):  # noqa: ANN001, ANN201 - a JobView
    return dataclasses.replace(view, zephon=dataclasses.replace(view.zephon, **zephon))


def test_an_entry_after_the_last_step_is_a_warning(tmp_path: Path):
    path = tmp_path / "left_out.jsonl"
    path.write_text(json.dumps({"ids": [1, 2], "from_step": 3}) + "\n")
    run = tmp_path / "run"
    view = data_job(run, exclude=str(path), dump_folder=str(run))
    assert view.steps > 3 and not decide_start(view, writer=True).notes
    assert decide_start(dataclasses.replace(view, steps=2), writer=True).notes == [
        "zephon.exclude entry from step 3 (2 ids) starts after training.steps (2): it leaves "
        "nothing out in this run (a run that trains past step 2 applies it)"
    ]
