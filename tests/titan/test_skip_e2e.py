"""Skip ranges end to end (issue 22): roll back to a checkpoint, add a skip, resume on
another number of ranks; the run equals a fresh run with the skip from the start, and a
skip inside the trained steps (or a malformed one) is refused with the run folder unchanged.

Both front ends take the field: the fresh run is the registry job ``llama3_tiny`` (0.3
spellings, ``--zephon.skip_steps``), the rolled-back one the TOML twin ``tiny.toml`` (0.2.2
spellings, the same ``--zephon.skip_steps``) the reference was trained with."""

from __future__ import annotations

from pathlib import Path

from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_losses,
    assert_refused,
    assert_unchanged,
    log_records,
    resume_events,
    tree,
)
from tests.titan.launch import copy_run_until, train, train03
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.tracker import read_log

SKIP = ("--zephon.skip_steps", "5:3")


def test_a_rollback_with_a_skip_matches_a_fresh_run_with_the_skip(
    e2e_root: Path, reference: Path, capsys
):
    fresh_job = train03(e2e_root / "skip_fresh", 2, *SKIP).check()
    fresh = fresh_job.run
    # a fresh run says the skip as a resume does (issue 28, item 13)
    assert (
        "Zephon: skip_steps 5:3: at step 5, skip the data of 3 steps (5..7): step 5 trains "
        "what step 8 would have trained" in fresh_job.output
    )
    # The finished reference, rolled back in place: load step 4, skip, train 5..8 again.
    rolled = copy_run_until(reference, e2e_root / "skip_rolled", 8)
    old_8 = (rolled / "checkpoint" / "step-8" / ".metadata").read_bytes()
    job = train(rolled, 1, "--checkpoint.load_step", "4", *SKIP).check()
    aside = rolled / "checkpoint_abandoned" / "rollback_to_step_4"
    assert (
        "Zephon: rollback to step 4: the checkpoints after it (step-8) were moved to "
        f"{aside}, so that no later automatic resume picks the abandoned branch" in job.output
    )
    assert sorted(p.name for p in aside.iterdir()) == ["step-8"]
    assert (aside / "step-8" / ".metadata").read_bytes() == old_8
    assert [c.step for c in runs.checkpoints(rolled)] == [4, 8]  # step-8 of the new branch
    assert dict(runs.read_data_state(rolled / "checkpoint" / "step-8").config.extra)["skip_steps"]
    (event,) = resume_events(rolled)
    assert event["from_step"] == 4 and event["extended"] == ["skip_steps"]
    assert event["notes"][0].startswith("skip_steps gained 5:3: at step 5, skip the data of 3")
    for run, kinds in ((fresh, ["start", "skip"]), (rolled, ["start", "resume", "skip"])):
        events = read_log(run / "zephon" / "sequence_log.jsonl").events
        assert [e["event"] for e in events] == kinds
        assert (events[-1]["from_step"], events[-1]["step"], events[-1]["steps"]) == (4, 5, 3)
    assert main(["verify", str(fresh), str(rolled)]) == 0
    assert "verdict: MATCH: both runs saw identical data at all 8 common steps" in (
        capsys.readouterr().out
    )
    assert_losses(fresh, rolled, range(5, 9), rtol=TOPOLOGY_RTOL)
    ref, skipped = log_records(reference), log_records(fresh)
    assert [ref[s]["ids_digest"] == skipped[s]["ids_digest"] for s in range(1, 9)] == [
        *[True] * 4,
        *[False] * 4,
    ]
    assert main(["verify", str(reference), str(fresh)]) == 1
    out = capsys.readouterr().out
    assert "verdict: MISMATCH: the runs saw different data from step 5 (where their " in out
    assert "at step 5, A does not skip there and B skips the data of 3 steps there" in out
    # zephon inspect RUN shows the skips and left-out list the data config binds (item 9)
    assert main(["inspect", str(fresh)]) == 0
    out = capsys.readouterr().out
    assert "    skip_steps:         5:3\n" in out and "    left out:           (none)\n" in out


def test_a_skip_inside_the_trained_steps_is_refused(e2e_root: Path, reference: Path):
    run = copy_run_until(reference, e2e_root / "skip_past", 4)
    log = e2e_root / "skip_past.log"
    before = tree(run)
    job = train(run, 1, "--zephon.skip_steps", "3:2", log=log)
    assert_refused(
        job,
        "  skip_steps: (none) -> 3:2 (the entries at or before step 4 differ from step 3 on",
        "allow_changes=['skip_steps']",
        '--zephon.allow_changes skip_steps (TOML: [zephon] allow_changes = ["skip_steps"])',
    )
    assert_unchanged(before, tree(run))


def test_a_malformed_skip_is_refused_before_anything_is_written(tmp_path: Path):
    job = train03(tmp_path / "log", 1, "--dump_folder", str(tmp_path / "run"),
                  "--zephon.skip_steps", "5:3,6:2")  # fmt: skip
    assert_refused(
        job,
        "zephon.skip_steps: skip entries 5:3 and 6:2 overlap: the first covers steps 5..7, "
        "the second starts at step 6. Start the second at step 8 or later, or merge them "
        "into one entry (e.g. 5:3).",
    )
    assert not (tmp_path / "run").exists()


def test_a_skip_past_the_last_step_is_a_warning_and_the_run_trains(tmp_path: Path):
    run = tmp_path / "run"
    job = train03(tmp_path / "log", 1, "--dump_folder", str(run), "--training.steps", "2",
                  "--zephon.skip_steps", "5:3").check()  # fmt: skip
    assert (
        "Zephon: zephon.skip_steps entry 5:3 starts after training.steps (2): it takes no "
        "effect in this run (a run that trains past step 4 applies it)"
    ) in job.output
    assert sorted(log_records(run)) == [1, 2]
