"""The TorchTitan (0.3) side of torchtitan_zephon, one folder per seam where it hooks in:

- ``configs/``: the registry, the ``[zephon]`` section, the job's view, the TOML
  front end and its table (how a job is spelled and parsed);
- ``components/``: the dataloader, validator and trainer TorchTitan builds, and
  what they share (attention masks, the job's data, accounting);
- ``start/``: checks, preflight, the start plan and old runs (before the first step);
- ``weights/``: topology-free initial weights;
- ``ft/``: torchft (replica groups);
- ``platform``: the platform layer (CPU + gloo where there is no accelerator).

Importing this package makes ``import torchtitan`` work where triton is absent.
"""

from torchtitan_zephon.titan.platform import install_triton_stub

install_triton_stub()
