"""The pure-torch reference kernels (kernels/reference.py, also the CPU path) against torch itself:
nn.EmbeddingBag, torch.optim, Python loops, and the exact sum order of repeated rows.

Shared set-up (Triton's interpreter on CPU machines, the autouse fixtures, bag and storage
factories) is in kernel_helpers.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DTYPES, INDEX_DTYPES, _sparse_step, make_bags, rand_storage, rand_weights, randn

from kernels import reference as ref


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_reference_matches_embedding_bag(mode: str, weighted: bool, index_dtype: torch.dtype):
    storage = rand_storage(20, 5, torch.float64, device="cpu")
    slots, offsets = make_bags(4, 3, 6, 20, index_dtype, device="cpu")
    w = rand_weights(slots.numel(), device="cpu").double() if weighted else None
    got = ref.pooled_gather(storage, slots, offsets, 3, mode, w)
    if weighted and mode == "mean":  # embedding_bag has no weighted mean: weighted sum / length
        lengths = ref.bag_lengths(offsets).clamp_min(1).double()
        want = F.embedding_bag(slots.long(), storage, offsets.long(), mode="sum",
                               per_sample_weights=w, include_last_offset=True) / lengths[:, None]
    else:
        want = F.embedding_bag(slots.long(), storage, offsets.long(), mode=mode,
                               per_sample_weights=w, include_last_offset=True)
    assert got.shape == (4, 3, 5)
    torch.testing.assert_close(got.reshape(12, 5), want)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_matches_oracle(mode: str, weighted: bool, dtype: torch.dtype):
    """pooled_gather_torch (the trainer's CPU path) == the oracle, forward and backward."""
    storage = rand_storage(20, 7, dtype, device="cpu")
    slots, offsets = make_bags(5, 3, 6, 20, torch.int64, device="cpu")
    w = rand_weights(slots.numel(), device="cpu") if weighted else None
    a = storage.clone().requires_grad_(True)
    b = storage.clone().requires_grad_(True)
    got = ref.pooled_gather_torch(a, slots, offsets, 3, mode, w)
    want = ref.pooled_gather(b, slots, offsets, 3, mode, w)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    g = randn(5, 3, 7)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_dtype_rules(dtype: torch.dtype):
    storage = rand_storage(8, 3, dtype, device="cpu").requires_grad_()
    slots, offsets = make_bags(2, 2, 4, 8, torch.int32, device="cpu")
    out = ref.pooled_gather(storage, slots, offsets, 2)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert storage.grad.dtype == dtype and storage.grad.shape == storage.shape


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_reference_gradcheck(mode: str):
    storage = rand_storage(6, 3, torch.float64, device="cpu").requires_grad_()
    slots, offsets = make_bags(2, 2, 4, 6, device="cpu")
    w = rand_weights(slots.numel(), device="cpu").double().requires_grad_()
    fn = lambda s, ww: ref.pooled_gather(s, slots, offsets, 2, mode, ww)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (storage, w))


def test_reference_adagrad_matches_torch_optim():
    storage = rand_storage(12, 4, torch.float32, device="cpu")
    dense = torch.nn.Parameter(storage.clone())
    opt = torch.optim.Adagrad([dense], lr=0.1, eps=1e-10)
    state = torch.zeros_like(storage)
    for step in range(3):
        slots, offsets = make_bags(3, 2, 5, 12, seed=step, device="cpu")
        grad = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(10 + step))
        _sparse_step(ref.accumulate_row_grads, ref.row_update, storage, grad, slots, offsets, 2,
                     state, optimizer="adagrad", lr=0.1, eps=1e-10)
        dense.grad = ref.accumulate_row_grads(grad, slots, offsets, 2, num_slots=12)
        opt.step()
    torch.testing.assert_close(storage, dense.detach())
    torch.testing.assert_close(state, opt.state[dense]["sum"])


def test_reference_sgd_matches_torch_optim():
    storage = rand_storage(10, 3, torch.float32, device="cpu")
    dense = torch.nn.Parameter(storage.clone())
    slots, offsets = make_bags(3, 2, 5, 10, device="cpu")
    grad = torch.randn(3, 2, 3)
    _sparse_step(ref.accumulate_row_grads, ref.row_update, storage, grad, slots, offsets, 2,
                 optimizer="sgd", lr=0.5)
    dense.grad = ref.accumulate_row_grads(grad, slots, offsets, 2, num_slots=10)
    torch.optim.SGD([dense], lr=0.5).step()
    torch.testing.assert_close(storage, dense.detach())


