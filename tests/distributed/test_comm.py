"""Collectives over real gloo processes: uneven/empty splits, grouped allreduce, exact byte
counters, ragged allgather, broadcast, and a timeout that raises instead of hanging."""
from __future__ import annotations

import os
import pickle
import time

import pytest
import torch

from helpers import spawn
from trainer.base.comm import CollectiveError, LocalCollectives, make_collectives


def _alltoall_worker(rank: int, world: int) -> dict:
    comm = make_collectives("torch", timeout_s=30)
    try:
        # rank r sends (r + 1) * (j + 1) rows to j, except nothing to rank 0 from the last rank
        splits = [(rank + 1) * (j + 1) if not (rank == world - 1 and j == 0) else 0 for j in range(world)]
        rows = torch.cat([torch.full((s, 3), float(rank * 100 + j)) for j, s in enumerate(splits)])
        out, recv = comm.alltoall(rows, splits, kind="rows")
        empty, recv_empty = comm.alltoall(torch.zeros(0, 3), [0] * world, kind="rows")
        big = torch.arange(200_000, dtype=torch.float32).repeat(world)
        big_out, _ = comm.alltoall(big, [200_000] * world, kind="grads")
        g = comm.grouped_allreduce([torch.full((5,), float(rank + 1)), torch.tensor([rank], dtype=torch.int64)],
                                   op="sum", kind="dense")
        mean = comm.allreduce(torch.tensor([float(rank)]), op="mean")
        gathered = comm.allgather(torch.full((rank + 1, 2), float(rank)), kind="meta")
        obj = comm.broadcast_object({"dir": f"from-{rank}"})
        return {"splits": splits, "out": out, "recv": recv, "recv_empty": recv_empty, "empty": empty,
                "big_ok": bool(torch.equal(big_out, torch.arange(200_000, dtype=torch.float32).repeat(world))),
                "g0": g[0], "g1": g[1], "mean": mean, "gathered": gathered, "obj": obj,
                "bytes": comm.counter.totals("train")}
    finally:
        comm.close()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_over_gloo(world):
    res = spawn(world, _alltoall_worker)
    for r, got in enumerate(res):
        expect_recv = [res[src]["splits"][r] for src in range(world)]
        assert got["recv"] == expect_recv
        want = torch.cat([torch.full((res[src]["splits"][r], 3), float(src * 100 + r)) for src in range(world)])
        assert torch.equal(got["out"], want)
        assert got["recv_empty"] == [0] * world and got["empty"].shape == (0, 3)
        assert got["big_ok"]
        assert torch.equal(got["g0"], torch.full((5,), float(sum(range(1, world + 1)))))
        assert got["g1"].item() == sum(range(world)) and got["g1"].dtype == torch.int64
        assert got["mean"].item() == pytest.approx(sum(range(world)) / world)
        assert got["gathered"].shape == (sum(range(1, world + 1)), 2)
        assert got["obj"] == {"dir": "from-0"}
        # byte counters are exact: only what leaves the process is counted
        sent_rows = sum(s for j, s in enumerate(got["splits"]) if j != r)
        assert got["bytes"]["rows"] == sent_rows * 3 * 4
        assert got["bytes"]["grads"] == (world - 1) * 200_000 * 4
        ring = 2 * (world - 1) / world
        assert got["bytes"]["dense"] == round(ring * (5 * 4 + 8)) + round(ring * 4)
        meta = (world - 1) * 8 * 3 + (world - 1) * (r + 1) * 2 * 4  # split sizes x3 + allgather
        if r == 0:  # broadcast_object: length + pickled payload to every peer
            meta += (world - 1) * (8 + len(pickle.dumps({"dir": "from-0"})))
        assert got["bytes"]["meta"] == meta


def _timeout_worker(rank: int, world: int) -> dict:
    comm = make_collectives("torch", timeout_s=2.0)
    t0 = time.perf_counter()
    err = None
    if rank == 0:
        try:
            comm.allreduce(torch.ones(4))
        except CollectiveError as exc:
            err = str(exc)
    else:
        time.sleep(6.0)  # never joins the allreduce
    return {"err": err, "elapsed": time.perf_counter() - t0}


@pytest.mark.dist
def test_collective_timeout_raises_naming_the_op():
    res = spawn(2, _timeout_worker, timeout=60)
    assert res[0]["err"] is not None, "rank 0 should have timed out"
    assert "allreduce" in res[0]["err"] and "rank 0/2" in res[0]["err"]
    assert res[0]["elapsed"] < 5.5, f"timeout took {res[0]['elapsed']:.1f}s for a 2s limit"


def test_local_backend_is_identity_and_sends_nothing():
    comm = LocalCollectives()
    t = torch.arange(6.0).view(3, 2)
    out, recv = comm.alltoall(t, [3], kind="rows")
    assert torch.equal(out, t) and recv == [3]
    assert torch.equal(comm.grouped_allreduce([t])[0], t)
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    assert all(v == 0 for v in comm.counter.totals().values())


def test_alltoall_rejects_bad_splits():
    comm = LocalCollectives()
    with pytest.raises(ValueError, match="splits"):
        comm.alltoall(torch.zeros(3), [2], kind="ids")
    with pytest.raises(ValueError, match="unknown byte kind"):
        comm.alltoall(torch.zeros(3), [3], kind="bogus")


def test_make_collectives_rejects_unknown_backend():
    with pytest.raises(ValueError, match="comm.backend"):
        make_collectives("mpi")


def _close_worker(rank: int, world: int) -> list[str]:
    comm = make_collectives("torch", 30.0)
    comm.allreduce(torch.ones(4))
    torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)  # imports torch._dynamo lazily
    comm.barrier()
    comm.close()
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]


@pytest.mark.dist
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_close_stops_gloo_threads():
    """After close() no gloo thread may survive: one alive at interpreter exit can abort a process
    that trained successfully (SIGABRT, 'terminate called without an active exception')."""
    for names in spawn(2, _close_worker):
        assert not [n for n in names if "gloo" in n], names


def _next_group_worker(rank: int, world: int) -> list[float]:
    sums = []
    for group in range(3):
        comm = make_collectives("torch", 20.0)
        sums.append(float(comm.allreduce(torch.full((2,), float(rank + 1 + group)))[0]))
        if rank == 0:
            time.sleep(1.0)  # rank 0 (the rendezvous server's host) finishes its run last
        comm.close()
    return sums


@pytest.mark.dist
def test_a_rank_that_opens_the_next_group_early_waits_for_it():
    """Workers that close a group and open another (run() after run(), as the tests' workers do):
    rank 1 reaches the next rendezvous while rank 0 is still in the previous group. With a new
    store server per group, rank 1 met rank 0's old server and rank 0 then timed out waiting for
    it ("1/2 clients joined"); with one server per process rank 1 waits for the new group."""
    for sums in spawn(2, _next_group_worker, timeout=120.0):
        assert sums == [3.0, 5.0, 7.0]
