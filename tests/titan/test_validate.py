"""Validation: every DP degree and micro-batch size covers the same held-out samples
and reports the same loss (global token-loss sum over the global token count)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.titan.test_dataloader import job
from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.components.validate import (
    HeldoutLoader,
    ZephonValidator,
    microbatch_size,
)
from torchtitan_zephon.titan.settings.job_view import JobView
from torchtitan_zephon.titan.start.job_data import ZephonJob, open_job_data

platform.apply()


class _Store:
    """Only what HeldoutLoader asks of a source (its ids are checked, not its tokens)."""

    def rows(self, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, None]:
        return np.repeat(np.asarray(ids)[:, None], seq_len + 1, axis=1), None


@settings(max_examples=200, deadline=None)
@given(
    g_per=st.tuples(st.integers(1, 12), st.integers(1, 8)),
    m=st.integers(1, 20),
    batches=st.integers(1, 3),
    equal=st.booleans(),
)
def test_ranks_cover_the_held_out_samples_in_order(g_per, m, batches, equal):
    """For any DP degree D dividing G and any micro-batch size: the rank slices of each
    global batch, in rank order, are the held-out samples in order; every rank has the
    same number of micro-batches, none larger than asked (all equal under PP)."""
    dp_degree, per_rank = g_per
    gbs = dp_degree * per_rank
    first = 1000
    by_rank = []
    for r in range(dp_degree):
        loader = HeldoutLoader(
            _Store(), seq_len=4, first_sample=first, global_batch=gbs, num_batches=batches,
            dp_rank=r, dp_degree=dp_degree, local_batch_size=m, equal_microbatches=equal,
        )  # fmt: skip
        mbs = [labels[:, 0].numpy() for _, labels in loader]
        assert all(len(b) <= m for b in mbs)
        if equal:
            assert len({len(b) for b in mbs}) == 1
        by_rank.append(np.concatenate(mbs).reshape(batches, per_rank))
        assert len(mbs) == len(loader.microbatch_ids())
    counts = {len(b) for b in by_rank}
    assert len(counts) == 1
    delivered = np.concatenate(
        [np.concatenate([by_rank[r][b] for r in range(dp_degree)]) for b in range(batches)]
    )
    assert delivered.tolist() == list(range(first, first + batches * gbs))


def test_microbatch_size_is_clamped_not_refused():
    assert microbatch_size(6, 8, equal=False) == 6
    assert microbatch_size(6, 4, equal=False) == 4  # 4 + 2
    assert microbatch_size(6, 4, equal=True) == 3
    assert microbatch_size(7, 4, equal=True) == 1
    with pytest.raises(ValueError, match="validator.microbatch_size must be >= 1, got 0"):
        microbatch_size(6, 0, equal=False)


def build_validator(
    view: JobView, dp_degree: int, dp_rank: int, micro: int, *, steps: int = -1
) -> ZephonValidator:
    """The validator as Zephon's trainer builds it: the job's data opened once and
    handed over (the build keyword ``job``), then TorchTitan's build keywords."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import ParallelismConfig

    data, _ = open_job_data(view)
    config = ZephonValidator.Config(microbatch_size=micro, steps=steps)
    return config.build(
        job=ZephonJob.of(view, data), parallelism=ParallelismConfig(), dp_world_size=dp_degree, dp_rank=dp_rank, tokenizer=None,
        parallel_dims=SimpleNamespace(dp_cp_enabled=False, pp_enabled=False, cp_enabled=False),
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
        validation_context=contextlib.nullcontext,
        metrics_processor=SimpleNamespace(ntokens_since_last_log=0),
        seq_len=view.seq_len, local_batch_size=view.local_batch_size,
    )  # fmt: skip


def validator(tmp: Path, dp_degree: int, dp_rank: int, micro: int, *, gbs=12, local=2):
    view = dataclasses.replace(
        job(tmp, heldout_samples=24), global_batch_size=gbs, local_batch_size=local
    )
    return build_validator(view, dp_degree, dp_rank, micro)


def test_validation_loss_does_not_depend_on_the_layout(tmp_path, tiny_model):
    """Global batch 12, local batch 2, validation micro-batch 8 (TorchTitan's default)
    on 2 ranks failed at start before (8 does not divide the 6 samples per rank).
    Now every (DP degree, micro-batch) gives the same global loss; the sum over
    ranks of the local totals is what the all-reduce computes."""
    losses = {}
    for dp_degree, micro in [(1, 12), (2, 8), (2, 4), (3, 3), (4, 2), (6, 5), (12, 1)]:
        totals = sum(
            validator(tmp_path, dp_degree, r, micro).pass_totals([tiny_model])
            for r in range(dp_degree)
        )
        assert totals[1] == 24 * 32, totals  # every held-out token once
        losses[(dp_degree, micro)] = float(totals[0] / totals[1])
    ref = losses[(1, 12)]
    assert 5 < ref < 10, ref  # a fresh model: about ln(2048) = 7.6
    for layout, loss in losses.items():
        assert abs(loss - ref) <= 1e-6 * ref, (layout, loss, ref)


def test_validate_logs_the_token_mean(tmp_path, tiny_model):
    v = validator(tmp_path, 1, 0, 5)
    logged = {}
    v.metrics_processor.log_validation = lambda loss, step: logged.update({step: loss})
    v.validate([tiny_model], 4)
    totals = validator(tmp_path, 1, 0, 24).pass_totals([tiny_model])
    assert logged[4] == pytest.approx(float(totals[0] / totals[1]), rel=1e-6)
    assert tiny_model.training