def test_reference_accumulate_matches_python_loop():
    slots, offsets = make_bags(3, 2, 5, 8, device="cpu")
    grad = torch.randn(6, 4, dtype=torch.float64)
    w = rand_weights(slots.numel(), device="cpu").double()
    want = torch.zeros(8, 4, dtype=torch.float64)
    for bag in range(6):
        lo, hi = int(offsets[bag]), int(offsets[bag + 1])
        for e in range(lo, hi):
            want[slots[e]] += w[e] * grad[bag] / max(hi - lo, 1)
    got = ref.accumulate_row_grads(grad, slots, offsets, 2, "mean", w, 8)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_reference_accumulate_one_entry_bags_fast_path(mode):
    """Bags of exactly one entry skip the entry gather (one_per_bag): the same sums, bit for bit,
    as the general path (a layout with an empty and a two-entry bag is not taken for one)."""
    slots = torch.tensor([4, 1, 4, 0, 1, 4])
    offsets = torch.arange(7)
    grad = torch.randn(3, 2, 5)
    assert ref.one_per_bag(offsets, 6)
    got = ref.accumulate_row_grads(grad, slots, offsets, 2, mode, None, 6)
    want = torch.zeros(6, 5).index_add_(0, slots, grad.reshape(6, 5))
    assert torch.equal(got, want)
    assert not ref.one_per_bag(torch.tensor([0, 0, 2, 3, 4, 5, 6]), 6)
    uneven = ref.accumulate_row_grads(grad, slots, torch.tensor([0, 0, 2, 3, 4, 5, 6]), 2, "sum", None, 6)
    assert not torch.equal(uneven, want)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sum_repeats_equals_the_sorted_sum_bit_for_bit(index_dtype):
    """The owner update's sort-free sum of repeated rows: the rows of sum_by_slot (torch.unique),
    in first-occurrence order, each sum bit-equal (first row, then repeats in entry order), and the
    scratch left unset for the next call."""
    gen = torch.Generator().manual_seed(3)
    for n, space in ((0, 10), (1, 10), (50, 1000), (400, 37)):  # none, one, few repeats, many
        slots = torch.randint(0, space, (n,), generator=gen).to(index_dtype)
        rows = torch.randn(n, 3, generator=gen)
        got_slots, got = ref.sum_repeats(slots, rows, space)
        want_slots, want = ref.sum_by_slot(slots, rows)
        order = torch.argsort(got_slots)
        assert torch.equal(got_slots[order], want_slots) and torch.equal(got[order], want)
        firsts = [int(s) for k, s in enumerate(slots.tolist()) if s not in slots.tolist()[:k]]
        assert got_slots.tolist() == firsts
        assert bool((ref._SCRATCH[("cpu", space)] == ref._UNSET).all())
    with pytest.raises((IndexError, RuntimeError)):  # a slot outside the space: refused, scratch dropped
        ref.sum_repeats(torch.tensor([1, 5, 40]), torch.zeros(3, 2), 37)
    assert ("cpu", 37) not in ref._SCRATCH
    assert ref.sum_repeats(torch.tensor([2, 2]), torch.ones(2, 1), 37)[1].tolist() == [[2.0]]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_reference_row_update_matches_torch_optim(optimizer: str):
    """Row gradients with repeats, 3 steps, Adagrad's accumulator starting at 0.1 (the trainer's
    default): the same as torch.optim on a dense parameter whose grad is the per-row sum."""
    storage = rand_storage(15, 4, torch.float32, device="cpu")
    dense = torch.nn.Parameter(storage.clone())
    state = torch.full_like(storage, 0.1) if optimizer == "adagrad" else None
    opt = (torch.optim.SGD([dense], lr=0.3) if optimizer == "sgd" else
           torch.optim.Adagrad([dense], lr=0.3, eps=1e-10, initial_accumulator_value=0.1))
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        idx, grads = torch.randint(0, 8, (12,), generator=gen), torch.randn(12, 4, generator=gen)
        ref.row_update(storage, idx, grads, optimizer=optimizer, lr=0.3, eps=1e-10, state=state)
        dense.grad = torch.zeros_like(storage).index_add_(0, idx, grads)
        dense.grad[8:] = 0.0
        opt.step()
    torch.testing.assert_close(storage, dense.detach(), rtol=1e-6, atol=1e-7)
    if state is not None:
        torch.testing.assert_close(state, opt.state[dense]["sum"])


def test_reference_rowwise_adagrad_formula():
    storage = rand_storage(6, 3, torch.float64, device="cpu")
    state = torch.full((6,), 0.1, dtype=torch.float64)
    idx, grads = torch.tensor([4, 1, 4]), torch.randn(3, 3, dtype=torch.float64)
    want_w, want_s = storage.clone(), state.clone()
    for row in (1, 4):
        g = grads[idx == row].sum(0)
        want_s[row] += (g * g).mean()
        want_w[row] -= 0.5 * g / (want_s[row].sqrt() + 1e-10)
    ref.row_update(storage, idx, grads, optimizer="rowwise_adagrad", lr=0.5, eps=1e-10, state=state)
    torch.testing.assert_close(storage, want_w)
    torch.testing.assert_close(state, want_s)
