"""scripts/gpu_check.sh, the GPU checklist in one bounded run, in its CPU mode (DEVICE=cpu QUICK=1):
the same stages and files as on a GPU at small sizes, so a broken script shows in CI and not first
on a lent GPU, whose minutes are few."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.dist
def test_gpu_check_runs_every_stage_in_cpu_mode(tmp_path: Path):
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "PYTHON": sys.executable,
           "BATCHES": "512", "BEFORE": str(ROOT)}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "check.log").read_text()
    stages = [line.split("]")[1].split(":")[0].strip() for line in log.splitlines() if " rc=" in line]
    assert stages == ["env", "parity", "bench_kernels", "bench_train_cpu_default", "bench_train_cpu_512",
                      "bench_train_w2_pipeline_off", "bench_train_w2_pipeline_ids",
                      "bench_kernels_before", "bench_train_before"], log
    assert all(" rc=0 " in line for line in log.splitlines() if " rc=" in line), log
    parity = [json.loads(x) for x in (tmp_path / "gpu_parity.jsonl").read_text().splitlines()]
    assert [p["path"] for p in parity] == ["dlrm", "w2-lfu-ssp"] and all(p["ok"] for p in parity)
    train = [json.loads(x) for x in (tmp_path / "bench_train.jsonl").read_text().splitlines()]
    assert [t["overrides"][-1] for t in train] == ["train.device=cpu", "data.batch_size=512",
                                                   "train.pipeline=off", "train.pipeline=ids"]
    assert [t["world_size"] for t in train] == [1, 1, 2, 2]
    assert all(t["samples_per_sec"] > 0 for t in train)
    assert any(json.loads(x).get("kernel") == "owner_update_sgd"
               for x in (tmp_path / "bench_kernels.jsonl").read_text().splitlines())
    assert (tmp_path / "bench_before.jsonl").read_text().count('"bench": "train"') == 1


@pytest.mark.slow
@pytest.mark.dist
def test_gpu_check_step_study_in_cpu_mode(tmp_path: Path):
    """PART=step (the profiled step study of the MLPerf-shaped DLRM) in its CPU mode: every stage
    runs (dev/gpu_dense_probe.py among them), the benchmark lines carry the profile and the steady
    phases, the probe its eager lines."""
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "PYTHON": sys.executable, "PART": "step",
           "STEP_BATCHES": "128", "STEP_W2_PIPELINES": "ids",
           "STEP_EXTRA": "data.cycle_batches=4 data.max_table_rows=2000 data.test_samples=512"}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "check.log").read_text()
    stages = [line.split("]")[1].split(":")[0].strip() for line in log.splitlines() if " rc=" in line]
    assert stages == ["env", "dense_probe", "step_mlperf_128", "step_bench", "step_w2_pipeline_ids"], log
    assert all(" rc=0 " in line for line in log.splitlines() if " rc=" in line), log
    probe = [json.loads(x) for x in (tmp_path / "dense_probe.jsonl").read_text().splitlines()]
    assert [(p["mode"], p["precision"]) for p in probe] == [("eager", "fp32"), ("eager", "bf16")]
    step = [json.loads(x) for x in (tmp_path / "step.jsonl").read_text().splitlines()]
    assert [(s["workload"], s["world_size"], s["precision"]) for s in step] == [
        ("mlperf", 1, "bf16"), ("bench", 1, "fp32"), ("bench", 2, "fp32")]
    for s in step:
        prof = s["profile"]
        assert prof["steps"] == 5 and prof["wall_ms_per_step"] > 0 and prof["aten_ops_per_step"] > 50
        assert prof["top_ops_inclusive_cpu"] and "device_busy" not in prof  # no device on a CPU
        assert s["ms_per_step_steady"]["step"] > 0 and s["samples_per_sec_after_first_10_steps"] > 0


@pytest.mark.parametrize("args", [["--profile-steps", "5", "--steps", "20"], ["--profile-steps", "11", "--steps", "60"]])
def test_bench_train_refuses_a_profile_window_it_cannot_keep_out_of_the_rate(args, capsys):
    """The profiled steps are 11..10+N and the steady rate is read after step 20: a window past
    step 20, or a run too short to have a steady rate after it, is one error line (exit 2)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_train import main
    assert main(["--worlds", "1", *args]) == 2
    assert capsys.readouterr().err.startswith("error: --profile-steps takes 1..10 steps")
