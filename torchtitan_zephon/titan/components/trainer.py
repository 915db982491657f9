"""ZephonTrainer: TorchTitan 0.3's Trainer with Zephon's data, a global batch size
schedule, the Global Sequence Tracker, topology-free initial weights and one job
per run folder.

``ZephonTrainer.Config`` is TorchTitan's ``Trainer.Config`` plus the ``zephon``
section (``--zephon.*``), with Zephon's dataloader and validator as defaults and
``debug.seed`` 0 (TorchTitan's default, None, draws a random seed per job).

Invariant: the training loop is TorchTitan's own; this subclass only (1) checks
the job (``checks.check_job_config`` on the job's view, after fitting the chunked
loss's chunk count to ``training.seq_len``: ``loss_chunks``), checks the start
(``preflight.decide_start``) and takes the run folder
(``ownership.lock.RunFolderLock``, global rank 0) before TorchTitan builds or
writes anything, so a refused start changes nothing on disk; it then hands the
job's view and the job's data the preflight opened to the dataloader and the
validator TorchTitan builds (``job_data.build_context``: each store is opened once
per process), pins the checkpoint the preflight checked (one the 0.2.2-based code
wrote is loaded through ``old_runs``' name map; after a rollback, an explicit
``checkpoint.load_step`` K, rank 0 moves the checkpoints after K aside at the first
step, once every rank has loaded K), and wraps the model spec's
``parallelize_fn`` so the built model's ``init_weights`` is topology-free
(``init.topology_free_parallelize``, unless ``zephon.init = "torchtitan"``);
(2) sets the gradient accumulation of each step from the batch schedule (with
``zephon.reproducible``, the step is ``titan.reproducible.step``'s: exact sums); (3)
after each completed step appends the step's record to the sequence log (global
rank 0), combining the DP ranks' token digests in rank order at audit level
``tokens``, and logs the step's per-source accounting (``titan.components.accounting``, unless
``zephon.accounting`` is off), and at the first step of an accepted start writes
``zephon/run_data.json`` (global rank 0: ``job.run_data``, what Zephon's tools need
to find the run's data); (4) releases the run folder when the job ends cleanly (after a
failure the lock stays, so an elastic restart of the same job recognises itself,
and any other job takes over a dead holder's lock within one lease). What it
refuses or stops for it raises as ``SettingRefused`` / ``JobStopped`` (or the
preflight's own errors), whose messages say it all: the entry point reports them
without a traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchtitan import trainer as titan_trainer
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.metrics import BaseLogger
from torchtitan.components.validate import BaseValidator
from torchtitan.config.configs import DebugConfig
from torchtitan.experiments.torchft.config.job_config import FaultTolerance
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from torchtitan_zephon.job.run_data import record_job, run_data_path
from torchtitan_zephon.migrate import old_runs
from torchtitan_zephon.run.lock import RunFolderLock
from torchtitan_zephon.run.process import torchrun_agent
from torchtitan_zephon.store.format import DataUnreadable, StoreError, error_kind
from torchtitan_zephon.titan.components.accounting import StepAccounting
from torchtitan_zephon.titan.components.attention import with_document_masks
from torchtitan_zephon.titan.components.checkpoint_folder import keep_newest, move_abandoned
from torchtitan_zephon.titan.components.dataloader import ZephonDataLoader
from torchtitan_zephon.titan.components.validate import ZephonValidator
from torchtitan_zephon.titan.ft.heal import HEAL_KEY, Healing, HealingRefused
from torchtitan_zephon.titan.ft.quorum import SharedReplicaId, start_manager
from torchtitan_zephon.titan.ft.settings import lighthouse_url
from torchtitan_zephon.titan.ft.step import train_step_ft
from torchtitan_zephon.titan.reproducible.fixed_point import NotRepresentable
from torchtitan_zephon.titan.reproducible.gradients import ExactGradients
from torchtitan_zephon.titan.reproducible.optimizer import use_exact_steps
from torchtitan_zephon.titan.reproducible.step import train_step_reproducible
from torchtitan_zephon.titan.settings.job_view import JobView, job_view
from torchtitan_zephon.titan.settings.loss_chunks import fit_loss_chunks
from torchtitan_zephon.titan.settings.zephon_section import Zephon
from torchtitan_zephon.titan.start import preflight
from torchtitan_zephon.titan.start.checks import check_job_config
from torchtitan_zephon.titan.start.job_data import ZephonJob, build_context
from torchtitan_zephon.titan.weights.init import topology_free_parallelize
from torchtitan_zephon.tracker import TrackerError


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


class _TimeWithoutTheEndSleep:
    """``time`` as TorchTitan's trainer module sees it, less its one ``sleep``: rank 0
    sleeping 2 s at the end of ``Trainer.train`` "for other ranks to complete". Nothing
    after it waits on them: ``close`` waits for this rank's own checkpoint, ending the
    process group is local, and torchrun (whose agent holds the rendezvous store) waits
    for every worker before it returns. It was 2 s of every job and of every end-to-end
    test. TorchTitan's log line before the call ("Sleeping 2 seconds for other ranks to
    complete") is left out of the log too (``_without_the_sleep_line``): it no longer
    says what happens."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        del seconds


