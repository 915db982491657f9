"""The ``--fault_tolerance.*`` settings (TorchTitan 0.3's torchft section), checked at start.

Role: ``check_fault_tolerance`` refuses, before anything is built or written, a
fault-tolerant job that cannot keep Zephon's rule (every committed step trains exactly
its global batch B(s), cut into one contiguous part per participating group,
``order.layout.part_slice``): a semi-synchronous method (local SGD, DiLoCo: groups step
on their own batches between syncs), a replica id outside ``[0, group_size)``, a
``min_replica_size`` outside ``[1, group_size]``, HSDP replication inside a group (torchft
replicates across groups), and a global batch smaller than ``group_size`` times the
group's DP degree (a rank of some group would hold no sample); and, until it is
built, pipeline parallelism under torchft. ``lighthouse_url`` reads
``TORCHFT_LIGHTHOUSE`` and checks that a lighthouse answers there within
``LIGHTHOUSE_TIMEOUT_S``.

Invariant: with ``fault_tolerance.enable`` off nothing here refuses anything; each
refusal is a ``ValueError`` naming the setting, the value found and what to do; nothing
here writes.
"""

from __future__ import annotations

import http.client
import math
import os
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from torchtitan_zephon.titan.settings.job_view import JobView, batch_schedule

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_TIMEOUT_S = 5.0
"""How long a start waits for the lighthouse to accept a connection before refusing."""
SUPPORTED_PROCESS_GROUPS = ("gloo", "nccl")


def check_fault_tolerance(job: JobView, world: int) -> None:
    """Raise ValueError for fault-tolerance settings Zephon's rule cannot keep (module
    docstring); ``world``: this group's ranks."""
    ft = job.fault_tolerance
    if not ft.enable:
        return
    if ft.semi_sync_method:
        raise ValueError(
            f"fault_tolerance.semi_sync_method = {ft.semi_sync_method!r}: Zephon trains every "
            "committed step on exactly its global batch, which needs synchronous steps (one "
            "quorum and one reduction per step); local SGD and DiLoCo step each group on its "
            "own batches between syncs. Drop --fault_tolerance.semi_sync_method."
        )
    if ft.group_size < 1:
        raise ValueError(
            f"fault_tolerance.group_size = {ft.group_size}: with --fault_tolerance.enable it is "
            "the number of replica groups the job may have (>= 1). Set "
            "--fault_tolerance.group_size N."
        )
    if not 0 <= ft.replica_id < ft.group_size:
        raise ValueError(
            f"fault_tolerance.replica_id = {ft.replica_id} is outside [0, {ft.group_size}) "
            f"(fault_tolerance.group_size {ft.group_size}): give each group its own id "
            f"0 .. {ft.group_size - 1}."
        )
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise ValueError(
            f"fault_tolerance.min_replica_size = {ft.min_replica_size}: the fewest groups a "
            f"step may train with must be in [1, {ft.group_size}] (group_size). Set "
            "--fault_tolerance.min_replica_size 1 to keep stepping while one group is left."
        )
    if ft.process_group not in SUPPORTED_PROCESS_GROUPS:
        raise ValueError(
            f"fault_tolerance.process_group = {ft.process_group!r}: expected one of "
            f"{', '.join(map(repr, SUPPORTED_PROCESS_GROUPS))} (gloo on CPU)."
        )
    if job.dp_replicate != 1:
        raise ValueError(
            f"parallelism.data_parallel_replicate_degree = {job.dp_replicate} with "
            "--fault_tolerance.enable: torchft replicates across replica groups, so a group "
            "shards its data-parallel ranks only. Set "
            "--parallelism.data_parallel_replicate_degree 1."
        )
    inner = job.dp_shard_degree(world) or 1  # this group's DP degree (replicate is 1)
    need = ft.group_size * inner
    for start, gbs in batch_schedule(job).entries:
        if gbs < need:
            raise ValueError(
                f"global batch size {gbs} (from step {start}) is smaller than "
                f"fault_tolerance.group_size {ft.group_size} x this group's DP degree {inner} "
                f"= {need}: with every group taking part, a rank would hold no sample. Raise "
                f"the global batch to {need} or more, or lower --fault_tolerance.group_size."
            )
    if job.pp > 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree = {job.pp} with --fault_tolerance.enable: "
            "Zephon's torchft step runs its part's micro-batches through the model itself, "
            "which a pipeline schedule does not allow yet. Set "
            "--parallelism.pipeline_parallel_degree 1."
        )


def lighthouse_url() -> str:
    """``TORCHFT_LIGHTHOUSE``, checked: set, an ``http://HOST:PORT`` address, and a
    torchft lighthouse answers there within ``LIGHTHOUSE_TIMEOUT_S``."""
    url = os.environ.get(LIGHTHOUSE_ENV, "")
    start = (
        "start one: torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510, then "
        f"{LIGHTHOUSE_ENV}=http://127.0.0.1:29510"
    )
    if not url:
        raise ValueError(
            f"--fault_tolerance.enable needs {LIGHTHOUSE_ENV}=http://HOST:PORT, the address of "
            f"the torchft lighthouse every replica group joins; {start}."
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(
            f"{LIGHTHOUSE_ENV}={url!r}: expected http://HOST:PORT (the lighthouse's --bind "
            "address, with its port)."
        )
    problem = _not_a_lighthouse(url)
    if problem is not None:
        raise ValueError(f"{problem}: check {LIGHTHOUSE_ENV}, or {start}.")
    return url


LIGHTHOUSE_PAGE = b"Lighthouse Dashboard - torchft"
"""The title of the page a torchft lighthouse serves at ``/`` beside its gRPC service."""


def _not_a_lighthouse(url: str) -> str | None:
    """Why ``url`` is not a torchft lighthouse that answers (None: it is one). One
    read-only HTTP GET of its dashboard page, no proxy, within ``LIGHTHOUSE_TIMEOUT_S``
    (a heartbeat would register a replica the next quorum waits for). Anything else
    listening there (another service, a store, a silent port) would leave torchft's
    client retrying forever."""
    wait = math.ceil(LIGHTHOUSE_TIMEOUT_S)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url.rstrip("/") + "/", timeout=LIGHTHOUSE_TIMEOUT_S) as answer:
            page = answer.read(1 << 16)
    except urllib.error.HTTPError as e:
        return f"the server at {url} is not a torchft lighthouse (it answered HTTP {e.code})"
    except urllib.error.URLError as e:
        why = e.reason if isinstance(e.reason, str) else _why(e.reason)
        return f"the torchft lighthouse at {url} does not answer ({why} within {wait} s)"
    except TimeoutError:
        return f"the torchft lighthouse at {url} does not answer (no answer within {wait} s)"
    except (OSError, http.client.HTTPException) as e:
        return (
            f"the server at {url} is not a torchft lighthouse (it does not speak HTTP as one "
            f"does: {type(e).__name__})"
        )
    if LIGHTHOUSE_PAGE not in page:
        return (
            f"the server at {url} is not a torchft lighthouse (it answered HTTP, but not with "
            "a lighthouse's dashboard)"
        )
    return None


def _why(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer"
    return getattr(error, "strerror", None) or type(error).__name__
