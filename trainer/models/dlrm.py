"""DLRM (Naumov et al. 2019): bottom MLP on dense features, pairwise dot interaction with the
pooled embeddings, top MLP to a click logit.

Single-device code: it sees [B, F] dense features and [B, T, d] pooled embeddings and knows
nothing about sharding or collectives; parallelism is applied from outside (trainer/runner.py).
"""
from __future__ import annotations

import torch
from torch import nn


def mlp(widths: list[int], final_relu: bool) -> nn.Sequential:
    """Linear layers widths[0] -> ... -> widths[-1], ReLU between (and after the last if asked)."""
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, dim: int, bottom: list[int],
                 top: list[int]) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim], final_relu=True)
        n = num_tables + 1
        li, lj = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top = mlp([dim + li.numel(), *top, 1], final_relu=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """dense [B, F], sparse [B, T, d] -> logits [B]."""
        x = self.bottom(dense)  # [B, d]
        z = torch.cat([x.unsqueeze(1), sparse], dim=1)  # [B, T+1, d]
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.li, self.lj]  # [B, (T+1)T/2]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)
