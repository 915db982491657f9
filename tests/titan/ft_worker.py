"""One replica group of the torchft reduction test (tests/titan/test_ft_quorum.py): a real
torchft Manager on its own TCPStore, a synchronous quorum at a real lighthouse, this
group's part of a fixed step trained, one reduction, the commit vote; the result saved.

python -m tests.titan.ft_worker REPLICA_ID MIN_REPLICAS LIGHTHOUSE GBS OUT
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.nn.functional as F

from tests.titan.launch import free_port
from torchtitan_zephon.order.layout import part_slice
from torchtitan_zephon.titan.ft.quorum import (
    SharedReplicaId,
    check_replica_ids,
    join_quorum,
    reduce_step,
    start_manager,
)

TOKENS, WIDTH, CLASSES = 4, 6, 5


def model_and_step(gbs: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The same model and the same global batch in every group (seeded)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES)
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(gbs, TOKENS, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (gbs, TOKENS), generator=g)
    return model, x, y


def loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, CLASSES), y.reshape(-1), reduction="sum")


def main(replica_id: int, min_replicas: int, lighthouse: str, gbs: int, out: str) -> None:
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    manager = start_manager(
        replica_id=replica_id, min_replica_size=min_replicas, lighthouse=lighthouse,
        timeout=timedelta(seconds=60), group_rank=0, group_world_size=1,
        store_addr="127.0.0.1", store_port=port,
    )  # fmt: skip
    try:
        quorum = join_quorum(manager, wait_for=min_replicas, within_s=60)
        try:
            members = check_replica_ids(manager, replica_id, min_replicas, quorum.part)
        except SharedReplicaId as e:
            torch.save({"shared": str(e)}, out)
            return
        model, x, y = model_and_step(gbs)
        first, count = part_slice(0, gbs, 1, quorum.part, quorum.parts)
        mine = loss_sum(model, x[first : first + count], y[first : first + count])
        scaled = mine / (gbs * TOKENS)  # over the tokens of the whole step, not the part
        scaled.backward()
        grads = [p.grad for p in model.parameters()]
        loss = reduce_step(manager, grads, scaled)
        commit = manager.should_commit()
        torch.save(
            {"part": quorum.part, "parts": quorum.parts, "count": count, "loss": loss,
             "grads": [g.clone() for g in grads], "commit": commit, "members": members},
            out,
        )  # fmt: skip
    finally:
        manager.shutdown(wait=False)
        del store


if __name__ == "__main__":
    rid, n, lighthouse, gbs, out = sys.argv[1:6]
    main(int(rid), int(n), lighthouse, int(gbs), out)
