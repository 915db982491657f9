"""The run's checkpoint folder at a job's end holds ``checkpoint.keep_latest_k``
checkpoints, asynchronous saves included (issue 43 case 14): TorchTitan's purge runs
when a save starts, before an asynchronous save has written its folder, and left four
with ``keep_latest_k 2``."""

from __future__ import annotations

from pathlib import Path

from tests.titan.launch import train
from torchtitan_zephon.titan.components.checkpoint_folder import keep_newest


def _checkpoint(run: Path, step: int, *, whole: bool = True) -> Path:
    path = run / "checkpoint" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if whole:
        (path / ".metadata").write_bytes(b"m")
    return path


def test_keep_newest_removes_only_what_is_older_than_the_newest_whole_ones(tmp_path: Path):
    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 10, whole=False)  # interrupted: not one of the k
    removed = keep_newest(tmp_path, "checkpoint", 2)
    assert sorted(p.name for p in removed) == ["step-2", "step-4"]
    left = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert left == ["step-10", "step-6", "step-8"]
    assert keep_newest(tmp_path, "checkpoint", 0) == []  # 0: keep all
    assert keep_newest(tmp_path, "checkpoint", 5) == []  # fewer whole ones than k


def test_async_saves_keep_latest_k_at_the_end(tmp_path: Path):
    run = tmp_path / "run"
    job = train(
        run, 2, "--training.steps", "6", "--checkpoint.interval", "1",
        "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2",
        "--validation.no-enable",
    ).check()  # fmt: skip
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-5", "step-6"]
    assert (run / "checkpoint" / "step-6" / ".metadata").is_file()
    assert job.output.count("checkpoint.keep_latest_k 2: the newest 2 are kept") <= 1
