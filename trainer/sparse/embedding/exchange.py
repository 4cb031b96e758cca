"""The no-cache wire and the lookup plan.

Why separate: "which rows do I need" (plan_lookup, from the batch and the sharding) is separated
from "fetch them" (a remote-row protocol, remote/). RowExchange is the no-cache wire over alltoall:
requests of ids -> replies of rows -> pushes of gradients in the same step (exact, BSP). It also
serves evaluation, which always reads fresh rows from the owners. The HET cache's own wire (version
checks, counted pushes) is remote/het.py.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...base.comm import Collectives
from ...base.core.device import from_host, positions, select
from .sharding import Sharding
from .store.shard import ShardStore
from .types import LookupPlan


def plan_lookup(sharding: Sharding, gids: torch.Tensor,
                hot_slot_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LookupPlan:
    """Dedup the batch's global ids and split them into replicated, owned and remote-by-owner.
    hot_slot_of(ids) -> [n] replica slot or -1, elementwise (None: nothing is replicated).

    One read-back per step: the ids are sorted once and every id gets a key (its owner, or W when
    it is replicated); the unique ids per key, a [W + 1] vector counted on the device, are the one
    thing read to the host. They are the alltoall split sizes, and they fix every size after them
    (U, owned, remote, hot), so the rest is fixed-size work: no op waits for the device, where
    torch.unique, nonzero and bincount would each wait once."""
    world, rank, dev = sharding.world, sharding.rank, gids.device
    ids, perm, first = sorted_runs(sharding, gids)
    seg = torch.cumsum(first, 0) - 1  # [N] position in uniq of each sorted id
    slot = hot_slot_of(ids) if hot_slot_of is not None else None
    key = sharding.owner(ids)
    if slot is not None:
        key = torch.where(slot >= 0, torch.full_like(key, world), key)
    per_key = torch.zeros(world + 1, dtype=torch.int64, device=dev).index_add_(0, key, first.long()).tolist()
    u = sum(per_key)
    at = positions(first, u)  # [U] first occurrence of each unique id
    uniq = ids.index_select(0, at)
    inverse = torch.empty_like(seg).scatter_(0, perm, seg)
    order = torch.argsort(key.index_select(0, at), stable=True)  # by key, then ascending id
    start = [0]
    for c in per_key:
        start.append(start[-1] + c)
    owned_pos = order[start[rank]:start[rank + 1]]
    remote_pos = torch.cat([order[:start[rank]], order[start[rank + 1]:start[world]]])
    hot_pos = order[start[world]:]
    hot_slots = slot.index_select(0, at).index_select(0, hot_pos) if slot is not None else hot_pos.clone()
    splits = per_key[:world]
    splits[rank] = 0
    return LookupPlan(uniq, inverse, owned_pos, remote_pos, splits, hot_pos, hot_slots)


def sorted_runs(sharding: Sharding, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids sorted [N] int64, the sort's permutation [N], [N] bool: the first of each run of equal
    ids). Fixed-size: the dedup both lookup plans start from (plan_lookup; the padded plan of a
    capturable step, padded.py)."""
    # ids that fit in int32 (wire_dtype's rule) sort as int32: the same order and the same
    # inverse, ~1.8x faster on the CPU; wider ones as they are (both conversions then no-ops)
    ids, perm = torch.sort(gids.to(wire_dtype(sharding.n_ids)))
    ids = ids.long()
    return ids, perm, run_starts(ids)


def run_starts(values: torch.Tensor) -> torch.Tensor:
    """[N] bool of sorted `values`: True at the first of each run of equal values (fixed-size)."""
    first = torch.ones(values.numel(), dtype=torch.bool, device=values.device)
    if values.numel() > 1:
        torch.ne(values[1:], values[:-1], out=first[1:])
    return first


