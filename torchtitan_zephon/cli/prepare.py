"""``zephon prepare``: tokenize text, JSONL, Parquet or HF datasets into a token store.

Of a Hugging Face DatasetDict folder it reads the ``train`` split unless ``--split``
names another (or ``all``), and says which split it read.

INPUTs and ``--output`` may be object-storage URLs (``ingest.objects``): raw objects
are streamed to the node-local cache and read as local files; a store for a URL is
uploaded with manifest.json last. The tokenizer and ``--report`` are local paths.

Under torchrun (or any launcher setting RANK / WORLD_SIZE) the ranks share the
work (``torchtitan_zephon.cli.prepare_ranks``); rank 0 prints the result and, after a
failure, the one error every rank agrees on.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from torchtitan_zephon.cli.args import int_in
from torchtitan_zephon.ingest.inputs import ALL_SPLITS
from torchtitan_zephon.ingest.objects import output_url
from torchtitan_zephon.ingest.prepare import prepare_store
from torchtitan_zephon.ingest.ranks import PrepareFailed, together
from torchtitan_zephon.ingest.token_files import INPUT_FORMATS
from torchtitan_zephon.ingest.units import UNIT_BYTES
from torchtitan_zephon.store.format import BLOCK_TOKENS, MAX_BLOCK_TOKENS
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import SHARD_BYTES
from torchtitan_zephon.store.urls import is_url, local_path, refuse_mistyped_url, refuse_url


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prepare",
        help="build a token store from raw text",
        description=(
            "Tokenize INPUTs (text files, folders, .jsonl/.jsonl.gz, .parquet, Hugging Face "
            "datasets saved with save_to_disk) into a token store. The output is "
            "byte-identical for any number of workers and ranks. Under torchrun (`torchrun "
            "--nnodes N --nproc-per-node P -m torchtitan_zephon prepare ...`) the ranks share "
            "the work; the output's parent folder must be on a filesystem they all share. "
            "An interrupted prepare keeps its finished parts beside the output: the same "
            "command run again continues. Of a DatasetDict only the train split is read "
            "unless --split says otherwise."
        ),
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files, folders, quoted glob patterns ('data/*.jsonl') or comma lists, or "
        "object-storage URLs of the same ('s3://BUCKET/corpus/*.jsonl.gz'); sources "
        "are named relative to the deepest folder holding them all, so a folder and a glob "
        "of its files give the same store",
    )
    p.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default="text",
        help="text to tokenize (default), or token files read in place, only metadata "
        "written: megatron (Megatron-LM indexed datasets: PREFIX, PREFIX.bin or PREFIX.idx, "
        "documents ended by EOD: --append-eod) or numpy (OLMo's raw token arrays, "
        "documents ended by EOS); checked against --tokenizer",
    )
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="folder with tokenizer.json")
    p.add_argument(
        "--output",
        required=True,
        metavar="STORE",
        help="new store folder, or an object-storage prefix (s3://BUCKET/PREFIX; uploaded "
        "with manifest.json last)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="tokenizer processes (per rank)",
    )
    p.add_argument("--text-field", default="text", metavar="NAME", help="JSON/Parquet field")
    p.add_argument(
        "--split",
        default="",
        metavar="NAME",
        help="the split of each Hugging Face DatasetDict folder to read (default: train; "
        f"'{ALL_SPLITS}': every split, in sorted order); other inputs are read whole",
    )
    p.add_argument(
        "--unit-bytes",
        type=int_in(1),
        default=UNIT_BYTES,
        metavar="N",
        help=f"input bytes per work unit (default {UNIT_BYTES}; the store's tokens and "
        "fingerprint do not depend on it; a sharded store's shards follow the units)",
    )
    p.add_argument(
        "--shard-bytes",
        type=int_in(1),
        default=SHARD_BYTES,
        metavar="N",
        help=f"a store of more token bytes keeps its tokens in shard files (objects) of at "
        f"most N bytes instead of one tokens.bin (default {SHARD_BYTES}, 1 GiB: far below "
        "every object store's cap): each unit's tokens are one shard or more, written once; "
        "the fingerprint, samples and order do not depend on it",
    )
    p.add_argument(
        "--block-tokens",
        type=int_in(1, MAX_BLOCK_TOKENS),
        default=None,
        metavar="N",
        help=f"tokens per block checksum, for reads from object storage (default "
        f"{BLOCK_TOKENS}; registered token files, --input-format: none unless given, a "
        "second pass over the tokens): pick the jobs' seq_len or a divisor of it, so a "
        "sample is read as exactly its own blocks; the fingerprint does not depend on it",
    )
    p.add_argument(
        "--pack-seq-len",
        type=seq_lens_arg,
        default=(),
        metavar="L[,L...]",
        help="also build the store's packing index (zephon.packing best_fit) at each of these "
        "seq_lens and keep it in the store (packing/), its chunks shared by the ranks: a job "
        "opening the local store then maps it, building nothing (a store without one is "
        "packed into each node's cache at its first use)",
    )
    p.add_argument(
        "--cache-dir",
        default="",
        metavar="DIR",
        help="the store cache when ZEPHON_CACHE is unset (the trainer's zephon.cache_dir): "
        "where objects of URL INPUTs are spooled and a store for a URL --output is built "
        "before its upload (under torchrun the ranks must share it for a URL --output)",
    )
    p.add_argument(
        "--report", metavar="FILE.json", help="write a summary (tokens, parts reused, seconds)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _check_report_path(path: str) -> None:
    """Refuse a --report file that could not be written, before anything is prepared."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise ValueError(f"--report {path}: {target} is a folder; expected a file name")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(
            f"--report {path}: cannot write {target} (its folder {folder} does not exist or "
            "is not writable); nothing was prepared"
        )


