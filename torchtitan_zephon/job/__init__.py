"""The job's data: what a loader reads, behind one interface.

Role: the layer above the engine (``order``, ``ingest``, ``store``) that opens a
job's stores and pairs a plan (which sample each position of the global stream
holds) with the tokens of those samples. Its modules (import from them; this
package re-exports nothing):

- ``data``: the one interface (``JobData``): one store, or several drawn in exact
  proportions (a mixture); ``source``, one of its sources (``Source``: a store and its
  map from sample ids to rows; ``WindowSource`` reads windows);
- ``vocab``: the vocabulary guard of a job's stores (``store_id_limit``,
  ``store_out_of_vocab``);
- ``stores``: the token store folder a store value names (``store_location``) and
  the opened stores of a mixture (``open_mixture_stores``);
- ``plans``: the plan a data config governs and what it tells (``plan_of``,
  ``first_correction``, ``mixture_progress``), without opening a store;
- ``settings``: the job's data as the trainer's settings name it (``raw_inputs``,
  ``open_store``, ``store_data``, ``builtin_tokenizer``): what ``titan`` asks
  instead of ingesting or opening a store itself;
- ``accounting``: what each trained step drew from each source (``step_account``:
  O(sources) from the plan's counts; ``documents_started``: O(global batch), for a
  background thread).
- ``loader``: the per-rank loader (``ZephonLoader``: this rank's slice of each step,
  read ahead from stores in object storage, checked and pinned) over that data;
  ``documents``, the per-document positions of a batch;
- ``packing``, ``packed``, ``packed_remote``: whole documents in every sample
  (``zephon.packing``): a store's packing index on disk, a store read as packed
  samples (``PackedSource``), their pieces read by range from object storage;
- ``run_data``: the record of the job's data a run folder keeps (``zephon/run_data.json``).

Ownership: a job opens its data once (``JobData.of_store`` / ``open_mixture``) and
hands that object on; the trainer hands it to the preflight, the loader and the
validator. Nothing here keeps opened stores per process: a second open is a
second object, checked afresh.

Invariant: everything downstream (the loader, the sequence tracker's ids
digests, the data state) sees only **sample keys**: int64 values naming (source
index, sample id) as ``source << SOURCE_SHIFT | id`` (``order.stream``). For one
store the key is the sample id, so runs and logs of one store are unchanged; for
a mixture the keys bind the sources, in name order (the order of the
``[[source]]`` blocks does not count).
"""
