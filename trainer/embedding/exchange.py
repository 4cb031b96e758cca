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

from ..comm import Collectives
from .sharding import Sharding
from .store import ShardStore
from .types import LookupPlan


def plan_lookup(sharding: Sharding, gids: torch.Tensor,
                hot_slot_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LookupPlan:
    """Dedup the batch's global ids and split them into replicated, owned and remote-by-owner.
    hot_slot_of(uniq) -> [U] replica slot or -1 (None: nothing is replicated)."""
    uniq, inverse = torch.unique(gids, sorted=True, return_inverse=True)
    slot = hot_slot_of(uniq) if hot_slot_of is not None else torch.full_like(uniq, -1)
    hot = slot >= 0
    owner = sharding.owner(uniq)
    mine = sharding.owned_by(uniq) & ~hot
    owned_pos = torch.nonzero(mine).squeeze(1)
    remote_pos = torch.nonzero(~mine & ~hot).squeeze(1)
    remote_owner = owner[remote_pos]
    order = torch.argsort(remote_owner, stable=True)
    remote_pos = remote_pos[order]
    splits = sharding.per_owner(uniq[remote_pos])
    hot_pos = torch.nonzero(hot).squeeze(1)
    return LookupPlan(uniq, inverse, owned_pos, remote_pos, splits, hot_pos, slot[hot_pos])


class Pull:
    """A pull in flight: the id request (an alltoall handle), then the owners' row reply."""

    def __init__(self, ids, splits: list[int]) -> None:
        self.ids, self.splits = ids, splits
        self.rows = None  # the row reply's handle, once served
        self.served: torch.Tensor | None = None  # ids peers asked this rank (as owner) for
        self.served_splits: list[int] = []


class RowExchange:
    """Pull remote rows from their owners and push row gradients back, over alltoall.

    Every rank is both a requester and an owner in each call. A pull has three parts, so that a
    pipelined step can start the first early: request (send the ids; independent of the model),
    serve (the owner reads the rows NOW and sends them back), result (the rows arrive). pull() runs
    the three back to back.
    """

    def __init__(self, comm: Collectives, store: ShardStore, precision: str = "fp32") -> None:
        self.comm, self.store = comm, store
        self.row_dtype = wire_float(precision)  # rows and gradients travel as this; owners keep fp32

    def request(self, remote_ids: torch.Tensor, splits: list[int]) -> Pull:
        """Start sending remote_ids (grouped by owner as `splits` says) to their owners."""
        return Pull(self.comm.alltoall_async(remote_ids, splits, kind="ids"), list(splits))

    def serve(self, p: Pull) -> None:
        """Owner side: read the requested rows as they are now and start sending them."""
        if p.rows is None:
            p.served, p.served_splits = p.ids.wait()
            rows = self.store.rows(p.served).to(self.row_dtype)
            p.rows = self.comm.alltoall_async(rows, p.served_splits, kind="rows", recv_splits=p.splits)

    def result(self, p: Pull) -> torch.Tensor:
        """[Ur, d] rows of the pull's ids (serving them first if that has not happened yet)."""
        self.serve(p)
        got, _ = p.rows.wait()
        return got.to(self.store.weight.dtype)

    def pull(self, remote_ids: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """[Ur, d] rows of remote_ids (grouped by owner as `splits` says), now."""
        return self.result(self.request(remote_ids, splits))

    def push(self, p: Pull, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Send grads [Ur, d] of pull p's ids to their owners.

        Returns (ids, grads) received as owner: the rows peers pulled from us and their gradients,
        in the order they were served, so no ids need to travel again.
        """
        if p.served is None:
            raise RuntimeError("push() of a pull that was never served")
        recv, _ = self.comm.alltoall(grads.to(self.row_dtype), p.splits, kind="grads",
                                     recv_splits=p.served_splits)
        return p.served, recv.to(grads.dtype)


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


def segment_counts(mask: torch.Tensor, splits: list[int]) -> list[int]:
    """Number of True in each consecutive segment of `mask` of lengths `splits`."""
    seg = torch.repeat_interleave(torch.arange(len(splits), device=mask.device),
                                  torch.tensor(splits, dtype=torch.int64, device=mask.device))
    return torch.bincount(seg[mask], minlength=len(splits)).tolist()
