"""The ``zephon`` section of Zephon's trainer config (CLI ``--zephon.KEY``; TOML
``[zephon]``): ``ZephonTrainer.Config.zephon``.

Invariant: every field that changes which tokens a step sees (store, seed,
seq_len, batch schedule, held-out samples) is part of the data config that the
checkpointed state fingerprints; a resume with another value is refused unless
the field is listed in ``allow_changes``.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Zephon:
    store: str = ""
    """Path of a token store made by `zephon prepare`, or raw inputs: a text /
    JSONL(.gz) / Parquet file, a folder of them, a local Hugging Face dataset
    folder, a glob pattern ("data/*.jsonl") or a comma-separated list of these.
    Raw inputs are tokenized with the tokenizer.json at hf_assets_path
    (field zephon.text_field) on first use, by the local ranks together under a
    lock, into a content-addressed cache (ZEPHON_CACHE, else zephon.cache_dir);
    later runs find it by file names, sizes and mtimes without reading the
    corpus. The store is the one `zephon prepare` makes of the same inputs (same
    fingerprint, however they are spelled). Empty: the builtin store, built on
    first use from text that ships with Python (its documentation topics and
    standard-library sources) with the tokenizer in
    torchtitan_zephon/assets/tokenizer (set hf_assets_path to it). A store in object
    storage is named by its URL (s3://BUCKET/PREFIX, gs://, az://; file:// is a local
    path): read by byte range with zephon.read_ahead_steps, read_ahead_bytes,
    request_timeout_s and cache_bytes, same fingerprint as its local copy."""

    text_field: str = "text"
    """The JSON / Parquet / dataset field holding a document's text, where
    zephon.store (or a mixture source) names raw inputs. It is part of the
    prepared store, so of its fingerprint."""

    split: str = ""
    """Where zephon.store (or a mixture source) names raw inputs: the split of each
    Hugging Face DatasetDict folder (save_to_disk) to read. Empty: "train" (a
    DatasetDict without it is refused, listing its splits); "all": every split, in
    sorted order. A single Dataset folder is read whole (an explicit split other than
    the one it was saved as is refused); other inputs are not affected. The splits
    read are part of the prepared store (its manifest), so of its fingerprint."""

    cache_dir: str = ""
    """Folder of the store cache (raw inputs prepared on first use, the builtin
    store; with zephon.cache_bytes > 0 also the node cache of remote stores, in its
    remote-blocks subfolder) when the environment variable ZEPHON_CACHE is unset.
    Empty: ~/.cache/torchtitan_zephon. On a shared filesystem whose file locks work
    across machines, one node prepares and the others wait; on local disk each
    node prepares once. A local folder (a URL is refused)."""

    read_ahead_steps: int = 4
    """Where zephon.store (or a mixture source) is in object storage (s3://, gs://,
    az://): the steps after the current one whose windows each rank fetches in the
    background, by byte range, as the plan names them (0: fetch each window when it
    is read; < 0 is refused at start). Not part of the data config."""

    read_ahead_bytes: int = 256 << 20
    """Bytes of fetched windows a remote store holds at most per process (a step
    larger than that is still fetched, alone; 0: one step at a time; < 0 is refused at
    start). Not part of the data config."""

    request_timeout_s: float = 30.0
    """Time limit, in seconds, of ONE ATTEMPT of a request to object storage (credential
    discovery included). A transient failure (an attempt over this limit, 5xx,
    throttling, a reset, a body cut short) is retried 4 times with backoff, so a request
    fails after 5 attempts at most, then a clear error naming the object. A read the
    step waits for fails within 5 x (request_timeout_s + 2) + 1 s of when it was needed
    or the endpoint went silent, however much is read ahead (a request failing on every
    attempt fails the reads pending with it). Must be > 0 (checked at start). Not part
    of the data config."""

    cache_bytes: int = 0
    """Bound, in bytes, of the node-local cache of remote stores (0, the default: no
    cache; each rank fetches what it reads). When > 0, the checked blocks (of the
    store's block_tokens, or 65,536-token chunks) a rank fetches are kept under
    <store cache folder>/remote-blocks/
    <store fingerprint>/ (ZEPHON_CACHE, else zephon.cache_dir), shared by the ranks of
    the node, by restarts and by other jobs using the same folder (the bound covers the
    whole remote-blocks folder), least recently used files removed first; a cached block
    is checked against its checksum each time it is used. < 0 is refused at start. Not
    part of the data config."""

    mixture: str = ""
    """Path of a mixture file (TOML): several stores drawn in exact proportions that
    follow a weight schedule, instead of zephon.store (setting both is an error).
    It holds [[source]] entries (name, store: a store path or raw inputs as in
    zephon.store, relative to the file, or "builtin:docs" / "builtin:stdlib"; optional heldout_samples, default
    zephon.heldout_samples, and max_epochs) and [[schedule]] entries (from_step,
    weights = { name = weight, ... }, normalized exactly). Every step's global
    batch follows the weights in effect at that step, each source with its own
    permutation and epochs. Entries appended for untrained steps resume without
    opt-in; changing the sources or the weights of trained steps needs
    allow_changes = ["mixture"]. See train_configs/mixture_example.toml."""

    seed: int = 0
    """Seed of the per-epoch sample permutation. Part of the data config."""

    batch_schedule: str = ""
    """Global batch size schedule, "STEP:GBS,STEP:GBS,..." (1-based steps, the
    first entry at step 1), e.g. "1:32,1000:64". Empty: training.global_batch_size
    for every step. Positions are accounted exactly across changes."""

    packing: str = "none"
    """"none" (the default): a sample is a fixed window of seq_len tokens of the
    concatenated documents. "best_fit": a sample is whole documents (a document longer
    than seq_len is cut into seq_len pieces, its rest packed like a short document)
    packed by best fit over 64 open samples, the rest EOS padding; a document's last
    token (EOS) and the padding train no label, positions and attention masks restart
    at every document. The packing index is built once per store and seq_len into
    <cache>/packing/ (ZEPHON_CACHE, else zephon.cache_dir); a mixture's sources each
    pack their own documents. Still one exact order at any DP degree. Part of the data
    config (only when not "none")."""

    skip_steps: str = ""
    """Skip ranges "S:N,S:N,..." (entries strictly increasing in S, N >= 1, not
    overlapping): at step S, the data that steps S..S+N-1 would have drawn is consumed
    and never trained (after a loss spike). Steps keep their numbers, batch sizes, LR
    schedule and, in a mixture, their per-source counts; each source's samples skip
    exactly what those N steps would have drawn from it. With one store and a constant
    batch size, step S trains what step S+N would have trained. An entry for untrained
    steps resumes as a continuation (roll back to a checkpoint, add the skip, resume);
    changing an entry at a trained step needs allow_changes = ["skip_steps"]. Part of
    the data config; a step's ids digest binds the entries with S <= that step."""

    exclude: str = ""
    """Path of a left-out list (JSON lines, one entry a line: {"source": NAME, "ids":
    [...], "from_step": S}; "source" omitted for a single store, required for a
    mixture). Default "": nothing left out. From step S on the ids are deleted from
    their source's sample stream: never trained, the source's next sample fills their
    slots (a mixture keeps its exact per-source counts); an id stays left out from the
    first step that names it. Ids are training sample ids as `zephon plan` prints
    them; an id out of range, a held-out id or a list that leaves a source empty is
    refused. An entry for untrained steps resumes as a continuation; changing an entry
    at a trained step needs allow_changes = ["exclude"]. Part of the data config (the
    file's content, not its path); a step's ids digest binds the entries with
    from_step <= that step."""

    heldout_samples: int = 0
    """Samples at the end of the store reserved for validation and never
    trained on. The validation loader reads them in order, so validation loss
    does not depend on the DP degree. With a mixture: the default of each
    source's heldout_samples; validation then reports each source's loss
    (validation/loss/<name>) beside the overall one."""

    audit: Literal["off", "ids", "tokens"] = "ids"
    """What the Global Sequence Tracker (<dump_folder>/zephon/sequence_log.jsonl)
    records per step: "off" (no log), "ids" (digest of the step's ordered sample
    ids), "tokens" (also a digest of the token content every DP rank received,
    combined in rank order; one small all-gather per step)."""

    allow_changes: list[str] = field(default_factory=list)
    """Data-config fields whose change since the checkpoint is accepted on
    resume, e.g. ["seed"]. Names: seed, seq_len, schedule, num_samples (changed
    by heldout_samples), store (its contents), tokenizer, mixture (a mixture's
    sources, or weights of steps already trained), skip_steps (an entry at a step
    already trained), exclude (a left-out entry at a step already trained), or
    "all". Without it such a resume is refused, naming the differing fields."""

    ignore_log_mismatch: bool = False
    """Resume even when the sequence log is missing or does not contain the
    checkpoint's chain head (the log then restarts its chain at the checkpoint)."""

    start_over: bool = False
    """Start from step 1 in a run folder that holds a history this job will not
    resume from (sequence-log steps, checkpoints; e.g. checkpointing is off, or no
    checkpoint is loadable). The log gets a start event that supersedes the old
    steps; old checkpoints stay. Without it such a start is refused, except for a
    torchrun elastic restart of the same job."""

    accounting: bool = True
    """Per-source accounting (default on): at every step, per source, the samples,
    tokens, cumulative samples beside the exact target, deviation, epoch and documents
    started go to TensorBoard (zephon/source/<name>/..., with metrics.enable_tensorboard),
    a line per step at metrics.log_freq to the log, and a warning when a source enters a
    new epoch. Off: none of these. Not part of the data config."""

    prefetch: int = 2
    """Micro-batches prepared ahead of the trainer by a background thread (0: none)."""

    init: Literal["zephon", "torchtitan"] = "zephon"
    """Initial weights. "zephon": every parameter is drawn on its full shape from a
    generator keyed by (debug.seed, its name), with TorchTitan's distributions, and
    each rank keeps its shard: the same initial weights on 1 rank and under any
    FSDP / TP / PP layout (on one device type), so fresh runs of one config at
    different sizes follow the same loss curve. "torchtitan": TorchTitan's own init
    (DTensor random ops on the shards: the values depend on the sharding). A resume
    loads the weights from the checkpoint either way."""

    reproducible: bool = False
    """The same bits at any DP degree (issue 46): the parameters, the optimizer state
    and every logged training loss and gradient norm of a step are identical whether
    the job runs on 1 rank or under FSDP on any number of ranks, for a fixed
    training.local_batch_size, seed and data config (FSDP or HSDP; a run resumed at another DP
    degree follows the uninterrupted run bit for bit). Each micro-batch's gradient is
    computed alone and the gradients, their norm and the loss are summed exactly
    (fixed point in int64: titan/reproducible), at the cost of reducing 6 times the
    gradient bytes. A change of TP, CP, PP or EP degree or of the micro-batch size is
    outside the guarantee. torchft replica groups of one rank are covered (a step's
    parts are then cut in whole micro-batches), and MoE models at EP 1. Refused at
    start, in one line, with what it does not cover yet: TP, CP, PP, EP, replicas over
    shards of one rank, torchft groups of more than one rank,
    training.mixed_precision_param other than float32, optimizers other than Adam /
    AdamW, and debug.deterministic off. Not part of the data config."""
