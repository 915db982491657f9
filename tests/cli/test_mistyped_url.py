"""A location written as a URL with one slash (``s3:/bucket/q``) is refused, suggesting the
URL with two, wherever a store or input is named; nothing is written (it was taken as the
local folder ``./s3:/bucket/q``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.titan.expect import assert_refused
from tests.titan.launch import train03
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.builtin import TOKENIZER_DIR
from torchtitan_zephon.store.urls import mistyped_url

TOK = str(TOKENIZER_DIR)


@pytest.mark.parametrize(
    "argv, what, fixed",
    [
        (["prepare", "/etc/hostname", "--tokenizer", TOK, "--output", "s3:/bucket/q"],
         "--output 's3:/bucket/q'", "s3://bucket/q"),
        (["prepare", "gs:/b/x.jsonl", "--tokenizer", TOK, "--output", "out"],
         "INPUT 'gs:/b/x.jsonl'", "gs://b/x.jsonl"),
        (["prepare", "a.txt,az:/c/x.txt", "--tokenizer", TOK, "--output", "out"],
         "INPUT 'az:/c/x.txt'", "az://c/x.txt"),
        (["inspect", "s3:/bucket/q"], "PATH 's3:/bucket/q'", "s3://bucket/q"),
        (["inspect", "file:/tmp/store"], "PATH 'file:/tmp/store'", "file:///tmp/store"),
        (["plan", "--store", "S3:/bucket/q", "--seq-len", "8", "--global-batch-size", "4",
          "--seed", "0", "--steps", "1:1"], "the store 'S3:/bucket/q'", "S3://bucket/q"),
    ],
)  # fmt: skip
def test_a_url_with_one_slash_is_refused_naming_the_url_meant(
    argv, what, fixed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and what in err and f"Did you mean {fixed!r}?" in err, err
    assert os.listdir(tmp_path) == []  # no ./s3: folder, no output


@given(
    st.sampled_from(["s3", "gs", "az", "S3"]),
    st.from_regex(r"[a-z0-9][a-z0-9/._-]{0,20}", fullmatch=True),
)
def test_only_a_scheme_zephon_reads_and_one_slash_is_mistyped(scheme: str, rest: str):
    assert mistyped_url(f"{scheme}:/{rest}") == f"{scheme}://{rest}"
    for fine in (f"{scheme}://{rest}", f"./{scheme}:/{rest}", f"/data/{scheme}:/{rest}",
                 f"http:/{rest}", f"{scheme}{rest}"):  # fmt: skip
        assert mistyped_url(fine) is None


def test_the_trainer_refuses_a_store_url_with_one_slash(tmp_path: Path):
    job = train03(tmp_path / "log", 1, "--dump_folder", str(tmp_path / "run"),
                  "--zephon.store", "s3:/bucket/q")  # fmt: skip
    assert_refused(job, "the store 's3:/bucket/q' starts with the URL scheme s3: and one slash",
                   "Did you mean 's3://bucket/q'?")  # fmt: skip
    assert not (tmp_path / "run").exists()
