"""Migrations: what older versions of Zephon wrote, made readable by today's, in one place.

- ``old_runs``: checkpoints of the TorchTitan 0.2.2-based Zephon, recognised, checked and
  loaded through a key map by the 0.3 trainer (the start decision asks ``old_runs.check``;
  the trainer installs the map into TorchTitan's checkpoint manager).
- ``old_stores``: stores written before checksums or block checksums, given them in place
  (``zephon inspect STORE --upgrade``) without changing their fingerprint.

On the trainer's path only the start decision (``old_runs.check`` of the checkpoint it
resumes from: ``None`` for today's) and the trainer (``old_runs.install`` of what it
found) use them; a store's readers only name ``zephon inspect --upgrade`` in the
messages that say to migrate. The package sits between ``titan`` and ``job`` in the
import layers (pyproject.toml).
"""
