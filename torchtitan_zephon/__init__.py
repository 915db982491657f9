"""torchtitan_zephon: TorchTitan with elastically deterministic data loading (Zephon)."""

__version__ = "0.1.0"

from torchtitan_zephon import old_paths  # noqa: E402

old_paths.install()  # import paths from before the layout by seam keep working
