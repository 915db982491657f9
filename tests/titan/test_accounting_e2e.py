"""Per-source accounting end to end: a 1-rank torchrun job on a 2-source mixture whose
small source wraps into new epochs; its TensorBoard scalars are the plan's accounting,
its log has the per-step line and the epoch-wrap warnings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.titan.launch import train
from torchtitan_zephon.ingest.builtin import builtin_store_path
from torchtitan_zephon.job.accounting import document_offsets, documents_started, step_account
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import slice_store
from torchtitan_zephon.titan.components.accounting import TAGS

SEQ_LEN, GBS, STEPS, HELDOUT = 64, 8, 6, 2


def small_slice(store: TokenStore, folder: Path, tokens: int) -> None:
    """Whole consecutive documents of ``store`` holding ``tokens`` to 1.5 x ``tokens``
    tokens (the first such run)."""
    off = np.append(np.asarray(store.doc_offsets, dtype=np.int64), store.num_tokens)
    for start in range(len(off) - 1):
        k = int(np.searchsorted(off, off[start] + tokens))  # first end reaching ``tokens``
        if k < len(off) and off[k] - off[start] <= 1.5 * tokens:
            slice_store(store, int(off[start]), int(off[k]), folder)
            return
    raise AssertionError("no run of documents of the size asked")


def test_tensorboard_holds_the_plans_accounting_and_the_log_warns_of_wraps(tmp_path: Path):
    builtin = TokenStore.open(builtin_store_path(part="docs"))
    small_slice(builtin, tmp_path / "small", (8 + HELDOUT) * SEQ_LEN + 1)
    mixture = tmp_path / "mix.toml"
    mixture.write_text(
        '[[source]]\nname = "big"\nstore = "builtin:docs"\n'
        '[[source]]\nname = "small"\nstore = "small"\n'
        "[[schedule]]\nfrom_step = 1\nweights = { big = 0.75, small = 0.25 }\n"
        "[[schedule]]\nfrom_step = 4\nweights = { big = 0.5, small = 0.5 }\n"
    )
    run = tmp_path / "run"
    job = train(
        run, 1, "--zephon.mixture", str(mixture), "--zephon.heldout_samples", str(HELDOUT),
        "--training.steps", str(STEPS), "--checkpoint.no-enable",
        "--metrics.log_freq", "3", "--validation.no-enable",
    ).check()  # fmt: skip

    (events,) = runs.event_files(run)  # one job, one event file
    board = EventAccumulator(str(events), size_guidance={"scalars": 0})
    board.Reload()

    def scalars(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in board.Scalars(tag)}

    data = JobData.open_mixture(MixtureConfig.load(mixture), SEQ_LEN, default_heldout=HELDOUT)
    plan = data.plan(data.data_config(seed=0, schedule=BatchSchedule([(1, GBS)])))
    offsets = document_offsets(data)
    small = data.mixture.sources[data.names.index("small")].num_samples
    assert 2 <= small < 12  # wraps within the job (2, then 4 samples a step)
    accounts = [step_account(plan, step, SEQ_LEN) for step in range(1, STEPS + 1)]
    docs = [documents_started(plan, step, offsets, SEQ_LEN) for step in range(1, STEPS + 1)]
    wraps = [(name, e, a.step) for a in accounts for name, e in a.wraps]
    for i, name in enumerate(data.names):
        for k, tag in enumerate(TAGS):
            want = [
                (a.samples[i], a.tokens[i], a.cumulative[i], float(a.targets[i]),
                 a.deviations[i], a.epochs[i], d[i])[k]
                for a, d in zip(accounts, docs, strict=True)
            ]  # fmt: skip
            got = scalars(f"zephon/source/{name}/{tag}")
            assert got == dict(zip(range(1, STEPS + 1), map(float, want), strict=True)), tag
    # a weight change at step 4: 2 then 4 samples of "small" per step, exact targets
    assert list(scalars("zephon/source/small/samples").values()) == [2, 2, 2, 4, 4, 4]
    assert scalars("zephon/source/small/target_samples")[STEPS] == 18
    assert sum(scalars("zephon/source/big/documents_started").values()) > 0

    # the log: the line at metrics.log_freq (steps 1, 3, 6), the wraps on rank 0 once each
    lines = [x for x in job.output.splitlines() if "Zephon: step " in x and " data | " in x]
    assert [int(x.split("Zephon: step ")[1].split()[0]) for x in lines] == [1, 3, 6]
    line = lines[-1]
    a = step_account(plan, STEPS, SEQ_LEN)
    i = a.names.index("small")
    assert (
        f"small: 4 samples, {int(a.cumulative[i])} in total (target 18.00, +0.00), "
        f"epoch {int(a.epochs[i])}, " in line
    )
    assert wraps and wraps[0][0] == "small"
    for name, epoch, step in wraps[:3]:
        text = f"Zephon: source {name!r} wrapped into epoch {epoch} at step {step}: "
        assert job.output.count(text) == 1, text
