"""The chunked loss's chunk count fits any training.seq_len (TorchTitan 0.3 crashed at the
first step when 8 did not divide it): fitted after the command line, refused only when
--loss.num_chunks was given."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.titan.expect import assert_refused, assert_unchanged, tree
from tests.titan.launch import TINY, train, train03
from tests.titan.test_init import REGISTRY
from torchtitan_zephon.titan.settings.loss_chunks import fit_loss_chunks, largest_divisor_up_to

LENGTHS = [62, 100, 1000, 4095, 4096, 61]

# Stock TorchTitan 0.3 registry jobs (Trainer.Config with ChunkedLossWrapper), run
# through torchtitan_zephon.train.
STOCK = [
    ("llama3", "llama3_debugmodel"),
    ("llama3", "llama3_8b"),
    ("qwen3", "qwen3_debugmodel"),
    ("deepseek_v3", "deepseek_v3_debugmodel"),
    ("deepseek_v3", "deepseek_v3_16b"),
]


@given(st.integers(1, 100_000), st.integers(1, 64))
def test_the_fitted_count_is_the_largest_divisor_not_above_the_limit(n: int, limit: int):
    d = largest_divisor_up_to(n, limit)
    assert 1 <= d <= limit and n % d == 0
    assert all(n % e for e in range(d + 1, limit + 1))


def _parse(*argv: str):
    from torchtitan_zephon.titan import platform

    platform.apply()
    from torchtitan_zephon.train import parse_config, parse_toml, toml_front_end

    return parse_toml(list(argv)) if toml_front_end(list(argv)) else parse_config(list(argv))


def _fits(config) -> None:
    local = config.training.seq_len // config.parallelism.context_parallel_degree
    assert local % config.loss.num_chunks == 0


@pytest.mark.parametrize("fn", REGISTRY)
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_every_registry_job_trains_any_seq_len(fn: str, seq_len: int):
    config = _parse("--module", "torchtitan_zephon.configs", "--config", fn,
                    "--training.seq_len", str(seq_len))  # fmt: skip
    configured = config.loss.num_chunks
    note = fit_loss_chunks(config, explicit=False)
    _fits(config)
    assert config.loss.num_chunks == largest_divisor_up_to(seq_len, configured)
    if config.loss.num_chunks == configured:
        assert note is None
    else:
        assert note is not None and "\n" not in note
        assert f"training.seq_len {seq_len}" in note and "--loss.num_chunks" in note


@pytest.mark.parametrize(("module", "fn"), STOCK)
def test_stock_torchtitan_jobs_train_a_seq_len_8_does_not_divide(module: str, fn: str):
    config = _parse("--module", module, "--config", fn, "--training.seq_len", "62")
    assert config.loss.num_chunks == 8
    assert fit_loss_chunks(config, explicit=False) is not None
    assert config.loss.num_chunks == 2


def test_the_toml_front_end_fits_the_count():
    config = _parse("--job.config_file", str(TINY), "--training.seq_len", "100")
    assert fit_loss_chunks(config, explicit=False) is not None
    assert config.loss.num_chunks == 5


def test_the_count_divides_the_local_length_under_context_parallelism():
    """TorchTitan chunks each rank's part: seq_len / CP degree."""
    config = _parse("--module", "torchtitan_zephon.configs", "--config", "llama3_tiny",
                    "--training.seq_len", "124",
                    "--parallelism.context_parallel_degree", "2")  # fmt: skip
    note = fit_loss_chunks(config, explicit=False)
    assert config.loss.num_chunks == 2  # 62 tokens per rank
    assert note is not None and "62 tokens per rank" in note


def test_a_count_that_divides_is_kept_even_when_explicit():
    config = _parse("--module", "torchtitan_zephon.configs", "--config", "llama3_tiny",
                    "--training.seq_len", "96", "--loss.num_chunks", "3")  # fmt: skip
    assert fit_loss_chunks(config, explicit=True) is None
    assert config.loss.num_chunks == 3


def test_an_explicit_count_that_does_not_divide_is_refused():
    config = _parse("--module", "torchtitan_zephon.configs", "--config", "llama3_tiny",
                    "--training.seq_len", "62", "--loss.num_chunks", "8")  # fmt: skip
    with pytest.raises(ValueError) as e:
        fit_loss_chunks(config, explicit=True)
    assert str(e.value) == (
        "loss.num_chunks = 8 does not divide training.seq_len 62: the chunked loss splits "
        "each sequence into equal chunks. Chunk counts that work up to 8: [1, 2]; sequence "
        "lengths that work with 8 chunks: multiples of 8 (56 or 64). Set --loss.num_chunks or "
        "--training.seq_len, or drop --loss.num_chunks to let Zephon choose."
    )
    assert config.loss.num_chunks == 8


def test_a_count_below_one_is_refused():
    config = _parse("--module", "torchtitan_zephon.configs", "--config", "llama3_tiny",
                    "--loss.num_chunks", "0")  # fmt: skip
    with pytest.raises(ValueError, match=r"^loss.num_chunks = 0: the chunked loss needs"):
        fit_loss_chunks(config, explicit=False)


def test_a_toml_job_trains_at_seq_len_62(tmp_path: Path):
    """End to end, as run_train.sh runs it: 2 ranks, 2 steps at a seq_len 8 does not
    divide; the log says the count once per rank, and the steps are recorded."""
    from tests.titan.expect import log_records

    run = tmp_path / "run"
    job = train(run, 2, "--training.seq_len", "62", "--training.steps", "2",
                "--checkpoint.interval", "2", "--validation.freq", "2").check()  # fmt: skip
    assert "the chunked loss splits training.seq_len 62 into 2 chunk(s) of 31 tokens" in job.output
    assert "Traceback" not in job.output
    assert sorted(log_records(run)) == [1, 2]


# slow (issue 44 part e): the loss-chunk check in-process
# (test_an_explicit_count_that_does_not_divide_is_refused), the refusal path end to end by
# default
@pytest.mark.slow
def test_an_explicit_count_is_refused_in_one_line_and_nothing_is_written(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("kept\n")
    before = tree(run)
    job = train03(tmp_path / "log", 1, "--dump_folder", str(run),
                  "--training.seq_len", "62", "--loss.num_chunks", "8")  # fmt: skip
    assert_refused(
        job, "Zephon refused to start: loss.num_chunks = 8 does not divide training.seq_len 62"
    )
    assert_unchanged(before, tree(run))
