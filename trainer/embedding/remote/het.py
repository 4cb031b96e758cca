"""HET: a per-worker cache of remote rows with per-row version clocks and bounded staleness.

This file holds the whole HET protocol: the worker side (HetRemote, driving the RowCache of
cache.py with the two rules of consistency.py) and its wire (HetWire, over alltoall), plus the
byte formula of that wire. The simulator (trainer/sim/) drives the same HetRemote through an
in-process exchange that implements HetWire's two calls on one owner-version array.

The wire, per step:
- check: the worker sends (id, cached version) for every remote id (version -1: no copy); the owner
  answers every id with its current version when it sends the row (no copy, or the copy is more
  than the pull bound behind: consistency.needs_row) or -1 ("still fresh"); then only those rows
  travel. The owner records the staleness of the reads it let through.
- push_updates: (id, update count, summed gradient) for whichever rows the cache decided to push
  (consistency.push_due, evictions, transient rows, the flush), all three in one message per owner
  (one alltoall; each part's bytes are still counted under its own kind).
On the wire an id is its owner's storage row (Sharding.local_index), as int32 whenever the shard
allows (exchange.wire_dtype), like the versions and counts.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...comm import Collectives
from ..cache import RowCache
from ..consistency import Bounds, needs_row
from ..exchange import wire_dtype
from ..sharding import Sharding
from ..store import ShardStore
from ..types import LookupPlan, Pushes
from .base import Audit, CacheStats, RemoteRows, StalenessStats


def serve_check(cached_version: torch.Tensor, owner_version: torch.Tensor,
                pull_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's answer to a version check: (send [n] bool, staleness [n] of each read: 0 where the
    row is sent, owner - cached where the worker's copy is used)."""
    send = needs_row(cached_version, owner_version, pull_bound)
    return send, torch.where(send, torch.zeros_like(owner_version), owner_version - cached_version)


