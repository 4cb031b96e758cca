"""scripts/simulate_cache.py and trainer/tools/simulate.py: the cache simulator.

- OPT (Belady's MIN) against a brute-force version written here and hand-checked traces.
- Invariants checked from the simulator's audit log, independently of the code enforcing them:
  no read more than pull_bound behind the owner (owner history rebuilt from the update log), every
  use of a row reaches its owner exactly once (flush included), BSP pulls every remote read.
- The simulator equals a real 2-process training run counter for counter (marked dist).
- Trace files (.npz / text) with --owners server and W = 1 against an independent textbook LRU.
- The CLI prints exactly one JSON line; W = 64 finishes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch

from trainer.tools import simulate as sim
from trainer.base.config import local_batch_size, table_rows
from trainer.workload.data import SyntheticData

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "simulate_cache.py")
# bigger tables than `tiny`, so rows are not touched every step and staleness builds up
WIDE = ["data=tiny", "data.table_rows=[97,3001,13,1250]", "data.global_batch_size=96"]
POLICIES = ("lru", "lfu", "lfu_pinned")


# ---------------------------------------------------------------------------- OPT
def brute_force_opt(seq: list[int], capacity: int, bypass: bool = False) -> list[bool]:
    """Belady's MIN the obvious way: on a miss with a full cache, scan forward for every cached
    id's next use and evict the farthest (never = infinity). O(n * C * n)."""
    cache: list[int] = []
    hits = []
    for i, x in enumerate(seq):
        if x in cache:
            hits.append(True)
            continue
        hits.append(False)
        if capacity == 0:
            continue
        if len(cache) < capacity:
            cache.append(x)
            continue
        rest = seq[i + 1:]
        nxt = lambda y: rest.index(y) if y in rest else len(seq)  # noqa: E731
        victim = max(cache + ([x] if bypass else []), key=nxt)
        if victim != x:
            cache[cache.index(victim)] = x
    return hits


def test_belady_hand_checked():
    # C=2: 1 m, 2 m, 3 m (evict 2: next use t4 > t3), 1 hit, 2 m (evict 3: never again),
    # 4 m (evict 2: t7 > t6), 1 hit, 2 m  -> hits at t3, t6
    seq = np.array([1, 2, 3, 1, 2, 4, 1, 2])
    assert sim.belady_hits(seq, 2).tolist() == [False] * 3 + [True, False, False, True, False]
    # with bypass 3 and 4 (never used again) are not cached: 1 and 2 always hit after warm-up
    assert np.nonzero(sim.belady_hits(seq, 2, bypass=True))[0].tolist() == [3, 4, 6, 7]
    # C=3: 1 2 3 cached, 1 hit, 2 hit, 4 m (evict 3: never again), 1 hit, 2 hit
    assert np.nonzero(sim.belady_hits(seq, 3))[0].tolist() == [3, 4, 6, 7]
    assert not sim.belady_hits(seq, 1).any() and not sim.belady_hits(seq, 0).any()
    assert sim.belady_hits(seq, 4).sum() == 8 - 4  # everything fits: only first uses miss
    # a b a with C=1: MIN must insert b (no hit); with bypass a stays and hits
    assert sim.belady_hits(np.array([5, 6, 5]), 1).tolist() == [False, False, False]
    assert sim.belady_hits(np.array([5, 6, 5]), 1, bypass=True).tolist() == [False, False, True]
    assert sim.next_use(np.array([7, 8, 7, 7, 9])).tolist() == [2, 5, 3, 5, 5]


@pytest.mark.parametrize("bypass", [False, True])
def test_belady_matches_brute_force(bypass):
    rng = np.random.default_rng(0)
    for trial in range(150):
        n, k = int(rng.integers(1, 120)), int(rng.integers(1, 25))
        p = 1.0 / np.arange(1, k + 1) ** rng.uniform(0, 1.5)
        seq = rng.choice(k, size=n, p=p / p.sum()) * 3 + 1000  # ids need not be compact
        cap = int(rng.integers(0, k + 2))
        want = brute_force_opt(seq.tolist(), cap, bypass)
        assert sim.belady_hits(seq, cap, bypass).tolist() == want, (trial, seq.tolist(), cap)


