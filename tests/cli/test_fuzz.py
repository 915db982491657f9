"""Every ``zephon`` subcommand fed malformed arguments and inputs.

Whatever the input, a command ends with a status (1 or 2 for bad input; argparse's
usage error is 2), never a traceback, and its message names the problem. Known bad
inputs are listed with the words the message must contain; Hypothesis then feeds
random bytes as files and random integers and words as arguments. Commands run
in-process (``main(argv)``) for speed; a few subprocess runs check what reaches a
terminal.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import torchtitan_zephon.cli.plan as plan_cli
from torchtitan_zephon.cli.main import main


def run(argv: list[str]) -> tuple[int, str, str]:
    """(status, stdout, stderr) of ``zephon argv``; an escaping exception fails the test."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException:  # noqa: BLE001 - exactly what must never happen
        pytest.fail(f"zephon {argv} raised:\n{traceback.format_exc()}\nstderr: {err.getvalue()}")
    return code, out.getvalue(), err.getvalue()


def assert_refused(argv: list[str], *words: str, code: int = 2) -> str:
    """The command exits ``code`` with ``zephon <cmd>`` and every word in its message."""
    status, out, err = run(argv)
    assert status == code, (argv, status, out, err)
    text = out + err
    assert "Traceback" not in text, text
    if code == 2:
        assert "error: " in err, err
    for word in words:
        assert word in text, (argv, word, text)
    return text


# ----------------------------------------------------------------------------- a zoo of bad paths


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("zoo")

    def put(name: str, data: bytes | str) -> str:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)

    lines = "".join(json.dumps({"text": f"alpha beta {k}", "n": k}) + "\n" for k in range(200))
    (root / "empty-folder").mkdir()
    paths = {
        "missing": str(root / "missing"),
        "empty": put("empty.txt", b""),
        "garbage": put("garbage.bin", bytes(range(256)) * 4),
        "folder": str(root / "empty-folder"),
        "truncated_json": put("cut.json", '[{"text": "alpha"}, {"text": "be'),
        "truncated_jsonl": put("cut.jsonl", lines[:2000].rsplit("\n", 1)[0] + '\n{"text": "be'),
        "truncated_gz": put("cut.jsonl.gz", gzip.compress(lines.encode())[:300]),
        "deep_json": put("deep.json", "[" * 100_000),
        "number_text": put("numbers.jsonl", '{"text": 12}\n'),
        "bad_tokenizer": put("bad-tok/tokenizer.json", b"{not json"),
        "store_garbage": put("store-garbage/manifest.json", bytes(range(256))),
        "store_deep": put("store-deep/manifest.json", "[" * 100_000),
        "store_fields": put(
            "store-fields/manifest.json",
            json.dumps({"format": "zephon-token-store", "version": 1, "fingerprint": 7}),
        ),
        "log_garbage": put("run-garbage/zephon/sequence_log.jsonl", bytes(range(256)) + b"\n{}"),
        "log_deep": put("run-deep/zephon/sequence_log.jsonl", "[" * 100_000 + "\n{}\n"),
        "log_overflow": put(
            "run-overflow/zephon/sequence_log.jsonl", '{"step": 1e400, "chain": "x"}\n'
        ),
    }
    for name in ("store_garbage", "store_deep", "store_fields"):
        paths[name] = str(Path(paths[name]).parent)
    for name in ("log_garbage", "log_deep", "log_overflow"):
        paths[name] = str(Path(paths[name]).parents[1])
    paths["bad_tokenizer"] = str(Path(paths["bad_tokenizer"]).parent)
    paths["root"] = str(root)
    return paths


def _prepare(zoo, inputs, tokenizer, *extra: str, output: str | None = None) -> list[str]:
    out = output or str(Path(zoo["root"]) / "never-written")
    return ["prepare", *inputs, "--tokenizer", tokenizer, "--output", out, "--quiet", *extra]


