"""Evaluator: exact AUC / logloss of the model the owners hold, on the whole test or validation split.

Why exact and collective: every rank evaluates its shard of the split and the (logit, label) rows
are gathered, so every rank computes the same AUC over every row (no averaging of per-rank AUCs)
and takes the same early-stopping decision without a message (docs/design.md, section 7). Pending
cache updates are flushed first (section 6), so an evaluation reads exactly what the owners hold.

With train.calibrate the final model's validation logits choose one temperature T by their
logloss (metrics.fit_temperature); later evaluations score sigmoid(T x logit). A positive scale
keeps the order of the logits, so no AUC changes; the test split still decides nothing.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import numpy as np
import torch

from ...base.core.errors import phase
from ...base.comm import Collectives
from ...sparse.embedding import HybridEmbedding
from ...workload.data.source import DataSource
from .metrics import auc_logloss, fit_temperature


class EvalInterrupted(Exception):
    """A stop request reached every rank during an evaluation: it was dropped between two batches."""


class Evaluator:
    """Evaluations of one rank's model (see the module docstring). Every call is collective.
    `interrupt` (set by the Trainer): whether this rank has a stop request; it is asked before each
    evaluation batch and every rank learns any rank's (one 1-element allreduce per batch), so an
    evaluation ends within one batch of a signal (EvalInterrupted)."""

    def __init__(self, comm: Collectives, model: torch.nn.Module, emb: HybridEmbedding, data: DataSource,
                 device: torch.device, autocast: Callable[[], ContextManager[Any]] = nullcontext) -> None:
        self.comm, self.model, self.emb, self.data, self.device = comm, model, emb, data, device
        self.autocast = autocast  # the model's forward context (train.precision: trainer/step/precision.py)
        self.temperature = 1.0  # logit scale of evaluations (calibrate() sets it before the final one)
        self.test_rows: Optional[np.ndarray] = None  # [n, 2] (logit x temperature, label) of the last test evaluation
        self.interrupt: Optional[Callable[[], bool]] = None

    @torch.no_grad()
    def evaluate(self, split: str = "test") -> dict[str, Any]:
        """Exact AUC / logloss over the whole eval split ("test"; "val": the validation split),
        gathered from every rank."""
        both = self.predict(split)
        scaled = np.stack([both[:, 0] * self.temperature, both[:, 1]], axis=1)
        if split == "test":
            self.test_rows = scaled  # the last test evaluation's (calibrated logit, label) rows: train.ensemble
        auc, ll = auc_logloss(scaled[:, 0], scaled[:, 1])
        return {"eval_auc": auc, "eval_logloss": ll, "eval_samples": int(both.shape[0])}

    @torch.no_grad()
    def predict(self, split: str) -> np.ndarray:
        """[n, 2] (logit, label) of every row of the split, gathered from every rank."""
        self.emb.flush()
        self.model.eval()
        logits, labels = [], []
        with phase(self.comm, "eval"):
            for batch in self.data.eval_batches(split):
                if self._interrupted():
                    raise EvalInterrupted(split)
                batch = batch.to(self.device)
                pooled = self.emb.eval_lookup(batch)
                with self.autocast():
                    logits.append(self.model(batch.dense, pooled).float().cpu())
                labels.append(batch.labels.cpu())
            local = torch.stack([torch.cat(logits), torch.cat(labels)], dim=1) if logits \
                else torch.zeros(0, 2)
            return self.comm.allgather(local, kind="meta").numpy()

    def _interrupted(self) -> bool:
        """Whether any rank has a stop request (collective: every rank asks before every batch)."""
        if self.interrupt is None:
            return False
        flag = torch.tensor([float(self.interrupt())])
        return bool(self.comm.allreduce(flag, kind="meta").item() > 0) if self.comm.size > 1 else flag.item() > 0

    def calibrate(self) -> dict[str, Any]:
        """train.calibrate: fit the temperature of the model's logits on the validation split; the
        evaluations after it apply it. Returns summary.json's `calibration`."""
        both = self.predict("val")
        t, before, after = fit_temperature(both[:, 0], both[:, 1])
        self.temperature = t
        if self.comm.rank == 0:
            print(f"[trainer] calibration: logit temperature {t:.4g} fitted on {both.shape[0]} validation rows "
                  f"(their logloss {before:.4f} -> {after:.4f}); train.calibrate=false turns it off", file=sys.stderr)
        return {"temperature": t, "val_logloss_before": before, "val_logloss_after": after,
                "val_samples": int(both.shape[0])}
