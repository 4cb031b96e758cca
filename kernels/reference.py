"""Pure-torch reference of every kernel: the CPU path of the trainer and the oracle of the tests.

Why plain torch ops (index_select / index_add_) instead of F.embedding_bag: they give one code path
for every dtype rule we promise (fp32 accumulation for fp16/bf16 storage, int32 or int64 indices,
per-sample weights with ``mean``) and autograd for free, including a dense gradient for ``storage``
and a gradient for ``per_sample_weights``.

Layout shared by all kernels ("sample-major bags"):
    storage  [S, d]       one slot space (shard rows, cache rows, replicated rows)
    slots    [N]          int32|int64, slot of every looked-up id, bag after bag
    offsets  [B*T + 1]    int32|int64, bag j = entries offsets[j]:offsets[j+1], sample j // T,
                          table j % T
    per_sample_weights [N] optional float, multiplies each row before pooling
Pooling: sum, or mean = weighted sum / number of entries (an empty bag gives zeros).
Accumulation is float32 (float64 for float64 inputs, which gradcheck uses).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from kernels.id_slot_map_reference import ReferenceIdSlotMap  # noqa: F401 (the reference backend's id -> slot map)
from kernels.rounding import StochasticRounding, round_rows

MODES = ("sum", "mean")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


# ----------------------------------------------------------------------------- shared helpers


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (gradcheck); everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_bags(slots: Tensor, offsets: Tensor, num_tables: int, mode: str) -> int:
    """Validate the bag layout; return the number of samples B. Shape checks only (no sync)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if slots.dim() != 1 or offsets.dim() != 1:
        raise ValueError("slots [N] and offsets [B*T+1] must be 1-D")
    for name, t in (("slots", slots), ("offsets", offsets)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if num_tables < 1 or offsets.numel() < 1 or (offsets.numel() - 1) % num_tables:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; expected B*T+1 with T={num_tables}"
        )
    return (offsets.numel() - 1) // num_tables


def check_weights(per_sample_weights: Optional[Tensor], slots: Tensor) -> None:
    """per_sample_weights, when given, is a float [N] aligned with slots."""
    if per_sample_weights is None:
        return
    if per_sample_weights.shape != slots.shape or not per_sample_weights.is_floating_point():
        raise ValueError("per_sample_weights must be a float tensor shaped like slots [N]")


def bag_lengths(offsets: Tensor) -> Tensor:
    """Entries per bag. offsets [B*T+1] -> [B*T] int64."""
    return (offsets[1:] - offsets[:-1]).long()


def entry_bags(offsets: Tensor, num_entries: int) -> Tensor:
    """Bag index of every entry. offsets [B*T+1] -> [N] int64."""
    bags = torch.arange(offsets.numel() - 1, device=offsets.device)
    return torch.repeat_interleave(bags, bag_lengths(offsets), output_size=num_entries)


# CPU-only shortcuts that read values on the host (free there, a sync on a GPU): one_per_bag here,
# trainer/device.positions' torch.nonzero. The step audit (tests/device_audit.py) turns this off to
# audit on the CPU the path a GPU takes.
CPU_SHORTCUTS = True


def one_per_bag(offsets: Tensor, num_entries: int) -> bool:
    """Whether every bag holds exactly one entry (one-hot features: Criteo, the bench workload).
    Read on the CPU only, where it costs one compare over the offsets; elsewhere False (the
    general path reads nothing back)."""
    return (CPU_SHORTCUTS and offsets.device.type == "cpu" and num_entries == offsets.numel() - 1
            and bool(torch.equal(offsets, torch.arange(num_entries + 1, dtype=offsets.dtype))))


def entry_coefficients(
    offsets: Tensor,
    num_entries: int,
    mode: str,
    per_sample_weights: Optional[Tensor],
    dtype: torch.dtype,
) -> Optional[Tensor]:
    """Factor each entry's row is multiplied by (weight, / bag length for mean). -> [N] or None."""
    coef = None
    if per_sample_weights is not None:
        coef = per_sample_weights.to(dtype)
    if mode == "mean":
        inv = 1.0 / bag_lengths(offsets).clamp_min(1).to(dtype)
        inv = inv.index_select(0, entry_bags(offsets, num_entries))
        coef = inv if coef is None else coef * inv
    return coef


