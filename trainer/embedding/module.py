"""HybridEmbedding: the autograd-facing side of the model-parallel tables.

Why not an nn.Module with parameters: embedding rows are updated owner-side by sparse optimizers
(once per row per step, on the gradient summed over workers), never by the dense optimizer or the
dense allreduce. Each step the needed rows are assembled into a small workspace leaf [U, d]; the
pooled gather reads it, autograd fills its .grad, and apply_gradients() routes those row gradients
to their owners.

Each row of a batch is one of three kinds (exchange.plan_lookup):
- replicated (hot, replica.py): read from this rank's replica; gradients summed by one allreduce
  over the hot rows the global batch touched, then every rank applies the same update;
- owned: read from and updated in this rank's shard;
- remote: read and written through the remote-row protocol chosen by config (remote/: no cache,
  HET cache with bounded staleness, Herald's on-demand sync; all behind remote/base.RemoteRows).
A hot step (the scheduler says every id of the global batch is replicated) runs no alltoall at all.
A training lookup ends either with apply_gradients() or, when every rank decided to skip the step
(train.nonfinite=skip), with discard(): no row, replica, cache entry or version changes.
Evaluation reads fresh rows from the owners after a flush, so it measures the model they hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import kernels
from ..comm import Collectives
from ..data.batch import Batch
from .exchange import RowExchange, plan_lookup
from .remote import CACHE_COUNTERS, Audit, CacheStats, PlainRemote, RemoteRows
from .replica import Replica
from .sharding import Sharding
from .store import ShardStore
from .types import GlobalStep, LookupPlan, Pushes

__all__ = ["CACHE_COUNTERS", "HybridEmbedding", "LookupStats"]


@dataclass
class LookupStats:
    """Counts of the last training step (per rank)."""

    ids: int = 0
    unique: int = 0
    remote: int = 0
    totals: dict[str, int] = field(default_factory=lambda: {"ids": 0, "unique": 0, "remote": 0})

    def record(self, ids: int, unique: int, remote: int) -> None:
        self.ids, self.unique, self.remote = ids, unique, remote
        for k, v in (("ids", ids), ("unique", unique), ("remote", remote)):
            self.totals[k] += v


@dataclass
class Prepared:
    """A training step prepared ahead (HybridEmbedding.prepare): its batch, global step, lookup plan
    and the remote protocol's begun read (None: nothing begun)."""

    batch: Batch
    info: GlobalStep
    plan: LookupPlan
    token: Any = None


