"""ZephonTrainer: TorchTitan's Trainer with the platform layer, a global batch size
schedule, the Global Sequence Tracker, and one job per run folder.

Invariant: the training loop is TorchTitan's own; this subclass only (1) adjusts
the job for the CPU, checks the start (``preflight.plan_start``) and takes the
run folder (``ownership.lock.RunFolderLock``, global rank 0) before TorchTitan builds
or writes anything, so a refused start changes nothing on disk; the job's data
the preflight opened is the one object the dataloader and the validator read
(``with_job_data``: each store is opened once per process); (2) sets the
gradient accumulation of each step from the batch schedule; (3) after each
completed step appends the step's record to the sequence log (global rank 0),
combining the DP ranks' token digests in rank order at audit level ``tokens``;
(4) releases the run folder when the job ends cleanly (after a failure the lock
stays, so an elastic restart of the same job recognises itself, and any other
job takes over a dead holder's lock within one lease). What it refuses or stops
for it raises as ``SettingRefused`` / ``JobStopped`` (or the preflight's own
errors), whose messages say it all: the entry point reports them without a
traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
from typing import Any

import torch.distributed as dist
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.ownership.lock import RunFolderLock
from torchtitan_zephon.ownership.process import torchrun_agent
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.titan import platform, preflight
from torchtitan_zephon.titan.checks import check_job_config
from torchtitan_zephon.titan.dataloader import ZephonDataLoader, build_zephon_dataloader
from torchtitan_zephon.titan.validate import build_zephon_validator
from torchtitan_zephon.tracker import TrackerError


def with_job_data(spec: Any, data: JobData | None) -> Any:
    """``spec`` (a TorchTitan ``TrainSpec``) whose Zephon dataloader and validator
    builders (or wrappers declaring them, ``functools.wraps``) read ``data``, the job's
    data as the preflight opened it, instead of opening it again. Other builders, and
    every builder when ``data`` is None, are left as they are."""
    if data is None:
        return spec
    changes = {}
    for name, ours in (
        ("build_dataloader_fn", build_zephon_dataloader),
        ("build_validator_fn", build_zephon_validator),
    ):
        fn = getattr(spec, name)
        if fn is not None and inspect.unwrap(fn) is ours:
            changes[name] = functools.partial(fn, data=data)
    return dataclasses.replace(spec, **changes)


class SettingRefused(Exception):
    """``check_job_config`` refused a setting before TorchTitan built anything; the
    check's ``ValueError`` is the ``__cause__``, and it is what the user is shown."""