SLEEP_LINE = "Sleeping 2 seconds for other ranks to complete"


def _without_the_sleep_line(record: logging.LogRecord) -> bool:
    return record.msg != SLEEP_LINE


titan_trainer.time = _TimeWithoutTheEndSleep()  # type: ignore[assignment]
logger.addFilter(_without_the_sleep_line)


def zephon_debug() -> DebugConfig:
    """TorchTitan's debug section with Zephon's seed default (0: reproducible runs)."""
    return DebugConfig(seed=0)


class ZephonTrainer(Trainer):
    dataloader: ZephonDataLoader

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        dataloader: BaseDataLoader.Config = field(default_factory=ZephonDataLoader.Config)
        validator: BaseValidator.Config = field(default_factory=ZephonValidator.Config)
        debug: DebugConfig = field(default_factory=zephon_debug)
        zephon: Zephon = field(default_factory=Zephon)
        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
        """TorchTitan 0.3's torchft section (``--fault_tolerance.*``), checked by
        ``titan.ft.settings`` at start."""

    def __init__(self, config: Config) -> None:
        self._tracking = False
        self.ft: Any = None  # torchft's Manager, with --fault_tolerance.enable
        self._lock: RunFolderLock | None = None
        self.accounting: StepAccounting | None = None  # built at the first step
        self.exact: ExactGradients | None = None  # with zephon.reproducible
        try:  # before TorchTitan builds anything: clear errors
            _check_components(config)
            note = fit_loss_chunks(config, explicit=False)  # train.py fits it first
            if note:
                logger.info(f"Zephon: {note}")
            job = job_view(config)
            check_job_config(job)
            ft_url = lighthouse_url() if job.fault_tolerance.enable else None
        except ValueError as e:
            raise SettingRefused(str(e)) from e
        # Everything that can refuse the start runs before TorchTitan writes anything
        # (its TensorBoard writer is created in Trainer.__init__).
        self._lock, start = self._take_run_folder(job, config)
        self._abandoned = (job, start.abandoned)
        if start.load_step is not None:
            config.checkpoint.load_step = start.load_step
        if ft_url is not None:  # this group's torchft Manager (titan.ft.quorum), heartbeating
            ft = job.fault_tolerance  # to the lighthouse while the model is built, so that
            self.ft = start_manager(  # groups started together meet in the first quorum
                replica_id=ft.replica_id,
                min_replica_size=ft.min_replica_size,
                lighthouse=ft_url,
                process_group=ft.process_group,
                timeout=timedelta(seconds=config.comm.train_timeout_seconds),
            )
        handoff = ZephonJob(job, start.data, start.data_config)  # opened once, by the preflight
        if config.zephon.init == "zephon" and config.model_spec is not None:
            seed = 0 if config.debug.seed is None else int(config.debug.seed)
            config.model_spec = dataclasses.replace(
                config.model_spec,
                parallelize_fn=topology_free_parallelize(config.model_spec.parallelize_fn, seed),
            )
        with build_context(handoff):  # the dataloader and validator TorchTitan builds read it
            super().__init__(config)
        self.zephon_job = handoff
        if config.zephon.reproducible:  # exact sums (checked at start: one model part)
            self.exact = ExactGradients(self.model_parts[0])
            try:
                use_exact_steps(self.optimizers.optimizers)
            except ValueError as e:
                raise SettingRefused(str(e)) from e
        if start.old_run is not None:  # a 0.2.2 checkpoint: loaded through its key map
            old_runs.install(self.checkpointer, start.old_run)
        if self.ft is not None:  # what this group sends a healing peer, and takes from one
            self.ft_healing = Healing(self)
            self.ft.register_state_dict_fn(HEAL_KEY, self.ft_healing.load, self.ft_healing.save)

    def _build_accounting(self, config: Config) -> StepAccounting | None:
        """Per-source accounting (``titan.components.accounting``), unless zephon.accounting is off:
        scalars through the metrics processor's logger where it writes (the metrics
        rank), the log line and the epoch warnings on global rank 0."""
        if not config.zephon.accounting:
            return None
        sink = self.metrics_processor.logger
        return StepAccounting(
            plan=lambda: self.dataloader.plan,
            data=self.dataloader.loader.data,
            seq_len=config.training.seq_len,
            sink=None
            if type(sink) is BaseLogger or getattr(sink, "number_of_loggers", 1) == 0
            else sink.log,
            should_log=self.metrics_processor.should_log,
            writes_log=int(os.environ.get("RANK", "0")) == 0,
        )

    @staticmethod
    def _take_run_folder(job: JobView, config: Any) -> tuple[RunFolderLock | None, Any]:
        """Check the start on every rank (reads only); global rank 0 then takes the run
        folder. Returns rank 0's lock (None elsewhere) and the start decision."""
        rank = int(os.environ.get("RANK", "0"))
        lock = verdict = None
        if rank == 0:
            lock = RunFolderLock(job.dump_folder)
            verdict = lock.check()
        start = preflight.decide_start(
            job,
            writer=rank == 0,
            same_job=verdict is not None and verdict.same_job,
            build_tokenizer=lambda: config.tokenizer.build(tokenizer_path=config.hf_assets_path),
        )
        if lock is None or verdict is None:
            return None, start
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
        if start.notes:
            preflight.log_start(start)
        return lock, start

    def init_distributed(self) -> Any:
        """TorchTitan's, then rank 0 records every rank's torchrun agent in the lock: a
        restart whose new rank 0 runs under any of them is this same job. TorchTitan's
        structured logger, which writes into dump_folder, starts only after that
        exchange: every rank has then passed its checks (rank 0 alone checks the run
        folder's history; another rank that started its logger first would write into
        a folder whose start rank 0 refuses). TorchTitan's own main starts it before
        the build."""
        dims = super().init_distributed()
        agent, _, _ = torchrun_agent()
        agents: list[Any] = [agent]
        if dist.is_initialized() and dist.get_world_size() > 1:
            agents = [None] * dist.get_world_size()
            dist.all_gather_object(agents, agent)
        if self._lock is not None:
            self._lock.set_agents(a for a in agents if a is not None)
        sl.init_structured_logger(
            source="training",
            output_dir=self.config.dump_folder,
            enable=self.config.debug.enable_structured_logging,
        )
        sl.log_trace_instant("structured_logger_started")
        return dims

    def train(self) -> None:
        """TorchTitan's loop; a store or sequence log that fails once training has begun
        (a ``tokens.bin`` changed after preparation, ...) stops it as ``JobStopped``.
        Before the first step such an error is a refused start and passes as it is."""
        try:
            super().train()
        except (HealingRefused, SharedReplicaId) as e:  # (a log that does not link: below)
            raise JobStopped(self.step, str(e)) from e
        except NotRepresentable as e:  # zephon.reproducible: a gradient it cannot sum
            raise JobStopped(
                self.step,
                f"zephon.reproducible: {e}. The step was not applied: the loss diverged or a "
                "gradient overflowed. Lower the learning rate (or clip harder) and resume from "
                "an earlier checkpoint (--checkpoint.load_step N).",
            ) from e
        except (StoreError, TrackerError) as e:
            if not self._tracking:
                raise
            if isinstance(e, DataUnreadable):  # named by the step whose data it was
                raise JobStopped(e.step, f"{e.kind}: {e} ({e.what} could not be read)") from e
            raise JobStopped(self.step, f"{error_kind(e)}: {e}") from e

    # -- per step --------------------------------------------------------
    def train_step(self, data_iterator: Any) -> None:
        step = self.step
        if self._lock is not None and self._lock.lost:
            raise JobStopped(
                step,
                f"this job no longer owns {self.config.dump_folder}: "
                f"{self._lock.lost} (this job missed its heartbeats for a whole lease). It stops "
                "before writing more.",
            )
        if not self._tracking:
            self._begin_tracking()
        # The loader's micro-batches of the step (of the pipeline's size under PP) / those
        self.gradient_accumulation_steps = (  # TorchTitan's loop draws per accumulation step
            self.dataloader.loader.grad_accumulation_steps(step)
            // self.num_pipeline_parallel_microbatches
        )
        accounting = self.accounting
        if accounting is not None:
            accounting.ahead(step)
        if self.ft is not None:  # torchft: the quorum, this group's part, the commit
            step, tokens = train_step_ft(self, step)  # a later step when it healed
            self._record_step(step, tokens)
        elif self.exact is not None:
            train_step_reproducible(self, self.exact, data_iterator)
            self._record_step(step)
        else:
            super().train_step(data_iterator)
            self._record_step(step)
        if accounting is not None:
            accounting.record(step)

    def pp_forward_backward_step(self, **kwargs: Any) -> Any:
        """TorchTitan's, then every stage holds the last stage's loss (TorchTitan's -1 off
        the last stage is what rank 0, the one a launcher shows, would log)."""
        loss = super().pp_forward_backward_step(**kwargs)
        if not self.pp_has_last_stage:
            loss = torch.zeros((), device=self.device)
        loss = loss.detach().reshape(()).to(torch.float32, copy=True)
        dist.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
        return loss

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: Any
    ) -> tuple[Any, Any, dict[str, Any]]:
        """TorchTitan's, with the document mask for ``DocumentSDPA`` (the CPU's stand-in
        for FlexAttention), which TorchTitan builds masks for only for Flex / varlen."""
        with_document_masks(self.model_config, input_dict)
        return super().post_dataloading_process(input_dict, labels)

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
                "at step 1. Load the data state too, or start a new --dump_folder.",
            )
        if dl.resumed_from is not None and dl.resumed_from != done:
            raise JobStopped(
                self.step,
                f"the checkpoint's trainer state is at step {done} but its Zephon data "
                f"state is at step {dl.resumed_from}: the checkpoint folder mixes two runs",
            )
        if dl.resumed_from is None:
            dl.tracker.start(dl.topology)
        if self._lock is not None:  # global rank 0: the start is accepted
            self._record_run_data()
            if dl.resumed_from is None:  # a resume says the entries it gained
                skips, gbs = dl.loader.config.skip_steps, dl.loader.config.batch_schedule().gbs
                for (s, n), text in zip(skips.entries, skips.describe(gbs), strict=True):
                    logger.info(f"Zephon: skip_steps {s}:{n}: {text}")
        if self._lock is not None and getattr(self, "_abandoned", None):
            failed = move_abandoned(*self._abandoned)  # every rank has loaded (the gather)
            if failed is not None:
                raise JobStopped(self.step, failed)
        self.accounting = self._build_accounting(self.config)
        self._tracking = True

    def _record_run_data(self) -> None:
        """``zephon/run_data.json``: what Zephon's tools need to find the run's data."""
        config, loader = self.config, self.dataloader.loader
        try:
            record_job(config.dump_folder, config.zephon, tokenizer=config.hf_assets_path,
                       checkpoint_folder=config.checkpoint.folder, data=loader.data,
                       data_config=loader.config.to_dict())  # fmt: skip
        except OSError as e:  # the tools fall back to the saved job config
            logger.warning(f"Zephon: could not write {run_data_path(config.dump_folder)}: {e}")

    def _check_same_data_everywhere(self) -> None:
        """Ranks that opened different stores (node-local copies that differ, another
        Python's builtin store) would silently cut batches from different orders."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        config = self.dataloader.loader.config
        mine = (
            config.store_fingerprint,
            config.fingerprint,
            self.dataloader.loader.data.path,
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

    def _record_step(self, step: int, ft_tokens: bytes | None = None) -> None:
        dl = self.dataloader
        if not dl.tracker.enabled:
            return
        tokens = ft_tokens  # under torchft: every participant's, gathered in part order
        if dl.audit == "tokens" and ft_tokens is None:
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
        if getattr(self, "accounting", None) is not None:
            self.accounting.close()
        if getattr(self, "ft", None) is not None:
            self.ft.shutdown(wait=False)
        clean = sys.exc_info()[1] is None
        checkpointer = getattr(self, "checkpointer", None)
        if clean and checkpointer is not None and checkpointer.enable:
            checkpointer.maybe_wait_for_saving()  # the last asynchronous save lands
        super().close()
        lock = getattr(self, "_lock", None)
        if lock is not None and clean:
            ck = self.config.checkpoint  # keep_latest_k, asynchronous saves included
            if ck.enable:
                keep_newest(self.config.dump_folder, ck.folder, ck.keep_latest_k)
            lock.release()


def _check_components(config: Any) -> None:
    """Zephon's trainer reads Zephon's data: its dataloader, and its validator when
    validation is on (a stock one would read a dataset Zephon does not order)."""
    if not isinstance(config.dataloader, ZephonDataLoader.Config):
        raise ValueError(
            f"ZephonTrainer trains on Zephon's data, but the config's dataloader is "
            f"{type(config.dataloader).__qualname__}: set dataloader=ZephonDataLoader.Config() "
            "in the config function (torchtitan_zephon.train replaces a stock one itself)"
        )
    if config.validator.enable and not isinstance(config.validator, ZephonValidator.Config):
        raise ValueError(
            f"ZephonTrainer validates on held-out samples, but the config's validator is "
            f"{type(config.validator).__qualname__}: set validator=ZephonValidator.Config(...) "
            "in the config function, or --validator.no-enable"
        )
