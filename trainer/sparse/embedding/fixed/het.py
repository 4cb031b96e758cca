"""FixedHet: the HET cache's protocol (remote/het.py) at fixed shapes, W > 1 (train.cuda_graph=on).

Why: the exact-size HET step (HetRemote over HetWire) sizes its version check by the batch's
remote ids, its row reply by the rows the owners decide to send, its installs by the free slots
and victims per table, its pushes by the due, transient and evicted rows: each a count read back.
Here each of those rides fixed-size blocks: the request (FixedShapes, padded.py: W blocks of C
slots, block w the batch's unique ids owner w holds, ascending: the exact step's remote ids in the
same order), P slots per block for the rows an owner sends, Q per owner for the pushes, and the
cache's bookkeeping runs masked over the request's entries (cache/masked.py).

The step, per rank (E = W x C entries; own block r and padding masked off where they are no read):
  1. the cache's slot and cached version of each remote entry (-1: no copy);
  2. one alltoall of (storage row, cached version) [E, 2]; each owner answers every entry from a
     peer (consistency.needs_row against its versions now, the staleness recorded) with a version
     ([E]: the row's where it sends it, -1 where the copy is fresh enough or the entry is none);
     then the rows it sends, in entry order, in P slots per requester (the exact step sends just
     these rows; a requester finds the k-th row of a block where its k-th needed entry is);
  3. the cache: touch the hits, refresh the stale copies, install the misses over free slots
     and victims (the dirty victims' updates kept for the push), misses with no slot transient;
     the workspace's remote rows from the cache, a transient one from the reply;
  4. the update: the cached entries record their gradient and give up the due ones (pending
     count past the push bound); one alltoall of Q entries (storage row, count, gradient) per
     owner: the due and transient rows of the request's block for that owner in entry order, then
     the dirty evictions of rows it holds; the owner sums its own rows first, then each sender's in
     rank order (one sender pushes a row at most once), and updates the summed rows masked,
     versions advanced by the counts: the exact step's sums and versions.
The blocks' sizes: at the bound (train.unique_capacity=0) P = C and Q = C + V (V = the fewer of
(W - 1) x C and the cache's slots: no step evicts more), which nothing exceeds. Otherwise P and Q
follow the traffic: the bound for the first MEASURE_STEPS steps, then, every MEASURE_STEPS steps, the
most the last window needed on any rank times train.capacity_margin (a cache's traffic changes as
it fills: the first steps miss everything), and at once after a step that overflowed.
Overflow: below the bound a block may overflow. The request's: each ids block carries its
requester's excess; the rows': each version reply carries its owner's; both known to every rank
before the cache changes, so every change of the step is masked off (no cache entry, counter,
staleness record, push or row changes). The pushes' (known once the cache has installed the step's
rows): each push block carries its sender's excess, so every owner masks its update off; the cache's
changes are undone from its journal and the step's counters restored (discard). Every rank's excess
rides the loss's read and the step is trained again in exact sizes (TrainPipeline), from the state
before it. Bytes: E ids and versions each way, P rows and Q pushes per peer (docs/gpu.md).
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

__all__ = ["HET_ENTRY_BYTES", "JOURNAL_SLOT_BYTES", "FixedHet", "HetBlocks"]

# per request entry: its gid, table, slot, cached version, served row and version, reply, count,
# due / hit / need / transient flags (8 x 8 B + 4 x 1 B, rounded)
HET_ENTRY_BYTES = 72
# per slot the cache's journal saves (journal.py): the slot, its gid, version, count, freq and
# last_use (8 B each), besides its row and pending gradient
JOURNAL_SLOT_BYTES = 48


@dataclass
class HetBlocks:
    """What a fixed-shape HET read leaves for its update ([E] each, E = W x C): each entry's cache
    slot (-1: none, or transient), transient flag and table, and the dirty evictions."""

    slots: torch.Tensor
    transient: torch.Tensor
    tables: torch.Tensor
    evicted: Evicted
    fits: torch.Tensor  # [] bool: no rank's request or row reply overflowed (else nothing changed)
    excess: torch.Tensor  # [] this rank's rows past the P slots (as owner) and pushes past the Q (as sender)


class FixedHet:
    """The HET protocol at fixed shapes for FixedShapes (see the module docstring)."""

    def __init__(self, comm: Collectives, store: ShardStore, remote: HetRemote, capacity: int,
                 most_misses: list[int], row_dtype: torch.dtype) -> None:
        self.comm, self.store, self.sharding = comm, store, store.sharding
        self.remote, self.cache = remote, remote.cache
        self.masked = MaskedCache(remote.cache, most_misses)
        self.row_dtype = row_dtype
        self.wire = wire_dtype(self.sharding.local_rows + 1)  # rows (local_rows: padding), versions, counts
        self.peaks: Optional[torch.Tensor] = None  # [2] the most rows one owner sent one requester, pushes one sender sent one owner
        self._saved: Optional[tuple] = None  # the counters before a read whose push may overflow
        self.resize(capacity)

    def resize(self, capacity: int, pull: int = 0, push: int = 0) -> None:
        """The blocks' slots (FixedShapes.resize): C request slots, P rows and Q pushes per peer
        (0: their bound, C and C + V); every size that follows from them."""
        w, r, c = self.comm.size, self.comm.rank, capacity
        self.capacity, self.splits = c, [c] * w
        dev = self.store.device
        self.block = torch.arange(w * c, device=dev) // c  # [E] the owner (requester, as owner) of each entry
        self.own = slice(r * c, (r + 1) * c)
        self.own_mask = self.block == r  # [E] the entries of its own block
        self.evicts = max(1, min((w - 1) * c, self.cache.size))  # V: a step's dirty evictions per owner
        self.pull_bound, self.push_bound = c, c + self.evicts
        self.pull_slots = min(pull or c, c)
        self.push_slots = min(push or self.push_bound, self.push_bound)
        # below a bound each block carries one entry more: its sender's excess (module docstring)
        self.pull_flagged, self.push_flagged = self.pull_slots < c, self.push_slots < self.push_bound
        self.peers = [p for p in range(w) if p != r]  # the owner's order after its own block

    def blocks(self) -> dict[str, int]:
        """summary.json's view of the reply and push blocks."""
        return {"pull_slots": self.pull_slots, "pull_bound": self.pull_bound, "push_slots": self.push_slots,
                "push_bound": self.push_bound}

    def _peak(self, pulled: torch.Tensor, pushed: torch.Tensor) -> None:
        step = torch.stack([pulled.max(), pushed.max()])
        self.peaks = step if self.peaks is None else torch.maximum(self.peaks, step)

    # ---- the read ---------------------------------------------------------------------------
    def read(self, req: PaddedRequest, step: int, flagged: bool
             ) -> tuple[torch.Tensor, HetBlocks, Optional[torch.Tensor]]:
        """(workspace rows [E, d] of the request's entries, compute dtype; the read's blocks;
        [] bool no rank's request or row reply overflowed its blocks, None where none can).
        flagged: each ids block carries its requester's excess (FixedShapes.resize); where some
        block overflowed, every rank masks the whole read and update off (nothing changes: no
        cache entry, counter, staleness record or row), and the step is trained again in exact
        sizes."""
        sh, store, cache, masked = self.sharding, self.store, self.cache, self.masked
        rows_n, r, w, c, p = sh.local_rows, self.comm.rank, self.comm.size, self.capacity, self.pull_slots
        gids = sh.global_of(req.ids.clamp(max=rows_n - 1), self.block)
        tables = sh.table_of(gids)
        if self.remote.undoable or self.push_flagged:
            cache.journal.begin()
        self._saved = None
        if self.push_flagged:  # an overflowing push block is known after the counters count the read
            st, audit = self.remote, self.remote.audit
            self._saved = (st.stats.all.clone(), st.staleness.hist.clone(), st.staleness.max.clone(),
                           len(audit.reads) if audit is not None else 0)
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
        served, ver = asked[:, 0].long(), asked[:, 1].long()
        peer = (served < rows_n) & (self.block != r) & ok  # entries peers asked this rank for
        idx = served.clamp(max=rows_n - 1)
        now, table = store.versions(idx), sh.local_table_of(idx)
        send, gap = serve_check(ver, now, self.remote.bounds.pull.index_select(0, table))
        send &= peer
        sent = send.reshape(w, c).sum(1)  # [W] rows this owner sends each requester
        past = (sent - p).clamp(min=0).sum()  # ... past their P slots
        reply = torch.where(send, now, torch.full_like(now, -1)).to(self.wire)
        rsplits = self.splits
        if self.pull_flagged:  # one more entry per block: this owner's rows past the slots
            reply = torch.cat([reply.reshape(w, c), past.to(self.wire).reshape(1, 1).expand(w, 1)], 1).reshape(-1)
            rsplits = [c + 1] * w
        got, _ = self.comm.alltoall(reply, rsplits, kind="versions", recv_splits=rsplits)
        if self.pull_flagged:
            got = got.reshape(w, c + 1)
            pull_fits = (got[:, -1] == 0).all()
            got = got[:, :-1].reshape(-1)
            fits = pull_fits if fits is None else fits & pull_fits
            ok = ok & pull_fits
        self.remote.staleness.record(gap, table, peer & ok)
        # the rows sent, in entry order, P slots per requester: slot k of block b is the entry
        # where block b's running count of sent entries reaches k + 1
        ran = torch.cumsum(send.reshape(w, c).long(), 1)
        want = torch.arange(1, p + 1, device=ran.device).expand(w, p).contiguous()
        at = torch.searchsorted(ran, want).clamp_(max=c - 1)
        stored = store.local_rows(idx.reshape(w, c).gather(1, at).reshape(-1))
        rows, _ = self.comm.alltoall(stored.to(self.row_dtype), [p] * w, kind="rows", recv_splits=[p] * w)
        versions = got.long()
        need = (versions >= 0) & ok
        # each needed entry's row: the k-th of its owner's block for the k-th needed entry there
        k = torch.cumsum(need.reshape(w, c).long(), 1) - 1
        src = k.clamp_(0, p - 1) + torch.arange(w, device=k.device).unsqueeze(1) * p
        pulled = rows.index_select(0, src.reshape(-1)).to(store.compute_dtype)
        remote = req.valid & (self.block != r) & ok
        slots = torch.where(remote, slots, -1)
        hit = slots >= 0
        masked.touch(slots, hit, step)
        masked.refresh(slots, need & hit, pulled, versions)
        miss = need & ~hit
        placed, evicted = masked.install(gids, tables, pulled, versions, miss, step)
        slots = torch.where(miss, placed, slots)
        transient = miss & (placed < 0)
        at = torch.where(slots >= 0, slots, cache.dump)
        ws = torch.where((slots >= 0).unsqueeze(1), cache.full["rows"].index_select(0, at), pulled)
        # its own rows, as the exact step: not through the wire
        ws[self.own] = store.local_rows(req.ids[self.own].clamp(max=rows_n - 1)).to(ws.dtype)
        self.remote.stats.reads(tables, hit, need, transient, remote)
        if self.remote.audit is not None:  # a test tool: it reads back (nothing where masked off)
            keep = torch.nonzero(remote).squeeze(1)
            self.remote.audit.read(step, gids[keep], torch.where(need, versions, cached)[keep])
        # the pushes this step's update will make, per owner (known now): their excess
        due = masked.due_after_record(slots, slots >= 0, self.remote.bounds.push)
        per = self._push_counts(due | transient, evicted)
        self._peak(sent, per)
        excess = past + (per - self.push_slots).clamp(min=0).sum()
        return ws, HetBlocks(slots, transient, tables, evicted, ok, excess), fits

    def _evictions(self, evicted: Evicted) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner of each dirty eviction [n], W where the entry is none; [W + 1] of them per owner,
        the last the none)."""
        w = self.comm.size
        owner = torch.where(evicted.valid, self.sharding.owner(evicted.gids.clamp(min=0)), w)
        return owner, torch.zeros(w + 1, dtype=torch.int64, device=owner.device).index_add_(0, owner, torch.ones_like(owner))

    def _push_counts(self, pushed: torch.Tensor, evicted: Evicted) -> torch.Tensor:
        """[W] the pushes to each owner: the request's pushed entries of its block, then the
        dirty evictions of rows it holds."""
        return pushed.reshape(self.comm.size, self.capacity).sum(1) + self._evictions(evicted)[1][:-1]

    def settle(self) -> None:
        """Before a step's lookup: the step before it is final (its journal and counters kept)."""
        if self.cache.journal.open:
            self.cache.journal.commit()
        self._saved = None

    def discard(self, again: bool = False) -> None:
        """A dropped step (train.nonfinite=skip) or one trained again (again: a block overflowed):
        the cache as it was before the read (the owners changed nothing: a version check only
        reads, and an overflowing step's update is masked off); a step trained again also leaves
        no count (its counters as they were before the read: the exact step counts it)."""
        if self.cache.journal.open:
            self.cache.journal.rollback()
        if again and self._saved is not None:
            st = self.remote
            st.stats.all.copy_(self._saved[0])
            st.staleness.hist.copy_(self._saved[1])
            st.staleness.max.copy_(self._saved[2])
            if st.audit is not None:
                del st.audit.reads[self._saved[3]:]

    # ---- the update ------------------------------------------------------------------------
    def push(self, req: PaddedRequest, read: HetBlocks, grad: torch.Tensor
             ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Record the gradients [E, d] of the request's entries in the cache and start the pushes;
        the function returned waits and gives what this rank receives as owner, own rows first
        then by sender: (storage row [M] (local_rows where nothing), count [M], gradient [M, d])."""
        sh, rows_n, c, q = self.sharding, self.sharding.local_rows, self.capacity, self.push_slots
        w, r = self.comm.size, self.comm.rank
        if not self.push_flagged:  # else kept open: an overflowing push block undoes the step (discard)
            self.cache.journal.commit()
        cached = read.slots >= 0
        _, pending, count, due = self.masked.record_and_take_due(read.slots, cached, grad, self.remote.bounds.push)
        gone = read.transient
        mine = self.own_mask & (req.ids < rows_n) & read.fits
        pushed = due | gone
        counts = torch.where(due, count, (gone | mine).long())
        grads = torch.where(due.unsqueeze(1), pending, torch.where((gone | mine).unsqueeze(1), grad,
                                                                   torch.zeros_like(grad)))
        stats = self.remote.stats
        stats.pushes(read.tables, counts, pushed)
        ev = read.evicted
        ev_tables = sh.table_of(ev.gids.clamp(min=0))
        stats.add("evicted_dirty", ev_tables, ev.valid)
        stats.pushes(ev_tables, ev.counts, ev.valid)
        # per owner, Q entries: its block's pushed entries in entry order, then its evictions
        dev = grad.device
        ahead = pushed.reshape(w, c).long()
        pos = torch.cumsum(ahead, 1) - 1  # [W, C] place of each pushed entry in its owner's block
        n = ahead.sum(1)  # [W]
        owner, per = self._evictions(ev)
        order = torch.argsort(owner, stable=True)
        start = torch.cumsum(per, 0) - per
        rank_ev = torch.empty_like(order)
        rank_ev[order] = torch.arange(owner.numel(), device=dev) - start.index_select(0, owner.index_select(0, order))
        ev_pos = torch.cat([n, n.new_zeros(1)]).index_select(0, owner) + rank_ev
        dump = w * q
        at_req = torch.where(pushed & (pos.reshape(-1) < q), self.block * q + pos.reshape(-1), dump)
        at_ev = torch.where(ev.valid & (ev_pos < q), owner * q + ev_pos, dump)
        at = torch.cat([at_req, at_ev])
        rows = torch.full((dump + 1,), rows_n, dtype=torch.int64, device=dev)
        rows.index_copy_(0, at, torch.cat([req.ids, torch.where(ev.valid, sh.local_index(ev.gids.clamp(min=0)), rows_n)]))
        cnt = torch.zeros(dump + 1, dtype=torch.int64, device=dev)
        cnt.index_copy_(0, at, torch.cat([torch.where(pushed, counts, 0), torch.where(ev.valid, ev.counts, 0)]))
        g = torch.zeros(dump + 1, grad.shape[1], dtype=grad.dtype, device=dev)
        g.index_copy_(0, at, torch.cat([torch.where(pushed.unsqueeze(1), grads, torch.zeros_like(grads)),
                                        ev.pending.to(grad.dtype)]))
        head = torch.stack([rows[:dump], cnt[:dump]], 1).reshape(w, q, 2)
        g = g[:dump].reshape(w, q, -1)
        m = q
        if self.push_flagged:  # one more entry per block: this sender's pushes past the slots
            past = (n + per[:w] - q).clamp(min=0).sum()
            flag = torch.stack([past, torch.zeros_like(past)]).reshape(1, 1, 2).expand(w, 1, 2)
            head = torch.cat([head, flag], 1)
            g = torch.cat([g, g.new_zeros(w, 1, g.shape[2])], 1)
            m = q + 1
        packed = _pack_rows([head.reshape(-1, 2).to(self.wire), g.reshape(w * m, -1).to(self.row_dtype)])
        width = 2 * self.wire.itemsize
        kind = {"ids": width // 2, "versions": width // 2, "grads": packed.shape[1] - width}
        handle = self.comm.alltoall_async(packed, [m] * w, kind=kind, recv_splits=[m] * w)
        own_ids, own_counts, own_grads = req.ids[self.own], mine[self.own].long(), grads[self.own]

        def finish() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            got = handle.wait()[0]
            head = _unpack_rows(got, 0, width, self.wire).long().reshape(w, m, 2)
            recv = _unpack_rows(got, width, got.shape[1] - width, self.row_dtype).to(grad.dtype).reshape(w, m, -1)
            peers = self.peers
            # its own rows as they are (not through the wire), then each sender's in rank order
            idx = torch.cat([own_ids, head[peers, :q, 0].reshape(-1)])
            counts = torch.cat([own_counts, head[peers, :q, 1].reshape(-1)])
            grads = torch.cat([own_grads, recv[peers, :q].reshape(-1, recv.shape[2])])
            keep = counts > 0
            if self.push_flagged:  # an overflowing push block on any rank: no row changes
                keep &= (head[:, q, 0] == 0).all()
            return torch.where(keep, idx, rows_n), counts, grads
        return finish
