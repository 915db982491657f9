"""The three loaders ``zephon bench loader`` compares, each built as its users build it.

Role: ``stock_loader`` is stock TorchTitan 0.3's ``HuggingFaceTextDataLoader`` (its
``HuggingFaceTextDataset`` in a ``ParallelAwareDataloader``) over a local JSONL
file (tokenizing on the fly, as TorchTitan trains); ``torchdata_loader`` is
torchdata's ``StatefulDataLoader`` over a map-style dataset of the store's
pre-tokenized windows (loader overhead alone); ``zephon_loader`` is the Zephon loader over the same store,
``state_at`` its data state at a step and ``trainer_record_bytes`` that state's
size as the trainer checkpoints it. ``forever``, ``shutdown`` and
``stock_rank_state`` drive and inspect them side by side.

Invariant: all three yield the same shape, ``local_batch x seq_len`` input
tokens per batch, from the same corpus (the builtin store's documents).
"""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_zephon.bench.builtin_corpus import TOKENIZER_DIR
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.store.reader import TokenStore

DATASET_NAME = "zephon_bench_corpus"


# ---------------------------------------------------------------- stock TorchTitan


def _register_stock_dataset(jsonl: Path, cache_dir: Path) -> None:
    """Make ``HuggingFaceTextDataset(DATASET_NAME, path)`` read a local JSONL file."""
    import torchtitan_zephon.titan  # noqa: F401  (lets torchtitan import without triton)

    # isort: split
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = DatasetConfig(
        path=str(jsonl),
        loader=lambda p: load_dataset(
            "json", data_files=p, split="train", cache_dir=str(cache_dir)
        ),
        sample_processor=lambda sample: sample["text"],
    )


def stock_loader(
    jsonl: Path, cache_dir: Path, seq_len: int, batch: int, workers: int, dp_rank: int = 0,
    dp_degree: int = 1,
) -> Any:  # fmt: skip
    """Stock TorchTitan 0.3's text loader, ``HuggingFaceTextDataLoader``, built from its
    config with the keyword arguments TorchTitan's Trainer passes (``config.build``)."""
    _register_stock_dataset(jsonl, cache_dir)
    import datasets
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13
    logging.getLogger().setLevel(logging.ERROR)  # TorchTitan's "re-looped" warning per epoch
    config = HuggingFaceTextDataLoader.Config(
        dataset=DATASET_NAME,
        dataset_path=str(jsonl),
        infinite=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers else None,
    )
    return config.build(
        dp_world_size=dp_degree,
        dp_rank=dp_rank,
        tokenizer=HuggingFaceTokenizer(tokenizer_path=str(TOKENIZER_DIR)),
        seq_len=seq_len,
        local_batch_size=batch,
    )


# ---------------------------------------------------------------- torchdata, map-style


class StoreWindows(torch.utils.data.Dataset):
    """Map-style dataset: item k is the k-th window of one epoch of the Zephon plan."""

    def __init__(self, store: TokenStore, seq_len: int, ids: np.ndarray) -> None:
        self.store, self.seq_len, self.ids = store, seq_len, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = torch.from_numpy(self.store.window(int(self.ids[k]), self.seq_len).astype(np.int64))
        return {"input": w[:-1]}, w[1:]


def torchdata_loader(store: TokenStore, seq_len: int, batch: int, workers: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    n = store.num_samples(seq_len)
    ids = DataPlan(n, 0, BatchSchedule([(1, batch)])).ids_for_positions(0, n)
    kwargs: dict[str, Any] = {"batch_size": batch, "num_workers": workers, "drop_last": True}
    if workers:
        kwargs.update(persistent_workers=True, prefetch_factor=2)
    return StatefulDataLoader(StoreWindows(store, seq_len, ids), **kwargs)


def forever(loader: Any) -> Any:
    """Iterate a finite loader forever (re-entering it at each epoch end)."""
    while True:
        yield from loader


# ---------------------------------------------------------------- Zephon


def zephon_loader(
    store: TokenStore, seq_len: int, batch: int, workers: int, *, dp_degree: int = 1,
    global_batch: int | None = None,
) -> ZephonLoader:  # fmt: skip
    gbs = global_batch or batch * dp_degree
    return ZephonLoader(
        store,
        seq_len=seq_len,
        seed=0,
        schedule=BatchSchedule([(1, gbs)]),
        dp_rank=0,
        dp_degree=dp_degree,
        local_batch_size=batch,
        num_workers=workers,
    )


def state_at(loader: ZephonLoader, step: int) -> DataState:
    """The loader's state as it would be saved after ``step - 1`` completed steps."""
    now = loader.data_state()
    return DataState(now.config, step, loader.plan.step_positions(step)[0], now.position_anchor)


def trainer_record_bytes(loader: ZephonLoader, step: int) -> tuple[int, int]:
    """(bytes of the loader state JSON, bytes of the trainer's DCP record) at ``step``.

    The trainer record is ``ZephonDataLoader.state_dict()``: ``{"zephon": JSON}``
    with the tracker head added; we count the JSON text DCP stores.
    """
    from torchtitan_zephon.tracker import genesis

    state = state_at(loader, step)
    record = state.with_tracker({"step": step - 1, "chain": genesis(state.config.fingerprint)})
    return len(json.dumps(state.to_dict()).encode()), len(record.to_json().encode())


# ---------------------------------------------------------------- side by side


def shutdown(loader: Any) -> None:
    """Stop a StatefulDataLoader's persistent workers now (not at garbage collection)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None


def stock_rank_state(loader: Any) -> tuple[int, int | None]:
    """(bytes of one DP rank's pickled state, tokens in its carried-over buffer)."""
    blob = loader.state_dict()[loader._rank_id]
    inner = pickle.loads(blob)
    ds = inner.get("dataset_state") if isinstance(inner, dict) else None
    # TorchTitan 0.3 carries the packed tokens over as inputs_buffer (0.2.2: token_buffer)
    key = next(
        (k for k in ("inputs_buffer", "token_buffer") if isinstance(ds, dict) and k in ds), None
    )
    buffer = len(ds[key]) if key else None
    return len(blob), buffer
