"""``zephon prepare``: tokenize text, JSONL, Parquet or HF datasets into a token store."""

from __future__ import annotations

import argparse
import os

from torchtitan_zephon.data.prepare import prepare_store


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prepare",
        help="build a token store from raw text",
        description=(
            "Tokenize INPUTs (text files, folders, .jsonl/.jsonl.gz, .parquet, Hugging Face "
            "datasets saved with save_to_disk) into a token store. The output is "
            "byte-identical for any number of workers."
        ),
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files, folders, quoted glob patterns ('data/*.jsonl') or comma lists; sources "
        "are named relative to the deepest folder holding them all, so a folder and a glob "
        "of its files give the same store",
    )
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="folder with tokenizer.json")
    p.add_argument("--output", required=True, metavar="STORE", help="new store folder")
    p.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenizer processes"
    )
    p.add_argument("--text-field", default="text", metavar="NAME", help="JSON/Parquet field")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    store = prepare_store(
        args.inputs,
        args.tokenizer,
        args.output,
        workers=args.workers,
        text_field=args.text_field,
        progress=not args.quiet,
    )
    print(
        f"prepared {store.path}: {store.num_tokens} tokens, {store.num_documents} documents, "
        f"{store.manifest['dtype']}, fingerprint {store.fingerprint}"
    )
    return 0
