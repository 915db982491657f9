"""The launchers: relative command-line paths are taken from the user's folder, and a
refused or stopped job ends with its Zephon message (through ``run_train.sh``: as the
last line, torchrun's exit status kept; through torchrun directly: as torchrun's root
cause, no traceback from a worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.titan.launch import REPO, TINY, job_env, train
from torchtitan_zephon.configs.toml_front import translate
from torchtitan_zephon.train import resolve_paths

PACKAGE = str(REPO / "torchtitan_zephon")


# ---------------------------------------------------------------- resolve_paths


def test_relative_path_options_are_joined_to_the_launch_folder(tmp_path: Path):
    base = tmp_path / "me"
    argv = [
        "--job.dump_folder", "rel_out",
        "--job.config-file=my.toml",
        "--model.hf_assets_path", "./tok",
        "--zephon.mixture=mixes/m.toml",
        "--zephon.cache-dir", "cache",
        "--checkpoint.initial_load_path", "old/step-10",
    ]  # fmt: skip
    assert resolve_paths(argv, base) == [
        "--job.dump_folder", str(base / "rel_out"),
        f"--job.config-file={base / 'my.toml'}",
        "--model.hf_assets_path", str(base / "tok"),
        f"--zephon.mixture={base / 'mixes/m.toml'}",
        "--zephon.cache-dir", str(base / "cache"),
        "--checkpoint.initial_load_path", str(base / "old/step-10"),
    ]  # fmt: skip


def test_a_relative_left_out_list_is_joined_to_the_launch_folder(tmp_path: Path):
    """zephon.exclude names a file the trainer opens: from the user's folder, as the store."""
    argv = ["--zephon.exclude", "left_out.jsonl", "--zephon.exclude=", "--training.steps", "3"]
    assert resolve_paths(argv, tmp_path) == [
        "--zephon.exclude", str(tmp_path / "left_out.jsonl"),
        "--zephon.exclude=", "--training.steps", "3",
    ]  # fmt: skip


def test_absolute_empty_and_dump_relative_values_stay(tmp_path: Path):
    argv = [
        "--job.dump_folder", "/abs/run",
        "--zephon.cache_dir=",
        "--checkpoint.folder", "ck",  # TorchTitan: inside the dump folder
        "--metrics.save_tb_folder", "tb",
        "--training.steps", "3",
        "--validation.no-enable",
    ]  # fmt: skip
    assert resolve_paths(argv, tmp_path) == argv


def test_store_values_builtin_globs_and_comma_lists(tmp_path: Path):
    base = tmp_path
    (base / "one.txt").write_text("x")
    assert resolve_paths(["--zephon.store", "builtin:docs"], base)[1] == "builtin:docs"
    assert resolve_paths(["--zephon.store=data/*.jsonl"], base) == [
        f"--zephon.store={base / 'data/*.jsonl'}"
    ]
    listed = resolve_paths(["--zephon.store", "one.txt,/abs/two.jsonl, sub/*.parquet"], base)[1]
    assert listed.split(",") == [
        str(base / "one.txt"),
        "/abs/two.jsonl",
        str(base / "sub/*.parquet"),
    ]


def test_only_the_last_config_file_is_read(tmp_path: Path):
    """run_train.sh passes CONFIG_FILE before the user's arguments: a later
    --job.config_file replaces it (the earlier one is not even opened)."""
    (tmp_path / "b.toml").write_text("[training]\nsteps = 5\n")
    argv = ["--job.config_file", str(tmp_path / "a.toml"), "--training.seq_len", "32",
            f"--job.config-file={tmp_path / 'b.toml'}"]  # fmt: skip
    t = translate(argv)
    assert t.config_file == str(tmp_path / "b.toml")
    assert t.values() == {"training.steps": 5, "training.seq_len": "32"}


# ---------------------------------------------------------------- run_train.sh


