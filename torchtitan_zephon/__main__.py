"""``python -m torchtitan_zephon``: the ``zephon`` command."""

import sys

from torchtitan_zephon.cli.main import main

sys.exit(main())
