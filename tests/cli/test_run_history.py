"""``show`` and ``where`` on a run whose history changed its data config (issue 43 case
2): each trained step is shown under the data config that trained it (another seed
before an accepted ``seed`` change, windows before packing was turned on), and a step
whose recomputed ids do not match its log record's ids digest says so rather than print
other samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.cli.test_show import show
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.packing import open_packing
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.tracker import LOG_NAME
from torchtitan_zephon.tracker.writer import SequenceTracker

SEQ = 8


def _run(folder: Path, store_path: Path, jobs: list[tuple[object, int, int, int]]) -> Path:
    """A run folder whose log holds one job per entry (data, seed, from_step, last step):
    the first starts, each later one resumes from its from_step (accepting the change);
    each records steps from_step + 1 .. last under its own data config."""
    (folder / "zephon").mkdir(parents=True)
    log = folder / "zephon" / LOG_NAME
    head = None
    for k, (data, seed, from_step, last) in enumerate(jobs):
        config = data.data_config(seed=seed, schedule=BatchSchedule.parse("4"))
        plan = data.plan(config)
        tracker = SequenceTracker(log, config=config, writer=True)
        if k == 0:
            tracker.start({"world_size": 1, "dp_degree": 1, "nnodes": 1})
        else:
            records = [json.loads(line) for line in log.read_text().splitlines()]
            chain = [r for r in records if r.get("step") == from_step and "event" not in r][-1]
            head = {"step": from_step, "chain": chain["chain"]}
            tracker.resume(head, {"world_size": 1}, details={"accepted_changes": ["seed"]})
        for step in range(from_step + 1, last + 1):
            tracker.record(step, plan.step_positions(step)[0], plan.global_ids(step))
    job = {"dump_folder": str(folder), "training": {}, "zephon": {"store": str(store_path)}}
    (folder / "config.json").write_text(json.dumps(job))
    return folder


def _where(capsys, run: Path, doc: int) -> list[dict]:
    assert main(["where", str(run), "--doc", str(doc), "--json"]) == 0, capsys.readouterr().err
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _hits(data, seed: int, doc: int, steps: range) -> list[tuple[int, int]]:
    """(step, index) of every sample of ``steps`` holding document ``doc`` (a scan)."""
    plan = data.plan(data.data_config(seed=seed, schedule=BatchSchedule.parse("4")))
    out = []
    for step in steps:
        for index, sid in enumerate(plan.global_ids(step).tolist()):
            if doc in [d["document"] for d in _documents(data, sid)]:
                out.append((step, index))
    return out


def _documents(data, sid: int) -> list[dict]:
    if data.packing != "none":
        return data.sources[0].documents(sid)
    offsets = np.asarray(data.stores[0].doc_offsets)
    start, stop = sid * SEQ, (sid + 1) * SEQ
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
    return [{"document": d} for d in range(first, last + 1)]


def test_steps_before_an_accepted_seed_change_are_shown_under_their_seed(
    store_path, store, tmp_path, capsys
):
    source = JobData.of_store(store, SEQ)
    run = _run(tmp_path / "run", store_path, [(source, 0, 0, 6), (source, 3, 4, 6)])
    for step, seed in ((3, 0), (4, 0), (5, 3), (6, 3), (9, 3)):
        plan = source.plan(source.data_config(seed=seed, schedule=BatchSchedule.parse("4")))
        info = show(capsys, str(run), "--step", str(step))
        assert [s["sample"] for s in info["samples"]] == plan.global_ids(step).tolist(), step
        assert info["status"] == ("trained" if step <= 6 else "planned")
    doc = int(source.plan(source.data_config(seed=0, schedule=BatchSchedule.parse("4")))
              .global_ids(2)[0]) * SEQ // 1  # fmt: skip
    doc = int(np.searchsorted(np.asarray(store.doc_offsets), doc, side="right")) - 1
    found = {(h["step"], h["index"]) for h in _where(capsys, run, doc) if h.get("step") is not None}
    expected = set(_hits(source, 0, doc, range(1, 5))) | set(_hits(source, 3, doc, range(5, 40)))
    assert {h for h in found if h[0] < 40} == expected and (2, 0) in found


def test_steps_before_packing_was_turned_on_are_shown_as_windows(
    store_path, store, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    windows = JobData.of_store(store, SEQ)
    packed = JobData.of_store(store, SEQ, packed=open_packing(store, SEQ)[0])
    run = _run(tmp_path / "run", store_path, [(windows, 0, 0, 4), (packed, 0, 2, 4)])
    for step, data in ((1, windows), (2, windows), (3, packed), (4, packed)):
        plan = data.plan(data.data_config(seed=0, schedule=BatchSchedule.parse("4")))
        info = show(capsys, str(run), "--step", str(step))
        assert [s["sample"] for s in info["samples"]] == plan.global_ids(step).tolist(), step
        assert ("padding" in info["samples"][0]) == (data is packed)


def test_a_step_whose_ids_do_not_match_its_log_record_says_so(store_path, store, tmp_path, capsys):
    source = JobData.of_store(store, SEQ)
    run = _run(tmp_path / "run", store_path, [(source, 0, 0, 3)])
    log = run / "zephon" / LOG_NAME
    lines = log.read_text().splitlines()
    record = json.loads(lines[2])
    assert record["step"] == 2
    digest = record["ids_digest"]
    lines[2] = lines[2].replace(digest, ("0" if digest[0] != "0" else "1") + digest[1:])
    log.write_text("\n".join(lines) + "\n")  # same length: the index still finds it
    assert main(["show", str(run), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert "step 2 of the run" in err and "do not match the ids digest the log holds" in err
    assert show(capsys, str(run), "--step", "3")["status"] == "trained"  # the others stand


def test_inspect_says_a_run_packs(store_path, store, tmp_path, capsys, monkeypatch):
    """Issue 43 case 11: `zephon inspect` of a packed run never mentioned packing."""
    from torchtitan_zephon.cli.inspect_run import describe_run, format_run
    from torchtitan_zephon.order.state import DataState

    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    packed = JobData.of_store(store, SEQ, packed=open_packing(store, SEQ)[0])
    run = _run(tmp_path / "run", store_path, [(packed, 0, 0, 2)])
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "    packing: best_fit (a sample is whole documents packed into seq_len" in out
    info = describe_run(run)
    config = packed.data_config(seed=0, schedule=BatchSchedule.parse("4"))
    info["data_state"] = DataState(config, 3, 8).to_dict()
    assert "  packing:            best_fit (a sample is whole documents" in format_run(info)
    windows = _run(tmp_path / "windows", store_path, [(JobData.of_store(store, SEQ), 0, 0, 2)])
    assert main(["inspect", str(windows)]) == 0
    assert "packing: none (a sample is a fixed window" in capsys.readouterr().out


def test_show_and_where_name_the_replica_group_that_trained_each_sample(
    store_path, store, tmp_path, capsys
):
    """Issue 43 case 10: on a torchft group's folder every sample was 'rank 0 (as
    trained)', though this group trained one part. This group (replica_id 0) trained
    part 1 of 2 from step 1 (group 1 part 0); it healed at step 3 and received steps
    4..5 from its peer: those name no group."""
    source = JobData.of_store(store, SEQ)
    config = source.data_config(seed=0, schedule=BatchSchedule.parse("4"))
    plan = source.plan(config)
    run = tmp_path / "run"
    (run / "zephon").mkdir(parents=True)
    tracker = SequenceTracker(run / "zephon" / LOG_NAME, config=config, writer=True)
    group = {"replica_id": 0, "group_size": 2}
    tracker.start({"world_size": 1, "dp_degree": 1, "nnodes": 1, **group})
    tracker.annotate("quorum", 1, {"groups": 2, "quorum_id": 7, "part": 1, "members": [1, 0]})
    for step in (1, 2, 3):
        tracker.record(step, plan.step_positions(step)[0], plan.global_ids(step))
    peer = SequenceTracker(tmp_path / "peer.jsonl", config=config, writer=True)
    peer.start({"world_size": 1, "dp_degree": 1, "nnodes": 1})
    for step in range(1, 6):
        peer.record(step, plan.step_positions(step)[0], plan.global_ids(step))
    lines = (tmp_path / "peer.jsonl").read_bytes().splitlines()[4:6]  # steps 4 and 5
    tracker.healed(3, lines, peer.head(), {"world_size": 1, "dp_degree": 1, **group})
    job = {"dump_folder": str(run), "training": {}, "zephon": {"store": str(store_path)}}
    (run / "config.json").write_text(json.dumps(job))

    info = show(capsys, str(run), "--step", "2")
    assert info["quorum"] == {"groups": 2, "part": 1, "members": [1, 0], "quorum_id": 7}
    assert [(s["group"], s["part"], s["dp_rank"]) for s in info["samples"]] == [
        (1, 0, 0), (1, 0, 0), (0, 1, 0), (0, 1, 0)
    ]  # fmt: skip
    assert main(["show", str(run), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "trained by a torchft quorum of 2 replica group(s)" in out
    assert "this run folder's group trained part 1" in out
    assert "[2] group 0 (part 1 of 2) rank 0" in out and "[0] group 1 (part 0 of 2) rank 0" in out
    healed = show(capsys, str(run), "--step", "5")
    assert "quorum" not in healed and "group" not in healed["samples"][0]
    sid = int(plan.global_ids(2)[3])
    doc = int(np.searchsorted(np.asarray(store.doc_offsets), sid * SEQ, side="right")) - 1
    hits = [h for h in _where(capsys, run, doc) if h.get("step") == 2 and h["index"] == 3]
    assert hits and hits[0]["group"] == 0 and hits[0]["part"] == 1
    assert main(["inspect", str(run)]) == 0
    assert "torchft replica group 0 of group_size 2" in capsys.readouterr().out