class Pull:
    """A pull in flight: the id request (an alltoall handle), then the owners' row reply (in one
    part, or in two: the settled rows early, see RowExchange.serve_settled, then the rest)."""

    def __init__(self, ids, splits: list[int]) -> None:
        self.ids, self.splits = ids, splits
        self.rows = None  # the row reply's handle, once served (with an early part: the rest)
        self.served: torch.Tensor | None = None  # ids peers asked this rank (as owner) for
        self.served_splits: list[int] = []
        self.early: Early | None = None  # the settled rows, sent ahead (serve_settled)
        self.admits = True  # a training read: dynamic tables admit the ids it asks for (not eval's)

    def requests(self) -> tuple[torch.Tensor, list[int]]:
        """(ids peers asked this rank for, per-peer counts): waits for the request once."""
        if self.served is None:
            self.served, self.served_splits = self.ids.wait()
        return self.served, self.served_splits

    def wait(self) -> None:
        """Wait for everything in flight (a pull that will not be used)."""
        for h in (self.ids, self.early.handle if self.early is not None else None, self.rows):
            if h is not None:
                h.wait()


class Early:
    """The early part of a row reply: which served ids were settled (sent early) and which
    requested ids come early, with the per-peer counts of both and the rows' handle."""

    def __init__(self, sent: torch.Tensor, came: torch.Tensor, send: list[int], recv: list[int],
                 handle) -> None:
        self.sent, self.came, self.send, self.recv, self.handle = sent, came, send, recv, handle


