"""The Horovod backend under real `horovodrun -np 2 -H localhost:2 --gloo` launches.

- collectives: alltoall with uneven / empty / large splits, grouped allreduce, allgather, broadcast,
  byte counters identical to the torch backend's (both run in the same processes), a timeout that
  raises a CollectiveError naming the op when one rank stalls;
- training: W=2 horovod reproduces the single-process reference (every loss, every parameter and
  eval logit, 1e-5), and equals the torch backend (losses and eval logits 1e-6 relative, identical bytes);
- entry points: `python -m trainer comm=horovod hydra.run.dir=DIR` writes DIR/summary.json, and a
  Hydra multirun runs every job in the same horovodrun processes, one agreed directory per job.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_same_eval, run_single
from hvd_launch import ROOT, WORKER, env, horovodrun, tail, worker_results
from parity_helpers import BASE, assert_same_run
from trainer.run.runner import RunResult

pytestmark = pytest.mark.dist
W = 2


# ---------------------------------------------------------------- collectives
@pytest.fixture(scope="module")
def coll(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hvd_coll"))
    return worker_results(horovodrun([WORKER, "collectives", out]), out)


def test_alltoall_uneven_empty_large_splits(coll):
    for r, res in enumerate(coll):
        h = res["horovod"]
        splits = [[0 if (s == W - 1 and j == 0) else (s + 1) * (j + 1) for j in range(W)] for s in range(W)]
        out, recv = h["uneven"]
        assert recv == [splits[s][r] for s in range(W)]
        want = torch.cat([torch.full((splits[s][r], 3), float(100 * s + r)) for s in range(W)])
        assert torch.equal(out, want)
        # the reply (known recv splits) returns every row to its requester, + 0.5
        mine = torch.cat([torch.full((n, 3), float(100 * r + j)) for j, n in enumerate(splits[r])])
        assert h["reply"][1] == splits[r] and torch.equal(h["reply"][0], mine + 0.5)
        ids, id_recv = h["ids"]
        assert id_recv == [0 if s == r else 3 + r for s in range(W)] and ids.dtype == torch.int64
        for key in ("empty", "empty_known"):
            assert h[key][0].shape == (0, 4) and h[key][1] == [0] * W
        big, big_recv = h["big"]
        assert big_recv == [300_000] * W and big.shape == (W * 300_000, 4)
        base = torch.arange(300_000 * 4, dtype=torch.float32).view(-1, 4)
        assert torch.equal(big, torch.cat([base + s for s in range(W)]))
        assert "alltoall" in res["horovod"]["bad_recv"] and "received splits" in h["bad_recv"]


def test_grouped_allreduce_allgather_broadcast(coll):
    tri = W * (W + 1) // 2
    for res in coll:
        h = res["horovod"]
        g = h["grouped_sum"]
        assert torch.equal(g[0], torch.full((5,), float(tri)))
        assert torch.equal(g[1], torch.arange(6, dtype=torch.float64).view(2, 3) * tri)
        assert g[2].dtype == torch.int64 and g[2].item() == tri
        rnd = sum(torch.randn(1000, 7, generator=torch.Generator().manual_seed(r)) for r in range(W))
        torch.testing.assert_close(g[3], rnd)
        torch.testing.assert_close(h["grouped_mean"][0], torch.full((5,), tri / W))
        assert torch.equal(h["allreduce"], torch.tensor([float(sum(range(W))), 2.0 * sum(range(W))]))
        assert torch.equal(h["allgather"], torch.cat([torch.full((2 * r, 2), float(r)) for r in range(W)]))
        assert torch.equal(h["broadcast"], torch.arange(4.0) * W)
        assert h["object"] == {"dir": "from-0"}


def test_results_and_byte_counters_equal_torch_backend(coll):
    for res in coll:
        h, t = res["horovod"], res["torch"]
        assert h["bytes"] == t["bytes"], (h["bytes"], t["bytes"])
        assert h["bytes"]["train"]["grads"] == (W - 1) * 300_000 * 4 * 4
        for key in ("uneven", "reply", "ids", "empty", "big"):
            assert torch.equal(h[key][0], t[key][0]) and h[key][1] == t[key][1], key
        for a, b in zip(h["grouped_sum"] + h["grouped_mean"], t["grouped_sum"] + t["grouped_mean"]):
            assert torch.equal(a, b)
        for key in ("allreduce", "allgather", "broadcast"):
            assert torch.equal(h[key], t[key]), key


def test_timeout_raises_collective_error_naming_the_op(coll):
    for probe in range(2):
        stalled = [res["timeouts"][probe] for res in coll]
        op, stall_rank = stalled[0]["op"], stalled[0]["stall_rank"]
        for r, p in enumerate(stalled):
            if r == stall_rank:
                assert p["err"] is None
                continue
            assert p["err"] is not None, f"rank {r} did not time out in {op}"
            assert f"collective '{op}'" in p["err"] and f"rank {r}/{W}" in p["err"]
            assert 1.4 < p["err_after"] < 3.5, p["err_after"]  # timeout_s = 1.5
    assert all(res["healthy_after"] == W for res in coll)


# ---------------------------------------------------------------- training
TRAIN_CASES = {
    "sgd-sum": BASE + ["optim=sgd"],
    "adagrad-mean-emptybags": BASE + ["optim=adagrad", "model.pooling=mean", "data.min_bag=0",
                                      "data.max_bag=4", "model.embedding_dim=8"],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every TRAIN_CASES entry, in one horovodrun launch: {case: [rank results]}."""
    out = str(tmp_path_factory.mktemp("hvd_train"))
    args = [WORKER, "train", out]
    for i, case in enumerate(sorted(TRAIN_CASES)):
        args += (["::"] if i else []) + TRAIN_CASES[case]
    res = worker_results(horovodrun(args), out)
    return {case: [r["cases"][i] for r in res] for i, case in enumerate(sorted(TRAIN_CASES))}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_horovod_parity_and_torch_equality(case, trained):
    overrides, res = TRAIN_CASES[case], trained[case]
    ref = run_single(overrides)
    hv0 = res[0]["horovod"]
    hv = RunResult(hv0["summary"], 0, hv0["losses"], hv0["state"])
    assert_same_run(ref, hv)  # every loss and every parameter, dense and all rows, 1e-5
    s = hv0["summary"]
    assert s["backend"] == "HorovodCollectives" and s["world_size"] == W
    assert s["bytes"]["rows"] > 0 and s["bytes"]["grads"] > 0
    assert_same_eval(ref, hv)  # every eval logit 1e-5, the AUC within the pairs that lets turn
    for r in res:  # horovod == torch backend on the same seed
        h, t = r["horovod"], r["torch"]
        torch.testing.assert_close(torch.tensor(h["losses"], dtype=torch.float64),
                                   torch.tensor(t["losses"], dtype=torch.float64), rtol=1e-6, atol=0)
        assert t["summary"]["backend"] == "TorchCollectives"
        for key in ("bytes", "eval_bytes"):
            assert h["summary"][key] == t["summary"][key], key
        # the eval logits within the losses' 1e-6 (and 1e-7 absolute: a logit, unlike a loss, can be
        # near 0), the AUC within the pairs they let turn
        assert_same_eval(RunResult(t["summary"], r["rank"], t["losses"], t["state"]),
                         RunResult(h["summary"], r["rank"], h["losses"], h["state"]), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- entry points
SHORT = ["data=tiny", "train.steps=30", "data.test_samples=512", "train.progress=off"]
REQUIRED = ("world_size", "steps", "samples_per_sec", "final_loss", "eval_auc", "eval_logloss",
            "bytes", "bytes_per_sample")


def test_horovodrun_python_m_trainer_writes_summary(tmp_path):
    out = tmp_path / "run"
    proc = horovodrun(["-m", "trainer", "comm=horovod", f"hydra.run.dir={out}"] + SHORT, cwd=str(tmp_path))
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((out / "summary.json").read_text())
    for key in REQUIRED:
        assert key in summary, key
    assert summary["world_size"] == W and summary["backend"] == "HorovodCollectives"
    assert summary["steps"] == 30 and summary["bytes"]["rows"] > 0
    assert (out / "metrics.jsonl").exists()


def test_multirun_under_horovodrun(tmp_path):
    """`-m optim.lr=0.01,0.1` with comm=auto: both jobs in the same horovodrun processes, one after
    the other, all ranks writing into rank 0's directory even when each rank's Hydra sweep dir
    differs (forced here: the dir depends on the rank, as timestamps may)."""
    sweep = "multirun/r${oc.env:HOROVOD_RANK}"
    proc = horovodrun(["-m", "trainer", "-m", "optim.lr=0.01,0.1", f"hydra.sweep.dir={sweep}"] + SHORT,
                      cwd=str(tmp_path))
    assert proc.returncode == 0, tail(proc)
    root = tmp_path / "multirun"
    assert sorted(os.listdir(root)) == ["r0"], f"stray sweep dirs: {os.listdir(root)}"
    summaries = [json.loads((root / "r0" / str(j) / "summary.json").read_text()) for j in range(2)]
    assert [s["config"]["optim"]["lr"] for s in summaries] == [0.01, 0.1]
    for s in summaries:
        assert s["backend"] == "HorovodCollectives" and s["world_size"] == W
    assert summaries[0]["final_loss"] != summaries[1]["final_loss"]
    # one Horovod init served both jobs: same process ids ran job 0 and job 1
    assert proc.stdout.count("Launching 2 jobs locally") == W


def test_staleness_sweep_under_horovodrun_and_plot(tmp_path):
    """The users' sweep: `horovodrun ... -m cache=lru consistency.pull_bound=0,8` runs both bounds in
    the same processes; scripts/plot_sweep.py turns the summaries into a PNG and a JSON report where
    the stale bound moves fewer embedding bytes than BSP."""
    sweep = tmp_path / "sweep"
    wide = ["data.table_rows=[97,3001,13,1250]", "data.global_batch_size=96", "train.steps=20"]
    proc = horovodrun(["-m", "trainer", "-m", "cache=lru", "consistency.pull_bound=0,8",
                       "consistency.push_bound=4", f"hydra.sweep.dir={sweep}"] + SHORT + wide,
                      cwd=str(tmp_path))
    assert proc.returncode == 0, tail(proc)
    summaries = [json.loads((sweep / str(j) / "summary.json").read_text()) for j in range(2)]
    assert [s["cache"]["pull_bound"] for s in summaries] == [0, 8]
    assert summaries[0]["cache"]["staleness"]["max"] == 0 < summaries[1]["cache"]["staleness"]["max"] <= 8
    steps = [json.loads(x) for x in (sweep / "1" / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in steps if "loss" in x][-1]["cache"]  # the JSONL carries the cache block too
    assert len(last["tables"]) == 4 and last["version_check_bytes"] > 0 and "hist" in last["staleness"]
    assert last["requested"] <= summaries[1]["cache"]["requested"]
    png = tmp_path / "sweep.png"
    plot = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_sweep.py"), str(sweep),
                           "--out", str(png), "--auc-tol", "1.0"], capture_output=True, text=True,
                          timeout=120, env=env())
    assert plot.returncode == 0, plot.stderr
    rep = json.loads(plot.stdout.strip().splitlines()[-1])
    assert [p["x"] for p in rep["points"]] == [0, 8]
    by_x = {p["x"]: p["embedding_bytes_per_sample"] for p in rep["points"]}
    assert by_x[8] < by_x[0] == pytest.approx(summaries[0]["embedding_bytes_per_sample"])
    assert rep["chosen"]["x"] == 8  # with a loose AUC tolerance the cheaper bound is chosen
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
