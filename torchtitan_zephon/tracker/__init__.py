"""Global Sequence Tracker: the append-only log that proves which data each step saw.

``<dump_folder>/zephon/sequence_log.jsonl`` holds one JSON object per line:

* a step record ``{"v": 2, "step", "first_position", "num_samples", "ids_digest",
  ["tokens_digest"], "chain"}`` per completed step. ``ids_digest`` hashes the
  step's ordered sample ids (sample keys for a mixture: source and id) *bound
  to what governed the step*: the data config's order key (store content,
  tokenizer, seq_len, held-out split, seed, order format, a mixture's sources)
  with, for a mixture, the weights in effect at the step (see
  ``order.data_config.DataConfig.step_key``), and the step's first position (its size
  is the number of ids). ``chain`` is ``sha256(previous chain
  + canonical JSON of the record without "chain")``; the line is that canonical
  JSON with the chain spliced in last (``records.record_line``);
* an event ``{"event": "start" | "resume", "from_step": k, "chain", "data_config",
  "data_config_fingerprint", "world_size", "dp_degree", "nnodes", ...}`` whenever a
  job starts; a start's chain is ``genesis(data_config_fingerprint)``, a resume's
  is the checkpoint's chain head. Step records after ``k`` written before that
  event are superseded (never rewritten): the *effective history* is what
  remains after applying the events in order;
* a skip event ``{"event": "skip", "from_step": S - 1, "chain", "step": S, "steps": N,
  "text"}`` just before the record of step S whenever a skip entry S:N of the data
  config (``order.skips``) takes effect (again after a rollback to a step before S).
  Its chain is the record of step S - 1's, so it supersedes nothing and the chain
  goes on through it; the resume or start event before it holds the data config.
  Under torchft, two more such annotations of step S: ``{"event": "quorum", ...,
  "groups": n, "quorum_id"}`` before the first step a new quorum of n replica groups
  trains, and ``{"event": "retry", ..., "groups", "quorum_id", "text"}`` for an attempt
  at step S that was not committed (trained again: still one record of S);

Invariants:
- The chain of the effective history at step ``s`` depends only on the data
  config, the audit level and the sample ids (and token digests) of steps
  ``1..s``, never on the topology or the restarts that produced it.
- Two bound records (``"v": 2``) of a step have equal ``ids_digest`` exactly when
  the step read the same samples of the same content under the same order key at
  the same positions; ``zephon verify`` compares these per-step digests, so runs
  with different audit levels or a schedule extended later still compare.
- ``read_log`` recomputes every record's chain from the one before it (the event
  that opened its job gives the first) and reports the first record whose chain,
  step order or resume link is wrong: a deleted, inserted, reordered or edited
  record never goes unnoticed. The chain is an unkeyed hash: it catches
  accidents, bugs, careless edits and foreign logs, not a forger who recomputes
  every later chain value.

Beside the log, ``sequence_log.jsonl.idx`` and ``.events`` index it (a cache,
see ``index``), so a resume finds its record in O(1) of the log's length.

Modules: ``records`` (formats, digests, chain), ``reader`` (streamed reading and
integrity) with ``stretches`` (its bytes in whole lines), ``step_order`` (missing,
out-of-order, repeated steps), ``links`` (events linked to records) and ``forked``
(the reader in a child process), ``fast_path`` (the reader's fast path: a stretch of
record lines checked at once), ``index`` (the sidecar), ``writer``
(``SequenceTracker``).
No torch.distributed here: the trainer decides who writes (global rank 0).
"""

from torchtitan_zephon.tracker.reader import LogContents, LogProblem, LogReader, read_log
from torchtitan_zephon.tracker.records import (
    LOG_NAME,
    TRACKER_FORMAT,
    TrackerError,
    chain_next,
    genesis,
    ids_digest,
    log_path,
    sample_digests,
    tokens_digest,
    window_digests,
)
from torchtitan_zephon.tracker.writer import SequenceTracker

__all__ = [
    "LOG_NAME",
    "TRACKER_FORMAT",
    "LogContents",
    "LogProblem",
    "LogReader",
    "SequenceTracker",
    "TrackerError",
    "chain_next",
    "genesis",
    "ids_digest",
    "log_path",
    "read_log",
    "sample_digests",
    "tokens_digest",
    "window_digests",
]
