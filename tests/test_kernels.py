"""Every Triton kernel against its pure-torch reference, and the reference against torch itself.

Why this shape: CI has no GPU, so the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1)
on tiny shapes that still hit the edge cases: odd d (1, 3, 7, 33, 300 -> column-block tails; d = 1
is one column block of width 1, the per-id scalars of WDL's wide part / FM's first-order term), bags
longer than a tile (entry-block tails), empty bags, duplicate ids within and across bags, int32/int64
indices, fp32/fp16/bf16 storage, per-sample weights, sum/mean. Tests marked ``gpu`` run
the compiled kernels at realistic sizes and are skipped without CUDA.

TRITON_INTERPRET is read by Triton when it is imported, so it is set here, at collection, before
anything imports triton, and only when there is no CUDA device (then the interpreter is the only way
to run Triton, and no other test can want compiled kernels). ``kernels`` imports triton lazily.

No silent skips: triton is a pinned dependency on Linux x86_64 (pyproject.toml), so there the Triton
tests always run and a missing or broken triton FAILS them (and test_triton_is_usable_where_pinned
says why). They skip only on platforms where triton cannot be installed.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Tuple

import pytest
import torch.nn.functional as F
from torch import Tensor

import kernels
from kernels import reference as ref
from kernels._triton import has_triton, interpret_enabled, interpreter_ready
from kernels.pooled_gather import pooled_gather_triton
from kernels.scatter_update import accumulate_row_grads_triton, row_update_triton

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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and OpenMP spinning on a busy 2-core
    machine made index_add_ 100x slower; restore the thread count for the other modules."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch: pytest.MonkeyPatch):
    """Every test starts on backend "auto" (no force, no variable, configured "auto") and leaves
    it there."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.set_backend(None)
    kernels.configure("auto", "cpu")
    yield
    kernels.set_backend(None)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.configure("auto", "cpu")


@pytest.mark.skipif(not TRITON_PINNED, reason="triton is not a dependency on this platform")
def test_triton_is_usable_where_pinned():
    """Where triton is pinned, it must import and run (compiled on CUDA, else interpreted)."""
    assert HAS_TRITON, "triton==3.7.1 is a dependency on Linux x86_64 but is not installed"
    if not CUDA_COMPILED_MODE:
        assert interpret_enabled(), "no CUDA: the Triton tests need TRITON_INTERPRET=1"
        assert INTERPRETED, "triton was imported before TRITON_INTERPRET=1 was set (see _triton.py)"


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


# ----------------------------------------------------------------------------- reference sanity


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


def _sparse_step(accumulate: Callable[..., Tensor], update: Callable[..., None], storage: Tensor,
                 grad: Tensor, slots: Tensor, offsets: Tensor, num_tables: int,
                 state: Optional[Tensor] = None, **kw: Any) -> None:
    """The trainer's sparse backward at W = 1 with these kernels: the gather's row-gradient
    scatter into a [U, d] workspace gradient (slots = each entry's unique row), then the owner's
    update of the U distinct storage rows (row_update, unique=True), in place."""
    uniq, inverse = torch.unique(slots.long(), return_inverse=True)
    ws_grad = accumulate(grad, inverse, offsets, num_tables, num_slots=uniq.numel())
    update(storage, uniq, ws_grad, state=state, unique=True, **kw)


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


# ----------------------------------------------------------------------------- pooled gather


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


