"""Wide & Deep (Cheng et al. 2016): a linear "wide" logit plus a deep MLP logit.

The original wide part is a linear model over sparse one-hot (and crossed) features. Our embedding
layer only delivers d-wide pooled rows per table, so the wide part here is a linear layer over
[dense, pooled embeddings flattened] ([B, F + T*d] -> 1): per table it learns w_t . e_t, a linear
function of the row, which can represent any per-row scalar weight in the span of the rows. The deep
part is an MLP over the same input. Single-device code (no collectives).
"""
from __future__ import annotations

import torch
from torch import nn

from .dlrm import mlp


class WDL(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, dim: int, deep: list[int],
                 dropout: float = 0.0) -> None:
        super().__init__()
        width = num_dense + num_tables * dim
        self.wide = nn.Linear(width, 1)
        self.deep = mlp([width, *deep, 1], final_relu=False, dropout=dropout)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """dense [B, F], sparse [B, T, d] -> logits [B]."""
        x = torch.cat([dense, sparse.flatten(1)], dim=1)  # [B, F + T*d]
        return (self.wide(x) + self.deep(x)).squeeze(1)
