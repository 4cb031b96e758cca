"""W = 2 across hosts (emulated ones, tests/distributed/test_multihost.py; containers,
tests/tools/test_image.py) against the same job on one host: the job, the check that the two runs
trained the same (their output directories) and that the traffic crossed the hosts' links."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from helpers import assert_auc_close, eval_label_counts

# comm.settled_rows=always: the same protocol on one host and across hosts (auto would send the
# settled rows early only across them, so the id bytes would differ by their flags)
CFG = ["data=tiny", "optim=adagrad", "train.steps=12", "train.log_every=1", "data.test_samples=512",
       "train.progress=off", "train.threads=1", "comm.settled_rows=always"]


# ------------------------------------------------------------------ comparing two runs
def _flatten(obj, path=""):
    """{path: leaf} of a checkpoint file's nested dicts / lists (strings left out: paths)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{path}/{k}"))
        return out
    if isinstance(obj, (list, tuple)) and not all(isinstance(x, (int, float)) for x in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{path}/{i}"))
        return out
    return {} if isinstance(obj, str) else {path: obj}


def _final_checkpoint(run_dir: str) -> str:
    root = os.path.join(run_dir, "checkpoints")
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and ".tmp" not in d)
    assert steps, f"no checkpoint in {root}"
    return os.path.join(root, steps[-1])


def _losses(run_dir: str, logged: list[int]) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    steps = [x for x in lines if "loss" in x]
    assert [x["step"] for x in steps] == logged, f"metrics lines at steps {logged} expected"
    return [x["loss"] for x in steps]


def assert_same_training(local_dir: str, net_dir: str, steps: int = 12, logged: list[int] | None = None) -> dict:
    """Per-step losses (those of the steps `logged`, default every one of `steps`), final parameters
    and optimizer state, bytes and eval equal (runs of CFG, with train.steps=`steps`); returns the
    emulated run's summary."""
    with open(os.path.join(local_dir, "summary.json")) as f:
        s_local = json.load(f)
    with open(os.path.join(net_dir, "summary.json")) as f:
        s_net = json.load(f)
    assert s_net["world_size"] == s_local["world_size"] == 2 and s_net["steps"] == steps
    assert s_net["backend"] == s_local["backend"]
    assert_same_losses(local_dir, net_dir, logged or list(range(1, steps + 1)))
    assert_same_model(local_dir, net_dir)
    assert s_net["bytes"] == s_local["bytes"] and s_net["eval_bytes"] == s_local["eval_bytes"]
    # the AUC is a rank statistic: within one (positive, negative) pair (no eval logits in summary.json)
    n_pos, n_neg = eval_label_counts(CFG)
    assert s_net["eval_samples"] == s_local["eval_samples"] == n_pos + n_neg
    assert_auc_close(s_net["eval_auc"], s_local["eval_auc"], n_pos, n_neg, pairs=1)
    assert s_net["eval_logloss"] == pytest.approx(s_local["eval_logloss"], rel=1e-6)
    assert s_net["bytes"]["rows"] > 0 and s_net["bytes"]["grads"] > 0  # rows moved between hosts
    return s_net


def assert_same_losses(local_dir: str, net_dir: str, logged: list[int], rtol: float = 1e-6, atol: float = 0.0) -> None:
    """The losses of the steps `logged` (metrics.jsonl holds each step once, also after a resume) equal."""
    torch.testing.assert_close(torch.tensor(_losses(net_dir, logged), dtype=torch.float64),
                               torch.tensor(_losses(local_dir, logged), dtype=torch.float64), rtol=rtol, atol=atol)


def assert_same_model(local_dir: str, net_dir: str, steps: int | None = None, rtol: float = 1e-6, atol: float = 0.0,
                      fewer_pushes: bool = False) -> None:
    """The two runs' final checkpoints hold the same model: every field of every shard (raw arrays,
    as saved) and every value of trainer.pt (the dense model, optimizer state, RNGs used in
    training), and with `steps` every step's loss. rtol / atol: the parity suite's 1e-5 / 1e-6 where
    part of a run trained at another W, whose sums round in another order. fewer_pushes: net_dir's
    run trained some steps at a smaller W, so its row versions (the pushes folded into a row: one
    per rank that read it in a step) may be lower, never higher."""
    if steps is not None:
        assert_same_losses(local_dir, net_dir, list(range(1, steps + 1)), rtol, atol)
    a, b = _final_checkpoint(local_dir), _final_checkpoint(net_dir)
    files = sorted(f for f in os.listdir(a) if f.endswith(".pt"))
    assert files == sorted(f for f in os.listdir(b) if f.endswith(".pt")) == ["trainer.pt"]
    compared = 0
    shards = json.load(open(os.path.join(a, "manifest.json")))["shards"]
    assert sorted(shards) == ["shard_00000-of-00002", "shard_00001-of-00002"]
    for shard, info in shards.items():  # every field's raw array (checkpoint format 2), as saved
        for field, meta in info["fields"].items():
            va, vb = (np.fromfile(os.path.join(d, shard, f"{field}.bin"), dtype=meta["dtype"]) for d in (a, b))
            if fewer_pushes and field == "version":
                assert (vb <= va).all() and (vb > 0).sum() == (va > 0).sum(), f"{shard}/{field}"
                compared += va.size
                continue
            np.testing.assert_allclose(vb, va, rtol=rtol, atol=atol, err_msg=f"{shard}/{field}")
            compared += va.size
    for name in files:
        fa = _flatten(torch.load(os.path.join(a, name), weights_only=False))
        fb = _flatten(torch.load(os.path.join(b, name), weights_only=False))
        assert fa.keys() == fb.keys(), name
        for key, va in fa.items():
            if key.startswith(("/rng/python", "/rng/numpy")):
                continue  # global Python / NumPy RNGs: saved for resume, never drawn from in training
            vb = fb[key]
            if isinstance(va, torch.Tensor):
                torch.testing.assert_close(vb, va, rtol=rtol, atol=atol, msg=lambda m: f"{name}{key}: {m}")
                compared += va.numel()
            else:
                close = isinstance(va, float) or (isinstance(va, (list, tuple)) and any(isinstance(x, float) for x in va))
                assert vb == pytest.approx(va, rel=rtol, abs=atol) if close else vb == va, f"{name}{key}"
    assert compared > 10_000  # every row, its version and accumulator, and the dense model


def assert_crossed_links(before: list[dict], after: list[dict], summary: dict) -> None:
    """The hosts' veth0 counters carry at least what the trainer counted (its training bytes plus
    the eval's): the job talked across the emulated network, not over a loopback."""
    counted = sum(summary["bytes"].values()) + sum(summary["eval_bytes"].values())
    sent = [x["tx_bytes"] - y["tx_bytes"] for x, y in zip(after, before)]
    assert sum(sent) >= counted, (sent, counted)
    assert min(sent) >= 0.25 * counted, (sent, counted)  # both hosts sent their share