class deterministic_algorithms:
    """Context manager toggling torch.use_deterministic_algorithms and restoring it."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(self.on)

    def __exit__(self, *exc: object) -> None:
        torch.use_deterministic_algorithms(self.prev)


# ----------------------------------------------------------------------------- row grads


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


# ----------------------------------------------------------------------------- sparse backward


def _opt_state(optimizer: str, rows: int, dim: int) -> Optional[Tensor]:
    gen = torch.Generator().manual_seed(8)
    if optimizer == "adagrad":
        return torch.rand(rows, dim, generator=gen).to(DEV)
    if optimizer == "rowwise_adagrad":
        return torch.rand(rows, generator=gen).to(DEV)
    return None


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


# ----------------------------------------------------------------------------- owner row update


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


# ----------------------------------------------------------------------------- hash map


def _map_factories() -> Iterator[Any]:
    yield pytest.param(lambda: kernels.ReferenceIdSlotMap(4, "cpu"), id="reference")
    if RUN_TRITON:
        yield pytest.param(lambda: kernels.TritonIdSlotMap(4, DEV), id="triton")


MAP_FACTORIES = list(_map_factories())


@pytest.mark.parametrize("factory", MAP_FACTORIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_hashmap_random_ops_match_dict(factory, seed):
    gen = torch.Generator().manual_seed(seed)
    table, model = factory(), {}
    for step in range(40):
        ids = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
        op = step % 3 if step > 5 else 0
        if op == 0:
            ids = ids.unique()[torch.randperm(ids.unique().numel(), generator=gen)]
            vals = torch.randint(0, 10_000, ids.shape, generator=gen)
            new = table.insert(ids, vals)
            assert new.tolist() == [i not in model for i in ids.tolist()]
            model.update(zip(ids.tolist(), vals.tolist()))
        elif op == 1:
            found = table.erase(ids)
            assert found.tolist() == [i in model for i in ids.tolist()]
            for i in ids.tolist():
                model.pop(i, None)
        slots, miss = table.lookup(ids)
        assert miss.tolist() == [i not in model for i in ids.tolist()]
        assert slots.tolist() == [model.get(i, -1) for i in ids.tolist()]
        assert len(table) == len(model)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == model


@pytest.mark.parametrize("factory", MAP_FACTORIES)
def test_hashmap_duplicate_ids_in_one_insert(factory):
    table = factory()
    ids = torch.tensor([5, 9, 5, 5, 1 << 40, 9])
    vals = torch.tensor([1, 2, 3, 4, 5, 6])
    new = table.insert(ids, vals)
    assert int(new.sum()) == 3 and len(table) == 3
    slots, miss = table.lookup(torch.tensor([5, 9, 1 << 40, 7]))
    assert miss.tolist() == [False, False, False, True]
    assert int(slots[0]) in (1, 3, 4) and int(slots[1]) in (2, 6) and int(slots[2]) == 5
    assert table.erase(torch.tensor([5, 5])).tolist() == [True, True]
    assert table.lookup(torch.tensor([5]))[1].tolist() == [True]


@needs_triton
@pytest.mark.parametrize("n", [1, 127, 128, 129, 301])
def test_triton_hashmap_odd_batch_sizes(n):
    """Batches of one id, one short of a block, a block, a block and one, several blocks with a
    tail: every lane of the last (partial) block is masked correctly in insert, lookup, erase."""
    table, want = kernels.TritonIdSlotMap(8, DEV), kernels.ReferenceIdSlotMap(0, "cpu")
    gen = torch.Generator().manual_seed(n)
    ids = torch.randperm(10 * n + 7, generator=gen)[:n] * 3 + 1
    vals = torch.randint(0, 1 << 30, (n,), generator=gen)
    assert torch.equal(table.insert(ids, vals).cpu(), want.insert(ids, vals))
    probe = torch.cat([ids, ids + 1])  # half present, half absent
    for a, b in zip(table.lookup(probe), want.lookup(probe)):
        assert torch.equal(a.cpu(), b)
    gone = ids[::2].contiguous()
    assert torch.equal(table.erase(gone).cpu(), want.erase(gone))
    for a, b in zip(table.lookup(probe), want.lookup(probe)):
        assert torch.equal(a.cpu(), b)
    assert len(table) == len(want) == n - gone.numel()


@needs_triton
def test_triton_hashmap_grows_and_reuses_tombstones():
    table = kernels.TritonIdSlotMap(4, DEV)
    start = table.capacity
    for rnd in range(6):  # churn: tombstones accumulate, rebuilds must clear them
        ids = torch.arange(rnd * 50, rnd * 50 + 50)
        table.insert(ids, ids * 2)
        assert table.erase(ids[:40]).all()
    assert len(table) == 60
    slots, miss = (t.cpu() for t in table.lookup(torch.arange(0, 300)))
    keep = (torch.arange(300) % 50) >= 40
    assert torch.equal(miss, ~keep) and torch.equal(slots[keep], torch.arange(300)[keep] * 2)
    assert table.capacity >= start


# ----------------------------------------------------------------------------- dispatch


def test_dispatch_defaults_to_reference_on_cpu():
    assert kernels.get_backend() == "auto" and not kernels.use_triton("cpu")
    assert callable(kernels.pooled_gather) and callable(kernels.row_update)
    importlib.import_module("kernels.pooled_gather")  # must not replace the public function
    assert callable(kernels.pooled_gather)
    assert isinstance(kernels.make_id_slot_map(8, "cpu"), kernels.ReferenceIdSlotMap)


def test_dispatch_backend_validation_and_env(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="backend"):
        kernels.set_backend("cuda")
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels.get_backend() == "reference"
    with kernels.use_backend("triton"):
        assert kernels.get_backend() == "triton"
    assert kernels.get_backend() == "reference"


@needs_interpreter
def test_forced_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch):
    storage = rand_storage(6, 5, torch.float32, device="cpu")
    slots, offsets = make_bags(2, 2, 3, 6, device="cpu")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    out = kernels.pooled_gather(storage, slots, offsets, 2)
    torch.testing.assert_close(out, ref.pooled_gather(storage, slots, offsets, 2))
    assert isinstance(kernels.make_id_slot_map(8, "cpu"), kernels.TritonIdSlotMap)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.pooled_gather(storage, slots, offsets, 2)


@needs_triton
def test_dispatch_routes_all_kernels(monkeypatch: pytest.MonkeyPatch):
    slots, offsets = make_bags(2, 2, 3, 6)
    grad = randn(2, 2, 4)
    outs = []
    for backend in ("triton", "reference"):
        kernels.set_backend(backend)
        storage = rand_storage(6, 4, torch.float32)
        _sparse_step(kernels.accumulate_row_grads, kernels.row_update, storage, grad, slots,
                     offsets, 2, optimizer="sgd", lr=1.0)
        outs.append((storage, kernels.accumulate_row_grads(grad, slots, offsets, 2, num_slots=6)))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])


# ----------------------------------------------------------------------------- config / trainer


def test_configure_applies_config_key_and_env_overrides(monkeypatch: pytest.MonkeyPatch):
    assert kernels.configure("reference", "cpu") == "reference"
    assert kernels.get_backend() == "reference"
    assert kernels.configure("auto", "cpu") == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "reference")  # the variable overrides the config key
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.configure("triton", "cpu") == "reference"
    assert kernels.get_backend() == "reference"
    with kernels.use_backend("auto"):  # set_backend / use_backend override both
        assert kernels.get_backend() == "auto"
    monkeypatch.setenv(kernels.ENV_VAR, "nope")
    with pytest.raises(kernels.BackendError, match="TRAINER_KERNELS='nope'"):
        kernels.configure("auto", "cpu")
    monkeypatch.delenv(kernels.ENV_VAR)
    with pytest.raises(kernels.BackendError, match="kernels.backend='cuda'"):
        kernels.configure("cuda", "cpu")


@needs_triton
def test_configure_forced_triton_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """Forcing triton without CUDA fails at start-up with a message naming the key and the fix."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(kernels.BackendError, match=r"kernels.backend='triton'.*TRITON_INTERPRET=1"):
        kernels.configure("triton", "cpu")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(kernels.BackendError, match=r"TRAINER_KERNELS \(overrides kernels.backend\)"):
        kernels.configure("reference", "cpu")
    monkeypatch.delenv(kernels.ENV_VAR)
    assert kernels.configure("triton", "cuda") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.configure("triton", "cpu") == "triton"


