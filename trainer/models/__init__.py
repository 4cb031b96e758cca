"""Model registry: name -> builder. Models are single-device code with forward(dense, sparse)."""
from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from .dlrm import DLRM

__all__ = ["DLRM", "build_model"]


def build_model(cfg: ModelConfig, num_dense: int, num_tables: int) -> nn.Module:
    """The model named by cfg.name, taking [B, F] dense and [B, T, d] pooled inputs."""
    if cfg.name == "dlrm":
        return DLRM(num_dense, num_tables, cfg.embedding_dim, list(cfg.bottom_mlp), list(cfg.top_mlp))
    raise ValueError(f"model.name={cfg.name!r} is not a known model")
