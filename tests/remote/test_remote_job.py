"""Stores in object storage as a job reads them: the loader's read-ahead, store values
and mixture sources that are URLs, and the `zephon` commands (real S3 API on loopback)."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import copy_store
from tests.remote.conftest import SECRET, SESSION
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.loader import ZephonLoader
from torchtitan_zephon.job.settings import open_store
from torchtitan_zephon.job.stores import store_location
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.mixture.config import MixtureConfig, MixtureError
from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote import RemoteTokenStore
from torchtitan_zephon.store.writer import slice_store


@pytest.fixture(scope="module")
def fine_store(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared store with checksum chunks of 64 tokens."""
    return copy_store(store_path, tmp_path_factory.mktemp("fine") / "store", chunk_tokens=64)


@pytest.fixture(scope="module")
def fine_url(s3, fine_store: Path) -> str:
    return s3.upload(fine_store, "job/fine")


def _loader(source, seq_len: int, **kw) -> ZephonLoader:
    return ZephonLoader(
        source,
        seq_len=seq_len,
        seed=3,
        schedule=BatchSchedule.parse("1:8"),
        dp_rank=kw.pop("dp_rank", 0),
        dp_degree=kw.pop("dp_degree", 2),
        local_batch_size=2,
        **kw,
    )


def _batches(loader: ZephonLoader, n: int) -> list[torch.Tensor]:
    return [next(loader)[0]["input"].clone() for _ in range(n)]


def test_the_loader_reads_ahead_and_serves_the_local_batches(fine_url, fine_store) -> None:
    seq_len = 128  # a window: 129 tokens from a multiple of 128, so 2 or 3 chunks of 64
    local = _loader(TokenStore.open(fine_store), seq_len)
    remote_store = TokenStore.open(fine_url)
    opened = remote_store.fetched_bytes
    remote = _loader(remote_store, seq_len)
    assert remote.read_ahead_steps == 4  # the store's default
    t0 = time.perf_counter()
    first = next(remote)
    first_batch_s = time.perf_counter() - t0
    steps = 40  # 2 micro-batches per rank and step
    got = [first[0]["input"].clone()] + _batches(remote, 2 * steps - 1)
    want = _batches(local, 2 * steps)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    announced = remote._announced - 1  # steps whose windows were fetched
    bundle_steps = remote.max_bundle // 2  # the loader's prefetch bundle, in steps
    remote.close()
    row = (seq_len + 1) * 2
    trained = 2 * steps * 2 * row  # micro-batches x rows x bytes
    fetched = remote_store.fetched_bytes - opened
    print(
        f"fetched/trained {fetched / trained:.3f}, fetched/read {fetched / remote_store.served_bytes:.3f}"
        f", steps fetched {announced} for {steps} trained, first batch {first_batch_s * 1000:.1f} ms"
    )
    # Every window of the steps announced (served, or read ahead and not yet served) was
    # fetched once, rounded out to whole chunks (at most 192 of 129 tokens), and only the
    # windows of the steps announced were read.
    assert remote_store.served_bytes <= announced * 4 * row
    assert remote_store.served_bytes <= fetched <= announced * 4 * row * 192 / 129
    # beyond the steps trained: two prefetch bundles (one taken, one pending), then
    # read_ahead_steps
    assert announced <= steps + 2 * bundle_steps + 4


def test_a_resume_from_the_bucket_continues_as_from_the_local_copy(fine_url, fine_store):
    seq_len = 16
    local = _loader(TokenStore.open(fine_store), seq_len, dp_degree=1)
    _batches(local, 7)  # steps 1..1 of 4 micro-batches, 3 of step 2
    state = local.state_dict()
    local_next = _batches(local, 8)
    remote = _loader(TokenStore.open(fine_url), seq_len, dp_degree=2, dp_rank=1)
    remote.load_state_dict(state)  # the fingerprint is the local copy's: no refusal
    assert remote.next_step == state["next_step"]
    local_again = _loader(TokenStore.open(fine_store), seq_len, dp_degree=2, dp_rank=1)
    local_again.load_state_dict(state)
    for a, b in zip(_batches(remote, 6), _batches(local_again, 6), strict=True):
        assert torch.equal(a, b)
    assert local_next  # the single-rank run went on


def test_a_mixture_with_a_source_in_the_bucket(s3, store, tmp_path) -> None:
    a = slice_store(store, 0, 1800, tmp_path / "a")
    b = slice_store(store, 1800, store.num_tokens, tmp_path / "b")
    url = s3.upload(b.path, "job/mix-b")

    def text(b_store: str) -> str:
        return (
            f'[[source]]\nname = "a"\nstore = "{a.path}"\n'
            f'[[source]]\nname = "b"\nstore = "{b_store}"\n'
            "[[schedule]]\nfrom_step = 1\nweights = { a = 0.5, b = 0.5 }\n"
        )

    cfg = MixtureConfig.loads(text(url), base_dir=tmp_path)
    assert cfg.sources[1].store == url  # a URL is not rebased onto the file's folder
    remote = JobData.open_mixture(cfg, 8)
    local = JobData.open_mixture(MixtureConfig.loads(text(str(b.path))), 8)
    assert remote.fingerprint == local.fingerprint
    assert isinstance(remote.stores[1], RemoteTokenStore)
    keys = np.concatenate(
        [
            remote.plan(remote.data_config(seed=1, schedule=BatchSchedule.parse("1:8"))).global_ids(
                s
            )
            for s in range(1, 6)
        ]
    )
    np.testing.assert_array_equal(remote.windows(keys, 8), local.windows(keys, 8))


