"""benchmarks/soak.py: a short soak prints one JSON line with the RSS slope and throughput drift."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import soak  # noqa: E402


def test_soak_prints_one_json_line_with_sane_figures():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--steps", "120", "--sample-every", "10", "--warmup", "20",
                           "train.threads=1", "data.batch_size=32"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    r = json.loads(lines[0])
    for key in ("steps", "warmup_steps", "samples", "rss_mib_start", "rss_mib_end", "rss_mib_max",
                "rss_slope_mib_per_1k_steps", "samples_per_sec_first_quarter", "samples_per_sec_last_quarter",
                "throughput_drift", "wall_s", "final_loss", "series"):
        assert key in r, key
    assert r["steps"] == 120 and r["warmup_steps"] == 20 and r["samples"] == 10
    assert [s[0] for s in r["series"]] == list(range(0, 121, 10))
    assert 50 < r["rss_mib_start"] <= r["rss_mib_max"] < 8192 and r["rss_mib_end"] <= r["rss_mib_max"]
    assert abs(r["rss_slope_mib_per_1k_steps"]) < 200  # MiB per 1k steps: a sane number, not a unit slip
    assert r["samples_per_sec_first_quarter"] > 0 and r["samples_per_sec_last_quarter"] > 0
    assert r["throughput_drift"] == pytest.approx(r["samples_per_sec_last_quarter"]
                                                  / r["samples_per_sec_first_quarter"], rel=1e-2)
    assert 0 < r["final_loss"] < 1.5 and r["overrides"] == ["train.threads=1", "data.batch_size=32"]


def test_report_fits_the_slope_after_warmup_and_compares_quarters():
    """A planted leak of 2 MiB per 1k steps after the warm-up (a jump inside it is ignored), and
    throughput that halves between the first and the last quarter."""
    steps = np.arange(0, 2001, 100)
    rss = np.where(steps <= 400, 100 + steps * 0.1, 200 + steps * 0.002)
    sps = np.where(steps <= 1000, 1000.0, 500.0)
    series = [(int(s), float(m), float(v)) for s, m, v in zip(steps, rss, sps)]
    r = soak.report(series, 400, 10.0, [0.5, float("nan"), 0.7], [])
    assert r["rss_slope_mib_per_1k_steps"] == pytest.approx(2.0, rel=1e-6)
    assert r["samples"] == 16 and r["throughput_drift"] == pytest.approx(0.5)
    assert r["final_loss"] == pytest.approx(0.6)  # a skipped step's NaN is left out
