"""The components Zephon gives TorchTitan 0.3 (its component seam).

- ``dataloader``: ``ZephonDataLoader`` (a ``BaseDataLoader``);
- ``validate``: ``ZephonValidator`` (held-out samples);
- ``trainer``: ``ZephonTrainer`` (TorchTitan's ``Trainer`` with the data state,
  the sequence log, the run folder's lock and the checks);
- ``attention``: document masks from the loader's document positions;
- ``job_data``: the job's data handed to these components, opened once;
- ``accounting``: what each step drew, logged.

This package re-exports nothing: import the modules.
"""