class RowExchange:
    """Pull remote rows from their owners and push row gradients back, over alltoall.

    Every rank is both a requester and an owner in each call. A pull has three parts, so that a
    pipelined step can start the first early: request (send the ids; independent of the model),
    serve (the owner reads the rows NOW and sends them back), result (the rows arrive). pull() runs
    the three back to back.
    """

    def __init__(self, comm: Collectives, store: ShardStore, precision: str = "fp32") -> None:
        self.comm, self.store = comm, store
        # rows and gradients travel as this (comm.wire_precision) whatever the rows' own type
        # (embedding.dtype): half rows sent as fp32 arrive exact, as their own half type exact and
        # at half the bytes, as the other half type rounded to nearest; readers get fp32 rows
        self.row_dtype = wire_float(precision)

    def request(self, remote_ids: torch.Tensor, splits: list[int]) -> Pull:
        """Start sending remote_ids (grouped by owner as `splits` says) to their owners."""
        return Pull(self.comm.alltoall_async(remote_ids, splits, kind="ids"), list(splits))

    def serve_settled(self, p: Pull, touched: torch.Tensor) -> None:
        """Owner side, one step early (train.pipeline=ids): send now the requested rows that the
        current step's update leaves as they are, so they travel while the model computes.
        `touched`: the global ids this rank updates at the current step (its own rows of the
        step and the rows peers pulled from it: an owner updates exactly those). A row outside
        them holds now the value it will hold after the update, so the reply stays exact; serve()
        sends the rest after the update. The requester learns which of its ids come early from
        a one-byte flag per id (counted as ids)."""
        if p.rows is not None or p.early is not None:
            return
        served, served_splits = p.requests()
        self.store.prefetch(served)
        settled = ~torch.isin(served, touched)  # O(batch): no scratch over the shard's rows
        flags, _ = self.comm.alltoall(settled.to(torch.uint8), served_splits, kind="ids",
                                      recv_splits=p.splits)
        came = flags.bool()
        w = len(p.splits)  # one read-back: rows sent early to each peer, received from each
        counts = torch.cat([segment_counts(settled, served_splits), segment_counts(came, p.splits)]).tolist()
        send, recv = counts[:w], counts[w:]
        rows = self.store.rows(select(served, settled, sum(send))).to(self.row_dtype)
        p.early = Early(settled, came, send, recv,
                        self.comm.alltoall_async(rows, send, kind="rows", recv_splits=recv))

    def serve(self, p: Pull) -> None:
        """Owner side: read the requested rows as they are now and start sending them (after
        serve_settled: only those it did not send)."""
        if p.rows is not None:
            return
        served, served_splits = p.requests()
        if p.admits and self.store.dynamic:
            self.store.admit(served)
        self.store.prefetch(served)
        e = p.early
        if e is None:
            rows = self.store.rows(served).to(self.row_dtype)
            p.rows = self.comm.alltoall_async(rows, served_splits, kind="rows", recv_splits=p.splits)
            return
        send = [a - b for a, b in zip(served_splits, e.send)]
        recv = [a - b for a, b in zip(p.splits, e.recv)]
        rows = self.store.rows(select(served, ~e.sent, sum(send))).to(self.row_dtype)
        p.rows = self.comm.alltoall_async(rows, send, kind="rows", recv_splits=recv)

    def result(self, p: Pull) -> torch.Tensor:
        """[Ur, d] rows of the pull's ids, in the store's compute dtype (serving them first if that
        has not happened yet)."""
        self.serve(p)
        got, _ = p.rows.wait()
        e = p.early
        if e is None:
            return got.to(self.store.compute_dtype)
        early, _ = e.handle.wait()
        out = torch.empty(e.came.numel(), self.store.dim, dtype=self.store.compute_dtype, device=got.device)
        out.index_copy_(0, positions(e.came, sum(e.recv)), early.to(out.dtype))
        out.index_copy_(0, positions(~e.came, got.shape[0]), got.to(out.dtype))
        return out

    def pull(self, remote_ids: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """[Ur, d] rows of remote_ids (grouped by owner as `splits` says), now; reads only
        (evaluation: a dynamic table admits nothing)."""
        p = self.request(remote_ids, splits)
        p.admits = False
        return self.result(p)

    def push_start(self, p: Pull, grads: torch.Tensor):
        """Start sending grads [Ur, d] of pull p's ids to their owners; returns a function that
        waits for them and returns (ids, grads) received as owner: the rows peers pulled from us
        and their gradients, in the order they were served, so no ids need to travel again."""
        if p.served is None:
            raise RuntimeError("push_start() of a pull that was never served")
        handle = self.comm.alltoall_async(grads.to(self.row_dtype), p.splits, kind="grads",
                                          recv_splits=p.served_splits)
        dtype = grads.dtype
        return lambda: (p.served, handle.wait()[0].to(dtype))


WIRE_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def wire_float(precision: str) -> torch.dtype:
    """dtype of rows and row gradients on the wire (comm.wire_precision); bytes are counted as sent."""
    try:
        return WIRE_FLOATS[precision]
    except KeyError:
        raise ValueError(f"comm.wire_precision={precision!r} is not one of {sorted(WIRE_FLOATS)}") from None


def wire_dtype(local_rows: int) -> torch.dtype:
    """Integer type of ids / versions / counts on the wire: int32 while an owner's rows fit."""
    return torch.int32 if local_rows < 2 ** 31 - 1 else torch.int64


def no_cache_wire_bytes(remote, dim: int, row_elem: int, id_bytes: int = 8) -> dict:
    """Bytes of the no-cache protocol (RowExchange.pull + push) for `remote` unique remote ids:
    an int64 id request, the row reply, the row gradient push."""
    return {"ids": remote * id_bytes, "rows": remote * dim * row_elem, "grads": remote * dim * row_elem}


def segment_counts(mask: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """[len(splits)] number of True in each consecutive segment of `mask` of lengths `splits`,
    counted on mask's device (fixed size: nothing is read back; the caller reads the counts once,
    together with any others it needs)."""
    sizes = from_host(splits, mask.device)
    seg = torch.repeat_interleave(torch.arange(len(splits), device=mask.device), sizes,
                                  output_size=mask.numel())
    counts = torch.zeros(len(splits), dtype=torch.int64, device=mask.device)
    return counts.index_add_(0, seg, mask.long())
