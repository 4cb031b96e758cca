"""Fused pooled gather (Triton): gather rows of one slot space and pool them per bag in one pass.

Why fused: the unfused path (index_select then a segment sum) writes and re-reads an [N, d]
intermediate; the kernel reads each looked-up row once and writes only the pooled [B*T, d] output, so
it is bound by the row reads alone. One program per (bag, block of d) loops over the bag's entries in
tiles of BLOCK_N rows, accumulating in float32 (float64 for float64 storage).

Backward (autograd): the storage gradient is a dense [S, d] tensor in storage's dtype (the trainer's
storage is a small per-step workspace of unique rows), produced by the row-gradient scatter of
kernels/scatter_update.py (atomics, or sorted segments when torch's deterministic mode is on); the
per-sample weight gradient is one dot product per entry, computed bag by bag.

Layout (see kernels.reference): storage [S, d], slots [N], offsets [B*T+1] sample-major,
per_sample_weights [N] -> [B, T, d].
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from kernels import reference as ref
from kernels._triton import block_sizes, cdiv, dense_1d, jit
from kernels.scatter_update import accumulate_row_grads_triton

tl: Any = None  # bound to triton.language by kernels._triton.jit at first launch


def pooled_gather_triton(
    storage: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    mode: str = "sum",
    per_sample_weights: Optional[Tensor] = None,
) -> Tensor:
    """Triton pooled gather with autograd. storage [S, d] -> [B, T, d] float32 (float64 for float64)."""
    batch = ref.check_bags(slots, offsets, num_tables, mode)
    ref.check_weights(per_sample_weights, slots)
    slots, offsets, per_sample_weights = dense_1d(slots, offsets, per_sample_weights)
    out = _PooledGather.apply(storage, slots, offsets, mode, per_sample_weights)
    return out.view(batch, num_tables, storage.shape[1])


class _PooledGather(torch.autograd.Function):
    """Forward: fused gather+pool. Backward: dense [S, d] row gradient and per-entry weight grads."""

    @staticmethod
    def forward(ctx: Any, storage: Tensor, slots: Tensor, offsets: Tensor, mode: str,
                weights: Optional[Tensor]) -> Tensor:
        ctx.mode = mode
        ctx.storage_meta = (storage.shape[0], storage.dtype)
        ctx.save_for_backward(storage, slots, offsets, weights)
        return pooled_gather_forward(storage, slots, offsets, mode, weights)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        storage, slots, offsets, weights = ctx.saved_tensors
        num_slots, dtype = ctx.storage_meta
        grad_storage = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_storage = accumulate_row_grads_triton(
                grad_out, slots, offsets, 1, ctx.mode, weights, num_slots
            ).to(dtype)
        if ctx.needs_input_grad[4]:
            grad_weights = weight_grads(grad_out, storage, slots, offsets, ctx.mode)
            grad_weights = grad_weights.to(weights.dtype)
        return grad_storage, None, None, None, grad_weights


def pooled_gather_forward(
    storage: Tensor, slots: Tensor, offsets: Tensor, mode: str, weights: Optional[Tensor]
) -> Tensor:
    """Launch the forward kernel. -> pooled [B*T, d] in the accumulation dtype."""
    num_bags, dim = offsets.numel() - 1, storage.shape[1]
    storage = _row_major(storage)
    out = torch.empty(num_bags, dim, dtype=ref.accumulation_dtype(storage.dtype),
                      device=storage.device)
    if num_bags == 0 or dim == 0:
        return out
    block_n, block_d = block_sizes(dim)
    grid = (num_bags, cdiv(dim, block_d))
    _pooled_gather_fwd_kernel[grid](
        storage, slots, offsets, slots if weights is None else weights, out, dim,
        storage.stride(0), HAS_WEIGHTS=weights is not None, MEAN=mode == "mean",
        BLOCK_N=block_n, BLOCK_D=block_d)
    return out


def weight_grads(grad_out: Tensor, storage: Tensor, slots: Tensor, offsets: Tensor,
                 mode: str) -> Tensor:
    """d(out)/d(per_sample_weights): dot(grad[bag], storage[slot]) (/ len for mean). -> [N]."""
    dim = storage.shape[1]
    grad_out = grad_out.reshape(-1, dim).contiguous()
    storage = _row_major(storage)
    out = torch.zeros(slots.numel(), dtype=grad_out.dtype, device=grad_out.device)
    if slots.numel() == 0 or dim == 0:
        return out
    block_n, block_d = block_sizes(dim)
    _weight_grad_kernel[(offsets.numel() - 1,)](
        storage, slots, offsets, grad_out, out, dim, storage.stride(0),
        MEAN=mode == "mean", BLOCK_N=block_n, BLOCK_D=block_d)
    return out


def _row_major(t: Tensor) -> Tensor:
    """Rows may be strided (a view into a larger buffer), columns must be contiguous."""
    return t if t.stride(1) == 1 else t.contiguous()


@jit
def _pooled_gather_fwd_kernel(storage_ptr, slots_ptr, offsets_ptr, weights_ptr, out_ptr, dim,
                              stride_s, HAS_WEIGHTS: tl.constexpr, MEAN: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[bag, cols] = sum over the bag's entries of w * storage[slot, cols] (/ len for mean)."""
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty)
    for first in range(start, end, BLOCK_N):
        ent = first + tl.arange(0, BLOCK_N)
        ent_ok = ent < end
        slot = tl.load(slots_ptr + ent, mask=ent_ok, other=0).to(tl.int64)
        rows = tl.load(storage_ptr + slot[:, None] * stride_s + cols[None, :],
                       mask=ent_ok[:, None] & col_ok[None, :], other=0.0).to(acc.dtype)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + ent, mask=ent_ok, other=0.0).to(acc.dtype)
            rows = rows * w[:, None]
        acc += tl.sum(rows, axis=0)
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(acc.dtype)
    tl.store(out_ptr + bag * dim + cols, acc, mask=col_ok)


@jit
def _weight_grad_kernel(storage_ptr, slots_ptr, offsets_ptr, grad_ptr, out_ptr, dim, stride_s,
                        MEAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[e] = dot(grad[bag], storage[slot[e]]) (/ len for mean) for every entry e of the bag."""
    bag = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    for first in range(start, end, BLOCK_N):
        ent = first + tl.arange(0, BLOCK_N)
        ent_ok = ent < end
        slot = tl.load(slots_ptr + ent, mask=ent_ok, other=0).to(tl.int64)
        dot = tl.zeros([BLOCK_N], dtype=out_ptr.dtype.element_ty)
        for c0 in range(0, dim, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            col_ok = cols < dim
            g = tl.load(grad_ptr + bag * dim + cols, mask=col_ok, other=0.0).to(dot.dtype)
            rows = tl.load(storage_ptr + slot[:, None] * stride_s + cols[None, :],
                           mask=ent_ok[:, None] & col_ok[None, :], other=0.0).to(dot.dtype)
            dot += tl.sum(rows * g[None, :], axis=1)
        if MEAN:
            dot = dot / tl.maximum(end - start, 1).to(dot.dtype)
        tl.store(out_ptr + ent, dot, mask=ent_ok)
