"""HET: a per-worker cache of remote rows with per-row version clocks and bounded staleness.

This file holds the whole HET protocol: the worker side (HetRemote, driving the RowCache of
cache.py with the two rules of consistency.py) and its wire (HetWire, over alltoall), plus the
byte formula of that wire. The simulator (trainer/sparse/sim/) drives the same HetRemote through an
in-process exchange that implements HetWire's two calls on one owner-version array.

The wire, per step:
- check: the worker sends (id, cached version) for every remote id (version -1: no copy); the owner
  answers every id with its current version when it sends the row (no copy, or the copy is more
  than the pull bound behind: consistency.needs_row) or -1 ("still fresh"); then only those rows
  travel. The owner records the staleness of the reads it let through.
- push_updates_start: (id, update count, summed gradient) for whichever rows the cache decided to
  push (consistency.push_due, evictions, transient rows, the flush), all three in one message per
  owner (one alltoall; each part's bytes are still counted under its own kind). Dynamic tables:
  the count's high 32 bits carry the life the updates were made in (consistency.py, "Lives"; a
  count is < 2^32), so the owner drops a held-back push of an id's earlier life.
On the wire an id is its owner's storage row (Sharding.local_index), as int32 whenever the shard
allows (exchange.wire_dtype), like the versions and counts. Dynamic tables (embedding/dynamic.py)
have no storage row per id: the id travels as its gid, int64 like the versions (which carry the
row's admission step), and the owner answers from its pool (DynamicStore.check_versions).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from ....base.comm import Collectives
from ....base.core.device import positions, select
from ..cache.rows import RowCache
from ..cache.consistency import ABSENT, LIFE_SHIFT, Bounds, life_of, needs_row
from ..exchange import segment_counts, wire_dtype, wire_float
from ..sharding import Sharding
from ..store.shard import ShardStore
from ..types import LookupPlan, Pushes
from .base import Audit, CacheStats, RemoteRows, StalenessStats


def serve_check(cached_version: torch.Tensor, owner_version: torch.Tensor,
                pull_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's answer to a version check: (send [n] bool, staleness [n] of each read: 0 where the
    row is sent, owner - cached where the worker's copy is used)."""
    send = needs_row(cached_version, owner_version, pull_bound)
    return send, torch.where(send, torch.zeros_like(owner_version), owner_version - cached_version)


class Check:
    """A version check in flight (see HetWire.request / serve / result)."""

    def __init__(self, request: Any, splits: list[int], pull_bound: torch.Tensor,
                 counts: Optional[torch.Tensor] = None) -> None:
        self.request, self.splits, self.pull_bound = request, splits, pull_bound
        self.rows: Any = None  # the row reply's handle, once served
        self.need: Optional[torch.Tensor] = None
        self.versions: Optional[torch.Tensor] = None
        self.counts = counts  # the requester's own device counts, read back with the split sizes
        self.counted: Optional[list[int]] = None  # ... their values, once served


class Announced:
    """Push sizes sent ahead (HetWire.announce): per owner, and the exchange's handle."""

    def __init__(self, splits: list[int], handle: Any) -> None:
        self.splits, self.handle = splits, handle


class HetRead:
    """A begun HET read: the slots and cached versions its request was sent with."""

    def __init__(self, slots: torch.Tensor, cached: torch.Tensor, check: Any) -> None:
        self.slots, self.cached, self.check = slots, cached, check


class HetStep:
    """What a HET read leaves for the step's write (or discard): the cache slot of each remote id
    (-1: transient), the positions of the transient ids (None: none), the dirty rows evicted to make
    room, and the push sizes sent ahead with how many of the cached rows are due."""

    def __init__(self, slots: torch.Tensor, transient: Optional[torch.Tensor], evicted: Optional[Pushes]) -> None:
        self.slots, self.transient, self.evicted = slots, transient, evicted
        self.announced: Any = None  # this step's push sizes, sent ahead (HetWire.announce)
        self.due: Optional[int] = None  # ... and how many of its cached rows are due
        self.transient_lives: Optional[torch.Tensor] = None  # the life each transient row was read in


