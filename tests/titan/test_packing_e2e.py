"""Packing end to end (issue 31 part a2): a 2-rank run of the tiny Llama with
``--zephon.packing best_fit``, killed after its checkpoint at step 4 and resumed on one
rank, trains exactly what an uninterrupted 1-rank packed run trains (``zephon verify``
MATCH, losses within the tolerance the elastic-resume tests use); a resume that turns
packing off is refused naming the field, with the run folder unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import PACKED
from tests.conftest import PACKED_SEQ as SEQ
from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_losses,
    assert_refused,
    assert_same_data,
    assert_unchanged,
    assert_verify_match,
    resume_events,
    tree,
)
from tests.titan.launch import copy_run_until, train03
from torchtitan_zephon.run.recorded import sequence_log


def assert_whole_documents(samples: list[dict]) -> None:
    """``zephon show``'s packed samples: documents then padding, seq_len tokens in all;
    a document of at most seq_len tokens whole (start 0, stop = length)."""
    for sample in samples:
        used = sum(d["stop"] - d["start"] for d in sample["documents"])
        assert used + sample["padding"] == SEQ and used > 0
        for d in sample["documents"]:
            if d["length"] <= SEQ:
                assert (d["start"], d["stop"]) == (0, d["length"])  # never split


@pytest.fixture(scope="module")
def one_rank(packed_one_rank: Path) -> Path:
    """The uninterrupted packed run on one rank (shared: tests/conftest.py)."""
    return packed_one_rank


# slow (issue 44 part e): a packed resume on another rank count is proven by
# test_a_packed_mixture_resumed_under_another_rank_count_trains_the_uninterrupted_run
@pytest.mark.slow
def test_a_packed_run_resumed_on_one_rank_matches_the_uninterrupted_one(
    one_rank: Path, tmp_path: Path
) -> None:
    two = tmp_path / "two_ranks"
    job = train03(two, 2, *PACKED).check()
    assert "packing best_fit:" in job.output and f"packed samples of seq_len {SEQ}" in job.output
    run = copy_run_until(two, tmp_path / "resumed", 4)
    train03(run, 1, *PACKED).check()
    (event,) = resume_events(run)
    assert (event["from_step"], event["dp_degree"]) == (4, 1)
    assert event["data_config"]["packing"]["method"] == "best_fit"
    for other in (two, run):
        assert_same_data(one_rank, other, range(1, 9))
        assert_losses(one_rank, other, range(1, 9), rtol=TOPOLOGY_RTOL)
        assert_verify_match(one_rank, other)


def test_a_resume_that_turns_packing_off_is_refused_naming_the_field(
    one_rank: Path, tmp_path: Path
) -> None:
    run = copy_run_until(one_rank, tmp_path / "unpacked", 4)
    before = tree(run)
    job = train03(run, 1, *PACKED[:2], *PACKED[4:], log=tmp_path / "unpacked.log")
    assert_refused(job, "Differing fields", "packing", "allow_changes")
    assert_unchanged(before, tree(run))
    assert sorted(sequence_log(run).records) == list(range(1, 9))


def test_show_and_where_name_the_packed_samples_of_a_packing_run(one_rank: Path, capsys) -> None:
    """``zephon show`` lists each packed sample's whole documents (start 0, stop = length
    when it fits seq_len) and its padding; ``zephon where`` finds a document in the step
    that trains it."""
    import json

    from torchtitan_zephon.cli.main import main

    assert main(["show", str(one_rank), "--step", "2", "--json", "--max-chars", "0"]) == 0
    step = json.loads(capsys.readouterr().out)
    assert step["status"] == "trained" and len(step["samples"]) == 8
    assert_whole_documents(step["samples"])
    from torchtitan_zephon.run.recorded import read_scalars

    padding = read_scalars(one_rank, "zephon/source/store/padding")  # the accounting's
    assert sorted(padding) == list(range(1, 9))
    assert padding[2] == sum(sample["padding"] for sample in step["samples"])
    first = step["samples"][0]
    doc, sample_id, index = first["documents"][0]["document"], first["sample"], first["index"]
    assert main(["where", str(one_rank), "--doc", str(doc), "--json", "--epochs", "0:0"]) == 0
    hits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"step": 2, "sample": sample_id, "index": index, "status": "trained"}.items() <= next(
        h for h in hits if h["step"] == 2 and h["index"] == index
    ).items()


# slow (issue 44 part e): packing x torchft groups, each proven alone by default
@pytest.mark.slow
def test_two_torchft_groups_train_the_packed_run_exactly(one_rank: Path, tmp_path: Path) -> None:
    """Under torchft each group trains whole packed samples of its part and divides its
    loss by the labelled tokens of all of B(s): two replica groups log what the 1-rank
    packed run logs (verify MATCH, losses within the tolerance)."""
    import subprocess

    pytest.importorskip("torchft", reason="torchft (a dependency of the package)")
    from tests.titan.conftest import lighthouse_at
    from tests.titan.launch import REPO
    from torchtitan_zephon.titan.ft.launch import group_command, group_env

    runs = [tmp_path / f"group{g}" for g in range(2)]
    with lighthouse_at(1) as url:
        procs = []
        for g, run in enumerate(runs):
            run.mkdir()
            log = open(run / "train.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(group_command(run, g, 2, *PACKED), cwd=REPO,
                          env=group_env(url), stdout=log, stderr=subprocess.STDOUT), log))  # fmt: skip
        for proc, log in procs:
            assert proc.wait(timeout=600) == 0, (log.name, Path(log.name).read_text()[-3000:])
            log.close()
    for run in runs:
        assert "(4 of the step's 8 samples)" in (run / "train.log").read_text()
        assert_same_data(one_rank, run, range(1, 9))
        assert_losses(one_rank, run, range(1, 9), rtol=TOPOLOGY_RTOL)
        assert_verify_match(one_rank, run)


MIXED = """
[[source]]
name = "docs"
store = "builtin:docs"