def _check_urls(args: argparse.Namespace) -> None:
    """Check object-storage URLs before anything is read or written: INPUTs and --output
    may be URLs (``ingest.objects``: an output URL is one prefix, no pattern); the
    tokenizer and --report are local (a URL is never taken as a path: ``s3://b/x``
    would become the local folder ``s3:``); ``file://`` URLs become the paths they name."""
    refuse_mistyped_url(args.output, "--output")
    for value in args.inputs:
        for item in value.split(","):
            refuse_mistyped_url(item.strip(), "INPUT")
    if is_url(args.output) and not args.output.lower().startswith("file://"):
        output_url(args.output)  # scheme, bucket, prefix, no pattern
    refuse_url(args.tokenizer, "--tokenizer", "Copy the tokenizer folder to local disk.")
    refuse_url(args.cache_dir, "--cache-dir", "The store cache is a local folder.")
    args.cache_dir = local_path(args.cache_dir)
    if args.report:
        refuse_url(args.report, "--report", "Name a local file.")
        args.report = local_path(args.report)
    # file:// URLs are local paths
    args.output, args.tokenizer = local_path(args.output), local_path(args.tokenizer)
    args.inputs = [
        ",".join(local_path(item.strip()) for item in value.split(","))
        if "file://" in value.lower()
        else value
        for value in args.inputs
    ]


def run(args: argparse.Namespace) -> int:
    from torchtitan_zephon.cli.prepare_ranks import ranks_from_env

    _check_urls(args)
    if args.report:
        _check_report_path(args.report)
    if args.input_format != "text":
        return _register(args)
    ranks = ranks_from_env()
    report: dict[str, Any] = {}
    made = _made_and_packed(
        args,
        ranks,
        lambda: prepare_store(
            args.inputs,
            args.tokenizer,
            args.output,
            workers=args.workers,
            text_field=args.text_field,
            progress=not args.quiet,
            ranks=ranks,
            unit_bytes=args.unit_bytes,
            report=report,
            split=args.split,
            block_tokens=BLOCK_TOKENS if args.block_tokens is None else args.block_tokens,
            shard_bytes=args.shard_bytes,
            cache_dir=args.cache_dir,
        ),
    )
    if made is None:
        return 2
    store, packed = made
    if ranks.rank != 0:
        return 0
    if args.report:
        with open(args.report, "w") as f:
            json.dump({**report, "fingerprint": store.fingerprint}, f, indent=2, sort_keys=True)
    reused = f", {report['reused']} of {report['units']} parts reused" if report["reused"] else ""
    print(
        f"prepared {store.path}: {store.num_tokens} tokens, {store.num_documents} documents, "
        f"{store.manifest['dtype']}, fingerprint {store.fingerprint}"
        f" ({report['world_size']} rank{'s' if report['world_size'] > 1 else ''}{reused})"
    )
    for line in _split_lines(report["splits"], args.split):
        print(line)
    for line in packed:
        print(line)
    return 0