def test_store_values_that_are_urls(fine_url) -> None:
    assert store_location(fine_url) == fine_url
    with pytest.raises(StoreError) as e:
        store_location("s3://corpus/raw/*.jsonl")
    assert str(e.value).startswith(  # raw inputs in a bucket: prepared as local ones are
        "'s3://corpus/raw/*.jsonl' names raw inputs, not a token store, and no tokenizer was "
        "given to prepare them."
    )
    with pytest.raises(MixtureError, match="mixture file 's3://b/mix.toml' is a URL"):
        MixtureConfig.load("s3://b/mix.toml")


def _job(tmp: Path, **zephon: Any):
    """The view Zephon's trainer hands the job layer (``titan.settings.job_view.JobView``) of the
    tiny registry job with these ``--zephon.*`` values."""
    from torchtitan_zephon.configs.config_registry import llama3_tiny
    from torchtitan_zephon.titan.settings.job_view import job_view

    config = llama3_tiny()
    config.dump_folder = str(tmp)
    config.training.seq_len = 8
    config.training.global_batch_size = 8
    config.zephon = dataclasses.replace(config.zephon, **{"heldout_samples": 0, **zephon})
    return job_view(config)


def test_the_trainer_settings_open_a_store_url(fine_url, tmp_path) -> None:
    job = _job(
        tmp_path,
        store=fine_url,
        read_ahead_steps=2,
        read_ahead_bytes=1 << 20,
        request_timeout_s=5.0,
    )
    store = open_store(job)
    assert isinstance(store, RemoteTokenStore)
    assert (store.options.read_ahead_steps, store.options.read_ahead_bytes) == (2, 1 << 20)
    assert store.options.request_timeout_s == 5.0
    assert JobData.of_store(store, 16).read_ahead_steps() == 2
    job = _job(tmp_path, store="s3://bucket/raw/*.jsonl", cache_dir="s3://bucket/cache")
    with pytest.raises(StoreError, match="zephon.cache_dir 's3://bucket/cache' is a URL"):
        open_store(job)


def test_a_mixture_job_reads_its_bucket_source_with_the_job_settings(s3, store, tmp_path):
    """The trainer's data of a mixture job (titan.start.job_data.resolve_data): a source in
    the bucket is read with the job's zephon.read_ahead_steps / read_ahead_bytes /
    request_timeout_s, not the store defaults."""
    from torchtitan_zephon.titan.start.job_data import resolve_data

    a = slice_store(store, 0, 1800, tmp_path / "a")
    b = slice_store(store, 1800, store.num_tokens, tmp_path / "b")
    url = s3.upload(b.path, "job/mix-settings")
    mixture = tmp_path / "mix.toml"
    mixture.write_text(
        f'[[source]]\nname = "a"\nstore = "{a.path}"\n'
        f'[[source]]\nname = "b"\nstore = "{url}"\n'
        "[[schedule]]\nfrom_step = 1\nweights = { a = 0.5, b = 0.5 }\n"
    )
    settings = dict(read_ahead_steps=1, read_ahead_bytes=1 << 16, request_timeout_s=7.5)
    data = resolve_data(_job(tmp_path / "run", mixture=str(mixture), **settings))
    assert data.mixture is not None
    remote = data.stores[data.names.index("b")]
    assert isinstance(remote, RemoteTokenStore)
    got = remote.options
    assert (got.read_ahead_steps, got.read_ahead_bytes, got.request_timeout_s) == (1, 1 << 16, 7.5)
    assert data.read_ahead_steps() == 1


def test_a_store_url_with_a_query_string_is_redacted_in_the_job_messages(fine_url, tmp_path):
    """A store URL carrying a signature (an Azure SAS token, say) is named redacted where
    the trainer's checks name the store."""
    from torchtitan_zephon.titan.start.job_data import resolve_data

    job = _job(tmp_path, store=f"{fine_url}?sv=2024&sig=SASMARKER", heldout_samples=10**9)
    with pytest.raises(ValueError) as e:
        resolve_data(job)
    assert "SASMARKER" not in str(e.value)
    assert f"{fine_url}?<redacted>" in str(e.value)


# ---------------------------------------------------------------- the zephon command


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    for text in (out, err):
        assert SECRET not in text and SESSION not in text
        assert "Traceback" not in text
    return code, out, err