class VersionWire(Protocol):
    """What HetRemote calls on its wire: HetWire (training, over alltoall) or the simulator's
    InProcessHetWire. A check is the wire's own token (request -> serve -> result, or cancel)."""

    staleness: Optional[StalenessStats]  # owner side: the staleness of the reads it let through
    dynamic: bool  # ids are gids of dynamic tables (versions carry an admission step)
    # push sizes sent ahead (HetWire.announce); None: the wire sends none (the remote computes none)
    announce: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], Optional["Announced"]]]

    def request(self, remote_ids: torch.Tensor, cached_versions: torch.Tensor, splits: list[int],
                pull_bound: torch.Tensor, counts: Optional[torch.Tensor] = None) -> Any: ...

    def serve(self, check: Any) -> None: ...

    def cancel(self, check: Any) -> None: ...

    def result(self, check: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def push_updates_start(self, pushes: Pushes, announced: Optional["Announced"] = None) -> Callable[[], Pushes]: ...


class HetWire:
    """HET's two collective calls over alltoall; every rank is requester and owner in each call."""

    def __init__(self, comm: Collectives, store: ShardStore, precision: str = "fp32") -> None:
        self.comm, self.store, self.sh = comm, store, store.sharding
        self.dynamic = store.dynamic  # ids travel as gids, versions carry an admission step
        self.row_dtype = wire_float(precision)  # rows and gradients on the wire (exchange.RowExchange)
        self.staleness = StalenessStats(self.sh.num_tables, store.device)

    @property
    def wire_dtype(self) -> torch.dtype:
        """Integer type of ids (owner storage rows), versions and counts on the wire."""
        return torch.int64 if self.dynamic else wire_dtype(self.sh.local_rows)

    def _wire_ids(self, gids: torch.Tensor) -> torch.Tensor:
        """What identifies gids on the wire: the owner's storage row, or the gid itself (dynamic)."""
        return gids if self.dynamic else self.sh.local_index(gids)

    @property
    def row_elem(self) -> int:
        """Bytes of one row element on the wire."""
        return torch.empty(0, dtype=self.row_dtype).element_size()

    def request(self, remote_ids: torch.Tensor, cached_versions: torch.Tensor, splits: list[int],
                pull_bound: torch.Tensor, counts: Optional[torch.Tensor] = None) -> "Check":
        """Start sending (storage row, cached version) of remote_ids [Ur] (grouped by owner as
        `splits`; cached_versions -1 = no copy) to their owners; pull_bound [T] per table.
        counts: an int64 vector of the requester's that serve() reads back together with the
        row counts (Check.counted), so it costs no read of its own."""
        req = torch.stack([self._wire_ids(remote_ids), cached_versions], 1).to(self.wire_dtype)
        handle = self.comm.alltoall_async(req, splits, kind={"ids": 1, "versions": 1})
        return Check(handle, list(splits), pull_bound, counts)

    def serve(self, chk: "Check") -> None:
        """Owner side: answer a check from the versions and rows as they are NOW, and start
        sending the rows that must be re-read (the version reply itself is waited for: the
        requester needs it to know how many rows come)."""
        if chk.rows is not None:
            return
        served, served_splits = chk.request.wait()
        idx, ver = served[:, 0].long(), served[:, 1].long()
        if self.dynamic:  # a training read: the owner admits first (idx are gids)
            now, table = self.store.check_versions(idx)
        else:
            self.store.prefetch_local(idx)  # embedding.store=disk: their versions and rows
            self.store.ready()
            now, table = self.store.versions(idx), self.sh.local_table_of(idx)
        send, gap = serve_check(ver, now, chk.pull_bound[table])  # bounds live on the store's device
        self.staleness.record(gap, table)
        reply = torch.where(send, now, torch.full_like(now, -1)).to(self.wire_dtype)
        got, _ = self.comm.alltoall(reply, served_splits, kind="versions", recv_splits=chk.splits)
        chk.versions = got.long()
        chk.need = chk.versions >= 0
        # one read-back: the rows this rank sends to each requester and receives from each owner
        w = len(served_splits)
        parts = [segment_counts(send, served_splits), segment_counts(chk.need, chk.splits)]
        counts = torch.cat(parts + ([chk.counts] if chk.counts is not None else [])).tolist()
        send_splits, recv_splits, chk.counted = counts[:w], counts[w:2 * w], counts[2 * w:]
        sent = select(idx, send, sum(send_splits))
        rows = self.store.rows(sent) if self.dynamic else self.store.local_rows(sent)
        chk.rows = self.comm.alltoall_async(rows.to(self.row_dtype), send_splits, kind="rows",
                                            recv_splits=recv_splits)

    def result(self, chk: "Check") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(need [Ur] bool, versions [Ur]: the owner version of each row sent, -1 elsewhere,
        rows [need.sum(), d] in the order of `need`), serving the check first if needed."""
        self.serve(chk)
        rows, _ = chk.rows.wait()
        return chk.need, chk.versions, rows.to(self.store.compute_dtype)  # the cache's rows: fp32

    def check(self, remote_ids: torch.Tensor, cached_versions: torch.Tensor, splits: list[int],
              pull_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Version check + pull of the rows that must be re-read, now (request, serve, result)."""
        return self.result(self.request(remote_ids, cached_versions, splits, pull_bound))

    def cancel(self, chk: "Check") -> None:
        chk.request.wait()

    def announce(self, gids: torch.Tensor, weights: Optional[torch.Tensor] = None) -> Optional["Announced"]:
        """Start telling the owners how many rows the coming push_updates sends each (`gids`: the
        rows it will push, in any order; weights: 1 for those it pushes, 0 for those it does
        not), so that push needs no size exchange in front of its rows: the exchange completes
        during the forward and backward passes. None where it would not help (one rank; a
        backend whose alltoall negotiates sizes itself)."""
        if self.comm.size == 1 or self.comm.learns_splits:
            return None
        splits = self.sh.per_owner(gids, weights)
        return Announced(splits, self.comm.exchange_splits_async(splits))

    def push_updates(self, pushes: Pushes, announced: Optional["Announced"] = None) -> Pushes:
        """push_updates_start, waited for at once."""
        return self.push_updates_start(pushes, announced)()

    def push_updates_start(self, pushes: Pushes,
                           announced: Optional["Announced"] = None) -> Callable[[], Pushes]:
        """Start sending (id, count, gradient) of pushed rows to their owners; the returned
        function waits and returns what this rank received as owner (global ids, gradients,
        counts), not yet applied. `announced`: the sizes sent ahead by announce() for exactly
        these rows.

        One alltoall: each row travels as the bytes of its (id, count) in the wire's integer type
        followed by those of its gradient; the bytes are counted per column under their kinds
        (ids, versions, grads), exactly as if they went in separate messages."""
        sh = self.sh
        gids, grads, counts = pushes.gids, pushes.grads, pushes.counts
        if self.dynamic and pushes.lives is not None:  # (life, count) in one int64: count < 2^32
            counts = (pushes.lives << LIFE_SHIFT) | counts
        order = torch.argsort(sh.owner(gids), stable=True)  # group by owner (no host read to test it)
        gids, grads, counts = gids[order], grads[order], counts[order]
        head = torch.stack([self._wire_ids(gids), counts], 1).to(self.wire_dtype)
        packed = _pack_rows([head, grads.to(self.row_dtype)])
        w = 2 * head.element_size()  # bytes of (id, count)
        kind = {"ids": w // 2, "versions": w // 2, "grads": packed.shape[1] - w}
        if announced is None:
            handle = self.comm.alltoall_async(packed, sh.per_owner(gids), kind=kind)
        else:
            recv = announced.handle.wait()
            if sum(announced.splits) != gids.numel():
                raise RuntimeError(f"HET push: {gids.numel()} rows, but {sum(announced.splits)} "
                                   "were announced to the owners")
            handle = self.comm.alltoall_async(packed, announced.splits, kind=kind, recv_splits=recv)

        def finish() -> Pushes:
            got, _ = handle.wait()
            head = _unpack_rows(got, 0, w, self.wire_dtype).long()
            recv = _unpack_rows(got, w, got.shape[1] - w, self.row_dtype).to(grads.dtype)
            if not self.dynamic:
                return Pushes(sh.global_of(head[:, 0], sh.rank), recv, head[:, 1])
            return Pushes(head[:, 0], recv, head[:, 1] & ABSENT, head[:, 1] >> LIFE_SHIFT)
        return finish


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
    size = dtype.itemsize
    if (buf.storage_offset() + at) % size or buf.stride(0) % size:
        cols = torch.empty(cols.shape, dtype=torch.uint8, device=buf.device).copy_(cols)
    return cols.view(dtype)


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

    wire: a VersionWire: HetWire (training) or the simulator's in-process exchange.
    """

    def __init__(self, wire: VersionWire, sharding: Sharding, cache: RowCache, bounds: Bounds,
                 stats: CacheStats, audit: Optional[Audit] = None) -> None:
        self.wire, self.sharding, self.cache = wire, sharding, cache
        self.bounds = bounds.to(cache.rows.device)  # indexed by device tables every step: moved once
        self.stats, self.audit = stats, audit
        self.staleness = wire.staleness
        self.undoable = False  # train.nonfinite=skip: journal each read so discard() can undo it

    def enable_undo(self) -> None:
        self.undoable = True

    def begin(self, plan: LookupPlan) -> HetRead:
        """Look the remote ids up in the cache and start the version check. Valid until read: in
        between, the cache's slots and versions change only through read (write records updates,
        flush takes them) or a rollback (then cancel and begin again)."""
        slots = self.cache.lookup(plan.remote_ids)
        cached = self.cache.versions_of(slots)
        misses = (slots < 0).sum().reshape(1)  # read back with the row counts (Check.counted)
        return HetRead(slots, cached, self.wire.request(plan.remote_ids, cached, plan.splits,
                                                        self.bounds.pull, misses))

    def serve(self, token: HetRead) -> None:
        self.wire.serve(token.check)

    def cancel(self, token: HetRead) -> None:
        self.wire.cancel(token.check)

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None,
             token: Optional[HetRead] = None) -> HetStep:
        """Fill ws's remote positions from the cache, checking versions with the owners."""
        cache, remote = self.cache, plan.remote_ids
        if self.undoable:
            cache.journal.begin()
        token = token if token is not None else self.begin(plan)
        table = self.sharding.table_of(remote)
        slots, cached_ver = token.slots, token.cached
        hit = slots >= 0
        need, versions, rows = self.wire.result(token.check)
        # every selection below has a size the host knows: no read of its own (on a GPU each
        # would wait for the device). Rows pulled: the row alltoall's size; misses: counted at
        # begin() and read back with it (a wire without that read counts them here)
        counted = getattr(token.check, "counted", None)
        n_miss = counted[0] if counted else int((slots < 0).sum())
        n_pulled = rows.shape[0]  # every miss is pulled, and the stale cached copies
        cache.touch(slots.index_select(0, positions(hit, slots.numel() - n_miss)), step)
        pulled = positions(need, n_pulled)  # position of each of `rows` among the remote ids
        pulled_slot = slots.index_select(0, pulled)
        was_cached = pulled_slot >= 0
        stale = positions(was_cached, n_pulled - n_miss)  # cached copies too far behind: re-read
        stale_slots = pulled_slot.index_select(0, stale)
        dropped = cache.refresh(stale_slots, rows.index_select(0, stale),
                                versions.index_select(0, pulled.index_select(0, stale)))
        if self.wire.dynamic:  # updates of an id's earlier life, dropped with the old copy
            self.stats.add("old_life_updates", cache.slot_table.index_select(0, stale_slots), dropped)
        fetched = positions(~was_cached, n_miss)  # misses
        miss = pulled.index_select(0, fetched)
        new_slots, evicted, placed = cache.install_counted(
            remote.index_select(0, miss), table.index_select(0, miss), rows.index_select(0, fetched),
            versions.index_select(0, miss), step)
        slots.index_copy_(0, miss, new_slots)
        gone = positions(new_slots < 0, n_miss - placed)  # transient: used from the pulled rows
        transient = miss.index_select(0, gone) if gone.numel() else None
        if transient is None:
            ws.index_copy_(0, plan.remote_pos, cache.rows.index_select(0, slots))
        else:
            if cache.size:
                ws.index_copy_(0, plan.remote_pos, cache.rows.index_select(0, slots.clamp(min=0)))
            ws.index_copy_(0, plan.remote_pos.index_select(0, transient),
                           rows.index_select(0, fetched.index_select(0, gone)))
        self.stats.reads(table, hit, need, None if transient is None else slots < 0)
        if self.audit is not None:
            self.audit.read(step, remote, torch.where(need, versions, cached_ver))
        out = HetStep(slots, transient, evicted)
        if transient is not None:  # pushed at once, tagged with the life they were read in
            out.transient_lives = life_of(versions.index_select(0, transient))
        self._announce(remote, out)
        return out

    def _announce(self, remote: torch.Tensor, st: HetStep) -> None:
        """Which rows this step's write will push is known now (the counts of the cached rows,
        the transient ones, the dirty evictions), only their gradients are not: send the sizes
        ahead so the push does not wait for a size exchange (HetWire.announce)."""
        announce = self.wire.announce
        if announce is None:
            return
        slots, gone = st.slots, st.transient
        cached = slots if gone is None else select(slots, slots >= 0, slots.numel() - gone.numel())
        due = self.cache.due_after_update(cached, self.bounds.push)
        # every candidate row, weighted 1 where it is pushed: counted per owner in one read
        parts, weights = [self.cache.gid.index_select(0, cached)], [due.long()]
        extra = ([remote.index_select(0, gone)] if gone is not None else []) + \
            ([st.evicted.gids] if st.evicted is not None and len(st.evicted) else [])
        for g in extra:
            parts.append(g)
            weights.append(torch.ones_like(g))
        st.announced = announce(torch.cat(parts), torch.cat(weights))
        if st.announced is not None:  # the due rows among the cached: the write's selection size
            st.due = sum(st.announced.splits) - sum(int(g.numel()) for g in extra)

    def write_start(self, plan: LookupPlan, grad: torch.Tensor, read: HetStep) -> Callable[[], Pushes]:
        """Local updates of this step: apply to cached copies, push the due, transient and
        evicted-dirty ones; the returned function gives what this rank received as owner."""
        slots, gone, due = read.slots, read.transient, read.due
        self.cache.journal.commit()
        g = grad.index_select(0, plan.remote_pos)
        parts = []
        if gone is None:  # every remote row is cached (the usual case)
            parts.append(self.cache.record_and_take_due(slots, g, self.bounds.push, due))
        else:
            cached = positions(slots >= 0, slots.numel() - gone.numel())
            parts.append(self.cache.record_and_take_due(slots.index_select(0, cached),
                                                        g.index_select(0, cached), self.bounds.push, due))
            parts.append(Pushes.single(plan.remote_ids.index_select(0, gone), g.index_select(0, gone),
                                       read.transient_lives))
        evicted = read.evicted
        if evicted is not None and len(evicted):
            self.stats.add("evicted_dirty", self.sharding.table_of(evicted.gids))
            parts.append(evicted)
        return self._send(Pushes.cat(parts) if len(parts) > 1 else parts[0], read.announced)

    def discard(self, read: HetStep) -> None:
        """Undo the read: installs, evictions (their dirty updates go back into the cache),
        refreshed copies and use counts; the owners changed nothing (version checks only read).
        The push sizes sent ahead are received and dropped (every rank discards the same step)."""
        self.cache.journal.rollback()
        if read.announced is not None:
            read.announced.handle.wait()

    def flush(self) -> Pushes:
        return self._send(self.cache.take_all())()

    def _send(self, pushes: Pushes, announced: Any = None) -> Callable[[], Pushes]:
        self.stats.pushes(self.sharding.table_of(pushes.gids), pushes.counts)
        return self.wire.push_updates_start(pushes, announced)
