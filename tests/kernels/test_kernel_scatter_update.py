"""The row-gradient scatter and the owner's fused update (kernels/scatter_update.py): the Triton
kernels against the reference for SGD, Adagrad and row-wise Adagrad, repeated rows, odd widths,
strided index views, no host read-back of counts; compiled at realistic sizes on a GPU.

Shared set-up (Triton's interpreter on CPU machines, the autouse fixtures, bag and storage
factories) is in kernel_helpers.py."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    DEV,
    DTYPES,
    INDEX_DTYPES,
    _assert_accumulated,
    _opt_state,
    _row_grad_truth,
    _row_grads,
    _run_row_update,
    _sparse_step,
    _zipf_bags,
    deterministic_algorithms,
    gpu,
    make_bags,
    needs_cuda,
    needs_triton,
    rand_storage,
    rand_weights,
    randn,
)
from torch import Tensor

import kernels
from kernels import reference as ref
from kernels.pooled_gather import pooled_gather_triton
from kernels.scatter_update import accumulate_row_grads_triton, row_update_triton


@needs_triton
@pytest.mark.parametrize("dim", [1, 3, 33])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_accumulate_row_grads(dim, index_dtype, mode, deterministic, weighted):
    slots, offsets = make_bags(3, 3, 6, 10, index_dtype, seed=dim)
    grad = randn(3, 3, dim, seed=6)
    w = rand_weights(slots.numel()) if weighted else None
    got = accumulate_row_grads_triton(grad, slots, offsets, 3, mode, w, 10, deterministic)
    want = ref.accumulate_row_grads(grad, slots, offsets, 3, mode, w, 10)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flat = accumulate_row_grads_triton(grad.reshape(9, dim), slots, offsets, 3, mode, w, 10,
                                       deterministic)
    torch.testing.assert_close(flat, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_accumulate_row_grads_deterministic_is_bitwise_stable():
    slots, offsets = make_bags(4, 2, 12, 6, seed=7)  # heavy duplication
    grad = randn(8, 300)
    runs = [accumulate_row_grads_triton(grad, slots, offsets, 2, num_slots=6, deterministic=True)
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("dim", [1, 3, 33])
@pytest.mark.parametrize("deterministic", [False, True])
def test_sparse_backward_d1_and_odd_widths(optimizer, dim, deterministic):
    """The trainer's scatter + update (row-gradient scatter into the workspace gradient, then the
    owner's row_update) on Triton == on the reference, at d = 1 (per-id scalars), 3 and 33, with
    plain sum pooling and no weights (the path the d = 1 bug was on)."""
    slots, offsets = make_bags(3, 2, 6, 32, torch.int64, seed=14)
    grad = randn(3, 2, dim, seed=15)
    storage, state = rand_storage(16, dim, torch.float32), _opt_state(optimizer, 16, dim)
    outs = []
    for accumulate, update in ((accumulate_row_grads_triton, row_update_triton),
                               (ref.accumulate_row_grads, ref.row_update)):
        s, st = storage.clone(), None if state is None else state.clone()
        with deterministic_algorithms(deterministic):
            _sparse_step(accumulate, update, s, grad, slots, offsets, 2, st, optimizer=optimizer,
                         lr=0.3, eps=1e-8)
        outs.append((s, st))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    if state is not None:
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[0][0], storage)


@needs_triton
def test_strided_index_views_are_read_as_their_elements():
    """Views such as ids[::2] (stride 2) as slots, offsets, weights, owner rows and hash-map ids:
    the kernels address entry i at base + i, so the launchers must make them dense first."""
    def every_other(t: Tensor) -> Tensor:  # same values, stride 2
        return torch.stack([t, torch.full_like(t, 10_000)], 1).reshape(-1)[::2]

    slots, offsets = make_bags(3, 2, 5, 12, torch.int64, seed=16)
    sv, ov = every_other(slots), every_other(offsets)
    w = rand_weights(slots.numel())
    wv = every_other(w)
    assert sv.stride(0) == 2 and torch.equal(sv, slots)
    storage = rand_storage(12, 3, torch.float32).requires_grad_()
    got = pooled_gather_triton(storage, sv, ov, 2, "mean", wv)
    torch.testing.assert_close(got, ref.pooled_gather(storage, slots, offsets, 2, "mean", w))
    grad = randn(3, 2, 3, seed=17)
    torch.testing.assert_close(
        accumulate_row_grads_triton(grad, sv, ov, 2, "sum", wv, 12),
        ref.accumulate_row_grads(grad, slots, offsets, 2, "sum", w, 12))
    idx, grads = _row_grads(10, 40, 3, unique=True)
    got_s, want_s = rand_storage(40, 3, torch.float32), rand_storage(40, 3, torch.float32)
    row_update_triton(got_s, every_other(idx), grads, lr=0.5, unique=True)
    ref.row_update(want_s, idx, grads, lr=0.5, unique=True)
    torch.testing.assert_close(got_s, want_s)
    table, ids = kernels.TritonIdSlotMap(8, DEV), torch.arange(100, 140, device=DEV)
    table.insert(ids, ids * 7)
    gone = ids[::2]
    assert table.erase(gone).all()
    slots_left, miss = table.lookup(ids)
    assert torch.equal(miss.cpu(), torch.arange(40) % 2 == 0)
    assert torch.equal(slots_left[1::2].cpu(), (ids[1::2] * 7).cpu())


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("unique", [False, True])
@pytest.mark.parametrize("dim", [1, 3, 7, 33, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_update(optimizer, unique, dim, dtype):
    """Triton == reference: pushes of several workers for one row (repeats) sum, then one step."""
    idx, grads = _row_grads(24, 40, dim, unique)
    storage, state = rand_storage(40, dim, dtype), _opt_state(optimizer, 40, dim)
    kw = dict(rows=idx, grads=grads, optimizer=optimizer, lr=0.3, eps=1e-8, unique=unique)
    got = _run_row_update(row_update_triton, storage, state, **kw)
    want = _run_row_update(ref.row_update, storage, state, **kw)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=tol, atol=tol)
    if state is not None:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(40, dtype=torch.bool, device=DEV)
    untouched[idx] = False
    assert torch.equal(got[0][untouched], storage[untouched])


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("unique", [False, True])
@pytest.mark.parametrize("dim", [3, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_row_update_stochastic_rounding_is_the_reference_bit_for_bit(optimizer, unique, dim, dtype):
    """Half storage written back by stochastic rounding (kernels/rounding.py): the kernel's inline
    hash and rule choose the same neighbour as the reference for every element (keys with high
    bits, rows repeated: a segment takes its first entry's key); the fp32 state is the reference's.
    Where the kernel's fp32 update differs from the reference's (a GPU's sqrt or FMA), one element
    may round to the other neighbour: one ulp there, bit-equal in the interpreter."""
    from kernels.rounding import StochasticRounding, salt_of

    idx, grads = _row_grads(24, 40, dim, unique)
    storage = (rand_storage(40, dim, torch.float32) * 0.1).to(dtype)
    state = _opt_state(optimizer, 40, dim)
    if state is not None:
        state = state + 0.1
    keys = idx.long() * 1_000_003 + (1 << 33)  # one key per storage row
    kw = dict(rows=idx, grads=grads * 1e-2, optimizer=optimizer, lr=0.5, eps=1e-8, unique=unique,
              rounding=StochasticRounding(salt_of(7, 123), keys))
    got = _run_row_update(row_update_triton, storage, state, **kw)
    want = _run_row_update(ref.row_update, storage, state, **kw)
    nearest = _run_row_update(ref.row_update, storage, state, **{**kw, "rounding": None})
    assert not torch.equal(want[0], nearest[0])  # the rule is in force: not the plain cast
    if DEV == "cpu":
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    else:
        fi = torch.finfo(dtype)
        ulp = want[0].float().abs().clamp_min(fi.tiny) * fi.eps
        assert bool(((got[0].float() - want[0].float()).abs() <= ulp).all())
    if state is not None:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("unique", [False, True])
def test_a_salt_in_device_memory_rounds_as_the_host_salt(dtype, unique):
    """A captured step reads the rounding's salt from a device value (trainer/sparse/embedding/optim.py:
    Rounding.on_device): the kernel and the reference give the same bits from it as from the
    host's int, and it changes with the value (one graph, every step's salt)."""
    from kernels.rounding import StochasticRounding, salt_of

    idx, grads = _row_grads(24, 40, 33, unique)
    storage = (rand_storage(40, 33, torch.float32) * 0.1).to(dtype)
    keys = idx.long() * 1_000_003 + (1 << 33)
    kw = dict(rows=idx, grads=grads * 1e-2, optimizer="adagrad", lr=0.5, eps=1e-8, unique=unique)
    state = _opt_state("adagrad", 40, 33) + 0.1
    host = StochasticRounding(salt_of(7, 123), keys)
    salt = torch.tensor([salt_of(7, 123)], dtype=torch.int64, device=DEV)
    for fn in (row_update_triton, ref.row_update):
        want = _run_row_update(fn, storage, state, **kw, rounding=host)
        got = _run_row_update(fn, storage, state, **kw, rounding=StochasticRounding(salt, keys))
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
        salt.fill_(salt_of(7, 124))
        other = _run_row_update(fn, storage, state, **kw, rounding=StochasticRounding(salt, keys))
        assert not torch.equal(other[0].view(torch.int16), want[0].view(torch.int16))
        assert torch.equal(other[0].view(torch.int16), _run_row_update(
            fn, storage, state, **kw, rounding=StochasticRounding(salt_of(7, 124), keys))[0].view(torch.int16))
        salt.fill_(salt_of(7, 123))


@needs_triton
@pytest.mark.parametrize("rows", [[3], [5, 5, 5, 5], [9, 1, 4], [7, 2, 7, 0, 2, 7, 9, 0]])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_row_update_needs_no_host_count(rows, optimizer):
    """Repeated rows are summed without reading the number of distinct rows back (one program per
    received row, idle unless first of its row): same result as the reference, and no host read or
    data-dependent output size on the way (device_audit records them)."""
    from device_audit import StepAudit

    storage, state = rand_storage(10, 3, torch.float32), _opt_state(optimizer, 10, 3)
    grads = randn(len(rows), 3, seed=18)
    want = _run_row_update(ref.row_update, storage, state, rows=torch.tensor(rows, device=DEV),
                           grads=grads, optimizer=optimizer, lr=0.4)
    with StepAudit() as audit:
        idx = torch.tensor(rows, device=DEV)  # made with a device: the audit follows it
        g = grads.to(DEV)
        s, st = storage.clone().to(DEV), None if state is None else state.clone().to(DEV)
        audit.recording = True
        row_update_triton(s, idx, g, optimizer=optimizer, lr=0.4, state=st)
        audit.recording = False
    torch.testing.assert_close(s, want[0])
    if st is not None:
        torch.testing.assert_close(st, want[1])
    assert not [str(r) for r in audit.records if r.kind in ("host", "shape", "mix")]


@needs_triton
@pytest.mark.parametrize("fn", [ref.row_update, row_update_triton], ids=["reference", "triton"])
def test_row_update_is_a_scatter_of_one_entry_bags_then_a_unique_update(fn):
    """The owner's update of repeated rows == summing them as bags of one entry (the gather's
    row-gradient scatter), then one update per distinct row."""
    idx, grads = _row_grads(30, 20, 5, unique=False)
    storage, state = rand_storage(20, 5, torch.float32), _opt_state("adagrad", 20, 5)
    got = _run_row_update(fn, storage, state, rows=idx, grads=grads, optimizer="adagrad", lr=0.2)
    s, st = storage.clone(), state.clone()
    _sparse_step(ref.accumulate_row_grads, ref.row_update, s, grads[:, None, :], idx,
                 torch.arange(idx.numel() + 1, device=DEV), 1, st, optimizer="adagrad", lr=0.2)
    torch.testing.assert_close(got[0], s)
    torch.testing.assert_close(got[1], st)


@needs_triton
def test_row_update_validation_and_empty():
    storage = torch.zeros(4, 3, device=DEV)
    for fn in (ref.row_update, row_update_triton):
        with pytest.raises(ValueError, match="state"):
            fn(storage, torch.tensor([1], device=DEV), torch.ones(1, 3, device=DEV), optimizer="adagrad")
        with pytest.raises(ValueError, match="grads"):
            fn(storage, torch.tensor([1, 2], device=DEV), torch.ones(1, 3, device=DEV))
        fn(storage, torch.empty(0, dtype=torch.int64, device=DEV), torch.empty(0, 3, device=DEV))
    assert not storage.any()


@gpu
@needs_cuda
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_gpu_sparse_backward(optimizer):
    """The trainer's scatter + update at a realistic size (Zipf ids, repeats), compiled Triton vs
    the reference, and the owner's update of repeated rows (several workers' pushes, one row
    repeated ~28k times). In float64 both must agree to rounding (the kernels' logic: segments,
    hot rows, every optimizer); in fp32 the scatter is checked against the float64 truth within
    fp32 accumulation rounding, and the update of the same gradients elementwise."""
    rows, dim = 100_000, 128
    slots, offsets = _zipf_bags(2048, 8, 64, rows, "cuda")
    grad = torch.randn(2048, 8, dim, device="cuda", dtype=torch.float64)
    storage = torch.randn(rows, dim, device="cuda", dtype=torch.float64)
    state = {"sgd": None, "adagrad": torch.rand(rows, dim, device="cuda", dtype=torch.float64),
             "rowwise_adagrad": torch.rand(rows, device="cuda", dtype=torch.float64)}[optimizer]
    pushed = slots[: 50_000].clone()
    pushed_grads = torch.randn(pushed.numel(), dim, device="cuda", dtype=torch.float64)
    outs = []
    lr = 2.0 ** -4  # Triton passes a float argument as fp32: a learning rate fp32 holds exactly
    for accumulate, update in ((accumulate_row_grads_triton, row_update_triton),
                               (ref.accumulate_row_grads, ref.row_update)):
        s, st = storage.clone(), None if state is None else state.clone()
        _sparse_step(accumulate, update, s, grad, slots, offsets, 8, st, optimizer=optimizer, lr=lr)
        update(s, pushed, pushed_grads, optimizer=optimizer, lr=lr, state=st)
        outs.append((s, st))
    for a, b in zip(outs[0], outs[1]):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    # fp32: the scatter against the float64 truth, then the same workspace gradient updated by both
    uniq, inverse = torch.unique(slots, return_inverse=True)
    ws = accumulate_row_grads_triton(grad.float(), inverse, offsets, 8, num_slots=uniq.numel())
    ones = torch.ones(slots.numel(), device="cuda")
    truth, scale = _row_grad_truth((uniq.numel(), dim), inverse, offsets, 8, "sum", ones, grad)
    _assert_accumulated(ws, truth, scale, torch.float32)
    kw = dict(rows=uniq, grads=ws, optimizer=optimizer, lr=0.05, unique=True)
    state32 = None if state is None else state.float()
    updated = [_run_row_update(update, storage.float(), state32, **kw)
               for update in (row_update_triton, ref.row_update)]
    for a, b in zip(updated[0], updated[1]):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_masked_update_equals_the_update_of_the_live_rows(optimizer, dtype, weight_decay):
    """row_update(mask=): the padded owner update of a capturable step (trainer/sparse/embedding/fixed/padded.py).
    On the live rows it equals the update of those rows alone, bit for bit, in the reference
    (whose arithmetic the CPU step runs) and within float tolerance in Triton; every masked row
    and its state stay exactly as they were: with weight decay (the reference selects the old
    rows) and without (a zero gradient's step, kernels.reference.zero_step_is_identity)."""
    rows, dim, live = 60, 5, 7
    storage = rand_storage(rows, dim, dtype)
    state = _opt_state(optimizer, rows, dim)
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(4))[:20].to(DEV)
    grads = randn(20, dim).to(DEV)
    mask = torch.arange(20, device=DEV) < live
    kw = dict(optimizer=optimizer, lr=0.3, eps=1e-8, unique=True, weight_decay=weight_decay)
    want_w, want_s = _run_row_update(ref.row_update, storage, state, rows=idx[:live], grads=grads[:live], **kw)
    for fn in (ref.row_update, row_update_triton):
        got_w, got_s = _run_row_update(fn, storage, state, rows=idx, grads=grads, mask=mask, **kw)
        exact = {"rtol": 0, "atol": 0} if fn is ref.row_update else {}  # Triton: dtype's default tolerance
        torch.testing.assert_close(got_w, want_w, **exact)
        if state is not None:
            torch.testing.assert_close(got_s, want_s, **exact)
            assert torch.equal(got_s[idx[live:]], state[idx[live:]])
        assert torch.equal(got_w[idx[live:]], storage[idx[live:]])


