"""A run folder (TorchTitan's ``job.dump_folder``): who holds it, and what it recorded.

Its modules (import from them; this package re-exports nothing):

- ``recorded``: reading a run folder after the fact (checkpoints, TensorBoard
  events, the sequence log, the saved job config), for the ``zephon`` command and a
  start's look at its own folder;

Ownership: one job at a time, and a dead job never blocks for long.
``<dump_folder>/zephon/owner.lock`` names the job that holds the folder:

- ``process``: a process named so that a reused pid is not mistaken for it
  (``Process``: host, machine id, pid, start time), this worker's torchrun agent,
  and ``kill_tree`` (the node-loss demo's and tests' SIGKILL of a process tree);
- ``holder``: the lock file and what it says (``Holder``, ``lock_path``,
  ``read_holder``, the lease period);
- ``lock``: taking and keeping the folder (``RunFolderLock``: check, acquire,
  heartbeat, release; ``FolderInUse``).

Invariant: at most one live job holds a folder, and a lock left by a dead job
blocks a restart for at most one lease period of the holder (``lock``).

No torch here: the trainer gathers its ranks' agents and passes them in.
"""
