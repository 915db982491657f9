"""The TorchTitan (0.3) side of torchtitan_zephon: platform layer, the zephon config
section, the job's view, dataloader and validator components, topology-free init,
preflight, Trainer.

Importing this package makes ``import torchtitan`` work where triton is absent.
"""

from torchtitan_zephon.titan.platform import install_triton_stub

install_triton_stub()
