"""``zephon where``: the steps whose samples contain a document, trained or planned.

Role: for document D of a store (of one source of a mixture: ``--source``), lists
every step, in the epochs asked (default the first two), whose global batch holds
a sample containing D: a sample contains D when any of its ``seq_len`` input
tokens belongs to D. The data is opened as ``zephon show`` opens it (a run with
its skips, a store, a mixture).

The way back, with no scan of the stream:
  D -> the sample ids whose input windows overlap D's tokens (contiguous ids)
  -> per epoch e, each id's position in the epoch: the inverse of the keyed
     permutation (``Permutation.inverse``) -> stream position e * N + that
  -> the effective position: the left-out map inverted (``ExclusionMap.effective``;
     a stream position whose sample a ``zephon.exclude`` entry deletes there is never
     trained: reported as ``left out``, with the entry's from_step)
  -> the draw that reads it: the skip map inverted (a stream position inside a
     skipped range is consumed and never trained: reported as ``skipped``)
  -> the training position: the draw itself for one store; for a mixture the
     position holding the source's k-th draw (a binary search over steps on the
     rule's counts, then the step's positions)
  -> the step holding that position (a binary search over the layout's steps).

Invariants:
- A hit (epoch, step, index) is exactly an occurrence of a sample containing D
  in ``plan.global_ids(step)`` at ``index``: ``where`` agrees with ``plan`` at
  every step, with skips, left-out samples and for mixtures (tests/cli/test_where.py
  checks it against a scan).
- The cost is O(samples of D x epochs x log(steps)), independent of where the
  steps lie in the stream.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_zephon.cli.args import int_in
from torchtitan_zephon.cli.open_data import ShowError, add_data_arguments, open_step_data, say_notes
from torchtitan_zephon.job.step_data import StepData, document_span
from torchtitan_zephon.order.permutation import Permutation
from torchtitan_zephon.order.skips import MAX_STEP
from torchtitan_zephon.order.stream import SourceShape

DEFAULT_EPOCHS = (0, 1)
MAX_EPOCHS = 10_000
"""Epochs one ``where`` searches at most (each costs one inverse per sample of D)."""
"""Steps searched for a mixture source's draw: a draw not reached by then is ``not drawn``."""


@dataclass(frozen=True)
class Hit:
    """One occurrence of a sample containing the document in the stream."""

    epoch: int
    sample: int
    stream_position: int
    status: str  # trained | planned | skipped (consumed by a skip) | left out | not drawn
    step: int | None = None
    index: int | None = None  # position in the step's global batch
    dp_rank: int | None = None
    rank_index: int | None = None
    left_out_from: int | None = None  # status "left out": the entry's from_step
    part: int | None = None  # a step a torchft quorum trained: the part holding it
    group: int | None = None  # and the replica group that trained that part

    def to_dict(self) -> dict[str, Any]:
        optional = ("left_out_from", "part", "group")
        return {k: v for k, v in self.__dict__.items() if k not in optional or v is not None}


def _epochs(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected FIRST:LAST epochs (inclusive, from 0) like 0:1, got {text!r}"
        ) from None
    if not 0 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 0 <= FIRST <= LAST, got {text!r}")
    if b - a + 1 > MAX_EPOCHS:
        raise argparse.ArgumentTypeError(
            f"{text!r} spans {b - a + 1} epochs; search at most {MAX_EPOCHS} at a time "
            f"(e.g. {a}:{a + MAX_EPOCHS - 1})"
        )
    return a, b


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "where",
        help="the steps whose samples contain a document",
        description="List the steps (trained or planned) whose samples contain document D "
        "(any of a sample's seq_len input tokens belongs to D), per epoch: the step, the "
        "sample's index in the global batch, its DP rank and index in the rank's slice, "
        "the sample id. Computed backwards through the inverse permutation, no scan.",
    )
    add_data_arguments(p, target="STORE_OR_RUN")
    p.add_argument("--doc", type=int_in(0), required=True, metavar="D", help="document id")
    p.add_argument(
        "--source", metavar="NAME", default=None,
        help="with a mixture: the source whose document D is meant",
    )  # fmt: skip
    p.add_argument(
        "--epochs", type=_epochs, default=DEFAULT_EPOCHS, metavar="A:B",
        help="epochs of the source's stream to search, inclusive, from 0 (default 0:1: the first two)",
    )  # fmt: skip
    p.add_argument(
        "--dp-degree", type=int_in(1), default=None, metavar="D",
        help="DP degree for the rank of each hit (default: for a run, the degree the hit's "
        "step was trained at, or the run's newest for a step not trained yet; else 1)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per hit")
    return p


