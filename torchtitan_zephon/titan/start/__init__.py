"""A start, before the first step (TorchTitan's checkpoint-load seam).

- ``checks``: the job config checked (degrees, batch layout, settings);
- ``preflight``: the data checked against the checkpoint a start resumes from;
- ``decision``: what a start will do (fresh, resume, refused), decided once
  (checkpoints written by older versions: ``torchtitan_zephon.migrate.old_runs``).

This package re-exports nothing: import the modules.
"""