def run_train_sh(cwd: Path, *args: str, nproc: int = 2, **env: str) -> subprocess.CompletedProcess:
    """``run_train.sh`` as a user runs it from ``cwd``, with this Python's torchrun."""
    e = job_env()
    e.update(
        ZEPHON_NO_VENV="1",
        NGPU=str(nproc),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}",
        CONFIG_FILE=str(TINY),
    )
    e.update(env)
    return subprocess.run(
        [str(REPO / "run_train.sh"), *args],
        cwd=cwd,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def test_run_train_refusal_is_the_last_line_with_the_users_folder(tmp_path: Path):
    """A missing relative store typed in the user's folder: the refusal names the
    absolute path there and is the last line, after torchrun's summary; exit status 1."""
    me = tmp_path / "me"
    me.mkdir()
    proc = run_train_sh(me, "--job.dump_folder", "rel_out", "--zephon.store", "missing_rel")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "ChildFailedError" in proc.stdout  # torchrun's summary came first
    assert last_line(proc.stdout) == (
        f"Zephon refused to start: StartRefused: token store '{me / 'missing_rel'}' does not "
        "exist; expected a folder made by `zephon prepare INPUT... --tokenizer DIR --output "
        "STORE`, or raw inputs to prepare on first use: a text/JSONL/Parquet file, a folder of "
        "them, a glob pattern or a comma-separated list."
    )
    assert not (me / "rel_out").exists() and not (REPO / "rel_out").exists()  # nothing written


def test_an_unknown_option_is_one_line_with_the_spelling_that_works(tmp_path: Path):
    """--job.save_config_file (0.2.2's) with a Python config: one line naming the 0.3
    spelling, printed last after torchrun's summary, no tyro box, nothing written."""
    proc = run_train_sh(tmp_path, "--module", "torchtitan_zephon.configs", "--config",
                        "llama3_tiny", "--dump_folder", "run", "--job.save_config_file",
                        "config.json", nproc=1)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "ChildFailedError" in proc.stdout and "Unrecognized options" not in proc.stdout
    assert last_line(proc.stdout) == (
        "Zephon refused to start: unknown option --job.save_config_file: the job's config has "
        "no job.save_config_file; did you mean --debug.save_config_file? (TorchTitan 0.3 "
        "spellings with --module / --config)"
    )
    assert not (tmp_path / "run").exists()


def test_unknown_options_name_the_closest_spelling():
    from torchtitan_zephon.configs.config_registry import llama3_tiny
    from torchtitan_zephon.train import unknown_options

    config = llama3_tiny()
    assert unknown_options(["--training.steps", "3", "--debug.no-deterministic",
                            "--zephon.store=x", "--dump-folder", "d"], config) is None  # fmt: skip
    msg = unknown_options(["--training.steps", "3", "--trainning.seq_len", "9"], config)
    assert msg is not None and msg.startswith("unknown option --trainning.seq_len: ")
    assert msg.endswith("did you mean --training.seq_len? (TorchTitan 0.3 spellings with "
                        "--module / --config)")  # fmt: skip
    msg = unknown_options(["--zzz.qqq=1"], config)
    assert msg is not None and "`--help` lists the options" in msg
    # an option of a subcommand-chosen type (activation_checkpoint is None here): not ours
    # to call unknown
    assert config.activation_checkpoint is None
    assert unknown_options(["--activation-checkpoint.mode", "full"], config) is None


def test_run_train_missing_config_file_names_the_path_it_looked_at(tmp_path: Path):
    proc = run_train_sh(tmp_path, nproc=1, CONFIG_FILE="nope.toml")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert last_line(proc.stdout).startswith(
        f"Zephon refused to start: --job.config_file {tmp_path / 'nope.toml'} is not a file"
    )
    assert "FileNotFoundError" not in proc.stdout


def test_run_train_relative_paths_from_another_folder(tmp_path: Path):
    """From the user's folder: a relative CONFIG_FILE, dump folder and raw-input store
    resolve there; the TOML's relative tokenizer path still resolves in the repository."""
    me = tmp_path / "me"
    me.mkdir()
    (me / "my.toml").write_text(TINY.read_text())
    text = (REPO / "README.md").read_text()
    (me / "corpus.txt").write_text(text * (1 + 40_000 // len(text)))
    proc = run_train_sh(
        me,
        "--job.dump_folder", "rel_out",
        "--zephon.store", "corpus.txt",
        "--training.steps", "1",
        "--validation.no-enable",
        "--checkpoint.no-enable",
        nproc=1,
        CONFIG_FILE="my.toml",
        ZEPHON_CACHE=str(tmp_path / "cache"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    log = me / "rel_out" / "zephon" / "sequence_log.jsonl"
    assert log.is_file(), sorted(p.name for p in me.iterdir())
    assert str(me / "corpus.txt") in proc.stdout  # the store was found in the user's folder
    assert not (REPO / "rel_out").exists()


def test_store_changed_mid_run_stops_with_one_line_even_from_a_filtered_rank(tmp_path: Path):
    """A token edited in ``tokens.bin`` read only by rank 1, whose output run_train.sh
    filters out (LOG_RANK=0): rank 1 stops with one message, which is the last line."""
    from tests.conftest import copy_store, edit_token
    from torchtitan_zephon.ingest.builtin import builtin_store_path
    from torchtitan_zephon.order.layout import BatchSchedule
    from torchtitan_zephon.order.stream import DataPlan
    from torchtitan_zephon.store.format import CHUNK_TOKENS
    from torchtitan_zephon.store.reader import TokenStore

    store = copy_store(builtin_store_path(), tmp_path / "store")
    seq = 64  # tiny.toml: seq_len 64, gbs 8, heldout 16; 2 ranks
    num_samples = TokenStore.open(store).num_samples(seq) - 16
    plan = DataPlan(num_samples, 0, BatchSchedule([(1, 8)]))
    rank0 = {int(s) * seq // CHUNK_TOKENS for t in (1, 2, 3) for s in plan.rank_ids(t, 0, 2)}
    rank0 |= {(num_samples + i) * seq // CHUNK_TOKENS for i in range(16)}  # validation
    sample = next(
        int(s) for s in plan.rank_ids(1, 1, 2) if int(s) * seq // CHUNK_TOKENS not in rank0
    )
    token = sample * seq + 10
    edit_token(store, token)
    proc = run_train_sh(
        tmp_path, "--job.dump_folder", str(tmp_path / "run"), "--zephon.store", str(store),
        "--training.steps", "2",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:]
    shown = [line for line in proc.stdout.splitlines() if line.startswith("[rank0]:")]
    assert shown and not any("Zephon stopped" in line for line in shown)  # rank 1 failed
    last = last_line(proc.stdout)
    assert last.startswith("Zephon stopped at step 1: StoreError: token store "), last
    assert last.endswith("(the data of step 1 could not be read)"), last
    assert f"chunk {token // CHUNK_TOKENS} of tokens.bin" in last and str(store) in last
    assert f'File "{PACKAGE}' not in proc.stdout.split("Root Cause")[-1]


# ---------------------------------------------------------------- torchrun directly


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--zephon.store", "missing_store"), "Zephon refused to start: StartRefused: token store"),
        pytest.param(
            ("--parallelism.tensor_parallel_degree", "3"),
            "Zephon refused to start: ValueError: the job has 2 ranks, which is not a multiple",
            marks=pytest.mark.slow,  # the checks' refusal path: tests/titan/test_checks.py
            id="tp3",  # (issue 44 part e)
        ),
    ],
)
def test_torchrun_directly_names_the_refusal_as_root_cause(tmp_path: Path, args, message):
    """torchrun's failure summary shows the worker's message where it said "To enable
    traceback see: ..."; no traceback passes through Zephon's code."""
    job = train(tmp_path / "run", 2, *args, log=tmp_path / "train.log")
    assert job.returncode == 1, job.output[-3000:]
    root_cause = job.output.split("Root Cause (first observed failure):")[-1]
    assert f"traceback : {message}" in root_cause, root_cause
    assert "To enable traceback see" not in job.output
    assert f'File "{PACKAGE}' not in job.output, job.output[-3000:]
    assert not (tmp_path / "run").exists()
