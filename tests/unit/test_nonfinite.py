"""Non-finite loss (train.nonfinite): stop with the step, or skip the batch with no partial state.

A data hook gives one rank's batch of a chosen step an infinite dense feature, so the global loss of
that step is NaN/inf while the other ranks' local losses are finite: the decision must be collective.
- stop: the run fails with a TrainingError naming the step (every rank).
- skip: dense parameters, every embedding row (owner shards, HET cache with bounded staleness,
  FAE replicas, Herald's lent rows) and the optimizer states equal a reference run that never saw
  the batch (the same trainer, calling train_step for every other step), and summary.json counts
  the skipped steps; train.max_skips consecutive skips stop the run.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import make_cfg, run_single, spawn
from parity_helpers import assert_same_run
from skip_helpers import poison, poison_w1, reference, without
from trainer.base.comm import LocalCollectives, make_collectives
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.sparse.embedding.cache.rows import RowCache, make_policy
from trainer.run.runner import RunResult, Trainer, TrainingError, run

BASE = ["data=tiny", "data.table_rows=[97,3001,13,1250]", "train.steps=14", "data.global_batch_size=48",
        "data.test_samples=480", "data.eval_batch_size=40", "train.threads=1", "train.progress=off"]
SKIP = ["train.nonfinite=skip"]


# ---------------------------------------------------------------------------- hooks and references
def case_worker(rank: int, world: int, overrides: list[str], bad: tuple[int, ...], bad_rank: int,
                same_world_reference: bool) -> dict:
    """Spawned rank: the skip run, then (optionally) the reference loop on the same W, then stop."""
    poison(bad, bad_rank)
    skipped = run(make_cfg(overrides + SKIP + ["comm=torch"]), return_state=True)
    out = {"skip": skipped}
    if same_world_reference:
        comm = make_collectives("torch", 60.0, "gloo")
        try:
            out["ref"] = reference(comm, overrides, bad)
        finally:
            comm.close()
    try:
        run(make_cfg(overrides + ["comm=torch"]))
        out["stop"] = None
    except TrainingError as exc:
        out["stop"] = str(exc)
    return out


# ---------------------------------------------------------------------------- W = 1
def test_stop_names_the_step(monkeypatch):
    poison_w1(monkeypatch, (6,))
    with pytest.raises(TrainingError, match=r"loss is (nan|inf) at step 6; stopping"):
        run_single(BASE)


FAE = ["optim=adagrad", "data.table_rows=[97,1001,13,250]", "placement=fae", "placement.budget_bytes=16000",
       "placement.hot_batches=true", "placement.window_batches=8", "data.max_bag=1", "train.steps=24"]


@pytest.mark.parametrize("extra", [["optim=adam"], FAE], ids=["plain-adam", "fae-hot-and-cold"])
def test_skip_equals_a_run_that_never_saw_the_batch(monkeypatch, tmp_path, extra):
    ref_trainer = Trainer(load_config(make_cfg(BASE + extra)), LocalCollectives(), None)
    bad = (3, 8)
    if ref_trainer.feed is not None:  # FAE: skip one hot step (replicas only) and one cold step
        hot = [ref_trainer.feed.order.batch(s)[1] for s in range(ref_trainer.c.train.steps)]
        bad = (hot.index(True), hot.index(False))
        bad = tuple(sorted(bad))
    poison_w1(monkeypatch, bad)
    out = tmp_path / "run"
    got = run(make_cfg(BASE + extra + SKIP + ["comm=local", "train.log_every=1"]), out_dir=str(out),
              return_state=True)
    ref = reference(ref_trainer.comm, [], bad, ref_trainer)
    assert_same_run(ref, RunResult({}, 0, without(got.losses, bad), got.state), rtol=1e-6, atol=1e-7)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["skipped_at"] == list(bad)
    assert math.isfinite(summary["final_loss"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {x["step"]: x["loss"] for x in lines if "loss" in x}
    for s in range(len(got.losses)):  # 1-based in the JSONL; a skipped step has no loss
        assert losses[s + 1] == (None if s in bad else pytest.approx(got.losses[s]))
    if ref_trainer.feed is not None:
        assert summary["placement"]["hot_rows"] > 0 and summary["placement"]["hot_steps"] > 0


def test_max_skips_stops_after_consecutive_skips(monkeypatch):
    poison_w1(monkeypatch, (2, 5, 6, 7))
    with pytest.raises(TrainingError, match=r"at step 7: 3 consecutive steps had a non-finite loss "
                                            r"\(train.max_skips=3\)"):
        run_single(BASE + SKIP + ["train.max_skips=3"])
    got = run_single(BASE + SKIP + ["train.max_skips=4"], return_state=False)  # 3 in a row are allowed
    assert got.summary["skipped_steps"] == 4


@pytest.mark.parametrize("override,key", [("train.nonfinite=retry", "train.nonfinite"),
                                          ("train.max_skips=0", "train.max_skips")])
def test_nonfinite_config_errors(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(make_cfg([override]))


# ---------------------------------------------------------------------------- W = 2 (gloo)
W2_CASES = {
    # (overrides, bad steps, bad rank, reference: None = the same W=2 trainer, else the overrides
    #  of the single-process reference, which BSP runs equal)
    "plain-adagrad": (["optim=adagrad"], (5,), 0, ["optim=adagrad"]),
    # the padded step (train/padded_step.py) updates rows last: a dropped step changed nothing
    "padded-adagrad": (["optim=adagrad", "train.cuda_graph=on"], (5,), 1, ["optim=adagrad"]),
    "cache-ssp-adam": (["optim=adam", "cache=lru", "cache.capacity_fraction=0.05", "consistency=ssp",
                        "consistency.pull_bound=3", "consistency.push_bound=2"], (4, 9), 1, None),
    # the cache in fixed shapes (fixed/het.py): a dropped step's installs and evictions rolled back
    "cache-ssp-adam-padded": (["optim=adam", "cache=lru", "cache.capacity_fraction=0.05", "consistency=ssp",
                               "consistency.pull_bound=3", "consistency.push_bound=2", "train.cuda_graph=on"],
                              (4, 9), 1, None),
    "herald-lend-adagrad": (["optim=adagrad", "optim.initial_accumulator=1e-4", "schedule=herald", "cache=lru",
                             "cache.capacity_fraction=0.05"], (6,), 1,
                            ["optim=adagrad", "optim.initial_accumulator=1e-4"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(W2_CASES))
def test_two_workers_skip_exactly_and_stop_naming_the_step(case):
    extra, bad, bad_rank, single = W2_CASES[case]
    overrides = BASE + extra
    res = spawn(2, case_worker, overrides, bad, bad_rank, single is None)
    ref_single = reference(LocalCollectives(), BASE + single, bad) if single is not None else None
    for r, out in enumerate(res):
        got = out["skip"]
        ref = out["ref"] if single is None else ref_single
        assert_same_run(ref, RunResult({}, r, without(got.losses, bad), got.state))
        assert got.summary["skipped_steps"] == len(bad)
        assert out["stop"] is not None and f"at step {bad[0]}; stopping" in out["stop"], out["stop"]
    s = res[0]["skip"].summary
    if "cache" in case:  # the rolled-back steps really had evictions of dirty rows around them
        assert s["cache"]["evicted_dirty"] > 0 and s["cache"]["staleness"]["max"] > 0
    if "herald" in case:
        assert s["placement"]["schedule"]["lend_pulls"] > 0


# ---------------------------------------------------------------------------- the cache's undo
def test_cache_rollback_restores_every_field_and_the_map():
    """begin / touch / refresh / install with dirty evictions / rollback == the state before."""
    torch.manual_seed(0)
    cache = RowCache([4, 3], 2, make_policy("lfu"), 100, 0.5)
    cache.install(torch.tensor([1, 2, 3, 50, 51]), torch.tensor([0, 0, 0, 1, 1]), torch.randn(5, 2),
                  torch.tensor([1, 1, 2, 3, 4]), step=0)
    cache.record_updates(cache.lookup(torch.tensor([1, 50])), torch.randn(2, 2))  # dirty rows
    fields = RowCache._FIELDS
    before = {f: getattr(cache, f).clone() for f in fields}
    cache.journal.begin()
    hit = cache.lookup(torch.tensor([2, 3, 51]))
    cache.touch(hit, 1)
    cache.refresh(hit[:1], torch.randn(1, 2), torch.tensor([9]))
    slots, evicted = cache.install(torch.tensor([4, 5, 52, 53]), torch.tensor([0, 0, 1, 1]), torch.randn(4, 2),
                                   torch.tensor([5, 5, 5, 5]), step=1)
    assert len(evicted) == 2 and sorted(evicted.gids.tolist()) == [1, 50]  # the dirty ones went out
    cache.journal.rollback()
    for f in fields:
        assert torch.equal(getattr(cache, f), before[f]), f
    ids = torch.arange(100)
    want = torch.full((100,), -1, dtype=torch.int64)
    want[before["gid"][before["gid"] >= 0]] = torch.nonzero(before["gid"] >= 0).squeeze(1)
    assert torch.equal(cache.lookup(ids), want)
    assert cache.pending_updates() == 2
    with pytest.raises(RuntimeError, match="without begin"):
        cache.journal.rollback()
