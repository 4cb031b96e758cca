"""Shared set-up of the kernel tests (tests/kernels/test_kernel_*.py: one file per kernel, plus the
reference and the dispatch): every Triton kernel is tested against its pure-torch reference, and the
reference against torch itself.

Why this shape: CI has no GPU, so the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1)
on tiny shapes that still hit the edge cases: odd d (1, 3, 7, 33, 300 -> column-block tails; d = 1
is one column block of width 1, the per-id scalars of WDL's wide part / FM's first-order term), bags
longer than a tile (entry-block tails), empty bags, duplicate ids within and across bags, int32/int64
indices, fp32/fp16/bf16 storage, per-sample weights, sum/mean. Tests marked ``gpu`` run
the compiled kernels at realistic sizes and are skipped without CUDA.

TRITON_INTERPRET is read by Triton when it is imported, so it is set here, when the first kernel
test module imports this one at collection, before anything imports triton, and only when there is
no CUDA device (then the interpreter is the only way to run Triton, and no other test can want
compiled kernels). ``kernels`` imports triton lazily.

No silent skips: triton is a pinned dependency on Linux x86_64 (pyproject.toml), so there the Triton
tests always run and a missing or broken triton FAILS them (and test_triton_is_usable_where_pinned
says why). They skip only on platforms where triton cannot be installed.

The kernel tests' two autouse fixtures (one thread, the backend "auto") are tests/kernels/conftest.py's.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import platform
from typing import Any, Callable, Optional, Tuple

import pytest
from torch import Tensor

from kernels import reference as ref
from kernels._triton import has_triton, interpret_enabled, interpreter_ready

HAS_TRITON = has_triton()
# pyproject.toml: "triton==3.7.1; platform_system == 'Linux' and platform_machine == 'x86_64'"
TRITON_PINNED = platform.system() == "Linux" and platform.machine() == "x86_64"
# This process runs Triton compiled (CUDA, no TRITON_INTERPRET) or interpreted (everything else).
CUDA_COMPILED_MODE = torch.cuda.is_available() and not interpret_enabled()
COMPILED = CUDA_COMPILED_MODE and HAS_TRITON
INTERPRETED = interpreter_ready()
# Small edge-case tests run compiled on CUDA where there is a GPU, interpreted on CPU elsewhere.
DEV = "cuda" if CUDA_COMPILED_MODE else "cpu"
RUN_TRITON = TRITON_PINNED or COMPILED or INTERPRETED
needs_triton = pytest.mark.skipif(
    not RUN_TRITON, reason="triton is not a dependency on this platform and is not installed")
needs_interpreter = pytest.mark.skipif(
    CUDA_COMPILED_MODE or not RUN_TRITON,
    reason="this process runs compiled Triton on CUDA (the interpreter tests run on CPU machines)")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not CUDA_COMPILED_MODE, reason="needs a CUDA device and compiled (not interpreted) kernels")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]


def make_bags(
    batch: int,
    tables: int,
    max_len: int,
    num_slots: int,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    device: str = DEV,
) -> Tuple[Tensor, Tensor]:
    """Random sample-major bags with empty bags and duplicate slots. -> (slots [N], offsets [B*T+1])."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (batch * tables,), generator=gen)
    lengths[:: max(3, tables)] = 0  # some empty bags, always
    offsets = torch.zeros(batch * tables + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    num = int(offsets[-1])
    slots = torch.randint(0, max(num_slots // 2, 1), (num,), generator=gen)  # many duplicates
    return slots.to(device, index_dtype), offsets.to(device, index_dtype)


def rand_storage(rows: int, dim: int, dtype: torch.dtype, seed: int = 1, device: str = DEV) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=gen).to(device, dtype)


def rand_weights(num: int, seed: int = 2, device: str = DEV) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(num, generator=gen) + 0.5).to(device)


def randn(*shape: int, seed: int = 3) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _sparse_step(accumulate: Callable[..., Tensor], update: Callable[..., None], storage: Tensor,
                 grad: Tensor, slots: Tensor, offsets: Tensor, num_tables: int,
                 state: Optional[Tensor] = None, **kw: Any) -> None:
    """The trainer's sparse backward at W = 1 with these kernels: the gather's row-gradient
    scatter into a [U, d] workspace gradient (slots = each entry's unique row), then the owner's
    update of the U distinct storage rows (row_update, unique=True), in place."""
    uniq, inverse = torch.unique(slots.long(), return_inverse=True)
    ws_grad = accumulate(grad, inverse, offsets, num_tables, num_slots=uniq.numel())
    update(storage, uniq, ws_grad, state=state, unique=True, **kw)


class deterministic_algorithms:
    """Context manager toggling torch.use_deterministic_algorithms and restoring it."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(self.on)

    def __exit__(self, *exc: object) -> None:
        torch.use_deterministic_algorithms(self.prev)


def _opt_state(optimizer: str, rows: int, dim: int) -> Optional[Tensor]:
    gen = torch.Generator().manual_seed(8)
    if optimizer == "adagrad":
        return torch.rand(rows, dim, generator=gen).to(DEV)
    if optimizer == "rowwise_adagrad":
        return torch.rand(rows, generator=gen).to(DEV)
    return None


def _row_grads(n: int, rows: int, dim: int, unique: bool, seed: int = 12) -> Tuple[Tensor, Tensor]:
    """Storage rows [n] (distinct, or with many repeats) and their gradients [n, d] on DEV."""
    gen = torch.Generator().manual_seed(seed)
    idx = (torch.randperm(rows, generator=gen)[:n] if unique else
           torch.randint(0, max(rows // 3, 1), (n,), generator=gen))
    return idx.to(DEV), torch.randn(n, dim, generator=gen).to(DEV)


def _run_row_update(fn: Callable[..., None], storage: Tensor, state: Optional[Tensor],
                    **kw: Any) -> Tuple[Tensor, Optional[Tensor]]:
    storage, state = storage.clone(), None if state is None else state.clone()
    fn(storage, state=state, **kw)
    return storage, state


def _zipf_bags(batch: int, tables: int, max_len: int, rows: int, device: str):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, max_len + 1, (batch * tables,), generator=gen)
    offsets = torch.zeros(batch * tables + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ranks = torch.distributions.Pareto(1.0, 1.2).sample((int(offsets[-1]),)).long() - 1
    slots = (ranks * 2654435761) % rows
    return slots.to(device), offsets.to(device)


# fp32 accumulation of a row's contributions, in whatever order the atomics land, stays within
# this fraction of the sum of their magnitudes (its rounding is a few eps = 2^-23 of it for
# random-sign terms; 2^-16 leaves 128x room, yet a lost or doubled contribution of a row with
# few entries shows). Half-precision storage adds the final cast: half an ulp of the value (and,
# below the smallest normal, the subnormal spacing finfo.tiny * finfo.eps).
ACC_REL = 2.0 ** -16


CAST_REL = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _row_grad_truth(shape: Tuple[int, int], slots: Tensor, offsets: Tensor, tables: int,
                    mode: str, w: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
    """The storage gradient in float64 and, per element, the sum of |contributions| (the same
    scatter of |g| and |w|), which bounds fp32 rounding over any summation order."""
    def scatter(grad: Tensor, weights: Tensor) -> Tensor:
        return ref.accumulate_row_grads(grad.double(), slots, offsets, tables, mode,
                                        weights.double(), num_slots=shape[0])
    return scatter(g, w), scatter(g.abs(), w.abs())


def _assert_accumulated(got: Tensor, truth: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
    cast = CAST_REL[dtype]
    err = (got.double() - truth).abs()
    tol = ACC_REL * scale * (1 + cast) + cast * truth.abs()
    if cast:
        tol = tol + torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off the float64 truth; "
                           f"worst excess {float((err - tol).max()):.3g}")
