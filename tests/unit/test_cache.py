"""HET cache + bounded staleness (docs/design.md, sections 1 "What correct means" and 5 "The HET
cache and its bounds").

- BSP (bounds 0) with every policy and capacity, tiny ones included, equals the single-process
  reference exactly (the parity backbone, extended).
- Read staleness: with pull_bound s no read is ever more than s owner updates behind. Checked
  independently of the code that enforces it: every read's version (requester side) is compared with
  the owner's version history rebuilt from the owners' own update log.
- No lost update: with SGD the tables move by exactly -lr * (sum of every row gradient any worker
  computed), whatever the bounds, policy and evictions, once the final flush is done.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_same_eval, make_cfg, run_single, run_world
from parity_helpers import WIDE, assert_same_run, owner_version_at
from trainer.base.config import ConfigError, table_rows
from trainer.run.resolve.configure import load_config
from trainer.sparse.embedding.cache.rows import LFU, LRU, LFUPinned, RowCache
from trainer.sparse.embedding.cache.consistency import UNBOUNDED, Bounds, needs_row, push_due
from trainer.sparse.embedding.sharding import RowSharding
from trainer.sparse.embedding.store.shard import init_rows

BASE = ["data=tiny", "train.steps=24", "data.global_batch_size=48", "data.test_samples=480",
        "data.eval_batch_size=40", "train.threads=1", "train.progress=off"]


# ---------------------------------------------------------------------------- unit: rules, cache
def test_consistency_rules():
    cached = torch.tensor([-1, 5, 5, 5])
    owner = torch.tensor([3, 5, 7, 8])
    bound = torch.tensor([2, 2, 2, 2])
    assert needs_row(cached, owner, bound).tolist() == [True, False, False, True]
    assert needs_row(cached, owner, torch.zeros(4, dtype=torch.int64)).tolist() == [True, False, True, True]
    b = Bounds.from_lists([-1, 0], [3, -1])
    assert b.pull.tolist() == [UNBOUNDED, 0] and b.push.tolist() == [3, UNBOUNDED]
    assert push_due(torch.tensor([3, 4, 10**9]), b.push[torch.tensor([0, 0, 1])]).tolist() == [False, True, False]
    assert [Bounds.from_lists(p, q).label for p, q in (([0, 0], [0, 0]), ([-1, -1], [-1, -1]),
                                                       ([0, 0], [0, 1]), ([-1, 0], [-1, -1]))] == \
        ["bsp", "asp", "ssp", "ssp"]


def _cache(policy, caps=(3,), dim=2):
    return RowCache(list(caps), dim, policy, n_ids=100, local_lr=0.5)


def _install(cache, gids, step, table=0):
    g = torch.tensor(gids)
    return cache.install(g, torch.full_like(g, table), torch.ones(len(gids), cache.dim),
                         torch.zeros_like(g), step)


def _three_entries(policy):
    """Entries 1, 2, 3 with freq 4, 2, 3 and last use at steps 3, 4, 2."""
    c = _cache(policy)
    _install(c, [1, 2, 3], step=0)
    for step, used in ((1, [1, 3]), (2, [1, 3]), (3, [1]), (4, [2])):
        c.touch(c.lookup(torch.tensor(used)), step)
    return c


@pytest.mark.parametrize("policy,victim", [(LRU(), 3), (LFU(), 2)])
def test_policies_pick_their_victim(policy, victim):
    c = _three_entries(policy)
    slots, _ = _install(c, [9], step=5)
    assert slots.item() >= 0
    assert c.lookup(torch.tensor([victim])).item() == -1
    assert c.lookup(torch.tensor([9])).item() == slots.item()
    assert (c.lookup(torch.tensor([1, 2, 3])) >= 0).sum() == 2


def test_lfu_pinned_with_every_entry_pinned_makes_new_rows_transient():
    c = _three_entries(LFUPinned(2))  # every entry used >= 2 times
    slots, _ = _install(c, [9], step=5)
    assert slots.tolist() == [-1]
    assert (c.lookup(torch.tensor([1, 2, 3])) >= 0).all()


def test_lfu_pinned_keeps_frequent_rows():
    c = _cache(LFUPinned(3))
    _install(c, [1, 2, 3], step=0)
    for step in (1, 2, 3):
        c.touch(c.lookup(torch.tensor([1])), step)  # 1 reaches freq 4 >= 3: pinned
    for step, new in ((4, 10), (5, 11), (6, 12)):
        slots, _ = _install(c, [new], step)
        assert slots.item() >= 0
    assert c.lookup(torch.tensor([1])).item() >= 0  # never evicted
    assert int((c.gid >= 0).sum()) == 3


def test_rows_of_the_current_step_are_never_evicted_and_overflow_is_transient():
    c = _cache(LRU(), caps=(2, 1))
    slots, _ = _install(c, [1, 2, 3], step=0)  # table 0 holds 2: one transient
    assert sorted(slots.tolist())[0] == -1 and (slots >= 0).sum() == 2
    c.touch(slots[slots >= 0], 1)
    more, _ = _install(c, [4], step=1)  # both cached rows are in use at step 1
    assert more.tolist() == [-1]
    other, _ = _install(c, [50], step=1, table=1)  # another table's region is separate
    assert other.item() == 2


def test_dirty_eviction_returns_pending_updates_and_refresh_reapplies_them():
    c = _cache(LRU(), caps=(1,))
    slots, _ = _install(c, [7], step=0)
    c.record_updates(slots, torch.tensor([[1.0, 2.0]]))
    c.record_updates(slots, torch.tensor([[1.0, 0.0]]))
    assert c.rows[slots].tolist() == [[0.0, 0.0]]  # 1 - 0.5 * (1+1), 1 - 0.5 * 2
    c.refresh(slots, torch.tensor([[10.0, 10.0]]), torch.tensor([4]))
    assert c.rows[slots].tolist() == [[9.0, 9.0]] and c.version[slots].item() == 4
    assert c.take_due(slots, torch.tensor([5])).gids.numel() == 0  # 2 updates <= bound 5
    _, evicted = _install(c, [8], step=1)
    assert evicted.gids.tolist() == [7] and evicted.counts.tolist() == [2]
    assert evicted.grads.tolist() == [[2.0, 2.0]]
    assert c.pending_updates() == 0 and c.lookup(torch.tensor([7])).item() == -1


def test_take_due_and_take_all():
    c = _cache(LRU(), caps=(4,))
    slots, _ = _install(c, [1, 2, 3], step=0)
    c.record_updates(slots, torch.ones(3, 2))
    c.record_updates(slots[:1], torch.ones(1, 2))
    due = c.take_due(slots, torch.tensor([1]))
    assert due.gids.tolist() == [1] and due.counts.tolist() == [2]
    rest = c.take_all()
    assert sorted(rest.gids.tolist()) == [2, 3] and c.pending_updates() == 0


def test_the_direct_map_is_used_only_while_sized_by_the_cache():
    """4 B per id of the whole id space only while that is at most 16 ids per slot: a small cache
    over a big id space gets the hash map (its bytes follow the slots, not the model)."""
    from trainer.sparse.embedding.cache.slotmap import DirectSlotMap
    assert isinstance(RowCache([7], 2, LFU(), n_ids=112, local_lr=0.5).map, DirectSlotMap)
    assert not isinstance(RowCache([7], 2, LFU(), n_ids=113, local_lr=0.5).map, DirectSlotMap)


def test_cache_works_with_the_kernels_hash_map(monkeypatch):
    """Same behaviour with the id -> slot hash map used when the id space is too big for an array."""
    import trainer.sparse.embedding.cache.slotmap as slotmap
    monkeypatch.setattr(slotmap, "DIRECT_MAP_MAX_IDS", 0)
    a, b = _cache(LFU(), caps=(3,)), None
    monkeypatch.setattr(slotmap, "DIRECT_MAP_MAX_IDS", 1 << 27)
    monkeypatch.setattr(slotmap, "DIRECT_IDS_PER_SLOT", 100)
    b = _cache(LFU(), caps=(3,))
    assert type(a.map) is not type(b.map)
    rng = np.random.default_rng(0)
    for step in range(30):
        ids = torch.tensor(sorted(set(rng.integers(0, 12, size=4).tolist())))
        for c in (a, b):
            s = c.lookup(ids)
            c.touch(s[s >= 0], step)
            _install(c, ids[s < 0].tolist(), step)
        assert a.lookup(ids).tolist() == b.lookup(ids).tolist()
        assert a.gid.tolist() == b.gid.tolist()


# ---------------------------------------------------------------------------- BSP parity
BSP_CASES = {
    "w2-lru-10pct": (2, ["cache=lru"]),
    "w2-lfu-1row-evicts-every-step": (2, ["cache=lfu", "cache.capacity_rows=1"]),
    "w3-lfu_pinned-half-emptybags": (3, ["cache=lfu_pinned", "cache.capacity_fraction=0.5",
                                          "data.min_bag=0", "data.max_bag=4"]),
    "w3-lru-3rows-adagrad-mean": (3, ["cache=lru", "cache.capacity_rows=3", "optim=adagrad",
                                       "model.pooling=mean"]),
    "w2-lfu-whole-table-adam-rowwise": (2, ["cache=lfu", "cache.capacity_fraction=1.0", "optim=adam",
                                             "+cache.tables.1.capacity_rows=2"]),
    "w2-lru-zero-capacity-all-transient": (2, ["cache=lru", "cache.capacity_fraction=0"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(BSP_CASES))
def test_bsp_with_cache_equals_single_process(case):
    world, extra = BSP_CASES[case]
    ref = run_single(BASE + extra)
    results = run_world(world, BASE + extra)
    for res in results:
        assert_same_run(ref, res)
    c = results[0].summary["cache"]
    assert c["requested"] > 0, c
    if "cache.capacity_fraction=0" in extra:  # no slot at all: every remote row is transient
        assert c["hits"] == 0 and c["transient"] == c["requested"]
    else:
        assert c["hits"] > 0, c  # the cache was really used
    assert c["staleness"]["max"] == 0 and c["pending_updates_after_flush"] == 0
    assert c["pushed_updates"] == c["requested"]  # every read row got exactly one update, pushed
    if "capacity_rows=1" in extra:
        assert c["transient"] > 0
    for res in results:  # the eval logits within the parity tolerance, the AUC within the pairs they let turn
        assert_same_eval(ref, res)


# ---------------------------------------------------------------------------- invariants
def _max_read_staleness(results) -> int:
    updates = np.concatenate([r.state["audit"]["updates"].numpy() for r in results])
    at = owner_version_at(updates)
    worst = 0
    for r in results:
        for step, gid, ver in r.state["audit"]["reads"].numpy().tolist():
            assert ver >= 0
            worst = max(worst, at(gid, step) - ver)
    return worst


STALE_CASES = {
    "w2-lru-pull3-push2": (2, 3, ["cache=lru", "consistency=ssp", "consistency.pull_bound=3",
                                  "consistency.push_bound=2"]),
    "w3-lfu-pull1-push0-small": (3, 1, ["cache=lfu", "consistency.pull_bound=1",
                                         "consistency.push_bound=0", "cache.capacity_rows=20"]),
    "w2-pinned-pull5-push8-pertable": (2, 5, ["cache=lfu_pinned", "cache.pin_threshold=3",
                                               "consistency.pull_bound=5", "consistency.push_bound=8",
                                               "+consistency.tables.1.pull_bound=2"]),
    # train.cuda_graph=on (the dense half captured, the cache's step in exact sizes): the same bound
    "w2-lru-pull3-push2-graph-on": (2, 3, ["cache=lru", "consistency=ssp", "consistency.pull_bound=3",
                                           "consistency.push_bound=2", "train.cuda_graph=on"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(STALE_CASES))
def test_reads_never_exceed_the_pull_bound(case):
    world, bound, extra = STALE_CASES[case]
    results = run_world(world, WIDE + ["train.steps=30", "train.eval_every=10"] + extra)
    worst = _max_read_staleness(results)
    c = results[0].summary["cache"]
    assert 0 < worst <= bound, worst  # stale reads happened, none beyond the bound
    assert c["staleness"]["max"] == worst  # the reported figure is the real one
    assert c["fresh_hits"] > 0 and c["pending_updates_after_flush"] == 0
    if "+consistency.tables.1.pull_bound=2" in extra:
        assert c["tables"][1]["max_staleness"] <= 2 and c["tables"][1]["pull_bound"] == 2


LOST_CASES = {
    "w2-lru-ssp": (2, ["cache=lru", "consistency=ssp"]),
    "w3-lru-tiny-cache-dirty-evictions": (3, ["cache=lru", "cache.capacity_rows=4",
                                               "consistency.pull_bound=2", "consistency.push_bound=6"]),
    "w2-lfu-asp": (2, ["cache=lfu", "consistency=asp", "cache.capacity_fraction=0.3"]),
    "w2-lru-dirty-evictions-graph-on": (2, ["cache=lru", "cache.capacity_rows=4", "consistency.pull_bound=2",
                                            "consistency.push_bound=6", "train.cuda_graph=on"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(LOST_CASES))
def test_no_update_is_lost(case):
    world, extra = LOST_CASES[case]
    overrides = WIDE + ["train.steps=20", "optim=sgd"] + extra
    results = run_world(world, overrides)
    cfg = load_config(make_cfg(overrides))
    grads = sum(r.state["audit"]["grads"] for r in results)  # every row gradient computed anywhere
    rows = table_rows(cfg)
    lr = cfg.optim.sparse_lr or cfg.optim.lr
    offsets = RowSharding(rows, world, 0).table_offsets
    for t, n in enumerate(rows):
        init = init_rows(cfg.train.seed, rows, cfg.model.embedding_dim, torch.full((n,), t),
                         torch.arange(n), cfg.embedding.init_scale).double()
        g = grads[int(offsets[t]):][:n]
        torch.testing.assert_close(results[0].state["tables"][t].double(), init - lr * g,
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"table {t}: {m}")
    c = results[0].summary["cache"]
    assert c["pending_updates_after_flush"] == 0
    assert c["pushed_updates"] == c["requested"]  # each remote read -> one update, pushed once
    if "capacity_rows=4" in " ".join(extra):
        assert c["evicted_dirty"] > 0


# ---------------------------------------------------------------------------- accounting, config
@pytest.mark.dist
def test_cache_bytes_add_up_and_bounds_save_bytes():
    base = WIDE + ["train.steps=12", "embedding.audit=false"]
    none = run_world(2, base, return_state=False)[0].summary
    ssp = run_world(2, base + ["cache=lru", "consistency=ssp", "consistency.pull_bound=8"],
                    return_state=False)[0].summary
    c, b = ssp["cache"], ssp["bytes"]
    assert b["rows"] == sum(t["row_bytes"] for t in c["tables"])
    wire = 4  # int32 ids / versions on the wire
    assert b["versions"] == c["version_check_bytes"] * 2 // 3 + c["pushed_rows"] * wire
    assert b["ids"] == c["requested"] * wire + c["pushed_rows"] * wire
    assert b["grads"] == c["pushed_rows"] * 16 * 4
    assert 0 < c["fresh_hits"] and c["pulled"] < c["requested"]
    assert ssp["bytes_per_sample"] < none["bytes_per_sample"]
    assert none["cache"] is None


@pytest.mark.parametrize("override,needle", [
    ("cache.policy=fifo", "cache.policy='fifo'"),
    ("cache.capacity_fraction=1.5", "must be in [0, 1]"),
    ("consistency.pull_bound=-2", "-1 for unbounded"),
    ("+consistency.tables.9.pull_bound=1", "table keys are table indices 0..3"),
    ("+cache.tables.x.capacity_rows=1", "cache.tables.x"),
])
def test_bad_cache_config_is_rejected(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(make_cfg(["data=tiny", override]))
    assert needle in str(err.value)
