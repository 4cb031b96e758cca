"""trainer/run/resolve/memplan.py: every rank knows its bytes before it allocates, rank 0 prints the plan, and a
config that cannot fit stops every rank with one error line (exit 2) instead of the allocator's
traceback. The figures are checked against the tensors a run really holds."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from failure_helpers import _env
from helpers import make_cfg, run_single, spawn

import trainer.run.resolve.memplan as memplan
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.run.runner import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["data=tiny", "train.steps=2", "data.global_batch_size=48", "data.test_samples=96", "train.progress=off",
        "checkpoint.enabled=false"]
HUGE = "data.table_rows=[1000,10000000000]"


@pytest.mark.parametrize("optim,state", [("sgd", 0), ("adagrad", 16 * 4), ("rowwise_adagrad", 4)])
def test_bytes_per_row_are_the_tensors_of_the_store(optim, state):
    """The plan's rows part is exactly the store's weight + optimizer state + version + touched."""
    c = load_config(make_cfg(TINY + [f"optim.sparse={optim}", "model.embedding_dim=16"]))
    plan = memplan.plan_memory(c, 2, 1)
    assert plan.bytes_per_row == 16 * 4 + state + 8 + 1
    from trainer.sparse.embedding.sharding import RowSharding
    from trainer.sparse.embedding.store.shard import ShardStore
    s = RowSharding(list(c.data.table_rows), 2, 1)
    store = ShardStore(s, 16, 0, None, optim, 0.1, 1e-8, torch.device("cpu"))
    held = [store.weight, store.version, store.touched, *store.optimizer.state_tensors().values()]
    assert plan.local_rows == s.local_rows and plan.parts["rows"] == sum(t.numel() * t.element_size() for t in held)


def test_cache_replica_and_snapshot_are_counted():
    c = load_config(make_cfg(TINY + ["cache=lru", "placement=fae", "placement.budget_bytes=4096",
                                     "data.val_fraction=0.1", "data.train_samples=960"]))
    plan = memplan.plan_memory(c, 2, 0)
    slots = sum(memplan.cache_capacities(c))
    assert slots > 0 and plan.parts["cache"] == slots * (2 * c.model.embedding_dim * 4 + 40)
    n_ids = sum(-(-n // 2) * 2 for n in c.data.table_rows)
    assert plan.parts["cache map"] == 4 * n_ids  # the CPU's direct map: 4 B per id of the model
    assert plan.parts["replica"] == 4096
    assert plan.parts["best snapshot"] == plan.local_rows * (1 + c.model.embedding_dim * 4)  # held flag + rows
    c.train.early_stop.snapshot = "disk"  # the rows in a file: the held flag only
    assert memplan.plan_memory(c, 2, 0).parts["best snapshot"] == plan.local_rows
    assert plan.total == sum(plan.parts.values()) and "cache map" not in memplan.plan_memory(
        load_config(make_cfg(TINY + ["cache=none"])), 2, 0).parts


def test_a_dynamic_pools_snapshot_counts_each_slots_id_and_version():
    """Dynamic tables: the best snapshot's part is its tensors: held flag + rows + the kept slot id
    and version (16 B per slot), in memory or with the rows on disk."""
    from trainer.base.core.snapshot_rows import SnapshotRows, SnapshotSlots
    c = load_config(make_cfg(TINY + ["embedding.kind=dynamic", "embedding.capacity=50", "data.val_fraction=0.1",
                                     "data.train_samples=960"]))
    plan = memplan.plan_memory(c, 2, 0)
    slots = len(c.data.table_rows) * 50
    weight = torch.zeros(slots, c.model.embedding_dim)
    kept, ids = SnapshotRows(weight, True), SnapshotSlots(torch.full((slots,), -1))
    kept.put(weight, torch.ones(slots, dtype=torch.bool))
    held = [kept.held, kept._mem, ids.gid, ids.version]
    assert plan.parts["best snapshot"] == sum(t.numel() * t.element_size() for t in held)
    c.train.early_stop.snapshot = "disk"
    assert memplan.plan_memory(c, 2, 0).parts["best snapshot"] == slots * (1 + 16)


@pytest.mark.parametrize("override,part", [(HUGE, "rows"), ("data.batch_size=50000000", "batch")])
def test_a_config_that_cannot_fit_is_one_line_exit_2(tmp_path, override, part):
    """The command: exit 2 with one `error: memory plan ...` line naming the largest part and the
    way out, before any row is allocated (seconds, not the minutes a 730 GB init would take)."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "trainer", "data=bench", override, "train.steps=2",
                           "train.progress=off", f"hydra.run.dir={out}"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert errors[0].startswith("error: memory plan, rank 0/1: rows ") and "available (" in errors[0]
    assert f"the largest part is {part} (" in errors[0] and "train.memory_check=false" in errors[0]


