"""dense_loss: the training loss of a step, the one expression of every step strategy."""
from __future__ import annotations

from typing import ContextManager

import torch
import torch.nn.functional as F

__all__ = ["dense_loss"]


def dense_loss(model: torch.nn.Module, autocast: ContextManager, dense: torch.Tensor, rows: torch.Tensor,
               labels: torch.Tensor, global_batch: int) -> torch.Tensor:
    """The training loss of this rank's batch: the model's forward under `autocast`, BCE summed
    and divided by the global batch (so the ranks' losses add up to the global mean). The one
    expression of both steps, split or not: the same values either way."""
    with autocast:
        logits = model(dense, rows)
    return F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="sum") / global_batch
