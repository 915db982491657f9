"""--fault_tolerance.* (issue 30 part a1): torchft is installed with its lighthouse, the
settings parse on both front ends, and a fault-tolerant start that cannot keep the rule
(every committed step trains exactly B(s)) is refused before anything is written."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.titan.expect import assert_refused, assert_unchanged, tree
from tests.titan.launch import TINY, free_port, train03

FT = ("--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
      "--fault_tolerance.replica_id", "1")  # fmt: skip


def _view(*argv: str):
    from torchtitan_zephon.titan import platform

    platform.apply()
    from torchtitan_zephon.titan.settings.job_view import job_view
    from torchtitan_zephon.train import parse_config, parse_toml, toml_front_end

    args = list(argv)
    return job_view(parse_toml(args) if toml_front_end(args) else parse_config(args))


def _registry(*overrides: str):
    return _view("--module", "torchtitan_zephon.configs", "--config", "llama3_tiny", *overrides)


def _refused(job, world: int = 1) -> str:
    from torchtitan_zephon.titan.start.checks import check_job_config

    with pytest.raises(ValueError) as e:
        check_job_config(job, world_size=world)
    return str(e.value)


def test_torchft_and_its_lighthouse_are_installed():
    import torchft

    assert torchft.Manager is not None
    assert (Path(sys.executable).parent / "torchft_lighthouse").is_file()


def test_the_settings_parse_on_both_front_ends():
    for job in (
        _registry(*FT, "--fault_tolerance.min_replica_size", "1"),
        _view("--job.config_file", str(TINY), *FT, "--fault_tolerance.min_replica_size", "1"),
    ):
        ft = job.fault_tolerance
        assert (ft.enable, ft.group_size, ft.replica_id, ft.min_replica_size) == (True, 2, 1, 1)
    assert not _registry().fault_tolerance.enable  # off by default


def test_a_job_that_keeps_the_rule_passes_the_checks():
    from torchtitan_zephon.titan.start.checks import check_job_config

    check_job_config(_registry(*FT), world_size=2)  # GBS 8 >= 2 groups x DP 2
    check_job_config(_registry(), world_size=2)  # no fault tolerance: nothing asked


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (("--fault_tolerance.semi_sync_method", "diloco"), 1,
         "fault_tolerance.semi_sync_method = 'diloco': Zephon trains every committed step on "
         "exactly its global batch"),
        (("--fault_tolerance.group_size", "0"), 1,
         "fault_tolerance.group_size = 0: with --fault_tolerance.enable it is the number of "
         "replica groups"),
        (("--fault_tolerance.replica_id", "2"), 1,
         "fault_tolerance.replica_id = 2 is outside [0, 2) (fault_tolerance.group_size 2): give "
         "each group its own id 0 .. 1."),
        (("--fault_tolerance.min_replica_size", "3"), 1,
         "fault_tolerance.min_replica_size = 3: the fewest groups a step may train with must be "
         "in [1, 2]"),
        (("--fault_tolerance.process_group", "mpi"), 1, "fault_tolerance.process_group = 'mpi'"),
        (("--parallelism.data_parallel_replicate_degree", "2"), 2,
         "parallelism.data_parallel_replicate_degree = 2 with --fault_tolerance.enable"),
        (("--fault_tolerance.group_size", "3"), 4,
         "global batch size 8 (from step 1) is smaller than fault_tolerance.group_size 3 x this "
         "group's DP degree 4 = 12"),
        (("--parallelism.pipeline_parallel_degree", "2"), 2,
         "parallelism.pipeline_parallel_degree = 2 with --fault_tolerance.enable"),
    ],
)  # fmt: skip
def test_settings_that_break_the_rule_are_refused(overrides, world, message):
    assert message in _refused(_registry(*FT, *overrides), world)


def test_the_lighthouse_address_is_checked(lighthouse, monkeypatch: pytest.MonkeyPatch):
    from torchtitan_zephon.titan.ft.settings import LIGHTHOUSE_TIMEOUT_S, lighthouse_url

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"^--fault_tolerance.enable needs TORCHFT_LIGHTHOUSE="):
        lighthouse_url()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "127.0.0.1:29510")
    with pytest.raises(ValueError, match=r"expected http://HOST:PORT"):
        lighthouse_url()
    silent = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", silent)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"the torchft lighthouse at {silent} does not answer"):
        lighthouse_url()
    assert time.monotonic() - t0 <= LIGHTHOUSE_TIMEOUT_S + 1
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    assert lighthouse_url() == lighthouse  # a real lighthouse answers


class _Listener:
    """A live loopback port that is not a lighthouse: ``kind`` "silent" accepts and says
    nothing, "garbage" answers bytes that are not HTTP, "http" is another web server."""

    def __init__(self, kind: str) -> None:
        import socket
        import threading

        self.kind, self.sock = kind, socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            if self.kind == "garbage":
                conn.sendall(b"\x00\x01 not http at all\r\n\r\n")
                conn.close()
            elif self.kind == "http":
                conn.recv(4096)
                body = b"<title>Some other service</title>"
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("silent", "does not answer (no answer within 5 s)"),
        ("garbage", "is not a torchft lighthouse (it does not speak HTTP as one does"),
        ("http", "is not a torchft lighthouse (it answered HTTP, but not with a lighthouse"),
    ],
)
def test_a_live_port_that_is_not_a_lighthouse_is_refused_within_seconds(
    kind: str, message: str, monkeypatch: pytest.MonkeyPatch
):
    """Issue 43 case 7: torchft's client retried forever at such a port, logging an h2
    protocol error every 100 ms; the start check only tested that it accepts."""
    from torchtitan_zephon.titan.ft.settings import LIGHTHOUSE_TIMEOUT_S, lighthouse_url

    server = _Listener(kind)
    try:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.url)
        t0 = time.monotonic()
        with pytest.raises(ValueError) as e:
            lighthouse_url()
        assert time.monotonic() - t0 <= LIGHTHOUSE_TIMEOUT_S + 1
        assert str(e.value).startswith(
            f"the {'torchft lighthouse' if kind == 'silent' else 'server'} at {server.url} "
        )
        assert message in str(e.value) and "\n" not in str(e.value)
    finally:
        server.close()


def test_a_fault_tolerant_start_with_a_bad_setting_is_refused_before_anything_is_written(
    lighthouse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """End to end (torchrun, a real lighthouse): a bad setting is refused in one line,
    named, the run folder unchanged (a good one trains: tests/titan/test_ft_e2e.py)."""
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)  # the jobs inherit it
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("kept\n")
    before = tree(run)
    job = train03(tmp_path / "log", 1, "--dump_folder", str(run), *FT,
                  "--fault_tolerance.replica_id", "5")  # fmt: skip
    assert_refused(job, "fault_tolerance.replica_id = 5 is outside [0, 2)")
    assert_unchanged(before, tree(run))
