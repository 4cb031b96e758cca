"""End to end through the real entry points: `python -m trainer` and `torchrun -m trainer`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import run_world
from trainer.run.resolve.configure import load_config
from trainer.workload.data import make_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_default_job_learns(tmp_path):
    """`python -m trainer` (tiny preset, single process) writes summary.json with AUC > 0.6."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "trainer", f"hydra.run.dir={out}"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("world_size", "steps", "samples_per_sec", "final_loss", "eval_auc", "eval_logloss",
                "bytes", "bytes_per_sample"):
        assert key in summary, key
    assert summary["world_size"] == 1 and summary["steps"] == 300
    # train.device=auto (the default) is reported resolved: the device the run trained on
    assert summary["config"]["train"]["device"] == "auto"
    assert summary["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert summary["transport"] is None  # the local backend sends nothing
    assert summary["eval_auc"] > 0.6, summary["eval_auc"]
    assert summary["samples_per_sec"] > 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x][:2] == [10, 20]


def test_bad_config_exits_with_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer", "data.batch_size=-1",
                           f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "data.batch_size=-1" in proc.stderr and "must be > 0" in proc.stderr


@pytest.mark.dist
def test_torchrun_two_workers_share_one_output_dir(tmp_path):
    """torchrun with Hydra's default (timestamped) run dir: one directory, one summary.json."""
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "2", "-m",
           "trainer", "comm=torch", "train.steps=20", "data.test_samples=512", "train.progress=off"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "outputs") for f in files
            if f == "summary.json"]
    assert len(runs) == 1, runs
    run_dirs = [d for d, subdirs, _ in os.walk(tmp_path / "outputs") if ".hydra" in subdirs]
    assert len(run_dirs) == 1, f"stray output dirs left: {run_dirs}"
    summary = json.load(open(runs[0]))
    assert summary["world_size"] == 2 and summary["bytes"]["rows"] > 0
    if not torch.cuda.is_available():  # the default device, auto, is the CPU here: gloo carries the bytes
        assert (summary["device"], summary["transport"]) == ("cpu", "gloo")


# FAE, the HET cache under ssp and Herald, each in fixed shapes (docs/gpu.md)
TORCHRUN_ON = {
    "fae": (["placement=fae", "placement.budget_bytes=16000", "placement.window_batches=8"], "step"),
    "lru-ssp": (["cache=lru", "consistency=ssp"], "step"),
    "herald": (["schedule=herald", "cache=lru", "placement.window_batches=8"], "step"),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(TORCHRUN_ON))
def test_torchrun_with_cuda_graph_on_equals_the_eager_step(tmp_path, case):
    """`torchrun ... train.cuda_graph=on` at W = 2 trains with FAE, the HET cache under ssp and
    Herald, and its final loss and counters equal train.cuda_graph=off's (docs/gpu.md: the seed
    systems under cuda_graph=on)."""
    extra, scope = TORCHRUN_ON[case]
    got = {}
    for graph in ("off", "on"):
        out = tmp_path / graph
        cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "trainer", "comm=torch",
               "data.max_bag=1", "train.steps=24", "data.global_batch_size=48", "data.test_samples=480",
               "data.eval_batch_size=40", "train.progress=off", *extra, f"train.cuda_graph={graph}",
               f"hydra.run.dir={out}"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[graph] = json.loads((out / "summary.json").read_text())
        if graph == "on":  # said once, by rank 0, where the sparse half stays exact-size
            assert proc.stderr.count("train.cuda_graph=on: ") == (scope == "dense"), proc.stderr[-3000:]
    off, on = got["off"], got["on"]
    assert on["final_loss"] == off["final_loss"] and on["eval_auc"] == off["eval_auc"]
    for key in ("embedding", "cache", "schedule"):
        assert on.get(key) == off.get(key), key
    if case == "fae":
        for key in ("hot_rows", "hot_steps", "alltoalls_in_hot_steps"):  # the padded step's cold steps call fewer
            assert on["placement"][key] == off["placement"][key], key
        assert on["placement"]["hot_rows"] > 0 and on["placement"]["hot_steps"] > 0
    else:
        assert on["placement"] == off["placement"]
    if case == "lru-ssp":
        assert on["cache"]["hits"] > 0 and on["cache"]["staleness"]["max"] > 0
    assert on["cuda_graph"]["scope"] == scope and off.get("cuda_graph") is None


@pytest.mark.dist
@pytest.mark.parametrize("pipeline,settled", [("off", "auto"), ("ids", "never"), ("ids", "always")])
def test_bytes_match_analytic_count_of_unique_remote_rows(pipeline, settled):
    """rows/ids/grads bytes == (unique remote rows per rank and step) x row/id size, counted here
    independently of the sharding code: row id of table t lives on worker id mod W. Pipelined with
    the settled rows, every step prepared ahead (all but the first) also carries the one-byte flag
    per requested id that says which rows were sent early."""
    world, steps, dim = 2, 6, 8
    overrides = ["data=tiny", f"train.steps={steps}", f"model.embedding_dim={dim}",
                 "data.test_samples=64", "train.progress=off", f"train.pipeline={pipeline}",
                 f"comm.settled_rows={settled}"]
    summary = run_world(world, overrides, return_state=False)[0].summary
    cfg = load_config(__import__("helpers").make_cfg(overrides))
    remote, flagged = 0, 0
    for rank in range(world):
        data = make_data(cfg, rank, world)
        for step in range(steps):
            b = data.train_batch(step)
            table = b.table_index().numpy()
            ids = b.values.numpy()
            pairs = {(int(t), int(i)) for t, i in zip(table, ids) if i % world != rank}
            remote += len(pairs)
            flagged += len(pairs) if step > 0 and settled == "always" else 0
    assert remote > 0
    assert summary["bytes"]["rows"] == remote * dim * 4
    assert summary["bytes"]["grads"] == remote * dim * 4
    assert summary["bytes"]["ids"] == remote * 8 + flagged
    samples = steps * summary["global_batch_size"]
    assert summary["bytes_per_sample_by_kind"]["rows"] == pytest.approx(remote * dim * 4 / samples)
    assert np.isclose(summary["bytes_per_sample"], summary["bytes_total"] / samples)