def seq_lens_arg(value: str) -> tuple[int, ...]:
    """``--pack-seq-len``: seq_lens >= 1, comma separated."""
    try:
        lens = tuple(int(v) for v in value.split(","))
    except ValueError:
        lens = ()
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(
            f"expected seq_lens >= 1, comma separated (e.g. 2048 or 2048,4096), got {value!r}"
        )
    return lens


def _register(args: argparse.Namespace) -> int:
    """``--input-format megatron|numpy``: the files registered as a store, read in place.
    Under torchrun rank 0 registers them (one pass over the tokens), then every rank
    packs its share of the documents' chunks for ``--pack-seq-len`` (``build_beside``:
    the bytes of one process)."""
    from torchtitan_zephon.cli.prepare_ranks import ranks_from_env
    from torchtitan_zephon.ingest.token_files import register_store

    ranks = ranks_from_env()

    def register() -> Any:
        def mine() -> None:
            if ranks.rank == 0:
                register_store(
                    args.inputs,
                    args.input_format,
                    args.tokenizer,
                    args.output,
                    block_tokens=args.block_tokens,
                )

        together(ranks, mine)
        return TokenStore.open(args.output)

    made = _made_and_packed(args, ranks, register)
    if made is None:
        return 2
    store, packed = made
    if ranks.rank != 0:
        return 0
    print(
        f"registered {store.path}: {store.num_tokens} tokens, {store.num_documents} "
        f"documents in {store.shards} {args.input_format} file(s) read in place, "
        f"{store.manifest['dtype']}, fingerprint {store.fingerprint}"
    )
    for line in packed:
        print(line)
    return 0


def _made_and_packed(
    args: argparse.Namespace, ranks: Any, make: Any
) -> tuple[Any, list[str]] | None:
    """The store ``make()`` makes with ``ranks``, then its packing indexes at
    ``--pack-seq-len`` (what each says); the ranks closed after. None on a rank other
    than 0 when the group failed (rank 0 raises, and prints, the message)."""
    try:
        store = make()
        packed = [_pack(store, seq_len, ranks, args.cache_dir) for seq_len in args.pack_seq_len]
    except PrepareFailed:
        if ranks.rank != 0:  # rank 0 prints the same message
            return None
        raise
    finally:
        close = getattr(ranks, "close", None)
        if close is not None:
            close()
    return store, packed


def _pack(store: Any, seq_len: int, ranks: Any = None, cache_dir: str = "") -> str:
    """``--pack-seq-len``: the store's own packing index at ``seq_len``, and what it is."""
    from torchtitan_zephon.job.packing import build_beside, open_packing

    folder = build_beside(store, seq_len, ranks, cache_dir)
    packed, _ = open_packing(store, seq_len)
    return (
        f"packed at seq_len {seq_len}: {packed.num_samples} samples, padding "
        f"{packed.padding_fraction():.2%} (index kept in {folder})"
    )


def _split_lines(splits: list[dict[str, Any]], asked: str) -> list[str]:
    """Which splits of each DatasetDict were read (prepare says so: held-out splits must
    not train by accident)."""
    lines = []
    for s in splits:
        read = ", ".join(s["read"])
        present = ", ".join(s["present"] or [])
        lines.append(
            f"  read split{'s' if len(s['read']) > 1 else ''} {read} of the DatasetDict "
            f"{s['source']} (its splits: {present}; choose with --split NAME, or --split "
            f"{ALL_SPLITS})"
        )
    if asked and not splits:
        lines.append(f"  --split {asked}: no input is a Hugging Face DatasetDict; all read whole")
    return lines
