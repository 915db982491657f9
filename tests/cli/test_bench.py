"""zephon bench: one smoke test per suite at tiny sizes (keys and relations, no timing)."""

import json

import pytest

from torchtitan_zephon.cli.main import main


def bench(capsys, *argv: str) -> dict:
    assert main(["bench", *argv, "--quick", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_loader(capsys, tmp_path):
    out = tmp_path / "loader.json"
    r = bench(capsys, "loader", "--out", str(out))
    assert json.loads(out.read_text()) == r
    for key in ("stock_tokens_per_s", "zephon_tokens_per_s", "torchdata_tokens_per_s"):
        assert r[key] > 0
    assert r["speedup"] == pytest.approx(r["zephon_tokens_per_s"] / r["stock_tokens_per_s"])
    keys = {f"{name}_workers{w}" for name in ("stock", "torchdata", "zephon") for w in (0, 2)}
    assert set(r["tokens_per_s"]) == keys
    # both shapes in one run, each figure the median of its interleaved rounds
    assert [(s["seq_len"], s["local_batch"]) for s in r["shapes"]] == [(256, 2), (64, 8)]
    assert r["shapes"][0]["tokens_per_s"] == r["tokens_per_s"]
    for s in r["shapes"]:
        assert set(s["tokens_per_s_rounds"]) == keys
        for key, rounds in s["tokens_per_s_rounds"].items():
            assert len(rounds) == r["rounds"] == 3
            assert s["tokens_per_s"][key] == sorted(rounds)[1]
        assert s["zephon_tokens_per_s"] == s["tokens_per_s"]["zephon_workers0"]
        assert s["torchdata_tokens_per_s"] == s["tokens_per_s"]["torchdata_workers0"]
        assert s["speedup_vs_torchdata"] == pytest.approx(
            s["zephon_tokens_per_s"] / s["torchdata_tokens_per_s"]
        )
        cpu = s["tokens_per_cpu_s"]  # in-process loaders only: 0 workers
        assert set(cpu) == {f"{name}_workers0" for name in ("stock", "torchdata", "zephon")}
        assert s["speedup_vs_torchdata_cpu"] == pytest.approx(
            cpu["zephon_workers0"] / cpu["torchdata_workers0"]
        )
    assert r["meets"]["torchdata_ratio"] == (
        min(s["speedup_vs_torchdata"] for s in r["shapes"]) >= r["targets"]["torchdata_ratio"]
    )
    assert r["restore_s_step_10"] > 0 and r["restore_s_step_1000000"] > 0
    assert r["restore_ratio"] == pytest.approx(r["restore_s_step_1000000"] / r["restore_s_step_10"])
    sizes = r["state_bytes"]
    assert set(sizes) == {"1", "8", "1024"}
    assert len(set(sizes.values())) == 1 and sizes["1"] < 4096
    assert len(set(r["trainer_record_bytes"].values())) == 1
    assert r["trainer_record_bytes"]["1"] < 4096
    stock = r["stock_state_bytes"]
    assert stock["1024"] == 1024 * stock["1"] == 1024 * r["stock_rank_state_bytes"]
    assert r["state_constant"] and r["meets"]["state_bytes"]
    checks = r["content_checks"]  # the same loader with the store's content checks on and off
    assert checks["chunk_tokens"] == 1 << 16 and checks["chunks"] >= 1
    for phase in ("first_epoch", "steady"):
        c = checks[phase]
        assert c["on_tokens_per_s"] > 0 and c["off_tokens_per_s"] > 0
        assert c["ratio"] == pytest.approx(c["on_tokens_per_s"] / c["off_tokens_per_s"])
    assert "check_ratio" in r["meets"]


def test_step(capsys):
    r = bench(capsys, "step")
    assert set(r["runs"]) == {"synthetic", "ids", "reproducible@1"}
    for run in r["runs"].values():
        assert run["steps_per_s"] > 0 and 0 <= run["data_wait_pct"] < 100
        assert run["measured_steps"] >= 1
        assert run["peak_rss_gib"] > 0 and run["parameters"] == 393_536  # llama3 tiny
    assert r["runs"]["synthetic"]["vs_synthetic"] == pytest.approx(1.0)
    assert "data_wait_ids" in r["meets"]
    # zephon.reproducible beside the same job without it (audit ids), at 1 rank
    c = r["reproducible"]["1"]
    on, off = r["runs"]["reproducible@1"], r["runs"]["ids"]
    assert c["steps_per_s"] == {"off": off["steps_per_s"], "on": on["steps_per_s"]}
    assert c["speed_ratio"] == pytest.approx(on["steps_per_s"] / off["steps_per_s"])
    assert c["memory_ratio"] == pytest.approx(on["peak_rss_gib"] / off["peak_rss_gib"])
    assert c["reduced_bytes_per_micro_batch"] == {"off": 0, "on": 0}  # one rank reduces nothing


def test_resume(capsys):
    r = bench(capsys, "resume")
    assert r["resume_s_step_10"] > 0 and r["resume_s_step_10000000"] > 0
    assert r["resume_ratio"] == pytest.approx(r["resume_s_step_10000000"] / r["resume_s_step_10"])
    sizes = r["checkpoint_data_bytes"]
    assert set(sizes) == {"1", "8", "1024"} and len(set(sizes.values())) == 1
    assert sizes["1"] < 4096
    assert r["stock_checkpoint_data_bytes"]["8"] == 8 * r["stock_rank_state_bytes"]


def test_scale(capsys):
    r = bench(capsys, "scale")
    assert set(r["fixed_per_rank"]) == {"8", "2048", "100000"}
    gbs = {d: x["global_batch"] for d, x in r["fixed_per_rank"].items()}
    assert gbs == {"8": 32, "2048": 8192, "100000": 400000}
    samples = {d: x["rank_samples"] for d, x in r["fixed_global"].items()}
    assert samples == {"8": 800000, "2048": 3125, "100000": 64}
    log = r["sequence_log"]
    assert 0 < log["ids_bytes_per_step"] < log["tokens_bytes_per_step"] < 1024
    assert r["verify_steps"] == 1000
    assert r["verify_steps_per_s"] == pytest.approx(1000 / r["verify_s"])
    rss = r["verify_rss_detail_mb"]  # the comparing process and twice the larger reader
    assert r["verify_peak_rss_mb"] == pytest.approx(rss["compare"] + 2 * rss["reader"])
    left = r["left_out"]  # a step's plan at 10 and 10^9, without and with left-out ids
    assert (left["samples"], left["ids"], left["skips"]) == (10**9, 10**4, 1000)
    for name in ("baseline", "left_out"):
        plan = left["plan_s"][name]
        assert left[f"{name}_ratio"] == pytest.approx(plan["1000000000"] / plan["10"])
    assert left["build_s"] > 0


def test_prepare(capsys):
    r = bench(capsys, "prepare")
    assert r["identical_ranks"] is True and r["workers"]["identical"] is True
    for n in (1, 2):
        x = r[f"ranks{n}"]
        assert x["tokens_per_s"] > 0 and x["limit_tokens_per_s"] > 0
        assert x["of_limit"] == pytest.approx(x["tokens_per_s"] / x["limit_tokens_per_s"])
        assert r["target"] == 0.9 and r["meets"][f"ranks{n}"] == (x["of_limit"] >= 0.9)
    assert r["scaling"] == pytest.approx(r["ranks2"]["tokens_per_s"] / r["ranks1"]["tokens_per_s"])
    assert r["units"] >= 2  # the file is split, so both ranks work
    assert r["shards"] >= 2  # into shards
    # Bytes written are counted (at --quick's ~40 KB of tokens, pages of logs and metadata
    # outweigh them: 1.027 into shards against 2.021 into one file is the full size's).
    assert r["ranks2"]["written_per_token_byte"] > 0 and r["one_file_written_per_token_byte"] > 0


def test_bad_level_is_a_clean_error(capsys):
    assert main(["bench", "step", "--levels", "everything"]) == 2
    assert "unknown audit levels" in capsys.readouterr().err
    assert main(["bench", "step", "--reproducible", "two"]) == 2
    assert "--reproducible takes comma-separated rank counts >= 1" in capsys.readouterr().err


def test_mixture(capsys):
    r = bench(capsys, "mixture")
    tp = r["tokens_per_s"]
    assert set(tp) == {"single", "single_joined", "sources_1", "sources_10", "sources_100"}
    assert all(v > 0 for v in tp.values())
    cpu = r["tokens_per_cpu_s"]
    assert set(cpu) == set(tp) and all(v > 0 for v in cpu.values())
    for k in ("1", "10", "100"):
        assert r["tokens_ratio"][k] == pytest.approx(tp[f"sources_{k}"] / tp["single"])
        assert r["tokens_ratio_cpu"][k] == pytest.approx(cpu[f"sources_{k}"] / cpu["single"])
        assert 0 < r["tokens_ratio_cpu_paired"][k] < float("inf")
    assert r["joined_ratio_cpu"] == pytest.approx(cpu["sources_100"] / cpu["single_joined"])
    assert r["meets"]["tokens_ratio_100"] == (r["tokens_ratio_cpu"]["100"] >= 0.8)
    assert r["plan_ratio"] == pytest.approx(r["plan_s"]["1000000000"] / r["plan_s"]["10"])
    assert 0 < r["state_bytes"] < 64 * 1024 and r["meets"]["state_bytes"]
    assert r["single_store_state_bytes"] < 4096
    assert 0 <= r["deviation_at_1e9"] <= r["max_deviation"] + 1e-9
    assert set(r["meets"]) == {"tokens_ratio_100", "plan_ratio", "state_bytes"}


def test_machine_names_the_torchtitan_the_figures_came_from():
    from importlib.metadata import version

    from torchtitan_zephon.cli.bench import machine

    m = machine()
    assert m["torchtitan"] == version("torchtitan") and m["torch"]


def test_accounting(capsys):
    r = bench(capsys, "accounting")
    assert (r["global_batch"], r["sources"]) == (4000, 3)
    for key in ("step_path_ms", "baseline_ids_ms", "background_ms", "tensorboard_ms"):
        assert r[key] > 0
    assert r["baseline_ratio"] == pytest.approx(r["baseline_ids_ms"] / r["step_path_ms"])
    assert r["scalars_per_step"] == 3 * 7
    assert r["documents_per_step"] > 0
    assert r["meets"] == {"step_path_ms": r["step_path_ms"] < 1.0}


@pytest.mark.slow  # 12 child processes (~60 s); tests/remote/test_virtual_corpus.py covers
# the corpus and the server by default
def test_corpus(capsys):
    r = bench(capsys, "corpus")
    assert r["corpora"]["virtual"]["documents"] > 10**10
    assert r["corpora"]["real"]["documents"] == 4 * 65536
    assert len(r["cases"]) == 12
    for case in r["cases"]:
        assert case["disk_bytes"] == 0  # a store read by range, its index kept with it
        assert case["first_batch_s"] > 0 and case["gets_per_step"] > 0
        if not case["packing"]:  # windows of seq_len 512 over 512-token blocks
            assert case["fetch_ratio"] < 1.1
