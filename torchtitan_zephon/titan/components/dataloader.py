"""The Zephon dataloader as a TorchTitan 0.3 component: one DP rank's slice of the
global order, checkpointed as one world-size-independent record.

Selected with ``dataloader=ZephonDataLoader.Config(...)`` in any model's trainer
config; built by TorchTitan's Trainer with its keyword arguments (DP coordinates,
tokenizer, seq_len, local batch size). What it needs beyond those, the job's view
and the job's data as the preflight opened them, come as one more build keyword,
``job`` (``job_data.ZephonJob``, the public seam another trainer uses too), or from
the ``job_data.build_context`` Zephon's trainer opens around TorchTitan's build;
built without either, it refuses, naming the trainer to use.

Invariant: ``state_dict()`` returns the same record on every rank of every
topology: ``{"zephon": <JSON text>}``, the ``order.state.DataState`` (data config,
next step, consumed positions, anchor) with the sequence tracker's chain head. It
replaces TorchTitan's per-DP-rank pickles, so DCP saves it once (under
``dataloader``) and any world size can load it. Every batch is
``({"input": [b, L], "positions": [b, L]}, labels [b, L])``; the positions restart at
each window's first token and after each EOS (``attention.document_positions``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools.logging import logger

from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.order.data_config import DataStateMismatch
from torchtitan_zephon.order.mixture.plan import deviation_warning
from torchtitan_zephon.order.resume import ResumeDecision
from torchtitan_zephon.order.state import RECORD_KEY, DataState
from torchtitan_zephon.order.stream import StreamPlan
from torchtitan_zephon.titan.components.attention import document_positions
from torchtitan_zephon.titan.settings.job_view import JobView, batch_schedule
from torchtitan_zephon.titan.start.decision import with_trainer_hint
from torchtitan_zephon.titan.start.job_data import (
    ZephonJob,
    check_tokenizer,
    eos_id_of,
    job_to_build,
)
from torchtitan_zephon.tracker import SequenceTracker, log_path, window_digests
from torchtitan_zephon.tracker.writer import StepDigests


class ZephonDataLoader(BaseDataLoader):
    """One DP rank's view of the global sample order, as TorchTitan expects it.

    Yields ``({"input": LongTensor[b, L], "positions": LongTensor[b, L]}, labels)``
    micro-batches. With audit level ``tokens`` it also keeps a 16-byte digest per
    delivered sample, per step, so the trainer can hash the tokens each rank really
    received.

    Everything the sequence log needs that grows with the batch (the step's global
    ids digest, the per-sample token digests) is computed by a background thread,
    ahead of the step where possible: the training thread only collects results.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "zephon"
        """Informational: the data is zephon.store / zephon.mixture."""

        num_workers: int = 0
        """Background threads that read and gather samples (0: with zephon.prefetch, one)."""

        pin_memory: bool = False
        """Put batches in pinned memory (faster host-to-GPU copies)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
        job: ZephonJob | None = None,
    ) -> None:
        """TorchTitan's build keywords, and ``job``: the job's view, data and data config
        opened once (``job_data.ZephonJob``; None: the open ``job_data.build_context``'s,
        as Zephon's trainer builds it)."""
        handoff = job_to_build(job, "dataloader (ZephonDataLoader.Config)")
        job, data = handoff.view, handoff.data
        self.config = config
        zc = job.zephon
        # Before anything else: a bad layout fails in milliseconds.
        schedule = batch_schedule(job)
        schedule.check_layout(dp_world_size, local_batch_size)
        if job.pp > 1:  # micro-batches of the pipeline's size, local_batch_size per schedule call
            schedule.check_layout(dp_world_size, job.local_batch_size)
        check_tokenizer(data, tokenizer)
        if data.seq_len != seq_len:
            raise ValueError(
                f"the job's data was opened for seq_len {data.seq_len} but TorchTitan builds "
                f"the dataloader for seq_len {seq_len}"
            )
        self.loader = ZephonLoader(
            data,
            seq_len=seq_len,
            data_config=handoff.data_config,  # the job's, built once (preflight)
            dp_rank=dp_rank,
            dp_degree=dp_world_size,
            local_batch_size=local_batch_size,
            num_workers=config.num_workers,
            prefetch=zc.prefetch,
            pin_memory=config.pin_memory,
            vocab_size=job.vocab_size,  # exact: refuses ids beyond the embedding
            last_step=job.steps if job.steps > 0 else None,  # read ahead no further
        )
        rank = int(os.environ.get("RANK", "0"))
        _check_plan(self.loader.plan, data, job)
        self.eos_id = eos_id_of(data)
        self.tracker = SequenceTracker(
            log_path(job.dump_folder),
            config=self.loader.config,
            writer=rank == 0,
            enabled=zc.audit != "off",
        )
        self.audit = zc.audit
        self.allow_changes = list(zc.allow_changes)
        self.ignore_log_mismatch = zc.ignore_log_mismatch
        self.topology = topology_from_env(dp_world_size, job)
        self.resumed_from: int | None = None
        self._digests: dict[int, list[Future]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-digest")
        self.ids_digests = StepDigests(
            lambda: self.loader.plan, lambda step: self.tracker.config.step_key(step)
        )

    @property
    def plan(self):  # noqa: ANN201 - DataPlan
        return self.loader.plan

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        mb_per_step = self._microbatches_per_step
        step = self.loader.next_step
        delivered = 0
        for input_dict, labels in self.loader:
            if delivered == 0 and self.tracker.enabled:
                self.ids_digests.ahead(step)
                self.ids_digests.ahead(step + 1)
            if self.audit == "tokens":
                self._digests.setdefault(step, []).append(
                    self._pool.submit(window_digests, input_dict["input"], labels)
                )
            input_dict["positions"] = document_positions(input_dict["input"], self.eos_id)
            yield input_dict, labels
            delivered += 1
            if delivered == mb_per_step(step):
                step, delivered = step + 1, 0

    def _microbatches_per_step(self, step: int) -> int:
        return self.loader.grad_accumulation_steps(step)

    def step_token_digests(self, step: int) -> bytes:
        """This rank's per-sample digests of ``step``, in delivery order (then forgotten)."""
        return b"".join(f.result() for f in self._digests.pop(step, []))

    # -- checkpoint ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.tracker.sync()  # the checkpoint will name this head: its record must be durable
        state = self.loader.data_state().with_tracker(self.tracker.head())
        return {RECORD_KEY: state.to_json()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if RECORD_KEY not in state_dict:
            raise ValueError(
                "the checkpoint's dataloader state is not a Zephon record (keys: "
                f"{sorted(state_dict)}); it was written by another dataloader (stock TorchTitan?). "
                "Start a new --dump_folder, or load only the model with "
                "--checkpoint.initial_load_path and --checkpoint.initial_load_model_only."
            )
        try:
            self.resume(DataState.from_json(state_dict[RECORD_KEY]), self.allow_changes)
        except DataStateMismatch as e:
            raise with_trainer_hint(e) from None

    def resume(
        self,
        saved: DataState,
        allow_changes: Sequence[str] = (),
        *,
        healed: tuple[int, list[bytes], dict[str, Any]] | None = None,
    ) -> ResumeDecision:
        """The one way into a resume of this rank's data: decide it
        (``job.plans.decide_resume``, with ``allow_changes`` opted in), continue the loader
        at ``saved``'s next step, forget what was computed under the plan before, and
        continue the sequence log. A DCP load (``load_state_dict``) continues the log from
        the checkpoint's chain head (``SequenceTracker.continue_from``); torchft healing
        passes ``healed``: (this group's step, the peers' log lines it missed, their chain
        head), which the tracker appends (``SequenceTracker.healed``). Raises
        ``DataStateMismatch`` naming a refused change, with nothing moved."""
        decision = self.loader.load_state_dict(saved, allow_changes=allow_changes)
        self.tracker.config = self.loader.config  # a resume may keep the saved mixture rule
        self.ids_digests.reset()  # computed under the plan before the resume
        self._digests.clear()
        if healed is not None:
            own_step, lines, head = healed
            self.tracker.healed(own_step, lines, head, self.topology)
            return decision
        done = self.loader.next_step - 1
        details: dict[str, Any] = {}
        if decision.accepted:
            details["accepted_changes"] = list(decision.accepted)
        if decision.extended:
            details["extended"] = list(decision.extended)
            logger.info(
                f"Zephon: {', '.join(decision.extended)} gained entries for steps after {done}: "
                "an exact continuation"
            )
        for note in decision.notes:
            logger.info(f"Zephon: {note}")
        if decision.notes:
            details["notes"] = list(decision.notes)
        warning = self.tracker.continue_from(
            saved.tracker,
            done,
            self.topology,
            ignore_mismatch=self.ignore_log_mismatch,
            details=details,
        )
        if warning is not None:
            logger.warning(f"Zephon: {warning}")
        self.resumed_from = done
        logger.info(
            f"Zephon: resuming at step {self.loader.next_step} (position "
            f"{saved.consumed_positions}) under DP degree {self.loader.dp_degree}"
        )
        return decision

    def close(self) -> None:
        self.loader.close()
        self.ids_digests.close()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _check_plan(plan: StreamPlan, data: Any, job: JobView) -> None:
    """Refuse a plan that runs a mixture's source past its max_epochs within
    training.steps; on rank 0, log the data's warnings (a store or a mixture's source
    smaller than a global batch) and a mixture's worst deviation from the exact
    targets."""
    if job.steps:
        plan.check_max_epochs(int(job.steps))
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for warning in data.warnings:
        logger.warning(f"Zephon: {warning}")
    report = plan.deviation_report()
    if report is None:  # one store: its count is its target
        return
    worst, who, step = report
    warning = deviation_warning(worst, who, step)
    if warning:
        logger.warning(f"Zephon: {warning}")
    logger.info(
        f"Zephon: mixture {data.path} of {len(plan.names)} sources ({', '.join(plan.names)}): "
        f"every source's sample count stays within {float(worst):.3f} samples of its exact "
        f"target at every step (worst: {who!r})"
    )


def topology_from_env(dp_degree: int, job: JobView) -> dict[str, Any]:
    """What a start or resume event records of the job's layout; a torchft replica
    group's also its replica_id and group_size, and ``reproducible`` (true) with
    ``zephon.reproducible`` (what ``zephon compare`` reads)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    ft = job.fault_tolerance
    return {
        "world_size": world,
        "dp_degree": dp_degree,
        "nnodes": max(1, world // max(1, local)),
        "tp_degree": job.tp,
        "local_batch_size": job.local_batch_size,
        **({"replica_id": ft.replica_id, "group_size": ft.group_size} if ft.enable else {}),
        **({"reproducible": True} if job.zephon.reproducible else {}),
    }
