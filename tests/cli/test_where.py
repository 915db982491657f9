"""``zephon where``: the steps holding a document agree with a scan of ``plan``'s ids."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli.test_show import mixture_file, write_run  # noqa: F401 - a fixture
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.cli.where import where
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.step_data import StepData
from torchtitan_zephon.order.exclusions import Exclusions
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig, MixtureError
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.order.skips import SkipSteps

SEQ = 8


def step_data(
    source, *, seed: int, gbs: str, skips: str = "", trained: int | None = None, exclude=()
) -> StepData:
    """``exclude``: left-out entries (from_step, ids[, source name]) of a zephon.exclude."""
    if exclude:
        source.leave_out(Exclusions.parse("\n".join(
            json.dumps({"from_step": e[0], "ids": e[1], **({"source": e[2]} if e[2:] else {})})
            for e in exclude
        )))  # fmt: skip
    extra = {"skip_steps": SkipSteps.parse(skips).to_json()} if skips else {}
    config = source.data_config(seed=seed, schedule=BatchSchedule.parse(gbs), extra=extra)
    plan = source.plan(config)
    if isinstance(plan, MixtureStream):
        stores, names = list(source.stores), list(source.names)
    else:
        stores, names = source.stores, [""]
    return StepData("test", plan, config, names, stores, None, SEQ, trained_last=trained)


def doc_samples(store, doc: int, first_id: int, n: int) -> set[int]:
    """Reference: the samples with an input token in ``doc``, by the tokens' documents."""
    out = set()
    for sid in range(first_id, first_id + n):
        if doc in store.document_ids(sid * SEQ, sid * SEQ + SEQ):
            out.add(sid)
    return out


def scan(data: StepData, store, doc: int, source: int, first_id: int, n: int, dp: int):
    """(hits as (step, index, rank, rank index, sample), stop): every occurrence in
    ``plan.global_ids`` of the steps before ``stop``, the first step whose draws from
    the source start past its first epoch (or past another source's max_epochs)."""
    plan, wanted = data.plan, doc_samples(store, doc, first_id, n)
    out, step = set(), 1
    while True:
        first, gbs = plan.step_positions(step)
        if isinstance(plan, MixtureStream):
            reach = int(plan.mixture.stream_positions_before(step)[source])
        else:
            reach = int(plan.stream_positions(np.array([first]))[0])
        if reach >= n:
            return out, step
        try:
            keys = plan.global_ids(step)
        except MixtureError:  # another source's max_epochs
            return out, step
        src, ids = (keys >> 40, keys & ((1 << 40) - 1))
        for k in np.nonzero((src == source) & np.isin(ids, list(wanted)))[0].tolist():
            out.add((step, k, k // (gbs // dp), k % (gbs // dp), int(ids[k])))
        step += 1


def found(hits, stop: int):
    return {(h.step, h.index, h.dp_rank, h.rank_index, h.sample) for h in hits
            if h.step is not None and h.step < stop}  # fmt: skip


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32),
    gbs=st.sampled_from(["4", "1:4,30:8", "1:8,11:4,50:12"]),
    skips=st.sampled_from(["", "3:2", "2:1,20:7", "9:40"]),
    doc=st.integers(0, 79),
    dp=st.sampled_from([1, 2, 4]),
    trained=st.integers(0, 200),
    data=st.data(),
)
def test_where_agrees_with_plan_for_one_store(store, seed, gbs, skips, doc, dp, trained, data):
    n = store.num_samples(SEQ) - 3
    exclude = data.draw(left_out_entries(sorted(doc_samples(store, doc, 0, n)) + [0, n - 1]))
    data = step_data(
        JobData.of_store(store, SEQ, num_samples=n), seed=seed, gbs=gbs, skips=skips, trained=trained,
        exclude=exclude,
    )  # fmt: skip
    expected, stop = scan(data, store, doc, 0, 0, n, dp)
    hits, _ = where(data, doc, epochs=(0, 1), dp_degree=dp)
    assert found(hits, stop) == expected
    for h in hits:  # each sample once per epoch; a hit is trained exactly up to the last step
        if h.step is not None:
            assert h.status == ("trained" if h.step <= trained else "planned")
    wanted = doc_samples(store, doc, 0, n)
    assert sorted((h.epoch, h.sample) for h in hits) == sorted(
        (e, s) for e in range(2) for s in wanted
    )
    assert any(h.status == "skipped" for h in hits) <= bool(skips)
    check_left_out(hits, exclude)


