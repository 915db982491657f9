"""torchft's Manager as Zephon drives it: a synchronous quorum before each step's data,
and one token-weighted reduction across the participating groups per step.

Role: ``start_manager`` builds torchft's ``Manager`` for this replica group with a
synchronous quorum (``use_async_quorum=False``: the quorum, and any healing it brings,
is complete before the step's data is drawn, so every member participates and its
part is known), a reconfigurable gloo or NCCL process group across the groups, and the
replica id ``zephon_ft_<replica_id>`` (torchft appends a uuid to it). ``join_quorum``
runs one step's quorum and says which part of the step this group trains (a group's
first step waits, within a bound, for a quorum of every group started with it)
(``StepQuorum``: participant ``part`` of ``parts``, the cut of ``order.layout``).
``reduce_step`` sums, across the participants, every gradient and the step's loss sum
in one flat buffer: one collective per step, whatever the number of micro-batches each
group ran (at ``zephon.audit tokens``, ``sum_across_groups`` adds one more for the
step's per-sample token digests, each group's in its own slots). ``check_replica_ids``
refuses two groups with one replica id, which torchft itself accepts.

Invariant (the reduction): each group's gradients are those of its tokens' loss sum
divided by the tokens of the whole step B(s), not of its own part, so their SUM across
the groups is the gradient of the mean loss over B(s) whatever the parts' sizes (three
groups at a global batch of 8 train 3, 3 and 2 samples and still weigh each token
alike); torchft's AVG, which divides by the number of participants, is never used. The
reduced loss sum is likewise the mean loss over B(s), the number one group without
torchft logs at that step. A group that does not participate contributes zeros
(torchft zeroes its tensor). Initial weights need no sync at step 0: Zephon's are a
function of the seed and the model config alone (``titan.weights``).

Invariant (the survivors of a kill meet again): a group waits for a quorum
``QUORUM_TIMEOUT_FACTOR`` times as long as a collective may hang. When a group dies in
a step's reduction, one survivor may see the error at once while another hangs in the
collective until the process-group timeout; the lighthouse forms no quorum of a
minority of the groups still heartbeating (torchft's split-brain rule), so the first
survivor's quorum request must outlast the second's hang, or it fails first and that
group stops (measured here: both at 120 s, the first one's request expired 12 ms
before the other's collective).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

QUORUM_POLL_S = 0.2
"""How soon a group's first step first asks again for a quorum of every group."""
QUORUM_POLL_MAX_S = 2.0
"""The longest a group's first step waits between two asks (the wait doubles up to it)."""

QUORUM_TIMEOUT_FACTOR = 3
"""A quorum request waits this many collective timeouts (module docstring): a peer hung
in a collective until its timeout then joins, with time to spare for its restart of
the process group."""
REPLICA_PREFIX = "zephon_ft_"
"""The replica id Zephon gives torchft for group ``I``: ``zephon_ft_I``."""


@dataclass(frozen=True)
class StepQuorum:
    """What one step's quorum tells this group: it trains part ``part`` of ``parts``."""

    part: int
    parts: int


def start_manager(
    *,
    replica_id: int,
    min_replica_size: int,
    lighthouse: str,
    process_group: str = "gloo",
    timeout: timedelta = timedelta(seconds=60),
    group_rank: int | None = None,
    group_world_size: int | None = None,
    store_addr: str | None = None,
    store_port: int | None = None,
    use_async_quorum: bool = False,
) -> Any:
    """torchft's ``Manager`` for this replica group, with a synchronous quorum (module
    docstring). The group's TCPStore (``store_addr``/``store_port``, else torchrun's
    ``MASTER_ADDR``/``MASTER_PORT``) must be up; group rank 0 serves the group's manager
    and talks to the lighthouse at ``lighthouse``. ``use_async_quorum``: only for
    ``zephon bench ft``'s baseline (TorchTitan's ``TorchFTManager``); the trainer never
    sets it."""
    import torchft

    if process_group == "gloo":
        pg = torchft.ProcessGroupGloo(timeout=timeout)
    elif process_group == "nccl":
        pg = torchft.ProcessGroupNCCL(timeout=timeout)
    else:
        raise ValueError(f"fault_tolerance.process_group {process_group!r}: gloo or nccl")
    return torchft.Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replica_size,
        use_async_quorum=use_async_quorum,
        timeout=timeout,
        quorum_timeout=timeout * QUORUM_TIMEOUT_FACTOR,
        connect_timeout=timeout,
        rank=group_rank,
        world_size=group_world_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=f"{REPLICA_PREFIX}{replica_id}",
        init_sync=False,
    )


