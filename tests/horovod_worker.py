"""One rank of the horovodrun-launched tests (tests/distributed/test_horovod.py starts it; not a test module).

    horovodrun -np 2 -H localhost:2 --gloo python tests/horovod_worker.py MODE OUT [overrides...]

MODE collectives: the same sequence of collectives on the horovod backend and on a torch gloo
process group created in the same processes (env from HOROVOD_RANK/SIZE + TC_MASTER_PORT); saves
both outputs and byte counters, then the timeout probes (one rank stalls, the other must raise a
CollectiveError naming the op), then a health check that Horovod still works.
MODE train: trainer.run() with comm=horovod, then with comm=torch, on each override set (sets
separated by '::'); saves
losses, summaries and (rank 0) the full state for the parity check against one process.
MODE auto: which backend comm=auto picks here (also run under torchrun and with no launcher).
Each rank writes OUT/rank<r>.pt.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

from trainer.base.comm import CollectiveError, make_collectives  # noqa: E402

TIMEOUT_S = 1.5  # the probes' collective timeout
STALL_S = 4.0  # how long the stalling rank stays away (> TIMEOUT_S, then it joins and drains)


def torch_env() -> None:
    """Make this horovodrun rank a torchrun-like rank too (same rank / size)."""
    os.environ.update(RANK=os.environ["HOROVOD_RANK"], WORLD_SIZE=os.environ["HOROVOD_SIZE"],
                      LOCAL_RANK=os.environ["HOROVOD_LOCAL_RANK"],
                      LOCAL_WORLD_SIZE=os.environ["HOROVOD_LOCAL_SIZE"], MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["TC_MASTER_PORT"])


def sequence(comm) -> dict:
    """Every collective the trainer uses, with uneven, empty and large splits. Same on all backends."""
    r, w = comm.rank, comm.size
    out: dict = {}
    # uneven: rank r sends (r + 1) * (j + 1) rows of width 3 to j; the last rank sends nothing to 0
    splits = [0 if (r == w - 1 and j == 0) else (r + 1) * (j + 1) for j in range(w)]
    rows = torch.cat([torch.full((s, 3), float(100 * r + j)) for j, s in enumerate(splits)])
    out["uneven"] = comm.alltoall(rows, splits, kind="rows")
    # a reply with known recv splits (served rows go back to where the requests came from)
    out["reply"] = comm.alltoall(out["uneven"][0] + 0.5, out["uneven"][1], kind="rows",
                                 recv_splits=splits)
    # 1-d int64 ids (the request alltoall); the self split is empty
    id_splits = [0 if j == r else 3 + j for j in range(w)]
    ids = torch.arange(sum(id_splits), dtype=torch.int64) + 1000 * r
    out["ids"] = comm.alltoall(ids, id_splits, kind="ids")
    # nothing at all, with and without known recv splits
    out["empty"] = comm.alltoall(torch.zeros(0, 4), [0] * w, kind="grads")
    out["empty_known"] = comm.alltoall(torch.zeros(0, 4), [0] * w, kind="grads", recv_splits=[0] * w)
    # large: 300k rows x 4 floats = 4.8 MB to each peer
    big = torch.arange(300_000 * 4, dtype=torch.float32).view(-1, 4).repeat(w, 1) + r
    out["big"] = comm.alltoall(big, [300_000] * w, kind="grads")
    # grouped allreduce of mixed dtypes, sum and mean; a plain allreduce
    group = [torch.full((5,), float(r + 1)), torch.arange(6, dtype=torch.float64).view(2, 3) * (r + 1),
             torch.tensor([r + 1], dtype=torch.int64), torch.randn(1000, 7, generator=torch.Generator().manual_seed(r))]
    out["grouped_sum"] = comm.grouped_allreduce(group, op="sum", kind="dense")
    out["grouped_mean"] = comm.grouped_allreduce([g for g in group if g.is_floating_point()], op="mean",
                                                 kind="dense")
    out["allreduce"] = comm.allreduce(torch.tensor([float(r), 2.0 * r]), op="sum", kind="meta")
    # ragged allgather (rank 0 contributes nothing), broadcast from the last rank, object broadcast
    out["allgather"] = comm.allgather(torch.full((r * 2, 2), float(r)), kind="meta")
    out["broadcast"] = comm.broadcast(torch.arange(4.0) * (r + 1), root=w - 1, kind="dense")
    out["object"] = comm.broadcast_object({"dir": f"from-{r}"})
    comm.barrier()
    try:  # wrong expected recv splits are caught, naming the op
        comm.alltoall(rows, splits, kind="rows", recv_splits=[s + 1 for s in out["uneven"][1]])
        out["bad_recv"] = None
    except CollectiveError as exc:
        out["bad_recv"] = str(exc)
    out["bytes"] = {p: comm.counter.totals(p) for p in ("train", "eval", "other")}
    return out


def timeout_probe(op: str, stall_rank: int) -> dict:
    """`stall_rank` stays away STALL_S; the others must raise naming `op` within ~TIMEOUT_S."""
    comm = make_collectives("horovod", timeout_s=TIMEOUT_S)
    fns = {"alltoall": lambda: comm.alltoall(torch.ones(comm.size, 2), [1] * comm.size, kind="rows"),
           "grouped_allreduce": lambda: comm.grouped_allreduce([torch.ones(3), torch.ones(2)])}
    t0 = time.monotonic()
    err, err_after = None, None
    if comm.rank == stall_rank:
        time.sleep(STALL_S)
        fns[op]()  # joins late: completes the op the others gave up on, so Horovod stays usable
    else:
        try:
            fns[op]()
        except CollectiveError as exc:
            err, err_after = str(exc), time.monotonic() - t0
        time.sleep(max(0.0, STALL_S + 0.5 - (time.monotonic() - t0)))
    return {"op": op, "stall_rank": stall_rank, "err": err, "err_after": err_after}


def mode_collectives(out_dir: str) -> dict:
    torch_env()
    hv = make_collectives("horovod", timeout_s=30)
    tc = make_collectives("torch", timeout_s=30, dist_backend="gloo")
    res = {"rank": hv.rank, "size": hv.size, "backend_auto": __import__("trainer.base.comm").base.comm.detect_backend(),
           "horovod": sequence(hv), "torch": sequence(tc)}
    tc.close()
    res["timeouts"] = [timeout_probe("alltoall", stall_rank=hv.size - 1),
                       timeout_probe("grouped_allreduce", stall_rank=0)]
    res["healthy_after"] = hv.allreduce(torch.ones(1)).item()
    hv.close()
    return res


def mode_train(out_dir: str, args: list[str]) -> dict:
    """One train_case per override set; sets are separated by "::" on the command line."""
    torch_env()
    cases, cur = [], []
    for a in args + ["::"]:
        if a == "::":
            cases.append(cur)
            cur = []
        else:
            cur.append(a)
    return {"cases": [train_case(c) for c in cases]}


def train_case(overrides: list[str]) -> dict:
    from helpers import make_cfg
    from trainer.run.runner import run
    hv = run(make_cfg(overrides + ["comm=horovod"]), return_state=True)
    tc = run(make_cfg(overrides + ["comm=torch", "comm.dist_backend=gloo"]), return_state=True)
    keep = ("world_size", "backend", "bytes", "eval_bytes", "final_loss", "eval_auc", "eval_logloss",
            "eval_samples", "embedding", "config")
    return {"rank": hv.rank,  # every rank's eval rows (helpers.assert_same_eval), rank 0's whole state
            "horovod": {"losses": hv.losses, "summary": {k: hv.summary[k] for k in keep},
                        "state": hv.state if hv.rank == 0 else {"eval_rows": hv.state["eval_rows"]}},
            "torch": {"losses": tc.losses, "summary": {k: tc.summary[k] for k in keep},
                      "state": {"eval_rows": tc.state["eval_rows"]}}}


def mode_auto(out_dir: str) -> dict:
    """What comm=auto picks under this launcher (torchrun, horovodrun or none)."""
    from trainer.base.comm import detect_backend
    comm = make_collectives("auto", timeout_s=30)
    try:
        total = comm.allreduce(torch.ones(1)).item()
        return {"detected": detect_backend(), "backend": type(comm).__name__, "rank": comm.rank,
                "size": comm.size, "allreduce": total}
    finally:
        comm.close()


MODES = {"collectives": lambda out, ov: mode_collectives(out), "train": mode_train,
         "auto": lambda out, ov: mode_auto(out)}


def main() -> int:
    mode, out_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))
    try:
        res = MODES[mode](out_dir, overrides)
        res["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - report to the test, then exit non-zero
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