def test_prepare_refuses_bad_input(zoo, tokenizer_dir, corpus_dir):
    tok = str(tokenizer_dir)
    cases = [
        (_prepare(zoo, [zoo["missing"]], tok), ["missing' does not exist"]),
        (_prepare(zoo, [zoo["empty"]], tok), ["empty corpus"]),
        (_prepare(zoo, [zoo["folder"]], tok), ["empty corpus"]),
        (_prepare(zoo, [zoo["garbage"]], tok), ["garbage.bin looks binary"]),
        (_prepare(zoo, [zoo["truncated_json"]], tok), ["cut.json:1: invalid JSON"]),
        (_prepare(zoo, [zoo["truncated_jsonl"]], tok), ["cut.jsonl:", ": invalid JSON"]),
        (_prepare(zoo, [zoo["truncated_gz"]], tok), ["cut.jsonl.gz: ", "truncated"]),
        (_prepare(zoo, [zoo["deep_json"]], tok), ["deep.json: JSON nested too deeply"]),
        (
            _prepare(zoo, [zoo["number_text"]], tok),
            ["numbers.jsonl:1: field 'text'", "found a number"],
        ),
        (_prepare(zoo, [str(corpus_dir)], zoo["missing"]), ["tokenizer folder", "not exist"]),
        (_prepare(zoo, [str(corpus_dir)], zoo["garbage"]), ["no tokenizer.json found"]),
        (_prepare(zoo, [str(corpus_dir)], zoo["bad_tokenizer"]), ["cannot load tokenizer"]),
        (_prepare(zoo, [str(corpus_dir)], tok, output=zoo["garbage"]), ["already exists"]),
        (_prepare(zoo, [str(corpus_dir)], tok, "--workers", "-1"), ["workers must be in [1,"]),
        (_prepare(zoo, [str(corpus_dir)], tok, "--workers", str(10**12)), ["workers must be"]),
        (_prepare(zoo, [str(corpus_dir)], tok, "--workers", "two"), ["invalid int value"]),
        (_prepare(zoo, [str(corpus_dir)], tok, "--bogus"), ["unrecognized arguments: --bogus"]),
        (["prepare", str(corpus_dir)], ["the following arguments are required"]),
    ]
    for argv, words in cases:
        assert_refused(argv, *words)
    assert not (Path(zoo["root"]) / "never-written").exists()
    assert not list(Path(zoo["root"]).glob(".never-written.*"))
    # the text files were tokenized before the JSONL file failed: their parts are kept
    staging = Path(zoo["root"]) / ".never-written.prepare"
    argv = _prepare(zoo, [str(corpus_dir)], tok, "--text-field", "body")
    assert_refused(argv, "unknown text field", f"finished parts are kept in {staging}")
    assert not (Path(zoo["root"]) / "never-written").exists()
    shutil.rmtree(staging)  # the zoo is shared with other tests


def test_inspect_verify_compare_refuse_bad_input(zoo):
    cases = [
        (["inspect", zoo["missing"]], ["does not exist"], 2),
        (["inspect", zoo["empty"]], ["not something zephon recognises"], 2),
        (["inspect", zoo["store_deep"], "--json"], ["not something zephon recognises"], 2),
        (["inspect", zoo["store_fields"]], ["manifest.json", "invalid field"], 2),
        (["inspect", zoo["log_garbage"]], ["sequence log: unavailable", "log is corrupt"], 0),
        (
            ["inspect", zoo["log_overflow"]],
            ["sequence log: unavailable", "wrong type", "corrupt"],
            0,
        ),
        (["inspect", "--bogus", zoo["empty"]], ["unrecognized arguments"], 2),
        (["verify", zoo["missing"], zoo["missing"]], ["does not exist"], 2),
        (["verify", zoo["empty"], zoo["empty"]], ["NO OVERLAP", "0 effective records"], 1),
        (["verify", zoo["folder"], zoo["folder"]], ["no sequence log"], 2),
        (
            ["verify", zoo["log_garbage"], zoo["log_garbage"]],
            ["not valid JSON", "the log is corrupt"],
            2,
        ),
        (
            ["verify", zoo["log_deep"], zoo["log_deep"]],
            ["nested too deeply", "the log is corrupt"],
            2,
        ),
        (
            ["verify", zoo["log_overflow"], zoo["log_garbage"]],
            ["wrong type", "the log is corrupt"],
            2,
        ),
        (
            ["verify", zoo["deep_json"], zoo["deep_json"]],
            ["deep.json:1: JSON nested too deeply", "the log is corrupt"],
            2,
        ),
        (
            ["verify", zoo["log_deep"]],
            ["nested too deeply", "the log is corrupt"],
            2,
        ),  # one run: its log alone
        (["compare", zoo["missing"], zoo["missing"]], ["missing"], 2),
        (["compare", zoo["garbage"], zoo["garbage"]], ["does not exist"], 2),
        (["compare", zoo["folder"], zoo["folder"]], ["no losses"], 2),
        (["compare", zoo["folder"]], ["at least two runs"], 2),
        (["compare", zoo["folder"], zoo["folder"], "--rtol", "nan"], ["finite and >= 0"], 2),
        (["compare", zoo["folder"], zoo["folder"], "--atol", "-1"], ["finite and >= 0"], 2),
        (["compare", zoo["folder"], zoo["folder"], "--rtol", "x"], ["invalid float value"], 2),
    ]
    for argv, words, code in cases:
        assert_refused(argv, *words, code=code)