def test_belady_is_fast():
    rng = np.random.default_rng(1)
    seq = (rng.zipf(1.2, size=400_000) % 200_000).astype(np.int64)
    t0 = time.perf_counter()
    hits = sim.belady_hits(seq, 2_000)
    assert time.perf_counter() - t0 < 15.0
    assert 0 < hits.sum() < seq.size


def test_opt_bounds_every_policy():
    """OPT with bypass is an upper bound of any cache that may leave misses uncached."""
    for policy in POLICIES:
        trace, spec, cfg = sim.build(WIDE + [f"cache={policy}", "cache.capacity_fraction=0.05"], 3, log=None)
        out = sim.simulate(trace, spec, 12, opt_bypass=True)
        assert 0 < out["hits"] and out["hit_rate"] <= out["opt_bypass_hit_rate"] + 1e-12
        assert out["opt_hit_rate"] <= out["opt_bypass_hit_rate"] + 1e-12


# ---------------------------------------------------------------------------- invariants
def _usage(trace, owners: sim.Owners, steps: int) -> dict[int, int]:
    """gid -> number of (step, worker) that used it: the updates its owner must end up with."""
    used: dict[int, int] = {}
    for s in range(steps):
        for w in range(trace.workers):
            for g in torch.unique(owners.gids(*trace.batch(s, w))).tolist():
                used[g] = used.get(g, 0) + 1
    return used


def _check_audit(sim_: sim.CacheSimulator, trace, steps: int, pull: int) -> np.ndarray:
    """Owner history rebuilt from the update log; returns the staleness of every read."""
    log = sim_.audit.result()
    reads, upd = log["reads"], log["updates"]
    step, gid, read_at, owner_seen = reads[:, 0], reads[:, 2], reads[:, 3], reads[:, 4]
    for s in range(steps):  # owner version at the start of step s = updates applied before it
        before = upd[upd[:, 0] < s]
        version = np.zeros(sim_.owners.n_ids, np.int64)
        np.add.at(version, before[:, 1], before[:, 2])
        at = step == s
        assert (owner_seen[at] == version[gid[at]]).all()
    stale = owner_seen - read_at
    assert (stale >= 0).all() and (pull < 0 or stale.max() <= pull)
    total = np.zeros(sim_.owners.n_ids, np.int64)
    np.add.at(total, upd[:, 1], upd[:, 2])
    used = _usage(trace, sim_.owners, steps)
    assert {g: int(total[g]) for g in np.nonzero(total)[0]} == used  # every use, exactly once
    return stale


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pull,push", [(2, 3), (0, 0), (0, -1), (-1, -1)])
def test_staleness_bound_and_no_lost_update(policy, pull, push):
    steps = 10
    trace, spec, cfg = sim.build(WIDE + [f"cache={policy}", "cache.capacity_fraction=0.08",
                                         f"consistency.pull_bound={pull}", f"consistency.push_bound={push}"],
                                 3, log=None)
    s = sim.run_simulation(trace, spec, steps, audit=True)
    stale = _check_audit(s, trace, steps, pull)
    out = sim.report(s, trace, 0.0)
    assert out["pushed_updates"] == out["requested"]  # each remote read: one update, pushed once
    assert out["max_staleness"] == stale.max() and sum(out["staleness_hist"].values()) == out["requested"]
    assert out["pulled"] == out["requested"] - out["fresh_hits"]
    if pull == 0:
        assert out["max_staleness"] == 0
    else:
        assert stale.max() > 0  # bounded staleness really lets stale reads through
    if (pull, push) == (0, 0):  # BSP: a worker's own push outdates its copy, so every read pulls
        assert out["fresh_hits"] == 0 and out["pulled"] == out["requested"]
    if (pull, push) == (0, -1):  # fresh hits exist, and only when nobody updated the row
        assert out["fresh_hits"] > 0 and (stale == 0).all()


