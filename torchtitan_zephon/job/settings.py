"""The job's data as the trainer's settings name it: its store, raw inputs and tokenizer.

Role: what ``titan`` asks of the job layer so that it neither ingests nor opens a
store itself. ``raw_inputs`` reads how a trainer job prepares a store value that
names raw inputs (``hf_assets_path``, ``zephon.text_field``, ``zephon.split``,
``zephon.cache_dir``) from its job (``titan.settings.job_view.JobView``: ``zephon`` and
``hf_assets_path``); ``remote_options`` how a store in object storage is read
(``zephon.read_ahead_steps``, ``zephon.read_ahead_bytes``, ``zephon.request_timeout_s``,
``zephon.cache_bytes``: the node cache under the store cache folder);
``open_store`` opens ``zephon.store`` (or the builtin store when it is empty; a URL is
read by range); ``store_data`` is the job's one store
with its held-out samples; ``builtin_tokenizer`` is the tokenizer the builtin
data was prepared with. The job config is read by attribute only (nothing here
imports TorchTitan); where to log is the caller's (``log``, ``warn``).

Invariant: messages name the options as the trainer spells them
(``--zephon.text_field``, ``--zephon.heldout_samples``, ``--training.seq_len``,
``hf_assets_path``); a store that cannot train is refused before a loader
exists.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR, builtin_store_path
from torchtitan_zephon.ingest.cache import RawInputs
from torchtitan_zephon.ingest.cache_folder import cache_root
from torchtitan_zephon.ingest.inputs import OptionNames
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.stores import store_location
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.packing import PackedSamples
from torchtitan_zephon.order.store_size import (
    MIN_STORE_SAMPLES,
    check_store_size,
    no_sample_text,
    store_fix,
)
from torchtitan_zephon.store.object_client import REQUEST_TIMEOUT_S
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote_options import (
    CACHE_BYTES,
    READ_AHEAD_BYTES,
    READ_AHEAD_STEPS,
    RemoteOptions,
)
from torchtitan_zephon.store.urls import redact, refuse_url

Log = Callable[[str], None]


def raw_inputs(job_config: Any, log: Log | None = None) -> RawInputs:
    """How this job prepares a store value that names raw inputs: with the tokenizer at
    hf_assets_path, zephon.text_field and zephon.split (messages name these
    options as the trainer spells them), into the cache (``$ZEPHON_CACHE``, else
    zephon.cache_dir); the process that holds the entry's lock uses one tokenizer process
    per local rank (the others wait for it anyway); progress on global rank 0; ``log``:
    where to say that this process prepares, or waits for another."""
    zc = job_config.zephon
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    refuse_url(
        getattr(zc, "cache_dir", ""),
        "zephon.cache_dir",
        "The store cache is a local folder (or one on a shared filesystem).",
    )
    return RawInputs(
        tokenizer=job_config.hf_assets_path,
        text_field=getattr(zc, "text_field", "text"),
        split=getattr(zc, "split", ""),
        names=OptionNames(text_field="--zephon.text_field", split="--zephon.split"),
        cache_dir=getattr(zc, "cache_dir", ""),
        workers=max(1, min(local, os.cpu_count() or 1)),
        progress=int(os.environ.get("RANK", "0")) == 0,
        log=log,
        tokenizer_origin="hf_assets_path",
    )


def store_name(value: str) -> str:
    """A ``zephon.store`` value as messages and logs may show it: the query string of a
    URL in it (an Azure SAS token, a signature) redacted."""
    return redact(value)


def remote_options(job_config: Any) -> RemoteOptions:
    """How this job reads a store in object storage (``zephon.store`` or a mixture
    source): zephon.read_ahead_steps (default 4), zephon.read_ahead_bytes (256 MiB),
    zephon.request_timeout_s (30 s per attempt) and zephon.cache_bytes (0: no node
    cache; else the cache lives under the store cache folder, ``$ZEPHON_CACHE`` else
    zephon.cache_dir), read from the ``zephon`` section the trainer hands over
    (``titan.settings.job_view.JobView.zephon``). A value out of range is a ``ValueError`` naming
    the setting (``RemoteOptions`` says what each allows): the trainer asks this at
    start for every job."""
    zc = job_config.zephon
    cache_bytes = int(getattr(zc, "cache_bytes", CACHE_BYTES))
    cache_dir = ""
    if cache_bytes > 0:
        refuse_url(
            getattr(zc, "cache_dir", ""),
            "zephon.cache_dir",
            "The node cache of remote stores is a local folder.",
        )
        cache_dir = str(cache_root(getattr(zc, "cache_dir", "")))
    return RemoteOptions(
        read_ahead_steps=int(getattr(zc, "read_ahead_steps", READ_AHEAD_STEPS)),
        read_ahead_bytes=int(getattr(zc, "read_ahead_bytes", READ_AHEAD_BYTES)),
        request_timeout_s=float(getattr(zc, "request_timeout_s", REQUEST_TIMEOUT_S)),
        cache_bytes=cache_bytes,
        cache_dir=cache_dir,
    )


def open_store(job_config: Any, *, log: Log | None = None, warn: Log | None = None) -> TokenStore:
    """Open ``zephon.store`` (a store folder, or raw inputs prepared into the cache on
    first use: ``job.stores.store_location``, saying so to ``log``), or the builtin store
    when it is empty (``warn``: an hf_assets_path that holds no tokenizer.json)."""
    path = job_config.zephon.store
    if not path:
        path = str(builtin_store_path(progress=int(os.environ.get("RANK", "0")) == 0))
        assets = os.path.abspath(job_config.hf_assets_path)
        if (
            assets != str(TOKENIZER_DIR)
            and not os.path.exists(os.path.join(assets, "tokenizer.json"))
            and warn is not None
        ):
            warn(
                f"hf_assets_path={job_config.hf_assets_path} has no tokenizer.json; "
                f"the builtin store was tokenized with {TOKENIZER_DIR}"
            )
        return TokenStore.open(path)
    location = store_location(path, raw_inputs(job_config, log))
    return TokenStore.open(location, remote=remote_options(job_config))


def store_data(
    store: TokenStore,
    seq_len: int,
    heldout: int,
    schedule: BatchSchedule,
    *,
    what: str,
    packed: PackedSamples | None = None,
) -> JobData:
    """The job's one store (``what`` names it), its last ``heldout`` samples held out:
    refused when it holds fewer than ``MIN_STORE_SAMPLES`` training samples (or none of
    seq_len), with a warning in ``source.warnings`` when they are fewer than a global
    batch. With ``packed`` (its packing index at seq_len) the samples are packed ones
    (``job.packed``)."""
    total = store.num_samples(seq_len) if packed is None else packed.num_samples
    held = f"lower --zephon.heldout_samples (now {heldout})" if heldout > 0 else ""
    need = MIN_STORE_SAMPLES + max(heldout, 0)
    fix = store_fix(store.num_tokens, need, "--training.seq_len", first=held)
    if total == 0:  # no sample at all: holding fewer out cannot help
        fix = store_fix(store.num_tokens, need, "--training.seq_len")
        raise ValueError(f"{no_sample_text(what, store.num_tokens, seq_len)}. {fix}")
    if heldout < 0 or heldout >= total:
        raise ValueError(
            f"zephon.heldout_samples={heldout} must be in [0, {total}): {what} has {total} "
            f"samples of seq_len {seq_len}. {fix}"
        )
    training = f"{what} (seq_len {seq_len}{f', {heldout} held out' if heldout else ''})"
    warning = check_store_size(training, total - heldout, schedule, fix)
    data = JobData.of_store(store, seq_len, packed=packed, num_samples=total - heldout)
    if warning:
        data.warnings.append(warning)
    return data


def builtin_tokenizer() -> tuple[Path, str]:
    """(the folder of the tokenizer the builtin data was prepared with, the sha256 of its
    tokenizer.json; "" when the folder holds none)."""
    path = TOKENIZER_DIR / "tokenizer.json"
    return TOKENIZER_DIR, hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
