"""Fused backward scatter + sparse optimizer (Triton), and the row-gradient launcher it builds on.

Why fused: the unfused path materialises a per-slot gradient (index_add_ into [U, d]), then reads it
back with the weights and optimizer state. Here the entries are sorted by slot once (a stable sort
of N int64s, small next to the N*d gradient reads), and one program per (unique slot, block of d)
sums that slot's contributions in entry order and applies SGD / Adagrad / row-wise Adagrad in place
right away. The sum order is fixed, so results are deterministic run to run, and no two programs
touch the same row, so no atomics are needed.

Remote slots (cache rows owned by another worker) do not run the optimizer: their summed gradient is
added to ``pending[slot - pending_offset]`` for the cache to push later (HET).

``row_update_triton`` is the owner's update (ShardStore.apply): the same segment kernel over row
gradients [n, d] received from every worker, one entry per gradient row, summed per storage row.

``accumulate_row_grads_triton`` (also pooled_gather's backward) returns the dense per-slot gradient:
bag-parallel atomics by default, or the sorted-segment kernel when ``deterministic`` (default:
torch.are_deterministic_algorithms_enabled()).

Layout (see kernels.reference): grad [B, T, d] or [B*T, d], slots [N], offsets [B*T+1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from kernels import reference as ref
from kernels._triton import block_sizes, cdiv, jit

tl: Any = None  # bound to triton.language by kernels._triton.jit at first launch


_OPT_CODE = {"write": 0, "sgd": 1, "adagrad": 2, "rowwise_adagrad": 3}


@dataclass
class Segments:
    """Entries grouped by slot. uniq [U] int64 ascending; starts [U+1]; bags, coef [N] in slot order."""

    uniq: Tensor
    starts: Tensor
    bags: Tensor
    coef: Optional[Tensor]


def sort_segments(slots: Tensor, offsets: Tensor, mode: str, weights: Optional[Tensor],
                  dtype: torch.dtype) -> Segments:
    """Stable-sort entries by slot (ties keep entry order, which fixes the summation order)."""
    num_entries = slots.numel()
    sorted_slots, order = torch.sort(slots.long(), stable=True)
    uniq, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    starts = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=slots.device)
    torch.cumsum(counts, 0, out=starts[1:])
    bags = ref.entry_bags(offsets, num_entries).index_select(0, order)
    coef = ref.entry_coefficients(offsets, num_entries, mode, weights, dtype)
    return Segments(uniq, starts, bags, None if coef is None else coef.index_select(0, order))


def _bag_grads(grad: Tensor, offsets: Tensor) -> Tensor:
    """grad [B, T, d] | [B*T, d] -> contiguous [B*T, d] in the accumulation dtype."""
    grad = grad.reshape(offsets.numel() - 1, -1)
    return grad.to(ref.accumulation_dtype(grad.dtype)).contiguous()


def accumulate_row_grads_triton(
    grad: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    mode: str = "sum",
    per_sample_weights: Optional[Tensor] = None,
    num_slots: Optional[int] = None,
    deterministic: Optional[bool] = None,
) -> Tensor:
    """Per-slot sum of entry gradients. -> [num_slots, d] float32 (float64 for float64 grad)."""
    ref.check_bags(slots, offsets, num_tables, mode)
    ref.check_weights(per_sample_weights, slots)
    bag_grad = _bag_grads(grad, offsets)
    if num_slots is None:
        num_slots = int(slots.max()) + 1 if slots.numel() else 0
    out = torch.zeros(num_slots, bag_grad.shape[1], dtype=bag_grad.dtype, device=grad.device)
    if slots.numel() == 0 or out.shape[1] == 0:
        return out
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        segs = sort_segments(slots, offsets, mode, per_sample_weights, bag_grad.dtype)
        _launch_segments(segs, bag_grad, out, "write")
    else:
        _launch_atomic(bag_grad, slots, offsets, mode, per_sample_weights, out)
    return out


def scatter_update_triton(
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
    """Same contract as kernels.reference.scatter_update. Returns unique slots [U] int64."""
    ref.check_bags(slots, offsets, num_tables, mode)
    ref.check_weights(per_sample_weights, slots)
    flagged = remote is not None or remote_start is not None
    ref.check_update_args(storage, state, optimizer, flagged, pending)
    _check_in_place(storage, state)
    bag_grad = _bag_grads(grad, offsets)
    segs = sort_segments(slots, offsets, mode, per_sample_weights, bag_grad.dtype)
    if segs.uniq.numel() == 0 or storage.shape[1] == 0:
        return segs.uniq
    flags = ref.remote_flags(segs.uniq, remote, remote_start)
    _launch_segments(segs, bag_grad, storage, optimizer, state=state, flags=flags,
                     pending=pending, pending_offset=pending_offset, lr=lr, eps=eps)
    return segs.uniq


def row_update_triton(
    storage: Tensor,
    rows: Tensor,
    grads: Tensor,
    *,
    optimizer: str = "sgd",
    lr: float = 0.01,
    eps: float = 1e-10,
    state: Optional[Tensor] = None,
    unique: bool = False,
    weight_decay: float = 0.0,
) -> None:
    """Same contract as kernels.reference.row_update: rows [n], grads [n, d] -> in place.

    The received row gradients are the segment kernel's input with one entry per gradient row:
    entries are stable-sorted by storage row (unique=True: taken as they are, one per segment).
    """
    ref.check_update_args(storage, state, optimizer, False, None)
    if grads.dim() != 2 or grads.shape[0] != rows.numel() or grads.shape[1] != storage.shape[1]:
        raise ValueError(f"grads must be [len(rows), d] = [{rows.numel()}, {storage.shape[1]}]")
    _check_in_place(storage, state)
    if rows.numel() == 0 or storage.shape[1] == 0:
        return
    grads = grads.to(ref.accumulation_dtype(grads.dtype)).contiguous()
    segs = _row_segments(rows.long(), unique)
    _launch_segments(segs, grads, storage, optimizer, state=state, lr=lr, eps=eps, wd=weight_decay)


def _row_segments(rows: Tensor, unique: bool) -> Segments:
    """Segments over gradient rows: entry e is gradient row e (no bags, no coefficients)."""
    if unique:
        order = torch.arange(rows.numel(), device=rows.device)
        return Segments(rows, torch.arange(rows.numel() + 1, device=rows.device), order, None)
    sorted_rows, order = torch.sort(rows, stable=True)
    uniq, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    starts = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, 0, out=starts[1:])
    return Segments(uniq, starts, order, None)


def _check_in_place(storage: Tensor, state: Optional[Tensor]) -> None:
    if storage.stride(1) != 1 or (state is not None and state.dim() == 2 and state.stride(1) != 1):
        raise ValueError("scatter_update updates in place: storage/state columns must be contiguous")


def _launch_segments(segs: Segments, bag_grad: Tensor, out: Tensor, op: str, *,
                     state: Optional[Tensor] = None, flags: Optional[Tensor] = None,
                     pending: Optional[Tensor] = None, pending_offset: int = 0,
                     lr: float = 0.0, eps: float = 0.0, wd: float = 0.0) -> None:
    """One program per (unique slot, block of d); row-wise Adagrad needs the whole row in one."""
    dim = bag_grad.shape[1]
    block_n, block_d = block_sizes(dim, dim if op == "rowwise_adagrad" else 256)
    dummy = segs.starts
    _segment_kernel[(segs.uniq.numel(), cdiv(dim, block_d))](
        bag_grad, segs.uniq, segs.starts, segs.bags,
        dummy if segs.coef is None else segs.coef,
        dummy if flags is None else flags.to(torch.int8),
        out, dummy if state is None else state, dummy if pending is None else pending,
        dim, out.stride(0), 0 if state is None or state.dim() == 1 else state.stride(0),
        0 if pending is None else pending.stride(0), pending_offset, lr, eps, wd,
        HAS_COEF=segs.coef is not None, OP=_OPT_CODE[op], HAS_REMOTE=flags is not None,
        HAS_WD=wd != 0.0, BLOCK_N=block_n, BLOCK_D=block_d)


def _launch_atomic(bag_grad: Tensor, slots: Tensor, offsets: Tensor, mode: str,
                   weights: Optional[Tensor], out: Tensor) -> None:
    """One program per (bag, block of d) adds its scaled gradient to every entry's slot row."""
    block_n, block_d = block_sizes(bag_grad.shape[1])
    dim = bag_grad.shape[1]
    _scatter_atomic_kernel[(offsets.numel() - 1, cdiv(dim, block_d))](
        bag_grad, slots, offsets, slots if weights is None else weights, out, dim,
        HAS_WEIGHTS=weights is not None, MEAN=mode == "mean", BLOCK_N=block_n, BLOCK_D=block_d)


