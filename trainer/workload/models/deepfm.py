"""DeepFM (Guo et al. 2017): first-order linear term + factorisation-machine pairwise term + deep MLP,
all sharing the same field embeddings.

Fields: the T pooled embeddings plus one field for the dense features (a bottom MLP maps them to d,
as in DLRM), so the FM term also crosses dense with sparse features. The first-order term is a
linear layer over [dense, pooled embeddings flattened]: with d-wide rows only, w_t . e_t stands in
for the per-row scalar weight of the original. Single-device code (no collectives).
"""
from __future__ import annotations

import torch
from torch import nn

from .dlrm import mlp


def fm_pairwise(v: torch.Tensor) -> torch.Tensor:
    """v [B, n, d] -> [B]: sum_{i<j} <v_i, v_j> = 0.5 * sum_d ((sum_i v_i)^2 - sum_i v_i^2)."""
    s = v.sum(dim=1)
    return 0.5 * (s * s - (v * v).sum(dim=1)).sum(dim=1)


class DeepFM(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, dim: int, bottom: list[int],
                 deep: list[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim], final_relu=True, dropout=dropout)
        self.linear = nn.Linear(num_dense + num_tables * dim, 1)
        self.deep = mlp([(num_tables + 1) * dim, *deep, 1], final_relu=False, dropout=dropout)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """dense [B, F], sparse [B, T, d] -> logits [B]."""
        fields = torch.cat([self.bottom(dense).unsqueeze(1), sparse], dim=1)  # [B, T+1, d]
        first = self.linear(torch.cat([dense, sparse.flatten(1)], dim=1)).squeeze(1)
        return first + fm_pairwise(fields) + self.deep(fields.flatten(1)).squeeze(1)