@st.composite
def left_out_entries(draw, ids: list[int], source: str | None = None):
    """0-3 zephon.exclude entries (from_step, ids[, source]) leaving out some of ``ids``
    (a document's samples, so that where meets them)."""
    entries = []
    for _ in range(draw(st.integers(0, 3))):
        chosen = draw(st.lists(st.sampled_from(ids), max_size=4, unique=True))
        entries.append((draw(st.integers(1, 60)), chosen, *([source] if source else [])))
    return entries


def check_left_out(hits, exclude) -> None:
    """A hit ``left out from step S`` is a sample of an entry of step S (its first), and
    has no step; a plan with no entries has no such hit."""
    first = {}
    for e in sorted(exclude):
        for x in e[1]:
            first.setdefault(x, e[0])
    for h in hits:
        if h.status == "left out":
            assert h.step is None and first[h.sample] == h.left_out_from
            assert h.to_dict()["left_out_from"] == h.left_out_from
        else:
            assert "left_out_from" not in h.to_dict()
    assert any(h.status == "left out" for h in hits) <= bool(first)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32),
    gbs=st.sampled_from(["10", "1:10,5:20"]),
    skips=st.sampled_from(["", "2:2", "4:1,8:3"]),
    name=st.sampled_from(["code", "web"]),
    doc=st.integers(0, 30),
    data=st.data(),
)
def test_where_agrees_with_plan_for_a_mixture(mixture_file, seed, gbs, skips, name, doc, data):  # noqa: F811
    source = JobData.open_mixture(MixtureConfig.load(mixture_file), SEQ)
    i = source.names.index(name)
    store, n = source.stores[i], int(source.mixture.sources[i].num_samples)
    doc = doc % store.num_documents
    exclude = data.draw(left_out_entries(sorted(doc_samples(store, doc, 0, n)) + [0], name))
    data = step_data(source, seed=seed, gbs=gbs, skips=skips, exclude=exclude)
    expected, stop = scan(data, store, doc, i, 0, n, 1)
    hits, _ = where(data, doc, source=name, epochs=(0, 1))
    assert found(hits, stop) == expected
    check_left_out(hits, exclude)
    if name == "code":  # max_epochs = 2: epoch 2 is never drawn
        _, notes = where(data, doc, source=name, epochs=(0, 3))
        assert "source 'code' has max_epochs=2: epochs 2.. are never drawn." in notes


def test_where_cli_on_a_run_with_a_skip(store_path, store, tmp_path, capsys):
    source = JobData.of_store(store, SEQ)
    run = write_run(tmp_path / "run", source, skips="2:3", trained=40,
                    saved={"zephon": {"store": str(store_path)}})  # fmt: skip
    assert main(["where", str(run), "--doc", "5", "--json"]) == 0
    hits = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    data = step_data(source, seed=3, gbs="4", skips="2:3", trained=40)
    expected, stop = scan(data, store, 5, 0, 0, store.num_samples(SEQ), 2)  # the run's DP degree 2
    assert {(h["step"], h["index"], h["dp_rank"], h["rank_index"], h["sample"]) for h in hits
            if h["step"] is not None and h["step"] < stop} == expected  # fmt: skip
    assert {h["status"] for h in hits} >= {"planned"}
    assert main(["where", str(run), "--doc", "5", "--epochs", "1:1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"document 5 in the run {run}, epochs 1..1: ")
    assert all(line.startswith("  epoch 1  ") for line in out[1:])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--doc", "100000"], "document 100000 is not in the store"),
        (["--doc", "1", "--source", "web"], "--source 'web' is for a mixture"),
        (["--doc", "1", "--epochs", "2:1"], "expected 0 <= FIRST <= LAST, got '2:1'"),
        (["--doc", "1", "--epochs", "0:99999999999"], "spans 100000000000 epochs; search at most"),
        (["--doc", "1", "--dp-degree", "3"], "--dp-degree 3 does not divide the global batch of 4"),
    ],
)
def test_bad_documents_sources_and_epochs(store_path, capsys, extra, message):
    argv = ["where", str(store_path), "--seq-len", "8", "--global-batch-size", "4", "--seed", "1"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_mixture_needs_the_source(mixture_file, capsys):  # noqa: F811
    argv = ["where", "--mixture", str(mixture_file), "--seq-len", "8", "--global-batch-size", "10"]
    assert main([*argv, "--seed", "1", "--doc", "0"]) == 2
    assert "name the source of the document with --source NAME" in capsys.readouterr().err
    assert main([*argv, "--seed", "1", "--doc", "0", "--source", "code"]) == 0
    assert capsys.readouterr().out.startswith("document 0 of source code in the mixture")


def test_help_states_the_default_epochs(capsys):
    assert main(["where", "--help"]) == 0
    assert "(default 0:1: the first two)" in " ".join(capsys.readouterr().out.split())


del argparse
