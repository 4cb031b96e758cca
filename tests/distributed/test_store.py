"""embedding.store=disk (trainer/sparse/embedding/store/tier/disk.py, tiered.py): the shard in files, a row cache in
RAM in front. The tier is storage, not a policy: a run with `disk` equals the same run with `memory`
bit for bit, at W = 1 and on gloo workers, for every optimizer, the HET cache's bounded staleness,
FAE, Herald, half-precision rows and the pipelined step, with a cache of ~150 rows so that rows
really come and go (evictions, prefetches, and calls wanting more rows than the cache holds, which
the files serve directly); a checkpoint saved with `disk` resumes at another W as the memory
one does; the files are gone after the run; what it refuses, it refuses in one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import run_single, run_world, tmpfs
from parity_helpers import BASE, ES
from hvd_launch import ROOT, tail

from trainer.sparse.embedding.store.tier import uring
from trainer.sparse.embedding.store.tier.disk import CHUNK

# tables of ~3.6 MB of rows at d = 16 (56k rows) and a cache of 64 KiB: 32 KiB of pages, ~150 rows
WIDE = [a for a in BASE if not a.startswith("data.test_samples")] + [
    "data.table_rows=[20011,30011,5003,1250]", "data.test_samples=96"]
SMALL_CACHE = [f"embedding.store_cache_bytes={16 * CHUNK}"]

CASES = {
    "w1-adagrad": (1, ["optim=adagrad"]),
    "w2-sgd": (2, ["optim=sgd"]),
    "w2-rowwise-fp16": (2, ["optim=adam", "embedding.dtype=fp16"]),
    "w2-het-ssp": (2, ["cache=lru", "cache.capacity_fraction=0.05", "consistency=ssp"]),
    "w2-fae": (2, ["placement=fae", "placement.budget_bytes=40000"]),
    "w2-herald": (2, ["schedule=herald", "cache=lru", "cache.capacity_fraction=0.05"]),
    "w2-pipeline-ids": (2, ["optim=adagrad", "train.pipeline=ids"]),
    # fixed shapes (train.cuda_graph=on): the whole step at W = 1, the padded exchange at W = 2
    "w1-whole-step": (1, ["optim=adagrad", "train.cuda_graph=on"]),
    "w2-padded-step": (2, ["optim=adagrad", "train.cuda_graph=on"]),
}


def _runs(world: int, overrides: list[str]):
    return [run_single(overrides)] if world == 1 else run_world(world, overrides)


def assert_identical(a, b) -> None:
    """Two runs' losses, dense parameters, every table row and every eval logit: the same bits."""
    assert a.losses == b.losses
    for name, value in a.state["dense"].items():
        assert torch.equal(b.state["dense"][name], value), name
    for t, (x, y) in enumerate(zip(a.state["tables"], b.state["tables"])):
        assert torch.equal(x, y), f"table {t}"
    assert a.summary["eval_logloss"] == b.summary["eval_logloss"]
    assert np.array_equal(a.state["eval_rows"], b.state["eval_rows"])  # every (logit, label), in order


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_disk_equals_memory_bit_for_bit(case, tmp_path):
    world, extra = CASES[case]
    store = tmp_path / "store"
    mem = _runs(world, WIDE + extra)
    disk = _runs(world, WIDE + extra + ["embedding.store=disk", f"embedding.store_dir={store}", *SMALL_CACHE])
    for m, d in zip(mem, disk):
        assert_identical(m, d)
    s = disk[0].summary["store"]
    assert s["kind"] == "disk" and s["cache_bytes"] == 16 * CHUNK and s["disk_bytes"] > 16 * s["cache_bytes"]
    assert s["rows_evicted"] > 0 and s["rows_read_per_step"] > 0 and 0 < s["row_hit_rate"] < 1, s
    assert s["cache_emptied"] == 0, s  # no step read the files' arrays behind the cache's back
    assert s["reader"] == _reader_here(), s  # the reads ahead through io_uring wherever the kernel allows it
    assert mem[0].summary["store"] == {"kind": "memory"}
    assert os.listdir(store) == []  # every rank's files removed at the end


def _reader_here() -> str:
    ring = uring.open_ring(8)
    if ring is None:
        return "threads"
    ring.close()
    return "io_uring"