[[source]]
name = "stdlib"
store = "builtin:stdlib"

[[schedule]]
from_step = 1
weights = { docs = 0.5, stdlib = 0.5 }
"""


def test_a_packed_mixture_resumed_under_another_rank_count_trains_the_uninterrupted_run(
    tmp_path: Path, capsys
) -> None:
    """Each source packs its own documents; a 2-rank packed mixture cut after its
    checkpoint at step 4 and resumed on one rank trains what the uninterrupted run trains
    (verify MATCH, losses and per-source validation losses within the tolerance), and
    ``zephon show`` names each sample's whole documents in its own source."""
    import json

    from torchtitan_zephon.cli.main import main
    from torchtitan_zephon.run import recorded as runs

    mixture = tmp_path / "mixture.toml"
    mixture.write_text(MIXED)
    args = (*PACKED[:4], "--zephon.mixture", str(mixture), *PACKED[6:])
    two = tmp_path / "two_ranks"
    job = train03(two, 2, *args).check()
    for name in ("docs", "stdlib"):
        assert f"mixture source '{name}': packing best_fit:" in job.output
    run = copy_run_until(two, tmp_path / "resumed", 4)
    train03(run, 1, *args).check()
    (event,) = resume_events(run)
    assert (event["from_step"], event["dp_degree"]) == (4, 1)
    assert event["data_config"]["packing"]["method"] == "best_fit"
    assert_same_data(two, run, range(1, 9))
    assert_losses(two, run, range(1, 9), rtol=TOPOLOGY_RTOL)
    assert_verify_match(two, run)
    for name in ("docs", "stdlib"):
        a = runs.read_scalars(two, f"validation/loss/{name}")
        b = runs.read_scalars(run, f"validation/loss/{name}")
        assert set(a) >= {4, 8} and set(b) >= {8}, (name, a, b)
        assert abs(a[8] - b[8]) <= TOPOLOGY_RTOL * a[8], (name, a, b)

    assert main(["show", str(run), "--step", "6", "--json", "--max-chars", "0"]) == 0
    step = json.loads(capsys.readouterr().out)
    assert {s["source"] for s in step["samples"]} == {"docs", "stdlib"}
    assert_whole_documents(step["samples"])
    sample = step["samples"][0]
    doc, source = sample["documents"][0]["document"], sample["source"]
    argv = ["where", str(run), "--doc", str(doc), "--source", source, "--json", "--epochs", "0:0"]
    assert main(argv) == 0
    hits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(h["step"] == 6 and h["index"] == sample["index"] for h in hits), hits
