"""Row-gradient scatter and the owner's sparse update (Triton): the sparse half of the backward.

``accumulate_row_grads_triton`` is the pooled gather's backward: the gradient of every bag added to
the row of each of its entries, giving the dense per-slot gradient of the step's [U, d] workspace.
By default one program per (bag, block of d) adds with atomics (fast; the summation order varies
between runs); with ``deterministic`` (default: torch.are_deterministic_algorithms_enabled()) the
entries are stable-sorted by slot and one program per slot sums them in entry order (the same bits
every run).

``row_update_triton`` is the owner's update (ShardStore.apply): row gradients [n, d] received from
every worker, stable-sorted by storage row, summed per row in a fixed order, then SGD / Adagrad /
row-wise Adagrad applied in place, once per distinct row, in the same program (no intermediate, no
atomics: no two live programs touch one row).

Both sorted paths use one segment layout without a host read: every sorted position p gets a
program whose segment is live only where p is the first entry of its slot, ending at the next
slot's first entry. torch.unique_consecutive would give one program per distinct slot instead, but
its output size is the number of distinct slots, which the host would have to wait for on a GPU
(a device sync in every owner update); n programs, most of them idle, cost far less.

Why no fused "backward scatter + optimizer" over bags: in the trainer a row's optimizer step must
see the gradient summed over every worker (its owner's own bags and every peer's pushes), so the
local bags alone cannot be optimized in the scatter; the scatter writes the workspace gradient,
the pushes leave from it, and the owner runs row_update on the sum of everything it received.

Layout (see kernels.reference): grad [B, T, d] or [B*T, d], slots [N], offsets [B*T+1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from kernels import reference as ref
from kernels._triton import block_sizes, cdiv, dense_1d, jit
from kernels.rounding import HALF_DTYPES, StochasticRounding

tl: Any = None  # bound to triton.language by kernels._triton.jit at first launch


_OPT_CODE = {"write": 0, "sgd": 1, "adagrad": 2, "rowwise_adagrad": 3}


@dataclass
class Segments:
    """One kernel program per segment u: slot[u], entries starts[u]:ends[u] of bags / coef [N]
    (in slot order). An empty segment (ends[u] == starts[u]) touches nothing."""

    slot: Tensor
    starts: Tensor
    ends: Tensor
    bags: Tensor
    coef: Optional[Tensor] = None


def sorted_segments(keys: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stable-sort keys [n] (ties keep entry order, which fixes the summation order) and lay out
    one segment per sorted position, live at the first entry of each key (see the module doc).
    -> (sorted keys, order, starts, ends), all [n] on keys' device; no host read."""
    n, dev = keys.numel(), keys.device
    pos = torch.arange(n, device=dev)
    sorted_keys, order = torch.sort(keys, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    # ends[p] = the next first entry after p (n after the last key): a reversed running minimum
    heads_after = torch.full((n,), n, dtype=torch.int64, device=dev)
    heads_after[:-1] = torch.where(first[1:], pos[1:], n)
    ends = heads_after.flip(0).cummin(0).values.flip(0)
    return sorted_keys, order, pos, torch.where(first, ends, pos)


def sort_segments(slots: Tensor, offsets: Tensor, mode: str, weights: Optional[Tensor],
                  dtype: torch.dtype) -> Segments:
    """Entries grouped by slot: segment bags (and coefficients) in slot order, entry order within."""
    num_entries = slots.numel()
    sorted_slots, order, starts, ends = sorted_segments(slots.long())
    bags = ref.entry_bags(offsets, num_entries).index_select(0, order)
    coef = ref.entry_coefficients(offsets, num_entries, mode, weights, dtype)
    return Segments(sorted_slots, starts, ends, bags,
                    None if coef is None else coef.index_select(0, order))


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
    slots, offsets, per_sample_weights = dense_1d(slots, offsets, per_sample_weights)
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


def row_update_triton(
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
    """Same contract as kernels.reference.row_update: rows [n], grads [n, d] -> in place.
    mask (unique=True): a row where it is False gets an empty segment, which touches nothing.

    The received row gradients are the segment kernel's input with one entry per gradient row:
    entries are stable-sorted by storage row (unique=True: taken as they are, one per segment).
    Half storage with `rounding`: the kernel repeats kernels/rounding.py's rule and hash, with the
    key of the segment's first entry (every entry of a segment is the same storage row).
    lr as a one-element fp32 tensor on the storage's device: the kernel reads the rate from it, so
    a captured CUDA graph follows a rate that changes between replays (train.cuda_graph=on).
    """
    ref.check_update_args(storage, state, optimizer)
    if grads.dim() != 2 or grads.shape[0] != rows.numel() or grads.shape[1] != storage.shape[1]:
        raise ValueError(f"grads must be [len(rows), d] = [{rows.numel()}, {storage.shape[1]}]")
    ref.check_rounding(rounding, rows)
    ref.check_mask(mask, rows, unique)
    ref.check_lr(lr, storage)
    _check_in_place(storage, state)
    if rows.numel() == 0 or storage.shape[1] == 0:
        return
    grads = grads.to(ref.accumulation_dtype(grads.dtype)).contiguous()
    segs = _row_segments(rows.long().contiguous(), unique, mask)
    if rounding is None or storage.dtype not in HALF_DTYPES:
        rounding = None
    _launch_segments(segs, grads, storage, optimizer, state=state, lr=lr, eps=eps, wd=weight_decay,
                     block_n=UNIQUE_BLOCK_N if unique else None, rounding=rounding)


# unique=True: every segment is one entry, so a tile of one row; block_sizes' tiles (32 rows at
# d = 64, 16 at d = 128) were mostly masked lanes. Update of 650k distinct rows on an H200
# (2026-11-26), tile of 1 / 2 / 8 rows: 0.65 / 0.67 / 1.13 ms at d = 64, 0.68 / 0.74 / 1.86 at
# d = 128; the torch reference 0.67 / 0.92; the trainer's scatter + update (bench_kernels'
# sparse_backward) 1.4 -> 0.8 ms at d = 64, bags of 32 (tile of 2). The repeated-rows path keeps
# block_sizes' tiles: smaller ones made a row pushed 70k times (a Zipf bench; the trainer pushes a
# row at most once per worker) 3x slower, and neither a tile size nor splitting long runs brought
# 10^6 rows under the reference's 1.7-2.2 ms (4.0-8.3 ms; docs/gpu.md).
UNIQUE_BLOCK_N = 1


def _row_segments(rows: Tensor, unique: bool, mask: Optional[Tensor] = None) -> Segments:
    """Segments over gradient rows: entry e is gradient row e (no bags, no coefficients);
    unique=True: one live segment per row as given (rows known distinct, no sort); a row whose
    mask is False gets an empty one."""
    if unique:
        pos = torch.arange(rows.numel(), device=rows.device)
        return Segments(rows, pos, pos + (1 if mask is None else mask.long()), pos)
    sorted_rows, order, starts, ends = sorted_segments(rows)
    return Segments(sorted_rows, starts, ends, order)


def _check_in_place(storage: Tensor, state: Optional[Tensor]) -> None:
    """Tensors updated in place cannot be copied to a dense layout: the kernels take a row stride
    but address columns (and a row-wise state's rows) at stride 1, so refuse anything else."""
    def dense_last(t: Optional[Tensor]) -> bool:  # a single column (d = 1) has any stride
        return t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1

    if not (dense_last(storage) and dense_last(state)):
        raise ValueError("row_update updates in place: storage/state columns (and a row-wise "
                         "state) must be contiguous")


def _launch_segments(segs: Segments, bag_grad: Tensor, out: Tensor, op: str, *,
                     state: Optional[Tensor] = None, lr: float | Tensor = 0.0, eps: float = 0.0,
                     wd: float = 0.0, block_n: Optional[int] = None,
                     rounding: Optional[StochasticRounding] = None) -> None:
    """One program per (segment, block of d); row-wise Adagrad needs the whole row in one.
    block_n: entries per tile (default: block_sizes'; one-entry segments want 1).
    rounding: stochastic rounding of the written rows (half `out`; keys aligned with the entries)."""
    dim = bag_grad.shape[1]
    tile_n, block_d = block_sizes(dim, dim if op == "rowwise_adagrad" else 256)
    block_n = tile_n if block_n is None else block_n
    dummy = segs.starts
    keys = dummy if rounding is None else rounding.keys.long().contiguous()
    salt = 0 if rounding is None else rounding.salt
    # an int with bit 32 set: never an int argument Triton specialises (0, 1); the kernel keeps 32
    # bits. A tensor: the kernel loads it (a captured step's salt, filled before each replay)
    salt_arg = salt if isinstance(salt, Tensor) else (1 << 32) | salt
    _segment_kernel[(segs.slot.numel(), cdiv(dim, block_d))](
        bag_grad, segs.slot, segs.starts, segs.ends, segs.bags,
        dummy if segs.coef is None else segs.coef,
        out, dummy if state is None else state, keys,
        dim, out.stride(0), 0 if state is None or state.dim() == 1 else state.stride(0), lr, eps, wd,
        salt_arg,
        HAS_COEF=segs.coef is not None, OP=_OPT_CODE[op], HAS_WD=wd != 0.0, SR=rounding is not None,
        LR_IN_MEMORY=isinstance(lr, Tensor), SALT_IN_MEMORY=isinstance(salt, Tensor),
        BF16=out.dtype == torch.bfloat16, BLOCK_N=block_n, BLOCK_D=block_d)


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
        ok = ent_ok[:, None] & col_ok[None, :]
        # The value tile is built with a select, not tl.broadcast_to: Triton's interpreter hands a
        # broadcast straight to its atomic as a view with zero strides, and when BLOCK_D == 1
        # (d = 1) the whole [BLOCK_N, 1] view flattens to one element read BLOCK_N times as if
        # it were contiguous, so entries past the first added whatever memory followed it.
        # A select always yields a real tile (and zeroes masked lanes); compiled code is the same.
        vals = tl.where(ok, g[None, :], 0.0)
        if HAS_WEIGHTS:
            vals = vals * tl.load(weights_ptr + ent, mask=ent_ok, other=0.0).to(g.dtype)[:, None]
        tl.atomic_add(out_ptr + slot[:, None] * dim + cols[None, :], vals, mask=ok, sem="relaxed")


@jit
def _segment_kernel(grad_ptr, slot_ptr, starts_ptr, ends_ptr, bags_ptr, coef_ptr, out_ptr,
                    state_ptr, keys_ptr, dim, stride_out, stride_state, lr, eps, wd, salt,
                    HAS_COEF: tl.constexpr, OP: tl.constexpr, HAS_WD: tl.constexpr,
                    SR: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, LR_IN_MEMORY: tl.constexpr = False,
                    SALT_IN_MEMORY: tl.constexpr = False):
    """Sum one slot's entry gradients in entry order, then write (OP 0) or optimize (OP 1..3);
    HAS_WD adds coupled L2 (g += wd * w) before the optimizer; LR_IN_MEMORY: lr points at the
    rate (one fp32 value) instead of being it; SALT_IN_MEMORY: salt points at the rounding's salt
    (one int64) instead of being it; SR writes the updated row to the
    half-precision storage by stochastic rounding (kernels/rounding.py, repeated here inline: a
    jitted kernel cannot call another), keyed by keys[first entry of the segment].
    An empty segment touches nothing (its slot belongs to another program's live segment)."""
    u = tl.program_id(0).to(tl.int64)
    start = tl.load(starts_ptr + u)
    end = tl.load(ends_ptr + u)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = (cols < dim) & (end > start)
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
    slot = tl.load(slot_ptr + u)
    w_ptrs = out_ptr + slot * stride_out + cols
    if OP == 0:
        tl.store(w_ptrs, g.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        if LR_IN_MEMORY:
            lr = tl.load(lr)
        w = tl.load(w_ptrs, mask=col_ok, other=0.0).to(g.dtype)
        if HAS_WD:
            g = g + wd * w
        if OP == 1:
            w = w - lr * g
        elif OP == 2:
            s_ptrs = state_ptr + slot * stride_state + cols
            s = tl.load(s_ptrs, mask=col_ok, other=0.0).to(g.dtype) + g * g
            tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=col_ok)
            w = w - lr * g / (tl.sqrt(s) + eps)
        else:
            row_ok = tl.sum(col_ok.to(tl.int32), axis=0) > 0
            s = tl.load(state_ptr + slot).to(g.dtype) + tl.sum(g * g, axis=0) / dim
            tl.store(state_ptr + slot, s.to(state_ptr.dtype.element_ty), mask=row_ok)
            w = w - lr * g / (tl.sqrt(s) + eps)
        if SR:
            # e: lowbias32 of (salt, key lo, key hi, column), as kernels/rounding.random_bits
            key = tl.load(keys_ptr + tl.load(bags_ptr + start))
            if SALT_IN_MEMORY:
                salt = tl.load(salt)
            h = key.to(tl.uint32) ^ salt.to(tl.uint32)
            h = h ^ (h >> 16)
            h = h * 0x7FEB352D
            h = h ^ (h >> 15)
            h = h * 0x846CA68B
            h = h ^ (h >> 16)
            h = h ^ (key >> 32).to(tl.uint32) ^ 0x9E3779B9
            h = h ^ (h >> 16)
            h = h * 0x7FEB352D
            h = h ^ (h >> 15)
            h = h * 0x846CA68B
            h = h ^ (h >> 16)
            e = h + cols.to(tl.uint32) * 0x9E3779B9
            e = e ^ (e >> 16)
            e = e * 0x7FEB352D
            e = e ^ (e >> 15)
            e = e * 0x846CA68B
            e = e ^ (e >> 16)
            if BF16:  # add 16 random bits below the kept half of x's bits, truncate
                xb = w.to(tl.uint32, bitcast=True)
                kept = ((xb + (e >> 16)) >> 16).to(tl.uint16)
                kept = tl.where(w == w, kept, 0x7FC0).to(tl.uint16)  # a NaN stays a NaN
                tl.store(w_ptrs, kept.to(tl.bfloat16, bitcast=True), mask=col_ok)
            else:  # y: round to nearest; z: its neighbour on x's side, taken w.p. |x-y| / |z-y|
                u = (e >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
                y = w.to(out_ptr.dtype.element_ty)
                yf = y.to(tl.float32)
                toward = tl.where(tl.abs(w) > tl.abs(yf), 1, -1).to(tl.int16)
                z = (y.to(tl.int16, bitcast=True) + toward).to(out_ptr.dtype.element_ty, bitcast=True)
                take_z = u * tl.abs(z.to(tl.float32) - yf) < tl.abs(w - yf)
                tl.store(w_ptrs, tl.where(take_z, z, y), mask=col_ok)
        else:
            tl.store(w_ptrs, w.to(out_ptr.dtype.element_ty), mask=col_ok)
