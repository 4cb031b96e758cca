"""DCN-v2 (Wang et al. 2021): explicit feature crosses x_{l+1} = x_0 * (W_l x_l + b_l) + x_l over
x_0 = [dense, pooled embeddings flattened], then a deep MLP (the "stacked" structure) to a logit.

cross_rank > 0 uses the paper's low-rank form W_l = U_l V_l^T (U, V: [D, r]), cheaper when D is
large (26 tables x d = 128 gives D = 3341). Single-device code (no collectives).
"""
from __future__ import annotations

import torch
from torch import nn

from .dlrm import mlp


class CrossLayer(nn.Module):
    """One DCN-v2 cross layer on [B, D]."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        if rank > 0:
            self.w = nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))
        else:
            self.w = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.w(x) + x


class DCN(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, dim: int, layers: int, rank: int,
                 deep: list[int], dropout: float = 0.0) -> None:
        super().__init__()
        width = num_dense + num_tables * dim
        self.cross = nn.ModuleList(CrossLayer(width, rank) for _ in range(layers))
        self.deep = mlp([width, *deep, 1], final_relu=False, dropout=dropout)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """dense [B, F], sparse [B, T, d] -> logits [B]."""
        x0 = torch.cat([dense, sparse.flatten(1)], dim=1)  # [B, D]
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.deep(x).squeeze(1)