def test_no_cache_baseline():
    trace, spec, cfg = sim.build(WIDE + ["cache=none"], 3, log=None)
    out = sim.simulate(trace, spec, 6)
    assert out["hits"] == 0
    assert out["pulled"] == out["pushed_rows"] == out["pushed_updates"] == out["requested"]
    assert out["bytes_reduction"] == 0.0 and out["bytes_per_sample"] == out["no_cache_bytes_per_sample"]
    # 8-byte ids + a 16-float row each way per remote id
    assert out["bytes"]["total"] == out["requested"] * (8 + 2 * 16 * 4)


def test_worker_batches_are_the_trainers():
    cfg = sim.compose_config(WIDE)
    trace = sim.ConfigTrace(cfg, 3)
    for w in range(3):
        ref = SyntheticData(cfg.data, table_rows(cfg), w, 3, local_batch_size(cfg, 3))
        for s in (0, 5):
            got, want = trace.batch(s, w), ref.train_batch(s)
            assert torch.equal(got[0], want.values) and torch.equal(got[1], want.table_index())


# ---------------------------------------------------------------------------- against the trainer
@pytest.mark.dist
def test_simulator_equals_trainer_counters():
    """Real 2-worker training (gloo) vs the simulator on the same overrides, counter for counter.
    The trainer's summary counts are summed over ranks and include its flush before the final eval
    (train.eval_every=0: no other flush). Three configs share one pair of processes."""
    from data_helpers import train_models
    from helpers import spawn
    steps = 12
    base = ["data=tiny", "data.table_rows=[97,3001,13,1250]", "data.global_batch_size=64",
            "cache.capacity_fraction=0.05"]
    configs = [base + ["cache=lru", "consistency=ssp", "consistency.pull_bound=2",
                       "consistency.push_bound=3"],
               base + ["cache=lfu_pinned", "cache.pin_threshold=3", "consistency=asp"],
               base + ["cache=lfu", "consistency=bsp"]]
    tail = [f"train.steps={steps}", "train.eval_every=0", "data.test_samples=128",
            "data.eval_batch_size=64", "train.threads=1", "train.progress=off"]
    runs = spawn(2, train_models, [c + tail for c in configs])[0]
    keys = ("requested", "hits", "fresh_hits", "pulled", "transient", "pushed_rows", "pushed_updates",
            "evicted_dirty")
    for overrides, run in zip(configs, runs):
        got = run["summary"]["cache"]
        trace, spec, cfg = sim.build(overrides, 2, log=None)
        out = sim.simulate(trace, spec, steps)
        assert {k: out[k] for k in keys} == {k: got[k] for k in keys}, overrides
        assert out["max_staleness"] == got["staleness"]["max"]
        assert out["staleness_hist"] == got["staleness"]["hist"]
        assert out["bytes"]["version_check"] == got["version_check_bytes"]
        assert out["hits"] > 0 and out["transient"] > 0
    assert runs[0]["summary"]["cache"]["evicted_dirty"] > 0 and runs[0]["summary"]["cache"]["fresh_hits"] > 0


# ---------------------------------------------------------------------------- trace files
def textbook_lru_hits(stream: list[int], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for x in stream:
        if x in cache:
            hits += 1
            cache.move_to_end(x)
            continue
        if capacity == 0:
            continue
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[x] = None
    return hits


def _random_ids(steps: int, batch: int, rows: list[int], seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.zipf(1.3, size=(steps, batch)) % n for n in rows], axis=2).astype(np.int64)