def source_index(data: StepData, name: str | None) -> int:
    """The source ``--source`` names (index in name order); 0 for one store."""
    if data.config.mixture is None:
        if name:
            raise ShowError(f"--source {name!r} is for a mixture; {data.what} is one store.")
        return 0
    if name is None:
        raise ShowError(
            f"{data.what} is a mixture of {', '.join(data.names)}: name the source of the "
            "document with --source NAME."
        )
    if name not in data.names:
        raise ShowError(
            f"--source {name!r} is not a source of {data.what}; its sources are "
            f"{', '.join(data.names)}."
        )
    return data.names.index(name)


def draw_of(shape: SourceShape, source: int, stream_position: int) -> int | tuple[str, int | None]:
    """The draw count (c_i of ``order.skips``) of source ``source`` that reads
    ``stream_position``; ``("skipped", None)`` when a skip range consumed it, or
    ``("left out", S)`` when the left-out entry of from_step S deleted its sample
    there (never trained either way).

    First the left-out map inverted (``ExclusionMap.effective``) gives the effective
    position. Then the skip map: it sends draw k to k + prefix[m] where m counts the
    entries whose start count is <= k; entry j's skipped effective positions are
    [starts_j + prefix_j, starts_j + prefix_{j+1})."""
    e = stream_position
    if shape.exclusion_map is not None:
        back, by = shape.exclusion_map.effective(np.array([stream_position]))
        if by[0]:
            return "left out", int(by[0])
        e = int(back[0])
    skip_map = shape.skip_map
    if skip_map is None:
        return e
    starts, prefix = skip_map.starts[source], skip_map.prefix[source]
    ends = starts + prefix[1:]  # first effective position after entry j's skipped block
    m = int(np.searchsorted(ends, e, side="right"))
    if m < len(starts) and starts[m] + prefix[m] <= e:
        return "skipped", None
    return e - int(prefix[m])


def where(
    data: StepData,
    doc: int,
    *,
    source: str | None = None,
    epochs: tuple[int, int] = DEFAULT_EPOCHS,
    dp_degree: int | None = None,
) -> tuple[list[Hit], list[str]]:
    """The hits of document ``doc`` in ``epochs`` (sorted by epoch, then stream order)
    and notes (samples of the document that are held out, epochs past max_epochs).

    A run whose history holds several data configs (a resume that accepted a change)
    is searched under each: a step's hits are those of the data config that trained it
    (a step not trained yet: the newest), sorted by step."""
    views = data.views()
    if len(views) == 1:
        return _where_in(data, doc, source=source, epochs=epochs, dp_degree=dp_degree)
    hits: list[Hit] = []
    notes: list[str] = []
    for view in views:
        found, said = _where_in(view, doc, source=source, epochs=epochs, dp_degree=dp_degree)
        for h in found:
            if h.step is None:  # never trained, or before the newest job's anchor
                if view is data and h.status != "trained":
                    hits.append(h)
            elif view.covers(h.step):
                hits.append(h)
        notes += [n for n in said if n not in notes]
    hits.sort(key=lambda h: (h.step is None, h.step or 0, h.index or 0, h.epoch))
    return hits, notes