def test_inspect_a_store_url(capsys, fine_url, fine_store) -> None:
    code, out, _ = _run(capsys, "inspect", fine_url)
    assert code == 0
    fingerprint = TokenStore.open(fine_store).fingerprint
    assert f"token store: {fine_url}\n  fingerprint: {fingerprint}\n" in out
    assert "requests (the manifest and checksums: opening reads no tokens)" in out
    code, out, _ = _run(capsys, "inspect", fine_url, "--check")
    assert code == 0 and "check:       intact" in out
    # the check fetched every token, and says so (issue 28, item 13)
    fetched = int(re.search(r"fetched:     ([\d,]+) bytes", out).group(1).replace(",", ""))
    assert fetched >= (Path(fine_store) / "tokens.bin").stat().st_size, out
    assert "(the manifest, the checksums and, for --check, every token)" in out
    # a store's file named instead of its prefix: the prefix to name (not a prepare)
    for name in ("manifest.json", "tokens.bin"):
        code, _, err = _run(capsys, "inspect", f"{fine_url}/{name}")
        assert code == 2 and err == (
            f"zephon inspect: error: {fine_url}/{name} names the store file {name}, not a "
            f"store: a store in object storage is named by its prefix, {fine_url}\n"
        )
    code, _, err = _run(capsys, "inspect", fine_url, "--upgrade")
    assert code == 2 and err.startswith(
        f"zephon inspect: error: --upgrade writes into a store; '{fine_url}' is in object storage."
    )


def test_inspect_refusals(capsys, s3, store_path) -> None:
    url = s3.upload(store_path, "job/partial", skip=("manifest.json",))
    code, _, err = _run(capsys, "inspect", url)
    assert code == 2
    assert err.startswith(
        f"zephon inspect: error: {url} holds no token store: it has no manifest.json"
    )
    code, _, err = _run(capsys, "inspect", "gopher://x/y")
    assert code == 2 and "has the URL scheme 'gopher', which zephon does not read" in err


def test_prepare_never_takes_a_url_as_a_path_and_writes_nothing(
    capsys, s3, tmp_path, monkeypatch, corpus_dir, tokenizer_dir
) -> None:
    """URL inputs and outputs are object storage (tests/remote/test_remote_prepare.py);
    a bucket that does not exist is an error, never a local folder "s3:"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZEPHON_CACHE", str(tmp_path / "cache"))
    code, _, err = _run(
        capsys,
        "prepare",
        str(corpus_dir),
        "--tokenizer",
        str(tokenizer_dir),
        "--output",
        "s3://bucket/store",
    )
    assert code == 2
    assert err.startswith(
        "zephon prepare: error: the bucket of s3://bucket/store does not exist (or is not "
        "visible with these credentials)"
    )
    code, _, err = _run(
        capsys,
        "prepare",
        "s3://bucket/raw/*.jsonl.gz",
        "--tokenizer",
        str(tokenizer_dir),
        "--output",
        str(tmp_path / "out"),
    )
    assert code == 2
    assert "the bucket of s3://bucket/raw does not exist" in err
    code, _, err = _run(
        capsys, "prepare", str(corpus_dir), "--tokenizer", "s3://bucket/tok", "--output", "o"
    )
    assert code == 2 and "--tokenizer 's3://bucket/tok' is a URL; --tokenizer takes a local" in err
    assert list(tmp_path.iterdir()) == []  # no folder "s3:", no output, no parts, no cache


def test_prepare_takes_file_urls_as_paths(capsys, tmp_path, corpus_dir, tokenizer_dir, store):
    out = tmp_path / "viaurl"
    code, text, _ = _run(
        capsys,
        "prepare",
        f"file://{corpus_dir}",
        "--tokenizer",
        str(tokenizer_dir),
        "--output",
        f"file://{out}",
        "--quiet",
        "--workers",
        "1",
    )
    assert code == 0, text
    assert TokenStore.open(out).fingerprint == store.fingerprint


def test_the_accounting_fetches_a_remote_stores_offsets_only_up_to_its_limit(s3, store_path):
    """A store in object storage: its document offsets (8 bytes a document) are fetched
    whole for the accounting only when at most the limit; above it, not fetched at all
    (a store of 10^10 documents holds 80 GB of offsets) and not counted (None)."""
    from torchtitan_zephon.job.accounting import document_offsets
    from torchtitan_zephon.job.data import JobData

    local = TokenStore.open(store_path)
    url = s3.upload(store_path, "accounting/store")
    size = local.num_documents * 8
    remote = TokenStore.open(url)
    (got,) = document_offsets(JobData.of_store(remote, 64), fetch_limit=size)
    assert np.array_equal(got, local.doc_offsets)
    remote = TokenStore.open(url)
    before = remote.fetched_bytes
    assert document_offsets(JobData.of_store(remote, 64), fetch_limit=size - 1) == [None]
    assert remote.fetched_bytes == before
    (mapped,) = document_offsets(
        JobData.of_store(local, 64), fetch_limit=0
    )  # local: mapped, any size
    assert np.array_equal(mapped, local.doc_offsets)
