"""End to end on TorchTitan 0.3: real torchrun jobs train from a store in the loopback
bucket (moto's S3 server, tests/remote/conftest.py), are killed after a checkpoint and
resume on another world size from the same bucket; ``zephon verify`` says MATCH against
a run of the local copy (same fingerprint, so the same samples at every step). The
same with packing (issue 31 part a3): the index built in each node's cache, the pieces
read by range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import PACKED, PACKED_SEQ
from tests.remote.conftest import SECRET, SESSION
from tests.titan import recorded
from tests.titan.expect import (
    TOPOLOGY_RTOL,
    assert_losses,
    assert_same_data,
    assert_verify_match,
    resume_events,
)
from tests.titan.launch import REPO, copy_run_until, train03
from torchtitan_zephon.cli.main import main
from torchtitan_zephon.ingest.builtin import builtin_store_path
from torchtitan_zephon.job.packing import index_folder, read_index
from torchtitan_zephon.migrate.old_stores import add_block_checksums
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.writer import write_store_as

pytest.importorskip("torchtitan.trainer", reason="TorchTitan 0.3 (torchtitan.trainer)")

# Non-default remote settings: the jobs take them through the trainer's command line
# (the zephon section, tyro) and a wrong value would stop them (RemoteOptions checks).
REMOTE = ("--zephon.read_ahead_steps", "2", "--zephon.read_ahead_bytes", "65536",
          "--zephon.request_timeout_s", "20")  # fmt: skip


@pytest.fixture(scope="module")
def bucket_store(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The builtin store (the registry job's default data) with block checksums, in the
    bucket: (its URL, its fingerprint as a local store)."""
    local = tmp_path_factory.mktemp("bucket_store") / "builtin"
    shutil.copytree(builtin_store_path(), local)
    store, _ = add_block_checksums(local)
    return s3.upload(local, "e2e/builtin"), store.fingerprint


