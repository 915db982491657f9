"""A job on a mixture (zephon.mixture): the source it opens, its checks, per-source validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.titan.test_dataloader import build_zephon_dataloader, deliver, job
from tests.titan.test_validate import build_validator
from torchtitan_zephon.order.mixture.config import MixtureError
from torchtitan_zephon.order.stream import split_keys
from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.components.validate import ZephonValidator
from torchtitan_zephon.titan.settings.job_view import JobView
from torchtitan_zephon.titan.start.job_data import resolve_data

platform.apply()

HALVES = """
[[source]]
name = "docs"
store = "builtin:docs"
{docs}
[[source]]
name = "stdlib"
store = "builtin:stdlib"

[[schedule]]
from_step = 1
weights = {{ docs = 0.75, stdlib = 0.25 }}

[[schedule]]
from_step = 3
weights = {{ docs = 0, stdlib = 1 }}
"""


def mixture_job(tmp: Path, docs: str = "", **zephon) -> JobView:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "mixture.toml"
    path.write_text(HALVES.format(docs=docs))
    return job(tmp / "run", mixture=str(path), global_batch_size=12, **zephon)


def test_the_job_reads_the_mixture_and_its_weights(tmp_path):
    dl = build_zephon_dataloader(2, 1, None, mixture_job(tmp_path, heldout_samples=12))
    assert dl.loader.data.mixture is not None
    assert dl.loader.config.mixture["schedule"][1]["weights"] == {"docs": "0/1", "stdlib": "1/1"}
    deliver(dl, 3 * 3)  # steps 1..3: 3 micro-batches of 2 per rank per step
    plan = dl.plan
    for step, docs in ((1, 9), (2, 9), (3, 0)):  # 0.75 x 12, then weight 0
        sources, _ = split_keys(plan.global_ids(step))
        assert int((sources == 0).sum()) == docs, step
    one = build_zephon_dataloader(1, 0, None, mixture_job(tmp_path, heldout_samples=12))
    deliver(one, 3 * 6)
    assert one.state_dict() == dl.state_dict()  # one record, whatever the layout
    one.close()
    dl.close()


def test_bad_mixture_jobs_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="zephon.mixture .* and zephon.store .* are both set"):
        resolve_data(mixture_job(tmp_path, store="/some/store"))
    with pytest.raises(MixtureError, match="cannot read mixture file"):
        resolve_data(job(tmp_path, mixture=str(tmp_path / "missing.toml")))
    too_much = mixture_job(tmp_path, docs="heldout_samples = 10000000")
    with pytest.raises(MixtureError, match=r"mixture source 'docs': heldout_samples=10000000"):
        resolve_data(too_much)
    small_tokenizer = SimpleNamespace(get_vocab_size=lambda: 1000)
    with pytest.raises(ValueError, match=r"the mixture .* \(sources docs, stdlib\) was tokenized"):
        resolve_data(mixture_job(tmp_path), small_tokenizer)

    # a model of 1000 embeddings (0.3: the model spec's, as the trainer's view reads it)
    cfg = dataclasses.replace(
        mixture_job(tmp_path), model_flavor="test_vocab_1000", vocab_size=1000
    )
    with pytest.raises(ValueError, match="embeds only 1000"):
        build_zephon_dataloader(1, 0, None, cfg)

    cfg = mixture_job(tmp_path)  # stdlib draws 12 samples a step from step 3
    path = Path(cfg.zephon.mixture)
    text = path.read_text().replace('"builtin:stdlib"', '"builtin:stdlib"\nmax_epochs = 1')
    path.write_text(text)
    cfg = dataclasses.replace(cfg, steps=10**6)
    with pytest.raises(
        MixtureError, match="mixture source 'stdlib' runs past max_epochs=1 at step"
    ):
        build_zephon_dataloader(1, 0, None, cfg)


def validator(cfg: JobView, dp_degree: int, dp_rank: int, micro: int) -> ZephonValidator:
    assert cfg.local_batch_size == 2
    return build_validator(cfg, dp_degree, dp_rank, micro)


def test_each_source_is_validated_on_its_own_held_out_samples(tmp_path, tiny_model):
    """docs keeps 36 held-out samples, stdlib 12 (zephon.heldout_samples): per-source
    losses and the overall one (every validated token) do not depend on the layout."""
    cfg = mixture_job(tmp_path, docs="heldout_samples = 36", heldout_samples=12)
    results = {}
    for dp_degree, micro in [(1, 12), (2, 4), (3, 3), (6, 1)]:
        per_rank = [validator(cfg, dp_degree, r, micro) for r in range(dp_degree)]
        names = [name for name, _ in per_rank[0].heldout_loaders]
        assert names == ["docs", "stdlib"]
        totals = [
            sum(v.pass_totals([tiny_model], v.heldout_loaders[k][1]) for v in per_rank)
            for k in range(2)
        ]
        assert [float(t[1]) for t in totals] == [36 * 32, 12 * 32]
        results[(dp_degree, micro)] = [float(t[0] / t[1]) for t in totals]
    ref = results[(1, 12)]
    for layout, losses in results.items():
        for a, b in zip(losses, ref, strict=True):
            assert abs(a - b) <= 1e-6 * b, (layout, losses, ref)

    v = validator(cfg, 1, 0, 5)
    logged = {}
    v.metrics_processor.log_validation = lambda loss, step, extra_metrics=None: logged.update(
        loss=loss, step=step, extra=extra_metrics
    )
    v.validate([tiny_model], 4)
    assert set(logged["extra"]) == {"validation/loss/docs", "validation/loss/stdlib"}
    assert logged["extra"]["validation/loss/docs"] == pytest.approx(ref[0], rel=1e-6)
    assert logged["loss"] == pytest.approx((36 * ref[0] + 12 * ref[1]) / 48, rel=1e-6)

    cfg = mixture_job(tmp_path / "b", docs="heldout_samples = 0", heldout_samples=12)
    v = validator(cfg, 1, 0, 4)
    assert [name for name, _ in v.heldout_loaders] == ["stdlib"]  # docs is not validated
    cfg = mixture_job(tmp_path / "c", docs="heldout_samples = 5", heldout_samples=12)
    with pytest.raises(ValueError, match="mixture source 'docs' holds 5 .* multiple of 12"):
        validator(cfg, 1, 0, 4)
