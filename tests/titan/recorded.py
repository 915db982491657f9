"""Jobs and plans whose results were recorded on main before the house refactor (issue 19).

``tests/titan/recorded_main/`` holds, for each job below, the sequence log of a run made on
main at 2 ranks (``python -m tests.titan.recorded`` made them), plus ``plans.json``: store fingerprints and
``zephon plan`` output at near and far steps. ``test_recorded.py`` rebuilds the same
inputs, trains them on the code under test at 1 rank and asks ``zephon verify`` for
MATCH against the recorded logs: a refactor or a port that moves any sample, digest,
fingerprint or the data config fails it.

Every input is a pure function of this file: the corpus is generated from sha256 of a
counter (no Python-version-dependent text), the mixture file is a literal.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "recorded_main"

WORDS = (
    "store sample position step slice batch window source stream schedule plan token "
    "epoch seed rank node loss resume proof chain digest order shuffle mixture weight "
    "the a of to and in is it that for on with as was at by an be this from or"
).split()


def corpus_lines(documents: int = 240) -> list[str]:
    """Deterministic documents of 40-160 words each (~30k tokens in all)."""
    lines = []
    for d in range(documents):
        h = hashlib.sha256(f"doc-{d}".encode()).digest()
        n = 40 + h[0] % 121
        words = []
        for i in range(n):
            w = hashlib.sha256(f"{d}:{i}".encode()).digest()
            words.append(WORDS[w[0] % len(WORDS)] + ("." if w[1] % 11 == 0 else ""))
        lines.append(json.dumps({"text": " ".join(words), "id": d}))
    return lines


def write_raw(folder: Path) -> Path:
    """The raw-input job's corpus: one JSONL file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    path.write_text("\n".join(corpus_lines()) + "\n")
    return path


MIXTURE = """
[[source]]
name = "docs"
store = "builtin:docs"

[[source]]
name = "stdlib"
store = "builtin:stdlib"

[[schedule]]
from_step = 1
weights = { docs = 0.75, stdlib = 0.25 }

[[schedule]]
from_step = 4
weights = { docs = 0.25, stdlib = 0.75 }
"""


def write_mixture(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mixture.toml"
    path.write_text(MIXTURE)
    return path


def job_overrides(job: str, inputs: Path) -> list[str]:
    """The overrides (on tests/titan/tiny.toml) of each recorded job; ``inputs`` is the
    folder that ``write_raw`` / ``write_mixture`` wrote into."""
    if job == "default":
        return []
    if job == "mixture":
        return [
            "--zephon.mixture", str(inputs / "mixture.toml"),
            "--zephon.batch_schedule", "1:8,6:16",
            "--zephon.heldout_samples", "24",
        ]  # fmt: skip
    if job == "raw":
        return ["--zephon.store", str(inputs / "corpus.jsonl")]
    raise KeyError(job)


JOBS = ("default", "mixture", "raw")

# zephon plan queries recorded in plans.json: (name, argv after "plan" with {store},
# {mixture} filled in).
PLANS = (
    ("store_near", ["--store", "{store}", "--seq-len", "64", "--global-batch-size", "8",
                    "--seed", "3", "--steps", "1:3"]),
    ("store_far_rank", ["--store", "{store}", "--seq-len", "32", "--global-batch-size", "12",
                        "--seed", "11", "--steps", "1000000:1000001", "--dp-degree", "3",
                        "--dp-rank", "2"]),
    ("store_schedule", ["--store", "{store}", "--seq-len", "64",
                        "--global-batch-size", "1:4,3:16,5:6", "--seed", "0", "--steps", "1:7"]),
    ("mixture_change", ["--mixture", "{mixture}", "--seq-len", "64",
                        "--global-batch-size", "1:8,6:16", "--seed", "0", "--steps", "2:7",
                        "--heldout-samples", "24"]),
    ("mixture_far", ["--mixture", "{mixture}", "--seq-len", "128", "--global-batch-size", "12",
                     "--seed", "5", "--steps", "123456789:123456790"]),
)  # fmt: skip


def plan_outputs(store: Path, mixture: Path) -> dict[str, list]:
    """Each PLANS query's JSON lines, run through the ``zephon`` command in-process."""
    import contextlib
    import io

    from torchtitan_zephon.cli.main import main

    out = {}
    for name, argv in PLANS:
        args = [a.format(store=store, mixture=mixture) for a in argv]
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            code = main(["plan", *args, "--json"])
        assert code == 0, f"zephon plan {' '.join(args)} failed ({code}): {err.getvalue()}"
        out[name] = [json.loads(line) for line in buf.getvalue().splitlines()]
    return out


def prepare_store(raw: Path, output: Path) -> str:
    """``zephon prepare`` of the raw corpus with the builtin tokenizer; its fingerprint."""
    from torchtitan_zephon.cli.main import main
    from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
    from torchtitan_zephon.store.reader import TokenStore

    argv = ["prepare", str(raw), "--tokenizer", str(TOKENIZER_DIR), "--output", str(output)]
    assert main([*argv, "--quiet", "--workers", "1"]) == 0
    return TokenStore.open(output).fingerprint


def record(root: Path) -> None:
    """Train every job at 2 ranks and write RECORDED (run on main, once)."""
    import os
    import shutil

    from tests.titan.launch import train

    os.environ["ZEPHON_CACHE"] = str(root / "cache")
    inputs = root / "inputs"
    write_mixture(inputs)
    raw = write_raw(inputs)
    RECORDED.mkdir(exist_ok=True)
    for job in JOBS:
        run = train(root / job, 2, *job_overrides(job, inputs)).check().run
        dst = RECORDED / job / "zephon"
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy(run / "zephon" / "sequence_log.jsonl", dst / "sequence_log.jsonl")
    fingerprint = prepare_store(raw, root / "store")
    plans = {
        "store_fingerprint": fingerprint,
        **plan_outputs(root / "store", inputs / "mixture.toml"),
    }
    (RECORDED / "plans.json").write_text(json.dumps(plans, indent=1) + "\n")


if __name__ == "__main__":
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        record(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
