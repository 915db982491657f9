"""How a sequence log's events link to its records.

Role: a start event's chain is the genesis of its data config (``records.genesis``
of the config's fingerprint); a resume from step ``k`` names the chain of the
log's record of step ``k``. An annotation (``ANNOTATIONS``: a ``skip`` entry taking
effect at step S; under torchft a ``quorum`` that trains step S and a ``retry`` of
step S after a commit that failed) follows the record of step S - 1: ``from_step``
S - 1 and that record's chain, the chain the record of step S then follows from; it
supersedes nothing. ``LogReader`` calls ``check_event`` (start, resume) or
``check_annotation`` at each event line of its second pass.

Invariant: an event whose chain does not link (an edited start event or data
config, a resume whose step has no record or another chain, an annotation that does
not follow the record before it) is reported as an
``event`` problem naming its line; only a resume that knowingly restarted the
chain (audit off, ``ignore_log_mismatch``) or a start of tracker format 1 is a
note instead.
"""

from __future__ import annotations

from typing import Any

from torchtitan_zephon.store.format import fingerprint
from torchtitan_zephon.tracker.records import genesis
from torchtitan_zephon.tracker.step_order import Report

ANNOTATIONS = ("skip", "quorum", "retry")
"""Events that annotate the step after them: the chain goes on through them."""


def check_event(
    lineno: int, e: dict[str, Any], linked: dict[int, str], report: Report, notes: list[str]
) -> tuple[int, str | None]:
    """Check the start / resume event ``e`` at ``lineno`` against the chains of the
    records before it (``linked``: the steps resume events name, trimmed to what the
    event keeps); its step and the chain the next record follows from (None: not
    linkable). Problems go to ``report``, what limits the proof to ``notes``."""
    k, chain = int(e.get("from_step", 0)), e.get("chain")  # from_step checked by the scan
    if chain is not None and not isinstance(chain, str):
        report(
            lineno, None, "event",
            f"line {lineno}: a {e.get('event')} event whose chain is {chain!r}, not a hex "
            "string (the event was edited)",
        )  # fmt: skip
        linked.clear()
        return k, None
    for s in [s for s in linked if s > k]:
        del linked[s]
    if e.get("event") == "start":
        linked.clear()
        fp = e.get("data_config_fingerprint")
        if chain is None:  # tracker format 1: the genesis is not recorded
            notes.append(
                f"line {lineno}: a start event of tracker format 1 (no data config): the "
                "first record after it cannot be linked"
            )
            return k, None
        if fp is None or fingerprint(e.get("data_config")) != fp or genesis(fp) != chain:
            report(
                lineno, None, "event",
                f"line {lineno}: the start event's chain is not the genesis of its data "
                "config (the event or its data config was edited)",
            )  # fmt: skip
    elif e.get("event") == "resume" and k > 0:
        have = linked.get(k)
        if e.get("chain_restart") or e.get("log_mismatch_ignored"):
            why = "audit was off" if e.get("chain_restart") else "ignore_log_mismatch"
            notes.append(
                f"line {lineno}: resume from step {k} restarted the chain ({why}): steps "
                f"up to {k} and after it are not linked"
            )
        elif have is None:
            report(
                lineno, k, "event",
                f"line {lineno}: resume from step {k}, but the log has no record of step {k} "
                "before it (records deleted?)",
            )  # fmt: skip
        elif have != chain:
            report(
                lineno, k, "event",
                f"line {lineno}: resume from step {k} names chain {str(chain)[:16]}..., the "
                f"log's record of step {k} has {have[:16]}...",
            )  # fmt: skip
    return k, chain


def check_annotation(
    lineno: int, e: dict[str, Any], prev: tuple[int | None, str | None], report: Report
) -> None:
    """Check the annotation ``e`` (a skip, quorum or retry event) at ``lineno`` against
    ``prev``, the (step, chain) the log reached before it: the event follows that record
    (a start or resume event's step and chain where no record came yet). An annotation
    changes neither."""
    step, chain = prev
    k = int(e.get("from_step", 0))
    if step is None or chain is None:
        return  # nothing to link to: the record after it is reported (an orphan)
    if k != step or e.get("chain") != chain or e.get("step") != k + 1:
        report(
            lineno, step + 1, "event",
            f"line {lineno}: a {e.get('event')} event for step {e.get('step')!r} (from_step "
            f"{k}) that does not follow the log's step {step} before it (the event was edited "
            "or moved)",
        )  # fmt: skip


check_skip = check_annotation  # its name before torchft's annotations
