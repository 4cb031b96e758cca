"""DLRM (Naumov et al. 2019): bottom MLP on dense features, pairwise dot interaction with the
pooled embeddings, top MLP to a click logit.

Single-device code: it sees [B, F] dense features and [B, T, d] pooled embeddings and knows
nothing about sharding or collectives; parallelism is applied from outside (trainer/run/runner.py).
"""
from __future__ import annotations

import torch
from torch import nn


def mlp(widths: list[int], final_relu: bool, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers widths[0] -> ... -> widths[-1], ReLU between (and after the last if asked);
    dropout > 0: nn.Dropout after every hidden layer's ReLU (not after the output layer)."""
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        hidden = i < len(widths) - 2
        if hidden or final_relu:
            layers.append(nn.ReLU())
        if hidden and dropout > 0:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class _Gram(torch.autograd.Function):
    """z [B, n, d] -> z z^T [B, n, n], with the backward as ONE bmm: dz = (G + G^T) z
    (autograd's generic bmm backward runs two)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z)
        return torch.bmm(z, z.transpose(1, 2))

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (z,) = ctx.saved_tensors
        # under autocast (train.precision) the forward's bmm ran in the half type: g is half while
        # z was saved fp32, and the backward runs outside autocast; the product is taken in g's
        # type (z cast as the forward's autocast cast it) and returned in z's (no-ops in fp32)
        return torch.bmm(g + g.transpose(1, 2), z.to(g.dtype)).to(z.dtype)


class DLRM(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, dim: int, bottom: list[int],
                 top: list[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim], final_relu=True, dropout=dropout)
        n = num_tables + 1
        li, lj = torch.tril_indices(n, n, offset=-1)
        # flat positions of the strictly-lower triangle in [n*n]; index_select (not [:, li, lj])
        # keeps the backward an index_add instead of a slow accumulating index_put
        self.register_buffer("tril", li * n + lj, persistent=False)
        self.top = mlp([dim + li.numel(), *top, 1], final_relu=False, dropout=dropout)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """dense [B, F], sparse [B, T, d] -> logits [B]."""
        x = self.bottom(dense)  # [B, d]
        z = torch.cat([x.unsqueeze(1), sparse], dim=1)  # [B, T+1, d]
        zz = _Gram.apply(z).flatten(1)  # [B, (T+1)^2]
        inter = zz.index_select(1, self.tril)  # [B, (T+1)T/2]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)
