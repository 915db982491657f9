"""``python -m torchtitan_zephon``: the ``zephon`` command."""

from torchtitan_zephon.cli.main import run

run()
