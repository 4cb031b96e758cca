"""World-size-1 backend: every collective is the identity and nothing crosses a wire.

Why: the embedded default (`python -m trainer` with no launcher) and the single-process reference
of the parity tests run the very same exchange code as W workers do, through this backend.
"""
from __future__ import annotations


from .base import Collectives


class LocalCollectives(Collectives):
    def __init__(self, timeout_s: float = 60.0) -> None:
        super().__init__(rank=0, size=1, timeout_s=timeout_s, local_size=1)

    def _allreduce(self, ts, op):
        return [t.clone() for t in ts]

    def _alltoall(self, t, splits, recv_splits):
        return t.clone()

    def _allgather(self, t):
        return t.clone()

    def _broadcast(self, t, root):
        return t.clone()

    def _barrier(self):
        return None
