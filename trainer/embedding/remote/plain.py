"""The no-cache protocol: every remote row is pulled and its gradient pushed in the same step (BSP)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..types import LookupPlan, Pushes
from .base import RemoteRows


class PlainRemote(RemoteRows):
    """Pull every remote row, push every row gradient, in the same step.

    exchange: the no-cache wire (exchange.RowExchange over alltoall, or the simulator's in-process
    exchange): pull(remote_ids, splits) -> rows, push(grads) -> (ids, grads) received as owner.
    """

    def __init__(self, exchange: Any) -> None:
        self.exchange = exchange

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None) -> None:
        ws.index_copy_(0, plan.remote_pos, self.exchange.pull(plan.remote_ids, plan.splits))

    def write(self, plan: LookupPlan, grad: torch.Tensor) -> Pushes:
        ids, grads = self.exchange.push(grad[plan.remote_pos])
        return Pushes.single(ids, grads)

    def discard(self) -> None:
        """Reads changed nothing; the pulled rows' gradients are simply not pushed."""
        self.exchange.forget()

    def flush(self) -> Optional[Pushes]:
        """Nothing is ever pending (and no collective runs)."""
        return None
