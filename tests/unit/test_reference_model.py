"""The single-process path equals an independent plain-PyTorch implementation.

The parity tests compare W workers against our own W=1 run; this closes the loop: W=1 through the
sharded store, exchange and sparse optimizers equals nn.EmbeddingBag tables + torch.optim on every
parameter (dense gradients on embedding rows, which leave untouched rows unchanged).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import make_cfg, run_single
from trainer.base.config import table_rows
from trainer.run.resolve.configure import load_config
from trainer.workload.data import make_data
from trainer.sparse.embedding import init_rows
from trainer.workload.models import build_model


def plain_torch_run(overrides: list[str]):
    c = load_config(make_cfg(overrides))
    rows, d = table_rows(c), c.model.embedding_dim
    tables = [torch.nn.Parameter(init_rows(c.train.seed, rows, d, torch.full((n,), t), torch.arange(n), None))
              for t, n in enumerate(rows)]
    torch.manual_seed(c.train.seed)
    model = build_model(c.model, c.data.num_dense, len(rows))
    params = list(model.parameters()) + tables
    o = c.optim
    opt = (torch.optim.SGD(params, lr=o.lr) if o.dense == "sgd" else
           torch.optim.Adagrad(params, lr=o.lr, eps=o.eps, initial_accumulator_value=o.initial_accumulator))
    data = make_data(c, 0, 1)
    losses = []
    for step in range(c.train.steps):
        b = data.train_batch(step)
        table = b.table_index()
        pooled = []
        for t in range(len(rows)):  # per table embedding_bag over this table's bags
            bag_len = b.lengths[:, t]
            vals = b.values[table == t]
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), bag_len.cumsum(0)])
            pooled.append(F.embedding_bag(vals, tables[t], offs, mode=c.model.pooling, include_last_offset=True))
        logits = model(b.dense, torch.stack(pooled, dim=1))
        loss = F.binary_cross_entropy_with_logits(logits, b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), [t.detach() for t in tables]


@pytest.mark.parametrize("optim,pooling", [("sgd", "sum"), ("adagrad", "mean")])
def test_single_process_equals_plain_torch(optim, pooling):
    overrides = ["data=tiny", "train.steps=15", "data.batch_size=32", "data.test_samples=64",
                 f"optim={optim}", f"model.pooling={pooling}", "data.min_bag=0", "train.progress=off"]
    losses, dense, tables = plain_torch_run(overrides)
    ours = run_single(overrides)
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for name, value in dense.items():
        torch.testing.assert_close(ours.state["dense"][name], value, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.state["tables"], tables):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