def _verify(a: Path, b: Path, capsys: pytest.CaptureFixture) -> dict:
    """``zephon verify A B --json`` (in process): exit 0 and the report."""
    capsys.readouterr()
    code = main(["verify", str(a), str(b), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    return report


def _assert_no_secret(*texts: str, runs: tuple[Path, ...] = ()) -> None:
    """The marker credentials appear in no output and no file of the run folders
    (checkpoints, sequence log, TensorBoard files, train.log) or the node cache."""
    for text in texts:
        assert SECRET not in text and SESSION not in text
    for run in runs:
        for p in run.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                assert SECRET.encode() not in data and SESSION.encode() not in data, p


@pytest.fixture(scope="module")
def bucket_run(bucket_store, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 CPU ranks, 8 steps, checkpoints at 4 and 8, the store in the bucket."""
    url, _ = bucket_store
    run = tmp_path_factory.mktemp("bucket") / "fresh"
    train03(run, 2, "--zephon.store", url, *REMOTE).check()
    return run


def test_a_bucket_run_killed_after_a_checkpoint_resumes_on_one_rank_from_the_bucket(
    bucket_store, bucket_run: Path, tmp_path: Path, capsys
) -> None:
    url, fingerprint = bucket_store
    resumed = copy_run_until(bucket_run, tmp_path / "resumed", 4)  # died after step-4
    cache = tmp_path / "node-cache"  # the resumed job reads through the node cache
    node_cache = ("--zephon.cache_bytes", "4000000", "--zephon.cache_dir", str(cache))
    job = train03(resumed, 1, "--zephon.store", url, *REMOTE, *node_cache).check()
    assert list((cache / "remote-blocks" / fingerprint / "blocks-512").rglob("*.bin"))
    assert "Zephon: resuming at step 5 (position 32) under DP degree 1" in job.output
    assert not (REPO / "s3:").exists()  # the URL was read as a URL, never as a path
    (event,) = resume_events(resumed)
    assert (event["from_step"], event["world_size"], event["dp_degree"]) == (4, 1, 1)
    assert_same_data(bucket_run, resumed, range(1, 9))
    assert_losses(bucket_run, resumed, range(5, 9), rtol=TOPOLOGY_RTOL)
    # The same data as a run on the local copy: main's 2-rank run of this job on the
    # builtin store (tests/titan/recorded_main/default), step by step, ids and tokens.
    assert TokenStore.open(builtin_store_path()).fingerprint == fingerprint
    for run in (bucket_run, resumed):
        report = _verify(recorded.RECORDED / "default", run, capsys)
        assert (report["steps_compared"], report["tokens_compared"], report["matches"]) == (8, 8, 8)
    _assert_no_secret(job.output, runs=(bucket_run, resumed, cache))


@pytest.mark.slow
def test_a_bucket_run_equals_a_run_on_the_local_copy(
    bucket_run: Path, tmp_path: Path, capsys
) -> None:
    """Same topology, same data, same start: the bucket changes nothing, not even a
    loss bit."""
    local = train03(tmp_path / "local", 2).check().run  # the builtin store, local
    assert_same_data(local, bucket_run, range(1, 9))
    assert_losses(local, bucket_run, range(1, 9), rtol=0)
    report = _verify(local, bucket_run, capsys)
    assert (report["steps_compared"], report["tokens_compared"], report["matches"]) == (8, 8, 8)


# slow (issue 44 part e): issue 45's end-to-end check; the sharded store's reads are
# proven against the one-file store in-process (tests/store/test_shards.py, locally;
# tests/remote/test_sharded_remote.py, in the bucket), packing from a bucket by
# test_a_bucket_run_killed_after_a_checkpoint_resumes_on_one_rank_from_the_bucket's path
@pytest.mark.slow
def test_a_packed_run_from_a_sharded_bucket_store_resumed_on_one_rank_matches_the_local_one(
    s3, packed_one_rank: Path, tmp_path: Path
) -> None:
    """Issue 45 part a: ``--zephon.packing best_fit`` on the docs store as shards of
    1,000 tokens (pieces and samples across shard bounds) in the bucket: 2 ranks, killed
    after checkpoint 4, resumed on 1 rank through the node cache; each builds the
    packing index in its own cache; both train exactly what the uninterrupted 1-rank
    packed run of the local one-file store trains (verify MATCH, losses within the
    tolerance)."""
    local = tmp_path / "docs"
    shutil.copytree(builtin_store_path(part="docs"), local)
    add_block_checksums(local, block_tokens=256)  # a seq_len piece is whole blocks
    sharded = write_store_as(TokenStore.open(local), tmp_path / "docs-sharded", shard_tokens=1000)
    assert sharded.shards > 2
    url = s3.upload(Path(sharded.path), "e2e/docs")
    args = (*PACKED[:4], "--zephon.store", url, *PACKED[6:], *REMOTE)
    caches = [tmp_path / "cache-two", tmp_path / "cache-one"]
    two = tmp_path / "two_ranks"
    job = train03(two, 2, *args, "--zephon.cache_dir", str(caches[0])).check()
    assert "packing best_fit:" in job.output
    run = copy_run_until(two, tmp_path / "resumed", 4)
    node_cache = ("--zephon.cache_bytes", "4000000", "--zephon.cache_dir", str(caches[1]))
    resumed = train03(run, 1, *args, *node_cache).check()
    (event,) = resume_events(run)
    assert (event["from_step"], event["dp_degree"]) == (4, 1)
    store = TokenStore.open(local)
    for cache in caches:  # each node's own index, built from the bucket
        folder = index_folder(store, PACKED_SEQ, str(cache))
        assert read_index(store, PACKED_SEQ, folder).num_samples > 0
    assert list((caches[1] / "remote-blocks" / store.fingerprint).rglob("*.bin"))
    for other in (two, run):
        assert_same_data(packed_one_rank, other, range(1, 9))
        assert_losses(packed_one_rank, other, range(1, 9), rtol=TOPOLOGY_RTOL)
        assert_verify_match(packed_one_rank, other)
    _assert_no_secret(job.output, resumed.output, runs=(two, run, *caches))