# ----------------------------------------------------------------------------- pooled gather


def pooled_gather(
    storage: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    mode: str = "sum",
    per_sample_weights: Optional[Tensor] = None,
) -> Tensor:
    """Pooled lookup. storage [S, d], slots [N], offsets [B*T+1] -> [B, T, d] float32.

    Differentiable w.r.t. storage (dense grad [S, d] in storage's dtype) and per_sample_weights.
    """
    batch = check_bags(slots, offsets, num_tables, mode)
    check_weights(per_sample_weights, slots)
    acc = accumulation_dtype(storage.dtype)
    num_entries, dim = slots.numel(), storage.shape[1]
    rows = storage.index_select(0, slots.long()).to(acc)
    coef = entry_coefficients(offsets, num_entries, mode, per_sample_weights, acc)
    if coef is not None:
        rows = rows * coef[:, None]
    out = rows.new_zeros(offsets.numel() - 1, dim)
    out = out.index_add(0, entry_bags(offsets, num_entries), rows)
    return out.view(batch, num_tables, dim)


def pooled_gather_torch(
    storage: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    mode: str = "sum",
    per_sample_weights: Optional[Tensor] = None,
) -> Tensor:
    """The CPU path of pooled_gather: F.embedding_bag forward and an index_add_ backward where they
    have the same semantics, else the oracle above. Same contract as pooled_gather (tests check).

    Why a custom backward: embedding_bag's CPU backward sorts the indices and costs ~30x its
    forward; the gradient of a pooled gather is one index_select + index_add_ (accumulate_row_grads).
    """
    weighted_grad = per_sample_weights is not None and per_sample_weights.requires_grad
    fast = storage.dtype in (torch.float32, torch.float64) and not weighted_grad and (
        per_sample_weights is None or mode == "sum")
    if not fast:
        return pooled_gather(storage, slots, offsets, num_tables, mode, per_sample_weights)
    check_bags(slots, offsets, num_tables, mode)
    check_weights(per_sample_weights, slots)
    return _FastPooledGather.apply(storage, slots, offsets, num_tables, mode, per_sample_weights)


class _FastPooledGather(torch.autograd.Function):
    """storage [S, d] -> [B, T, d]; backward gives the dense [S, d] gradient of storage."""

    @staticmethod
    def forward(ctx, storage, slots, offsets, num_tables, mode, per_sample_weights):
        psw = None if per_sample_weights is None else per_sample_weights.to(storage.dtype)
        out = torch.nn.functional.embedding_bag(
            slots.long(), storage, offsets.long(), mode=mode, include_last_offset=True,
            per_sample_weights=psw)
        ctx.save_for_backward(slots, offsets, per_sample_weights)
        ctx.num_tables, ctx.mode, ctx.num_slots = num_tables, mode, storage.shape[0]
        return out.view(-1, num_tables, storage.shape[1])

    @staticmethod
    def backward(ctx, grad):
        slots, offsets, psw = ctx.saved_tensors
        g = accumulate_row_grads(grad.contiguous(), slots, offsets, ctx.num_tables, ctx.mode, psw,
                                 ctx.num_slots)
        return g.to(grad.dtype), None, None, None, None, None


# ----------------------------------------------------------------------------- gradient scatter


