"""The chain heads a run's complete checkpoints saved, checked against its log.

Role: for ``zephon verify RUN``, find the run folder a log belongs to, read each
checkpoint's Zephon record (as the trainer's resume check reads it) and, while the
log's records stream past, note the chains of the steps those heads name.

Invariant: a checkpoint's head is a problem exactly when a job resuming from it
is refused (``writer.head_problem``, the trainer's test and wording) and the log
does not excuse it: a head found only in a superseded record, or a resume that
knowingly continued with the mismatch, is a note; incomplete and corrupt
checkpoints are skipped, as a resume skips them. Watching costs O(checkpoints)
per batch of records.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan_zephon.job.run_data import read_run_data, recorded
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.tracker import LOG_NAME, LogReader
from torchtitan_zephon.tracker.fast_path import RecordRun
from torchtitan_zephon.tracker.reader import STRETCH_BYTES
from torchtitan_zephon.tracker.writer import head_problem


def run_folder(log_file: Path) -> Path | None:
    """The run folder a log belongs to (``<run>/zephon/sequence_log.jsonl``), if any."""
    if log_file.name == LOG_NAME and log_file.parent.name == "zephon":
        return log_file.parent.parent
    return None


class CheckpointHeads:
    """The chain heads a run's complete checkpoints saved, checked against its log.

    A checkpoint's Zephon record (``runs.read_data_state``, as the trainer's resume
    check reads it) holds the chain value of the last step it covers; the log must
    hold that value as its effective record of that step (``writer.head_problem``,
    the trainer's test and wording), or a job resuming from the checkpoint is
    refused: the log lost or changed records the checkpoint vouches for. A head found
    only in a superseded record (a checkpoint of a history a later start or resume
    replaced) is a note. Incomplete and corrupt checkpoints are skipped, as a resume
    skips them. Watching the log costs O(checkpoints) per batch of records."""

    def __init__(self, log_file: Path) -> None:
        self.checked: list[dict[str, Any]] = []
        """One entry per checkpoint folder (the ``--json`` report's ``checkpoints``)."""
        self.notes: list[str] = []
        self._found: dict[int, str] = {}
        run = run_folder(log_file)
        for c in runs.checkpoints(run, checkpoint_folder(run)) if run else []:
            self._add(runs.verify_checkpoint(c))
        self._steps = sorted({e["head"]["step"] for e in self.checked if e["head"]})
        self._wanted = set(self._steps)

    def _add(self, c: runs.CheckpointInfo) -> None:
        entry: dict[str, Any] = {"step": c.step, "path": str(c.path), "status": c.status}
        entry.update(head=None, result="skipped", message=None)
        self.checked.append(entry)
        if c.status != "complete":
            why = "incomplete (no .metadata)" if not c.complete else f"corrupt ({c.problem})"
            self.notes.append(f"checkpoint {c.path} is {why}: skipped, as a resume skips it")
            return
        if c.holds != "training":
            what = "the model only" if c.holds == "model" else "no Zephon data state"
            self.notes.append(f"checkpoint {c.path} holds {what}: not checked")
            return
        try:
            state = runs.read_data_state(c.path)
        except Exception as e:  # noqa: BLE001 - a DCP folder can be broken in many ways
            self.notes.append(
                f"checkpoint {c.path}: its data state is unreadable ({e}): not checked"
            )
            return
        head, done = state.tracker, state.next_step - 1
        if head is None or int(head["step"]) != done or done == 0:
            entry["result"] = "no chain head"  # audit off, or step 0: nothing to hold
            return
        entry["head"] = {"step": done, "chain": str(head["chain"])}

    def watch(
        self, batches: Iterator[RecordRun | list[tuple]]
    ) -> Iterator[RecordRun | list[tuple]]:
        """``batches`` passed through, noting the chains of the steps the heads name."""
        steps, wanted, found = self._steps, self._wanted, self._found
        for batch in batches:
            if not steps:
                pass
            elif isinstance(batch, RecordRun):
                lo = bisect.bisect_left(steps, batch.first)
                for s in steps[lo : bisect.bisect_right(steps, batch.last, lo)]:
                    i = s - batch.first
                    found[s] = batch.chains[32 * i : 32 * i + 32].hex()
            else:
                for row in batch:
                    if int(row[0]) in wanted:
                        found[int(row[0])] = str(row[6])
            yield batch

    def problems(self, log: LogReader) -> list[dict[str, Any]]:
        """After the log's batches were watched to the end: a problem per checkpoint
        whose head the log does not hold (each entry's ``result`` filled in)."""
        pending = []
        for e in self.checked:
            if e["head"] is None:
                continue
            k, chain = e["head"]["step"], e["head"]["chain"]
            problem = head_problem(k, chain, self._found.get(k))
            if problem is None:
                e["result"] = "held"
            elif any(_continued_anyway(ev, k, chain) for ev in log.events):
                e["result"] = "mismatch ignored"
                self.notes.append(
                    f"checkpoint {e['path']}: the log does not hold its chain head ({problem}); "
                    f"a resume from step {k} continued with the mismatch ignored"
                )
            else:
                pending.append((e, problem))
        superseded = _records_of(log.path, [e["head"] for e, _ in pending]) if pending else {}
        out = []
        for e, problem in pending:
            k, chain = e["head"]["step"], e["head"]["chain"]
            line = superseded.get((k, chain))
            if line is not None:
                e["result"] = "superseded"
                self.notes.append(
                    f"checkpoint {e['path']} saved step {k} of a superseded history (its record "
                    f"is line {line}, replaced by a later start or resume): a job resuming from "
                    f"it is refused ({problem})"
                )
                continue
            lost = k not in self._found
            e["result"] = "missing" if lost else "differs"
            e["message"] = (
                f"checkpoint {e['path']} saved the chain head of step {k}, which the log does "
                f"not hold: {problem}. "
                + (
                    "Records the checkpoint vouches for are gone (a cut or deleted line?)"
                    if lost
                    else "The log was edited or belongs to another run"
                )
                + "; a job resuming from that checkpoint is refused"
            )
            out.append({"line": None, "step": k, "kind": "checkpoint", "message": e["message"]})
        return out


def checkpoint_folder(run: Path) -> str:
    """``checkpoint.folder`` of the run's newest start (``zephon/run_data.json``), else of
    the job config the run saved, else TorchTitan's default."""
    folder = recorded(read_run_data(run), "checkpoint_folder")
    if folder:
        return folder
    saved = runs.saved_config(run)
    section = saved[1].get("checkpoint") if saved else None
    folder = section.get("folder") if isinstance(section, dict) else None
    return folder if isinstance(folder, str) and folder else "checkpoint"


def _continued_anyway(event: dict[str, Any], step: int, chain: str) -> bool:
    """A resume from ``step`` that took ``chain`` from the checkpoint and knowingly
    restarted the log's chain there (``zephon.ignore_log_mismatch``, audit off)."""
    return (
        event.get("event") == "resume"
        and event.get("from_step") == step
        and event.get("chain") == chain
        and bool(event.get("log_mismatch_ignored") or event.get("chain_restart"))
    )


def _records_of(path: Path, heads: list[dict[str, Any]]) -> dict[tuple[int, str], int]:
    """``(step, chain) -> line`` of any record (superseded or not) of those heads: one
    pass over the log's bytes, made only for heads the effective history lacks."""
    needles = {h["chain"].encode(): h["step"] for h in heads}
    out: dict[tuple[int, str], int] = {}
    with open(path, "rb") as f:
        lineno = 1
        while stretch := f.read(STRETCH_BYTES):
            stretch += f.readline()
            for needle, step in needles.items():
                at = stretch.find(needle)
                while at >= 0:
                    start = stretch.rfind(b"\n", 0, at) + 1
                    end = stretch.find(b"\n", at)
                    end = len(stretch) if end < 0 else end
                    try:
                        entry = json.loads(stretch[start:end])
                    except (ValueError, RecursionError):
                        entry = None
                    if (
                        isinstance(entry, dict)
                        and "event" not in entry
                        and entry.get("step") == step
                        and entry.get("chain") == needle.decode()
                    ):
                        out[(step, needle.decode())] = lineno + stretch.count(b"\n", 0, start)
                    at = stretch.find(needle, end)
            lineno += stretch.count(b"\n")
    return out
