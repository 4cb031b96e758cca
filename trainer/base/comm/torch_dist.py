"""torch.distributed backend (gloo on CPU, nccl on GPU) behind the Collectives interface.

Why a separate file: the rest of the trainer must never import torch.distributed; this is the only
place that does. Every collective is issued async and waited with the configured timeout, and the
process group itself is created with the same timeout, so a dead or absent peer becomes a
CollectiveError naming the operation instead of a hang.

torch._dynamo is imported before the process group exists on purpose. Importing it afterwards (which
the first torch.optim optimizer does) keeps a reference to the default gloo group alive past
destroy_process_group(), so gloo's worker threads survive into interpreter shutdown, where one of
them may drop its last tensor without the GIL and abort the process ("terminate called without an
active exception", SIGABRT at exit after a successful run). Seen with torch 2.13 on 1 in ~6 runs.
"""
from __future__ import annotations

import datetime as _dt
import os
from typing import Any, Mapping

import torch
import torch._dynamo  # noqa: F401  (must precede init_process_group: see below)
import torch.distributed as dist

from ..config import ConfigError, dist_transport, resolve_device
from .base import Collectives, flatten, unflatten


RENDEZVOUS_MIN_S = 60.0
_STORE: dict[str, Any] = {}  # this process's rendezvous store: {"key": ..., "store": TCPStore, "groups": n}


