"""``zephon spikes``: the robust rule, the rollback it suggests, and the command on event
files written by TensorBoard's own SummaryWriter (the one TorchTitan 0.3 uses)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cli.test_show import write_run
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.cli.spikes import MIN_WINDOW, ROLLBACK_MARGIN, find_spikes, rollback
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.run.recorded import LOSS_TAG


def write_events(
    run: Path, losses: dict[int, float], tag: str = LOSS_TAG, when: str = "20261201-1200"
) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run / "tb" / when))
    for step, loss in losses.items():
        writer.add_scalar(tag, loss, step)
    writer.close()


def curve(n: int = 60, spike: int = 40, height: float = 3.0) -> dict[int, float]:
    rng = np.random.default_rng(0)
    out = {s: 5.0 + 0.05 * float(rng.standard_normal()) for s in range(1, n + 1)}
    out[spike] += height
    return out


def test_the_rule_flags_the_spike_only():
    losses = curve()
    assert [s["step"] for s in find_spikes(losses)] == [40]
    (s,) = find_spikes(losses)
    window = np.array([losses[t] for t in range(1, 40)])
    median = np.median(window)
    assert s["median"] == pytest.approx(median)
    assert s["sigma"] == pytest.approx(1.4826 * np.median(np.abs(window - median)))
    assert find_spikes(losses, k=s["score"] * 1.001) == []  # just above the threshold: none
    assert [x["step"] for x in find_spikes(losses, k=s["score"] * 0.999)] == [40]


def test_the_first_steps_use_the_shorter_window_they_have():
    losses = {1: 5.0, 2: 5.1, 3: 4.9, 4: 5.0, 5: 50.0, 6: 5.0, 7: 5.05, 8: 9.0}
    # step 5 has 4 steps before it (< MIN_WINDOW = 5): never judged; step 8 uses steps 1..7
    assert MIN_WINDOW == 5
    assert [s["step"] for s in find_spikes(losses, window=50)] == [8]
    flat = {s: 2.0 for s in range(1, 10)} | {10: 2.0001}  # MAD 0: any rise is a spike
    assert [s["step"] for s in find_spikes(flat)] == [10]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0.5, 10), min_size=1, max_size=80),
    st.integers(MIN_WINDOW, 60),
    st.floats(0.5, 10),
)
def test_the_rule_matches_its_formula(values, window, k):
    losses = dict(enumerate(values, start=1))
    expected = []
    for t in range(len(values)):
        w = np.array(values[max(0, t - window) : t])
        if w.size < MIN_WINDOW:
            continue
        m = np.median(w)
        if values[t] - m > max(k * 1.4826 * np.median(np.abs(w - m)), 0):
            expected.append(t + 1)
    assert [s["step"] for s in find_spikes(losses, k, window)] == expected


def test_rollback_takes_the_newest_checkpoint_ten_steps_back():
    assert rollback(40, [10, 20, 30, 35], SkipSteps()) == (30, "31:20")
    assert rollback(40, [31, 35], SkipSteps()) is None
    # the run's own entries up to C are kept (a continuation from C); later ones that
    # overlap the new entry are dropped, those after it kept
    assert rollback(40, [20, 30], SkipSteps([(5, 2), (33, 4)])) == (30, "5:2,31:20")
    assert rollback(40, [20, 30], SkipSteps([(5, 2), (33, 4), (60, 3)])) == (
        30,
        "5:2,31:20,60:3",
    )
    # an entry trained from before C still covers step C+1: the new one starts after it
    assert rollback(40, [20, 30], SkipSteps([(28, 5)])) == (30, "28:5,33:18")
    # the spike lies inside such a range: an older checkpoint, before the range
    assert rollback(30, [15, 20], SkipSteps([(16, 20)])) == (15, "16:25")
    # a checkpoint before the range replaces it; none before it: no skip can help
    assert rollback(60, [40, 50], SkipSteps([(45, 100)])) == (40, "41:30")
    assert rollback(60, [50], SkipSteps([(45, 100)])) is None


@settings(max_examples=300, deadline=None)
@given(
    entries=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 30)), max_size=4),
    checkpoints=st.lists(st.integers(1, 120), max_size=6),
    spike=st.integers(1, 130),
)
def test_a_suggested_rollback_is_a_continuation_that_changes_the_spikes_data(
    entries, checkpoints, spike
):
    """What the resume rule accepts from C (the entries with S <= C unchanged:
    order.resume.skips_kept) and a new entry that starts after C, at or before the
    spike, reaching ROLLBACK_MARGIN steps past it; None only when no checkpoint allows
    one."""
    skips = SkipSteps()
    for s, n in sorted(entries):  # non-overlapping, increasing entries
        if not skips.entries or s >= skips.entries[-1][0] + skips.entries[-1][1]:
            skips = SkipSteps([*skips.entries, (s, n)])
    early = [c for c in checkpoints if c <= spike - ROLLBACK_MARGIN]
    got = rollback(spike, checkpoints, skips)
    if got is None:
        assert all(skips.reach(c) > spike for c in early)
        return
    c, value = got
    new = SkipSteps.parse(value)
    assert c in early and all(skips.reach(d) > spike for d in early if d > c)
    assert new.up_to(c) == skips.up_to(c)
    (added,) = [(s, n) for s, n in new.entries if c < s <= spike]
    assert added[0] + added[1] - 1 == spike + ROLLBACK_MARGIN


def test_a_spike_inside_a_trained_skip_range_gets_the_left_out_list_of_its_samples(
    store_path, store, tmp_path, capsys
):
    """The run skipped 31:30 from step 31 (trained); a spike at step 45 lies inside that
    range and the only checkpoint before it is 35: no skip from 35 changes step 45's
    data, so spikes suggests leaving its samples out, and the lines it prints are a
    zephon.exclude file whose ids are step 45's."""
    run = write_run(
        tmp_path / "run",
        JobData.of_store(store, 8),
        skips="31:30",
        trained=60,
        saved={"zephon": {"store": str(store_path)}},
    )
    write_events(run, curve(60, 45))
    (run / "checkpoint" / "step-35").mkdir(parents=True)
    (run / "checkpoint" / "step-35" / ".metadata").write_bytes(b"")
    assert main(["spikes", str(run), "--json"]) == 0
    spike = json.loads(capsys.readouterr().out)
    assert spike["rollback"] is None
    assert spike["exclude"]["load_step"] == 35
    (line,) = spike["exclude"]["lines"]
    entry = json.loads(line)
    ids = sorted(s["sample"] for s in spike["data"]["samples"])
    assert entry == {"ids": ids, "from_step": 36}
    assert main(["spikes", str(run)]) == 0
    out = capsys.readouterr().out
    assert "no skip from a checkpoint at or before step 35 changes step 45's data" in out
    assert f"--checkpoint.load_step 35 --zephon.exclude FILE, FILE holding {line}" in out


