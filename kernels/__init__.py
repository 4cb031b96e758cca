"""Hot-path kernels of the sparse side, with one dispatch: Triton on CUDA tensors, torch otherwise.

Why one dispatch: the trainer calls ``kernels.pooled_gather`` (forward over the step's workspace;
its backward is ``accumulate_row_grads``), ``kernels.row_update`` (the owner's gradient sum +
sparse optimizer in ShardStore.apply) and ``kernels.make_id_slot_map`` (the cache), and never
chooses an implementation itself, so there is a single code path whose backend is picked here:

- ``"auto"`` (default): Triton when the tensors are on CUDA and Triton is importable, else the
  pure-torch reference (kernels.reference), which is also the CPU path.
- ``"triton"``: always Triton. On CPU tensors this works only under ``TRITON_INTERPRET=1`` (the
  interpreter, for tests); otherwise a clear error is raised.
- ``"reference"``: always the reference.

Where the backend comes from, strongest first:
1. ``set_backend(name)`` / ``use_backend(name)`` (context manager): programmatic, for tests and
   benchmarks; ``set_backend(None)`` clears it.
2. The environment variable ``TRAINER_KERNELS`` (auto | triton | reference): an operator's override
   of the config, e.g. ``TRAINER_KERNELS=reference python -m trainer ...`` on a GPU box.
3. ``configure(backend, device)``: the trainer's start-up call with the config key
   ``kernels.backend``; it also checks that the backend can run on the trainer's device.
4. ``"auto"``.

Note: the public function ``pooled_gather`` shares its name with a kernel file. The files are
imported first and the function bound afterwards, so the package attribute is the function; import
launchers with ``from kernels.pooled_gather import pooled_gather_triton``.
"""

from __future__ import annotations

__distribution__ = "hybrid-trainer"  # this package is hybrid-trainer's (trainer/run/install.py checks it)

import contextlib
import os
import warnings
from typing import Iterator, Optional

import torch
from torch import Tensor

from kernels import id_slot_map_triton as _id_slot_map_module
from kernels import pooled_gather as _pooled_gather_module
from kernels import reference
from kernels import scatter_update as _scatter_update_module
from kernels._triton import has_triton, interpret_enabled, require_triton
from kernels.id_slot_map_reference import (SPLITMIX_GAMMA, SPLITMIX_M1, SPLITMIX_M2, cells_bound, splitmix,
                                          splitmix_inplace)
from kernels.id_slot_map_triton import IdSlotMap, TritonIdSlotMap
from kernels.reference import OPTIMIZERS, ReferenceIdSlotMap
from kernels.rounding import HALF_DTYPES, StochasticRounding, salt_of

__all__ = [
    "BACKENDS", "BackendError", "HALF_DTYPES", "IdSlotMap", "OPTIMIZERS", "ReferenceIdSlotMap", "SPLITMIX_GAMMA",
    "SPLITMIX_M1", "SPLITMIX_M2",
    "StochasticRounding", "TritonIdSlotMap", "accumulate_row_grads", "cells_bound", "check_backend",
    "configure", "get_backend", "make_id_slot_map", "pooled_gather", "reference", "row_update",
    "salt_of", "set_backend", "splitmix", "splitmix_inplace", "triton_available", "use_backend", "use_triton",
]

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "TRAINER_KERNELS"
_override: Optional[str] = None  # set_backend / use_backend
_configured: str = "auto"  # configure(), from the config key kernels.backend
_warned_fallback = False


class BackendError(ValueError, RuntimeError):
    """The kernel backend asked for is unknown or cannot run here; the message says which and why.

    A ValueError (a bad setting) and a RuntimeError (what a failed launch raised before)."""


def triton_available() -> bool:
    """Whether Triton is installed (it is imported only at the first Triton launch)."""
    return has_triton()


def _validate(name: str, source: str = "kernel backend") -> str:
    if name not in BACKENDS:
        raise BackendError(f"{source}={name!r}: must be one of {', '.join(BACKENDS)}")
    return name


