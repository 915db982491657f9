"""ZephonTrainer: TorchTitan's Trainer with the platform layer, a global batch size
schedule, and the Global Sequence Tracker.

Invariant: the training loop is TorchTitan's own; this subclass only (1) adjusts
the job for the CPU before TorchTitan builds anything, (2) sets the gradient
accumulation of each step from the batch schedule, and (3) after each completed
step appends the step's record to the sequence log (global rank 0), combining the
DP ranks' token digests in rank order at audit level ``tokens``.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from torchtitan_zephon.titan import platform
from torchtitan_zephon.titan.checks import check_job_config
from torchtitan_zephon.titan.dataloader import ZephonDataLoader


class ZephonTrainer(Trainer):
    dataloader: ZephonDataLoader

    def __init__(self, job_config: Any) -> None:
        check_job_config(job_config)  # before TorchTitan builds anything: clear errors
        if platform.on_cpu():
            for change in platform.cpu_job_defaults(job_config):
                logger.info(f"CPU platform: {change}")
        super().__init__(job_config)
        self._tracking = False
        if not isinstance(self.dataloader, ZephonDataLoader):
            raise TypeError(
                f"model.name={job_config.model.name} does not build a Zephon dataloader; "
                "use a zephon_* model name (e.g. zephon_llama3)"
            )

    # -- per step --------------------------------------------------------
    def train_step(self, data_iterator: Any) -> None:
        step = self.step
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
            raise RuntimeError(
                f"the checkpoint restored the trainer at step {done} but no Zephon data state "
                "(was 'dataloader' in checkpoint.exclude_from_loading?): the data would restart "
                "at step 1. Load the data state too, or start a new job.dump_folder."
            )
        if dl.resumed_from is not None and dl.resumed_from != done:
            raise RuntimeError(
                f"the checkpoint's trainer state is at step {done} but its Zephon data "
                f"state is at step {dl.resumed_from}: the checkpoint folder mixes two runs"
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
            raise RuntimeError(
                "the ranks do not read the same data:\n" + "\n".join(lines) + "\nGive every "
                "node the same store (a shared filesystem, or identical copies: compare "
                "`zephon inspect STORE` fingerprints) and the same zephon settings."
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

    def train(self) -> None:
        self._warn_incomplete_checkpoints()
        super().train()

    def _warn_incomplete_checkpoints(self) -> None:
        """TorchTitan loads the newest ``step-N`` with a DCP ``.metadata`` and silently
        passes over folders a dying job left half-written: say which ones."""
        ck = self.job_config.checkpoint
        if not ck.enable or ck.load_step != -1 or dist.get_rank() != 0:
            return
        from torchtitan_zephon.runs import checkpoints

        folder = os.path.join(self.job_config.job.dump_folder, ck.folder)
        found = checkpoints(self.job_config.job.dump_folder, ck.folder)
        complete = [c.step for c in found if c.complete]
        for c in found:
            if not c.complete:
                logger.warning(
                    f"Zephon: checkpoint {c.path} is incomplete (no .metadata: the job died while "
                    f"writing it) and is skipped; resuming from "
                    f"{'step ' + str(max(complete)) if complete else 'scratch'} in {folder}"
                )

    def close(self) -> None:
        if getattr(self, "dataloader", None) is not None:
            self.dataloader.close()
        super().close()
