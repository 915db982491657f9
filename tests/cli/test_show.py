"""``zephon show``: a step's samples, documents and text, for runs, stores and mixtures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.store.writer import slice_store
from torchtitan_zephon.tracker import LOG_NAME
from torchtitan_zephon.tracker.writer import SequenceTracker

BASE = ["--seq-len", "8", "--global-batch-size", "4", "--seed", "3"]


def write_run(
    folder: Path, source, *, gbs: str = "4", seed: int = 3, skips: str = "", trained: int = 3,
    saved: dict | None = None, dp_degree: int = 2,
) -> Path:  # fmt: skip
    """A run folder as the trainer leaves it: a sequence log written by the real
    tracker (start event with the data config, records of steps 1..trained) and the
    job config TorchTitan 0.3 saves with --debug.save_config_file."""
    extra = {"skip_steps": SkipSteps.parse(skips).to_json()} if skips else {}
    config = source.data_config(seed=seed, schedule=BatchSchedule.parse(gbs), extra=extra)
    plan = source.plan(config)
    (folder / "zephon").mkdir(parents=True)
    tracker = SequenceTracker(folder / "zephon" / LOG_NAME, config=config, writer=True)
    tracker.start({"world_size": dp_degree, "dp_degree": dp_degree, "nnodes": 1})
    for step in range(1, trained + 1):
        tracker.record(step, plan.step_positions(step)[0], plan.global_ids(step))
    if saved is not None:
        # TorchTitan 0.3's layout (no "job" section; dump_folder at the top)
        job = {"dump_folder": str(folder), "training": {}, **saved}
        (folder / "config.json").write_text(json.dumps(job))
    return folder


def show(capsys, *argv: str) -> dict:
    assert main(["show", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_a_store_step_is_the_plans_with_documents_and_text(
    store_path, store, tokenizer_dir, capsys
):
    from tokenizers import Tokenizer

    plan = DataPlan(store.num_samples(8), 3, BatchSchedule([(1, 4)]))
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for step in (1, 7, 10**9):
        info = show(
            capsys,
            str(store_path),
            *BASE,
            "--step",
            str(step),
            "--tokenizer",
            str(tokenizer_dir),
            "--max-chars",
            "0",
        )
        assert [s["sample"] for s in info["samples"]] == plan.global_ids(step).tolist()
        assert info["status"] == "planned" and info["slots"] == [4 * (step - 1), 4 * step]
        for s in info["samples"]:
            sid = s["sample"]
            docs = store.document_ids(sid * 8, sid * 8 + 8)
            assert [d["document"] for d in s["documents"]] == sorted(set(docs.tolist()))
            for d in s["documents"]:  # the window's part of each document, by its tokens
                first = int(store.doc_offsets[d["document"]])
                inside = np.nonzero(docs == d["document"])[0] + sid * 8 - first
                assert (d["start"], d["stop"]) == (int(inside[0]), int(inside[-1]) + 1)
            tokens = np.asarray(store.window(sid, 8))[:-1].tolist()
            assert s["text"] == tok.decode(tokens, skip_special_tokens=False)
    # one rank's slice, one sample, a cut text
    whole = show(capsys, str(store_path), *BASE, "--step", "5", "--tokenizer", str(tokenizer_dir))
    part = show(capsys, str(store_path), *BASE, "--step", "5", "--dp-degree", "2", "--dp-rank", "1")
    assert [s["sample"] for s in part["samples"]] == [s["sample"] for s in whole["samples"][2:]]
    assert [s["dp_rank"] for s in part["samples"]] == [1, 1]
    one = show(capsys, str(store_path), *BASE, "--step", "5", "--dp-degree", "2", "--dp-rank", "1",
               "--sample", "1", "--tokenizer", str(tokenizer_dir), "--max-chars", "5")  # fmt: skip
    assert one["samples"][0]["sample"] == whole["samples"][3]["sample"]
    assert one["samples"][0]["text"] == whole["samples"][3]["text"][:5]


def test_text_output_and_the_help_states_the_default(store_path, tokenizer_dir, capsys):
    assert (
        main(["show", str(store_path), *BASE, "--step", "2", "--tokenizer", str(tokenizer_dir)])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"step 2 of the store {store_path} (planned): slots 4..7, 4 samples")
    assert out[1].startswith("  [0] rank 0  sample ") and " docs " in out[1]
    assert main(["show", "--help"]) == 0
    assert "(default 200; 0: all)" in " ".join(capsys.readouterr().out.split())


def test_a_run_knows_its_config_its_skips_and_what_it_trained(
    store_path, store, tokenizer_dir, tmp_path, capsys
):
    source = JobData.of_store(store, 8, num_samples=store.num_samples(8) - 5)
    run = write_run(tmp_path / "run", source, skips="2:3", trained=3,
                    saved={"hf_assets_path": str(tokenizer_dir), "zephon": {"store": str(store_path)}})  # fmt: skip
    plan = DataPlan(store.num_samples(8) - 5, 3, BatchSchedule([(1, 4)]), skips=SkipSteps([(2, 3)]))
    for step, status in (
        (1, "trained"),
        (2, "trained"),
        (3, "trained"),
        (4, "planned"),
        (5000, "planned"),
    ):
        info = show(capsys, str(run), "--step", str(step))
        assert [s["sample"] for s in info["samples"]] == plan.global_ids(step).tolist()
        assert info["status"] == status and info["dp_degree"] == 2  # the run's DP degree
        assert "text" in info["samples"][0] and info["samples"][0]["documents"]
    # without the saved config the store is not found: ids only, and a note saying what to pass
    (run / "config.json").unlink()
    assert main(["show", str(run), "--step", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert [s["sample"] for s in json.loads(out.out)["samples"]] == plan.global_ids(2).tolist()
    assert "was not found" in out.err and "pass --store STORE" in out.err
    info = show(
        capsys,
        str(run),
        "--step",
        "2",
        "--store",
        str(store_path),
        "--tokenizer",
        str(tokenizer_dir),
    )
    assert "text" in info["samples"][0]


@pytest.fixture(scope="module")
def mixture_file(store, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    slice_store(store, 0, 2500, root / "code")
    slice_store(store, 2500, store.num_tokens, root / "web")
    (root / "mix.toml").write_text(
        '[[source]]\nname = "web"\nstore = "web"\n'
        '[[source]]\nname = "code"\nstore = "code"\nmax_epochs = 2\n'
        "[[schedule]]\nfrom_step = 1\nweights = { web = 0.7, code = 0.3 }\n"
        "[[schedule]]\nfrom_step = 3\nweights = { web = 0.25, code = 0.75 }\n"
    )
    return root / "mix.toml"


def test_a_mixture_step_names_each_samples_source(mixture_file, capsys):
    args = [
        "--mixture",
        str(mixture_file),
        "--seq-len",
        "8",
        "--global-batch-size",
        "10",
        "--seed",
        "3",
    ]
    source = JobData.open_mixture(MixtureConfig.load(mixture_file), 8)
    plan = source.plan(source.data_config(seed=3, schedule=BatchSchedule.parse("10")))
    for step in (1, 4):
        info = show(capsys, *args, "--step", str(step))
        names, ids = plan.decode(plan.global_ids(step))
        assert [s["source"] for s in info["samples"]] == names
        assert [s["sample"] for s in info["samples"]] == ids.tolist()
    # past a source's max_epochs: refused in one line
    last = 2 * int(plan.mixture.num_samples[0]) // 7 + 10
    assert main(["show", *args, "--step", str(last)]) == 2
    err = capsys.readouterr().err
    assert "mixture source 'code' runs past max_epochs=2" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--step", "0"], "step 0 is before the first step 1 of the store"),
        (["--step", "-3"], "step -3 is before the first step 1"),
        (
            ["--step", "2", "--dp-degree", "2", "--dp-rank", "2"],
            "--dp-rank 2 is out of range: DP degree 2 has ranks 0 .. 1",
        ),
        (
            ["--step", "2", "--sample", "4"],
            "--sample 4 is out of range: step 2 holds samples 0 .. 3",
        ),
        (
            ["--step", "2", "--dp-degree", "2", "--dp-rank", "0", "--sample", "2"],
            "DP rank 0's slice holds samples 0 .. 1",
        ),
    ],
)
def test_bad_steps_ranks_and_samples_are_one_line_errors(store_path, capsys, extra, message):
    assert main(["show", str(store_path), *BASE, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zephon show: error: ") and message in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_missing_flags_and_a_run_with_data_flags_are_refused(store_path, store, tmp_path, capsys):
    assert main(["show", str(store_path), "--step", "1"]) == 2
    assert "needs --seq-len, --global-batch-size, --seed" in capsys.readouterr().err
    run = write_run(tmp_path / "run", JobData.of_store(store, 8))
    assert main(["show", str(run), "--step", "1", "--seed", "4"]) == 2
    assert "is a run folder: its sequence log's data config decides" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "nothing"), *BASE, "--step", "1"]) == 2
    assert "does not exist: expected a run folder" in capsys.readouterr().err


def test_a_mixture_run_finds_its_sources_from_the_saved_mixture_file(
    mixture_file, tmp_path, tokenizer_dir, capsys
):
    source = JobData.open_mixture(MixtureConfig.load(mixture_file), 8)
    saved = {"hf_assets_path": str(tokenizer_dir), "zephon": {"mixture": str(mixture_file)}}
    run = write_run(tmp_path / "run", source, gbs="10", skips="2:1", trained=2, saved=saved)
    plan = source.plan(source.data_config(seed=3, schedule=BatchSchedule.parse("10"),
                                          extra={"skip_steps": [[2, 1]]}))  # fmt: skip
    info = show(capsys, str(run), "--step", "3")
    names, ids = plan.decode(plan.global_ids(3))
    assert [(s["source"], s["sample"]) for s in info["samples"]] == list(
        zip(names, ids.tolist(), strict=True)
    )
    assert info["status"] == "planned" and all(
        "text" in s and s["documents"] for s in info["samples"]
    )
    # another mixture file whose 'web' is another store: that source's data is left out, said so
    other = tmp_path / "other.toml"
    other.write_text(mixture_file.read_text().replace('store = "web"', 'store = "code"').replace(
        'store = "code"', f'store = "{mixture_file.parent / "code"}"'))  # fmt: skip
    (run / "config.json").unlink()
    assert main(["show", str(run), "--step", "3", "--mixture", str(other), "--json"]) == 0
    out = capsys.readouterr()
    samples = json.loads(out.out)["samples"]
    assert {s["source"] for s in samples if "documents" in s} == {"code"}
    assert "the stores of mixture sources 'web' were not found" in out.err


def test_trained_steps_end_where_the_effective_history_ends(store_path, store, tmp_path, capsys):
    from torchtitan_zephon.run import recorded as runs

    source = JobData.of_store(store, 8)
    run = write_run(
        tmp_path / "run", source, trained=5, saved={"zephon": {"store": str(store_path)}}
    )
    log = run / "zephon" / LOG_NAME
    chain3 = runs.sequence_log(run).records[3]["chain"]
    config = source.data_config(seed=3, schedule=BatchSchedule.parse("4"))
    SequenceTracker(log, config=config, writer=True).resume(
        {"step": 3, "chain": chain3}, {"world_size": 1}
    )
    assert runs.sequence_log(run).steps() == [1, 2, 3]  # a rollback to 3: steps 4, 5 superseded
    with open(log, "ab") as f:
        f.write(b'{"v": 2, "step": 4, "first_pos')  # a line cut short by a crash
    for step, status in ((3, "trained"), (4, "planned"), (5, "planned")):
        assert show(capsys, str(run), "--step", str(step))["status"] == status


def test_a_resume_that_accepted_a_schedule_change_anchors_the_plan(
    store_path, store, tmp_path, capsys
):
    from torchtitan_zephon.run import recorded as runs

    source = JobData.of_store(store, 8)
    run = write_run(
        tmp_path / "run", source, gbs="4", trained=4, saved={"zephon": {"store": str(store_path)}}
    )
    log = run / "zephon" / LOG_NAME
    head = {"step": 2, "chain": runs.sequence_log(run).records[2]["chain"]}
    # resumed from step 2 with a global batch of 8 (accepted): step 3 starts at position 8
    config = source.data_config(seed=3, schedule=BatchSchedule.parse("8"))
    plan = DataPlan(
        store.num_samples(8), 3, BatchSchedule.parse("8"), anchor_step=3, anchor_position=8
    )
    tracker = SequenceTracker(log, config=config, writer=True)
    tracker.resume(head, {"world_size": 1}, details={"accepted_changes": ["schedule"]})
    tracker.record(3, *plan.step_positions(3)[:1], plan.global_ids(3))
    for step, status in ((3, "trained"), (4, "planned"), (10**6, "planned")):
        info = show(capsys, str(run), "--step", str(step))
        assert info["slots"] == [8 + 8 * (step - 3), 16 + 8 * (step - 3)]
        assert [s["sample"] for s in info["samples"]] == plan.global_ids(step).tolist()
        assert info["status"] == status
    # step 2, before the anchor, was trained under the start's data config: shown so
    # (issue 43 case 2; it was refused as before this plan's first step)
    info = show(capsys, str(run), "--step", "2")
    assert info["slots"] == [4, 8] and info["status"] == "trained"
    # a later rollback to step 1 (before the change): the start's plan again
    head = {"step": 1, "chain": runs.sequence_log(run).records[1]["chain"]}
    old = source.data_config(seed=3, schedule=BatchSchedule.parse("4"))
    SequenceTracker(log, config=old, writer=True).resume(head, {"world_size": 1})
    assert show(capsys, str(run), "--step", "2")["slots"] == [4, 8]


# ---------------------------------------------------------------- left-out samples


def _folder(path: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_show_and_where_on_a_run_that_leaves_samples_out(store_path, store, tmp_path, capsys):
    """The run's list comes from its saved zephon.exclude (or --exclude FILE), checked
    against the sha256 its data config binds; show prints the plan with the samples
    left out, where reports them ``left out from step S``; any other list, or none, is
    a one-line refusal naming --exclude FILE, the run folder unchanged."""
    from torchtitan_zephon.order.exclusions import Exclusions

    plain = DataPlan(store.num_samples(8), 3, BatchSchedule([(1, 4)]))
    gone = plain.global_ids(3)[:2].tolist()  # what step 3 would train
    left = tmp_path / "left.jsonl"
    left.write_text(json.dumps({"ids": gone, "from_step": 3}) + "\n")
    source = JobData.of_store(store, 8)
    source.leave_out(Exclusions.load(str(left)))
    plan = source.plan(source.data_config(seed=3, schedule=BatchSchedule.parse("4")))
    zephon = {"store": str(store_path), "exclude": str(left)}
    run = write_run(tmp_path / "run", source, trained=5, saved={"zephon": zephon})
    for step in (1, 3, 4, 9):
        info = show(capsys, str(run), "--step", str(step))
        assert [s["sample"] for s in info["samples"]] == plan.global_ids(step).tolist()
    assert not set(gone) & {s["sample"] for s in show(capsys, str(run), "--step", "3")["samples"]}
    doc = int(store.document_ids(gone[0] * 8, gone[0] * 8 + 8)[0])
    assert main(["where", str(run), "--doc", str(doc), "--json"]) == 0
    hits = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    mine = [h for h in hits if h["sample"] == gone[0] and h["epoch"] == 0]
    assert mine == [{"epoch": 0, "sample": gone[0], "stream_position": mine[0]["stream_position"],
                     "status": "left out", "step": None, "index": None, "dp_rank": None,
                     "rank_index": None, "left_out_from": 3}]  # fmt: skip
    assert main(["where", str(run), "--doc", str(doc)]) == 0
    assert (
        f"sample {gone[0]}  stream position {mine[0]['stream_position']}: left out from "
        "step 3 (zephon.exclude), never trained" in capsys.readouterr().out
    )
    # --exclude FILE where the saved config names none (or elsewhere)
    bare = write_run(tmp_path / "bare", source, trained=5, saved={"zephon": {"store": str(store_path)}})  # fmt: skip
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"ids": gone[:1], "from_step": 3}) + "\n")
    moved = write_run(tmp_path / "moved", source, trained=5,
                      saved={"zephon": {"exclude": str(tmp_path / "gone.jsonl")}})  # fmt: skip
    plain_run = write_run(tmp_path / "plain", JobData.of_store(store, 8), trained=2)
    before = {r: _folder(r) for r in (run, bare, moved, plain_run)}
    for target, extra, fragments in [
        (bare, [], ["leaves samples out (from step 3, 2 ids (sha256",
                    "and no left-out list was given (its saved job config names no zephon.exclude)",
                    "pass --exclude FILE, the zephon.exclude list the run was trained with"]),
        (run, ["--exclude", str(other)], [f"but --exclude file {other} holds from step 3, 1 id",
                                         "pass --exclude FILE"]),
        (moved, [], [f"names zephon.exclude {tmp_path / 'gone.jsonl'}, which is not a file here",
                     "pass --exclude FILE"]),
        (plain_run, ["--exclude", str(left)], ["leaves no samples out, but --exclude file",
                                               "drop --exclude"]),
    ]:  # fmt: skip
        for command in (["show", "--step", "3"], ["where", "--doc", str(doc)]):
            assert main([command[0], str(target), *command[1:], *extra]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err, err
            assert all(f in err for f in fragments), err
    assert {r: _folder(r) for r in before} == before
    info = show(capsys, str(bare), "--step", "3", "--exclude", str(left))
    assert [s["sample"] for s in info["samples"]] == plan.global_ids(3).tolist()


def test_a_store_or_mixture_takes_exclude_as_plan_does(store_path, store, mixture_file, tmp_path, capsys):  # fmt: skip
    left = tmp_path / "left.jsonl"
    left.write_text(json.dumps({"ids": [0, 5, 9], "from_step": 2}) + "\n")
    plan = DataPlan(store.num_samples(8), 3, BatchSchedule([(1, 4)]))
    from torchtitan_zephon.order.exclusions import Exclusions

    kept = DataPlan(store.num_samples(8), 3, BatchSchedule([(1, 4)]),
                    exclusions=Exclusions.load(str(left)).for_source(None))  # fmt: skip
    for step in (1, 2, 50):
        info = show(capsys, str(store_path), *BASE, "--step", str(step), "--exclude", str(left))
        assert [s["sample"] for s in info["samples"]] == kept.global_ids(step).tolist()
    assert plan.global_ids(50).tolist() != kept.global_ids(50).tolist()
    assert main(["plan", "--store", str(store_path), *BASE, "--steps", "50:50", "--json",
                 "--exclude", str(left)]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["ids"] == kept.global_ids(50).tolist()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1], "from_step": 2, "source": "web"}\n')
    for argv in (["show", str(store_path), *BASE, "--step", "2"],
                 ["where", str(store_path), *BASE, "--doc", "1"]):  # fmt: skip
        assert main([*argv, "--exclude", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f'--exclude file {bad}, line 1 names "source"' in err and "Traceback" not in err
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"ids": [1, 2, 3], "from_step": 1, "source": "code"}) + "\n")
    args = ["--mixture", str(mixture_file), "--seq-len", "8", "--global-batch-size", "10",
            "--seed", "3"]  # fmt: skip
    info = show(capsys, *args, "--step", "2", "--exclude", str(mixed))
    source = JobData.open_mixture(MixtureConfig.load(mixture_file), 8)
    source.leave_out(Exclusions.load(str(mixed)))
    want = source.plan(source.data_config(seed=3, schedule=BatchSchedule.parse("10")))
    names, ids = want.decode(want.global_ids(2))
    assert [(s["source"], s["sample"]) for s in info["samples"]] == list(
        zip(names, ids.tolist(), strict=True)
    )


def test_each_step_is_shown_at_the_dp_degree_it_was_trained_at(store_path, store, tmp_path, capsys):
    """Steps 1-4 trained on 2 ranks, then resumed on 1 from step 4 (steps 5, 6): a step
    is shown at the degree of the job that trained it (show, where, in text and JSON);
    a step not trained yet at the run's current one, and said so."""
    from torchtitan_zephon.cli.open_data import open_step_data
    from torchtitan_zephon.cli.show import step_samples
    from torchtitan_zephon.cli.where import where
    from torchtitan_zephon.run import recorded as runs

    source = JobData.of_store(store, 8)
    run = write_run(tmp_path / "run", source, trained=4, dp_degree=2,
                    saved={"zephon": {"store": str(store_path)}})  # fmt: skip
    config = source.data_config(seed=3, schedule=BatchSchedule.parse("4"))
    plan = source.plan(config)
    head = {"step": 4, "chain": runs.sequence_log(run).records[4]["chain"]}
    tracker = SequenceTracker(run / "zephon" / LOG_NAME, config=config, writer=True)
    tracker.resume(head, {"world_size": 1, "dp_degree": 1, "nnodes": 1})
    for step in (5, 6):
        tracker.record(step, plan.step_positions(step)[0], plan.global_ids(step))
    for step, degree, status, said in (
        (2, 2, "trained", "trained"), (4, 2, "trained", "trained"),
        (5, 1, "trained", "trained"), (7, 1, "planned", "current"),
    ):  # fmt: skip
        info = show(capsys, str(run), "--step", str(step))
        assert (info["dp_degree"], info["status"], info["dp_degree_from"]) == (degree, status, said)
        assert [s["dp_rank"] for s in info["samples"]] == [i * degree // 4 for i in range(4)]
    assert main(["show", str(run), "--step", "2"]) == 0
    assert "4 samples, DP degree 2 (as trained)" in capsys.readouterr().out.splitlines()[0]
    assert main(["show", str(run), "--step", "7"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "DP degree 1 (not trained yet: the run's current layout)" in first
    # --dp-degree still wins
    info = show(capsys, str(run), "--step", "2", "--dp-degree", "4")
    assert (info["dp_degree"], info["dp_degree_from"]) == (4, "option")
    assert [s["dp_rank"] for s in info["samples"]] == [0, 1, 2, 3]
    # where: a hit's rank at its step's trained degree
    args = _where_args(run)
    data = open_step_data(args, "where")
    for step in (2, 5):
        (sample,) = step_samples(data, step, sample=3, max_chars=1)["samples"]
        hits, _ = where(data, sample["documents"][0]["document"])
        (hit,) = [h for h in hits if h.step == step and h.index == 3]
        assert hit.dp_rank == (1 if step == 2 else 0)


def _where_args(run: Path):
    from torchtitan_zephon.cli.main import build_parser

    return build_parser().parse_args(["where", str(run), "--doc", "0"])


def test_the_run_folder_alone_finds_the_runs_store_and_tokenizer(
    store_path, store, tokenizer_dir, tmp_path, capsys
):
    """No saved job config (TorchTitan's --debug.save_config_file): show, where and
    inspect find the store and tokenizer from what the trainer recorded at its start."""
    from types import SimpleNamespace

    from torchtitan_zephon.job.run_data import record_job

    source = JobData.of_store(store, 8)
    run = write_run(tmp_path / "run", source, trained=2)
    config = source.data_config(seed=3, schedule=BatchSchedule.parse("4"))
    assert main(["show", str(run), "--step", "1"]) == 0
    assert "was not found" in capsys.readouterr().err  # nothing tells where the store is
    zephon = SimpleNamespace(store=str(store_path), mixture="", exclude="")
    record_job(run, zephon, tokenizer=str(tokenizer_dir), checkpoint_folder="checkpoint",
               data=source, data_config=config.to_dict())  # fmt: skip
    info = show(capsys, str(run), "--step", "1")
    assert capsys.readouterr().err == ""
    assert all(s["documents"] and s["text"] for s in info["samples"])
    doc = info["samples"][0]["documents"][0]["document"]
    assert main(["where", str(run), "--doc", str(doc)]) == 0
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"    store:     {store_path}\n" in out
    assert f"    tokenizer: {tokenizer_dir}\n" in out


@pytest.mark.parametrize("kind", ["store", "mixture"])
def test_a_step_has_slots_and_each_sample_the_position_where_names(
    kind, store_path, store, mixture_file, tmp_path, capsys
):
    """With skip_steps 3:2 (issue 28, item 5): step 3's slots are its place in the batch
    schedule (8..11 at GBS 4: what the sequence log calls first_position), and each
    sample's position is its index in its source's stream, the stream_position `where`
    gives for it (past the skip)."""
    if kind == "store":
        source, saved = JobData.of_store(store, 8), {"zephon": {"store": str(store_path)}}
    else:
        source = JobData.open_mixture(MixtureConfig.load(mixture_file), 8)
        saved = {"zephon": {"mixture": str(mixture_file)}}
    run = write_run(tmp_path / "run", source, skips="3:2", trained=4, saved=saved)
    info = show(capsys, str(run), "--step", "3")
    assert info["slots"] == [8, 12] and "positions" not in info
    assert main(["show", str(run), "--step", "3"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith(f"step 3 of the run {run} (trained): slots 8..11, 4 samples")
    for s in info["samples"]:
        assert f"sample {s['sample']}  position {s['position']}" in "\n".join(text)
        name = s["source"] or None
        doc = s["documents"][0]["document"]
        argv = ["where", str(run), "--doc", str(doc), "--json", "--epochs", "0:3"]
        assert main(argv + (["--source", name] if name else [])) == 0
        hits = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        (hit,) = [h for h in hits if h["step"] == 3 and h["index"] == s["index"]]
        assert hit["stream_position"] == s["position"] and hit["sample"] == s["sample"]
    if kind == "store":  # one store at GBS 4: the skip moved step 3 by 2 steps' samples
        assert [s["position"] for s in info["samples"]] == [16, 17, 18, 19]
