"""Argument types shared by the ``zephon`` subcommands.

Invariant: a value outside its type's range is an argparse usage error that
names the flag, the range expected and the value given (exit status 2), before
the subcommand reads or starts anything.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.skips import SkipSteps


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer >= ``low`` (and <= ``high`` when given)."""
    expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def positive_float(text: str) -> float:
    """A finite number > 0 (a duration, a size)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def schedule_arg(text: str) -> BatchSchedule:
    """``--global-batch-size``: a batch schedule (``G`` or ``S:G,...``)."""
    try:
        return BatchSchedule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def skip_steps_arg(text: str) -> SkipSteps:
    """``--skip-steps``: skip ranges (``S:N,...``)."""
    try:
        return SkipSteps.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