def test_spikes_on_a_run_lists_the_spike_its_data_and_the_rollback(
    store_path, store, tmp_path, capsys
):
    run = write_run(
        tmp_path / "run",
        JobData.of_store(store, 8),
        trained=60,
        saved={"zephon": {"store": str(store_path)}},
    )
    write_events(run, curve(60, 40))
    for step in (10, 20, 30, 35):
        (run / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoint" / f"step-{step}" / ".metadata").write_bytes(b"")
    (run / "checkpoint" / "step-31").mkdir()  # incomplete (no .metadata): never suggested
    assert main(["spikes", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        f"{run}: 60 logged steps (1..60), 1 spike above median + 6 x 1.4826 x MAD"
    )
    assert out[1].startswith("step 40: loss 8.")
    assert out[2].startswith("    [0] rank 0  sample ")  # show's summary of step 40
    assert out[-1] == "  roll back: --checkpoint.load_step 30 --zephon.skip_steps 31:20"
    assert main(["spikes", str(run), "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    spike = json.loads(line)
    assert spike["rollback"] == {"load_step": 30, "skip_steps": "31:20"}
    assert main(["show", str(run), "--step", "40", "--json"]) == 0
    assert spike["data"] == json.loads(capsys.readouterr().out) | {
        "samples": spike["data"]["samples"]
    }
    write_events(run, {40: 99.0}, when="20261201-1300")  # a resumed job rewrote step 40
    assert main(["spikes", str(run)]) == 0
    assert "step 40: loss 99.0000" in capsys.readouterr().out
    for step in (10, 20, 30):  # no complete checkpoint early enough
        (run / "checkpoint" / f"step-{step}" / ".metadata").unlink()
    assert main(["spikes", str(run)]) == 0
    assert "  no complete checkpoint at or before step 30 in " in capsys.readouterr().out


def test_no_events_and_no_loss_scalar_are_clear_errors(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    assert main(["spikes", str(run)]) == 2
    err = capsys.readouterr().err
    assert "no TensorBoard events under" in err and "--metrics.enable_tensorboard" in err
    write_events(run, {1: 1.0, 2: 2.0}, tag="lr")
    assert main(["spikes", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"hold no '{LOSS_TAG}' scalar" in err and "Traceback" not in err
    assert main(["spikes", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default 6)" in help_text and "(default 50)" in help_text


def test_spikes_of_a_run_that_leaves_samples_out_shows_the_step_without_them(
    store_path, store, tmp_path, capsys
):
    from torchtitan_zephon.order.exclusions import Exclusions
    from torchtitan_zephon.order.layout import BatchSchedule

    left = tmp_path / "left.jsonl"
    left.write_text(json.dumps({"ids": list(range(0, 400, 3)), "from_step": 20}) + "\n")
    source = JobData.of_store(store, 8)
    source.leave_out(Exclusions.load(str(left)))
    plan = source.plan(source.data_config(seed=3, schedule=BatchSchedule.parse("4")))
    run = write_run(tmp_path / "run", source, trained=60, saved={"zephon": {"store": str(store_path)}})  # fmt: skip
    write_events(run, curve(60, 40))
    assert main(["spikes", str(run), "--json"]) == 0  # the losses, and why no data
    captured = capsys.readouterr()
    assert "data" not in json.loads(captured.out)
    assert "the data of the spikes is not shown: the run " in captured.err
    assert "pass --exclude FILE" in captured.err
    assert main(["spikes", str(run), "--json", "--exclude", str(left)]) == 0
    samples = json.loads(capsys.readouterr().out)["data"]["samples"]
    assert [s["sample"] for s in samples] == plan.global_ids(40).tolist()


def test_a_spike_the_weight_schedule_put_there_gets_a_weight_entry_not_a_skip(
    store, tmp_path, capsys
):
    """All samples of the spike step come from the source whose weight just rose (issue
    28, item 4): a skip would leave that source there; spikes says so and suggests the
    weight entry that takes it out, which does."""
    from torchtitan_zephon.job.data import JobData
    from torchtitan_zephon.order.layout import BatchSchedule
    from torchtitan_zephon.order.mixture.config import MixtureConfig
    from torchtitan_zephon.store.writer import slice_store

    root = tmp_path / "mix"
    slice_store(store, 0, 2500, root / "code")
    slice_store(store, 2500, store.num_tokens, root / "web")
    head = '[[source]]\nname = "web"\nstore = "web"\n[[source]]\nname = "code"\nstore = "code"\n'
    mix = root / "mix.toml"
    mix.write_text(head + "[[schedule]]\nfrom_step = 1\nweights = { web = 0.75, code = 0.25 }\n"
                   "[[schedule]]\nfrom_step = 30\nweights = { web = 0, code = 1 }\n")  # fmt: skip
    source = JobData.open_mixture(MixtureConfig.load(mix), 8)
    run = write_run(tmp_path / "run", source, trained=45,
                    saved={"zephon": {"mixture": str(mix)}})  # fmt: skip
    write_events(run, curve(45, 40))
    for step in (20, 35):
        (run / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoint" / f"step-{step}" / ".metadata").write_bytes(b"")
    assert main(["spikes", str(run), "--json"]) == 0
    (spike,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {s["source"] for s in spike["data"]["samples"]} == {"code"}
    assert spike["rollback"] is None
    assert spike["schedule"] == {
        "source": "code", "from_step": 30, "share": "1", "share_before": "1/4",
        "load_step": 35, "entry": {"from_step": 36, "weights": {"code": 1, "web": 3}},
    }  # fmt: skip
    assert main(["spikes", str(run)]) == 0
    advice = capsys.readouterr().out.splitlines()[-1]
    assert advice == (
        "  all 4 samples of step 40 come from source 'code', whose share the mixture's weight "
        "schedule raised from 1/4 to 1 at step 30: a skip moves each source's stream, but the "
        "weights would still fill these slots from 'code'; change the weights instead: "
        "--checkpoint.load_step 35 with, in the mixture file, the [[schedule]] entries at or "
        "before step 35 kept and then from_step = 36, weights = { code = 1, web = 3 } (the "
        "weights before step 30)"
    )
    # the suggested entry changes step 40's data: 'code' no longer fills all its slots
    mix.write_text(head + "[[schedule]]\nfrom_step = 1\nweights = { web = 0.75, code = 0.25 }\n"
                   "[[schedule]]\nfrom_step = 30\nweights = { web = 0, code = 1 }\n"
                   "[[schedule]]\nfrom_step = 36\nweights = { code = 1, web = 3 }\n")  # fmt: skip
    fixed = JobData.open_mixture(MixtureConfig.load(mix), 8)
    plan = fixed.plan(fixed.data_config(seed=3, schedule=BatchSchedule.parse("4")))
    names, _ = plan.decode(plan.global_ids(40))
    assert set(names) != {"code"} and "web" in names
