"""benchmarks/bench_net.py: its README command shrunk (every mode on one emulated 200 Mbit/s link:
one sane JSON line per mode, speedups against the round's exact serial step, the emulated link's
interfaces carrying at least the bytes the trainer counts), rounds and per-rank phases on
localhost, and the config-key check that turns a mode the trainer cannot run yet into an error line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from docs_registry import documented
from hvd_launch import ROOT, env, require_netns

from benchmarks import bench_net  # noqa: E402

KINDS = {"ids", "versions", "rows", "grads", "dense"}


def test_missing_config_keys_are_detected():
    assert bench_net.missing_keys(["cache=lfu", "train.no_such_key=1", "comm.no_such_either=fp16"]) == \
        ["train.no_such_key", "comm.no_such_either"]
    assert bench_net.missing_keys(bench_net.MODES["cache_ssp"]) == []
    assert bench_net.missing_keys(["cache=none", "train.steps=3"]) == []


def test_rounds_rotate_the_modes_and_summarise_medians():
    modes = ["exact_serial", "cache_ssp", "wire_fp16"]
    assert [bench_net.round_order(modes, r) for r in range(4)] == [
        modes, ["cache_ssp", "wire_fp16", "exact_serial"], ["wire_fp16", "exact_serial", "cache_ssp"], modes]
    runs = [{"samples_per_sec": 100.0, "speedup_vs_exact_serial": 1.2},
            {"bench": "net", "error": "run failed"},
            {"samples_per_sec": 90.0, "speedup_vs_exact_serial": 0.9},
            {"samples_per_sec": 120.0, "speedup_vs_exact_serial": 1.0}]
    s = bench_net.summary_line("1gbit", "cache_ssp", runs)
    assert s["summary"] is True and (s["rounds"], s["ok_rounds"]) == (4, 3)
    assert s["samples_per_sec_median"] == 100.0 and s["speedup_median"] == 1.0
    assert (s["speedup_min"], s["speedup_max"], s["speedups"]) == (0.9, 1.2, [1.2, 0.9, 1.0])
    assert "speedup_median" not in bench_net.summary_line("1gbit", "x", [runs[1]])


@pytest.mark.dist
def test_repeat_interleaves_rounds_and_phases_time_every_rank_step_by_step():
    """--repeat 2 --phases on localhost (one run of the bench serves both checks): rounds rotate
    the modes' order and summarise medians; every rank's phases are timed step by step."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_net", "--quick", "--repeat", "2",
                           "--phases", "--links", "localhost", "--modes", "exact_serial", "exact_pipelined"],
                          cwd=ROOT, capture_output=True, text=True, env=env(), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    runs, sums = [x for x in lines if not x.get("summary")], [x for x in lines if x.get("summary")]
    assert [(x["round"], x["mode"]) for x in runs] == [
        (1, "exact_serial"), (1, "exact_pipelined"), (2, "exact_serial"), (2, "exact_pipelined")]
    # round 2 ran the pipelined mode first (rotated order), its progress says so
    log = [l for l in proc.stderr.splitlines() if ": running (" in l]
    assert [l.split()[2].rstrip(":") for l in log] == ["exact_serial", "exact_pipelined", "exact_pipelined", "exact_serial"]
    for r in (1, 2):
        base = next(x for x in runs if x["round"] == r and x["mode"] == "exact_serial")["samples_per_sec"]
        for x in (x for x in runs if x["round"] == r):
            assert x["speedup_vs_exact_serial"] == pytest.approx(x["samples_per_sec"] / base, abs=1e-3)
    assert [x["mode"] for x in sums] == ["exact_serial", "exact_pipelined"]
    piped = [x["speedup_vs_exact_serial"] for x in runs if x["mode"] == "exact_pipelined"]
    assert sums[1]["speedups"] == piped and sums[1]["speedup_median"] == pytest.approx(sum(piped) / 2, abs=1e-3)
    assert sums[0]["speedup_median"] == 1.0 and sums[0]["ok_rounds"] == 2

    steps = bench_net.QUICK["steps"]
    for x in runs:
        assert [p["rank"] for p in x["phases"]] == [0, 1]
        for p in x["phases"]:
            ms, calls = p["ms_per_step"], p["calls"]
            assert p["steps"] == steps and calls["step"] == calls["backward"] == calls["apply"] == steps
            assert set(ms) == {"step", "batch", "prefetch", "lookup", "backward", "apply", "wait"}
            for inner in ("batch", "lookup", "backward", "apply"):  # inside the step
                assert 0 < ms[inner] < ms["step"], (inner, ms)
            # process CPU per step: some, and at most what the process's threads could use in the
            # step's wall-clock time (gloo's and the main thread: a few cores at the very most)
            assert 0 < p["cpu_ms_per_step"] <= 4 * ms["step"], p
            assert p["cpu_busy"] == pytest.approx(p["cpu_ms_per_step"] / ms["step"], rel=0.01, abs=1e-3), p
    for x in runs:  # the serial step prepares nothing ahead; the pipelined one every step but the last
        if x["mode"] == "exact_serial":
            assert all(p["calls"]["batch"] == steps and p["ms_per_step"]["prefetch"] < 0.1 for p in x["phases"])
        else:
            assert all(p["calls"]["prefetch"] == steps and p["calls"]["batch"] == steps for p in x["phases"])


