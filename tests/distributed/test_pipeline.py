"""The pipelined step (train.pipeline), the asynchronous collectives under it, and the wire precision.

- pipeline=ids moves only work that depends on no update (the next batch, its plan, its id / version
  requests, and without a cache the rows the current step does not update) ahead, and runs the
  dense allreduce beside the embedding push: at BSP it still equals the single-process reference
  (real gloo processes);
- pipeline=rows also lets the owners answer the next step's reads before this step's updates: every
  read is at most pull_bound updates behind the owner version at the start of the step BEFORE it
  (the in-flight step counted), and still no update is lost;
- async handles return what the blocking collectives return;
- comm.wire_precision=fp16 halves the row and gradient bytes, counted as sent, owners stay fp32.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helpers import run_single, run_world, spawn, train_worker
from parity_helpers import BASE, WIDE, assert_same_run, owner_version_at
from trainer.base.comm import make_collectives

PARITY = {
    "w2-plain-sgd": (2, ["optim=sgd"]),
    # a row lr large enough that a row read one update early changes the run beyond the tolerance
    # (with the default lr a one-step-stale row moves the losses by ~1e-7 only): the settled rows
    # sent during the step before (RowExchange.serve_settled) must be exactly the untouched ones
    "w2-plain-sgd-row-lr-5": (2, ["optim=sgd", "optim.sparse_lr=5.0"]),
    "w3-plain-adagrad-mean": (3, ["optim=adagrad", "model.pooling=mean"]),
    "w2-lru-bsp-adam": (2, ["optim=adam", "cache=lru", "cache.capacity_rows=30"]),
    # the same large row lr with a BSP cache (its version requests go ahead, the answers may not)
    # and with FAE's hot batches (hot rows replicated, cold steps in between)
    "w2-lru-bsp-sgd-row-lr-5": (2, ["optim=sgd", "optim.sparse_lr=5.0", "cache=lru", "cache.capacity_rows=30"]),
    "w2-fae-sgd-row-lr-5": (2, ["optim=sgd", "optim.sparse_lr=5.0", "placement=fae",
                                "placement.budget_bytes=16000"]),
    "w2-fae-hot-batches": (2, ["optim=adagrad", "placement=fae", "placement.budget_bytes=16000"]),
    "w2-skip-with-lru": (2, ["optim=sgd", "cache=lru", "train.nonfinite=skip"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(PARITY))
def test_pipeline_ids_equals_the_single_process_reference(case):
    world, extra = PARITY[case]
    ref = run_single(BASE + extra)
    # the settled rows too (auto sends them only between hosts; these ranks share one)
    results = run_world(world, BASE + extra + ["train.pipeline=ids", "train.eval_every=10",
                                               "comm.settled_rows=always"])
    for res in results:
        assert_same_run(ref, res)
    s = results[0].summary
    assert s["config"]["train"]["pipeline"] == "ids" and s["settled_rows"]
    assert s["bytes"]["rows"] > 0 and s["bytes"]["grads"] > 0


def _ranks_on_hosts_of_one(rank: int, world: int, overrides: list[str]):
    """A rank whose launcher said it is alone on its host (torchrun's LOCAL_WORLD_SIZE)."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    return train_worker(rank, world, overrides, False)


@pytest.mark.dist
def test_settled_rows_auto_follows_the_hosts():
    """comm.settled_rows=auto sends the settled rows early only when the ranks span hosts (torchrun's
    LOCAL_WORLD_SIZE below the world size), where bytes cost time; the flags (one byte per requested
    id of every prepared step) are what the early rows add to the id bytes."""
    overrides = BASE + ["optim=sgd", "train.pipeline=ids"]
    one_host = run_world(2, overrides, return_state=False)[0].summary
    hosts = spawn(2, _ranks_on_hosts_of_one, overrides + ["comm=torch"])[0].summary
    serial = run_world(2, BASE + ["optim=sgd", "train.pipeline=off"], return_state=False)[0].summary
    assert not one_host["settled_rows"] and hosts["settled_rows"]
    assert one_host["bytes"]["ids"] == serial["bytes"]["ids"] < hosts["bytes"]["ids"]
    assert one_host["bytes"]["rows"] == hosts["bytes"]["rows"] == serial["bytes"]["rows"]
    assert one_host["final_loss"] == pytest.approx(hosts["final_loss"], rel=1e-6)


def _reads_behind(results, shift: int) -> int:
    """Largest (owner version at the start of step - shift) - version read, over every read."""
    at = owner_version_at(np.concatenate([r.state["audit"]["updates"].numpy() for r in results]))
    worst = 0
    for r in results:
        for step, gid, ver in r.state["audit"]["reads"].numpy().tolist():
            worst = max(worst, at(gid, step - shift) - ver)
    return worst


@pytest.mark.dist
def test_pipeline_rows_bound_counts_the_in_flight_step_and_loses_no_update():
    bound = 2
    overrides = WIDE + ["train.steps=24", "train.eval_every=10", "optim=sgd", "cache=lru",
                        "consistency=ssp", f"consistency.pull_bound={bound}", "consistency.push_bound=1",
                        "train.pipeline=rows"]
    results = run_world(2, overrides)
    # answered one step early: within the bound of the owner version one step back ...
    assert _reads_behind(results, shift=1) <= bound
    # ... and really early: against the version at the step itself, some reads are further behind
    assert _reads_behind(results, shift=0) > bound
    c = results[0].summary["cache"]
    assert c["pending_updates_after_flush"] == 0
    assert c["pushed_updates"] == c["requested"]  # each remote read -> one update, pushed once
    serial = run_world(2, overrides[:-1] + ["train.pipeline=off"])
    assert _reads_behind(serial, shift=0) <= bound  # the serial run answers at the step itself


def _async_worker(rank: int, world: int) -> dict:
    comm = make_collectives("torch", 60.0, "gloo")
    try:
        x = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank
        splits = [1, 2] if rank == 0 else [2, 1]
        h1 = comm.alltoall_async(x, splits, kind="rows")  # recv sizes exchanged first
        h2 = comm.grouped_allreduce_async([x, torch.ones(1) * (rank + 1)], kind="dense")
        h3 = comm.alltoall_async(x.long(), splits, kind="ids", recv_splits=[1, 2] if rank == 0 else [2, 1])
        got2 = h2.wait()  # waits in any order
        got1, recv1 = h1.wait()
        got3, _ = h3.wait()
        sync1, sync_recv = comm.alltoall(x, splits, kind="rows")
        sync2 = comm.grouped_allreduce([x, torch.ones(1) * (rank + 1)], kind="dense")
        assert h1.wait()[0] is got1  # a second wait returns the same result
        return {"async": (got1, recv1, got2, got3), "sync": (sync1, sync_recv, sync2),
                "calls": dict(comm.counter.calls), "bytes": comm.counter.totals()}
    finally:
        comm.close()


@pytest.mark.dist
def test_async_handles_return_what_the_blocking_collectives_return():
    for out in spawn(2, _async_worker):
        got1, recv1, got2, got3 = out["async"]
        sync1, sync_recv, sync2 = out["sync"]
        torch.testing.assert_close(got1, sync1)
        assert recv1 == sync_recv
        for a, b in zip(got2, sync2):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(got3, sync1.long())
        assert out["calls"]["alltoall"] == 3 and out["calls"]["grouped_allreduce"] == 2


@pytest.mark.dist
def test_fp16_wire_halves_row_bytes_and_keeps_fp32_owners():
    base = BASE + ["optim=adagrad", "train.steps=12"]
    fp32 = run_world(2, base)
    fp16 = run_world(2, base + ["comm.wire_precision=fp16"])
    b32, b16 = fp32[0].summary["bytes"], fp16[0].summary["bytes"]
    assert b16["rows"] * 2 == b32["rows"] > 0 and b16["grads"] * 2 == b32["grads"] > 0
    assert b16["ids"] == b32["ids"] and b16["dense"] == b32["dense"]
    for a, b in zip(fp16[0].state["tables"], fp32[0].state["tables"]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert not all(torch.equal(a, b) for a, b in zip(fp16[0].state["tables"], fp32[0].state["tables"]))
    np.testing.assert_allclose(fp16[0].losses, fp32[0].losses, rtol=2e-3)
    # the cache's wire too: rows and pushed gradients at 2 bytes an element
    het = run_world(2, base + ["cache=lru", "comm.wire_precision=bf16"], return_state=False)[0].summary
    c = het["cache"]
    assert het["bytes"]["rows"] == sum(t["row_bytes"] for t in c["tables"]) == c["pulled"] * 16 * 2
    assert het["bytes"]["grads"] == c["pushed_rows"] * 16 * 2
