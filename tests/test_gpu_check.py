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

ROOT = Path(__file__).resolve().parents[1]


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