def entry_grads(
    grad: Tensor,
    slots: Tensor,
    offsets: Tensor,
    num_tables: int,
    mode: str,
    per_sample_weights: Optional[Tensor],
) -> Tensor:
    """Gradient reaching every entry's row. grad [B, T, d] or [B*T, d] -> [N, d] float32."""
    check_bags(slots, offsets, num_tables, mode)
    check_weights(per_sample_weights, slots)
    acc = accumulation_dtype(grad.dtype)
    bag_grad = grad.reshape(offsets.numel() - 1, -1).to(acc)
    num_entries = slots.numel()
    if per_sample_weights is None and one_per_bag(offsets, num_entries):
        return bag_grad  # entry j is bag j, and a mean over one entry is the entry itself
    rows = bag_grad.index_select(0, entry_bags(offsets, num_entries))
    coef = entry_coefficients(offsets, num_entries, mode, per_sample_weights, acc)
    return rows if coef is None else rows * coef[:, None]


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
    """Sum of entry gradients per slot. grad [B, T, d] | [B*T, d] -> [num_slots, d] float32.

    Duplicates within and across bags add up. index_add_ on CPU adds in entry order (deterministic);
    ``deterministic`` is accepted for interface parity with the Triton launcher.
    """
    del deterministic
    rows = entry_grads(grad, slots, offsets, num_tables, mode, per_sample_weights)
    if num_slots is None:
        num_slots = int(slots.max()) + 1 if slots.numel() else 0
    out = rows.new_zeros(num_slots, rows.shape[1])
    return out.index_add_(0, slots.long(), rows)


def sum_by_slot(slots: Tensor, rows: Tensor) -> Tuple[Tensor, Tensor]:
    """Sum rows that share a slot. slots [n], rows [n, d] -> (unique slots [U] ascending, [U, d]).

    Sums in entry order per slot (index_add_ on CPU is sequential, hence deterministic).
    """
    uniq, inverse = torch.unique(slots.long(), return_inverse=True)
    out = rows.new_zeros(uniq.numel(), rows.shape[1])
    return uniq, out.index_add_(0, inverse, rows)


def sum_repeats(slots: Tensor, rows: Tensor, num_slots: int) -> Tuple[Tensor, Tensor]:
    """Sum rows that share a slot, without sorting. slots [n] in [0, num_slots), rows [n, d] ->
    (distinct slots [U] in order of first occurrence, [U, d] their sums). The same sums as
    sum_by_slot, bit for bit: each slot's first row, then its repeats added in entry order.

    Why: torch.unique sorts (the owner update's largest cost on the CPU, ~1.3 ms for 26k rows);
    here one scratch array over the slot space (kept per size and device, unset between calls)
    finds each entry's first occurrence in a few linear passes."""
    _, uniq, out = first_and_sums(slots, rows, num_slots)
    return uniq, out


def first_and_sums(slots: Tensor, rows: Tensor, num_slots: int) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """sum_repeats, also giving the entry position of each distinct slot's first occurrence (None
    when every entry is distinct: the positions are then 0..n-1), so that values aligned with the
    entries (a stochastic rounding's row keys) can follow the sums."""
    n = slots.numel()
    slots = slots.long()
    key = (str(slots.device), num_slots)
    scratch = _SCRATCH.get(key)
    if scratch is None:  # [num_slots] int32 (4 bytes per storage row), every entry _UNSET
        scratch = _SCRATCH[key] = torch.full((num_slots,), _UNSET, dtype=torch.int32, device=slots.device)
    at = torch.arange(n, dtype=torch.int32, device=slots.device)
    try:
        scratch.scatter_reduce_(0, slots, at, reduce="amin")  # deterministic, unlike index_copy_ of repeats
        first_of = scratch.index_select(0, slots)  # [n] position of each entry's first occurrence
        scratch.index_fill_(0, slots, _UNSET)
    except BaseException:  # a slot out of range: the scratch may hold some positions, so drop it
        del _SCRATCH[key]
        raise
    first = first_of == at
    keep = torch.nonzero(first).squeeze(1)
    if keep.numel() == n:
        return None, slots, rows
    out = rows.index_select(0, keep)
    rep = torch.nonzero_static(~first, size=n - keep.numel()).squeeze(1)  # the repeats (count known)
    compact = torch.cumsum(first, 0) - 1  # [n] rank among the first occurrences
    out.index_add_(0, compact.index_select(0, first_of.index_select(0, rep).long()), rows.index_select(0, rep))
    return keep, slots.index_select(0, keep), out


_UNSET = torch.iinfo(torch.int32).max
_SCRATCH: dict[tuple[str, int], Tensor] = {}  # (device, slots) -> sum_repeats' scratch, unset between calls


