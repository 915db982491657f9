"""The job's data as the TorchTitan side opens it: once per process, in the trainer's
preflight, then handed to the dataloader and the validator when they are built.

Role: ``ZephonJob`` is that hand-off, the public seam of both components: the job's
view, its data (``zephon.mixture``, else ``zephon.store`` or the builtin store) and
its data config, each built once. ``ZephonJob.open(view)`` opens it
(``open_job_data``). A component takes it as a build keyword, as TorchTitan's
builders take the runtime objects they need (``config.build(job=zephon_job, ...)``),
or, built by TorchTitan's ``Trainer.__init__`` (which passes its own keywords only),
from the ``build_context(zephon_job)`` Zephon's trainer opens around it;
``job_to_build`` is what the component asks (refusing, naming the trainer to use and
this seam, when it has neither). Another trainer or a test does the same:

    zephon_job = ZephonJob.open(job_view(trainer_config))   # trainer_config: any
    dataloader = ZephonDataLoader.Config().build(job=zephon_job, ...)  # Trainer.Config
                                                    # with a ``zephon`` section

``batch_schedule``, ``eos_id_of`` and ``heldout_parts`` (held-out samples validation
reads, checked by the preflight too) are what both components read of them.
Opening logs one info line per store read by range whose block checksums do not divide
seq_len (``block_rounding_note``: what the rounding costs, and ``--block-tokens``).

Invariant: a component reads the object the preflight opened, never a store of its
own, so each store is opened, and the data config built, once per process; every
check that needs only the job and the stores (vocabulary against the model and the
tokenizer, held-out samples, a mixture's sources against each other) runs when the
data is opened, before anything is written. The hand-off never rides on a config, so
a saved or logged job config never holds opened stores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from torchtitan.tools.logging import logger

from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.packing import open_packing, packing_note
from torchtitan_zephon.job.settings import (
    open_store,
    raw_inputs,
    remote_options,
    store_data,
    store_name,
)
from torchtitan_zephon.order.data_config import DataConfig, data_extra
from torchtitan_zephon.order.exclusions import Exclusions
from torchtitan_zephon.order.mixture.config import MixtureConfig
from torchtitan_zephon.order.packing import padding_warning
from torchtitan_zephon.store.format import MAX_BLOCK_TOKENS
from torchtitan_zephon.titan.settings.job_view import JobView, batch_schedule


def _log(message: str) -> None:
    """Where the job layer says that this process prepares raw inputs, or waits."""
    logger.info(f"Zephon: {message}")


def resolve_data(job: JobView, tokenizer: Any = None) -> JobData:
    """The data a job reads: ``zephon.mixture``, else ``zephon.store`` (or the builtin
    store), opened and checked: the stores' vocabulary against the model and the
    tokenizer, the held-out samples against the store sizes, a mixture's sources
    against each other (``MixtureError`` names the source at fault)."""
    zc = job.zephon
    seq_len = job.seq_len
    mixture = zc.mixture
    shown = store_name(zc.store)
    packing = getattr(zc, "packing", "none")
    data_extra(packing=packing)  # an unknown method: refused, naming the setting
    if mixture:
        if zc.store:
            raise ValueError(
                f"zephon.mixture ({mixture}) and zephon.store ({shown}) are both set: a job "
                "reads either one store or a mixture. Drop zephon.store, or name the store as "
                "a [[source]] of the mixture file."
            )
        data = JobData.open_mixture(
            MixtureConfig.load(mixture),
            seq_len,
            packing=packing,
            default_heldout=zc.heldout_samples,
            path=mixture,
            progress=int(os.environ.get("RANK", "0")) == 0,
            raw=raw_inputs(job, _log),
            remote=remote_options(job),
            cache_dir=zc.cache_dir,
            log=_log,
            warn=logger.warning,
        )
        what = f"the mixture {mixture} (sources {', '.join(data.names)})"
    else:
        store = open_store(job, log=_log, warn=logger.warning)
        named = (  # as the user named it, and where it is when that differs
            f"the builtin store ({store.path})"
            if not zc.store
            else f"the store {shown}"
            if str(store.path) == shown
            else f"the store {shown!r} ({store.path})"
        )
        schedule = batch_schedule(job)
        packed = None
        if packing != "none":
            packed, index = open_packing(store, seq_len, cache_dir=zc.cache_dir, log=_log)
            _log(packing_note(packed, store, index))
            warning = padding_warning(packed, str(store.path))
            if warning:
                logger.warning(warning)
        data = store_data(store, seq_len, zc.heldout_samples, schedule, what=named, packed=packed)
        what = f"the store {store.path}"
    model_vocab = job.vocab_size
    if model_vocab is not None and data.vocab_size > model_vocab:
        raise ValueError(
            f"{what} was tokenized with a vocabulary of {data.vocab_size} "
            f"tokens but model {job.model} embeds "
            f"only {model_vocab}: choose a flavor with vocab_size >= {data.vocab_size}, or a "
            "store prepared with a smaller tokenizer"
        )
    check_tokenizer(data, tokenizer)
    for st in data.stores:
        note = block_rounding_note(st, seq_len)
        if note:
            _log(note)
    return data


def block_rounding_note(store: Any, seq_len: int) -> str | None:
    """One line when ``store`` is read by range with block checksums whose block_tokens
    does not divide ``seq_len`` (each window then fetches whole blocks beyond its own
    tokens): what that costs and the fix; None otherwise (nothing is wrong either way:
    reads round out to whole blocks)."""
    ratio = getattr(store, "window_fetch_ratio", None)
    if ratio is None or ratio(seq_len) <= 1.0:
        return None
    size = int(store.blocks["block_tokens"])
    fit = next(d for d in range(min(seq_len, MAX_BLOCK_TOKENS), 0, -1) if seq_len % d == 0)
    return (
        f"the store {store.path} has block checksums of {size} tokens and seq_len {seq_len} "
        f"is not a multiple of it: each {seq_len + 1}-token sample window fetches "
        f"{ratio(seq_len):.2f}x its bytes (whole blocks). To fetch only its own, rewrite them "
        f"on the local copy (`zephon inspect STORE --upgrade --block-tokens {fit}`, or "
        f"`zephon prepare ... --block-tokens {fit}`) and upload it again: the fingerprint stays."
    )


def check_tokenizer(data: JobData, tokenizer: Any) -> None:
    """Refuse a source whose token ids the job's tokenizer (when given) cannot hold."""
    if tokenizer is not None and data.vocab_size > tokenizer.get_vocab_size():
        raise ValueError(
            f"{data.what} was tokenized with a vocabulary of {data.vocab_size} "
            f"tokens but hf_assets_path's tokenizer has {tokenizer.get_vocab_size()}: "
            "point --hf_assets_path at the tokenizer the store was prepared with"
        )


