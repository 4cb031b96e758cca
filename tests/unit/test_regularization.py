"""Regularisation and schedules against torch references: coupled L2 on embedding rows inside
kernels.row_update (reference and Triton), the learning-rate warmup + polynomial decay against
torch's schedulers, and dropout in the MLPs (train mode only).

Weight decay on rows is coupled (torch.optim's weight_decay: g <- g + wd * w) and applied by the
owner once per touched row per step: the reference is torch.optim with weight_decay on a dense copy
of the table, restricted to the rows the step touched (untouched rows, and their optimizer state,
are put back after torch's step, since torch would decay every row).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (see tests/kernel_helpers.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from helpers import make_cfg  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels._triton import has_triton, interpret_enabled  # noqa: E402
from trainer.base.config import OptimConfig  # noqa: E402
from trainer.run.resolve.configure import load_config  # noqa: E402
from trainer.step.lr import lr_factor  # noqa: E402
from trainer.workload.models import build_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not interpret_enabled() else "cpu"
needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed on this platform")


def _steps(n_steps: int, rows: int, dim: int, seed: int = 0):
    """Per step: storage rows (with repeats: several workers' pushes), gradients; rows >= 8 never."""
    for step in range(n_steps):
        gen = torch.Generator().manual_seed(seed + step)
        n = 12
        yield torch.randint(0, min(8, rows), (n,), generator=gen), torch.randn(n, dim, generator=gen)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_row_weight_decay_is_torch_weight_decay_on_touched_rows(optimizer):
    wd, lr, rows, dim = 0.05, 0.3, 15, 4
    gen = torch.Generator().manual_seed(7)
    storage = torch.randn(rows, dim, generator=gen)
    dense = torch.nn.Parameter(storage.clone())
    state = torch.full_like(storage, 0.1) if optimizer == "adagrad" else None
    opt = (torch.optim.SGD([dense], lr=lr, weight_decay=wd) if optimizer == "sgd" else
           torch.optim.Adagrad([dense], lr=lr, eps=1e-10, initial_accumulator_value=0.1, weight_decay=wd))
    for idx, grads in _steps(4, rows, dim):
        ref.row_update(storage, idx, grads, optimizer=optimizer, lr=lr, eps=1e-10, state=state,
                       weight_decay=wd)
        touched = torch.zeros(rows, dtype=torch.bool)
        touched[idx] = True
        before = dense.detach().clone()
        acc = opt.state[dense]["sum"].clone() if optimizer == "adagrad" and opt.state else None
        dense.grad = torch.zeros_like(storage).index_add_(0, idx, grads)
        opt.step()
        with torch.no_grad():  # torch decays every row: keep only the touched rows' step
            dense[~touched] = before[~touched]
            if acc is not None:
                opt.state[dense]["sum"][~touched] = acc[~touched]
            elif optimizer == "adagrad":
                opt.state[dense]["sum"][~touched] = 0.1
    torch.testing.assert_close(storage, dense.detach(), rtol=1e-6, atol=1e-7)
    if state is not None:
        torch.testing.assert_close(state, opt.state[dense]["sum"])
    assert not torch.equal(storage[8:], torch.zeros_like(storage[8:]))  # untouched rows kept their values


def test_rowwise_adagrad_weight_decay_formula():
    """Row-wise Adagrad (no torch optimizer): g = sum of the row's pushes + wd * w; s += mean(g^2);
    w -= lr g / (sqrt(s) + eps), once per distinct row."""
    wd, lr = 0.2, 0.5
    storage = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    state = torch.full((6,), 0.1, dtype=torch.float64)
    idx, grads = torch.tensor([4, 1, 4]), torch.randn(3, 3, dtype=torch.float64)
    want_w, want_s = storage.clone(), state.clone()
    for row in (1, 4):
        g = grads[idx == row].sum(0) + wd * storage[row]
        want_s[row] += (g * g).mean()
        want_w[row] -= lr * g / (want_s[row].sqrt() + 1e-10)
    ref.row_update(storage, idx, grads, optimizer="rowwise_adagrad", lr=lr, eps=1e-10, state=state,
                   weight_decay=wd)
    torch.testing.assert_close(storage, want_w)
    torch.testing.assert_close(state, want_s)


def test_weight_decay_zero_is_the_plain_update():
    storage = torch.randn(10, 4)
    a, b = storage.clone(), storage.clone()
    idx, grads = next(_steps(1, 10, 4))
    ref.row_update(a, idx, grads, optimizer="sgd", lr=0.1)
    ref.row_update(b, idx, grads, optimizer="sgd", lr=0.1, weight_decay=0.0)
    assert torch.equal(a, b)
    ref.row_update(b, idx, grads, optimizer="sgd", lr=0.1, weight_decay=0.5)
    ref.row_update(storage, idx, grads, optimizer="sgd", lr=0.1)
    ref.row_update(storage, idx, grads, optimizer="sgd", lr=0.1)
    assert not torch.allclose(b, storage)  # the decay did something


@needs_triton
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("unique", [False, True])
@pytest.mark.parametrize("dim", [7, 33])
def test_triton_row_update_weight_decay_matches_reference(optimizer, unique, dim):
    from kernels.scatter_update import row_update_triton

    gen = torch.Generator().manual_seed(11)
    rows = 40
    idx = torch.randperm(rows, generator=gen)[:24] if unique else torch.randint(0, 13, (24,), generator=gen)
    grads = torch.randn(24, dim, generator=gen)
    storage = torch.randn(rows, dim, generator=gen)
    state = {"sgd": None, "adagrad": torch.rand(rows, dim, generator=gen) + 0.1,
             "rowwise_adagrad": torch.rand(rows, generator=gen) + 0.1}[optimizer]
    out = []
    for fn in (row_update_triton, ref.row_update):
        w = storage.clone().to(DEV)
        s = None if state is None else state.clone().to(DEV)
        fn(w, idx.to(DEV), grads.to(DEV), optimizer=optimizer, lr=0.3, eps=1e-8, state=s, unique=unique,
           weight_decay=0.1)
        out.append((w.cpu(), None if s is None else s.cpu()))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    if state is not None:
        torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-5, atol=1e-5)
    plain = storage.clone().to(DEV)
    ref.row_update(plain, idx.to(DEV), grads.to(DEV), optimizer=optimizer, lr=0.3, eps=1e-8,
                   state=None if state is None else state.clone().to(DEV), unique=unique)
    assert not torch.allclose(plain.cpu(), out[1][0])  # the decay is really applied


