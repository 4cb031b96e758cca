"""The no-cache protocol: every remote row is pulled and its gradient pushed in the same step (BSP)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..types import LookupPlan, Pushes
from .base import RemoteRows


class PlainRemote(RemoteRows):
    """Pull every remote row, push every row gradient, in the same step.

    exchange: the no-cache wire (exchange.RowExchange over alltoall, or the simulator's in-process
    exchange): request / serve / result of a pull, push(pull, grads) -> (ids, grads) received as owner.
    """

    def __init__(self, exchange: Any) -> None:
        self.exchange = exchange

    def begin(self, plan: LookupPlan) -> Any:
        return self.exchange.request(plan.remote_ids, plan.splits)

    def serve(self, token: Any) -> None:
        self.exchange.serve(token)

    def serve_settled(self, token: Any, owned: torch.Tensor, read: Any) -> None:
        """The rows of the next step's read that this step's update leaves alone travel now: this
        rank updates its own rows of the step (`owned`) and the rows peers pulled from it (`read`:
        this step's pull)."""
        touched = owned if read is None or read.served is None else torch.cat([owned, read.served])
        self.exchange.serve_settled(token, touched)

    def cancel(self, token: Any) -> None:
        token.wait()

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None, token: Any = None) -> Any:
        """Returns the pull: its gradients go back the way its rows came."""
        pull = token if token is not None else self.begin(plan)
        ws.index_copy_(0, plan.remote_pos, self.exchange.result(pull))
        return pull

    def write_start(self, plan: LookupPlan, grad: torch.Tensor, read: Any) -> Callable[[], Pushes]:
        finish = self.exchange.push_start(read, grad[plan.remote_pos])
        return lambda: Pushes.single(*finish())

    def discard(self, read: Any) -> None:
        """Reads changed nothing; the pulled rows' gradients are simply not pushed."""

    def flush(self) -> Optional[Pushes]:
        """Nothing is ever pending (and no collective runs)."""
        return None
