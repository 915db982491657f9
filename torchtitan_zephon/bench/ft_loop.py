"""One replica group's training loop for ``zephon bench ft``'s quorum cost: a registry
job's model (on CPU, as Zephon's trainer builds it) trained on one fixed batch under a
real torchft ``Manager``, with a synchronous quorum (Zephon's: the quorum is known before
the data is drawn) or an asynchronous one (TorchTitan 0.3's ``TorchFTManager``: the
quorum runs while the forward does). Prints one JSON object: every step's seconds.

    python -m torchtitan_zephon.bench.ft_loop MODE REPLICA LIGHTHOUSE CONFIG BATCH STEPS

Invariant: the two modes run the same model, batch and step (quorum, forward, backward,
one all-reduce of every gradient, the commit vote, an SGD update); only
``use_async_quorum`` differs.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F


def build_model(config_name: str) -> tuple[torch.nn.Module, object, int, int]:
    """The registry job's model on CPU, initialised; (model, model config, vocab, seq_len)."""
    from torchtitan_zephon.configs import config_registry
    from torchtitan_zephon.titan import platform

    config = getattr(config_registry, config_name)()
    platform.cpu_config_defaults(config)
    spec = config.model_spec.model
    with torch.device("meta"):
        model = spec.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, spec, int(spec.vocab_size), int(config.training.seq_len)


def main(mode: str, replica: int, lighthouse: str, config: str, batch: int, steps: int) -> None:
    from torch.distributed import ReduceOp, TCPStore

    from torchtitan_zephon.titan.components.attention import with_document_masks
    from torchtitan_zephon.titan.ft.launch import free_port
    from torchtitan_zephon.titan.ft.quorum import start_manager

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, spec, vocab, seq_len = build_model(config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq_len).expand(batch, seq_len)
    extra = with_document_masks(spec, {"positions": positions})
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4)
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    manager = start_manager(
        replica_id=replica, min_replica_size=2, lighthouse=lighthouse,
        timeout=timedelta(seconds=120), group_rank=0, group_world_size=1,
        store_addr="127.0.0.1", store_port=port, use_async_quorum=mode == "async",
    )  # fmt: skip
    times, quorum_s = [], []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            manager.start_quorum()  # sync: returns with the quorum; async: at once
            quorum_s.append(time.perf_counter() - t0)
            logits = model(inputs, **extra)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()  # async: waits for it
            at = 0
            for p in params:
                p.grad.copy_(flat[at : at + p.numel()].view_as(p.grad))
                at += p.numel()
            if manager.should_commit():
                opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
    finally:
        manager.shutdown(wait=False)
        del store
    print(json.dumps({"mode": mode, "step_s": times, "quorum_call_s": quorum_s}))


if __name__ == "__main__":
    m, r, url, cfg, b, n = sys.argv[1:7]
    main(m, int(r), url, cfg, int(b), int(n))