def test_show_where_spikes_refuse_bad_input(zoo):
    cases = [
        (["show", zoo["missing"], "--step", "1"], ["does not exist: expected a run folder"]),
        (["show", zoo["folder"], "--step", "1"], ["needs --seq-len, --global-batch-size, --seed"]),
        (["show", zoo["log_garbage"], "--step", "1"], ["no start or resume event with a data config"]),
        (["show", zoo["log_deep"], "--step", "1"], ["sequence log"]),
        (["show", zoo["log_overflow"], "--step", "1"], ["no start or resume event with a data config"]),
        (["show", zoo["store_garbage"], "--seq-len", "8", "--global-batch-size", "4",
          "--seed", "1", "--step", "1"], ["manifest.json"]),
        (["show", "--step", "1"], ["needs a run folder or a store"]),
        (["where", zoo["log_garbage"], "--doc", "1"], ["no start or resume event"]),
        (["where", zoo["store_fields"], "--seq-len", "8", "--global-batch-size", "4",
          "--seed", "1", "--doc", "0"], ["invalid field"]),
        (["spikes", zoo["missing"]], ["does not exist"]),
        (["spikes", zoo["folder"]], ["no TensorBoard events under"]),
        (["spikes", zoo["folder"], "--k", "0"], ["finite number > 0"]),
        (["spikes", zoo["folder"], "--window", "2"], ["an integer >= 5"]),
    ]  # fmt: skip
    for argv, words in cases:
        assert_refused(argv, *words)


def test_plan_refuses_bad_input(zoo, store_path):
    def plan(store: str, *extra: str) -> list[str]:
        base = ["plan", "--store", store, "--seq-len", "8", "--seed", "1", "--steps", "1:2"]
        return [*base, "--global-batch-size", "4", *extra]

    cases = [
        (plan(zoo["missing"]), ["missing' does not exist"]),
        (plan(zoo["garbage"]), ["is a file, expected a folder"]),
        (plan(zoo["folder"]), ["has no manifest.json"]),
        (plan(zoo["store_garbage"]), ["cannot read", "manifest.json"]),
        (plan(zoo["store_deep"]), ["cannot read", "maximum recursion depth"]),
        (plan(zoo["store_fields"]), ["invalid field"]),
        (plan(str(store_path), "--global-batch-size", str(10**12)), ["at most 1000000000"]),
        (plan(str(store_path), "--global-batch-size", "-4"), ["must be >= 1, found -4"]),
        (plan(str(store_path), "--dp-degree", "3"), ["DP degrees that work"]),
        (plan(str(store_path), "--dp-rank", "5", "--dp-degree", "2"), ["must be below"]),
        (plan(str(store_path), "--seq-len", "-1"), ["--seq-len: expected an integer >= 1"]),
        (  # a store shorter than seq_len + 1 tokens (issue 18: it said "samples [0, 0)")
            plan(str(store_path), "--seq-len", str(10**30)),
            [f"a sample of seq_len {10**30} needs seq_len + 1", "holds no sample", "--seq-len "],
        ),
        (plan(str(store_path), "--steps", "2:1"), ["expected 1 <= FIRST <= LAST"]),
        (plan(str(store_path), "--steps", "one:two"), ["expected FIRST:LAST"]),
        (plan(str(store_path), "--seed", "0x10"), ["invalid int value"]),
        (plan(str(store_path), "--bogus", "1"), ["unrecognized arguments"]),
    ]
    for argv, words in cases:
        assert_refused(argv, *words)


