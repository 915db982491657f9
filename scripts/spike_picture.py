"""A loss spike caused by bad data, found, shown and rolled back with a skip: the
"When a loss spike hits" picture of docs/operating.md (docs/spike_rollback.png), from real runs.

1. A store with bad data: the builtin store with the samples that steps BAD_STEPS
   train on overwritten by repeated n-grams of random tokens (same size, so the same
   order: the order depends on the seed and the number of samples only).
2. A run of train_configs/debug_model.toml on it (CPU, 1 rank, checkpoints every
   INTERVAL steps): its loss spikes at the first bad step.
3. ``zephon spikes`` on it: the spike P and the rollback it suggests; the run is copied
   and the copy resumed with ``--checkpoint.load_step C --zephon.skip_steps ...``.
4. Both loss curves on one plot.

    python scripts/spike_picture.py [--out outputs/spike_demo] [--png docs/spike_rollback.png]

A few minutes on 2 CPU cores. The same run folders serve that guide's walkthrough.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan_zephon.cli.spikes import find_spikes, rollback  # noqa: E402
from torchtitan_zephon.ingest.builtin import builtin_store_path  # noqa: E402
from torchtitan_zephon.order.layout import BatchSchedule  # noqa: E402
from torchtitan_zephon.order.skips import SkipSteps  # noqa: E402
from torchtitan_zephon.order.stream import DataPlan  # noqa: E402
from torchtitan_zephon.run import recorded as runs  # noqa: E402
from torchtitan_zephon.store.reader import TokenStore  # noqa: E402
from torchtitan_zephon.store.writer import write_derived_store  # noqa: E402

CONFIG = REPO / "train_configs" / "debug_model.toml"
SEQ_LEN, GBS, SEED, HELDOUT = 128, 8, 0, 64  # debug_model.toml's
STEPS, INTERVAL = 40, 5
BAD_STEPS = (25, 26)
NGRAM = 4
WINDOW = 10  # early in training the loss falls fast: a short trailing window follows it


def bad_store(out: Path) -> Path:
    """The builtin store with repeated n-grams in the samples of BAD_STEPS."""
    folder = out / "store_with_ngrams"
    if folder.exists():
        return folder
    store = TokenStore.open(builtin_store_path())
    plan = DataPlan(store.num_samples(SEQ_LEN) - HELDOUT, SEED, BatchSchedule([(1, GBS)]))
    tokens = np.array(store.tokens)
    rng = np.random.default_rng(0)
    for step in BAD_STEPS:
        for sid in plan.global_ids(step).tolist():
            gram = rng.integers(1000, store.vocab_size, NGRAM)
            tokens[sid * SEQ_LEN : (sid + 1) * SEQ_LEN + 1] = np.resize(gram, SEQ_LEN + 1)
    tmp = out / ".store.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = {"name": f"builtin store, repeated {NGRAM}-grams at steps {BAD_STEPS}", "kind": "demo"}
    write_derived_store(tmp, store, tokens.astype(store.dtype).tobytes(), store.doc_offsets, source)
    os.rename(tmp, folder)
    return folder


def train(run: Path, store: Path, *extra: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", ZEPHON_DEVICE="cpu", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "-m", "torchtitan_zephon.train", "--job.config_file", str(CONFIG),
        "--job.dump_folder", str(run), "--zephon.store", str(store),
        "--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL),
        "--debug.save_config_file", "config.json", *extra,
    ]  # fmt: skip
    with open(run.parent / f"{run.name}.log", "a") as log:
        subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "spike_demo")
    ap.add_argument("--png", type=Path, default=REPO / "docs" / "spike_rollback.png")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = bad_store(args.out)
    spiky, rolled = args.out / "spiky", args.out / "rolled_back"
    if not (spiky / "checkpoint" / f"step-{STEPS}").exists():
        shutil.rmtree(spiky, ignore_errors=True)
        train(spiky, store)
    before = runs.read_scalars(spiky)
    spikes = find_spikes(before, window=WINDOW)
    if not spikes:
        raise SystemExit(f"no spike found in {spiky}: {json.dumps(before)}")
    p = spikes[0]["step"]
    ckpts = [c.step for c in runs.checkpoints(spiky) if c.complete]
    found = rollback(p, ckpts, SkipSteps())  # the run has no skip of its own
    assert found is not None, ckpts
    c, skip = found
    print(f"spike at step {p}; rolling back to {c} with --zephon.skip_steps {skip}")
    if not (rolled / "zephon").exists() or runs.read_scalars(rolled) == before:
        shutil.rmtree(rolled, ignore_errors=True)
        shutil.copytree(spiky, rolled)
        train(rolled, store, "--checkpoint.load_step", str(c), "--zephon.skip_steps", skip)
    after = runs.read_scalars(rolled)
    plot(before, after, p, c, skip, args.png)
    print(f"wrote {args.png}")


def plot(before: dict, after: dict, p: int, c: int, skip: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    s0 = sorted(before)
    ax.plot(
        s0,
        [before[s] for s in s0],
        color="tab:red",
        lw=1.6,
        label="run on data with repeated n-grams",
    )
    s1 = sorted(s for s in after if s > c)
    ax.plot(s1, [after[s] for s in s1], color="tab:blue", lw=1.6,
            label=f"rolled back to step {c}, --zephon.skip_steps {skip}")  # fmt: skip
    ax.axvline(p, color="tab:red", ls=":", lw=1)
    ax.annotate(f"spike at step {p} (zephon spikes):\nrepeated n-grams (zephon show)", (p, before[p]),
                xytext=(p + 1.5, before[p] - 0.3), fontsize=8, color="tab:red", va="top")  # fmt: skip
    ax.axvline(c, color="gray", ls="--", lw=1)
    ax.text(c + 0.3, ax.get_ylim()[1], f" checkpoint {c}", fontsize=8, color="gray", va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(
        "A loss spike from bad data, rolled back with a skip (debug model, CPU)", fontsize=10
    )
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


if __name__ == "__main__":
    main()
