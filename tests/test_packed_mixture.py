"""A mixture with packing (issue 31 part b, mixtures): each source packs its own
documents, the mixture's plan draws packed sample ids from each source in its exact
proportions, and everything a key names (rows, labels, labelled tokens, documents,
held-out samples) is that source's packed sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_job import SEQ, W1, mixture_text, slices  # noqa: F401 - the fixture
from tests.test_packed_data import dense
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.job.packed import PackedSource
from torchtitan_zephon.job.source import IGNORE_INDEX
from torchtitan_zephon.order.data_config import MIXTURE_FIELD, PACKING_FIELD
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.stream import SOURCE_SHIFT

SCHEDULE = BatchSchedule([(1, 12)])


@pytest.fixture(scope="module")
def packed_mixture(slices, tmp_path_factory) -> JobData:  # noqa: F811
    config = MixtureConfig.loads(mixture_text(slices, W1))
    cache = str(tmp_path_factory.mktemp("cache"))
    lines: list[str] = []
    data = JobData.open_mixture(
        config, SEQ, packing="best_fit", default_heldout=3, cache_dir=cache, log=lines.append
    )
    assert [line.split(":")[0] for line in lines if "packed samples" in line] == [
        "mixture source 'code'", "mixture source 'math'", "mixture source 'web'",
    ]  # fmt: skip
    return data


def _keys(data: JobData, draw) -> np.ndarray:
    keys = []
    for _ in range(draw(st.integers(1, 8))):
        i = draw(st.integers(0, len(data.sources) - 1))
        keys.append(i << SOURCE_SHIFT | draw(st.integers(0, data.sources[i].available - 1)))
    return np.array(keys, dtype=np.int64)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_key_names_its_sources_packed_sample(packed_mixture, data) -> None:
    keys = _keys(packed_mixture, data.draw)
    rows, ignored = packed_mixture.rows(keys, SEQ)
    ignored = dense(ignored, keys, SEQ)
    assert np.array_equal(rows, packed_mixture.windows(keys, SEQ))
    assert np.array_equal(ignored, packed_mixture.ignored(keys, SEQ))
    started = np.zeros(len(packed_mixture.sources), dtype=np.int64)
    for r, key in enumerate(keys.tolist()):
        source = packed_mixture.sources[key >> SOURCE_SHIFT]
        one = np.array([key & ((1 << SOURCE_SHIFT) - 1)])
        want_rows, want_ignored = source.rows(one, SEQ)
        want_ignored = dense(want_ignored, one, SEQ)
        assert np.array_equal(rows[r], want_rows[0]) and np.array_equal(ignored[r], want_ignored[0])
        started[key >> SOURCE_SHIFT] += source.documents_started(one)
    assert packed_mixture.labelled_tokens(keys) == int((~ignored).sum())
    assert packed_mixture.documents_started(keys).tolist() == started.tolist()


def test_each_source_counts_its_packed_samples_and_the_config_binds_packing(
    packed_mixture,
    slices,  # noqa: F811
) -> None:
    for s, data in zip(packed_mixture.mixture.sources, packed_mixture.sources, strict=True):
        assert isinstance(data, PackedSource)
        assert s.num_samples + s.heldout_samples == data.packed.num_samples == data.available
        assert s.heldout_samples == 3
    config = packed_mixture.data_config(seed=5, schedule=SCHEDULE)
    assert config.packing == "best_fit" and PACKING_FIELD in config.to_dict()
    unpacked = JobData.open_mixture(MixtureConfig.loads(mixture_text(slices, W1)), SEQ,
                                default_heldout=3).data_config(seed=5, schedule=SCHEDULE)  # fmt: skip
    assert PACKING_FIELD not in unpacked.to_dict()
    assert config.fingerprint != unpacked.fingerprint
    assert config.to_dict()[MIXTURE_FIELD] != unpacked.to_dict()[MIXTURE_FIELD]  # the counts
    parts = packed_mixture.heldout()
    assert [(h.name, h.source, h.first, h.count) for h in parts] == [
        (name, data, s.num_samples, 3)
        for name, s, data in zip(
            packed_mixture.names,
            packed_mixture.mixture.sources,
            packed_mixture.sources,
            strict=True,
        )
    ]


def _step_batches(data, degree: int, local: int, steps: int = 4) -> list[tuple]:
    per_rank = []
    for rank in range(degree):
        loader = ZephonLoader(data, seq_len=SEQ, seed=5, schedule=SCHEDULE, dp_rank=rank,
                              dp_degree=degree, local_batch_size=local)  # fmt: skip
        with loader:
            per_rank.append([loader.step_microbatches(s) for s in range(1, steps + 1)])
    out = []
    for s in range(steps):
        batches = [mb for rank in per_rank for mb in rank[s]]
        out.append(
            (torch.cat([b[0]["input"] for b in batches]), torch.cat([b[1] for b in batches]))
        )
    return out


def test_the_loader_delivers_the_same_packed_mixture_batches_at_any_dp_degree(
    packed_mixture,
) -> None:
    one = _step_batches(packed_mixture, 1, 12)
    for degree, local in ((2, 3), (3, 4), (4, 1), (6, 2)):
        for (a_in, a_lab), (b_in, b_lab) in zip(
            one, _step_batches(packed_mixture, degree, local), strict=True
        ):
            assert torch.equal(a_in, b_in) and torch.equal(a_lab, b_lab)
    loader = ZephonLoader(packed_mixture, seq_len=SEQ, seed=5, schedule=SCHEDULE, dp_rank=0,
                          dp_degree=1, local_batch_size=12)  # fmt: skip
    with loader:
        for step, (inputs, labels) in enumerate(one, start=1):
            keys = loader.plan.global_ids(step)
            rows, ignored = packed_mixture.rows(keys, SEQ)
            ignored = dense(ignored, keys, SEQ)
            assert inputs.tolist() == rows[:, :-1].astype(np.int64).tolist()
            want = torch.from_numpy(rows[:, 1:].astype(np.int64))
            want[torch.from_numpy(ignored)] = IGNORE_INDEX
            assert torch.equal(labels, want)


def test_the_accounting_counts_documents_per_source(packed_mixture) -> None:
    from torchtitan_zephon.titan.components.accounting import StepAccounting

    config = packed_mixture.data_config(seed=5, schedule=SCHEDULE)
    plan = packed_mixture.plan(config)
    written: dict[int, dict[str, float]] = {}
    acc = StepAccounting(plan=lambda: plan, data=packed_mixture, seq_len=SEQ,
                         sink=lambda m, s: written.__setitem__(s, m),
                         should_log=lambda s: True, writes_log=True)  # fmt: skip
    for step in range(1, 41):
        want, padding = [0] * len(packed_mixture.sources), [0] * len(packed_mixture.sources)
        for key in plan.global_ids(step).tolist():
            source = packed_mixture.sources[key >> SOURCE_SHIFT]
            sample = source.packed.sample(key & ((1 << SOURCE_SHIFT) - 1)).tolist()
            want[key >> SOURCE_SHIFT] += sum(1 for _doc, start, _n in sample if start == 0)
            padding[key >> SOURCE_SHIFT] += SEQ - sum(n for _doc, _start, n in sample)
        assert acc._counts(plan, step)[0].tolist() == want
        acc.record(step)
        acc.ready(step)
        for i, name in enumerate(packed_mixture.names):
            assert written[step][f"zephon/source/{name}/documents_started"] == want[i]
            assert written[step][f"zephon/source/{name}/padding"] == padding[i]
    acc.close()
    assert any(v for m in written.values() for k, v in m.items() if k.endswith("/padding"))
