"""The order engine: which sample every step, rank and micro-batch trains on.

Role: pure index math from a data config (stores' sizes and fingerprints, seed,
batch schedule, mixture) to sample keys: ``permutation`` (a keyed bijection per
epoch), ``layout`` (steps over positions, rank slices, micro-batches), ``store_size``
(what a store must hold for a schedule, and what to change), ``stream``
(one store's stream, sample keys), ``mixture/`` (config, spec, rule, build, plan,
stream), ``skips`` (skip ranges: the data of whole steps consumed, never trained),
``exclusions`` (left-out samples: ids deleted from a source's stream from a step on),
``data_config`` (the data config), ``state`` (the data state) and ``resume`` (the
resume rule).

Invariant: pure and deterministic: the same config gives the same keys on every
rank, process and machine. Imports only ``store`` (format helpers) besides
itself: never ``ingest``, ``job``, torch.distributed or torchtitan, so nothing
here can read a corpus or tokenize by accident. Import the modules directly:
this package re-exports nothing.

Glossary (one word per concept, used across the package):

- store: a prepared token corpus on disk (``store.reader.TokenStore``).
- sample: a fixed window of ``seq_len + 1`` tokens of a store, named by its id.
- position: an index in the global stream (0, 1, 2, ...), the one word for it, in a
  mixture too (``MixturePlan.ids_for_positions``); each position reads its source's
  *stream position* (its index in that source's own stream, without skips); past the
  skips it is an *effective position*, which left-out samples map on to the stream
  position (``exclusions``). ``zephon show --json`` keeps printing a step's positions
  under the key ``slots`` (an interface: scripts read it).
- place: where a sample is trained: a micro-batch's (step, index, last)
  (``Layout.microbatch_places``), a source's draw's (step, index in the step)
  (``StreamPlan.place_of_draw``).
- step: one optimizer step (1-based), covering ``gbs(step)`` consecutive positions.
- slice: one DP rank's contiguous part of a step.
- micro-batch: ``local_batch_size`` consecutive samples of a slice (one forward).
- range (of a rank's stream): consecutive positions of one rank's stream, looked up
  together (``Layout.rank_ranges``); a *window* is a sample's tokens
  (``TokenStore.windows``).
- layout: the map step -> DP rank slice -> micro-batches -> ranges, in positions, from
  the batch schedule and the resume anchor (``layout.Layout``, its one home).
- source: one store of a mixture, by name (a ``[[source]]`` of a mixture file).
- data: the job's data, opened once (``job.data.JobData``: one store, or a mixture);
  never called a source.
- inputs: the raw files ``zephon prepare`` reads (text, JSONL, Parquet, datasets).
- part: a replica group's share of a step under torchft (``layout.part_slice``).
- stream: the sample keys of every position, the global sequence a plan defines.
- schedule: a step-indexed setting: the batch schedule, a mixture's weight schedule.
- plan: the pure function from a data config to its stream (``DataPlan``, ``MixturePlan``).
"""