# ---- learning-rate schedule -------------------------------------------------------------
def _torch_factors(opt_factory, steps: int) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = opt_factory(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_is_torch_linear_lr():
    o = OptimConfig(warmup_steps=5, decay="none")
    want = _torch_factors(lambda opt: torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1 / 6, end_factor=1.0, total_iters=5), 12)
    got = [lr_factor(k, o, 12) for k in range(12)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[0] > 0 and got[5:] == [1.0] * 7


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_warmup_then_poly_decay_is_torch_sequential(power):
    """MLPerf DLRM's shape: linear warmup, then polynomial decay to the end of the run."""
    w, total = 4, 20
    o = OptimConfig(warmup_steps=w, decay="poly", decay_power=power)
    want = _torch_factors(lambda opt: torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / (w + 1), total_iters=w),
        torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=total - w, power=power)], milestones=[w]), total)
    got = [lr_factor(k, o, total) for k in range(total)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert got[-1] > 0  # the last step still trains


def test_poly_decay_window_formula():
    """An explicit window: flat until decay_start, (1 - k/n)^p over n steps, then 0 (torch's
    PolynomialLR after total_iters); warmup takes precedence."""
    o = OptimConfig(warmup_steps=2, decay="poly", decay_start=5, decay_steps=4, decay_power=2.0)
    got = [lr_factor(k, o, 12) for k in range(12)]
    want = [1 / 3, 2 / 3, 1, 1, 1] + [(1 - k / 4) ** 2 for k in range(4)] + [0.0, 0.0, 0.0]
    assert got == pytest.approx(want)
    assert lr_factor(3, OptimConfig(warmup_steps=0, decay="none"), 10) == 1.0


class _NoWire:
    """A HET wire that is never called (W = 1: no remote rows): what HetRemote reads at construction."""

    staleness, dynamic, announce = None, False, None


def test_schedule_sets_every_learning_rate():
    """The dense optimizer and every sparse optimizer instance (owner, replica, HET cache's local
    rule) follow the same factor; a run with warmup moves less in its first step."""
    from trainer.base.comm import LocalCollectives
    from trainer.run.runner import Trainer

    from trainer.sparse.embedding.remote import HeraldRemote, HetRemote
    from trainer.sparse.embedding.remote.base import CacheStats

    base = ["data=tiny", "train.steps=10", "optim=adam", "optim.warmup_steps=4", "optim.decay=poly",
            "train.progress=off", "comm=local", "optim.sparse_weight_decay=0.01"]
    het = Trainer(load_config(make_cfg(base + ["cache=lru", "placement=fae"])), LocalCollectives(), None)
    het.emb.remote = HetRemote(_NoWire(), het.emb.sharding, _cache_like(het), het.sparse.bounds,
                               CacheStats(len(het.sparse.sharding.table_rows), torch.device("cpu")))  # W = 1 has no remote rows: a cache to schedule
    herald = Trainer(load_config(make_cfg(base + ["cache=lru", "schedule=herald"])), LocalCollectives(), None)
    assert isinstance(herald.emb.remote, HeraldRemote)
    for t in (het, herald):
        t.lr = type(t.lr)(t.c.optim, t.c.train.steps, t.opt, t.emb, 0.05)  # picks up the cache set above
        sparse = t.lr.sparse + ([t.lr.cache] if t.lr.cache is not None else [])
        assert len(sparse) == (3 if t is het else 2)  # owner + replica + HET cache / owner + lent rows
        for step, f in ((0, 0.2), (3, 0.8), (4, 1.0), (7, (1 - 3 / 6) ** 2)):
            assert t.lr.apply(step) == pytest.approx(f)
            assert t.opt.param_groups[0]["lr"] == pytest.approx(0.001 * f)
            assert t.emb.store.optimizer.lr == pytest.approx(0.05 * f)
            assert t.emb.store.optimizer.weight_decay == 0.01  # every instance decays rows alike
            if t is het:
                assert t.emb.replica.optimizer.lr == pytest.approx(0.05 * f)
                assert t.emb.replica.optimizer.weight_decay == 0.01
                assert t.emb.cache.local_lr == pytest.approx(0.05 * f)
            else:
                assert t.emb.remote.lent.optimizer.lr == pytest.approx(0.05 * f)
                assert t.emb.remote.lent.optimizer.weight_decay == 0.01


def _cache_like(t):
    from trainer.run.build import _cache_rows
    from trainer.sparse.embedding.cache.rows import RowCache, make_policy
    return RowCache(_cache_rows(t.c, t.sparse.plan), t.emb.dim, make_policy("lru"), t.emb.sharding.n_ids, 0.05)


# ---- dropout ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dlrm", "wdl", "deepfm", "dcn"])
def test_dropout_in_the_mlps_only_in_training(name):
    c = load_config(make_cfg([f"model={name}", "data=tiny", "model.dropout=0.5"]))
    torch.manual_seed(0)
    model = build_model(c.model, c.data.num_dense, len(c.data.table_rows))
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.5 for m in drops)
    dense, sparse = torch.randn(64, c.data.num_dense), torch.randn(64, len(c.data.table_rows), 16)
    model.eval()
    assert torch.equal(model(dense, sparse), model(dense, sparse))
    model.train()
    assert not torch.equal(model(dense, sparse), model(dense, sparse))
    c0 = load_config(make_cfg([f"model={name}", "data=tiny"]))
    assert c0.model.dropout == 0.0
    plain = build_model(c0.model, c0.data.num_dense, len(c0.data.table_rows))
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    assert math.isclose(sum(p.numel() for p in plain.parameters()), sum(p.numel() for p in model.parameters()))