def set_backend(name: Optional[str]) -> None:
    """Force a backend ("auto" | "triton" | "reference") over everything; None clears the force."""
    global _override
    _override = None if name is None else _validate(name)


def _env_backend() -> Optional[str]:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return _validate(value, ENV_VAR) if value else None


def get_backend() -> str:
    """The backend in force: set_backend's, else $TRAINER_KERNELS, else configure()'s ("auto")."""
    if _override is not None:
        return _override
    return _env_backend() or _configured


def check_backend(name: str, device: torch.device | str, source: str = "kernels.backend") -> None:
    """Fail now, with a clear BackendError naming ``source``, if backend ``name`` cannot run kernels
    on tensors living on ``device`` (unknown name; triton not installed; triton forced on a CPU
    device without TRITON_INTERPRET=1)."""
    _validate(name, source)
    if name != "triton":
        return
    if not has_triton():
        raise BackendError(f"{source}='triton' but the `triton` package is not installed; install "
                           "triton==3.7.1 or use 'auto' / 'reference'")
    if torch.device(device).type != "cuda" and not interpret_enabled():
        raise BackendError(
            f"{source}='triton' but the trainer's tensors are on {torch.device(device)}: compiled "
            "Triton kernels need CUDA. Use 'auto' or 'reference' on CPU, or set TRITON_INTERPRET=1 "
            "(Triton's interpreter: slow, for tests)")


def configure(backend: str, device: torch.device | str) -> str:
    """Trainer start-up: apply the config key ``kernels.backend`` and check it against ``device``.

    $TRAINER_KERNELS, when set, overrides ``backend`` (and is what gets checked). Returns the
    implementation the trainer's kernels will use on ``device``: "triton" or "reference".
    Raises BackendError (a ValueError) with a message naming the key or the variable.
    """
    global _configured
    _configured = _validate(backend, "kernels.backend")
    env = _env_backend()
    effective, source = (env, f"{ENV_VAR} (overrides kernels.backend)") if env else (
        _configured, "kernels.backend")
    check_backend(effective, device, source)
    return "triton" if use_triton(device) else "reference"


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
        raise BackendError(
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


def row_update(
    storage: Tensor,
    rows: Tensor,
    grads: Tensor,
    *,
    optimizer: str = "sgd",
    lr: float | Tensor = 0.01,
    eps: float = 1e-10,
    state: Optional[Tensor] = None,
    unique: bool = False,
    weight_decay: float = 0.0,
    rounding: Optional[StochasticRounding] = None,
    mask: Optional[Tensor] = None,
) -> None:
    """The owner's sparse update, in place: sum grads [n, d] per storage row (rows [n], repeated
    when several workers pushed one row), then SGD / Adagrad (state [S, d]) / row-wise Adagrad
    (state [S]) once per distinct row. unique=True: rows are known distinct (no sum).
    weight_decay: coupled L2 (g += wd * w, torch.optim's rule) once per distinct row.
    fp16 / bf16 storage: each row is updated in fp32 and written back by `rounding` (stochastic,
    kernels/rounding.py: keys [n], one per entry of rows) or, when None, rounded to nearest.
    mask [n] bool (unique=True only): rows where it is False stay exactly as they are (the
    padding rows of a fixed-size update). lr: a float, or one fp32 value on the storage's device
    that the Triton kernel reads there (a captured step follows a changing rate; the reference
    reads it to the host)."""
    fn = (_scatter_update_module.row_update_triton if use_triton(storage.device)
          else reference.row_update)
    fn(storage, rows, grads, optimizer=optimizer, lr=lr, eps=eps, state=state, unique=unique,
       weight_decay=weight_decay, rounding=rounding, mask=mask)


def make_id_slot_map(capacity: int, device: torch.device | str = "cpu") -> IdSlotMap:
    """An id -> slot map on ``device``: the Triton hash table when the backend says so."""
    if use_triton(torch.device(device)):
        return _id_slot_map_module.TritonIdSlotMap(capacity, device)
    return ReferenceIdSlotMap(capacity, device)