def _write_txt(path, ids: np.ndarray, extra: str = "") -> str:
    with open(path, "w") as f:
        f.write("# step-major samples\n")
        for row in ids.reshape(-1, ids.shape[2]):
            f.write(", ".join(str(v) for v in row) + "\n")
        f.write(extra)
    return str(path)


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_trace_files_server_lru_is_textbook_lru(tmp_path):
    rows, cap = [50, 400], 7
    ids = _random_ids(300, 1, rows)
    np.savez(tmp_path / "t.npz", ids=ids, table_rows=np.array(rows))
    txt = _write_txt(tmp_path / "t.txt", ids, extra="1 2\n")  # one more sample: 301 steps of 1
    outs = []
    for path in (str(tmp_path / "t.npz"), txt):
        proc = _run_cli("--workers", "1", "--owners", "server", "--trace", path, "--batch", "1",
                        "--per-table", "cache=lru", f"cache.capacity_rows={cap}")
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout))
    npz, text = outs
    assert text["steps"] == 301 and npz["steps"] == 300  # the txt has one more sample
    for t, n in enumerate(rows):
        stream = ids[:, 0, t].tolist()
        assert npz["per_table"][t]["hits"] == textbook_lru_hits(stream, cap)
        assert npz["per_table"][t]["opt_hits"] == sum(brute_force_opt(stream, cap))
    want = sum(textbook_lru_hits(ids[:, 0, t].tolist(), cap) for t in range(2))
    assert npz["hit_rate"] == want / (2 * 300) and npz["requested"] == 600
    for t, extra in enumerate((1, 2)):
        assert text["per_table"][t]["hits"] == textbook_lru_hits(ids[:, 0, t].tolist() + [extra], cap)


def test_text_trace_steps_and_errors(tmp_path):
    ids = _random_ids(5, 4, [30, 30, 30])
    txt = _write_txt(tmp_path / "a.txt", ids, extra="1 2 3\n1\t2\t3\n")  # 22 samples
    got, rows = sim.load_trace(txt, 4)
    assert got.shape == (5, 4, 3) and np.array_equal(got, ids) and rows == list(ids.reshape(-1, 3).max(0) + 1)
    npz = tmp_path / "a.npz"
    np.savez(npz, ids=ids)
    assert np.array_equal(sim.load_trace(str(npz), None)[0], ids)
    with pytest.raises(sim.TraceError, match="do not divide among 3 workers"):
        sim.build([], 3, trace_file=txt, batch=4, log=None)
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2\n3 4\n5 -6\n")
    with pytest.raises(sim.TraceError, match=r"bad.txt:3: negative id '-6' in column 2"):
        sim.load_trace(str(bad), 1)
    bad.write_text("1 2\n3 x\n")
    with pytest.raises(sim.TraceError, match=r"bad.txt:2: not an integer id 'x'"):
        sim.load_trace(str(bad), 1)
    bad.write_text("1 2\n3 4 5\n")
    with pytest.raises(sim.TraceError, match=r"bad.txt:2: 3 ids"):
        sim.load_trace(str(bad), 1)
    neg = ids.copy()
    neg[1, 2, 0] = -1
    np.savez(npz, ids=neg)
    with pytest.raises(sim.TraceError, match=r"ids\[1, 2, 0\]"):
        sim.load_trace(str(npz), None)
    np.savez(npz, ids=ids, table_rows=np.array([30, 30, 5]))
    with pytest.raises(sim.TraceError, match="table 2 has id"):
        sim.load_trace(str(npz), None)
    proc = _run_cli("--trace", txt, "--batch", "8", "--workers", "2", "cache=lru")
    assert proc.returncode == 0 and "dropped the last 6 samples" in proc.stderr
    assert json.loads(proc.stdout)["steps"] == 2


# ---------------------------------------------------------------------------- CLI
def test_cli_one_json_line_and_64_workers():
    proc = _run_cli("--workers", "64", "--steps", "3", "data=tiny", "cache=lfu_pinned",
                    "consistency=ssp", "--per-table")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    keys = ["workers", "steps", "owners", "policy", "capacity_rows", "pull_bound", "push_bound",
            "requested", "hits", "hit_rate", "opt_hit_rate", "hit_rate_vs_opt", "pulled",
            "pushed_rows", "pushed_updates", "evicted_dirty", "transient", "max_staleness",
            "staleness_hist", "bytes", "bytes_per_sample", "no_cache_bytes_per_sample",
            "bytes_reduction", "seconds", "per_table"]
    assert set(keys) <= set(out) and set(out["bytes"]) == {"version_check", "rows", "pushes", "total"}
    assert out["workers"] == 64 and out["pushed_updates"] == out["requested"] > 0
    assert "simulate: step 3/3" in proc.stderr
    help_ = _run_cli("--help")
    assert help_.returncode == 0 and "Belady" in help_.stdout and "farthest" in help_.stdout


