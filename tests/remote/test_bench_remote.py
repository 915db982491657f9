"""``zephon bench remote --quick``: the table's structure and the relations between its
figures (not their speed): the comparison rows exist, fetched/trained is finite, the
naive download fetches the whole store, and the latency proxy passes answers on."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest

from torchtitan_zephon.bench import SUITES
from torchtitan_zephon.bench.remote import LATENCIES_MS, rows
from torchtitan_zephon.cli.main import main


@pytest.mark.slow
def test_bench_remote_quick(capsys, tmp_path) -> None:
    """The quick run (~1 min here: a moto server, 3 proxies and 10 fresh processes)."""
    out = tmp_path / "remote.json"
    assert main(["bench", "remote", "--quick", "--json", "--out", str(out)]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == r
    assert "remote" in SUITES
    s = r["streams"]
    ways = {"local", *(f"remote_{ms}ms" for ms in LATENCIES_MS), "on_demand_20ms", "download_20ms"}
    assert set(s) == ways and LATENCIES_MS == (0, 20, 50)
    for name, v in s.items():
        assert v["tokens_per_s"] > 0 and v["trained_bytes"] == s["local"]["trained_bytes"]
        assert name == "local" or math.isfinite(v["fetched_per_trained"])
    assert s["local"]["fetched_per_trained"] == 0  # nothing fetched from a bucket
    assert r["store_bytes"] >= 100 * s["local"]["trained_bytes"]
    assert r["store_over_trained"] == pytest.approx(r["store_bytes"] / s["local"]["trained_bytes"])
    for ms in LATENCIES_MS:  # range reads: windows, blocks and the opening, not the store
        assert 1.0 <= s[f"remote_{ms}ms"]["fetched_per_trained"] < 2.0
    ps = r["packed_streams"]  # packed samples, local and from the bucket at 20 ms
    assert set(ps) == {"local", "remote_20ms"} and ps["local"]["fetched_per_trained"] == 0
    assert ps["remote_20ms"]["tokens_per_s"] > 0
    assert 1.0 <= ps["remote_20ms"]["fetched_per_trained"] < r["store_over_trained"]
    naive = s["download_20ms"]["fetched_per_trained"]
    assert naive >= r["store_over_trained"]  # every file fetched whole
    for key in ("job_remote", "job_local"):
        j = r[key]
        assert 0 <= j["data_wait_pct"] < 100 and j["step_s_median"] > 0
        assert j["steps"] == r["job"]["measured_steps"]
    assert r["job_local"]["fetched_per_trained"] == 0
    assert math.isfinite(r["job_remote"]["fetched_per_trained"])
    fb = r["first_batch"]
    assert set(fb) == {"local_10", "remote_10", "local_late", "remote_late", "download_10"}
    for p in fb.values():
        parts = p["imports_s"] + p["open_s"] + p["build_and_load_s"] + p["next_s"]
        assert p["to_first_batch_s"] >= parts > 0
    assert fb["local_10"]["requests_by_first"] == 0 < fb["remote_late"]["requests_by_first"]
    assert r["first_batch_extra_s"] == pytest.approx(
        fb["remote_10"]["to_first_batch_s"] - fb["local_10"]["to_first_batch_s"]
    )
    assert set(r["request_ms"]) == {str(ms) for ms in LATENCIES_MS}
    for ms in LATENCIES_MS:  # the proxy adds its latency to every request
        assert r["request_ms"][str(ms)] >= ms
    assert set(r["meets"]) == {"data_wait_pct", "fetched_per_trained", "first_batch_extra_s"}
    table = rows(r)
    assert all(len(row) == 3 for row in table)
    labels = "\n".join(a for a, _, _ in table)
    for part in (
        "local disk",
        "+0 ms",
        "+20 ms",
        "+50 ms",
        "no read-ahead",
        "naive",
        "packed samples (best_fit)",
        "bytes fetched per byte trained",
        "data wait % of step",
        "process start -> first batch",
        "minus local",
    ):
        assert part in labels, part
    notes = "\n".join(c for _, _, c in table)
    assert "target <= 1.1" in notes and "target < 1.0 %" in notes and "target <= 1 s" in notes
    # the default job from blocks of its seq_len, beside prepare's default 512
    assert r["job_block_tokens"] == r["job"]["seq_len"] and r["job"]["seq_len"] % 512
    j, j512 = r["job_remote"]["fetched_per_trained"], r["job_remote_512"]["fetched_per_trained"]
    assert 1.0 <= j < j512 and r["meets_default_job"] == {"fetched_per_trained": j <= 1.1}
    assert f"{r['job_block_tokens']}-token blocks (= its seq_len)" in labels
    assert "512-token blocks (prepare's default)" in labels


def test_latency_proxy_adds_latency_and_passes_answers_on() -> None:
    """The proxy process the bench starts: its endpoint on stdout, the upstream's body
    and status passed on, each request at least the added latency late."""
    body = b"zephon" * 100

    class Upstream(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(206 if "part" in self.path else 200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", '"abc"')
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    Thread(target=server.serve_forever, daemon=True).start()
    upstream = f"http://127.0.0.1:{server.server_address[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_zephon.bench.latency_proxy", upstream, "50"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://127.0.0.1:")
        import time

        t0 = time.perf_counter()
        with urllib.request.urlopen(f"{endpoint}/part", timeout=10) as answer:
            assert answer.status == 206 and answer.read() == body
            assert answer.headers["ETag"] == '"abc"'
        assert time.perf_counter() - t0 >= 0.05
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
        server.shutdown()
    with socket.socket() as s:  # the proxy's port is closed once its stdin is
        assert s.connect_ex(("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))) != 0


def test_bench_remote_without_moto_says_what_to_install(capsys, monkeypatch) -> None:
    """Asked for by name where moto or obstore is missing: one line naming the extra to
    install, exit 1, no traceback; `zephon bench all` would show it as a table row."""
    import torchtitan_zephon.bench.remote as remote

    monkeypatch.setattr(remote, "_missing", lambda: "moto.server")
    assert main(["bench", "remote"]) == 1
    out = capsys.readouterr()
    assert "zephon bench remote: not run: needs moto[server] and obstore" in out.err
    assert "pip install -e '.[test]'" in out.err and "Traceback" not in out.err
    assert "not run" in out.out  # the table's one row