class JobStopped(RuntimeError):
    """Training stopped at ``step`` for a reason the message states in full (what was
    found, what to do): a store changed after preparation, the run folder lost, ranks
    that read different data, a checkpoint that mixes two runs."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


class ZephonTrainer(Trainer):
    dataloader: ZephonDataLoader

    def __init__(self, job_config: Any) -> None:
        self._tracking = False
        try:  # before TorchTitan builds anything: clear errors
            check_job_config(job_config)
        except ValueError as e:
            raise SettingRefused(str(e)) from e
        if platform.on_cpu():
            for change in platform.cpu_job_defaults(job_config):
                logger.info(f"CPU platform: {change}")
        # Everything that can refuse the start runs before TorchTitan writes anything
        # (its TensorBoard writer is created in Trainer.__init__).
        self._lock, self._data = self._take_run_folder(job_config)
        super().__init__(job_config)
        if not isinstance(self.dataloader, ZephonDataLoader):
            raise TypeError(
                f"model.name={job_config.model.name} does not build a Zephon dataloader; "
                "use a zephon_* model name (e.g. zephon_llama3)"
            )

    @property
    def train_spec(self) -> Any:
        return self._train_spec

    @train_spec.setter
    def train_spec(self, spec: Any) -> None:
        # TorchTitan's Trainer.__init__ sets its train spec and builds the dataloader
        # and the validator through it: this trainer's copy hands them its job data.
        self._train_spec = with_job_data(spec, getattr(self, "_data", None))

    @staticmethod
    def _take_run_folder(job_config: Any) -> tuple[RunFolderLock | None, JobData | None]:
        """Check the start on every rank (reads only); global rank 0 then takes the run
        folder. Returns rank 0's lock (None elsewhere) and the job's data."""
        rank = int(os.environ.get("RANK", "0"))
        lock = verdict = None
        if rank == 0:
            lock = RunFolderLock(job_config.job.dump_folder)
            verdict = lock.check()
        plan = preflight.plan_start(
            job_config, writer=rank == 0, same_job=verdict is not None and verdict.same_job
        )
        if lock is None or verdict is None:
            return None, plan.data
        lock.acquire(verdict)
        if verdict.kind == "same_job":
            logger.info(
                f"Zephon: run folder lock taken over from this job's earlier attempt "
                f"({verdict.holder.describe() if verdict.holder else '?'}): an elastic restart"
            )
        elif verdict.kind == "dead":
            logger.warning(
                f"Zephon: run folder lock taken over from a dead job "
                f"({verdict.holder.describe() if verdict.holder else 'unreadable lock'}) after "
                f"{verdict.waited_s:.1f} s"
            )
        if plan.notes:
            preflight.log_plan(plan)
        return lock, plan.data

    def init_distributed(self) -> Any:
        """TorchTitan's, then rank 0 records every rank's torchrun agent in the lock: a
        restart whose new rank 0 runs under any of them is this same job."""
        dims = super().init_distributed()
        agent, _, _ = torchrun_agent()
        agents: list[Any] = [agent]
        if dist.is_initialized() and dist.get_world_size() > 1:
            agents = [None] * dist.get_world_size()
            dist.all_gather_object(agents, agent)
        if self._lock is not None:
            self._lock.set_agents(a for a in agents if a is not None)
        return dims

    def train(self) -> None:
        """TorchTitan's loop; a store or sequence log that fails once training has begun
        (a ``tokens.bin`` changed after preparation, ...) stops it as ``JobStopped``.
        Before the first step such an error is a refused start and passes as it is."""
        try:
            super().train()
        except (StoreError, TrackerError) as e:
            if not self._tracking:
                raise
            raise JobStopped(self.step, f"{type(e).__name__}: {e}") from e

    # -- per step --------------------------------------------------------
    def train_step(self, data_iterator: Any) -> None:
        step = self.step
        if self._lock is not None and self._lock.lost:
            raise JobStopped(
                step,
                f"this job no longer owns {self.job_config.job.dump_folder}: "
                f"{self._lock.lost} (this job missed its heartbeats for a whole lease). It stops "
                "before writing more.",
            )
        if not self._tracking:
            self._begin_tracking()
        tc = self.job_config.training
        gbs = self.dataloader.plan.schedule.gbs(step)
        self.gradient_accumulation_steps = gbs // (
            self.dataloader.loader.dp_degree * tc.local_batch_size
        )
        super().train_step(data_iterator)
        self._record_step(step)

    def _begin_tracking(self) -> None:
        """At the first step of this job: every rank reads the same data, and the data
        state and the trainer state agree."""
        dl, done = self.dataloader, self.step - 1
        self._check_same_data_everywhere()
        if dl.resumed_from is None and done > 0:
            raise JobStopped(
                self.step,
                f"the checkpoint restored the trainer at step {done} but no Zephon data state "
                "(was 'dataloader' in checkpoint.exclude_from_loading?): the data would restart "
                "at step 1. Load the data state too, or start a new job.dump_folder.",
            )
        if dl.resumed_from is not None and dl.resumed_from != done:
            raise JobStopped(
                self.step,
                f"the checkpoint's trainer state is at step {done} but its Zephon data "
                f"state is at step {dl.resumed_from}: the checkpoint folder mixes two runs",
            )
        if dl.resumed_from is None:
            dl.tracker.start(dl.topology)
        self._tracking = True

    def _check_same_data_everywhere(self) -> None:
        """Ranks that opened different stores (node-local copies that differ, another
        Python's builtin store) would silently cut batches from different orders."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        config = self.dataloader.loader.config
        mine = (
            config.store_fingerprint,
            config.fingerprint,
            str(self.dataloader.loader.store.path),
        )
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if any(f[:2] != everyone[0][:2] for f in everyone):
            lines = [
                f"  rank {r}: store {f[2]} fingerprint {f[0][:16]}..., data config {f[1][:16]}..."
                for r, f in enumerate(everyone)
            ]
            raise JobStopped(
                self.step,
                "the ranks do not read the same data:\n" + "\n".join(lines) + "\nGive every "
                "node the same store (a shared filesystem, or identical copies: compare "
                "`zephon inspect STORE` fingerprints) and the same zephon settings.",
            )

    def _record_step(self, step: int) -> None:
        dl = self.dataloader
        if not dl.tracker.enabled:
            return
        tokens = None
        if dl.audit == "tokens":
            local = dl.step_token_digests(step)
            if self.parallel_dims.dp_enabled:
                group = self.parallel_dims.get_mesh("batch").get_group()
                parts: list[Any] = [None] * dist.get_world_size(group)
                dist.all_gather_object(parts, local, group=group)
                tokens = b"".join(parts)
            else:
                tokens = local
        # Every rank advances the same chain (the checkpointed head must be identical
        # everywhere); only global rank 0 writes the log. The ids digest was computed
        # ahead, off this thread.
        first, count, digest = dl.ids_digests.take(step)
        dl.tracker.record(step, first, tokens=tokens, digest=digest, num_samples=count)

    def close(self) -> None:
        """TorchTitan's close; the run folder is released only when no exception is being
        handled (TorchTitan's ``main`` closes from its ``except`` too)."""
        if getattr(self, "dataloader", None) is not None:
            self.dataloader.close()
        super().close()
        lock = getattr(self, "_lock", None)
        if lock is not None and sys.exc_info()[1] is None:
            lock.release()
