"""Collectives: one interface, backends local / torch (gloo, nccl) / horovod, chosen by config.

`make_collectives("auto")` picks horovod under horovodrun, torch under torchrun (WORLD_SIZE > 1),
and local otherwise. `device` is the run's train.device: the transport follows it (nccl when the
run trains on CUDA, trainer.base.config.resolve_device / dist_transport).
"""
from __future__ import annotations

import os

from .base import KINDS, EMBEDDING_KINDS, ByteCounter, CollectiveError, Collectives, Handle
from .local import LocalCollectives

__all__ = ["KINDS", "EMBEDDING_KINDS", "ByteCounter", "CollectiveError", "Collectives", "Handle", "LocalCollectives",
           "make_collectives", "detect_backend"]


def detect_backend() -> str:
    """The backend the launcher implies: horovod, torch, or local.

    horovodrun sets HOROVOD_RANK; torchrun sets RANK/WORLD_SIZE; a bare mpirun of more than one
    process (Horovod built with MPI) sets OMPI_COMM_WORLD_SIZE / PMI_SIZE. Alone: local.
    """
    env = os.environ
    if "HOROVOD_RANK" in env:
        return "horovod"
    if int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" in env:
        return "torch"
    if any(int(env.get(k, "1")) > 1 for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
        return "horovod"
    return "local"


def make_collectives(backend: str = "auto", timeout_s: float = 60.0,
                     dist_backend: str = "auto", device: str = "auto") -> Collectives:
    """Create the Collectives for `backend` (auto|local|torch|horovod) of a run on `device` (a
    train.device value: auto | cpu | cuda); dist_backend: the torch backend's transport."""
    if backend == "auto":
        backend = detect_backend()
    if backend == "local":
        return LocalCollectives(timeout_s)
    if backend == "torch":
        from .torch_dist import TorchCollectives
        return TorchCollectives(timeout_s, dist_backend, device)
    if backend == "horovod":
        from .horovod import HorovodCollectives
        return HorovodCollectives(timeout_s, device)
    raise ValueError(f"comm.backend={backend!r} is not one of auto, local, torch, horovod")
