"""Horovod smoke test for the collectives the hybrid trainer uses.

Run (CPU, no ssh needed for localhost):
    horovodrun -np 2 -H localhost:2 --gloo /work/main/.venv/bin/python scripts/hvd_smoke.py

Checks, on every rank: alltoall with uneven / empty / all-zero splits (and the exact
return types), alltoall autograd, grouped_allreduce(op=Sum) on mixed dtypes, allgather
with different first dims, broadcast, join and barrier. Prints one JSON line per rank
and exits non-zero on the first failed assertion.

    --fail MODE       peer-failure probe instead of the smoke test: after a warm-up
                      allreduce the last rank misbehaves and rank 0 runs an allreduce and
                      prints one JSON line saying what it got and after how long.
                      MODE: exit0 / exit3 (os._exit with that code), stall (sleeps
                      --stall-seconds, never joins the collective), freeze (SIGSTOP
                      itself, so its Horovod background thread stops too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import horovod.torch as hvd

ENV_KEYS = (
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_CONTROLLER",
    "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_GLOO_IFACE", "HOROVOD_GLOO_TIMEOUT_SECONDS", "PYTHONUNBUFFERED",
)


def _rows(src: int, dst: int, n: int, width: int = 3) -> torch.Tensor:
    """n rows that encode (src, dst, row index) so misrouted data is caught."""
    r = torch.arange(n, dtype=torch.float32).unsqueeze(1).expand(n, width)
    return src * 1000.0 + dst * 100.0 + r


def _alltoall_case(rank: int, size: int, counts_to: list[int], counts_from: list[int],
                   splits_as_tensor: bool) -> dict:
    send = torch.cat([_rows(rank, j, counts_to[j]) for j in range(size)]) if sum(counts_to) \
        else torch.empty(0, 3)
    splits = torch.tensor(counts_to, dtype=torch.int32) if splits_as_tensor else counts_to
    ret = hvd.alltoall(send, splits=splits)
    assert isinstance(ret, tuple) and len(ret) == 2, type(ret)
    out, recv_splits = ret
    assert isinstance(recv_splits, torch.Tensor) and recv_splits.dtype == torch.int32, recv_splits
    assert recv_splits.tolist() == counts_from, (recv_splits.tolist(), counts_from)
    expect = [_rows(s, rank, counts_from[s]) for s in range(size) if counts_from[s]]
    expect = torch.cat(expect) if expect else torch.empty(0, 3)
    assert out.shape == expect.shape and torch.equal(out, expect), (out, expect)
    return {"sent": counts_to, "received_splits": recv_splits.tolist(),
            "out_shape": list(out.shape)}


def smoke() -> dict:
    rank, size = hvd.rank(), hvd.size()
    res: dict = {}

    # --- alltoall without splits: returns a bare Tensor (no received splits)
    t = torch.arange(size * 2, dtype=torch.float32).unsqueeze(1) + 10 * rank
    ret = hvd.alltoall(t)
    assert isinstance(ret, torch.Tensor), type(ret)
    expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32).unsqueeze(1)
                        + 10 * s for s in range(size)])
    assert torch.equal(ret, expect), (ret, expect)
    res["alltoall_no_splits_returns"] = type(ret).__name__

    # --- alltoall with splits: returns (Tensor, IntTensor received_splits)
    # uneven: rank r sends r+1 rows to every peer
    res["alltoall_uneven"] = _alltoall_case(
        rank, size, [rank + 1] * size, [s + 1 for s in range(size)], splits_as_tensor=False)
    # one empty split: rank r sends nothing to (r+1) % size, r+j+1 rows to every other j
    to = [0 if j == (rank + 1) % size else rank + j + 1 for j in range(size)]
    frm = [0 if rank == (s + 1) % size else s + rank + 1 for s in range(size)]
    res["alltoall_one_empty"] = _alltoall_case(rank, size, to, frm, splits_as_tensor=True)
    # rank 0 sends nothing at all (0-row input); everybody else sends 2 rows to each peer
    to = [0] * size if rank == 0 else [2] * size
    frm = [0 if s == 0 else 2 for s in range(size)]
    res["alltoall_rank0_sends_nothing"] = _alltoall_case(rank, size, to, frm, splits_as_tensor=False)
    res["alltoall_with_splits_returns"] = "tuple(Tensor, Tensor[int32])"

    # --- alltoall autograd. Backward is an alltoall of grad_output with the received
    # splits, so d(sum(out * 2))/dx == 2 everywhere. The incoming gradient must be
    # contiguous: out.sum().backward() hands backward an expanded (stride-0) gradient and
    # 0.28.1 raises "ValueError: Tensor is required to be contiguous." (checked below).
    x = torch.randn(size * (rank + 1), 4, requires_grad=True)
    out, rs = hvd.alltoall(x, splits=[rank + 1] * size, name="smoke.a2a_grad")
    (out * torch.full_like(out, 2.0)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 2.0)), x.grad
    res["alltoall_backward"] = "ok"
    x2 = torch.randn(size * (rank + 1), 4, requires_grad=True)
    out2, _ = hvd.alltoall(x2, splits=[rank + 1] * size, name="smoke.a2a_grad_expanded")
    try:
        out2.sum().backward()
        res["alltoall_backward_noncontiguous_grad"] = "ok"
    except ValueError as e:
        res["alltoall_backward_noncontiguous_grad"] = "ValueError: " + str(e)

    # --- grouped_allreduce, op=Sum, mixed dtypes/shapes
    ts = [torch.full((4,), float(rank + 1)),
          torch.full((2, 3), 0.5 * (rank + 1), dtype=torch.float64),
          torch.arange(5, dtype=torch.int64) * (rank + 1)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="smoke.grouped")
    tri = size * (size + 1) // 2
    assert isinstance(outs, list) and len(outs) == 3, type(outs)
    assert torch.equal(outs[0], torch.full((4,), float(tri)))
    assert torch.equal(outs[1], torch.full((2, 3), 0.5 * tri, dtype=torch.float64))
    assert outs[2].dtype == torch.int64 and torch.equal(outs[2], torch.arange(5) * tri)
    res["grouped_allreduce_sum"] = [[str(o.dtype), list(o.shape)] for o in outs]
    avg = hvd.allreduce(torch.tensor([float(rank)]), name="smoke.avg")  # default op: Average
    assert abs(avg.item() - (size - 1) / 2) < 1e-6, avg
    res["allreduce_default_average"] = avg.item()

    # --- allgather with different first dims: rank r contributes r+2 rows
    g = hvd.allgather(torch.full((rank + 2, 2), float(rank)), name="smoke.gather")
    expect = torch.cat([torch.full((s + 2, 2), float(s)) for s in range(size)])
    assert torch.equal(g, expect), g
    res["allgather_shape"] = list(g.shape)

    # --- broadcast from root 0 (out-of-place) and broadcast_ (in-place)
    b = hvd.broadcast(torch.arange(6, dtype=torch.float32) * (rank + 1), root_rank=0, name="smoke.bc")
    assert torch.equal(b, torch.arange(6, dtype=torch.float32)), b
    b2 = torch.full((3,), float(rank))
    hvd.broadcast_(b2, root_rank=size - 1, name="smoke.bc_")
    assert torch.equal(b2, torch.full((3,), float(size - 1))), b2
    res["broadcast"] = "ok"
    res["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=0)

    # --- barrier and join
    hvd.barrier()
    res["barrier"] = "ok"
    last = hvd.join()
    assert isinstance(last, int) and 0 <= last < size, last
    res["join_last_rank"] = last
    return res


def fail_probe(mode: str, stall_seconds: float) -> dict | None:
    rank, size = hvd.rank(), hvd.size()
    hvd.allreduce(torch.ones(1), name="warmup")
    if rank == size - 1:
        sys.stdout.flush()
        if mode.startswith("exit"):
            os._exit(int(mode[4:]))
        if mode == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(stall_seconds)
        return None
    time.sleep(1.0)
    t0 = time.monotonic()
    try:
        r = hvd.allreduce(torch.ones(1), name="after_peer_failure")
        outcome = {"result": r.tolist()}
    except Exception as e:  # noqa: BLE001
        outcome = {"exception": type(e).__module__ + "." + type(e).__name__,
                   "message": str(e)[:160]}
    outcome["seconds"] = round(time.monotonic() - t0, 2)
    return {"rank": rank, "fail_mode": mode, **outcome}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail", choices=["exit0", "exit3", "stall", "freeze"], default=None)
    ap.add_argument("--stall-seconds", type=float, default=120.0)
    args = ap.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.fail is not None:
        line = fail_probe(args.fail, args.stall_seconds)
        if line is not None:
            print(json.dumps(line), flush=True)
        sys.stdout.flush()
        os._exit(0)  # skip hvd.shutdown()/atexit: the peer may be gone

    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    t0 = time.monotonic()
    res = smoke()
    line = {"rank": rank, "size": size, "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "gloo_enabled": hvd.gloo_enabled(), "mpi_enabled": hvd.mpi_enabled(),
            "nccl_built": bool(hvd.nccl_built()), "torch": torch.__version__,
            "seconds": round(time.monotonic() - t0, 3), "checks": res, "env": env}
    print(json.dumps(line, sort_keys=True), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