def test_bad_link_is_refused():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_net", "--links", "fast"],
                          cwd=ROOT, capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 2 and "error: link rate 'fast'" in proc.stderr and proc.stdout == ""


@pytest.mark.dist
@pytest.mark.netns
def test_readme_command_on_a_shaped_link():
    """benchmarks/README.md's command (`--links 200mbit --repeat 3 --steps 120`), shrunk to one
    round of 4 steps of the quick workload: every mode on the emulated 200 Mbit/s link, each
    against the exact serial step of its round (the docs' registry runs it here, not twice)."""
    require_netns()
    proc = subprocess.run(documented(".venv/bin/python -m benchmarks.bench_net --links 200mbit --repeat 3 --steps 120"),
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    runs, sums = [x for x in lines if not x.get("summary")], [x for x in lines if x.get("summary")]
    assert [x["mode"] for x in runs] == list(bench_net.MODES) and sums == []  # one round: no medians
    assert "[bench_net] 200mbit cache_ssp: running" in proc.stderr  # progress on stderr
    by = {x["mode"]: x for x in runs}
    for x in runs:
        assert "error" not in x, x
        assert x["link"] == "200mbit" and x["link_bits_per_s"] == 200_000_000
        assert x["bench"] == "net" and x["world_size"] == 2 and x["steps"] == bench_net.QUICK["steps"]
        assert x["global_batch_size"] == 2 * bench_net.QUICK["batch_size"]
        assert x["samples_per_sec"] > 0 and 0.0 <= x["eval_auc"] <= 1.0 and x["final_loss"] > 0
        assert KINDS <= set(x["bytes_per_sample_by_kind"])
        assert x["bytes_per_sample"] == pytest.approx(sum(x["bytes_per_sample_by_kind"].values()), abs=0.1)
        assert x["embedding_bytes_per_sample"] == pytest.approx(
            sum(x["bytes_per_sample_by_kind"][k] for k in ("ids", "versions", "rows", "grads")), abs=0.1)
        base = by["exact_serial"]["samples_per_sec"]
        assert x["speedup_vs_exact_serial"] == pytest.approx(x["samples_per_sec"] / base, abs=1e-3)
        assert x["link_tx_bytes_per_sample"] >= x["bytes_per_sample"]  # the traffic went through the hosts' links
    exact, cache = by["exact_serial"], by["cache_ssp"]
    assert exact["speedup_vs_exact_serial"] == 1.0
    assert exact["bytes_per_sample_by_kind"]["versions"] == 0 < cache["bytes_per_sample_by_kind"]["versions"]
    assert cache["overrides"] == bench_net.MODES["cache_ssp"] and 0 < cache["cache_hit_rate"] < 1
    # the fp16 wire halves the rows and gradients of the same mode at fp32
    assert by["exact_wire_fp16"]["bytes_per_sample_by_kind"]["rows"] == pytest.approx(
        by["exact_pipelined"]["bytes_per_sample_by_kind"]["rows"] / 2, rel=0.01)