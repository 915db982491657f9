"""zephon plan --mixture and zephon inspect on a mixture's checkpoint."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.state import RECORD_KEY, DataState
from torchtitan_zephon.store.writer import slice_store


@pytest.fixture(scope="module")
def mixture_file(store, tmp_path_factory) -> Path:
    """Two sources cut from the test store, a weight change at step 3."""
    root = tmp_path_factory.mktemp("mixture")
    slice_store(store, 0, 2500, root / "code")
    slice_store(store, 2500, store.num_tokens, root / "web")
    text = (
        '[[source]]\nname = "web"\nstore = "web"\n'  # relative to the mixture file
        '[[source]]\nname = "code"\nstore = "code"\nheldout_samples = 4\n'
        "[[schedule]]\nfrom_step = 1\nweights = { web = 0.7, code = 0.3 }\n"
        "[[schedule]]\nfrom_step = 3\nweights = { web = 0.25, code = 0.75 }\n"
    )
    (root / "mix.toml").write_text(text)
    return root / "mix.toml"


def plan_of(path: Path, gbs: str = "1:10,4:20"):
    source = JobData.open_mixture(MixtureConfig.load(path), 8, default_heldout=2)
    return source, source.plan(source.data_config(seed=3, schedule=BatchSchedule.parse(gbs)))


def test_plan_prints_ids_and_their_sources(mixture_file, capsys):
    args = ["plan", "--mixture", str(mixture_file), "--seq-len", "8", "--seed", "3"]
    args += ["--heldout-samples", "2"]
    assert main([*args, "--global-batch-size", "1:10,4:20", "--steps", "1:5", "--json"]) == 0
    out = capsys.readouterr()
    lines = [json.loads(x) for x in out.out.splitlines()]
    _, plan = plan_of(mixture_file)
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    for x in lines:
        names, ids = plan.decode(plan.global_ids(x["step"]))
        assert x["sources"] == names and x["ids"] == ids.tolist()
        assert len(x["ids"]) == (10 if x["step"] < 4 else 20)
    assert {n for x in lines for n in x["sources"]} == {"web", "code"}
    assert "mixture of 2 sources (code, web); every source's count stays within" in out.err
    # the ranks' slices concatenate to the whole step
    ranks = {"ids": [], "sources": []}
    for r in range(5):
        cmd = [*args, "--global-batch-size", "10", "--steps", "2:2", "--json"]
        assert main([*cmd, "--dp-degree", "5", "--dp-rank", str(r)]) == 0
        line = json.loads(capsys.readouterr().out)
        ranks["ids"] += line["ids"]
        ranks["sources"] += line["sources"]
    assert main([*args, "--global-batch-size", "10", "--steps", "2:2", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert ranks == {"ids": whole["ids"], "sources": whole["sources"]}


def test_plan_warns_when_a_step_cannot_stay_within_one_sample(store, tmp_path, capsys):
    """A weight change that leaves no counts within one sample at some step: the
    plan says which source, which step and how far, on stderr; the ids still print."""
    quarter = store.num_tokens // 4
    text = ""
    for k, name in enumerate("abcd"):
        slice_store(store, k * quarter, (k + 1) * quarter, tmp_path / name)
        text += f'[[source]]\nname = "{name}"\nstore = "{name}"\n'
    text += "[[schedule]]\nfrom_step = 1\nweights = { a = 1, b = 0.25, c = 0.3, d = 0.7 }\n"
    text += "[[schedule]]\nfrom_step = 2\nweights = { a = 0, b = 0.5, c = 0.3, d = 0 }\n"
    (tmp_path / "mix.toml").write_text(text)
    args = ["plan", "--mixture", str(tmp_path / "mix.toml"), "--seq-len", "8", "--seed", "0"]
    assert main([*args, "--global-batch-size", "5", "--steps", "1:6", "--json"]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 6
    source = JobData.open_mixture(MixtureConfig.load(tmp_path / "mix.toml"), 8)
    plan = source.plan(source.data_config(seed=0, schedule=BatchSchedule.parse("5")))
    worst, who, step = plan.mixture.deviation_report()
    assert worst > 1
    assert f"zephon plan: warning: mixture source {who!r} ends step {step} " in out.err
    assert "Traceback" not in out.err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--store", "S"], "argument --store: not allowed with argument --mixture"),
        (["--heldout-samples", "100000"], "mixture source 'web': heldout_samples=100000"),
        (["--dp-degree", "3"], "DP degrees that work"),
    ],
)
def test_plan_refuses_bad_input_with_a_message(mixture_file, capsys, extra, message):
    args = ["plan", "--mixture", str(mixture_file), "--seq-len", "8", "--seed", "3"]
    try:  # argparse's usage errors exit 2 too
        rc = main([*args, "--global-batch-size", "10", "--steps", "1:2", *extra])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_plan_names_a_bad_mixture_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[source]]\nname = "web"\nstore = "nowhere"\n[[schedule]]\nfrom_step = 1\n')
    args = ["plan", "--mixture", str(bad), "--seq-len", "8", "--seed", "3"]
    assert main([*args, "--global-batch-size", "10", "--steps", "1:2"]) == 2
    err = capsys.readouterr().err
    assert "zephon plan: error: mixture file" in err and "needs weights" in err


def save_checkpoint(path: Path, state: DataState) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"dataloader": {RECORD_KEY: state.to_json()}}, checkpoint_id=str(path), no_dist=True
        )
    return path


def test_inspect_shows_each_source_drawn_vs_target_and_epoch(mixture_file, tmp_path, capsys):
    source, _ = plan_of(mixture_file, "10")
    loader = ZephonLoader(
        source, seq_len=8, seed=3, schedule=BatchSchedule.parse("10"), dp_rank=0,
        dp_degree=1, local_batch_size=10, prefetch=0,
    )  # fmt: skip
    drawn = {"code": 0, "web": 0}
    for step in range(1, 7):
        names, _ = loader.plan.decode(loader.plan.global_ids(step))
        for n in names:
            drawn[n] += 1
    near = DataState(loader.config, 7, 60)
    far = DataState(loader.config, 10**9, 10 * (10**9 - 1))  # O(1): nothing is replayed
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoint" / "step-6", near)
    save_checkpoint(run / "checkpoint" / "step-999999999", far)

    assert main(["inspect", str(run / "checkpoint" / "step-6"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["mixture"]
    by_name = {s["name"]: s for s in info["sources"]}
    assert {n: s["samples"] for n, s in by_name.items()} == drawn
    # exact targets: 0.7 x 10 x 2 steps + 0.25 x 10 x 4 steps for web
    assert by_name["web"]["target"] == "24/1" and by_name["code"]["target"] == "36/1"
    assert by_name["code"]["weight"] == "3/4" and by_name["code"]["heldout_samples"] == 4
    assert by_name["web"]["epoch"] == drawn["web"] // by_name["web"]["num_samples"]

    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "mixture at step 1000000000 (2 sources; the plan's worst deviation" in out
    assert "source  weight" in out and "drawn" in out and "target" in out
    code = next(line for line in out.splitlines() if line.strip().startswith("code"))
    target = 0.3 * 20 + 0.75 * 10 * (10**9 - 3)
    assert f"{target:.2f}" in code, code


def test_plan_takes_raw_input_sources_with_the_trainers_tokenizer_options(
    store, tokenizer_dir, tmp_path, monkeypatch, capsys
):
    """A [[source]] naming raw inputs (a JSONL file whose text is in another field) is
    prepared into the cache as the trainer prepares it: the same ids as a mixture of the
    store `zephon prepare` makes of it. Without --tokenizer: what to pass, naming it."""
    from tests.conftest import corpus_text

    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    slice_store(store, 0, 2500, tmp_path / "web")
    with open(tmp_path / "notes.jsonl", "w") as f:
        for k in range(60):
            f.write(json.dumps({"body": corpus_text(k, 40 + k % 13)}) + "\n")
    prepare = ["prepare", str(tmp_path / "notes.jsonl"), "--tokenizer", str(tokenizer_dir)]
    assert main([*prepare, "--output", str(tmp_path / "notes"), "--text-field", "body"]) == 0
    schedule = "[[schedule]]\nfrom_step = 1\nweights = { web = 0.5, notes = 0.5 }\n"
    for name, notes in (("raw.toml", "notes.jsonl"), ("prepared.toml", "notes")):
        (tmp_path / name).write_text(
            f'[[source]]\nname = "web"\nstore = "web"\n[[source]]\nname = "notes"\n'
            f'store = "{notes}"\n' + schedule
        )
    args = ["--seq-len", "8", "--seed", "3", "--global-batch-size", "6", "--steps", "1:4"]
    capsys.readouterr()
    assert main(["plan", "--mixture", str(tmp_path / "prepared.toml"), *args, "--json"]) == 0
    expected = capsys.readouterr().out
    raw = ["plan", "--mixture", str(tmp_path / "raw.toml"), *args, "--json"]
    assert main([*raw, "--tokenizer", str(tokenizer_dir), "--text-field", "body"]) == 0
    out = capsys.readouterr()
    assert out.out == expected and '"notes"' in expected
    assert "zephon plan: preparing the raw inputs" in out.err
    assert main(raw) == 2
    assert capsys.readouterr().err == (
        f"zephon plan: error: mixture source 'notes' names raw inputs ({tmp_path}/notes.jsonl): "
        "pass --tokenizer DIR (the trainer's hf_assets_path; TOML: model.hf_assets_path) and, "
        "when the text is not "
        "in the field 'text', --text-field F (the trainer's zephon.text_field): zephon plan "
        "then prepares them into the store cache as the trainer does.\n"
    )


def test_plan_leaves_out_a_sources_ids_and_keeps_its_counts(mixture_file, tmp_path, capsys):
    args = ["plan", "--mixture", str(mixture_file), "--seq-len", "8", "--seed", "3"]
    args += ["--heldout-samples", "2", "--global-batch-size", "10", "--steps", "1:8", "--json"]
    assert main(args) == 0
    plain = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    web = [i for x in plain[1:] for i, n in zip(x["ids"], x["sources"], strict=True) if n == "web"]
    exclude = tmp_path / "x.jsonl"
    exclude.write_text(json.dumps({"source": "web", "ids": web[:3], "from_step": 2}))
    assert main([*args, "--exclude", str(exclude)]) == 0
    out = capsys.readouterr()
    got = [json.loads(x) for x in out.out.splitlines()]
    assert [x["sources"] for x in got] == [x["sources"] for x in plain]  # counts kept
    assert got[0] == plain[0]
    got_web = [
        i for x in got[1:] for i, n in zip(x["ids"], x["sources"], strict=True) if n == "web"
    ]
    assert got_web[: len(web) - 3] == web[3:]  # deleted, the source's next ones move up
    assert "exclude from step 2, leave out 3 sample ids of source 'web'" in out.err
    for text, message in [
        (json.dumps({"ids": [1], "from_step": 2}), 'has no "source"'),
        (json.dumps({"ids": [1], "from_step": 2, "source": "wiki"}), "'wiki' is not a source"),
        (json.dumps({"ids": [308], "from_step": 2, "source": "code"}), "held-out (validation)"),
    ]:
        exclude.write_text(text)
        assert main([*args, "--exclude", str(exclude)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
