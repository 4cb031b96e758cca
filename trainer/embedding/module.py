"""HybridEmbedding: the autograd-facing side of the model-parallel tables.

Why not an nn.Module with parameters: embedding rows are updated owner-side by sparse optimizers
(once per row per step, on the gradient summed over workers), never by the dense optimizer or the
dense allreduce. Each step the needed rows are assembled into a small workspace leaf [U, d]; the
pooled gather reads it, autograd fills its .grad, and apply_gradients() routes those row gradients
to their owners.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from ..comm import Collectives
from ..data.batch import Batch
from .exchange import LookupPlan, RowExchange, plan_lookup
from .sharding import RowSharding
from .store import ShardStore


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


class HybridEmbedding:
    """Pooled lookups [B, T, d] over row-sharded tables, with owner-side sparse updates."""

    def __init__(self, comm: Collectives, sharding: RowSharding, store: ShardStore,
                 pooling: str) -> None:
        self.comm, self.sharding, self.store, self.pooling = comm, sharding, store, pooling
        self.exchange = RowExchange(comm, store)
        self.stats = LookupStats()
        self._pending: tuple[LookupPlan, torch.Tensor] | None = None

    @property
    def dim(self) -> int:
        return self.store.dim

    def lookup(self, batch: Batch, train: bool = True) -> torch.Tensor:
        """[B, T, d] pooled embeddings of the batch. Collective: every rank must call it."""
        gids = self.sharding.global_ids(batch.values, batch.table_index())
        plan = plan_lookup(self.sharding, gids)
        ws = torch.empty(plan.uniq.numel(), self.dim, dtype=self.store.weight.dtype,
                         device=self.store.weight.device)
        ws.index_copy_(0, plan.owned_pos, self.store.rows(plan.owned_ids))
        ws.index_copy_(0, plan.remote_pos, self.exchange.pull(plan.remote_ids, plan.splits))
        if train:
            ws.requires_grad_(True)
            self._pending = (plan, ws)
            self.stats.record(gids.numel(), plan.uniq.numel(), plan.remote_pos.numel())
        return kernels.pooled_gather(ws, plan.inverse, batch.offsets(), batch.num_tables,
                                     mode=self.pooling)

    def apply_gradients(self) -> None:
        """Push remote row gradients to owners; owners update every touched row once. Collective."""
        if self._pending is None:
            raise RuntimeError("apply_gradients() called without a training lookup")
        plan, ws = self._pending
        self._pending = None
        grad = ws.grad if ws.grad is not None else torch.zeros_like(ws)
        recv_ids, recv_grads = self.exchange.push(grad[plan.remote_pos])
        self.store.apply(torch.cat([plan.owned_ids, recv_ids]),
                         torch.cat([grad[plan.owned_pos], recv_grads]),
                         unique=recv_ids.numel() == 0)  # owned ids alone are distinct

    def full_tables(self) -> list[torch.Tensor]:
        """Every table, whole ([rows_t, d] each), assembled from all shards. Collective."""
        shards = self.comm.allgather(self.store.weight.detach().cpu(), kind="meta")
        w, r = self.sharding.world, self.sharding.local_rows
        by_gid = shards.view(w, r, self.dim).transpose(0, 1).reshape(w * r, self.dim)
        offs = self.sharding.table_offsets
        return [by_gid[int(offs[t]): int(offs[t]) + n].clone()
                for t, n in enumerate(self.sharding.table_rows)]
