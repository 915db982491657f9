"""titan.components.accounting: the trainer's per-source accounting (scalars to the metrics
logger, the log line at log steps, capped epoch-wrap warnings) and its switch."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import tyro

from torchtitan_zephon.bench.accounting import OffsetsOnly
from torchtitan_zephon.job.accounting import documents_started, step_account
from torchtitan_zephon.order.layout import BatchSchedule, Layout
from torchtitan_zephon.order.mixture.plan import MixturePlan
from torchtitan_zephon.order.mixture.spec import MixtureSpec
from torchtitan_zephon.order.mixture.stream import MixtureStream
from torchtitan_zephon.titan.components.accounting import TAGS, WRAP_WARNINGS, StepAccounting
from torchtitan_zephon.titan.components.trainer import ZephonTrainer
from torchtitan_zephon.titan.settings.zephon_section import Zephon

SEQ_LEN = 4


def mixture(seed: int = 1) -> MixtureStream:
    """a: 100 samples, b: 3 samples; 6 + 2 a step, then 4 + 4 from step 5."""
    spec = MixtureSpec.build({"a": 100, "b": 3}, [(1, {"a": 3, "b": 1}), (5, {"a": 1, "b": 1})])
    return MixtureStream(MixturePlan(spec, seed, Layout(BatchSchedule([(1, 8)]))))


# every source's document offsets: a start every 3 tokens (so 1 or 2 per sample of 4)
STORES = [SimpleNamespace(doc_offsets=np.arange(0, 100 * SEQ_LEN, 3)) for _ in range(2)]
DATA = OffsetsOnly([st.doc_offsets for st in STORES], SEQ_LEN)  # JobData's counts, no store


def accounting(plan, sink, **kw) -> StepAccounting:
    defaults = {"should_log": lambda s: s == 1 or s % 3 == 0, "writes_log": True}
    return StepAccounting(
        plan=lambda: plan, data=DATA, seq_len=SEQ_LEN, sink=sink, **{**defaults, **kw}
    )


def test_scalars_each_step_the_line_at_log_steps_and_capped_wrap_warnings(caplog):
    plan = mixture()
    written: list[tuple[int, dict]] = []
    acc = accounting(plan, lambda metrics, step: written.append((step, metrics)))
    with caplog.at_level(logging.INFO):
        for step in range(1, 9):
            acc.ahead(step)
            acc.record(step)
        acc.close()
    assert [s for s, _ in written] == list(range(1, 9))
    offsets = [st.doc_offsets for st in STORES]
    for step, metrics in written:
        a = step_account(plan, step, SEQ_LEN)
        docs = documents_started(plan, step, offsets, SEQ_LEN)
        assert set(metrics) == {f"zephon/source/{n}/{t}" for n in ("a", "b") for t in TAGS}
        assert metrics["zephon/source/b/samples"] == (2 if step < 5 else 4)
        assert metrics["zephon/source/b/tokens"] == metrics["zephon/source/b/samples"] * 4
        assert metrics["zephon/source/a/cumulative_samples"] == int(a.cumulative[0])
        assert metrics["zephon/source/b/target_samples"] == 2 * min(step, 4) + 4 * max(0, step - 4)
        assert metrics["zephon/source/b/deviation"] == 0.0
        assert metrics["zephon/source/b/epoch"] == (int(a.cumulative[1]) - 1) // 3
        assert metrics["zephon/source/a/documents_started"] == int(docs[0]) > 0
    lines = [r.getMessage() for r in caplog.records if " data | " in r.getMessage()]
    assert [x.split()[2] for x in lines] == ["1", "3", "6"]
    assert lines[0] == (
        "Zephon: step 1 data | a: 6 samples, 6 in total (target 6.00, +0.00), epoch 0, "
        f"{int(written[0][1]['zephon/source/a/documents_started'])} new documents | "
        "b: 2 samples, 2 in total (target 2.00, +0.00), epoch 0, "
        f"{int(written[0][1]['zephon/source/b/documents_started'])} new documents"
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # b (3 samples) draws 2, then 4 a step: its last draws 3 (step 2), 7 (4), 11 (5) are
    # in epochs 1, 2, 3
    assert warned == [
        "Zephon: source 'b' wrapped into epoch 1 at step 2: its training samples repeat "
        "from here, in a new order",
        "Zephon: source 'b' wrapped into epoch 2 at step 4: its training samples repeat "
        "from here, in a new order",
        "Zephon: source 'b' wrapped into epoch 3 at step 5: its training samples repeat "
        "from here, in a new order",
        "Zephon: later epoch wraps of source 'b' are not logged; its epoch is in "
        "TensorBoard (zephon/source/b/epoch)",
    ]
    assert WRAP_WARNINGS == 3


def test_without_tensorboard_rank_0_still_logs_the_lines_and_every_wrap(caplog):
    """No scalars to write: the documents are counted for the log steps only, and the
    wraps at the other steps (2, 4, 5) are still warned."""
    acc = accounting(mixture(), None)
    with caplog.at_level(logging.INFO):
        for step in range(1, 7):
            acc.ahead(step)
            acc.record(step)
        acc.close()
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split()[2] for m in messages if " data | " in m] == ["1", "3", "6"]
    assert [m.split(" at step ")[1][0] for m in messages if "wrapped into" in m] == ["2", "4", "5"]


def test_a_rank_that_writes_nothing_accounts_nothing(caplog):
    acc = accounting(mixture(), None, writes_log=False)
    assert not acc.active
    with caplog.at_level(logging.INFO):
        acc.ahead(1)
        assert acc.record(1) is None
    assert not caplog.records
    acc.close()


def test_a_plan_replaced_by_a_resume_is_counted_afresh():
    old, new = mixture(seed=1), mixture(seed=2)
    offsets = [st.doc_offsets for st in STORES]
    step = next(  # a step whose documents differ under the two seeds
        s
        for s in range(1, 50)
        if documents_started(old, s, offsets, SEQ_LEN).tolist()
        != documents_started(new, s, offsets, SEQ_LEN).tolist()
    )
    current = [old]
    written: list[dict] = []
    acc = StepAccounting(
        plan=lambda: current[0],
        data=DATA,
        seq_len=SEQ_LEN,
        sink=lambda m, s: written.append(m),
        should_log=lambda s: False,
        writes_log=False,
    )
    acc.ahead(step)  # counted under the old plan
    current[0] = new
    acc.record(step)
    acc.close()
    docs = documents_started(new, step, offsets, SEQ_LEN)
    assert [written[0][f"zephon/source/{n}/documents_started"] for n in "ab"] == docs.tolist()


def test_the_switch_is_on_by_default_and_off_builds_nothing():
    assert Zephon().accounting is True
    off = tyro.cli(Zephon, args=["--no-accounting"])  # --zephon.no-accounting
    assert off.accounting is False
    assert ZephonTrainer._build_accounting(SimpleNamespace(), SimpleNamespace(zephon=off)) is None


@pytest.mark.parametrize("bad", [SimpleNamespace()])
def test_a_plan_of_no_known_kind_is_a_type_error(bad):
    with pytest.raises(TypeError, match="no accounting for a SimpleNamespace"):
        step_account(bad, 1, SEQ_LEN)


def test_a_source_whose_documents_are_not_counted_has_no_documents_tag_or_text():
    """documents_started is -1 for a source without offsets (a store in object storage
    with more offsets than the accounting fetches: job.accounting.document_offsets):
    its scalar and the line's 'new documents' are left out, the rest is as before."""
    from torchtitan_zephon.titan.components.accounting import log_line, metrics_of

    plan = mixture()
    offsets = [STORES[0].doc_offsets, None]
    docs = documents_started(plan, 1, offsets, SEQ_LEN)
    assert docs[1] == -1 and docs[0] == documents_started(plan, 1, [offsets[0]] * 2, SEQ_LEN)[0]
    a = step_account(plan, 1, SEQ_LEN)
    metrics = metrics_of(a, docs)
    assert "zephon/source/b/documents_started" not in metrics
    assert metrics["zephon/source/a/documents_started"] == int(docs[0])
    assert set(metrics) == {f"zephon/source/{n}/{t}" for n in ("a", "b") for t in TAGS} - {
        "zephon/source/b/documents_started"
    }
    assert log_line(a, docs).endswith("| b: 2 samples, 2 in total (target 2.00, +0.00), epoch 0")