@jit
def _scatter_atomic_kernel(grad_ptr, slots_ptr, offsets_ptr, weights_ptr, out_ptr, dim,
                           HAS_WEIGHTS: tl.constexpr, MEAN: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[slot[e], cols] += w[e] * grad[bag, cols] (/ len for mean) for the bag's entries e."""
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    g = tl.load(grad_ptr + bag * dim + cols, mask=col_ok, other=0.0)
    if MEAN:
        g = g / tl.maximum(end - start, 1).to(g.dtype)
    for first in range(start, end, BLOCK_N):
        ent = first + tl.arange(0, BLOCK_N)
        ent_ok = ent < end
        slot = tl.load(slots_ptr + ent, mask=ent_ok, other=0).to(tl.int64)
        vals = tl.broadcast_to(g[None, :], [BLOCK_N, BLOCK_D])
        if HAS_WEIGHTS:
            vals = vals * tl.load(weights_ptr + ent, mask=ent_ok, other=0.0).to(g.dtype)[:, None]
        tl.atomic_add(out_ptr + slot[:, None] * dim + cols[None, :], vals,
                      mask=ent_ok[:, None] & col_ok[None, :], sem="relaxed")


@jit
def _segment_kernel(grad_ptr, uniq_ptr, starts_ptr, bags_ptr, coef_ptr, remote_ptr, out_ptr,
                    state_ptr, pending_ptr, dim, stride_out, stride_state, stride_pending,
                    pending_offset, lr, eps, wd, HAS_COEF: tl.constexpr, OP: tl.constexpr,
                    HAS_REMOTE: tl.constexpr, HAS_WD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Sum one slot's entry gradients in entry order, then write (OP 0) or optimize (OP 1..3);
    HAS_WD adds coupled L2 (g += wd * w) to a local row's gradient before the optimizer."""
    u = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    start = tl.load(starts_ptr + u)
    end = tl.load(starts_ptr + u + 1)
    g = tl.zeros([BLOCK_D], dtype=grad_ptr.dtype.element_ty)
    for first in range(start, end, BLOCK_N):
        ent = first + tl.arange(0, BLOCK_N)
        ent_ok = ent < end
        bag = tl.load(bags_ptr + ent, mask=ent_ok, other=0)
        rows = tl.load(grad_ptr + bag[:, None] * dim + cols[None, :],
                       mask=ent_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_COEF:
            rows = rows * tl.load(coef_ptr + ent, mask=ent_ok, other=0.0)[:, None]
        g += tl.sum(rows, axis=0)
    slot = tl.load(uniq_ptr + u)
    local_ok = col_ok
    if HAS_REMOTE:
        flag = tl.load(remote_ptr + u)
        local_ok = col_ok & (flag == 0)
        far_ok = col_ok & (flag != 0)
        p_ptrs = pending_ptr + (slot - pending_offset) * stride_pending + cols
        p = tl.load(p_ptrs, mask=far_ok, other=0.0).to(g.dtype)
        tl.store(p_ptrs, (p + g).to(pending_ptr.dtype.element_ty), mask=far_ok)
    w_ptrs = out_ptr + slot * stride_out + cols
    if OP == 0:
        tl.store(w_ptrs, g.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        w = tl.load(w_ptrs, mask=local_ok, other=0.0).to(g.dtype)
        if HAS_WD:
            g = g + wd * w
        if OP == 1:
            w = w - lr * g
        elif OP == 2:
            s_ptrs = state_ptr + slot * stride_state + cols
            s = tl.load(s_ptrs, mask=local_ok, other=0.0).to(g.dtype) + g * g
            tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=local_ok)
            w = w - lr * g / (tl.sqrt(s) + eps)
        else:
            row_ok = tl.sum(local_ok.to(tl.int32), axis=0) > 0
            s = tl.load(state_ptr + slot).to(g.dtype) + tl.sum(g * g, axis=0) / dim
            tl.store(state_ptr + slot, s.to(state_ptr.dtype.element_ty), mask=row_ok)
            w = w - lr * g / (tl.sqrt(s) + eps)
        tl.store(w_ptrs, w.to(out_ptr.dtype.element_ty), mask=local_ok)
