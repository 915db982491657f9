"""torchtitan_zephon: TorchTitan with elastically deterministic data loading (Zephon)."""

__version__ = "0.1.0"
