"""The run-comparison checks the parity tests share, and the base configs they compare on: two
in-process runs (RunResult with return_state) equal within the parity tolerance, the model of two
runs' states, and the base runs of the parity backbone, early stopping and the HET cache's audit.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

# ---------------------------------------------------------------------------- the parity backbone
BASE = ["data=tiny", "train.steps=24", "data.global_batch_size=48", "data.test_samples=480",
        "data.eval_batch_size=40", "train.threads=1", "train.progress=off"]


def assert_same_run(ref, got, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
    for name, value in ref.state["dense"].items():
        torch.testing.assert_close(got.state["dense"][name], value, rtol=rtol, atol=atol,
                                   msg=lambda m: f"dense param {name}: {m}")
    assert len(got.state["tables"]) == len(ref.state["tables"])
    for t, (a, b) in enumerate(zip(got.state["tables"], ref.state["tables"])):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"table {t}: {m}")


# ---------------------------------------------------------------------------- early stopping
# a small finite training set, overfitted quickly (Adagrad at lr 0.5): validation AUC peaks at
# step 32 and early stopping (patience 3 evaluations of every 4 steps) ends the run at step 44
ES = ["data=tiny", "data.train_samples=480", "data.val_fraction=0.25", "data.global_batch_size=48",
      "data.test_samples=480", "data.eval_batch_size=40", "train.threads=1", "train.progress=off",
      "train.steps=80", "train.eval_every=4", "train.early_stop.patience=3", "optim=adagrad", "optim.lr=0.5"]


def same_model(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for name, value in a["dense"].items():
        torch.testing.assert_close(b["dense"][name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    for t, (x, y) in enumerate(zip(a["tables"], b["tables"])):
        torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=lambda m: f"table {t}: {m}")


def until_best(overrides: list[str], best: int) -> list[str]:
    """The same run with the same evaluations, stopped at `best`, no early stop, no restore."""
    return overrides + [f"train.steps={best}", "train.early_stop.patience=0",
                        "train.early_stop.restore_best=false"]


# ---------------------------------------------------------------------------- the HET cache's audit
# bigger tables than `tiny`: rows are not touched every step, so staleness really builds up
WIDE = ["data=tiny", "data.table_rows=[97,3001,13,1250]", "data.global_batch_size=96",
        "data.test_samples=288", "data.eval_batch_size=96", "train.threads=1", "train.progress=off",
        "embedding.audit=true"]


def owner_version_at(updates: np.ndarray):
    """gid -> function(step) giving the owner's version at the start of `step` (reads happen before
    that step's updates), from the owners' logs of (step, gid, version after)."""
    hist: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for step, gid, ver in updates.tolist():
        hist[gid].append((step, ver))
    for h in hist.values():
        h.sort()

    def at(gid: int, step: int) -> int:
        before = [v for s, v in hist.get(gid, []) if s < step]
        return max(before) if before else 0
    return at