# ----------------------------------------------------------------------------- sparse optimizer


def check_update_args(storage: Tensor, state: Optional[Tensor], optimizer: str) -> None:
    """Shape contract of the sparse optimizer update (fails early with a clear message)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if storage.dim() != 2:
        raise ValueError("storage must be [S, d]")
    want = {"sgd": None, "adagrad": tuple(storage.shape), "rowwise_adagrad": (storage.shape[0],)}
    shape = want[optimizer]
    if shape is not None and (state is None or tuple(state.shape) != shape):
        raise ValueError(f"{optimizer} needs state of shape {shape}")


def optimizer_step_(
    rows: Tensor,
    state_rows: Optional[Tensor],
    grads: Tensor,
    optimizer: str,
    lr: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """One sparse step, in place on gathered copies. rows, grads [U, d]; state_rows [U, d] | [U].

    The one formula of every sparse optimizer on the reference path (the Triton kernels repeat it
    in-kernel and are tested against it). Same ops as torch.optim (tests check):
    SGD: w -= lr * g. Adagrad (torch.optim.Adagrad, lr_decay=0): state += g*g;
    w -= lr * g / (sqrt(state) + eps). Row-wise Adagrad keeps one accumulator per row and adds
    mean(g*g) over d (FBGEMM's EXACT_ROWWISE_ADAGRAD). In place because this is the CPU hot path:
    no temporaries beyond sqrt(state).
    weight_decay > 0 is coupled L2, torch.optim's weight_decay: g <- g + wd * w (the row before the
    step) for every optimizer, so it also enters Adagrad's accumulator; once per row per call.
    """
    if weight_decay:
        grads = grads.add(rows, alpha=weight_decay)
    if optimizer == "sgd":
        rows.add_(grads, alpha=-lr)
        return
    if optimizer == "adagrad":
        state_rows.addcmul_(grads, grads)
        rows.addcdiv_(grads, state_rows.sqrt().add_(eps), value=-lr)
        return
    state_rows.add_((grads * grads).mean(dim=1))
    rows.addcdiv_(grads, state_rows.sqrt().add_(eps)[:, None], value=-lr)


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
    """Sparse optimizer on row gradients, in place: the owner's update (store.apply).

    storage [S, d]; rows [n] int32|int64 storage rows, repeated when several pushes hit one row;
    grads [n, d]; state [S, d] (adagrad), [S] (rowwise_adagrad) or None (sgd). The gradients of a
    row are summed first, then the optimizer runs once per distinct row. unique=True: rows are
    known distinct, skip the sum.
    weight_decay: coupled L2 added to each distinct row's summed gradient (optimizer_step_).
    Half-precision storage: the rows are updated in fp32 and written back by `rounding`'s
    stochastic rule (kernels/rounding.py; its keys [n] align with `rows`), or rounded to nearest
    when it is None. The state is whatever dtype it is (the trainer keeps it fp32).
    mask [n] bool (with unique=True only): rows where it is False are left exactly as they are
    (row and state): the padding rows of a fixed-size update (trainer/sparse/embedding/fixed/padded.py).
    lr may be a one-element fp32 tensor (the Triton kernel reads it on the device); here it is
    read to the host first, so the arithmetic is the float rate's.
    """
    check_update_args(storage, state, optimizer)
    check_lr(lr, storage)
    lr = float(lr)
    if grads.dim() != 2 or grads.shape[0] != rows.numel() or grads.shape[1] != storage.shape[1]:
        raise ValueError(f"grads must be [len(rows), d] = [{rows.numel()}, {storage.shape[1]}]")
    check_rounding(rounding, rows)
    check_mask(mask, rows, unique)
    grads = grads.to(accumulation_dtype(grads.dtype))
    if unique:
        _update_rows(storage, state, rows.long(), grads, optimizer, lr, eps, weight_decay, rounding, mask)
        return
    keep, uniq, summed = first_and_sums(rows, grads, storage.shape[0])
    if rounding is not None and keep is not None:
        rounding = StochasticRounding(rounding.salt, rounding.keys.index_select(0, keep))
    _update_rows(storage, state, uniq, summed, optimizer, lr, eps, weight_decay, rounding)


def check_rounding(rounding: Optional[StochasticRounding], rows: Tensor) -> None:
    """A stochastic rounding carries one key per entry of rows."""
    if rounding is not None and tuple(rounding.keys.shape) != (rows.numel(),):
        raise ValueError(f"rounding.keys must be [len(rows)] = [{rows.numel()}], got {tuple(rounding.keys.shape)}")


def check_mask(mask: Optional[Tensor], rows: Tensor, unique: bool) -> None:
    """A row mask is [len(rows)] bool and comes with unique=True (distinct rows: a masked row is
    written back as it was, which two entries of one row would race on)."""
    if mask is None:
        return
    if not unique:
        raise ValueError("row_update: mask needs unique=True (distinct rows)")
    if mask.dtype != torch.bool or tuple(mask.shape) != (rows.numel(),):
        raise ValueError(f"row_update: mask must be bool [len(rows)] = [{rows.numel()}], got "
                         f"{mask.dtype} {tuple(mask.shape)}")


def check_lr(lr: float | Tensor, storage: Tensor) -> None:
    """A rate given as a tensor is one fp32 value on the storage's device."""
    if isinstance(lr, Tensor) and (lr.numel() != 1 or lr.dtype != torch.float32 or lr.device != storage.device):
        raise ValueError(f"lr as a tensor must be one float32 value on {storage.device}, got "
                         f"{tuple(lr.shape)} {lr.dtype} on {lr.device}")


