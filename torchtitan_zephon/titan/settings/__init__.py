"""The settings at the bottom of ``titan/``: what a job's settings are, whatever
front end or builder made them.

- ``zephon_section``: the ``[zephon]`` section (``Zephon``);
- ``job_view``: what Zephon reads of a job config, whatever builder made it
  (``JobView``, ``job_view``), and the global batch schedule (``batch_schedule``);
- ``loss_chunks``: the chunked loss's chunk count fitted to ``seq_len``.

The jobs and the command lines that name them are above ``titan/``, in
``torchtitan_zephon.configs``.
This package re-exports nothing: import the modules.
"""