def test_bench_refuses_bad_arguments():
    """Refused before any suite starts (the suites themselves are slow)."""
    cases = [
        (["bench", "nothing"], ["invalid choice: 'nothing'"]),
        (["bench", "loader", "--quick", "--seconds", "-1"], ["finite number > 0"]),
        (["bench", "loader", "--quick", "--seconds", "inf"], ["finite number > 0"]),
        (["bench", "loader", "--quick", "--batch", "0"], ["--batch: expected an integer >= 1"]),
        (["bench", "loader", "--quick", "--workers", "-2"], ["--workers: expected an integer"]),
        (["bench", "step", "--quick", "--nproc", "0"], ["--nproc: expected an integer in [1,"]),
        (["bench", "step", "--quick", "--nproc", str(10**9)], ["--nproc: expected an integer"]),
        (["bench", "step", "--quick", "--steps", "-5"], ["--steps: expected an integer >= 1"]),
        (["bench", "step", "--quick", "--levels", "loud"], ["unknown audit levels ['loud']"]),
        (["bench", "loader", "--quick", "--bogus"], ["unrecognized arguments"]),
    ]
    for argv, words in cases:
        assert_refused(argv, *words)
    assert_refused(["unknown-command"], "invalid choice: 'unknown-command'")
    assert_refused([], "the following arguments are required: COMMAND")


# ----------------------------------------------------------------------------- Hypothesis