@dataclass(frozen=True)
class ZephonJob:
    """What Zephon's dataloader and validator read: the job's view, its data and its
    data config, opened and built once per process (module docstring)."""

    view: JobView
    data: JobData
    data_config: DataConfig

    @classmethod
    def open(cls, view: JobView, tokenizer: Any = None) -> ZephonJob:
        """Open the job's data and build its data config (``open_job_data``): every
        check that needs only the job and the stores runs here."""
        data, data_config = open_job_data(view, tokenizer)
        return cls(view, data, data_config)

    @classmethod
    def of(cls, view: JobView, data: JobData) -> ZephonJob:
        """The job ``view`` over ``data`` opened for it, its data config built here."""
        return cls(view, data, job_data_config(view, data))


_BUILDING: ContextVar[ZephonJob | None] = ContextVar("zephon_build_context", default=None)


@contextmanager
def build_context(job: ZephonJob) -> Iterator[ZephonJob]:
    """While open, a Zephon dataloader or validator that is built without a ``job``
    keyword reads ``job``: how Zephon's trainer hands the job it opened to the
    components TorchTitan's ``Trainer.__init__`` builds (with its own keywords only)."""
    token = _BUILDING.set(job)
    try:
        yield job
    finally:
        _BUILDING.reset(token)


def job_to_build(job: ZephonJob | None, what: str) -> ZephonJob:
    """The job a component is built for: its ``job`` build keyword, else the open
    ``build_context``'s; a clear error when ``what`` (the component) has neither."""
    job = job if job is not None else _BUILDING.get()
    if job is None:
        raise ValueError(
            f"the Zephon {what} is built by Zephon's trainer, which opens the job's data and "
            "checks the start before TorchTitan writes anything: run "
            "`python -m torchtitan_zephon.train --module M --config FN` (or torchrun ... -m "
            "torchtitan_zephon.train), whose trainer config is ZephonTrainer.Config. Another "
            "trainer hands it the job's data itself: config.build(job=ZephonJob.open("
            "job_view(trainer_config)), ...), or builds it inside build_context(job) "
            "(titan.start.job_data)"
        )
    return job


def eos_id_of(data: JobData) -> int:
    """The EOS id that ends each document of ``source`` (a mixture's stores share one
    tokenizer, whose EOS is the first store's)."""
    return int(data.stores[0].eos_id)


def open_job_data(job: JobView, tokenizer: Any = None) -> tuple[JobData, DataConfig]:
    """The data source a job reads and its data config, without building a loader.

    Every check that needs only the job and the stores runs here
    (``resolve_data``: vocabulary against the model and the tokenizer, held-out
    samples, a mixture's sources against each other), so the trainer's preflight
    refuses a bad job before anything is written. The trainer opens the data here
    once and hands the object to the dataloader and the validator (``build_context``).
    """
    data = resolve_data(job, tokenizer)
    if job.zephon.exclude:  # checked against the data: ids, held-out ids, sources
        data.leave_out(Exclusions.load(job.zephon.exclude))
    return data, job_data_config(job, data)


def job_data_config(job: JobView, data: JobData) -> DataConfig:
    """The data config of ``job`` over ``data`` (opened for it, left-out samples set)."""
    return data.data_config(
        seed=job.zephon.seed,
        schedule=batch_schedule(job),
        extra=data_extra(
            skip_steps=job.zephon.skip_steps, packing=getattr(job.zephon, "packing", "none")
        ),
    )


def heldout_parts(job: JobView, data: Any) -> list[Any]:
    """The held-out parts validation reads (a mixture's sources with held-out samples),
    or ValueError when one holds less than a global batch: the preflight asks this
    before anything is written (validation on), the validator when it is built."""
    gbs = batch_schedule(job).gbs(1)
    parts = data.heldout()
    mixture = parts[0].name is not None
    if mixture:
        small = [h for h in parts if 0 < h.count < gbs]
        if small:
            raise ValueError(
                f"validation reads held-out samples in global batches of {gbs}; mixture "
                f"source {small[0].name!r} holds {small[0].count} (heldout_samples). Set its "
                f"heldout_samples to a multiple of {gbs}, or to 0 to not validate it."
            )
        parts = [h for h in parts if h.count > 0]
    if not parts or parts[0].count < gbs:
        raise ValueError(
            f"validation needs at least one global batch ({gbs} samples) of held-out data; "
            f"zephon.heldout_samples is {parts[0].count if parts else 0}. Set "
            f"--zephon.heldout_samples to a multiple of {gbs}"
            + (" (or heldout_samples of the mixture's sources)." if mixture else ".")
        )
    return parts