def test_cli_bad_config_is_a_clear_error():
    proc = _run_cli("data=tiny", "cache.policy=fifo")
    assert proc.returncode == 2 and "cache.policy" in proc.stderr and proc.stdout == ""


def test_criteo_dir(tmp_path):
    """data=criteo data.dir=DIR: worker w reads rank w's memmap batches."""
    from data_helpers import prepare_sample
    prepare_sample(str(tmp_path))
    d = str(tmp_path / "prepared")
    over = ["data=criteo", f"data.dir={d}", "data.batch_size=32", "cache=lru"]
    trace, spec, cfg = sim.build(over, 2, log=None)
    assert sim.resolve_steps(trace, cfg, None, None) == cfg.train.steps > 1
    from trainer.workload.data.blocks import CriteoData, memmap_reader
    ref = CriteoData(cfg.data, table_rows(cfg), 1, 2, 32, memmap_reader(cfg.data.num_dense))
    for s in range(3):
        assert torch.equal(trace.batch(s, 1)[0], ref.train_batch(s).values)
    out = sim.simulate(trace, spec, 4)
    assert out["requested"] > 0 and out["hits"] > 0


def test_owners_auto_uses_a_server_at_one_worker(tmp_path):
    """W=1 with the default owners replays the whole trace through one cache (nothing is local)."""
    ids = np.array([[[1], [2]], [[1], [3]], [[1], [2]]], dtype=np.int64)  # 3 steps, 2 samples, 1 table
    path = str(tmp_path / "t.npz")
    np.savez(path, ids=ids)
    trace, spec, _ = sim.build(["cache=lru", "cache.capacity_rows=2"], 1, trace_file=path, log=None)
    assert spec.owners == "server"
    out = sim.simulate(trace, spec, 3)
    assert out["requested"] == 6 and out["hits"] == 2  # 1 and 2 re-read from the cache of 2 rows
    assert sim.build(["cache=lru"], 2, trace_file=path, log=None)[1].owners == "sharded"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pull,push", [(2, 3), (0, 0), (-1, -1)])
@pytest.mark.parametrize("fraction", [0.08, 0.01])  # 0.01: full regions, evictions and transient rows
def test_announced_push_sizes_are_the_push(policy, pull, push, fraction, monkeypatch):
    """HetRemote.read announces which rows the step's write will push (HetWire.announce: the push's
    sizes travel during forward/backward); the write must push exactly those rows, whatever the
    evictions, transient rows and due counts, and the simulation's result must not change."""
    from trainer.sparse.embedding.remote.het import Announced
    from trainer.sparse.sim.engine import InProcessHetWire

    announced, checked = {}, []  # the simulator reads for every worker, then writes for every one

    def announce(self, gids, weights=None):
        pushed = gids if weights is None else gids[weights > 0]
        announced[self.rank] = pushed.clone()
        return Announced([int(pushed.numel())], None)

    def push_updates_start(self, pushes, ann=None):
        if ann is None:  # the final flush (not a training step's write): nothing announced
            assert self.rank not in announced
            return lambda: pushes
        assert torch.equal(torch.sort(announced.pop(self.rank)).values, torch.sort(pushes.gids).values)
        checked.append(len(pushes))
        return lambda: pushes

    args = WIDE + [f"cache={policy}", f"cache.capacity_fraction={fraction}",
                   f"consistency.pull_bound={pull}", f"consistency.push_bound={push}"]
    trace, spec, _ = sim.build(args, 3, log=None)
    want = sim.report(sim.run_simulation(trace, spec, 8), trace, 0.0)
    monkeypatch.setattr(InProcessHetWire, "announce", announce, raising=False)
    monkeypatch.setattr(InProcessHetWire, "push_updates_start", push_updates_start)
    got = sim.report(sim.run_simulation(trace, spec, 8), trace, 0.0)
    assert len(checked) == 8 * 3 and sum(checked) > 0
    assert got == want
    if fraction == 0.01:  # the case the announcement could get wrong: rows that leave the cache
        assert want["transient"] > 0 and (push == 0 or want["evicted_dirty"] > 0)
