"""The Zephon loader: one DP rank's micro-batches, with world-size-free state.

Role: turn the job data's plan (``job``: one TokenStore, or a mixture of several) into
an infinite iterator of ``({"input": LongTensor[b, seq_len]}, labels LongTensor[b,
seq_len])`` for one DP rank, prefetched in the background, and save/restore its position
as one small record that is the same on every rank. The plan yields sample keys (sample
ids for one store); ``data.windows`` gathers their tokens. ``document_positions`` (``documents``) is
the per-document position of each input token, a pure function of the window (the
TorchTitan side adds it to each batch).

Invariants:
- For steps s = next_step, next_step + 1, ... the loader yields exactly the rank's
  micro-batches of ``plan.microbatch_ids(s, ...)`` in order, whatever ``num_workers``
  and ``prefetch`` are.
- A failure (a changed store chunk, an id beyond the vocabulary, an interrupt) is raised
  at the first micro-batch it concerns; every micro-batch before it is delivered, and
  the next call retries that same micro-batch: none is ever skipped or delivered twice.
- ``state_dict()`` depends only on the data config and on how many whole steps have been
  *delivered* to the caller: never on dp_rank, dp_degree, local_batch_size, num_workers
  or on batches prefetched but not yet returned. Loading it under any DP layout that
  divides the global batch size continues the global stream exactly where it stopped;
  restoring is O(1).
- With ``last_step``, no key of a later step is announced to the data, and no bundle
  holding one is made before the caller asks for that step; the batches delivered do not
  depend on ``last_step``.
- Every batch holds tokens the store checked against its content checksums (see
  ``store/reader.py``) and, given ``vocab_size``, only ids below it.

Mechanics: the loader plans ahead: the next micro-batches (``Layout.microbatch_places``)
and their sample ids come from one vectorized plan call (``StreamPlan.rank_stream_ids``,
the layout's range of the rank's stream) per few hundred micro-batches. With
``prefetch`` or ``num_workers``, ``max(1, num_workers)`` background threads each prepare
a *bundle* of consecutive micro-batches (``max_bundle``: about 64K tokens, at least
``prefetch`` micro-batches) with one gather and one int64 conversion; its micro-batches
are views of two buffers. Plans and bundles grow from one micro-batch after a start or a
reset, so the first batch waits for one micro-batch's work. Without either, each micro-
batch is prepared on demand in the caller's thread.

Read-ahead (stores in object storage): the loader announces to its data, step by step,
the rank's keys of every step of a bundle it starts and of the ``read_ahead_steps``
after the bundle's last step (``JobData.read_ahead``; default: the data's, 0 for local
stores), so their byte ranges are fetched in the background (``store.remote``) before a
bundle asks for them; a bundle whose bytes have not arrived waits for them, and that
wait is the trainer's data wait. The effective lead is therefore the steps of the
bundles in production (``max(1, num_workers)`` bundles of up to ``max_bundle`` micro-
batches, and the one being delivered) plus ``read_ahead_steps`` (``lead_steps``). A
reset or a resume drops what was announced and announces again from the first
undelivered step. The first bundle after a start, a reset or a resume announces its own
steps only, and the next bundle (started once the first was taken, with ``num_workers``
<= 1) the read-ahead beyond: so the first step after a resume waits only for its own
samples, and the read-ahead of later steps runs behind it. Announcing costs one plan
call per step in the caller's thread; the fetching and checking run on the store's fetch
thread. With read-ahead a bundle never holds micro-batches of two steps: a step whose
bytes have arrived is delivered whatever happens to the reads of the steps after it.

The run's end (``last_step``: training.steps) bounds only what is read ahead (see the
invariant): a caller that asks past it gets its batches, made on demand.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from torchtitan_zephon.job.data import JobData, as_job_data
from torchtitan_zephon.job.documents import document_positions
from torchtitan_zephon.job.plans import decide_resume
from torchtitan_zephon.job.source import unlabel
from torchtitan_zephon.order.data_config import DataConfig, DataStateMismatch
from torchtitan_zephon.order.layout import BatchSchedule, check_batch_layout
from torchtitan_zephon.order.resume import ResumeDecision
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.store.format import DataUnreadable, StoreError
from torchtitan_zephon.store.reader import TokenStore

__all__ = ["DataStateMismatch", "MicroBatch", "ZephonLoader", "document_positions"]

MicroBatch = tuple[dict[str, torch.Tensor], torch.Tensor]
# A micro-batch's place in the rank's stream: (step, index within the step, last of the step).
Place = tuple[int, int, bool]
Bundle = tuple[list[tuple[Place, MicroBatch]], Exception | None]  # then the failure that stopped it

# Tokens a prefetch bundle aims at (512 KiB of int64 inputs, as much of labels): enough
# micro-batches that a thread hand-off per bundle costs little per micro-batch, few
# enough that the bundle's buffers stay in cache; at most MAX_BUNDLE micro-batches.
BUNDLE_TOKENS = 1 << 16
MAX_BUNDLE = 64
PLAN_IDS = 1 << 12  # sample ids planned at once, at most: one plan call per this many ids


class ZephonLoader:
    """Infinite, deterministic micro-batch stream for one DP rank."""

    def __init__(
        self,
        data: TokenStore | JobData,
        *,
        seq_len: int,
        seed: int | None = None,
        schedule: BatchSchedule | None = None,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        sample_offset: int = 0,
        num_samples: int | None = None,
        num_workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        extra_config: dict | None = None,
        vocab_size: int | None = None,
        read_ahead_steps: int | None = None,
        last_step: int | None = None,
        data_config: DataConfig | None = None,
    ) -> None:
        """``data_config``: the job's, built once per process (else seed and schedule)."""
        if data_config is not None and (seed, schedule, extra_config) != (None, None, None):
            raise ValueError("give the loader data_config or seed and schedule, not both")
        if data_config is None and (seed is None or schedule is None):
            raise ValueError("the loader needs data_config, or seed and schedule")
        data = as_job_data(data, seq_len, sample_offset=sample_offset, num_samples=num_samples)
        # Token ids must index the model's embedding: exact and free from the manifest's
        # max_token_id; a store without one (format 1) has each batch checked instead.
        self._id_limit = data.id_limit(vocab_size)
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}.")
        if data_config is not None and data_config.seq_len != seq_len:
            raise ValueError(f"the data config is for seq_len {data_config.seq_len}, not {seq_len}")
        if schedule is None:
            schedule = data_config.batch_schedule()  # type: ignore[union-attr]
        schedule.check_layout(dp_degree, local_batch_size)
        if num_workers < 0 or prefetch < 0:
            raise ValueError(
                f"num_workers and prefetch must be >= 0, got {num_workers} and {prefetch}."
            )
        self.config = data_config or data.data_config(
            seed=seed, schedule=schedule, extra=extra_config
        )
        self.data = data
        self.seq_len = int(seq_len)
        self.dp_rank = int(dp_rank)
        self.dp_degree = int(dp_degree)
        self.local_batch_size = int(local_batch_size)
        self.num_workers = int(num_workers)
        self.prefetch = int(prefetch)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.plan = data.plan(self.config)
        self._threaded = self.prefetch > 0 or self.num_workers > 0
        tokens = self.local_batch_size * self.seq_len
        self.max_bundle = (
            max(self.prefetch, min(MAX_BUNDLE, max(1, BUNDLE_TOKENS // tokens)))
            if self._threaded
            else 1
        )  # micro-batches per bundle job
        # Micro-batches planned in one call, at most (a multiple of the bundle, about
        # PLAN_IDS ids). From the start and after a reset, plans and bundles start at one
        # micro-batch and double up to these sizes, so a first batch costs no more than one.
        self.max_plan = max(
            self.max_bundle, PLAN_IDS // self.local_batch_size // self.max_bundle * self.max_bundle
        )
        self._next_step = 1
        self._delivered = (1, 0)  # next (step, micro-batch index) to hand to the caller
        self._cursor = (1, 0)  # next (step, micro-batch index) to plan
        self._planned: list[Place] = []  # planned places, with their ids, not yet handed out
        self._planned_ids = np.empty((0, self.local_batch_size), dtype=np.int64)
        self._planned_at = 0
        self._plan_size = self._bundle_size = 1
        self._ready: deque[tuple[Place, MicroBatch]] = deque()  # produced, not yet delivered
        self._failure: Exception | None = None  # raised once self._ready is delivered
        self._pending: deque[Future[Bundle]] = deque()
        self._executor: ThreadPoolExecutor | None = None
        if read_ahead_steps is None:
            read_ahead_steps = data.read_ahead_steps()
        if read_ahead_steps < 0:
            raise ValueError(f"read_ahead_steps must be >= 0, got {read_ahead_steps}.")
        self.read_ahead_steps = int(read_ahead_steps)
        if last_step is not None and last_step < 1:
            raise ValueError(f"last_step must be >= 1 (or None: no end), got {last_step}.")
        self.last_step = None if last_step is None else int(last_step)
        self._announced = 1  # first step whose keys were not yet announced to the data
        self._first_bundle = True  # the next bundle is the first since a start or reset

    # ------------------------------------------------------------------ read-ahead

    @property
    def announced_through(self) -> int:
        """Last step whose keys were announced to the data (the step before the first
        undelivered one when none was since the start, a reset or a resume)."""
        return self._announced - 1

    def lead_steps(self, step: int) -> int:
        """At most how many steps after ``step`` (the step being delivered) have their
        keys announced, with ``step``'s micro-batches per step: the steps of the
        bundle being delivered and of the bundles in production, then
        ``read_ahead_steps`` more (never past ``last_step``)."""
        microbatches = self.max_bundle * (max(1, self.num_workers) + 1)
        per_step = self.grad_accumulation_steps(step)
        lead = -(-microbatches // per_step) + self.read_ahead_steps
        if self.last_step is not None:
            lead = max(0, min(lead, self.last_step - step))
        return lead

    def _read_ahead(self, first: int, last: int, ahead: int) -> None:
        """Announce the rank's keys of steps ``first`` .. ``last + ahead`` (at most
        ``last_step``) not yet announced, in step order."""
        end = last + ahead + 1
        if self.last_step is not None:
            end = min(end, self.last_step + 1)
        for s in range(max(self._announced, first), end):
            keys = self.plan.rank_ids(s, self.dp_rank, self.dp_degree)
            self.data.read_ahead(keys, self.seq_len)
        self._announced = max(self._announced, end)

    # ------------------------------------------------------------------ batches

    @property
    def next_step(self) -> int:
        """First step not yet completely delivered to the caller."""
        return self._next_step

    def grad_accumulation_steps(self, step: int) -> int:
        return check_batch_layout(
            self.plan.schedule.gbs(step), self.dp_degree, self.local_batch_size
        )

    def batch(self, ids: np.ndarray) -> MicroBatch:
        """The micro-batch of samples ``ids``: int64 inputs and labels [len(ids), seq_len]
        (pure: does not move the loader; raises StoreError on content the checks refuse)."""
        inputs, labels = self._tensors(ids)
        return {"input": inputs}, labels

    def _tensors(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # The rows, and the inputs that train no label (packed samples: a document's last
        # token, the padding); each source checks what it reads.
        tokens, unlabelled = self.data.rows(ids, self.seq_len)
        if self._id_limit is not None and tokens.size and int(tokens.max()) >= self._id_limit:
            raise StoreError(self.data.out_of_vocab(ids, tokens, self._id_limit))
        # One pass each, straight from the store dtype into contiguous int64 buffers.
        inputs = torch.from_numpy(tokens[:, :-1].astype(np.int64, order="C"))
        labels_np = tokens[:, 1:].astype(np.int64, order="C")
        unlabel(labels_np, unlabelled)
        labels = torch.from_numpy(labels_np)
        if self.pin_memory:
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        return inputs, labels

    def step_microbatches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of ``step`` (pure: does not move the loader)."""
        return [
            self.batch(ids)
            for ids in self.plan.microbatch_ids(
                step, self.dp_rank, self.dp_degree, self.local_batch_size
            )
        ]

    def part_microbatches(
        self, step: int, part: int, parts: int, multiple_of: int = 1
    ) -> list[MicroBatch]:
        """Under torchft: this rank's micro-batches of part ``part`` of ``parts`` of
        ``step`` (participant ``part`` of the quorum's ``parts``, each part a multiple
        of ``multiple_of`` samples; this loader's DP rank and degree are the group's inner ones;
        ``Layout.part_microbatch_positions``). Pure, like ``step_microbatches``: the data
        state moves only with ``committed``."""
        return [
            self.batch(ids)
            for ids in self.plan.part_microbatch_ids(
                step, part, parts, self.dp_rank, self.dp_degree, self.local_batch_size, multiple_of
            )
        ]

    def committed(self, step: int) -> None:
        """Under torchft: ``step`` was committed, so the data state moves on to the next
        step. A step that failed to commit calls nothing: it is drawn again, the same."""
        if step != self._next_step:
            raise ValueError(
                f"step {step} committed, but the data state is at step {self._next_step}"
            )
        self._next_step = step + 1
        self._delivered = (step + 1, 0)
        self._reset()

    def _plan_ahead(self) -> None:
        """Plan the next ``self._plan_size`` micro-batches from the cursor in one call."""
        count, b = self._plan_size, self.local_batch_size
        places, cursor = self.plan.layout.microbatch_places(self._cursor, count, self.dp_degree, b)
        first_step, first_index, _ = places[0]
        ids = self.plan.rank_stream_ids(
            first_step, first_index * b, count * b, self.dp_rank, self.dp_degree
        )
        self._planned, self._planned_ids, self._planned_at = places, ids.reshape(count, b), 0
        self._cursor = cursor
        self._plan_size = min(2 * count, self.max_plan)

    def _advance(self) -> tuple[list[Place], np.ndarray]:
        """The next bundle: its places and their ids [places, local_batch_size]."""
        if self._planned_at == len(self._planned):
            self._plan_ahead()
        k = self._planned_at
        stop = min(k + self._bundle_size, len(self._planned))
        end = self.last_step
        if end is not None and self._planned[k][0] <= end < self._planned[stop - 1][0]:
            # a bundle ends at the run's last step: the next one starts only when asked
            stop = k + next(j for j, place in enumerate(self._planned[k:stop]) if place[0] > end)
        if self.read_ahead_steps:  # a step waits only for its own bytes: one step a bundle
            ends = [j for j, place in enumerate(self._planned[k:stop]) if place[2]]
            stop = k + ends[0] + 1 if ends else stop
        self._planned_at = stop
        if self.read_ahead_steps:  # every step of the bundle, and the next ones
            ahead = 0 if self._first_bundle else self.read_ahead_steps
            self._read_ahead(self._planned[k][0], self._planned[stop - 1][0], ahead)
        self._first_bundle = False
        self._bundle_size = min(2 * self._bundle_size, self.max_bundle)
        return self._planned[k:stop], self._planned_ids[k:stop]

    def _make(self, places: list[Place], ids: np.ndarray) -> list[tuple[Place, MicroBatch]]:
        """The micro-batches of ``places`` with ``ids`` [len(places), local_batch_size],
        made together: one gather, views of one pair of int64 buffers."""
        inputs, labels = self._tensors(ids.ravel())
        if len(places) == 1:
            return [(places[0], ({"input": inputs}, labels))]
        b = self.local_batch_size
        return [
            (place, ({"input": inputs[k * b : (k + 1) * b]}, labels[k * b : (k + 1) * b]))
            for k, place in enumerate(places)
        ]

    def _produce(self, places: list[Place], ids: np.ndarray) -> Bundle:
        """``_make``; if that fails, the micro-batches one by one up to the first that
        fails, so every micro-batch before a failure is still delivered."""
        try:
            return self._make(places, ids), None
        except Exception as e:
            if len(places) == 1:
                return [], e
        done: list[tuple[Place, MicroBatch]] = []
        for k, place in enumerate(places):
            try:
                done += self._make([place], ids[k : k + 1])
            except Exception as e:
                return done, e
        return done, None

    def _next_place_step(self) -> int:
        """The step of the next micro-batch to put in a bundle."""
        if self._planned_at < len(self._planned):
            return self._planned[self._planned_at][0]
        return self._cursor[0]

    def _fill(self, demand: bool = False) -> None:
        """Keep ``max(1, num_workers)`` bundles in production; past ``last_step``, only
        the one the caller waits for (``demand``, none pending)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=max(1, self.num_workers), thread_name_prefix="zephon-loader"
            )
        end = self.last_step
        while len(self._pending) < max(1, self.num_workers):
            asked = demand and not self._pending
            if end is not None and not asked and self._next_place_step() > end:
                return
            self._pending.append(self._executor.submit(self._produce, *self._advance()))

    def _take_bundle(self) -> None:
        """Move the next bundle's micro-batches into ``self._ready``, or raise its failure."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self._threaded:
            if not self._pending:
                self._fill(demand=True)
            done, failure = self._pending.popleft().result()
            if failure is None:
                self._fill()
        else:
            done, failure = self._produce(*self._advance())
        if not done:
            raise failure
        self._ready.extend(done)
        self._failure = failure

    def __iter__(self) -> ZephonLoader:
        return self

    def __next__(self) -> MicroBatch:
        if not self._ready:
            try:
                self._take_bundle()
            except StoreError as e:
                self._reset()  # rewind to the first undelivered micro-batch: never skip one
                if isinstance(e, DataUnreadable):
                    raise
                step = self._delivered[0]
                raise DataUnreadable(e, step, f"the data of step {step}") from e
            except BaseException:
                self._reset()
                raise
        (step, index, last), batch = self._ready.popleft()
        if last:  # the step's final micro-batch is handed over by this return
            self._next_step = step + 1
            self._delivered = (step + 1, 0)
        else:
            self._delivered = (step, index + 1)
        return batch

    def _reset(self) -> None:
        """Drop everything produced but not delivered; production resumes at the first
        undelivered micro-batch."""
        for fut in self._pending:
            fut.cancel()
        for fut in self._pending:  # let running jobs finish before the plan changes
            if not fut.cancelled():
                fut.exception()
        self._pending.clear()
        self._ready.clear()
        self._failure = None
        self._cursor = self._delivered
        self._planned, self._planned_at = [], 0
        self._plan_size = self._bundle_size = 1
        if self.read_ahead_steps:
            self.data.drop_read_ahead()
        self._announced = self._delivered[0]
        self._first_bundle = True

    def close(self) -> None:
        """Stop background threads and drop prefetched batches."""
        self._reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> ZephonLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def data_state(self) -> DataState:
        """World-size-independent record of the data position (same on every rank)."""
        first, _ = self.plan.step_positions(self._next_step)
        anchor = (self.plan.anchor_step, self.plan.anchor_position)
        return DataState(self.config, self._next_step, first, anchor)

    def state_dict(self) -> dict[str, Any]:
        """``data_state()`` as a JSON-able dict."""
        return self.data_state().to_dict()

    def load_state_dict(
        self, state: dict[str, Any] | DataState, *, allow_changes: Iterable[str] = ()
    ) -> ResumeDecision:
        """Continue at the saved ``next_step``; refuse config changes not in ``allow_changes``.

        The rule is ``job.plans.decide_resume``: ``allow_changes`` names data config
        fields whose change is accepted (``seed``, ``seq_len``, ``schedule``,
        ``sample_offset``, ``num_samples``, ``store_fingerprint``, ``tokenizer_hash``,
        any extra_config key), the aliases ``store`` (store_fingerprint +
        num_samples), ``tokenizer`` and ``mixture`` (a mixture's sources or the
        weights of trained steps), or ``all``. A batch or weight schedule that
        changed only for untrained steps needs no opt-in.
        """
        saved = state if isinstance(state, DataState) else DataState.from_dict(state)
        decision = decide_resume(saved, self.config, allow_changes)
        if decision.config is not None:  # the same samples, bound to the saved rule
            self.config = decision.config
        self._reset()
        self.plan = self.data.plan(self.config, decision.anchor)
        self._next_step = saved.next_step
        self._cursor = self._delivered = (saved.next_step, 0)
        self._announced = saved.next_step
        return decision
