"""What the dynamic-table tests share: a store without processes (gid, store), the base run of the
W-worker parity tests (BASE, NO_EVICTION), their checks (the same ids admitted, the counters) and
the resume at step 8 that several of them run."""
from __future__ import annotations

import torch

from helpers import run_world
from parity_helpers import assert_same_run
from trainer.sparse.embedding.dynamic.admission import Counting
from trainer.sparse.embedding.dynamic.shard import DynamicStore
from trainer.sparse.embedding.sharding import ID_BITS, HashSharding

# ---------------------------------------------------------------------------- without processes
CPU = torch.device("cpu")


def gid(t: int, i) -> torch.Tensor:
    return (torch.as_tensor(i, dtype=torch.int64) | (t << ID_BITS)).reshape(-1)


def store(capacity=4, admit_after=1, eviction="lru", world=1, rank=0, optimizer="sgd", tables=2, counting=Counting()):
    sh = HashSharding(tables, capacity, world, rank)
    return DynamicStore(sh, 3, 7, 0.1, optimizer, 0.5, 1e-8, CPU, 0.1, admit_after=admit_after, eviction=eviction,
                        counting=counting)


# ---------------------------------------------------------------------------- W workers against one process
BASE = ["data=tiny", "train.steps=16", "data.global_batch_size=48", "data.test_samples=480",
        "data.eval_batch_size=40", "train.threads=1", "train.progress=off", "checkpoint.enabled=false",
        "embedding.kind=dynamic", "data.scramble_ids=true"]
NO_EVICTION = ["embedding.capacity=1100"]  # > the tiny preset's largest table (1001 ids)


def assert_same_ids(ref, got):
    for t, (a, b) in enumerate(zip(ref.state["table_ids"], got.state["table_ids"])):
        assert torch.equal(a, b), f"table {t}: other ids admitted"


def resume_at_step_8_equals_uninterrupted(tmp_path, extra):
    """Train BASE + extra (16 steps) on W = 2 saving at steps 8 and 16, resume the step-8 checkpoint
    on W = 2 and check it against the uninterrupted run: every loss, dense parameter, admitted id
    and row, and the dynamic counters. Returns the uninterrupted run."""
    import trainer.run.checkpoint as ckpt
    overrides = [o for o in BASE if o != "checkpoint.enabled=false"] + extra + ["checkpoint.every=8"]
    root = str(tmp_path / "full")
    full = run_world(2, overrides + [f"checkpoint.dir={root}"])
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [8, 16]
    step8 = dict(ckpt.complete_checkpoints(root))[8]
    got = run_world(2, overrides + [f"checkpoint.resume={step8}", f"checkpoint.dir={tmp_path / 'again'}"])
    assert got[0].summary["start_step"] == 8
    for a, b in zip(full, got):
        assert_same_ids(a, b)
        assert_same_run(a, b)
    assert got[0].summary["dynamic"] == full[0].summary["dynamic"]
    return full


def counts(d):
    """summary.json's dynamic counters without the pools' capacity (W x embedding.capacity)."""
    drop = ("capacity_rows",)
    return {k: ([{a: b for a, b in t.items() if a not in drop} for t in v] if k == "tables" else v)
            for k, v in d.items() if k not in drop}
