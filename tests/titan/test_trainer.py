"""One owner of the job's data: the trainer opens it once (the preflight) and the
dataloader and validator TorchTitan builds read that object, so each store is
opened exactly once per process (issue 19, point 4)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.titan import platform

platform.apply()

from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from tests.titan.test_mixture_job import HALVES  # noqa: E402
from torchtitan_zephon.titan.components.dataloader import ZephonDataLoader  # noqa: E402
from torchtitan_zephon.titan.components.trainer import ZephonTrainer  # noqa: E402
from torchtitan_zephon.titan.components.validate import ZephonValidator  # noqa: E402


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


def trainer_config(run: Path, **zephon: Any) -> ZephonTrainer.Config:
    """The tiny registry job (CPU defaults applied, as train.py does), run folder ``run``,
    no checkpoints, validation on."""
    from torchtitan_zephon.configs.config_registry import llama3_tiny

    config = llama3_tiny()
    platform.cpu_config_defaults(config)
    config.dump_folder = str(run)
    config.hf_assets_path = "./torchtitan_zephon/assets/tokenizer"
    config.training.seq_len = 32
    config.checkpoint.enable = False
    config.validator = dataclasses.replace(config.validator, enable=True)
    config.zephon = dataclasses.replace(config.zephon, **zephon)
    return config


@pytest.fixture
def titan_builds(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """TorchTitan's ``Trainer.__init__`` reduced to what touches the job's data: it
    builds the tokenizer, the dataloader and (validation on) the validator from the
    config ZephonTrainer hands it, with TorchTitan 0.3's own build keywords
    (trainer.py: ``config.tokenizer.build``, ``config.dataloader.build``,
    ``config.validator.build``) at the DP coordinates ``layout``. The model, the mesh and
    the optimizer are not built."""
    seen = SimpleNamespace(layout=(1, 0), built=[])

    def titan_init(self: Trainer, config: Any) -> None:
        from torchtitan.config import ParallelismConfig

        self.config = config
        tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
        dp_degree, dp_rank = seen.layout
        dataloader = config.dataloader.build(
            dp_world_size=dp_degree, dp_rank=dp_rank, tokenizer=tokenizer,
            seq_len=config.training.seq_len, local_batch_size=config.training.local_batch_size,
            snapshot_every_n_steps=None,
        )  # fmt: skip
        validator = None
        if config.validator.enable:
            validator = config.validator.build(
                parallelism=ParallelismConfig(), dp_world_size=dp_degree, dp_rank=dp_rank,
                tokenizer=tokenizer,
                parallel_dims=SimpleNamespace(dp_cp_enabled=False, pp_enabled=False,
                                              cp_enabled=False),
                loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
                validation_context=None, metrics_processor=None,
                seq_len=config.training.seq_len,
                local_batch_size=config.training.local_batch_size,
                pp_schedule=None, pp_has_first_stage=None, pp_has_last_stage=None,
            )  # fmt: skip
        seen.built.append(SimpleNamespace(dataloader=dataloader, validator=validator))

    monkeypatch.setattr(Trainer, "__init__", titan_init)
    return seen


def start_like_the_trainer(
    config: ZephonTrainer.Config, titan_builds: SimpleNamespace, dp_degree: int, dp_rank: int
) -> tuple[Any, ZephonDataLoader, ZephonValidator | None]:
    """ZephonTrainer's own ``__init__`` (checks, run folder, preflight, the hand-over to
    the dataloader and validator configs), then TorchTitan's builds as above; returns
    the job data the preflight opened, the dataloader and the validator."""
    titan_builds.layout = (dp_degree, dp_rank)
    trainer = ZephonTrainer(config)
    if trainer._lock is not None:
        trainer._lock.release()
    (done,) = titan_builds.built
    return trainer.zephon_job.data, done.dataloader, done.validator


def test_the_store_is_opened_once_across_preflight_dataloader_and_validator(
    tmp_path, opened, titan_builds
):
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    config = trainer_config(tmp_path / "run", heldout_samples=16)
    data, dl, validator = start_like_the_trainer(config, titan_builds, 2, 1)
    try:
        assert dl.loader.data is data
        assert [h.source.store for _, h in validator.heldout_loaders] == data.stores
        next(iter(dl))  # reading a batch opens nothing either
        assert opened == Counter({str(builtin_store_path().resolve()): 1})
    finally:
        dl.close()


def test_each_mixture_source_is_opened_once_across_preflight_dataloader_and_validator(
    tmp_path, opened, titan_builds
):
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    mixture = tmp_path / "mixture.toml"
    mixture.write_text(HALVES.format(docs="heldout_samples = 12"))
    config = trainer_config(tmp_path / "run", mixture=str(mixture), heldout_samples=12)
    config.training.global_batch_size = 12
    data, dl, validator = start_like_the_trainer(config, titan_builds, 2, 0)
    try:
        assert dl.loader.data is data
        assert [h.source.store for _, h in validator.heldout_loaders] == data.stores
        next(iter(dl))
        parts = [str(builtin_store_path(part=p).resolve()) for p in ("docs", "stdlib")]
        assert opened == Counter(dict.fromkeys(parts, 1))
    finally:
        dl.close()


def test_without_the_trainers_data_the_builders_refuse_and_open_nothing(tmp_path, opened):
    """0.3: TorchTitan builds the components from their configs alone (no job config to
    open the data from): a Zephon dataloader or validator built without Zephon's
    trainer refuses, naming the entry point, before it opens any store."""
    config = trainer_config(tmp_path / "run", heldout_samples=16)
    with pytest.raises(ValueError, match="built by Zephon's trainer.*torchtitan_zephon.train"):
        config.dataloader.build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=32, local_batch_size=2
        )
    with pytest.raises(ValueError, match="validator .*built by Zephon's trainer"):
        config.validator.build(
            parallelism=None, dp_world_size=1, dp_rank=0, tokenizer=None,
            parallel_dims=None, loss_fn=None, validation_context=None,
            metrics_processor=None, seq_len=32, local_batch_size=2,
        )  # fmt: skip
    assert sum(opened.values()) == 0
    assert not (tmp_path / "run").exists()


def test_the_trainer_hands_its_job_data_to_the_configs_torchtitan_builds(
    tmp_path, opened, titan_builds
):
    """ZephonTrainer hands the job data its preflight opened to the dataloader and the
    validator TorchTitan's Trainer.__init__ builds (its build context): both read that
    object."""
    config = trainer_config(tmp_path / "run", heldout_samples=16)
    data, dl, validator = start_like_the_trainer(config, titan_builds, 1, 0)
    try:
        assert data is not None and dl.loader.data is data
        assert validator.zephon_job.data is data and sum(opened.values()) == 1
    finally:
        dl.close()


def test_the_data_config_is_built_once_across_preflight_dataloader_and_validator(
    tmp_path, titan_builds, monkeypatch
):
    """Issue 29 (c2): the preflight builds the job's data config once; the dataloader's
    loader and its sequence log use that very object."""
    from torchtitan_zephon.order.data_config import DataConfig

    built: list[DataConfig] = []
    real = DataConfig.make.__func__

    def counting(cls, *args, **kwargs):  # noqa: ANN001, ANN202
        built.append(real(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(DataConfig, "make", classmethod(counting))
    config = trainer_config(tmp_path / "run", heldout_samples=16)
    _, dl, _ = start_like_the_trainer(config, titan_builds, 2, 0)
    try:
        next(iter(dl))
        assert len(built) == 1
        assert dl.loader.config is built[0] and dl.tracker.config is built[0]
    finally:
        dl.close()
