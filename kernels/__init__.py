"""Hot-path kernels of the sparse side, with one dispatch: Triton on CUDA tensors, torch otherwise.

Why one dispatch: the trainer's embedding module calls ``kernels.pooled_gather`` /
``kernels.scatter_update`` / ``kernels.make_id_slot_map`` and never chooses an implementation itself,
so there is a single code path whose backend is picked here:

- ``"auto"`` (default): Triton when the tensors are on CUDA and Triton is importable, else the
  pure-torch reference (kernels.reference), which is also the CPU path.
- ``"triton"``: always Triton. On CPU tensors this works only under ``TRITON_INTERPRET=1`` (the
  interpreter, for tests); otherwise a clear RuntimeError is raised.
- ``"reference"``: always the reference.

Choose with ``set_backend(name)`` (or ``use_backend(name)`` as a context manager) or the environment
variable ``TRAINER_KERNELS``; ``set_backend`` wins, ``set_backend(None)`` returns to the variable.

Note: the public functions ``pooled_gather`` and ``scatter_update`` share their names with the kernel
files. The files are imported first and the functions bound afterwards, so the package attributes are
the functions; import launchers with ``from kernels.pooled_gather import pooled_gather_triton``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator, Optional

import torch
from torch import Tensor

from kernels import hashmap as _hashmap_module
from kernels import pooled_gather as _pooled_gather_module
from kernels import reference
from kernels import scatter_update as _scatter_update_module
from kernels._triton import has_triton, interpret_enabled, require_triton
from kernels.hashmap import IdSlotMap, TritonIdSlotMap
from kernels.reference import ReferenceIdSlotMap

__all__ = [
    "BACKENDS", "IdSlotMap", "ReferenceIdSlotMap", "TritonIdSlotMap", "accumulate_row_grads",
    "get_backend", "make_id_slot_map", "pooled_gather", "reference", "scatter_update",
    "set_backend", "triton_available", "use_backend", "use_triton",
]

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "TRAINER_KERNELS"
_override: Optional[str] = None
_warned_fallback = False


def triton_available() -> bool:
    """Whether Triton is installed (it is imported only at the first Triton launch)."""
    return has_triton()


def _validate(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name: Optional[str]) -> None:
    """Force a backend ("auto" | "triton" | "reference"); None defers to $TRAINER_KERNELS."""
    global _override
    _override = None if name is None else _validate(name)


def get_backend() -> str:
    """The backend in force: set_backend's, else $TRAINER_KERNELS, else "auto"."""
    if _override is not None:
        return _override
    return _validate(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto")


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """Temporarily set the backend (tests, benchmarks)."""
    previous = _override
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def use_triton(device: torch.device | str) -> bool:
    """Whether a kernel on tensors living on ``device`` runs in Triton under the current backend."""
    device = torch.device(device)
    backend = get_backend()
    if backend == "reference":
        return False
    if backend == "auto":
        return device.type == "cuda" and _triton_or_warn()
    require_triton()
    if device.type != "cuda" and not interpret_enabled():
        raise RuntimeError(
            f"kernel backend 'triton' was forced but the tensors are on {device}: compiled Triton "
            "kernels need CUDA tensors. Set TRITON_INTERPRET=1 to run them in Triton's interpreter "
            "(slow, for tests), or use backend 'auto' or 'reference'."
        )
    return True


def _triton_or_warn() -> bool:
    global _warned_fallback
    available = has_triton()
    if not available and not _warned_fallback:
        warnings.warn("triton is not installed; CUDA tensors use the torch reference kernels")
        _warned_fallback = True
    return available


def pooled_gather(
    storage: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    mode: str = "sum",
    per_sample_weights: Optional[Tensor] = None,
) -> Tensor:
    """Pooled lookup. storage [S, d], slots [N], offsets [B*T+1] (sample-major) -> [B, T, d] float32.

    fp32/fp16/bf16 storage, fp32 accumulation; int32/int64 slots/offsets; sum or mean (empty bag ->
    0). Differentiable w.r.t. storage (dense [S, d] grad in storage's dtype) and per_sample_weights.
    """
    if use_triton(storage.device):
        return _pooled_gather_module.pooled_gather_triton(
            storage, slots, offsets, num_tables, mode, per_sample_weights)
    return reference.pooled_gather_torch(storage, slots, offsets, num_tables, mode,
                                         per_sample_weights)


def accumulate_row_grads(
    grad: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    mode: str = "sum",
    per_sample_weights: Optional[Tensor] = None,
    num_slots: Optional[int] = None,
    deterministic: Optional[bool] = None,
) -> Tensor:
    """Per-slot gradient sum. grad [B, T, d] | [B*T, d] -> [num_slots, d] float32."""
    fn = (_scatter_update_module.accumulate_row_grads_triton if use_triton(grad.device)
          else reference.accumulate_row_grads)
    return fn(grad, slots, offsets, num_tables, mode, per_sample_weights, num_slots, deterministic)


def scatter_update(
    storage: Tensor,
    grad: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    *,
    optimizer: str = "sgd",
    lr: float = 0.01,
    eps: float = 1e-10,
    state: Optional[Tensor] = None,
    mode: str = "sum",
    per_sample_weights: Optional[Tensor] = None,
    remote: Optional[Tensor] = None,
    remote_start: Optional[int] = None,
    pending: Optional[Tensor] = None,
    pending_offset: int = 0,
) -> Tensor:
    """Fused gradient scatter + sparse optimizer, in place; returns the unique slots [U] int64.

    storage [S, d]; grad [B, T, d] | [B*T, d]; optimizer "sgd" | "adagrad" (state [S, d]) |
    "rowwise_adagrad" (state [S]). Slots flagged remote (remote bool [S], or slot >= remote_start)
    skip the optimizer: pending[slot - pending_offset] += summed grad (pending [P, d]).
    """
    fn = (_scatter_update_module.scatter_update_triton if use_triton(storage.device)
          else reference.scatter_update)
    return fn(storage, grad, slots, offsets, num_tables, optimizer=optimizer, lr=lr, eps=eps,
              state=state, mode=mode, per_sample_weights=per_sample_weights, remote=remote,
              remote_start=remote_start, pending=pending, pending_offset=pending_offset)


def make_id_slot_map(capacity: int, device: torch.device | str = "cpu") -> IdSlotMap:
    """An id -> slot map on ``device``: the Triton hash table when the backend says so."""
    if use_triton(torch.device(device)):
        return _hashmap_module.TritonIdSlotMap(capacity, device)
    return ReferenceIdSlotMap(capacity, device)
