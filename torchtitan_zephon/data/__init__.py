"""Zephon data engine: token store, permutation, plan and loader.

Pure Python + numpy + torch tensors. No torch.distributed, no torchtitan imports.

Modules (import them directly; this package re-exports nothing so that
``prepare`` worker processes stay light):

- ``store``: ``TokenStore`` (memory-mapped tokens + manifest + fingerprint), ``StoreError``.
- ``prepare``: ``prepare_store`` builds a store from text / JSONL / Parquet / HF datasets.
- ``permutation``: ``Permutation``, a keyed O(1) bijection per (seed, epoch).
- ``plan``: ``BatchSchedule``, ``DataPlan``, ``check_batch_layout``: step -> sample ids.
- ``loader``: ``ZephonLoader`` (one DP rank's micro-batches), ``DataStateMismatch``.
"""
