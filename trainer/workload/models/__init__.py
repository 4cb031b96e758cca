"""Model registry: name -> builder. Models are single-device code with forward(dense, sparse)."""
from __future__ import annotations

from torch import nn

from ...base.config import ModelConfig
from .dcn import DCN
from .deepfm import DeepFM
from .dlrm import DLRM
from .wdl import WDL

__all__ = ["DCN", "DLRM", "DeepFM", "WDL", "build_model"]


def build_model(cfg: ModelConfig, num_dense: int, num_tables: int) -> nn.Module:
    """The model named by cfg.name, taking [B, F] dense and [B, T, d] pooled inputs.
    top_mlp is the deep tower of every model; bottom_mlp is used by DLRM and DeepFM; cfg.dropout
    applies after every hidden layer of those MLPs (train mode only)."""
    d, top, p = cfg.embedding_dim, list(cfg.top_mlp), cfg.dropout or 0.0
    if cfg.name == "dlrm":
        return DLRM(num_dense, num_tables, d, list(cfg.bottom_mlp), top, p)
    if cfg.name == "wdl":
        return WDL(num_dense, num_tables, d, top, p)
    if cfg.name == "deepfm":
        return DeepFM(num_dense, num_tables, d, list(cfg.bottom_mlp), top, p)
    if cfg.name == "dcn":
        return DCN(num_dense, num_tables, d, cfg.cross_layers, cfg.cross_rank, top, p)
    raise ValueError(f"model.name={cfg.name!r} is not a known model")
