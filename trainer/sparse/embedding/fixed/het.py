"""FixedHet: the HET cache's protocol (remote/het.py) at fixed shapes, W > 1 (train.cuda_graph=on).

Why: the exact-size HET step (HetRemote over HetWire) sizes its version check by the batch's
remote ids, its row reply by the rows the owners decide to send, its installs by the free slots
and victims per table, its pushes by the due, transient and evicted rows: each a count read back.
Here each of those rides the fixed-shape request (FixedShapes, padded.py: W blocks of C slots, block
w the batch's unique ids owner w holds, ascending: the exact step's remote ids in the same order)
and the cache's bookkeeping runs masked over the request's entries (cache/masked.py).

The step, per rank (E = W x C entries; own block r and padding masked off where they are no read):
  1. the cache's slot and cached version of each remote entry (-1: no copy);
  2. one alltoall of (storage row, cached version) [E, 2]; each owner answers every entry from a
     peer (consistency.needs_row against its versions now, the staleness recorded) with a version
     ([E]: the row's where it sends it, -1 where the copy is fresh enough or the entry is none) and
     a row ([E, d]: every entry's, as the plain padded step; the requester uses the sent ones);
  3. the cache: touch the hits, refresh the stale copies, install the misses over free slots
     and victims (the dirty victims' updates kept for the push), misses with no slot transient;
     the workspace's remote rows from the cache, a transient one from the reply;
  4. the update: the cached entries record their gradient and give up the due ones (pending
     count past the push bound); one alltoall per owner of [C + V] entries (storage row, count,
     gradient): the request's C entries (a due or transient row, count 0 where nothing is pushed)
     and V entries for the dirty evictions of rows that owner holds (V = the fewer of (W - 1) x C
     and the cache's slots: no step evicts more); the owner sums its own rows first, then each
     sender's in rank order (one sender pushes a row at most once), and updates the summed rows
     masked, versions advanced by the counts: the exact step's sums and versions.
Below the bound (train.unique_capacity, measured by default) a request may overflow its blocks:
each block then carries its requester's excess, so every rank knows from the version check's
alltoall whether any rank overflowed, and masks every change of the step off (no cache entry,
counter, staleness record, push or row changes); the step is trained again in exact sizes
(TrainPipeline), from the state before it. Bytes: the wire carries E entries each way where the exact
step carries the remote ids, the rows it pulls and the rows it pushes (docs/gpu.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ....base.comm import Collectives
from ..cache.masked import Evicted, MaskedCache
from ..exchange import wire_dtype
from ..remote.het import HetRemote, _pack_rows, _unpack_rows, serve_check
from ..store.shard import ShardStore
from .padded import PaddedRequest

__all__ = ["HET_ENTRY_BYTES", "FixedHet", "HetBlocks"]

# per request entry: its gid, table, slot, cached version, served row and version, reply, count,
# due / hit / need / transient flags (8 x 8 B + 4 x 1 B, rounded)
HET_ENTRY_BYTES = 72


@dataclass
class HetBlocks:
    """What a fixed-shape HET read leaves for its update ([E] each, E = W x C): each entry's cache
    slot (-1: none, or transient), transient flag and table, and the dirty evictions."""

    slots: torch.Tensor
    transient: torch.Tensor
    tables: torch.Tensor
    evicted: Evicted
    fits: torch.Tensor  # [] bool: no rank's request overflowed (else nothing is pushed or applied)


class FixedHet:
    """The HET protocol at fixed shapes for FixedShapes (see the module docstring)."""

    def __init__(self, comm: Collectives, store: ShardStore, remote: HetRemote, capacity: int,
                 most_misses: list[int], row_dtype: torch.dtype) -> None:
        self.comm, self.store, self.sharding = comm, store, store.sharding
        self.remote, self.cache = remote, remote.cache
        self.masked = MaskedCache(remote.cache, most_misses)
        self.row_dtype = row_dtype
        self.wire = wire_dtype(self.sharding.local_rows + 1)  # rows (local_rows: padding), versions, counts
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """The blocks' slots (FixedShapes.resize): every size that follows from them."""
        w, r, c = self.comm.size, self.comm.rank, capacity
        self.capacity, self.splits = c, [c] * w
        dev = self.store.device
        self.block = torch.arange(w * c, device=dev) // c  # [E] the owner (requester, as owner) of each entry
        self.own = slice(r * c, (r + 1) * c)
        self.own_mask = self.block == r  # [E] the entries of its own block
        self.evicts = max(1, min((w - 1) * c, self.cache.size))  # V: a step's dirty evictions per owner
        self.push_splits = [c + self.evicts] * w
        m = c + self.evicts
        blocks = [r] + [p for p in range(w) if p != r]  # the owner's order: its own block, then by rank
        self.order = torch.cat([torch.arange(b * m, (b + 1) * m) for b in blocks]).to(dev)

    # ---- the read ---------------------------------------------------------------------------
    def read(self, req: PaddedRequest, step: int, flagged: bool
             ) -> tuple[torch.Tensor, HetBlocks, Optional[torch.Tensor]]:
        """(workspace rows [E, d] of the request's entries, compute dtype; the read's blocks;
        [] bool no rank's request overflowed its blocks, None where none can). flagged: each
        block carries its requester's excess (FixedShapes.resize); where some rank's overflowed,
        every rank masks the whole read and update off (nothing changes: no cache entry, counter,
        staleness record or row), and the step is trained again in exact sizes."""
        sh, store, cache, masked = self.sharding, self.store, self.cache, self.masked
        rows_n, r, w, c = sh.local_rows, self.comm.rank, self.comm.size, self.capacity
        gids = sh.global_of(req.ids.clamp(max=rows_n - 1), self.block)
        tables = sh.table_of(gids)
        if self.remote.undoable:
            cache.journal.begin()
        slots = masked.lookup(gids, req.valid & (self.block != r))
        cached = cache.versions_of(slots)
        # the version check: (storage row, cached version) of every entry, to its owner
        ask = torch.stack([req.ids, cached], 1).to(self.wire)
        splits = self.splits
        if flagged:  # one more entry per block: (the requester's excess, 0)
            flag = torch.stack([req.excess, torch.zeros_like(req.excess)]).to(self.wire)
            ask = torch.cat([ask.reshape(w, c, 2), flag.reshape(1, 1, 2).expand(w, 1, 2)], 1).reshape(-1, 2)
            splits = [c + 1] * w
        asked, _ = self.comm.alltoall(ask, splits, kind={"ids": 1, "versions": 1}, recv_splits=splits)
        fits = None
        if flagged:
            asked = asked.reshape(w, c + 1, 2)
            fits = (asked[:, -1, 0] == 0).all()
            asked = asked[:, :-1].reshape(-1, 2)
        ok = torch.ones((), dtype=torch.bool, device=req.ids.device) if fits is None else fits
        remote = req.valid & (self.block != r) & ok
        slots = torch.where(remote, slots, -1)
        served, ver = asked[:, 0].long(), asked[:, 1].long()
        peer = (served < rows_n) & (self.block != r) & ok  # entries peers asked this rank for
        idx = served.clamp(max=rows_n - 1)
        now, table = store.versions(idx), sh.local_table_of(idx)
        send, gap = serve_check(ver, now, self.remote.bounds.pull.index_select(0, table))
        send &= peer
        self.remote.staleness.record(gap, table, peer)
        reply = torch.where(send, now, torch.full_like(now, -1)).to(self.wire)
        got, _ = self.comm.alltoall(reply, self.splits, kind="versions", recv_splits=self.splits)
        stored = store.local_rows(idx)
        pulled, _ = self.comm.alltoall(stored.to(self.row_dtype), self.splits, kind="rows", recv_splits=self.splits)
        pulled = pulled.to(store.compute_dtype)
        versions = got.long()
        need = versions >= 0
        hit = slots >= 0
        masked.touch(slots, hit, step)
        masked.refresh(slots, need & hit, pulled, versions)
        miss = need & ~hit
        placed, evicted = masked.install(gids, tables, pulled, versions, miss, step)
        slots = torch.where(miss, placed, slots)
        transient = miss & (placed < 0)
        at = torch.where(slots >= 0, slots, cache.dump)
        ws = torch.where((slots >= 0).unsqueeze(1), cache.full["rows"].index_select(0, at), pulled)
        ws[self.own] = stored[self.own].to(ws.dtype)  # its own rows, as the exact step: not through the wire
        self.remote.stats.reads(tables, hit, need, transient, remote)
        if self.remote.audit is not None:  # a test tool: it reads back (nothing where masked off)
            keep = torch.nonzero(remote).squeeze(1)
            self.remote.audit.read(step, gids[keep], torch.where(need, versions, cached)[keep])
        return ws, HetBlocks(slots, transient, tables, evicted, ok), fits

    def discard(self) -> None:
        """A dropped step (train.nonfinite=skip): the cache as it was before the read (the owners
        changed nothing: a version check only reads)."""
        self.cache.journal.rollback()

    # ---- the update ------------------------------------------------------------------------
    def push(self, req: PaddedRequest, read: HetBlocks, grad: torch.Tensor
             ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Record the gradients [E, d] of the request's entries in the cache and start the pushes;
        the function returned waits and gives what this rank receives as owner, own rows first
        then by sender: (storage row [M] (local_rows where nothing), count [M], gradient [M, d])."""
        sh, rows_n, c, v = self.sharding, self.sharding.local_rows, self.capacity, self.evicts
        w = self.comm.size
        self.cache.journal.commit()
        cached = read.slots >= 0
        _, pending, count, due = self.masked.record_and_take_due(read.slots, cached, grad, self.remote.bounds.push)
        gone = read.transient
        mine = self.own_mask & (req.ids < rows_n) & read.fits
        counts = torch.where(due, count, (gone | mine).long())
        grads = torch.where(due.unsqueeze(1), pending, torch.where((gone | mine).unsqueeze(1), grad,
                                                                   torch.zeros_like(grad)))
        pushed = due | gone
        stats = self.remote.stats
        stats.pushes(read.tables, counts, pushed)
        ev = read.evicted
        ev_tables = sh.table_of(ev.gids.clamp(min=0))
        stats.add("evicted_dirty", ev_tables, ev.valid)
        stats.pushes(ev_tables, ev.counts, ev.valid)
        # the evictions into V entries per owner, in their order (stable by owner)
        owner = torch.where(ev.valid, sh.owner(ev.gids.clamp(min=0)), w)
        per = torch.zeros(w + 1, dtype=torch.int64, device=owner.device).index_add_(0, owner, torch.ones_like(owner))
        order = torch.argsort(owner, stable=True)
        start = torch.cumsum(per, 0) - per
        pos = torch.empty_like(order)
        pos[order] = torch.arange(owner.numel(), device=owner.device) - start.index_select(0, owner.index_select(0, order))
        at = torch.where(ev.valid, owner * v + pos.clamp(max=v - 1), w * v)
        e_rows = torch.full((w * v + 1,), rows_n, dtype=torch.int64, device=owner.device)
        e_rows.index_copy_(0, at, torch.where(ev.valid, sh.local_index(ev.gids.clamp(min=0)), rows_n))
        e_counts = torch.zeros(w * v + 1, dtype=torch.int64, device=owner.device)
        e_counts.index_copy_(0, at, torch.where(ev.valid, ev.counts, 0))
        e_grads = torch.zeros(w * v + 1, grad.shape[1], dtype=grad.dtype, device=grad.device)
        e_grads.index_copy_(0, at, ev.pending)
        # per owner: its C request entries, then its V evictions
        rows = torch.cat([req.ids.reshape(w, c), e_rows[:-1].reshape(w, v)], 1).reshape(-1)
        cnt = torch.cat([counts.reshape(w, c), e_counts[:-1].reshape(w, v)], 1).reshape(-1)
        g = torch.cat([grads.reshape(w, c, -1), e_grads[:-1].reshape(w, v, -1)], 1).reshape(w * (c + v), -1)
        head = torch.stack([rows, cnt], 1).to(self.wire)
        packed = _pack_rows([head, g.to(self.row_dtype)])
        width = 2 * head.element_size()
        kind = {"ids": width // 2, "versions": width // 2, "grads": packed.shape[1] - width}
        handle = self.comm.alltoall_async(packed, self.push_splits, kind=kind, recv_splits=self.push_splits)
        m = c + v
        r = self.comm.rank

        def finish() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            got = handle.wait()[0]
            head = _unpack_rows(got, 0, width, self.wire).long()
            recv = _unpack_rows(got, width, got.shape[1] - width, self.row_dtype).to(grad.dtype)
            # its own rows as they are (not through the wire), as the exact step
            recv[r * m:r * m + c] = grads[self.own]
            idx = torch.where(head[:, 1] > 0, head[:, 0], rows_n).index_select(0, self.order)
            return idx, head[:, 1].index_select(0, self.order), recv.index_select(0, self.order)
        return finish