@pytest.mark.dist
@pytest.mark.parametrize("rows", [["optim=adagrad"], ["optim=adam", "embedding.dtype=bf16"]], ids=["fp32", "bf16"])
def test_a_disk_checkpoint_resumes_at_another_w_as_memory_does(rows, tmp_path):
    """Saved at step 12 on W = 2, resumed at W = 1 to step 24: the same bits as the memory store's
    (fp32 rows with Adagrad's state; bf16 rows, saved as their raw 2 bytes, with row-wise state)."""
    out = {}
    for kind in ("memory", "disk"):
        ck = tmp_path / kind / "ck"
        store = ["embedding.store=disk", f"embedding.store_dir={tmp_path / 'store'}", *SMALL_CACHE] \
            if kind == "disk" else []
        first = WIDE + [*rows, f"checkpoint.dir={ck}", "checkpoint.every=12", *store]
        run_world(2, [a for a in first if not a.startswith("train.steps")] + ["train.steps=12"], return_state=False)
        out[kind] = run_single(first + ["checkpoint.resume=auto"])
    assert out["memory"].summary["start_step"] == out["disk"].summary["start_step"] == 12
    assert_identical(out["memory"], out["disk"])
    for step in ("step_00000012", "step_00000024"):  # the saves themselves: the same bytes, block for block
        shards = [json.loads((tmp_path / kind / "ck" / step / "manifest.json").read_text())["shards"]
                  for kind in ("memory", "disk")]
        assert shards[0] == shards[1] and len(shards[0]) == (2 if step.endswith("12") else 1)


def test_the_best_snapshot_and_its_restore_as_memory_does(tmp_path):
    """Early stopping on validation AUC: snapshots of the touched rows after each better
    evaluation, the best step restored at the end; the same bits as memory. No snapshot empties
    the row cache (it reads the file and clears the marks in both): the restore, which writes
    the file, is the one phase that makes it forget its rows."""
    mem = run_single(ES)
    disk = run_single(ES + ["embedding.store=disk", f"embedding.store_dir={tmp_path / 'store'}", *SMALL_CACHE])
    assert mem.summary["early_stop"]["restored"] and disk.summary["early_stop"]["restored"]
    assert_identical(mem, disk)
    store = disk.summary["store"]
    assert store["cache_emptied"] == 0 and store["cache_forgotten"] == 1, store


def _cli(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, says", [
    (["embedding.kind=dynamic", "embedding.capacity=100"], "needs embedding.kind=fixed"),
    (["train.device=cuda"], "needs train.device=cpu"),
    (["embedding.store=ssd"], "embedding.store"),
    (["embedding.store_cache_bytes=-1"], "must be >= 0"),
])
def test_what_the_disk_store_refuses(args, says, tmp_path):
    r = _cli(["data=tiny", "embedding.store=disk", *args], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, tail(r)
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and says in r.stderr, tail(r)


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path):
    """A 1 MiB tmpfs for a 3.6 MB shard: one line naming both sizes, and nothing left in it."""
    with tmpfs(tmp_path / "small", size="1m") as small:
        r = _cli(WIDE + ["embedding.store=disk", f"embedding.store_dir={small}", "train.steps=2"], tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, tail(r)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: embedding.store=disk: rank 0's shard needs") and "free for it" in last, last
        assert os.listdir(small) == []


def test_a_disk_without_room_for_a_checkpoints_scratch_is_refused_unless_none_is_written(tmp_path):
    """Room for the files but not for a checkpoint's buckets beside them: refused in one line naming
    both; with checkpoint.enabled=false (no save, no resume) the same disk trains."""
    with tmpfs(tmp_path / "mid", size="10m") as mid:
        args = WIDE + ["embedding.store=disk", f"embedding.store_dir={mid}", "train.steps=2"]
        r = _cli(args, tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, tail(r)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: embedding.store=disk: rank 0's shard needs") and "of scratch" in last, last
        assert "checkpoint.enabled=false" in last and os.listdir(mid) == []
        r = _cli(args + ["checkpoint.enabled=false"], tmp_path)
        assert r.returncode == 0, tail(r)
        assert os.listdir(mid) == []


def test_the_memory_plan_counts_the_disk_and_the_cache(tmp_path):
    r = _cli(WIDE + ["embedding.store=disk", f"embedding.store_dir={tmp_path / 'store'}", "train.steps=2",
                     "embedding.store_cache_bytes=1000000"], tmp_path)
    assert r.returncode == 0, tail(r)
    line = next(x for x in r.stderr.splitlines() if "memory plan" in x)
    assert "on disk, RAM cache 1.0 MB" in line, line
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["memory_plan"]["disk"] > summary["memory_plan"]["parts"]["rows"] == 1_000_000
