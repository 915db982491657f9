"""The TorchTitan side of torchtitan_zephon: platform layer, [zephon] config,
TrainSpec registration, dataloader builder, checkpointed tracker, Trainer.

Importing this package makes ``import torchtitan`` work where triton is absent.
"""

from torchtitan_zephon.titan.platform import install_triton_stub

install_triton_stub()