def join_quorum(
    manager: Any, *, wait_for: int = 1, within_s: float = 0.0, say: Any = None
) -> StepQuorum:
    """Run this step's quorum (synchronous: healing, if any, is applied on return) and
    say which part of the step this group trains. With ``wait_for`` groups, ask again
    (every ``QUORUM_POLL_S``) until the quorum holds that many or ``within_s`` passed:
    a group's first step waits so for the groups started with it, which would otherwise
    each find a quorum of their own and have to heal from one another. A quorum that
    heals this group ends the wait: its peers are ahead, a running job it joins (asking
    again would leave them waiting on it in their reduction). The wait is said once
    (``say``: how many groups are missing, and for how long at most), and asked again
    every ``QUORUM_POLL_S``, then less often (up to ``QUORUM_POLL_MAX_S``): each ask is a
    quorum request torchft logs."""
    deadline = time.monotonic() + within_s
    before = manager.current_step()
    poll, told = QUORUM_POLL_S, False
    while True:
        manager.start_quorum()
        got = manager.num_participants()
        if got >= wait_for or manager.current_step() != before or time.monotonic() >= deadline:
            break
        if not told and say is not None:
            left = max(0.0, deadline - time.monotonic())
            say(
                f"torchft: {got} of the {wait_for} replica groups are in the quorum; waiting "
                f"for {wait_for - got} more, at most {left:.0f} s (comm.init_timeout_seconds), "
                "then training with the groups present"
            )
            told = True
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        poll = min(2 * poll, QUORUM_POLL_MAX_S)
    part = manager.participating_rank()
    if part is None:  # with a synchronous quorum every member participates
        raise RuntimeError("torchft: this group is in the quorum but does not participate")
    return StepQuorum(int(part), int(manager.num_participants()))


def reduce_step(manager: Any, grads: list[torch.Tensor], loss_sum: torch.Tensor) -> float:
    """Sum ``grads`` (in place) and ``loss_sum`` over the participating groups in one
    collective (module docstring: each already divided by the tokens of all of B(s));
    returns the summed loss. Every group passes its gradients in the same order."""
    flat = torch.cat(
        [g.detach().reshape(-1).to(torch.float32) for g in grads]
        + [loss_sum.detach().reshape(1).to(torch.float32).to(grads[0].device if grads else "cpu")]
    )
    from torch.distributed import ReduceOp

    manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
    at = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[at : at + n].view_as(g))
        at += n
    return float(flat[at])


def sum_across_groups(manager: Any, values: torch.Tensor) -> torch.Tensor:
    """``values`` (int64) summed over the participating groups, in place: each group
    fills only its own slots (its part's per-sample token digests), so the sum is every
    participant's slots in part order."""
    from torch.distributed import ReduceOp

    manager.allreduce(values, reduce_op=ReduceOp.SUM).wait()
    return values


class SharedReplicaId(RuntimeError):
    """Two replica groups of one quorum run with the same ``fault_tolerance.replica_id``."""


def check_replica_ids(manager: Any, replica_id: int, group_size: int, part: int) -> list[int]:
    """Refuse a quorum in which two groups share a replica id (torchft accepts them: it
    appends a uuid to each id), and return the replica ids of the quorum's participants
    in part order (what the sequence log's quorum event records: who trained which
    part). Every participant marks its id's slot and writes its part + 1 beside it; the
    slots are summed across the groups, and a slot above one stops each group sharing
    it, naming the id. Skipped when the quorum failed meanwhile (the next change checks
    again; then the members are not known: [])."""
    from torch.distributed import ReduceOp

    slots = torch.zeros(2 * group_size, dtype=torch.float32)
    slots[replica_id] = 1.0
    slots[group_size + replica_id] = float(part + 1)
    manager.allreduce(slots, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return []
    if float(slots[replica_id]) > 1.0:
        raise SharedReplicaId(
            f"{int(slots[replica_id])} replica groups in this quorum run with "
            f"--fault_tolerance.replica_id {replica_id}: each group needs its own id in "
            f"[0, {group_size}). Restart this group with a free id; its run folder is kept."
        )
    members = {int(slots[group_size + i]) - 1: i for i in range(group_size) if slots[i] == 1.0}
    return [members[k] for k in sorted(members)]
