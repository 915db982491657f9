"""The zephon command: prepare / inspect / plan, exit codes and error messages."""

import json
import subprocess
import sys
import warnings

import pytest

from torchtitan_zephon.cli.main import main
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.store.format import UncheckedStoreWarning
from torchtitan_zephon.store.reader import TokenStore

from .conftest import copy_store, edit_token, make_v1


def test_prepare_then_inspect(tmp_path, tokenizer_dir, corpus_dir, capsys, store):
    out = tmp_path / "s"
    argv = ["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
    assert main([*argv, "--workers", "2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "prepared" in printed and store.fingerprint in printed  # same bytes as the fixture
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "token store" in text and store.fingerprint in text and "uint16" in text
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "store" and info["num_tokens"] == store.num_tokens
    assert info["sources"][0]["name"] == "doc00.txt"  # relative to the input folder
    # preparing over an existing store is refused
    assert main([*argv, "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "but MASTER_ADDR and MASTER_PORT not"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "are not whole numbers"),
        ({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "outside"),
    ],
)
def test_prepare_with_half_a_launcher_environment_says_what_is_missing(
    tmp_path, tokenizer_dir, corpus_dir, capsys, monkeypatch, env, message
):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "s"
    argv = ["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
    assert main([*argv, "--quiet"]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_plan_json_lines(store_path, capsys):
    args = ["plan", "--store", str(store_path), "--seq-len", "8", "--seed", "3"]
    assert main([*args, "--global-batch-size", "1:4,3:8", "--steps", "1:4", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    n = TokenStore.open(store_path).num_samples(8)
    plan = DataPlan(n, 3, BatchSchedule.parse("1:4,3:8"))
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert all(x["ids"] == plan.global_ids(x["step"]).tolist() for x in lines)
    # ranks' slices concatenate to the whole step
    ranks = []
    for r in range(2):
        cmd = [*args, "--global-batch-size", "8", "--steps", "2:2", "--json"]
        assert main([*cmd, "--dp-degree", "2", "--dp-rank", str(r)]) == 0
        ranks += json.loads(capsys.readouterr().out)["ids"]
    assert main([*args, "--global-batch-size", "8", "--steps", "2:2", "--json"]) == 0
    assert ranks == json.loads(capsys.readouterr().out)["ids"]


def test_plan_shows_skips_and_prints_the_ids_past_them(store_path, capsys):
    args = ["plan", "--store", str(store_path), "--seq-len", "8", "--seed", "3", "--json"]
    assert main([*args, "--global-batch-size", "4", "--steps", "1:9"]) == 0
    plain = [json.loads(x)["ids"] for x in capsys.readouterr().out.splitlines()]
    assert (
        main([*args, "--global-batch-size", "4", "--steps", "1:4", "--skip-steps", "3:2,9:1"]) == 0
    )
    out = capsys.readouterr()
    skipped = [json.loads(x)["ids"] for x in out.out.splitlines()]
    assert skipped == [plain[0], plain[1], plain[4], plain[5]]  # step 3 trains step 5's data
    assert (
        "zephon plan: skip_steps at step 3, skip the data of 2 steps (3..4): step 3 trains "
        "what step 5 would have trained, and steps 3..4 of the original order are never "
        "trained." in out.err
    )
    assert "skip_steps at step 9, skip the data of 1 step (9..9)" in out.err
    assert "(after the last step printed, 4)." in out.err
    assert (
        main([*args, "--global-batch-size", "4", "--steps", "1:2", "--skip-steps", "3:2,4:1"]) == 2
    )
    err = capsys.readouterr().err
    assert "argument --skip-steps: skip entries 3:2 and 4:1 overlap" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "/nonexistent/store"], "does not exist"),
        (
            ["prepare", "/nonexistent/in", "--tokenizer", "/x", "--output", "/tmp/zz"],
            "does not exist",
        ),
        (
            [
                "plan",
                "--store",
                "STORE",
                "--seq-len",
                "8",
                "--global-batch-size",
                "12",
                "--seed",
                "1",
                "--steps",
                "1:2",
                "--dp-degree",
                "5",
            ],
            "DP degrees that work",
        ),
        (
            [
                "plan",
                "--store",
                "STORE",
                "--seq-len",
                "8",
                "--global-batch-size",
                "2:8",
                "--seed",
                "1",
                "--steps",
                "1:2",
            ],
            "must start at step 1",
        ),
    ],
)
def test_errors_exit_2_without_traceback(argv, message, store_path, capsys):
    argv = [str(store_path) if a == "STORE" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"zephon {argv[0]}: error: " in err and message in err
    assert "Traceback" not in err


def test_inspect_unknown_kind(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not something zephon recognises" in capsys.readouterr().err


def test_python_dash_m_entry_point(store_path):
    ok = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", "inspect", str(store_path), "--json"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["kind"] == "store"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_zephon",
            "plan",
            "--store",
            str(store_path),
            "--seq-len",
            "0",
            "--global-batch-size",
            "4",
            "--seed",
            "1",
            "--steps",
            "1:1",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "zephon plan: error: argument --seq-len: expected an integer >= 1, got '0'" in bad.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", "plan", "--steps", "x"],
        capture_output=True,
        text=True,
    )
    assert usage.returncode == 2 and "usage:" in usage.stderr


def _inspect(capsys, *argv):
    rc = main(["inspect", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inspect_check_reports_bad_chunks(tmp_path, store_path, capsys):
    path = copy_store(store_path, tmp_path / "s", chunk_tokens=100)
    rc, out, _ = _inspect(capsys, path, "--check")
    assert rc == 0 and "check:       intact (" in out and "chunks of 100 tokens" in out
    edit_token(path, 250)
    edit_token(path, 1234)
    rc, out, _ = _inspect(capsys, path, "--check")
    assert rc == 1 and "check:       FAILED, 2 problem(s):" in out
    assert "chunk 2 (tokens [200, 300)) of tokens.bin does not match its checksum" in out
    assert "chunk 12 (tokens [1200, 1300))" in out
    rc, out, _ = _inspect(capsys, path, "--check", "--json")
    report = json.loads(out)["check"]
    assert rc == 1 and not report["ok"]
    assert report["bad_chunks"] == [
        {"index": 2, "start": 200, "stop": 300},
        {"index": 12, "start": 1200, "stop": 1300},
    ]
    rc, out, _ = _inspect(capsys, path)  # without --check: opening is cheap and succeeds
    assert rc == 0 and "check:" not in out


def test_inspect_upgrade_keeps_fingerprint(tmp_path, store_path, store, capsys):
    path = copy_store(store_path, tmp_path / "old")
    fingerprint = make_v1(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedStoreWarning)  # said in the summary instead
        rc, out, _ = _inspect(capsys, path)
    assert rc == 0 and "checksums:   none (format 1)" in out and "--upgrade" in out
    rc, out, _ = _inspect(capsys, path, "--check")
    assert rc == 1 and "no content checksums (store format version 1)" in out
    rc, out, _ = _inspect(capsys, path, "--upgrade", "--check")
    assert rc == 0 and f"fingerprint: {fingerprint}" in out
    assert "upgrade:     content checksums added, fingerprint unchanged" in out
    assert "check:       intact" in out and f"max token id {store.max_token_id}" in out
    rc, out, _ = _inspect(capsys, path, "--upgrade")
    assert rc == 0 and "nothing to do" in out
    assert TokenStore.open(path).fingerprint == fingerprint


def test_inspect_check_needs_a_store(tmp_path, capsys):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    for flag in ("--check", "--upgrade"):
        rc, _, err = _inspect(capsys, tmp_path / "run", flag)
        assert rc == 2 and "--check and --upgrade apply to token stores" in err
        assert "is a run folder" in err


# ----------------------------------------------------------------------------- plan: bad arguments


def _plan(store_path, *extra: str) -> list[str]:
    base = {"--seq-len": "8", "--global-batch-size": "4", "--seed": "1", "--steps": "1:2"}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        base[flag] = value
    argv = ["plan", "--store", str(store_path)]
    for flag, value in base.items():
        argv += [flag, value] if value is not None else [flag]
    return argv


def test_plan_huge_global_batch_is_refused_up_front(store_path, capsys):
    """A batch no one could print is refused before any id is computed (was a numpy
    MemoryError traceback); a huge entry outside the printed steps does not matter."""
    assert main(_plan(store_path, "--global-batch-size", str(10**12), "--json", None)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("zephon plan: error: step 1 has 1000000000000 sample ids")
    assert "at most 1000000000 per step" in captured.err and "--dp-rank" in captured.err
    later = f"1:4,100:{10**12}"
    assert main(_plan(store_path, "--global-batch-size", later, "--steps", "98:99")) == 0
    assert main(_plan(store_path, "--global-batch-size", later, "--steps", "99:100")) == 2
    assert "step 100 has 1000000000000 sample ids" in capsys.readouterr().err


def test_plan_streams_big_steps_in_blocks(store_path, capsys, monkeypatch):
    """Steps are printed block by block (bounded memory); the output is the same as
    printing each step's ids at once."""
    import torchtitan_zephon.cli.plan as plan_cli

    n = TokenStore.open(store_path).num_samples(8)
    plan = DataPlan(n, 1, BatchSchedule.parse("40"))
    monkeypatch.setattr(plan_cli, "BLOCK", 7)
    assert main(_plan(store_path, "--global-batch-size", "40", "--json", None)) == 0
    expected = [{"step": s, "ids": plan.global_ids(s).tolist()} for s in (1, 2)]
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == expected
    assert main(_plan(store_path, "--global-batch-size", "40", "--steps", "2:2")) == 0
    assert capsys.readouterr().out == "step 2: " + " ".join(map(str, expected[1]["ids"])) + "\n"
    argv = _plan(store_path, "--global-batch-size", "40", "--dp-degree", "4", "--dp-rank", "3")
    assert main([*argv, "--json"]) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[1])
    assert last == {"step": 2, "ids": plan.rank_ids(2, 3, 4).tolist()}


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--seq-len", "0", "argument --seq-len: expected an integer >= 1, got '0'"),
        ("--seq-len", "-8", "argument --seq-len: expected an integer >= 1, got '-8'"),
        ("--seq-len", "eight", "argument --seq-len: expected an integer >= 1, got 'eight'"),
        ("--dp-degree", "0", "argument --dp-degree: expected an integer >= 1, got '0'"),
        ("--dp-degree", "-2", "argument --dp-degree: expected an integer >= 1, got '-2'"),
        ("--dp-rank", "-1", "argument --dp-rank: expected an integer >= 0, got '-1'"),
        ("--dp-rank", "1", "--dp-rank 1 must be below --dp-degree 1"),
        ("--local-batch-size", "0", "argument --local-batch-size: expected an integer >= 1"),
        ("--sample-offset", "-1", "argument --sample-offset: expected an integer >= 0"),
        ("--num-samples", "0", "argument --num-samples: expected an integer >= 1"),
        ("--num-samples", "10000000", "samples [0, 10000000) do not fit the store"),
        ("--seed", "1.5", "argument --seed: invalid int value: '1.5'"),
        ("--steps", "0:2", "argument --steps: expected 1 <= FIRST <= LAST"),
        ("--steps", "3:1", "argument --steps: expected 1 <= FIRST <= LAST"),
        ("--steps", "1:2:3", "argument --steps: expected FIRST:LAST"),
        ("--steps", "1:", "argument --steps: expected FIRST:LAST"),
        ("--global-batch-size", "0", "global batch size must be >= 1"),
        ("--global-batch-size", "1:4,1:8", "strictly increasing"),
        ("--global-batch-size", "4x", "cannot parse global batch schedule '4x'"),
    ],
)
def test_plan_argument_errors(store_path, capsys, flag, value, message):
    code = main(_plan(store_path, flag, value))
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


# ---------------------------------------------------------------- small stores (issue 18)


def test_plan_warns_for_a_store_smaller_than_a_batch_and_refuses_one_sample(
    store_path, store, capsys
):
    """Warned (stderr, ids still printed) when a global batch is larger than the store,
    naming the store, its sample count and the batch; refused with one sample."""
    t = store.num_tokens
    three = str((t - 1) // 3)  # a seq_len that leaves 3 samples
    assert main(_plan(store_path, "--seq-len", three, "--global-batch-size", "1:2,5:8",
                      "--steps", "4:5", "--json", None)) == 0  # fmt: skip
    out = capsys.readouterr()
    assert out.err == (
        f"zephon plan: warning: the store {store_path} (seq_len {three}) has 3 training "
        "samples, fewer than the global batch of 8 from step 5 on (batch schedule entry "
        "5:8): every such step repeats samples within itself. Use a larger store or a "
        "smaller global batch.\n"
    )
    steps = [json.loads(x) for x in out.out.splitlines()]
    assert steps[1]["ids"] == DataPlan(3, 1, BatchSchedule.parse("1:2,5:8")).global_ids(5).tolist()
    assert main(_plan(store_path, "--seq-len", three, "--global-batch-size", "3")) == 0
    assert capsys.readouterr().err == ""  # every step fits the store: no word
    one = str(t - 1)
    assert main(_plan(store_path, "--seq-len", one, "--global-batch-size", "8")) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (
        f"zephon plan: error: the store {store_path} (seq_len {one}) has 1 training sample: "
        "every step would train on that one sample alone, repeated to fill the global batch "
        "(8 at step 1), whatever the seed or the number of ranks. A single store needs at "
        f"least 2. To change it: use --seq-len {(t - 1) // 2} or less (the longest that gives "
        "2 samples), or use a larger store.\n"
    )
    assert main(_plan(store_path, "--num-samples", "1", "--global-batch-size", "1")) == 2
    assert "To change it: raise --num-samples (now 1)." in capsys.readouterr().err


def test_plan_of_a_store_shorter_than_one_sample_says_tokens_and_seq_len(store_path, store, capsys):
    t = store.num_tokens
    assert main(_plan(store_path, "--seq-len", str(t))) == 2
    assert capsys.readouterr().err == (
        f"zephon plan: error: the store {store_path} has {t} tokens, but a sample of seq_len "
        f"{t} needs seq_len + 1 = {t + 1} tokens (its inputs and the label of the last one), "
        f"so it holds no sample. To change it: use --seq-len {(t - 1) // 2} or less (the "
        "longest that gives 2 samples), or use a larger store.\n"
    )


def test_plan_of_raw_inputs_prepares_them_as_the_trainer_does(
    tmp_path, monkeypatch, corpus_dir, tokenizer_dir, store_path, capsys
):
    """--store naming raw inputs with --tokenizer: the ids of the store `zephon prepare`
    makes of them (the trainer's cache entry); without --tokenizer, what to pass."""
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    assert main(_plan(store_path, "--json", None)) == 0
    expected = capsys.readouterr().out
    raw = _plan(corpus_dir, "--json", None, "--tokenizer", str(tokenizer_dir))
    assert main(raw) == 0
    out = capsys.readouterr()
    assert out.out == expected and "zephon plan: preparing the raw inputs" in out.err
    assert main(raw) == 0  # the cache entry is found again: nothing prepared
    out = capsys.readouterr()
    assert out.out == expected and "preparing" not in out.err
    assert main(_plan(corpus_dir)) == 2
    err = capsys.readouterr().err
    assert (
        "has no manifest.json" in err
        and (
            f"{str(corpus_dir)!r} names raw inputs: pass --tokenizer DIR (the trainer's "
            "hf_assets_path; TOML: model.hf_assets_path) and, when the text is not in the field "
            "'text', --text-field F "
            "(the trainer's zephon.text_field)"
        )
        in err
    )


# ----------------------------------------------------------------------------- issue 18


def test_prepare_and_inspect_say_which_split_of_a_dataset_dict_was_read(
    tmp_path, tokenizer_dir, capsys
):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({"text": [f"alpha beta {k}" for k in range(n)]})
            for name, n in (("train", 20), ("validation", 10))
        }
    ).save_to_disk(str(tmp_path / "dd"))
    base = ["prepare", str(tmp_path / "dd"), "--tokenizer", str(tokenizer_dir), "--quiet"]
    assert main([*base, "--output", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "20 documents" in out
    assert (
        "  read split train of the DatasetDict dd (its splits: train, validation; choose with "
        "--split NAME, or --split all)"
    ) in out
    assert main(["inspect", str(tmp_path / "s")]) == 0
    assert "    dd  [hf, split train] " in capsys.readouterr().out
    assert main([*base, "--output", str(tmp_path / "all"), "--split", "all"]) == 0
    assert "30 documents" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "all"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sources"][0]["splits"] == ["train", "validation"]
    assert main([*base, "--output", str(tmp_path / "x"), "--split", "dev"]) == 2
    err = capsys.readouterr().err
    assert "has no split 'dev'. Choose one with --split NAME, or --split all" in err
    assert "Traceback" not in err and not (tmp_path / "x").exists()


def test_prepare_names_its_text_field_option(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "d.jsonl").write_text('{"body": "alpha"}\n{"body": "beta"}\n')
    argv = ["prepare", str(tmp_path / "d.jsonl"), "--tokenizer", str(tokenizer_dir), "--quiet",
            "--output", str(tmp_path / "s")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:1: unknown text field 'text'; fields present: ['body']. Choose one with " \
        "--text-field." in err  # fmt: skip


def test_inspect_lists_what_the_store_cache_holds(tmp_path, tokenizer_dir, store_path, capsys,
                                                  monkeypatch):  # fmt: skip
    """`zephon inspect CACHE`: the stores (builtin, raw with their inputs), a build kept
    after a failure (its finished parts), locks held or free, anything else; sizes; and
    it changes nothing."""
    import fcntl
    import shutil

    from tests.titan.expect import assert_unchanged, tree
    from torchtitan_zephon.ingest import cache_folder
    from torchtitan_zephon.ingest.cache import RawInputs
    from torchtitan_zephon.job.stores import store_location
    from torchtitan_zephon.store.format import StoreError

    monkeypatch.delenv(cache_folder.CACHE_ENV, raising=False)
    root = tmp_path / "cache"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(2):
        (corpus / f"p{k}.jsonl").write_text("".join(
            json.dumps({"text": f"alpha beta {d}"}) + "\n" for d in range(5)))  # fmt: skip
    opts = RawInputs(tokenizer=str(tokenizer_dir), cache_dir=str(root))
    entry = store_location(f"{corpus}/p0.jsonl", opts)
    (corpus / "p1.jsonl").write_text('{"text": "alpha"}\n{"text": broken\n')
    with pytest.raises(StoreError):
        store_location(str(corpus), opts)  # p0 finished, then p1 fails: its build is kept
    shutil.copytree(store_path, root / "builtin-docs-0123456789abcdef")
    (root / "raw-work-0ld.lock").write_text("node-9 pid 9\n")  # left by an older zephon
    (root / "notes.txt").write_text("mine")
    held = open(root / "raw-work-busy.lock", "a+")  # noqa: SIM115
    fcntl.flock(held, fcntl.LOCK_EX)
    held.write("node-3 pid 33\n")
    held.flush()
    try:
        before = tree(root)
        assert main(["inspect", str(root)]) == 0
        out = capsys.readouterr().out
        assert main(["inspect", str(root), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert_unchanged(before, tree(root))
    finally:
        held.close()
    assert out.startswith(f"store cache: {root} (")
    store = TokenStore.open(entry)
    assert f"  stores of raw inputs (1):\n    {entry.name}  " in out
    assert f"{store.num_tokens:,} tokens, fingerprint {store.fingerprint[:16]}, from " \
        f"'{corpus}/p0.jsonl' (text field 'text'; 1 source: p0.jsonl)" in out  # fmt: skip
    assert (
        "  builtin stores (1):\n    builtin-docs-0123456789abcdef  " in out and "part docs" in out
    )
    (building,) = info["building"]
    assert building["name"].startswith(".raw-work-") and building["parts"] == 1
    assert f"    {building['name']}  " in out
    assert "left by a build that failed or was killed (1 finished part of p0.jsonl, " \
        "p1.jsonl): the next run of " \
        "the same inputs continues from it; delete it to start over" in out  # fmt: skip
    assert "    raw-work-busy.lock  " in out and "held by node-3 pid 33" in out
    assert "    raw-work-0ld.lock  13 bytes, free (left by a killed process or an older " \
        "zephon): safe to delete" in out  # fmt: skip
    assert "  other (1):\n    notes.txt  4 bytes" in out
    assert [i["name"] for i in info["raw"]] == [entry.name]
    assert info["raw"][0]["inputs"] == f"{corpus}/p0.jsonl"
    sizes = {p.name: p for p in root.iterdir()}
    assert info["raw"][0]["size_bytes"] == sum(  # the entry and its record
        f.stat().st_size for f in sizes[entry.name].rglob("*") if f.is_file()
    ) + sizes[f"{entry.name}.json"].stat().st_size  # fmt: skip
    assert info["size_bytes"] == sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def test_plan_reads_the_split_of_a_dataset_dict_as_the_trainer_does(
    tmp_path, tokenizer_dir, monkeypatch, capsys
):
    """--split is the trainer's zephon.split: `plan` of raw inputs names the same cache
    entry, so its ids are those of `prepare --split` of the same folder."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict(
                {"text": [f"{name} alpha beta {k}" * 9 for k in range(n)]}
            )
            for name, n in (("train", 40), ("validation", 30))
        }
    ).save_to_disk(str(tmp_path / "dd"))
    query = ["--seq-len", "16", "--global-batch-size", "4", "--seed", "1", "--steps", "1:3",
             "--json"]  # fmt: skip
    for split in ("validation", "all"):
        store = tmp_path / f"store-{split}"
        assert main(["prepare", str(tmp_path / "dd"), "--tokenizer", str(tokenizer_dir),
                     "--output", str(store), "--split", split, "--quiet"]) == 0  # fmt: skip
        capsys.readouterr()
        assert main(["plan", "--store", str(store), *query]) == 0
        expected = capsys.readouterr().out
        raw = ["plan", "--store", str(tmp_path / "dd"), "--tokenizer", str(tokenizer_dir),
               "--split", split, *query]  # fmt: skip
        assert main(raw) == 0
        assert capsys.readouterr().out == expected
    assert main(["plan", "--store", str(tmp_path / "dd"), "--tokenizer", str(tokenizer_dir),
                 "--split", "dev", *query]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "has no split 'dev'" in err and "--split" in err and "Traceback" not in err


def test_prepare_refuses_a_report_it_could_not_write_before_preparing(
    tmp_path, corpus_dir, tokenizer_dir, capsys
):
    for report in (tmp_path / "absent" / "r.json", tmp_path):
        out = tmp_path / "store"
        argv = ["prepare", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--output",
                str(out), "--report", str(report), "--quiet"]  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"zephon prepare: error: --report {report}: ") and "Errno" not in err
        assert not out.exists()


def test_plan_leaves_out_the_ids_of_an_exclude_file_from_its_step(store_path, tmp_path, capsys):
    args = ["plan", "--store", str(store_path), "--seq-len", "8", "--seed", "3", "--json"]
    args += ["--global-batch-size", "4"]
    assert main([*args, "--steps", "1:14"]) == 0
    plain = [json.loads(x)["ids"] for x in capsys.readouterr().out.splitlines()]
    left = plain[3][:2] + plain[6][1:2]  # two ids of step 4, one of step 7
    exclude = tmp_path / "bad.jsonl"
    exclude.write_text(json.dumps({"ids": left, "from_step": 3}) + "\n")
    assert main([*args, "--steps", "1:12", "--exclude", str(exclude)]) == 0
    out = capsys.readouterr()
    got = [json.loads(x)["ids"] for x in out.out.splitlines()]
    assert got[:2] == plain[:2]  # before from_step: unchanged
    flat = [i for step in plain[2:] for i in step if i not in left]
    assert [i for step in got[2:] for i in step] == flat[: 4 * 10]  # deleted, the rest moves up
    assert (
        f"zephon plan: exclude from step 3, leave out 3 sample ids ({', '.join(map(str, sorted(left)))})"
        in out.err
    )
    for text, message in [
        ('{"ids": [1], "from_step": 0}', f"--exclude file {exclude}, line 1: from_step is 0"),
        ('{"ids": [10000000], "from_step": 2}', "line 1: id 10000000 is not a sample of the store"),
        ('{"ids": [1], "from_step": 2, "source": "web"}', 'names "source": "web"'),
        ("not json", "line 1 is not JSON"),
    ]:
        exclude.write_text(text)
        assert main([*args, "--steps", "1:2", "--exclude", str(exclude)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert main([*args, "--steps", "1:2", "--exclude", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read --exclude file" in capsys.readouterr().err


def test_plan_of_a_store_holds_out_its_last_samples_as_the_trainer_does(
    store_path, tmp_path, capsys
):
    """--heldout-samples H with --store: the ids of a job with zephon.heldout_samples H
    (job.settings.store_data: the store's last H samples held out), and a left-out id
    among those held out is refused, as the trainer refuses it."""
    from torchtitan_zephon.job.settings import store_data

    store = TokenStore.open(store_path)
    held = 24
    args = ["plan", "--store", str(store_path), "--seq-len", "8", "--seed", "3", "--json"]
    args += ["--global-batch-size", "4", "--steps", "1:6"]
    assert main([*args, "--heldout-samples", str(held)]) == 0
    got = [json.loads(x)["ids"] for x in capsys.readouterr().out.splitlines()]
    schedule = BatchSchedule.parse("4")
    source = store_data(store, 8, held, schedule, what="the store")
    plan = source.plan(source.data_config(seed=3, schedule=schedule))
    assert got == [plan.global_ids(s).tolist() for s in range(1, 7)]
    assert got != [
        DataPlan(store.num_samples(8), 3, schedule).global_ids(s).tolist() for s in range(1, 7)
    ]
    exclude = tmp_path / "held.jsonl"
    exclude.write_text(json.dumps({"ids": [store.num_samples(8) - 1], "from_step": 2}))
    assert main([*args, "--heldout-samples", str(held), "--exclude", str(exclude)]) == 2
    err = capsys.readouterr().err
    assert "held-out" in err and "Traceback" not in err
    assert main([*args, "--heldout-samples", "2", "--num-samples", "10"]) == 2
    assert "both set how many samples train: give one" in capsys.readouterr().err
    assert main([*args, "--heldout-samples", str(store.num_samples(8))]) == 2
    assert "leaves no training sample" in capsys.readouterr().err
