"""The pooled gather (kernels/pooled_gather.py): the Triton kernel and its backward against the
reference, on the edge cases (odd widths, block tails, empty bags, strided storage, weights,
sum / mean, fp32 / fp16 / bf16, deterministic mode); compiled at realistic sizes on a GPU.

Shared set-up (Triton's interpreter on CPU machines, the autouse fixtures, bag and storage
factories) is in kernel_helpers.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import (
    DEV,
    DTYPES,
    INDEX_DTYPES,
    _assert_accumulated,
    _row_grad_truth,
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

from kernels import reference as ref
from kernels.pooled_gather import pooled_gather_triton


@needs_triton
@pytest.mark.parametrize("dim", [1, 7, 33])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_gather_forward(dim, dtype, index_dtype, mode, weighted):
    storage = rand_storage(16, dim, dtype)
    slots, offsets = make_bags(3, 2, 5, 16, index_dtype, seed=dim)
    w = rand_weights(slots.numel()) if weighted else None
    got = pooled_gather_triton(storage, slots, offsets, 2, mode, w)
    want = ref.pooled_gather(storage, slots, offsets, 2, mode, w)
    assert got.dtype == torch.float32 and got.shape == (3, 2, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_pooled_gather_block_tails(index_dtype):
    """d=300: two column blocks (256 + tail 44); bags up to 20 entries: tiles of 8 with tails."""
    storage = rand_storage(40, 300, torch.bfloat16)
    slots, offsets = make_bags(2, 2, 20, 40, index_dtype, seed=3)
    w = rand_weights(slots.numel())
    got = pooled_gather_triton(storage, slots, offsets, 2, "mean", w)
    torch.testing.assert_close(got, ref.pooled_gather(storage, slots, offsets, 2, "mean", w),
                               rtol=1e-5, atol=1e-5)


@needs_triton
def test_pooled_gather_all_empty_and_strided_storage():
    big = rand_storage(10, 12, torch.float32)
    storage = big[:, 2:9]  # row stride 12, contiguous columns
    offsets = torch.zeros(7, dtype=torch.int32, device=DEV)
    slots = torch.empty(0, dtype=torch.int32, device=DEV)
    for mode in ("sum", "mean"):
        out = pooled_gather_triton(storage, slots, offsets, 3, mode)
        assert out.shape == (2, 3, 7) and not out.any()
    slots, offsets = make_bags(2, 3, 4, 10)
    torch.testing.assert_close(pooled_gather_triton(storage, slots, offsets, 3),
                               ref.pooled_gather(storage, slots, offsets, 3))


@needs_triton
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dim", [1, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_gather_triton_gradcheck(mode, dim, weighted):
    storage = rand_storage(5, dim, torch.float64).requires_grad_()
    slots, offsets = make_bags(2, 2, 3, 5, torch.int32, seed=4)
    if weighted:
        w = rand_weights(slots.numel()).double().requires_grad_()
        fn = lambda s, ww: pooled_gather_triton(s, slots, offsets, 2, mode, ww)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (storage, w))
    else:
        fn = lambda s: pooled_gather_triton(s, slots, offsets, 2, mode)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (storage,))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dim", [1, 3, 7])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_gather_backward(dtype, mode, deterministic, dim, weighted):
    """Row (and weight) gradients of the Triton gather == the oracle's, at d = 1 (per-id scalars:
    one column block of width 1), odd d and d = 7; unweighted too (no per-entry product)."""
    slots, offsets = make_bags(3, 2, 5, 12, torch.int32, seed=5)
    scale = torch.arange(6.0 * dim, device=DEV).view(3, 2, dim)
    grads = []
    for fn in (pooled_gather_triton, ref.pooled_gather):
        storage = rand_storage(12, dim, dtype).requires_grad_()
        w = rand_weights(slots.numel()).requires_grad_() if weighted else None
        with deterministic_algorithms(deterministic):
            (fn(storage, slots, offsets, 2, mode, w) * scale).sum().backward()
        assert storage.grad.dtype == dtype
        grads.append((storage.grad.float(), None if w is None else w.grad))
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=tol, atol=tol)
    if weighted:
        torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-4)


@needs_triton
# F.embedding_bag takes per_sample_weights with mode="sum" only; weighted mean at d = 1 is checked
# against the oracle in test_pooled_gather_backward.
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_pooled_gather_d1_matches_embedding_bag(mode, weighted, deterministic):
    """Storage [7, 1] (the wide part of WDL / FM's first-order term: one scalar per id) against
    F.embedding_bag, forward and backward, twice: a d = 1 backward once read past a one-element
    value tile (garbage that changed from run to run), so both runs must also agree bit for bit."""
    slots = torch.tensor([0, 3, 3, 6, 1, 2, 5, 4, 0, 0, 6], device=DEV)
    offsets = torch.tensor([0, 2, 4, 4, 7, 11], device=DEV)  # an empty bag, a repeated id
    base = rand_storage(7, 1, torch.float32)
    w = rand_weights(slots.numel()) if weighted else None
    upstream = randn(5, 1, 1, seed=13)
    want_s = base.clone().requires_grad_()
    want = F.embedding_bag(slots, want_s, offsets, mode=mode, include_last_offset=True,
                           per_sample_weights=w)
    want.backward(upstream.view(5, 1))
    runs = []
    for _ in range(2):
        storage = base.clone().requires_grad_()
        with deterministic_algorithms(deterministic):
            got = pooled_gather_triton(storage, slots, offsets, 1, mode, w)
            got.backward(upstream)
        torch.testing.assert_close(got.view(5, 1), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(storage.grad, want_s.grad, rtol=1e-6, atol=1e-6)
        runs.append(storage.grad)
    assert torch.equal(runs[0], runs[1])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 130])
def test_gpu_pooled_gather_and_backward(dtype, dim):
    """Compiled gather and its backward at a realistic size: Zipf ids, so one row takes about half
    of the 10^6 entries. The forward against the reference; the storage gradient (fp32 atomics,
    cast to the storage dtype) against the float64 truth, within fp32 accumulation rounding of
    each element's contributions (the fp32 reference sums in another order and, for half
    storage, accumulates in the half dtype: no yardstick for a hot row)."""
    slots, offsets = _zipf_bags(2048, 8, 64, 100_000, "cuda")
    storage = torch.randn(100_000, dim, device="cuda").to(dtype).requires_grad_()
    w = torch.rand(slots.numel(), device="cuda")
    got = pooled_gather_triton(storage, slots.int(), offsets.int(), 8, "mean", w)
    want = ref.pooled_gather(storage, slots, offsets, 8, "mean", w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(got)
    (gs,) = torch.autograd.grad(got, storage, g)
    assert gs.dtype == dtype
    truth, scale = _row_grad_truth(storage.shape, slots, offsets, 8, "mean", w, g)
    _assert_accumulated(gs, truth, scale, dtype)
