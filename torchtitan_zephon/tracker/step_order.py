"""Step order in a sequence log: which steps the current history has shown so far.

Role: ``LogReader`` hands every record's step to a ``StepOrder``; a step that does
not follow the one before it becomes a problem that says which it is: a step
missing (its record never comes), out of order (its record comes further on: the
skipped range is followed until it turns up) or repeated.

Invariant: memory is O(gaps) (at most ``MAX_GAPS`` skipped ranges, then the order
is no longer followed until the next start event), never O(steps); a missing
step's problem is rewritten to "out of order" exactly when its record turns up
later, and steps of such a gap that never come are named at ``finish``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from torchtitan_zephon.tracker.records import LogProblem

Report = Callable[[int, "int | None", str, str], "LogProblem | None"]
"""``LogReader._problem``: count a problem (line, step, kind, message), return it if kept."""

MAX_GAPS = 1000
"""Skipped ranges followed in detail; past this the reader no longer tells a missing
step from an out-of-order one (until the next start event)."""


class Gap:
    """Steps a forward jump in the log skipped: reported missing (``problem``) until one
    of them turns up further on; the problem then says the log is out of order."""

    def __init__(self, line: int, step: int, problem: LogProblem | None) -> None:
        self.line, self.step, self.problem = line, step, problem
        """The line of the record that jumped ahead, its step, the problem said there."""
        self.filled = False


class StepOrder:
    """Which steps of the current history the log has shown so far, in O(gaps) memory:
    every step in ``floor + 1 .. high`` has had a record except the ``missing`` ranges
    (sorted, disjoint, each with the gap that skipped it). Tells a deleted record from
    one that comes later (out of order) or again (repeated). ``high`` None: not
    followed (before a start event, or past MAX_GAPS)."""

    def __init__(self) -> None:
        self.high: int | None = None
        self.floor = 0
        self.missing: list[list] = []  # [first, last, Gap]

    def event(self, kind: Any, k: int) -> None:
        """A start event (the history begins again) or a resume from step ``k``."""
        if kind == "start":
            self.high, self.floor, self.missing = k, k, []
        elif self.high is None:
            return
        elif k <= self.high:
            self.high = k
            self.missing = [[a, min(b, k), g] for a, b, g in self.missing if a <= k]
        else:  # a resume from a step the log never reached: the steps up to k unknown
            self.high = self.floor = k

    def knows(self, step: int) -> bool:
        """Whether the log so far says if ``step`` had its record."""
        return self.high is not None and self.floor < step <= self.high

    def _overlapping(self, first: int, last: int) -> tuple[int, int]:
        """The slice of ``missing`` whose ranges overlap ``first..last`` (O(log gaps))."""
        lo = bisect.bisect_left(self.missing, first, key=lambda r: r[1])
        hi = bisect.bisect_right(self.missing, last, lo, key=lambda r: r[0])
        return lo, hi

    def is_missing(self, step: int) -> bool:
        lo, hi = self._overlapping(step, step)
        return lo < hi

    def unseen(self, first: int, last: int) -> list[int]:
        """The first step of each stretch of ``first..last`` with no record so far
        (the first two at most: enough to tell none, one and more)."""
        if self.high is None or first <= self.floor:
            return [first]
        lo, hi = self._overlapping(first, last)
        out = [max(a, first) for a, _, _ in self.missing[lo : min(hi, lo + 2)]]
        if last > self.high:
            out.append(max(first, self.high + 1))
        return out

    def skipped(self, first: int, last: int, gap: Gap) -> None:
        """A forward jump left ``first..last`` without records (what lies beyond
        ``high`` is new)."""
        if self.high is None:
            return
        first = max(first, self.high + 1)
        if first <= last:
            if len(self.missing) >= MAX_GAPS:
                self.high = None  # too disordered to follow
                return
            self.missing.append([first, last, gap])

    def saw(self, first: int, last: int, line: int, prev: int | None) -> None:
        """Records of the consecutive steps ``first..last``, the first at ``line`` after
        a record of step ``prev``. The first record a gap was missing turns the gap's
        problem into an out-of-order one."""
        if self.high is None:
            return
        if first <= self.high and self.missing:
            lo, hi = self._overlapping(first, last)
            out = []
            for a, b, g in self.missing[lo:hi]:
                if not g.filled:
                    g.filled = True
                    s = max(a, first)
                    after = prev if s == first else s - 1
                    if g.problem is not None:
                        g.problem.message = (
                            f"line {g.line}: out of order (step {s} after step {after}): the "
                            f"record of step {s} belongs before this line's record of step "
                            f"{g.step} but is at line {line + s - first}"
                        )
                if a < first:
                    out.append([a, first - 1, g])
                if b > last:
                    out.append([last + 1, b, g])
            self.missing[lo:hi] = out
            if len(self.missing) > MAX_GAPS:  # split past the bound: too disordered to follow
                self.high, self.missing = None, []
                return
        self.high = max(self.high, last)

    def jump(self, lineno: int, prev: int, step: int, report: Report) -> None:
        """The record of ``step`` follows that of ``prev < step - 1``: the steps between
        are missing, unless all came earlier (the log is out of order)."""
        unseen = self.unseen(prev + 1, step - 1)
        if not unseen:
            between = (
                f"step {prev + 1}" if prev + 1 == step - 1 else f"steps {prev + 1}..{step - 1}"
            )
            report(
                lineno, step, "order",
                f"line {lineno}: out of order (step {step} after step {prev}): {between} came "
                "earlier in the log",
            )  # fmt: skip
            return
        gap = unseen[0]  # the first bad step is the first missing one
        what = f"step {gap} is" if gap == step - 1 else f"steps {gap}..{step - 1} are"
        problem = report(
            lineno, gap, "order",
            f"line {lineno}: {what} missing before the record of step {step} (deleted?)",
        )  # fmt: skip
        self.skipped(prev + 1, step - 1, Gap(lineno, step, problem))

    def back(self, lineno: int, prev: int, step: int, report: Report) -> None:
        """The record of ``step`` follows that of ``prev >= step``."""
        if not self.knows(step):
            message = f"record of step {step} follows step {prev} (repeated or out of order)"
        elif self.is_missing(step):
            message = f"out of order (step {step} after step {prev})"
        else:
            message = (
                f"record of step {step} follows step {prev}: step {step} is repeated (its "
                "record came earlier in the log)"
            )
        report(lineno, step, "order", f"line {lineno}: {message}")

    def finish(self) -> None:
        """At the end of the log: an out-of-order gap's steps that never came are named."""
        left: dict[int, list[list]] = {}
        for r in self.missing:
            if r[2].filled and r[2].problem is not None:
                left.setdefault(id(r[2]), []).append(r)
        for ranges in left.values():
            (a, b, g), n = ranges[0], sum(b - a + 1 for a, b, _ in ranges)
            if len(ranges) == 1:
                what = f"step {a} is" if a == b else f"steps {a}..{b} are"
            else:
                what = f"{n} of its steps, from step {a} on, are"
            g.problem.message += f"; {what} missing (deleted?)"
