"""The TorchTitan (0.3) side of torchtitan_zephon, one folder per seam where it hooks in,
layered: each imports only those below it (contract ``titan-layers``):

- ``platform``: the platform layer (CPU + gloo where there is no accelerator);
- ``components/``: the trainer, dataloader and validator TorchTitan builds, and what
  they share (attention masks, accounting, the run folder's checkpoints);
- ``start/``: checks, the job's data opened once, preflight, the start decision and
  old runs (before the first step);
- ``ft/``: torchft (replica groups);
- ``settings/`` and ``weights/``: the ``[zephon]`` section and the job's view;
  topology-free initial weights.

How a job is named and parsed (the registry, the TOML front end, the command lines)
is one floor up, in ``torchtitan_zephon.configs``.

Importing this package makes ``import torchtitan`` work where triton is absent.
"""

from torchtitan_zephon.titan.platform import install_triton_stub

install_triton_stub()