class HetWire:
    """HET's two collective calls over alltoall; every rank is requester and owner in each call."""

    def __init__(self, comm: Collectives, store: ShardStore) -> None:
        self.comm, self.store, self.sh = comm, store, store.sharding
        self.staleness = StalenessStats(self.sh.num_tables, store.weight.device)

    @property
    def wire_dtype(self) -> torch.dtype:
        """Integer type of ids (owner storage rows), versions and counts on the wire."""
        return wire_dtype(self.sh.local_rows)

    def check(self, remote_ids: torch.Tensor, cached_versions: torch.Tensor, splits: list[int],
              pull_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Version check + pull of the rows that must be re-read.

        remote_ids [Ur] grouped by owner as `splits`; cached_versions [Ur] (-1 = no copy);
        pull_bound [T] per table. Returns (need [Ur] bool, versions [Ur] owner version of each row
        sent, -1 elsewhere; rows [need.sum(), d] in the order of `need`).
        """
        sh, wire = self.sh, self.wire_dtype
        req = torch.stack([sh.local_index(remote_ids), cached_versions], 1).to(wire)
        served, served_splits = self.comm.alltoall(req, splits, kind={"ids": 1, "versions": 1})
        idx, ver = served[:, 0].long(), served[:, 1].long()
        now = self.store.versions(idx)
        table = sh.local_table_of(idx)
        send, gap = serve_check(ver, now, pull_bound.to(now.device).index_select(0, table))
        self.staleness.record(gap, table)
        reply = torch.where(send, now, -1).to(wire)
        got, _ = self.comm.alltoall(reply, served_splits, kind="versions", recv_splits=splits)
        versions = got.long()
        need = versions >= 0
        rows, _ = self.comm.alltoall(self.store.weight.index_select(0, idx[send]),
                                     _true_per_segment(send, served_splits), kind="rows",
                                     recv_splits=_true_per_segment(need, splits))
        return need, versions, rows

    def push_updates(self, pushes: Pushes) -> Pushes:
        """Send (id, count, gradient) of pushed rows to their owners; return what this rank
        received as owner (global ids, gradients, counts), not yet applied.

        One alltoall: each row travels as the bytes of its (id, count) in the wire's integer type
        followed by those of its gradient; the bytes are counted per column under their kinds
        (ids, versions, grads), exactly as if they went in separate messages."""
        sh = self.sh
        gids, grads, counts = pushes.gids, pushes.grads, pushes.counts
        owner = sh.owner(gids)
        if gids.numel() > 1 and not bool((owner[1:] >= owner[:-1]).all()):  # group by owner, in order
            order = torch.argsort(owner, stable=True)
            gids, grads, counts = gids[order], grads[order], counts[order]
        head = torch.stack([sh.local_index(gids), counts], 1).to(self.wire_dtype)
        packed = _pack_rows([head, grads])
        w = 2 * head.element_size()  # bytes of (id, count)
        got, _ = self.comm.alltoall(packed, torch.bincount(owner, minlength=sh.world).tolist(),
                                    kind={"ids": w // 2, "versions": w // 2, "grads": packed.shape[1] - w})
        head = _unpack_rows(got, 0, w, self.wire_dtype).long()
        return Pushes(sh.global_of(head[:, 0], sh.rank), _unpack_rows(got, w, got.shape[1] - w, grads.dtype),
                      head[:, 1])


def _pack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """[n, bytes] uint8 whose row i holds the bytes of row i of each part ([n, k_j] each), in order."""
    widths = [p.shape[1] * p.element_size() for p in parts]
    buf = torch.empty(parts[0].shape[0], sum(widths), dtype=torch.uint8, device=parts[0].device)
    at = 0
    for p, w in zip(parts, widths):
        buf[:, at:at + w].copy_(p.contiguous().view(torch.uint8))
        at += w
    return buf


def _unpack_rows(buf: torch.Tensor, at: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Byte columns [at, at + width) of a packed [n, bytes] buffer as `dtype` values: a view when
    they are aligned for it, else a copy."""
    cols = buf[:, at:at + width]
    size = torch.empty(0, dtype=dtype).element_size()
    if (buf.storage_offset() + at) % size or buf.stride(0) % size:
        cols = torch.empty(cols.shape, dtype=torch.uint8, device=buf.device).copy_(cols)
    return cols.view(dtype)


def _true_per_segment(mask: torch.Tensor, splits: list[int]) -> list[int]:
    """Number of True in each consecutive segment of `mask` of lengths `splits` (one cumsum)."""
    edges = torch.tensor([0] + splits, device=mask.device).cumsum(0)
    c = torch.cat([edges.new_zeros(1), torch.cumsum(mask, 0)])
    c = c.index_select(0, edges)
    return (c[1:] - c[:-1]).tolist()


def het_wire_bytes(requested, pulled, pushed_rows, dim: int, row_elem: int, wire: int) -> dict:
    """Bytes on the wire of the HET protocol from its counts (numbers or arrays, per table or total).

    requested: remote ids looked up (each sends (id, version) and gets a version-or-(-1) back);
    pulled: rows sent by owners; pushed_rows: rows pushed (id, count, gradient each).
    dim, row_elem: row width and element size; wire: size of an id/version/count on the wire.
    The trainer's summary and the simulator both count bytes with this function.
    """
    row = dim * row_elem
    return {"version_check": requested * 3 * wire, "rows": pulled * row,
            "pushes": pushed_rows * (2 * wire + row)}


class HetRemote(RemoteRows):
    """HET: remote rows come from the cache where fresh enough, the rest through the wire's check;
    row gradients of cached rows stay in the cache until their push is due.

    wire: HetWire (training) or the simulator's in-process exchange (check + push_updates).
    """

    def __init__(self, wire: Any, sharding: Sharding, cache: RowCache, bounds: Bounds,
                 stats: CacheStats, audit: Optional[Audit] = None) -> None:
        self.wire, self.sharding, self.cache, self.bounds = wire, sharding, cache, bounds
        self.stats, self.audit = stats, audit
        self.staleness = getattr(wire, "staleness", None)
        self._slots: torch.Tensor | None = None  # the read's slot of each remote id (-1: transient)
        self._transient: torch.Tensor | None = None  # positions of its transient ids (None: none)
        self._evicted: Pushes | None = None
        self.undoable = False  # train.nonfinite=skip: journal each read so discard() can undo it

    def enable_undo(self) -> None:
        self.undoable = True

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None) -> None:
        """Fill ws's remote positions from the cache, checking versions with the owners."""
        cache, remote = self.cache, plan.remote_ids
        if self.undoable:
            cache.begin()
        table = self.sharding.table_of(remote)
        slots = cache.lookup(remote)
        hit = slots >= 0
        cache.touch(slots[hit], step)
        cached_ver = cache.versions_of(slots)
        need, versions, rows = self.wire.check(remote, cached_ver, plan.splits, self.bounds.pull)
        pulled = torch.nonzero(need).squeeze(1)  # position of each of `rows` among the remote ids
        pulled_slot = slots.index_select(0, pulled)
        was_cached = pulled_slot >= 0
        stale = torch.nonzero(was_cached).squeeze(1)  # cached copies too far behind: re-read
        cache.refresh(pulled_slot.index_select(0, stale), rows.index_select(0, stale),
                      versions.index_select(0, pulled.index_select(0, stale)))
        fetched = torch.nonzero(~was_cached).squeeze(1)  # misses (every miss is pulled)
        miss = pulled.index_select(0, fetched)
        new_slots, self._evicted = cache.install(
            remote.index_select(0, miss), table.index_select(0, miss), rows.index_select(0, fetched),
            versions.index_select(0, miss), step)
        slots.index_copy_(0, miss, new_slots)
        gone = torch.nonzero(new_slots < 0).squeeze(1)  # transient: used from the pulled rows
        self._transient = miss.index_select(0, gone) if gone.numel() else None
        if self._transient is None:
            ws.index_copy_(0, plan.remote_pos, cache.rows.index_select(0, slots))
        else:
            if cache.size:
                ws.index_copy_(0, plan.remote_pos, cache.rows.index_select(0, slots.clamp(min=0)))
            ws.index_copy_(0, plan.remote_pos.index_select(0, self._transient),
                           rows.index_select(0, fetched.index_select(0, gone)))
        self.stats.reads(table, hit, need, None if self._transient is None else slots < 0)
        if self.audit is not None:
            self.audit.read(step, remote, torch.where(need, versions, cached_ver))
        self._slots = slots

    def write(self, plan: LookupPlan, grad: torch.Tensor) -> Pushes:
        """Local updates of this step: apply to cached copies, push the due, transient and
        evicted-dirty ones; returns what this rank received as owner."""
        slots, gone, self._slots, self._transient = self._slots, self._transient, None, None
        self.cache.commit()
        g = grad.index_select(0, plan.remote_pos)
        parts = []
        if gone is None:  # every remote row is cached (the usual case)
            parts.append(self.cache.record_and_take_due(slots, g, self.bounds.push))
        else:
            cached = torch.nonzero(slots >= 0).squeeze(1)
            parts.append(self.cache.record_and_take_due(slots.index_select(0, cached),
                                                        g.index_select(0, cached), self.bounds.push))
            parts.append(Pushes.single(plan.remote_ids.index_select(0, gone), g.index_select(0, gone)))
        evicted, self._evicted = self._evicted, None
        if evicted is not None and len(evicted):
            self.stats.add("evicted_dirty", self.sharding.table_of(evicted.gids))
            parts.append(evicted)
        return self._send(Pushes.cat(parts) if len(parts) > 1 else parts[0])

    def discard(self) -> None:
        """Undo the read: installs, evictions (their dirty updates go back into the cache),
        refreshed copies and use counts; the owners changed nothing (version checks only read)."""
        self.cache.rollback()
        self._slots, self._transient, self._evicted = None, None, None

    def flush(self) -> Pushes:
        return self._send(self.cache.take_all())

    def _send(self, pushes: Pushes) -> Pushes:
        self.stats.pushes(self.sharding.table_of(pushes.gids), pushes.counts)
        return self.wire.push_updates(pushes)