def test_masked_update_needs_distinct_rows():
    storage = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="mask needs unique=True"):
        ref.row_update(storage, torch.tensor([0, 0]), torch.ones(2, 2), mask=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="mask must be bool"):
        ref.row_update(storage, torch.tensor([0, 1]), torch.ones(2, 2), unique=True, mask=torch.tensor([1, 0]))


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("masked", [False, True])
def test_a_rate_read_from_the_device_equals_the_float_rate(optimizer, masked):
    """lr as a one-element fp32 tensor (what a captured step passes, so that one CUDA graph follows
    a warmup or a decay): the Triton kernel reads it on the device and writes bit for bit what the
    float rate writes; the reference reads it to the host (the same arithmetic); a rate of another
    shape, dtype or device is refused."""
    rows, dim = 50, 6
    storage, state = rand_storage(rows, dim, torch.float32), _opt_state(optimizer, rows, dim)
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(2))[:17].to(DEV)
    grads = randn(17, dim).to(DEV)
    mask = (torch.arange(17, device=DEV) % 3 != 0) if masked else None
    kw = dict(rows=idx, grads=grads, optimizer=optimizer, eps=1e-8, unique=True, weight_decay=0.01, mask=mask)
    rate = torch.tensor([0.37], device=DEV)
    for fn in (row_update_triton, ref.row_update):
        want = _run_row_update(fn, storage, state, lr=0.37, **kw)
        got = _run_row_update(fn, storage, state, lr=rate, **kw)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        if state is not None:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        for bad in (torch.tensor([0.37, 0.1], device=DEV), torch.tensor([0.37], dtype=torch.float64, device=DEV)):
            with pytest.raises(ValueError, match="lr as a tensor must be one float32 value"):
                _run_row_update(fn, storage, state, lr=bad, **kw)