class HybridEmbedding:
    """Pooled lookups [B, T, d] over row-sharded tables, with owner-side sparse updates."""

    def __init__(self, comm: Collectives, sharding: Sharding, store: ShardStore, pooling: str,
                 remote: RemoteRows | None = None, replica: Replica | None = None,
                 audit: Audit | None = None, wire_precision: str = "fp32") -> None:
        """remote: the remote-row protocol (default: no cache, PlainRemote over this module's
        RowExchange); replica: the replicated rows (placement), loaded from their owners here."""
        self.comm, self.sharding, self.store, self.pooling = comm, sharding, store, pooling
        self.exchange = RowExchange(comm, store, wire_precision)  # the no-cache wire; eval reads through it
        self.stats = LookupStats()
        self.remote: RemoteRows = remote if remote is not None else PlainRemote(self.exchange)
        self.audit = audit
        self.replica = replica
        if replica is not None:
            replica.load_from_owners(comm, store)
        self.step = -1  # index of the current training step
        self._pending: tuple[LookupPlan, torch.Tensor, GlobalStep] | None = None

    @property
    def cache(self):
        """The HET cache when the protocol has one (else None)."""
        return getattr(self.remote, "cache", None)

    @property
    def cache_stats(self) -> CacheStats | None:
        return self.remote.stats

    @property
    def dim(self) -> int:
        return self.store.dim

    def plan(self, batch: Batch) -> LookupPlan:
        gids = self.sharding.global_ids(batch.values, batch.table_index())
        return plan_lookup(self.sharding, gids, self.replica.find if self.replica is not None else None)

    def prepare(self, batch: Batch, info: GlobalStep | None = None) -> "Prepared":
        """A training step's input side, ahead of its lookup (train.pipeline): the plan and the
        begun remote read (requests sent; nothing depends on any update yet). Collective."""
        info = info if info is not None else GlobalStep()
        plan = self.plan(batch)
        return Prepared(batch, info, plan, None if info.hot else self.remote.begin(plan))

    def serve(self, prep: "Prepared") -> None:
        """Let the owners answer a prepared read now (before this rank's current step updates
        anything: train.pipeline=rows). Collective."""
        if prep.token is not None:
            self.remote.serve(prep.token)

    def serve_settled(self, prep: "Prepared") -> None:
        """train.pipeline=ids: the owners send now the rows of a prepared read that the current
        step's update leaves unchanged (exact; the rest after it). Collective."""
        if prep.token is not None and self._pending is not None and self.comm.size > 1:
            self.remote.serve_settled(prep.token, self._pending[0].owned_ids)

    def cancel(self, prep: "Prepared") -> None:
        """Drop a prepared read (the step before it was skipped). Collective."""
        if prep.token is not None:
            self.remote.cancel(prep.token)

    def lookup(self, batch: Batch, train: bool = True, info: GlobalStep | None = None,
               prepared: "Prepared | None" = None) -> torch.Tensor:
        """[B, T, d] pooled embeddings of the batch (or of a prepared training step). Collective:
        every rank must call it (with the same info.hot)."""
        token = None
        if prepared is not None:
            batch, info, plan, token = prepared.batch, prepared.info, prepared.plan, prepared.token
        else:
            info = info if info is not None else GlobalStep()
            plan = self.plan(batch)
        ws = torch.empty(plan.uniq.numel(), self.dim, dtype=self.store.weight.dtype,
                         device=self.store.weight.device)
        if train:
            self.step += 1
        if info.hot:
            if plan.remote_pos.numel():
                raise RuntimeError(f"step {self.step}: a hot step holds {plan.remote_pos.numel()} "
                                   f"non-replicated ids on rank {self.sharding.rank}")
        elif train:
            self.remote.read(plan, ws, self.step, info.sync, token)
        else:
            ws.index_copy_(0, plan.remote_pos, self.exchange.pull(plan.remote_ids, plan.splits))
        # owned rows after the protocol: Herald's writebacks may have just returned some of them
        ws.index_copy_(0, plan.owned_pos, self.store.rows(plan.owned_ids))
        if plan.hot_pos.numel():
            ws.index_copy_(0, plan.hot_pos, self.replica.rows(plan.hot_slots))
        if train:
            ws.requires_grad_(True)
            self._pending = (plan, ws, info)
            self.stats.record(int(batch.values.numel()), plan.uniq.numel(), plan.remote_pos.numel())
        return kernels.pooled_gather(ws, plan.inverse, batch.offsets(), batch.num_tables,
                                     mode=self.pooling)

    def apply_gradients(self, between: Callable[[], None] | None = None) -> None:
        """Replicated rows: allreduce + local update; remote rows: the protocol's pushes; owners
        update every touched row once. Collective. between(): called once, after the pushes
        have started and before this rank waits for what it receives (train.pipeline starts the
        dense allreduce there, so it travels behind the row gradients while the owner updates)."""
        if self._pending is None:
            raise RuntimeError("apply_gradients() called without a training lookup")
        plan, ws, info = self._pending
        self._pending = None
        grad = ws.grad if ws.grad is not None else torch.zeros_like(ws)
        if self.audit is not None:
            self.audit.grads.index_add_(0, plan.uniq.cpu(), grad.detach().double().cpu())
        if self.replica is not None:
            self._reduce_hot(plan, grad, info)
        owned = Pushes.single(plan.owned_ids, grad[plan.owned_pos])
        if info.hot:
            received = Pushes.empty(self.dim, grad.device)
            finish = lambda: received  # noqa: E731
        else:
            finish = self.remote.write_start(plan, grad)
        if between is not None:
            between()
        self._apply(owned, finish())

    def enable_discard(self) -> None:
        """Make discard() possible: protocols with state (the HET cache) journal each read."""
        self.remote.enable_undo()

    def discard(self) -> None:
        """Drop the pending training lookup instead of applying its gradients. Every rank must call
        it for the same step (the decision is collective); it communicates nothing."""
        if self._pending is None:
            raise RuntimeError("discard() called without a training lookup")
        _, _, info = self._pending
        self._pending = None
        if not info.hot:
            self.remote.discard()

    def _reduce_hot(self, plan: LookupPlan, grad: torch.Tensor, info: GlobalStep) -> None:
        """Sum the gradients of the hot rows the global batch touched over all ranks (one
        allreduce of [u, d], kind "replica") and apply them to every replica alike."""
        union = info.hot_slots
        if union is None:
            raise RuntimeError("replicated rows need the global step's hot_slots (the scheduler's feed)")
        union = union.to(grad.device)  # the runner moved it with the batch: no copy here
        buf = torch.zeros(union.numel(), self.dim, dtype=grad.dtype, device=grad.device)
        if plan.hot_slots.numel():
            if union.numel() == 0:
                raise RuntimeError("a local hot row is missing from the global step's hot_slots")
            at = torch.searchsorted(union, plan.hot_slots)
            # a consistency check that never reads the device: on CUDA it fails asynchronously
            found = (at < union.numel()) & (union[at.clamp(max=union.numel() - 1)] == plan.hot_slots)
            torch._assert_async(found.all(), "a local hot row is missing from the global step's hot_slots")
            buf.index_copy_(0, at, grad[plan.hot_pos])
        if union.numel():
            buf = self.comm.allreduce(buf, op="sum", kind="replica")
        self.replica.apply(union, buf)

    def _apply(self, owned: Pushes, received: Pushes) -> None:
        """Owner update: own rows plus what peers pushed, once per row, versions advanced."""
        both = Pushes.cat([owned, received])
        self.store.apply(both.gids, both.grads, unique=len(received) == 0, counts=both.counts)
        if self.audit is not None and len(both):
            g = torch.unique(both.gids)
            self.audit.update(self.step, g, self.store.versions(self.sharding.local_index(g)))

    def flush(self) -> int:
        """Push every pending local update to its owner and copy replicated rows back into their
        owners' shards (before eval, checkpoint, exit). Collective when the protocol holds
        pending updates; returns the number of rows this rank pushed."""
        if self.replica is not None:
            self.replica.write_to_owner(self.store)
        received = self.remote.flush()
        if received is None:
            return 0
        self._apply(Pushes.empty(self.dim, self.store.weight.device), received)
        return len(received)

    def full_tables(self) -> list[torch.Tensor]:
        """Every table, whole ([rows_t, d] each), assembled from all shards. Collective."""
        if self.replica is not None:
            self.replica.write_to_owner(self.store)
        shards = self.comm.allgather(self.store.weight.detach().cpu(), kind="meta")
        sh = self.sharding
        by_gid = torch.empty(sh.n_ids, self.dim, dtype=shards.dtype)
        for r in range(sh.world):
            by_gid[sh.local_gids(r)] = shards[r * sh.local_rows:(r + 1) * sh.local_rows]
        offs = sh.table_offsets
        return [by_gid[int(offs[t]): int(offs[t]) + n].clone()
                for t, n in enumerate(self.sharding.table_rows)]