# 100 examples per property keep the file near 30 s; ZEPHON_FUZZ_EXAMPLES=2000 digs deeper.
FUZZ = settings(
    max_examples=int(os.environ.get("ZEPHON_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_records = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
_jsonl = st.lists(
    st.one_of(
        st.fixed_dictionaries({"text": _records}),
        st.fixed_dictionaries({"text": st.text(max_size=50)}),
        _records,
    ),
    max_size=8,
).map(lambda rs: "".join(json.dumps(r) + "\n" for r in rs).encode())
_file_bytes = st.one_of(
    st.binary(max_size=3000),
    _jsonl,
    _jsonl.map(lambda b: b[: len(b) // 2]),  # cut short
    st.tuples(_jsonl, st.integers(0, 400)).map(lambda t: gzip.compress(t[0])[: t[1] or None]),
    st.text(max_size=300).map(str.encode),
)


@FUZZ
@given(
    data=_file_bytes, suffix=st.sampled_from([".txt", ".jsonl", ".jsonl.gz", ".json", ".parquet"])
)
def test_prepare_random_files(tmp_path, tokenizer_dir, data, suffix):
    """Random bytes under every input kind's name: a store or a refusal naming the file."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example
    (folder / f"input{suffix}").write_bytes(data)
    out = folder / "out"
    code, _, err = run(
        _prepare(
            {},
            [str(folder / f"input{suffix}")],
            str(tokenizer_dir),
            "--workers",
            "1",
            output=str(out),
        )
    )
    assert "Traceback" not in err
    if code == 0:
        assert (out / "manifest.json").is_file()
    else:
        assert code == 2 and err.startswith("zephon prepare: error: "), err
        assert f"input{suffix}" in err or "empty corpus" in err, err
        assert not out.exists()
    assert not list(folder.glob(".out.*"))


_manifest_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(10**40), 10**40),
    st.floats(),
    st.text(max_size=10),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from(["vocab_size", "sha256", "eos_token"]), st.integers()),
)
_MANIFEST_KEYS = ["format", "version", "fingerprint", "dtype", "eos_id", "num_tokens",
                  "num_documents", "tokenizer", "sources", "text_field"]  # fmt: skip


@FUZZ
@given(
    changes=st.dictionaries(st.sampled_from(_MANIFEST_KEYS), _manifest_values, min_size=1),
    dropped=st.lists(st.sampled_from(_MANIFEST_KEYS), max_size=2),
    refingerprint=st.booleans(),
    raw=st.none() | st.binary(max_size=300),
)
def test_inspect_and_plan_random_stores(tmp_path, store_path, changes, dropped, refingerprint, raw):
    """The real store with its manifest edited (fields changed or dropped, the fingerprint
    recomputed or not) or replaced by random bytes: inspect and plan refuse it clearly."""
    from torchtitan_zephon.store.format import manifest_fingerprint

    store = Path(tempfile.mkdtemp(dir=tmp_path)) / "store"
    shutil.copytree(store_path, store)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest.update(changes)
    for key in dropped:
        manifest.pop(key, None)
    if refingerprint:
        manifest["fingerprint"] = manifest_fingerprint(manifest)
    text = json.dumps(manifest).encode() if raw is None else raw
    (store / "manifest.json").write_bytes(text)
    code, out, err = run(["inspect", str(store)])
    argv = ["plan", "--store", str(store), "--seq-len", "4", "--global-batch-size", "2"]
    plan_code, plan_out, plan_err = run([*argv, "--seed", "0", "--steps", "1:1"])
    if code == 0:  # an edit that keeps the store valid (e.g. the same value, or text_field)
        assert plan_code == 0, plan_err
        return
    assert code == 2 and "zephon inspect: error: " in err, (out, err)
    assert plan_code == 2 and "zephon plan: error: " in plan_err and str(store) in plan_err


_log_lines = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"step": _manifest_values, "chain": _manifest_values, "ids_digest": _manifest_values}
        ),
        st.fixed_dictionaries(
            {"event": st.sampled_from(["start", "resume", "other"]), "from_step": _manifest_values}
        ),
        _records,
    ).map(json.dumps),
    max_size=6,
)


@FUZZ
@given(lines=_log_lines, cut=st.integers(0, 50), raw=st.binary(max_size=200))
def test_verify_and_inspect_random_logs(tmp_path, lines, cut, raw):
    """Random sequence logs: verify and inspect report, refuse or compare; never crash."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp_path))
    (run_dir / "zephon").mkdir()
    text = "\n".join(lines).encode()
    (run_dir / "zephon" / "sequence_log.jsonl").write_bytes(text[: len(text) - cut] + raw)
    code, out, err = run(["verify", str(run_dir), str(run_dir), "--json"])
    assert code in (0, 1, 2), (code, out, err)
    if code == 2:
        assert err.startswith("zephon verify: error: ") and str(run_dir) in err, err
    else:
        # a log equals itself, unless the log itself does not verify (or is of format 1)
        assert json.loads(out)["verdict"] in ("match", "no-overlap", "corrupt", "unbound")
    code, out, err = run(["inspect", str(run_dir), "--json"])
    assert code == 0 and json.loads(out)["kind"] == "run", (out, err)


_configs = st.dictionaries(
    st.sampled_from(["seq_len", "seed", "schedule", "num_samples", "store_fingerprint",
                     "tokenizer_hash", "skip_steps", "mixture", "sample_offset", "order_format"]),
    st.one_of(st.integers(-3, 10**20), st.text(max_size=5), st.none(),
              st.lists(st.lists(st.integers(-2, 9), max_size=3), max_size=3),
              st.dictionaries(st.sampled_from(["format", "sources", "schedule"]), st.integers())),
)  # fmt: skip


@FUZZ
@given(config=_configs, step=st.integers(-2, 10**12))
@example(config={"seq_len": 0, "seed": 0, "sample_offset": 2**63}, step=1)
@example(config={"sample_offset": (1 << 40) - 88}, step=1)  # past the sample id space
def test_show_and_where_random_data_configs(tmp_path, config, step):
    """A start event holding a random data config: show and where refuse it in a line."""
    base = {"seq_len": 8, "seed": 1, "schedule": [[1, 4]], "num_samples": 100,
            "store_fingerprint": "f", "tokenizer_hash": "t"}  # fmt: skip
    run_dir = Path(tempfile.mkdtemp(dir=tmp_path))
    (run_dir / "zephon").mkdir()
    event = {"event": "start", "from_step": 0, "chain": "x", "data_config": {**base, **config}}
    (run_dir / "zephon" / "sequence_log.jsonl").write_text(json.dumps(event) + "\n")
    for argv in (
        ["show", str(run_dir), "--step", str(step)],
        ["where", str(run_dir), "--doc", "0"],
    ):
        code, out, err = run(argv)
        assert code in (0, 2), (code, out, err)
        if code == 2:
            assert err.startswith(f"zephon {argv[0]}: error: ") and err.count("\n") == 1, err


_ints = st.one_of(st.integers(-3, 40), st.integers(-(10**30), 10**30))


@FUZZ
@given(
    seq_len=_ints, gbs=_ints, seed=_ints, first=_ints, span=st.integers(0, 3), degree=_ints,
    rank=st.none() | _ints, local=st.none() | _ints, offset=st.none() | _ints, count=st.none() | _ints,
)  # fmt: skip
def test_plan_random_integers(
    store_path, seq_len, gbs, seed, first, span, degree, rank, local, offset, count
):
    """Any integers: the ids of the steps, or a usage / value error naming the argument."""
    argv = ["plan", "--store", str(store_path), "--seq-len", str(seq_len), "--seed", str(seed)]
    argv += ["--global-batch-size", str(gbs), "--steps", f"{first}:{first + span}", "--json"]
    argv += ["--dp-degree", str(degree)]
    for flag, value in (
        ("--dp-rank", rank),
        ("--local-batch-size", local),
        ("--sample-offset", offset),
        ("--num-samples", count),
    ):
        if value is not None:
            argv += [flag, str(value)]
    with mock.patch.object(plan_cli, "MAX_IDS_PER_STEP", 10_000):
        code, out, err = run(argv)
    if code == 0:
        lines = [json.loads(x) for x in out.splitlines()]
        assert [x["step"] for x in lines] == list(range(first, first + span + 1))
    else:
        assert code == 2 and "zephon plan: error: " in err, err


_words = st.one_of(
    st.sampled_from(
        ["--json", "--store", "--seq-len", "--steps", "--seed", "--global-batch-size", "--dp-rank",
         "--dp-degree", "--rtol", "--atol", "--plot", "-h", "--", "-", "1:2", "0", "-1", "1e9", "",
         "--step", "--doc", "--epochs", "--sample", "--k", "--window", "--max-chars", "--mixture"]
    ),
    st.from_regex(r"[a-z0-9:,._-]{1,10}", fullmatch=True).filter(lambda w: not w.startswith("..")),
)  # fmt: skip


@FUZZ
@given(
    command=st.sampled_from(["inspect", "plan", "show", "where", "spikes", "verify", "compare"]),
    words=st.lists(_words, max_size=8),
)
def test_random_words(tmp_path_factory, command, words):
    """Random argument lists (relative names only, in an empty folder)."""
    cwd = tmp_path_factory.mktemp("words")
    before = os.getcwd()
    os.chdir(cwd)
    try:
        code, out, err = run([command, *words])
    finally:
        os.chdir(before)
    assert code in (0, 1, 2), (code, err)
    if code != 0:
        assert "error: " in err or "verdict" in out, (command, words, out, err)
    assert list(cwd.iterdir()) == [] or "--plot" in words


# ----------------------------------------------------------------------------- at a terminal


@pytest.mark.parametrize(
    "argv, words",
    [
        (["prepare", "{truncated_gz}", "--tokenizer", "{tok}", "--output", "{root}/x"], ["truncated"]),
        (["plan", "--store", "{store_deep}", "--seq-len", "8", "--global-batch-size", "4",
          "--seed", "1", "--steps", "1:1"], ["cannot read"]),
        (["verify", "{log_overflow}", "{log_deep}"], ["corrupt"]),
        (["bench", "step", "--nproc", "0"], ["--nproc"]),
    ],
)  # fmt: skip
def test_no_traceback_reaches_the_terminal(zoo, tokenizer_dir, argv, words):
    names = {**zoo, "tok": str(tokenizer_dir)}
    argv = [a.format(**names) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_zephon", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"zephon {argv[0]}: error: " in proc.stderr and all(w in proc.stderr for w in words)
