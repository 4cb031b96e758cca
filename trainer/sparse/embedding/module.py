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
A training step goes prepare() -> lookup() -> apply_gradients(), or discard() instead of the
last when every rank decided to skip the step (train.nonfinite=skip): no row, replica, cache entry
or version changes; dynamic tables' admissions, evictions and counts of the step are undone too
(DynamicStore.rollback, Replica.rollback: they journal them from the step's lookup to its update).
What a step holds between those calls (its batch, plan, the remote protocol's begun read and read,
the workspace) lives in its InFlightStep (types.py), which every call takes:
this module keeps no step of its own, so the step prepared ahead (train.pipeline) and the step
being trained are two objects the trainer holds side by side (trainer/step/pipeline.py).
Evaluation (eval_lookup) reads fresh rows from the owners after a flush, so it measures the model
they hold.
Half-precision rows (embedding.dtype): the workspace is float32 whatever the rows' type (the
store's compute_dtype). Rows are upcast as they are copied into it, which is exact, so the model
reads the stored values; the workspace's gradient, the pushes and the owner's update stay float32
(the owner rounds only when it writes the updated row back). A training lookup sets the one step
clock (clock()), the rounding's key among what reads it, so a row's stochastic rounding is keyed
by the step being applied wherever the row is updated (owner, replica, lent rows).
Fixed shapes (train.cuda_graph=on): fixed/shapes.py (FixedShapes) is this module's other mode, the
same stages with every size set by the config, which the capturable steps call instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import kernels
from ...base.comm import Collectives
from ...workload.data.batch import Batch
from .dynamic.shard import gather_tables
from .exchange import RowExchange, plan_lookup
from .remote import CACHE_COUNTERS, Audit, PlainRemote, RemoteRows
from .replica import Replica
from .sharding import Sharding
from .store.shard import ShardStore
from .types import GlobalStep, InFlightStep, LookupPlan, Pushes

__all__ = ["CACHE_COUNTERS", "HybridEmbedding", "InFlightStep", "LookupStats"]


@dataclass
class LookupStats:
    """Counts of the last training step (per rank). A capturable step counts its unique ids on
    the device (record_on_device); settle() reads them, once, where they are reported."""

    ids: int = 0
    unique: int = 0
    remote: int = 0
    totals: dict[str, int] = field(default_factory=lambda: {"ids": 0, "unique": 0, "remote": 0})
    pending: torch.Tensor | None = None  # [4] int64 on the device: last unique and remote counts, their sums unsettled

    def record(self, ids: int, unique: int, remote: int) -> None:
        self.ids, self.unique, self.remote = ids, unique, remote
        for k, v in (("ids", ids), ("unique", unique), ("remote", remote)):
            self.totals[k] += v

    def record_on_device(self, ids: int, unique: torch.Tensor, remote: torch.Tensor | None = None) -> None:
        """A step whose unique and remote counts [] stay on the device (no read; remote None: 0)."""
        self.ids = ids
        self.totals["ids"] += ids
        last = torch.stack([unique.reshape(()), torch.zeros_like(unique.reshape(())) if remote is None
                            else remote.reshape(())])
        summed = last if self.pending is None else self.pending[2:] + last
        self.pending = torch.cat([last, summed])

    def snapshot(self) -> tuple:
        """The counts as they are (restore() puts them back: a step trained again)."""
        return self.ids, self.unique, self.remote, dict(self.totals), self.pending

    def restore(self, saved: tuple) -> None:
        self.ids, self.unique, self.remote, totals, self.pending = saved
        self.totals = dict(totals)

    def settle(self) -> None:
        """Read the counts kept on the device (one read; a no-op when there are none)."""
        if self.pending is not None:
            self.unique, self.remote, unique, remote = self.pending.tolist()
            self.totals["unique"] += unique
            self.totals["remote"] += remote
            self.pending = None


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
        # the step of the last training lookup, as its InFlightStep carries it (the train pipeline's
        # clock, trainer/step/pipeline.py; this module counts nothing): the cache's LRU ages, the
        # dynamic tables' admissions, the audit's records (a resumed run: the checkpoint's step - 1)
        self.step = -1
        self.undoable = False  # enable_discard(): dynamic tables journal each step's admissions

    def clock(self, step: int) -> None:
        """The sparse side's one step clock: the step being trained (its lookup to its update),
        which the cache's ages, the dynamic tables' admissions, the audit's records and the
        stochastic rounding of half rows (the store's rounding key: this step's updates round by
        it wherever a row is updated, owner, replica or lent rows) all read. Set by a training
        lookup (either mode), and by a resume to the step before the checkpoint's."""
        self.step = step
        self.store.rounding.step = step

    @property
    def cache(self):
        """The HET cache when the protocol has one (else None)."""
        return getattr(self.remote, "cache", None)

    @property
    def dim(self) -> int:
        return self.store.dim

    def plan(self, batch: Batch) -> LookupPlan:
        gids = self.sharding.global_ids(batch.values, batch.table_index())
        return plan_lookup(self.sharding, gids, self.replica.find if self.replica is not None else None)

    def prepare(self, flight: InFlightStep) -> InFlightStep:
        """A training step's input side: its plan and the begun remote read (requests sent;
        nothing depends on any update yet), made a step early (train.pipeline) or by its
        lookup. Collective."""
        flight.plan = self.plan(flight.batch)
        flight.token = None if flight.info.hot else self.remote.begin(flight.plan)
        self.store.tick(flight.step)
        self.store.prefetch(flight.plan.owned_ids)  # embedding.store=disk: its own rows start coming
        return flight

    def serve(self, flight: InFlightStep) -> None:
        """Let the owners answer a prepared read now (before this rank's current step updates
        anything: train.pipeline=rows). Collective."""
        if flight.token is not None:
            self.remote.serve(flight.token)

    def serve_settled(self, flight: InFlightStep, current: InFlightStep) -> None:
        """train.pipeline=ids: the owners send now the rows of a prepared read that the current
        step's update (`current`, looked up) leaves unchanged (exact; the rest after it). Collective."""
        if flight.token is not None and self.comm.size > 1:
            self.remote.serve_settled(flight.token, current.plan.owned_ids, current.read)

    def cancel(self, flight: InFlightStep) -> None:
        """Drop a prepared read (its step will not run, or must begin again). Collective."""
        if flight.token is not None:
            self.remote.cancel(flight.token)
            flight.token = None

    def lookup(self, flight: InFlightStep) -> torch.Tensor:
        """[B, T, d] pooled embeddings of a training step (prepared first if it was not); fills
        its workspace (flight.ws) and keeps the protocol's read in it for apply_gradients /
        discard. Collective: every rank must call it (with the same info.hot)."""
        if flight.plan is None:
            self.prepare(flight)
        batch, info, plan = flight.batch, flight.info, flight.plan
        ws = self._workspace(plan)
        self.clock(flight.step)
        if self.store.dynamic:  # its own ids first; peers' requests when this rank serves them
            for undo in self._journals():  # until apply_gradients (commit) or discard (rollback)
                undo.begin()
            self.store.clock = self.step
            self.store.admit(plan.owned_ids)
            if self.replica is not None:  # the hot ids the global batch reads (replica.py)
                self.replica.admit(self.comm, self.store, self.union(info))
        if info.hot:
            if plan.remote_pos.numel():
                raise RuntimeError(f"step {self.step}: a hot step holds {plan.remote_pos.numel()} "
                                   f"non-replicated ids on rank {self.sharding.rank}")
        else:
            flight.read = self.remote.read(plan, ws, self.step, info.sync, flight.token)
        self._local_rows(plan, ws)
        ws.requires_grad_(True)
        flight.ws = ws
        self.stats.record(int(batch.values.numel()), plan.uniq.numel(), plan.remote_pos.numel())
        return kernels.pooled_gather(ws, plan.inverse, batch.offsets(), batch.num_tables, mode=self.pooling)

    def eval_lookup(self, batch: Batch) -> torch.Tensor:
        """[B, T, d] pooled embeddings of an evaluation batch: remote rows fresh from their owners,
        nothing recorded for an update. Collective."""
        plan = self.plan(batch)
        ws = self._workspace(plan)
        ws.index_copy_(0, plan.remote_pos, self.exchange.pull(plan.remote_ids, plan.splits))
        self._local_rows(plan, ws)
        return kernels.pooled_gather(ws, plan.inverse, batch.offsets(), batch.num_tables, mode=self.pooling)

    def _workspace(self, plan: LookupPlan) -> torch.Tensor:
        return torch.empty(plan.uniq.numel(), self.dim, dtype=self.store.compute_dtype,
                           device=self.store.device)

    def _local_rows(self, plan: LookupPlan, ws: torch.Tensor) -> None:
        """The owned and replicated rows into the workspace (owned rows after the protocol's read:
        Herald's writebacks may have just returned some of them), upcast (a no-op for fp32 rows)."""
        ws.index_copy_(0, plan.owned_pos, self.store.rows(plan.owned_ids).to(ws.dtype))
        if plan.hot_pos.numel():
            ws.index_copy_(0, plan.hot_pos, self.replica.rows(plan.hot_slots).to(ws.dtype))

    def apply_gradients(self, flight: InFlightStep) -> None:
        """Replicated rows: allreduce + local update; remote rows: the protocol's pushes; owners
        update every touched row once. Collective."""
        self.begin_update(flight)()

    def begin_update(self, flight: InFlightStep) -> Callable[[], None]:
        """apply_gradients in two halves: this one reduces the replicated rows and starts the
        pushes; the function it returns waits for what this rank receives and updates the owned
        rows (train.pipeline starts the dense allreduce between the two, so it travels behind the
        row gradients while the owners update). Collective, both halves, each called once."""
        ws, read = self.finish_lookup(flight, "apply_gradients")
        for undo in self._journals():
            undo.commit()
        plan, info = flight.plan, flight.info
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
            finish = self.remote.write_start(plan, grad, read)
        return lambda: self._apply(owned, finish())

    def enable_discard(self) -> None:
        """Make discard() possible: protocols with state (the HET cache) journal each read, dynamic
        tables each step's admissions."""
        self.remote.enable_undo()
        self.undoable = True

    def discard(self, flight: InFlightStep) -> None:
        """Drop a looked-up training step instead of applying its gradients. Every rank must call
        it for the same step (the decision is collective); it communicates nothing."""
        _, read = self.finish_lookup(flight, "discard")
        if not flight.info.hot:
            self.remote.discard(read)
        for undo in self._journals():
            undo.rollback()

    def _journals(self) -> list[Any]:
        """What journals a training step's admissions while discard() is possible (dynamic tables):
        the owner's pool and rows, and the replica's rows given a life."""
        if not (self.undoable and self.store.dynamic):
            return []
        return [self.store] if self.replica is None else [self.store, self.replica]

    @staticmethod
    def finish_lookup(flight: InFlightStep, what: str) -> tuple[torch.Tensor, Any]:
        """(workspace, read) of a looked-up step, which is finished from now on (applied or
        discarded once)."""
        if flight.ws is None:
            raise RuntimeError(f"{what}() called without a training lookup")
        ws, read = flight.ws, flight.read
        flight.ws, flight.read = None, None
        return ws, read

    def _reduce_hot(self, plan: LookupPlan, grad: torch.Tensor, info: GlobalStep) -> None:
        """Sum the gradients of the hot rows the global batch touched over all ranks (one
        allreduce of [u, d], kind "replica") and apply them to every replica alike."""
        union = self.union(info).to(grad.device)  # the runner moved it with the batch: no copy here
        buf = torch.zeros(union.numel(), self.dim, dtype=grad.dtype, device=grad.device)
        if plan.hot_slots.numel():
            if union.numel() == 0:
                raise RuntimeError("a local hot row is missing from the global step's hot_slots")
            at = torch.searchsorted(union, plan.hot_slots)
            # a consistency check that never reads the device: on CUDA it fails asynchronously
            found = (at < union.numel()) & (union[at.clamp(max=union.numel() - 1)] == plan.hot_slots)
            torch._assert_async(found.all(), "a local hot row is missing from the global step's hot_slots")
            buf.index_copy_(0, at, grad[plan.hot_pos])
        self.reduce_replica(union, buf)

    def reduce_replica(self, union: torch.Tensor, buf: torch.Tensor, fits: torch.Tensor | None = None) -> None:
        """The replica's rows `union` [u] (the global batch's hot rows, ascending) take this rank's
        gradients buf [u, d] summed over the ranks (one allreduce, kind "replica"), on every rank
        alike (fits, a device bool: only where it holds). Both modes end their replicated rows'
        update here."""
        if union.numel():
            buf = self.comm.allreduce(buf, op="sum", kind="replica")
        self.replica.apply(union, buf, self.store, fits)

    @staticmethod
    def union(info: GlobalStep) -> torch.Tensor:
        """The replica slots the global batch reads (the scheduler's feed)."""
        if info.hot_slots is None:
            raise RuntimeError("replicated rows need the global step's hot_slots (the scheduler's feed)")
        return info.hot_slots

    def _apply(self, owned: Pushes, received: Pushes) -> None:
        """Owner update: own rows plus what peers pushed, once per row, versions advanced."""
        both = Pushes.cat([owned, received])
        self.store.apply(both.gids, both.grads, unique=len(received) == 0, counts=both.counts, lives=both.lives)
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
        self._apply(Pushes.empty(self.dim, self.store.device), received)
        return len(received)

    def dynamic_tables(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Dynamic tables: (ids, rows) of every admitted row per table (dynamic.gather_tables),
        replicated rows written back first. Collective."""
        if self.replica is not None:
            self.replica.write_to_owner(self.store)
        return gather_tables(self.comm, self.store)

    def full_tables(self) -> list[torch.Tensor]:
        """Every table, whole ([rows_t, d] each, as stored), assembled from all shards. Collective."""
        if self.replica is not None:
            self.replica.write_to_owner(self.store)
        with self.store.raw(write=False):
            shards = self.comm.allgather(self.store.weight.detach().cpu(), kind="meta")
        sh = self.sharding
        by_gid = torch.empty(sh.n_ids, self.dim, dtype=shards.dtype)
        for r in range(sh.world):
            by_gid[sh.local_gids(r)] = shards[r * sh.local_rows:(r + 1) * sh.local_rows]
        offs = sh.table_offsets
        return [by_gid[int(offs[t]): int(offs[t]) + n].clone()
                for t, n in enumerate(self.sharding.table_rows)]