def test_config_key_validation(monkeypatch: pytest.MonkeyPatch):
    from helpers import make_cfg
    from trainer.config import ConfigError
    from trainer.configure import load_config

    base = ["data=tiny", "train.device=cpu"]
    assert load_config(make_cfg(base)).kernels.backend == "auto"
    assert load_config(make_cfg(base + ["kernels.backend=reference"])).kernels.backend == "reference"
    with pytest.raises(ConfigError, match="kernels.backend='gpu': must be one of auto, triton, reference"):
        load_config(make_cfg(base + ["kernels.backend=gpu"]))
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(ConfigError, match="TRAINER_KERNELS='fast'"):
        load_config(make_cfg(base))
    monkeypatch.setenv(kernels.ENV_VAR, "reference")  # the override wins over a forced triton
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    load_config(make_cfg(base + ["kernels.backend=triton"]))


@needs_triton
def test_config_forced_triton_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch):
    from helpers import make_cfg
    from trainer.config import ConfigError
    from trainer.configure import load_config

    forced = ["data=tiny", "train.device=cpu", "kernels.backend=triton"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"kernels.backend='triton'.*cpu.*TRITON_INTERPRET=1"):
        load_config(make_cfg(forced))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_config(make_cfg(forced)).kernels.backend == "triton"


TINY_RUN = ["data=tiny", "train.steps=3", "data.batch_size=16", "data.eval_samples=32",
            "data.eval_batch_size=32", "train.threads=1", "train.progress=off", "data.min_bag=0"]


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list:
    """Wrap owner.name so that every call is recorded; returns the list of calls."""
    calls: list = []
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        calls.append(kw.get("unique"))
        return inner(*args, **kw)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@needs_interpreter
