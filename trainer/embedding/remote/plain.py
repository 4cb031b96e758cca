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
        self._pull: Any = None  # the pull of the step being trained (its gradients go back)

    def begin(self, plan: LookupPlan) -> Any:
        return self.exchange.request(plan.remote_ids, plan.splits)

    def serve(self, token: Any) -> None:
        self.exchange.serve(token)

    def serve_settled(self, token: Any, owned: torch.Tensor) -> None:
        """The rows of the next step's read that this step's update leaves alone travel now: this
        rank updates its own rows of the step (`owned`) and the rows peers pulled from it."""
        touched = owned if self._pull is None or self._pull.served is None \
            else torch.cat([owned, self._pull.served])
        self.exchange.serve_settled(token, touched)

    def cancel(self, token: Any) -> None:
        token.wait()

    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None, token: Any = None) -> None:
        self._pull = token if token is not None else self.begin(plan)
        ws.index_copy_(0, plan.remote_pos, self.exchange.result(self._pull))

    def write_start(self, plan: LookupPlan, grad: torch.Tensor) -> Callable[[], Pushes]:
        pull, self._pull = self._pull, None
        finish = self.exchange.push_start(pull, grad[plan.remote_pos])
        return lambda: Pushes.single(*finish())

    def discard(self) -> None:
        """Reads changed nothing; the pulled rows' gradients are simply not pushed."""
        self._pull = None

    def flush(self) -> Optional[Pushes]:
        """Nothing is ever pending (and no collective runs)."""
        return None