def _where_in(
    data: StepData,
    doc: int,
    *,
    source: str | None,
    epochs: tuple[int, int],
    dp_degree: int | None,
) -> tuple[list[Hit], list[str]]:
    """``where`` under one data config."""
    i = source_index(data, source)
    store = data.stores[i]
    if store is None:
        raise ShowError(
            f"the store of {data.what}{f' (source {source!r})' if source else ''} was not "
            "found, so its documents are unknown: pass --store STORE (or --mixture FILE)."
        )
    shape = data.plan.source_shape(i)
    first_id, n, seed, max_epochs = shape.first_id, shape.num_samples, shape.seed, shape.max_epochs
    d0, d1 = document_span(store, doc)
    seq_len = data.seq_len
    if data.packed is not None:  # the packed samples holding its pieces
        holding = data.packed[i].samples_of_document(doc)
    else:  # the input windows overlapping [d0, d1)
        holding = np.arange(d0 // seq_len, (d1 - 1) // seq_len + 1, dtype=np.int64)
    ids = holding[(holding >= first_id) & (holding < first_id + n)]
    notes = []
    if ids.size < holding.size:
        notes.append(
            f"document {doc} lies in samples {', '.join(map(str, holding.tolist()[:8]))}"
            f"{' ...' if holding.size > 8 else ''}; only {ids.size} of them are training "
            f"samples ({first_id}..{first_id + n - 1}); the rest are held out or past the "
            "last whole sample."
        )
    hits: list[Hit] = []
    for epoch in range(epochs[0], epochs[1] + 1):
        if max_epochs is not None and epoch >= max_epochs:
            notes.append(
                f"source {source!r} has max_epochs={max_epochs}: epochs {epoch}.. are never drawn."
            )
            break
        if not ids.size:
            break
        within = Permutation(n, seed, epoch).inverse(ids - first_id)
        for sid, w in sorted(zip(ids.tolist(), within.tolist(), strict=True), key=lambda t: t[1]):
            hits.append(_hit(data, i, epoch, sid, epoch * n + w, dp_degree, shape))
    return hits, notes


def _hit(
    data: StepData,
    source: int,
    epoch: int,
    sample: int,
    q: int,
    dp_degree: int | None,
    shape: SourceShape,
) -> Hit:
    """The hit of stream position ``q``: its step, and its DP rank at ``dp_degree``, else
    at the degree the step was trained at (a run's step not trained yet: the run's
    current one; ``StepData.degree_at``)."""
    draw = draw_of(shape, source, q)
    if isinstance(draw, tuple):  # never trained: skipped, or left out from a step
        return Hit(epoch, sample, q, draw[0], left_out_from=draw[1])
    found = data.plan.place_of_draw(source, draw)
    if isinstance(found, str):  # before the resume anchor, or not drawn by MAX_STEP
        return Hit(epoch, sample, q, found, None)
    step, index = found
    gbs = data.plan.schedule.gbs(step)
    degree = dp_degree or data.degree_at(step)[0]
    if gbs % degree:
        given = "--dp-degree" if dp_degree else "the run's DP degree"
        raise ShowError(
            f"{given} {degree} does not divide the global batch of {gbs} samples of step "
            f"{step} (document hit: sample {sample}); pass a DP degree that divides every "
            "global batch size of the job."
        )
    placed = data.place(step, index, degree)
    return Hit(epoch, sample, q, data.status(step), step, index, placed["dp_rank"],
               placed["rank_index"], part=placed.get("part"), group=placed.get("group"))  # fmt: skip


def format_hit(h: Hit) -> str:
    if h.step is None:
        why = {
            "skipped": "consumed by a skip range, never trained",
            "left out": f"left out from step {h.left_out_from} (zephon.exclude), never trained",
            "not drawn": f"not drawn by step {MAX_STEP}",
            "trained": "before the resume anchor",
        }[h.status]
        return f"epoch {h.epoch}  sample {h.sample}  stream position {h.stream_position}: {why}"
    group = ""
    if h.part is not None:
        group = f"group {'?' if h.group is None else h.group} part {h.part}, "
    return (
        f"epoch {h.epoch}  step {h.step}  index {h.index} ({group}rank {h.dp_rank} "
        f"#{h.rank_index})  sample {h.sample}  {h.status}"
    )


def run(args: argparse.Namespace) -> int:
    data = open_step_data(args, "where")
    hits, notes = where(
        data, args.doc, source=args.source, epochs=args.epochs, dp_degree=args.dp_degree
    )
    say_notes(data, "where")
    for note in notes:
        print(f"zephon where: note: {note}", file=sys.stderr)
    a, b = args.epochs
    if not args.json:
        print(
            f"document {args.doc}{f' of source {args.source}' if args.source else ''} in "
            f"{data.what}, epochs {a}..{b}: {len(hits)} occurrence{'s' * (len(hits) != 1)}"
        )
    for h in hits:
        print(json.dumps(h.to_dict()) if args.json else "  " + format_hit(h))
    return 0