@pytest.mark.parametrize("optim", ["adagrad", "adam"])  # adam: dense adam, rows rowwise_adagrad
def test_trainer_owner_update_goes_through_the_dispatch(monkeypatch: pytest.MonkeyPatch, optim):
    """A 3-step W=1 run with TRAINER_KERNELS=triton (interpreted) and one on the reference: the
    owner updates of ShardStore.apply are the dispatch's row_update, once per step, and both
    backends train the same losses, dense parameters and tables within 1e-5."""
    from helpers import run_single

    triton_calls = _count_calls(monkeypatch, kernels._scatter_update_module, "row_update_triton")
    ref_calls = _count_calls(monkeypatch, kernels.reference, "row_update")
    overrides = TINY_RUN + [f"optim={optim}"]
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    got = run_single(overrides)
    assert len(triton_calls) == 3 and not ref_calls
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    want = run_single(overrides)
    assert len(ref_calls) == 3 and len(triton_calls) == 3
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses),
                               rtol=1e-5, atol=1e-6)
    for name, value in want.state["dense"].items():
        torch.testing.assert_close(got.state["dense"][name], value, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.state["tables"], want.state["tables"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(want.state["tables"], _initial_tables()))


@needs_interpreter
def test_config_key_kernels_backend_selects_the_owner_update(monkeypatch: pytest.MonkeyPatch):
    """kernels.backend=triton (no variable set) reaches the trainer via kernels.configure."""
    from helpers import run_single

    triton_calls = _count_calls(monkeypatch, kernels._scatter_update_module, "row_update_triton")
    ref_calls = _count_calls(monkeypatch, kernels.reference, "row_update")
    run_single(TINY_RUN + ["kernels.backend=triton"])
    assert len(triton_calls) == 3 and not ref_calls
    run_single(TINY_RUN + ["kernels.backend=reference"])
    assert len(ref_calls) == 3 and len(triton_calls) == 3


@needs_interpreter
@pytest.mark.dist
def test_triton_backend_parity_two_workers(monkeypatch: pytest.MonkeyPatch):
    """W=2 gloo workers on the Triton backend (interpreted; the variables reach the spawned ranks)
    equal the single-process reference run: owners sum the pushes of both workers for one row."""
    from helpers import run_single, run_world

    overrides = TINY_RUN + ["optim=adagrad", "data.global_batch_size=32"]
    want = run_single(overrides)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    got = run_world(2, overrides)
    for res in got:
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(want.losses),
                                   rtol=1e-5, atol=1e-6)
        for a, b in zip(res.state["tables"], want.state["tables"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[0].summary["bytes"]["grads"] > 0


def _initial_tables() -> list[Tensor]:
    from helpers import make_cfg
    from trainer.config import table_rows
    from trainer.configure import load_config
    from trainer.embedding import init_rows

    c = load_config(make_cfg(TINY_RUN))
    return [init_rows(c.train.seed, table_rows(c), c.model.embedding_dim, torch.full((n,), t),
                      torch.arange(n), c.embedding.init_scale) for t, n in enumerate(table_rows(c))]


def test_import_without_triton():
    """`import kernels` and the reference path work when triton cannot be imported."""
    code = textwrap.dedent("""
        import sys, torch
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import kernels
        assert not kernels.triton_available()
        s = torch.randn(4, 3)
        out = kernels.pooled_gather(s, torch.tensor([0, 3]), torch.tensor([0, 1, 2]), 1)
        assert out.shape == (2, 1, 3)
        kernels.set_backend("triton")
        try:
            kernels.pooled_gather(s, torch.tensor([0, 3]), torch.tensor([0, 1, 2]), 1)
        except RuntimeError as e:
            assert "not installed" in str(e)
        else:
            raise AssertionError("forced triton without triton must fail")
        print("ok")
    """)
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


# ----------------------------------------------------------------------------- GPU (compiled)


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


@gpu
@needs_cuda
def test_gpu_hashmap_vs_reference():
    gpu_map, ref_map = kernels.TritonIdSlotMap(1 << 16, "cuda"), kernels.ReferenceIdSlotMap(0, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(20):
        ids = torch.randint(0, 1 << 40, (200_000,), device="cuda", generator=gen).unique()
        vals = torch.arange(ids.numel(), device="cuda")
        assert torch.equal(gpu_map.insert(ids, vals), ref_map.insert(ids, vals))
        probe = torch.cat([ids[: ids.numel() // 2], ids[:1000] + 1])
        assert torch.equal(gpu_map.erase(probe[::3]), ref_map.erase(probe[::3]))
        for a, b in zip(gpu_map.lookup(probe), ref_map.lookup(probe)):
            assert torch.equal(a, b)
    assert len(gpu_map) == len(ref_map)