def _rendezvous(timeout: _dt.timedelta) -> dict[str, Any]:
    """init_process_group's store, rank and world size: ONE TCPStore per process, each process group
    under its own key prefix. Without a launcher's store, rank 0 serves it on MASTER_ADDR:MASTER_PORT
    for the life of the process; under torchrun (TORCHELASTIC_USE_AGENT_STORE) every rank is a
    client of the agent's store, which outlives the workers.

    Why a prefix per group: a process that closes its group and opens another (the next job of a
    Hydra sweep, a second run() in the same workers) must not meet the previous group's keys.
    env:// under torchrun puts every group of a process under the same keys of the agent's store,
    so the second group's gloo read the first group's per-rank addresses and connected to closed
    ports ("Gloo connectFullMesh failed ... Connection refused": every sweep job after the first
    failed). Outside torchrun env:// starts a new store server per group, and a rank that came
    early could reach rank 0's previous server and wait for a rendezvous that never came ("1/2
    clients joined"). With one store and a fresh prefix a rank that comes early waits under the new
    prefix. Every rank opens its groups in the same order, so the n-th group has the same prefix on
    every rank.

    Restarts (torchrun --max-restarts): the agent's store outlives the workers, so a restarted
    worker (which counts its groups from 1 again) would meet the keys of the incarnation before it;
    the restart count is then part of the prefix. That count is each agent's own, and agents of
    several nodes disagree on it as soon as one node restarts for a failure and another for the
    membership change (the count moves only for a failure): ranks would wait under different
    prefixes until the timeout. So across nodes with restarts the agent's store is refused
    (agent_store_refusal); with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every rendezvous round gives
    the workers a fresh store on a new port, served by rank 0, and no restart count is needed."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent else "0"
    key = f"{addr}:{port}/{rank}/{world}/{restart}"
    if _STORE.get("key") != key:
        # joining waits for the slowest rank to start (imports, a loaded host): at least
        # RENDEZVOUS_MIN_S, whatever the collectives' timeout (a 2 s comm.timeout_s is for steps)
        wait = max(timeout, _dt.timedelta(seconds=RENDEZVOUS_MIN_S))
        store = dist.TCPStore(addr, port, world, is_master=rank == 0 and not agent, timeout=wait)
        _STORE.update(key=key, groups=0, store=store)
    _STORE["groups"] += 1
    prefix = f"trainer/restart{restart}/group{_STORE['groups']}/"
    return {"store": dist.PrefixStore(prefix, _STORE["store"]), "rank": rank, "world_size": world}


def agent_store_refusal(env: Mapping[str, str] | None = None) -> str | None:
    """Why this torchrun worker cannot rendezvous safely, or None: restarts allowed
    (TORCHELASTIC_MAX_RESTARTS > 0) with the agent's shared store and more than one node
    (GROUP_WORLD_SIZE > 1); see _rendezvous. A node that joins later is also never given the
    master's address by torchrun's shared store (its rendezvous waits for it forever)."""
    env = os.environ if env is None else env
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and int(env.get("GROUP_WORLD_SIZE", "1")) > 1):
        return ("torchrun --max-restarts across several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                "every node's environment (a fresh store per restart; with torchrun's shared store the "
                "nodes' restart counts disagree, and a node that rejoins never gets the master's address)")
    return None


def pick_backend(dist_backend: str, device: str) -> str:
    """gloo or nccl: comm.dist_backend for a run on train.device `device` in this process's
    environment (config.dist_transport; auto: nccl when the run is on cuda and this host's ranks
    have a GPU each)."""
    run = resolve_device(device)
    return dist_transport(dist_backend, run, run == "cuda" and _gpus_shared())


def _gpus_shared() -> bool:
    """Whether ranks of this host would share a GPU: more ranks here (LOCAL_WORLD_SIZE, else
    WORLD_SIZE) than GPUs, or no LOCAL_RANK to pick a GPU by (every rank on the current one)."""
    env = os.environ
    if "LOCAL_RANK" not in env:
        return int(env.get("WORLD_SIZE", "1")) > 1
    here = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE", "1")
    return int(here) > torch.cuda.device_count()


class TorchCollectives(Collectives):
    """Collectives over a torch.distributed process group, from the torchrun environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the rendezvous of _rendezvous)."""

    def __init__(self, timeout_s: float, backend: str = "auto", device: str = "auto") -> None:
        """backend: comm.dist_backend (auto | gloo | nccl); device: the run's train.device. On
        cuda each rank takes the GPU of its local rank (LOCAL_RANK modulo the GPUs), and auto is
        nccl unless this host's ranks would share a GPU (config.dist_transport)."""
        if resolve_device(device) == "cuda" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        self.backend = self.transport = backend = pick_backend(backend, device)
        self._owns_group = not dist.is_initialized()
        timeout = _dt.timedelta(seconds=timeout_s)
        if self._owns_group:
            if any(v not in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
                raise RuntimeError("comm.backend=torch needs RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT "
                                   "in the environment (launch with torchrun)")
            why = agent_store_refusal()
            if why:
                raise ConfigError(why)
            dist.init_process_group(backend=backend, timeout=timeout, **_rendezvous(timeout))
        local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun: the ranks it started on this host
        super().__init__(dist.get_rank(), dist.get_world_size(), timeout_s,
                         local_size=int(local) if local and local.isdigit() else None)
        self._timeout = timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")

    def _wait(self, work) -> None:
        if not work.wait(self._timeout):
            raise TimeoutError(f"no completion within {self.timeout_s:g}s")

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if t.device != self.device else t

    def _allreduce(self, ts, op):
        return self._allreduce_start(ts, op)()

    def _allreduce_start(self, ts, op):
        if op not in ("sum", "mean"):
            raise ValueError(f"unsupported allreduce op {op!r}")
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(ts):
            by_dtype.setdefault(t.dtype, []).append(i)
        started = []
        for idx in by_dtype.values():
            buf = self._to_dev(flatten([ts[i] for i in idx]))
            started.append((idx, buf, dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True)))

        def finish() -> list[torch.Tensor]:
            out: list[torch.Tensor] = [None] * len(ts)  # type: ignore[list-item]
            for idx, buf, work in started:
                self._wait(work)
                if op == "mean":
                    buf /= self.size
                group = [ts[i] for i in idx]
                for i, piece in zip(idx, unflatten(buf.to(group[0].device), group)):
                    out[i] = piece
            return out
        return finish

    def _alltoall(self, t, splits, recv_splits):
        return self._alltoall_start(t, splits, recv_splits)()

    def _alltoall_start(self, t, splits, recv_splits):
        out = torch.empty((sum(recv_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=self.device)
        work = dist.all_to_all_single(out, self._to_dev(t), output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(splits), async_op=True)

        def finish() -> torch.Tensor:
            self._wait(work)
            return out.to(t.device)
        return finish

    def _allgather(self, t):
        n = torch.tensor([t.shape[0]], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        self._wait(dist.all_gather(sizes, n, async_op=True))
        sizes_i = [int(s.item()) for s in sizes]
        mx = max(sizes_i)
        pad = torch.zeros((mx,) + tuple(t.shape[1:]), dtype=t.dtype, device=self.device)
        pad[: t.shape[0]] = self._to_dev(t)
        bufs = [torch.empty_like(pad) for _ in range(self.size)]
        self._wait(dist.all_gather(bufs, pad, async_op=True))
        return torch.cat([b[:s] for b, s in zip(bufs, sizes_i)]).to(t.device)

    def _broadcast(self, t, root):
        buf = self._to_dev(t.clone())
        self._wait(dist.broadcast(buf, src=root, async_op=True))
        return buf.to(t.device)

    def _barrier(self):
        self._wait(dist.barrier(async_op=True))

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