def zero_step_is_identity(optimizer: str, lr: float, eps: float, weight_decay: float) -> bool:
    """Whether a zero gradient leaves a row and its state exactly as they are (bit for bit):
    SGD w + (-lr) * 0 = w; Adagrad (row-wise too) s + 0 * 0 = s and w + (-lr) * (0 / (sqrt(s) +
    eps)) = w, the quotient 0 since eps > 0 and s >= 0 keep the divisor positive (a NaN state,
    which a real step would make NaN anyway, excepted); coupled weight decay adds wd * w: not the
    identity. Then a masked row needs only its gradient zeroed (one select, no copy of the rows)."""
    return weight_decay == 0 and math.isfinite(lr) and (optimizer == "sgd" or eps > 0)


def _update_rows(
    storage: Tensor,
    state: Optional[Tensor],
    rows_idx: Tensor,
    grads: Tensor,
    optimizer: str,
    lr: float,
    eps: float,
    weight_decay: float = 0.0,
    rounding: Optional[StochasticRounding] = None,
    mask: Optional[Tensor] = None,
) -> None:
    """Apply the optimizer to distinct storage[rows_idx] (and state) in place; half storage is
    written back by `rounding` (keys aligned with rows_idx) or to nearest. mask: rows where it is
    False are written back as they were (the same ops on every row, a select before the copy).

    Gather, update, copy back: index_add_ of the step would be ~4x slower on CPU for rows scattered
    over a large table.
    """
    acc = grads.dtype
    if mask is not None and zero_step_is_identity(optimizer, lr, eps, weight_decay):
        grads, mask = torch.where(mask[:, None], grads, 0.0), None  # masked rows: a zero gradient
    with torch.no_grad():
        old = storage.index_select(0, rows_idx)
        rows = old.to(acc, copy=mask is not None)
        old_st = None if state is None else state.index_select(0, rows_idx)
        st = None if old_st is None else old_st.to(acc, copy=mask is not None)
        optimizer_step_(rows, st, grads, optimizer, lr, eps, weight_decay)
        new = round_rows(rows, storage.dtype, rounding)
        if mask is not None:
            new = torch.where(mask[:, None], new, old)
            st = None if st is None else torch.where(mask if st.dim() == 1 else mask[:, None], st, old_st.to(acc))
        storage.index_copy_(0, rows_idx, new)
        if st is not None:
            state.index_copy_(0, rows_idx, st.to(state.dtype))
