"""Shared end-to-end runs: uninterrupted references that several tests compare against
(the 2-rank ``reference`` and its resume on one rank are tests/conftest.py's, shared
with tests/cli); the tiny model the validator tests evaluate."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from tests.titan.launch import train


@pytest.fixture(scope="session")
def reference_one_rank(e2e_root: Path) -> Path:
    """1 CPU rank, 8 steps; validation micro-batches of 3 (8 samples per pass: 3 + 3 + 2)."""
    return train(e2e_root / "one_rank", 1, "--validation.local_batch_size", "3").check().run


@pytest.fixture(scope="session")
def reference_fsdp_tp(e2e_root: Path) -> Path:
    """4 CPU ranks, FSDP 2 x TP 2, 8 steps."""
    return (
        train(e2e_root / "reference_fsdp_tp", 4, "--parallelism.tensor_parallel_degree", "2")
        .check()
        .run
    )


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """The tiny registry job's model as Zephon's trainer builds it on CPU (DocumentSDPA
    attention), initialised once (the validator tests' model)."""
    from torchtitan_zephon.configs.config_registry import llama3_tiny
    from torchtitan_zephon.titan import platform

    config = llama3_tiny()
    platform.cpu_config_defaults(config)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


@contextlib.contextmanager
def lighthouse_at(min_replicas: int = 1, heartbeat_timeout_ms: int = 5000):
    """A real ``torchft_lighthouse`` (torchft's Rust binary, installed with the package)
    on a free loopback port, forming quorums of at least ``min_replicas`` groups; yields
    its ``TORCHFT_LIGHTHOUSE`` address, stopped afterwards. A group silent for
    ``heartbeat_timeout_ms`` is dropped from the next quorum (``titan.ft.launch``)."""
    from torchtitan_zephon.titan.ft.launch import local_lighthouse

    with local_lighthouse(min_replicas, heartbeat_timeout_ms) as url:
        yield url


@pytest.fixture
def lighthouse():
    """``lighthouse_at(1)`` for one test."""
    with lighthouse_at(1) as url:
        yield url