def test_memory_check_false_and_a_table_that_cannot_fit_is_one_line_exit_2(tmp_path):
    """train.memory_check=false starts a plan that cannot fit (a warning); the allocation that
    fails is one `error:` line naming the part and the bytes, exit 2, not the allocator's traceback.
    (Linux's default overcommit refuses a 640 GB allocation at once; with overcommit_memory=1 it
    would succeed and the kernel kill the process as the rows are written: not run there.)"""
    if open("/proc/sys/vm/overcommit_memory").read().strip() == "1":
        pytest.skip("vm.overcommit_memory=1: the allocation would succeed, the OOM killer would end the run")
    done = subprocess.run([sys.executable, "-m", "trainer", "data=bench", HUGE, "train.steps=2",
                           "train.memory_check=false", "train.progress=off", f"hydra.run.dir={tmp_path / 'out'}"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "warning: memory plan" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of memory allocating the embedding shard (rows, optimizer state, versions): ")
    assert " bytes asked for and not available" in last, last


def test_allocating_turns_only_out_of_memory_into_one_line():
    from trainer.base.core.errors import TrainingError, allocating
    with pytest.raises(TrainingError, match=r"^out of memory allocating the cache: 1,024 bytes asked for"):
        with allocating("the cache"):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes.")
    with pytest.raises(TrainingError, match=r"^out of memory allocating rows: 2.00 GiB asked for"):
        with allocating("rows"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; ...)")
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not an allocation failure: as it was
        with allocating("rows"):
            raise RuntimeError("shape mismatch")


def _refused(rank: int, world: int) -> str:
    try:
        run(make_cfg(["data=bench", HUGE, "train.steps=2", "train.progress=off", "checkpoint.enabled=false",
                      "comm=torch"]))
    except ConfigError as exc:
        return str(exc)
    return "trained"


@pytest.mark.dist
def test_every_rank_stops_when_a_plan_cannot_fit():
    """W = 2 (gloo processes): each rank's share is counted (ceil(rows / W) per table) and both
    ranks raise; each names its own plan or the rank that failed."""
    got = spawn(2, _refused, timeout=120)
    assert got[0].startswith("memory plan, rank 0/2: rows 5,000,000,500 x ") or "rank 0" in got[0], got
    assert all(g != "trained" for g in got), got


def test_the_plan_line_and_memory_check_false(tmp_path, monkeypatch, capsys):
    """A run prints rank 0's plan; with too little memory and train.memory_check=false it warns
    and trains."""
    run_single(TINY, return_state=False)
    line = [ln for ln in capsys.readouterr().err.splitlines() if "memory plan" in ln]
    assert len(line) == 1 and line[0].startswith("[trainer] memory plan, rank 0/1: rows "), line
    monkeypatch.setattr(memplan, "available_memory", lambda device, local: (1000, "a test's 1000 B"))
    with pytest.raises(ConfigError, match="of 1.0 kB available \\(a test's 1000 B\\)"):
        run_single(TINY, return_state=False)
    result = run_single(TINY + ["train.memory_check=false"], return_state=False)
    assert result.summary["steps"] == 2
    assert "warning: memory plan" in capsys.readouterr().err


def test_available_memory_is_shared_by_the_ranks_of_a_host():
    one, src = memplan.available_memory(torch.device("cpu"), 1)
    two, src2 = memplan.available_memory(torch.device("cpu"), 2)
    assert one and two and abs(two - one // 2) < one // 10 and src2.endswith("/ 2 ranks on this host")
