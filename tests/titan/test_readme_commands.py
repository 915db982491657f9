"""Every command of the README and the guides in docs/ runs as written (issue 28, item 8).

Each ```bash block is read as a shell would (continuation lines joined, comments and
`;` / `&&` / `|` split): a `zephon` command is parsed by zephon's own parser; a training
command (`./run_train.sh`, `torchrun ... -m torchtitan_zephon.train`) is parsed as the
trainer parses it (the TOML front end or a registry job) and checked as the trainer
checks it before building anything (the parallelism degrees against its ranks, the
chunked loss, every batch of the schedule over DP ranks x micro-batches). The ones
that train run for 2 steps under `-m slow`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.titan.launch import REPO, job_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SEPARATORS = {";", "&&", "||", "|", "&"}
ZEPHON = {"zephon", ".venv/bin/zephon"}
PYTHONS = {"python", "python3", ".venv/bin/python"}


@dataclass
class Command:
    where: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def commands() -> list[Command]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
            first = text.count("\n", 0, m.start()) + 2
            lines = m.group(1).replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
                lexer.whitespace_split = True
                lexer.commenters = "#"
                argv: list[str] = []
                for token in [*lexer, ";"]:
                    if token not in SEPARATORS:
                        argv.append(token)
                        continue
                    env = {}
                    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                        key, _, value = argv.pop(0).partition("=")
                        env[key] = value
                    if argv:
                        out.append(Command(f"{doc.name}:{first + i}", argv, env))
                    argv = []
    return out


def zephon_args(c: Command) -> list[str] | None:
    """The arguments of a `zephon` command (also `python -m torchtitan_zephon`, under
    torchrun too), else None."""
    argv = c.argv
    if argv[0] in ZEPHON:
        return argv[1:]
    if "-m" in argv and argv[0] in (*PYTHONS, "torchrun"):
        i = argv.index("-m")
        if argv[i + 1] == "torchtitan_zephon":
            return argv[i + 2 :]
    return None


@dataclass
class Training:
    args: list[str]
    nproc: int
    nnodes: int


def training(c: Command) -> Training | None:
    """A training command: its trainer arguments (the TOML file run_train.sh adds) and
    its processes per node and nodes."""
    argv = c.argv
    if argv[0] == "./run_train.sh":
        args = argv[1:]
        if not any(a.split("=")[0] in ("--module", "--config") for a in args):
            config = c.env.get("CONFIG_FILE", "train_configs/debug_model.toml")
            args = ["--job.config_file", config, *args]
        return Training(args, int(c.env.get("NGPU", "2")), int(c.env.get("NNODES", "1")))
    if argv[0] == "torchrun" and "torchtitan_zephon.train" in argv:
        i = argv.index("torchtitan_zephon.train")
        launcher = argv[:i]
        nproc = nnodes = 1
        for j, a in enumerate(launcher):
            key, eq, value = a.partition("=")
            value = value if eq else (launcher[j + 1] if j + 1 < len(launcher) else "")
            if key in ("--nproc_per_node", "--nproc-per-node"):
                nproc = int(value)
            elif key == "--nnodes":
                nnodes = int(value)
        return Training(argv[i + 1 :], nproc, nnodes)
    return None


ALL = commands()
ZEPHON_COMMANDS = [c for c in ALL if zephon_args(c) is not None and "..." not in c.argv]
TRAINING = [c for c in ALL if training(c) is not None]


def test_the_docs_hold_the_commands_this_test_reads():
    assert len(ZEPHON_COMMANDS) >= 10 and len(TRAINING) >= 10
    assert any("llama3_debugmodel" in c.argv for c in TRAINING)


@pytest.mark.parametrize("command", ZEPHON_COMMANDS, ids=str)
def test_each_zephon_command_parses(command: Command, capsys):
    from torchtitan_zephon.cli.main import build_parser

    try:
        build_parser().parse_args(zephon_args(command))
    except SystemExit:
        pytest.fail(f"{command}: {capsys.readouterr().err}")


def _parse(args: list[str]):
    from torchtitan_zephon.titan import platform

    platform.apply()
    from torchtitan_zephon.configs.command_line import option_name
    from torchtitan_zephon.train import parse_config, parse_toml, toml_front_end

    config = parse_toml(args) if toml_front_end(args) else parse_config(args)
    return config, any(option_name(a) == "loss.num_chunks" for a in args)


@pytest.mark.parametrize("command", TRAINING, ids=str)
def test_each_training_command_passes_the_trainers_checks(
    command: Command, monkeypatch: pytest.MonkeyPatch
):
    from torchtitan_zephon.titan.settings.job_view import batch_schedule, job_view
    from torchtitan_zephon.titan.settings.loss_chunks import fit_loss_chunks
    from torchtitan_zephon.titan.start.checks import check_job_config

    t = training(command)
    assert t is not None
    # the user's own TOML job: its options are checked on the default job's TOML, its
    # batch sizes are the user's
    own_job = "JOB.toml" in t.args
    t.args = [str(REPO / "train_configs/debug_model.toml") if a == "JOB.toml" else a
              for a in t.args]  # fmt: skip
    monkeypatch.chdir(REPO)  # relative paths are the repository's, as the docs run them
    world = t.nproc * t.nnodes
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        config, explicit = _parse(t.args)
        fit_loss_chunks(config, explicit=explicit)
        job = job_view(config)
        check_job_config(job, world_size=world)
        dp = job.dp_degree(world)
        assert dp is not None, "TorchTitan's parallel dims refuse the degrees"
        if not own_job:
            batch_schedule(job).check_layout(dp, job.local_batch_size)
    except (ValueError, SystemExit) as e:
        pytest.fail(f"{command}: {e}")


PLACEHOLDER = re.compile(r"^(STORE|JOB\.toml|\$\w+|s3://.*|/data/.*|/models/.*)$")


def _runnable(c: Command) -> bool:
    """A training command that runs on its own: one node, no placeholder, not a step of
    a walkthrough that resumes the run an earlier command trained, not a torchft replica
    group (it needs its lighthouse and its peers: tests/titan/test_ft_e2e.py trains them)."""
    t = training(c)
    return (
        t is not None
        and t.nnodes == 1
        and not any(PLACEHOLDER.match(a) for a in t.args)
        and "--checkpoint.load_step" not in t.args
        and "--fault_tolerance.enable" not in t.args
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in TRAINING if _runnable(c)], ids=str)
def test_each_training_command_trains_two_steps(command: Command, tmp_path: Path):
    """As written, with its dump folder in a temporary folder and 2 steps (one process
    per rank on CPU)."""
    import subprocess
    import sys

    t = training(command)
    assert t is not None
    registry = any(a.split("=")[0] in ("--module", "--config") for a in t.args)
    folder = "--dump_folder" if registry else "--job.dump_folder"
    args = [*t.args, folder, str(tmp_path / "run"), "--training.steps", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={t.nproc}", "-m", "torchtitan_zephon.train", *args],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"{command}\n{(proc.stdout + proc.stderr)[-4000:]}"
