"""DLRM, WDL, DeepFM and DCN-v2 against their defining formulas, written out explicitly here."""
from __future__ import annotations

import itertools

import pytest
import torch

from trainer.base.config import ModelConfig
from trainer.workload.models import build_model
from trainer.workload.models.dcn import DCN
from trainer.workload.models.deepfm import DeepFM, fm_pairwise
from trainer.workload.models.dlrm import DLRM
from trainer.workload.models.wdl import WDL

B, F, T, D = 5, 4, 3, 8


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, F, generator=g), torch.randn(B, T, D, generator=g)


def test_fm_pairwise_is_the_sum_over_pairs():
    v = torch.randn(B, 6, D)
    want = sum((v[:, i] * v[:, j]).sum(1) for i, j in itertools.combinations(range(6), 2))
    torch.testing.assert_close(fm_pairwise(v), want)


def test_deepfm_is_linear_plus_fm_plus_deep():
    torch.manual_seed(1)
    m = DeepFM(F, T, D, [6], [7])
    dense, sparse = _inputs()
    fields = torch.cat([m.bottom(dense).unsqueeze(1), sparse], 1)
    linear = m.linear(torch.cat([dense, sparse.reshape(B, -1)], 1)).squeeze(1)
    pairs = sum((fields[:, i] * fields[:, j]).sum(1) for i, j in itertools.combinations(range(T + 1), 2))
    torch.testing.assert_close(m(dense, sparse), linear + pairs + m.deep(fields.reshape(B, -1)).squeeze(1))


@pytest.mark.parametrize("rank", [0, 2])
def test_dcn_cross_layers_follow_dcn_v2(rank):
    torch.manual_seed(2)
    m = DCN(F, T, D, layers=2, rank=rank, deep=[5])
    dense, sparse = _inputs()
    x0 = torch.cat([dense, sparse.reshape(B, -1)], 1)
    x = x0
    for layer in m.cross:
        w = layer.w if rank == 0 else None
        if rank == 0:
            xw = x @ w.weight.T + w.bias
        else:
            u, v = layer.w[0].weight, layer.w[1]
            xw = (x @ u.T) @ v.weight.T + v.bias
        x = x0 * xw + x
    torch.testing.assert_close(m(dense, sparse), m.deep(x).squeeze(1))


def _dlrm_by_formula(m: DLRM, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """top([x, <z_i, z_j> for every pair i > j]), z = [bottom(dense), the T pooled rows]."""
    x = m.bottom(dense)
    z = torch.cat([x.unsqueeze(1), sparse], 1)
    pairs = [(z[:, i] * z[:, j]).sum(1) for i in range(T + 1) for j in range(i)]
    return m.top(torch.cat([x, torch.stack(pairs, 1)], 1)).squeeze(1)


def test_dlrm_is_top_over_bottom_and_pair_dots():
    torch.manual_seed(4)
    m = DLRM(F, T, D, [6], [7]).double()
    dense, sparse = (t.double() for t in _inputs())
    torch.testing.assert_close(m(dense, sparse), _dlrm_by_formula(m, dense, sparse))


def test_dlrm_gram_backward_equals_autograd_of_the_formula():
    """The hand-written backward of the Gram matrix (one bmm: dz = (G + G^T) z) against autograd
    through the explicit per-pair sums: the gradients of the pooled rows and of every parameter,
    in float64, and gradcheck of the Gram matrix alone."""
    torch.manual_seed(5)
    m = DLRM(F, T, D, [6], [7]).double()
    dense, sparse = (t.double() for t in _inputs())
    grads = []
    for fn in (m, lambda a, b: _dlrm_by_formula(m, a, b)):
        m.zero_grad()
        s = sparse.clone().requires_grad_(True)
        (fn(dense, s) * torch.arange(1.0, B + 1, dtype=torch.float64)).sum().backward()
        grads.append([s.grad] + [p.grad.clone() for p in m.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)
    from trainer.workload.models.dlrm import _Gram
    z = torch.randn(B, T + 1, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_Gram.apply, (z,))


def test_wdl_is_wide_plus_deep():
    torch.manual_seed(3)
    m = WDL(F, T, D, [6])
    dense, sparse = _inputs()
    x = torch.cat([dense, sparse.reshape(B, -1)], 1)
    torch.testing.assert_close(m(dense, sparse), (x @ m.wide.weight.T + m.wide.bias + m.deep(x)).squeeze(1))


@pytest.mark.parametrize("name", ["dlrm", "wdl", "deepfm", "dcn"])
def test_every_model_sends_gradient_to_every_table(name):
    m = build_model(ModelConfig(name=name, embedding_dim=D, bottom_mlp=[6], top_mlp=[7]), F, T)
    dense, sparse = _inputs()
    sparse.requires_grad_(True)
    out = m(dense, sparse)
    assert out.shape == (B,)
    out.sum().backward()
    assert (sparse.grad.abs().sum(dim=(0, 2)) > 0).all()
