"""Predictor: an exported artifact (artifact.py) scoring batches as the trainer's evaluation does.

The same arithmetic as Evaluator.predict: each bag's rows read from its table (upcast to fp32 as
the trainer's workspace is), pooled by kernels.pooled_gather (sum or mean, the bag's rows in
order), then the dense program (under the autocast of train.precision where it was bf16 / fp16,
as the evaluation ran). So the logits equal the trainer's evaluation of the same rows (the test
checks 1e-6; in fp32 on a CPU they are the same bits).

Memory: the tables are memory-mapped; a batch reads only its rows.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import numpy as np
import torch

import kernels
from ..step.precision import AUTOCAST_DTYPES
from .artifact import ServingError, read_manifest
from .preprocess import RawRows
from .tables import TableRows


class Predictor:
    """Predictor(DIR).score(dense, ids) -> probabilities; .logits(...) the logits."""

    def __init__(self, directory: str, verify: bool = True) -> None:
        """verify: every file checked against the manifest's sha256 first (reads the whole
        artifact once; False trusts it)."""
        self.manifest = read_manifest(directory, verify)
        m = self.manifest["model"]
        self.num_dense, self.num_tables, self.dim = int(m["num_dense"]), int(m["num_tables"]), int(m["embedding_dim"])
        self.pooling, self.autocast = m["pooling"], AUTOCAST_DTYPES.get(m.get("precision", "fp32"))
        self.tables = [TableRows(directory, t) for t in self.manifest["tables"]]
        self.rows = torch.tensor([t.num_rows for t in self.tables], dtype=torch.int64)
        self.program = torch.export.load(os.path.join(directory, m["dense"])).module()
        self.raw = RawRows(directory, [int(t["rows"]) for t in self.manifest["tables"]]) \
            if self.manifest.get("preprocess") else None

    @torch.no_grad()
    def logits(self, dense, ids, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B] logits of B samples: dense [B, F] float; ids [B, T] (one id per table) or, with
        lengths [B, T] (ids per bag), the bags' ids flattened sample-major, table by table."""
        dense = torch.as_tensor(np.asarray(dense, dtype=np.float32) if not torch.is_tensor(dense) else dense,
                                dtype=torch.float32)
        ids = torch.as_tensor(ids, dtype=torch.int64)
        b, t = dense.shape[0], self.num_tables
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ServingError(f"dense features of shape {tuple(dense.shape)}: the model takes [B, {self.num_dense}]")
        if lengths is None:
            if ids.shape != (b, t):
                raise ServingError(f"ids of shape {tuple(ids.shape)}: the model takes [B, {t}] (one id per table) "
                                   "for B dense rows, or flat ids with lengths")
            self._check(ids, self.rows.expand(b, t), torch.arange(t).expand(b, t))
            # one row per bag: its sum and its mean are the row itself (what pooled_gather gives, bit for bit)
            pooled = torch.stack([self.tables[k].rows(ids[:, k]) for k in range(t)], 1)
            return self._dense(dense, pooled)
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if lengths.shape != (b, t) or int(lengths.sum()) != ids.numel():
            raise ServingError(f"lengths of shape {tuple(lengths.shape)} summing to {int(lengths.sum())} for "
                               f"{ids.numel()} ids: [B, {t}] bag sizes whose sum is the number of ids")
        ids = ids.reshape(-1)
        table = torch.arange(t).repeat(b).repeat_interleave(lengths.reshape(-1))  # each id's table
        self._check(ids, self.rows.index_select(0, table), table)
        ws = torch.empty(ids.numel(), self.dim, dtype=torch.float32)
        for k in range(t):
            at = torch.nonzero(table == k).squeeze(1)
            if at.numel():
                ws.index_copy_(0, at, self.tables[k].rows(ids.index_select(0, at)))
        offsets = torch.zeros(b * t + 1, dtype=torch.int64)
        torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
        pooled = kernels.pooled_gather(ws, torch.arange(ids.numel()), offsets, t, mode=self.pooling)
        return self._dense(dense, pooled)

    def _dense(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The dense program's logits, under the run's autocast where it had one."""
        if self.autocast is None:
            return self.program(dense, pooled).float()
        with torch.autocast("cpu", dtype=self.autocast):
            return self.program(dense, pooled).float()

    @staticmethod
    def _check(ids: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> None:
        """ServingError unless every id is inside its table's rows (rows, table: each id's)."""
        bad = (ids < 0) | (ids >= rows)
        if bool(bad.any()):
            i = tuple(int(x) for x in torch.nonzero(bad)[0])
            raise ServingError(f"id {int(ids[i])} of table {int(table[i])} is outside its {int(rows[i]):,} rows "
                               f"({int(bad.sum())} such ids in the batch)")

    def score(self, dense, ids, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B] probabilities (the sigmoid of the logits)."""
        return torch.sigmoid(self.logits(dense, ids, lengths))

    def score_file(self, path: str) -> Iterator[torch.Tensor]:
        """Probabilities of the raw rows of a TSV file (.gz too; data=criteo artifacts), in order,
        a chunk of rows at a time."""
        if self.raw is None:
            raise ServingError("this artifact's data has no raw row format (data.name="
                               f"{self.manifest['config']['data']['name']}): score the trainer's ids with "
                               "Predictor.score(dense, ids)")
        for batch in self.raw.batches(path):
            yield self.score(batch.dense, batch.values, batch.lengths)
