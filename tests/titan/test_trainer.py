"""One owner of the job's data: the trainer opens it once (the preflight) and the
dataloader and validator TorchTitan builds read that object, so each store is
opened exactly once per process (issue 19, point 4)."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.titan.test_mixture_job import mixture_job
from tests.titan.test_preflight import data_job
from tests.titan.test_preflight import job as checkpoint_job
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.titan import platform

platform.apply()


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Every ``TokenStore.open`` of this process from here on, by resolved store path
    (the real open runs: this only counts)."""
    counts: Counter = Counter()
    real = TokenStore.open.__func__

    def counting(cls, path, **kwargs):  # noqa: ANN001, ANN202
        store = real(cls, path, **kwargs)
        counts[str(Path(store.path).resolve())] += 1
        return store

    monkeypatch.setattr(TokenStore, "open", classmethod(counting))
    return counts


def trainer_job(cfg: SimpleNamespace) -> SimpleNamespace:
    """``cfg`` (a data job) with what the preflight and the validator read besides."""
    base = checkpoint_job(Path(cfg.job.dump_folder), enable=False)
    cfg.checkpoint = base.checkpoint
    for key, value in vars(base.zephon).items():
        if not hasattr(cfg.zephon, key):
            setattr(cfg.zephon, key, value)
    cfg.model.name, cfg.model.flavor = "zephon_llama3", "tiny"
    cfg.parallelism = data_job(Path(cfg.job.dump_folder)).parallelism
    cfg.validation = SimpleNamespace(local_batch_size=2, steps=-1)
    return cfg


def start_like_the_trainer(cfg: SimpleNamespace, dp_degree: int, dp_rank: int):  # noqa: ANN201
    """What ZephonTrainer does in one process: the preflight, then TorchTitan's
    Trainer.__init__ building the tokenizer, the dataloader and the validator through
    the trainer's train spec, with TorchTitan's own keyword arguments."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_zephon.titan import preflight
    from torchtitan_zephon.titan.spec import register
    from torchtitan_zephon.titan.trainer import with_job_data

    register()
    plan = preflight.plan_start(cfg, writer=dp_rank == 0)
    spec = with_job_data(get_train_spec(cfg.model.name), plan.data)
    tokenizer = spec.build_tokenizer_fn(cfg)
    dataloader = spec.build_dataloader_fn(
        dp_world_size=dp_degree, dp_rank=dp_rank, tokenizer=tokenizer, job_config=cfg
    )
    validator = spec.build_validator_fn(
        job_config=cfg, dp_world_size=dp_degree, dp_rank=dp_rank, tokenizer=tokenizer,
        parallel_dims=SimpleNamespace(dp_cp_enabled=False, pp_enabled=False, cp_enabled=False),
        loss_fn=cross_entropy_loss, validation_context=contextlib.nullcontext,
        maybe_enable_amp=contextlib.nullcontext(),
        metrics_processor=SimpleNamespace(ntokens_since_last_log=0),
        pp_schedule=None, pp_has_first_stage=None, pp_has_last_stage=None,
    )  # fmt: skip
    return plan.data, dataloader, validator


def test_the_store_is_opened_once_across_preflight_dataloader_and_validator(tmp_path, opened):
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    cfg = trainer_job(data_job(tmp_path / "run", heldout_samples=16))
    data, dl, validator = start_like_the_trainer(cfg, 2, 1)
    try:
        assert dl.loader.source is data
        assert [h.store for _, h in validator.heldout_loaders] == [data.store]
        next(iter(dl))  # reading a batch opens nothing either
        assert opened == Counter({str(builtin_store_path().resolve()): 1})
    finally:
        dl.close()


def test_each_mixture_source_is_opened_once_across_preflight_dataloader_and_validator(
    tmp_path, opened
):
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    cfg = trainer_job(mixture_job(tmp_path, docs="heldout_samples = 12", heldout_samples=12))
    data, dl, validator = start_like_the_trainer(cfg, 2, 0)
    try:
        assert dl.loader.source is data
        assert [h.store for _, h in validator.heldout_loaders] == data.stores
        next(iter(dl))
        parts = [str(builtin_store_path(part=p).resolve()) for p in ("docs", "stdlib")]
        assert opened == Counter(dict.fromkeys(parts, 1))
    finally:
        dl.close()


def test_without_the_trainers_data_each_builder_opens_the_job_itself(tmp_path, opened):
    """The builders TorchTitan may call on their own (no trainer, no preflight) still
    work: each opens and checks the job's data (a separate object) itself."""
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_zephon.titan.spec import register
    from torchtitan_zephon.titan.trainer import with_job_data

    register()
    spec = get_train_spec("zephon_llama3")
    assert with_job_data(spec, None) is spec
    cfg = trainer_job(data_job(tmp_path / "run", heldout_samples=16))
    dl = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None, job_config=cfg)
    dl.close()
    assert sum(opened.values()) == 1


def test_the_trainers_train_spec_hands_its_job_data_to_the_builders(tmp_path, opened):
    """TorchTitan's Trainer.__init__ sets ``self.train_spec`` and builds through it: the
    spec ZephonTrainer keeps is bound to the job data its preflight opened."""
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_zephon.titan import preflight
    from torchtitan_zephon.titan.spec import register
    from torchtitan_zephon.titan.trainer import ZephonTrainer

    register()
    cfg = trainer_job(data_job(tmp_path / "run", heldout_samples=16))
    trainer = ZephonTrainer.__new__(ZephonTrainer)  # only the seam, not a whole trainer
    trainer._data = preflight.plan_start(cfg, writer=True).data
    trainer.train_spec = get_train_spec(cfg.model.name)  # what Trainer.__init__ does
    dl = trainer.train_spec.build_dataloader_fn(
        dp_world_size=1, dp_rank=0, tokenizer=None, job_config=cfg
    )
    try:
        assert dl.loader.source is trainer._data and sum(opened.values()) == 1
    finally:
        dl.close()
