"""Skipped steps with dynamic tables (train.nonfinite=skip; fp16's overflow skips take the same
path): a skipped step leaves the pool exactly as before it (which id holds which slot, the map, the
lives, scores, pending counts, counters, free slots and the rows admission wrote; FAE's replicated
rows given a life), and a W = 2 run
that skips a step equals one that never saw the batch: at the same W with evictions, admit_after = 2
and the HET cache, and the single process without evictions (docs/dynamic.md, "Skipped steps").
"""
from __future__ import annotations

import pytest
import torch

from helpers import make_cfg, spawn
from dynamic_helpers import BASE as DYN, NO_EVICTION, assert_same_ids, gid, store
from parity_helpers import assert_same_run
from skip_helpers import FP16, inject, poison, poison_w1, reference, without
from trainer.base.comm import LocalCollectives, make_collectives
from trainer.run.resolve.configure import load_config
from trainer.sparse.embedding.dynamic.admission import Counting
from trainer.run.report import dynamic_summary
from trainer.run.runner import RunResult, Trainer, run

EVICT = ["embedding.capacity=30", "embedding.admit_after=2", "optim=adagrad"]
SKIP = ["train.nonfinite=skip"]
FAE = ["placement=fae", "placement.budget_bytes=4000"]  # ~31 hot rows of the tiny preset


def pool_state(st) -> dict[str, object]:
    """Everything a step's admission may change in a DynamicStore, copied."""
    p = st.pool
    out = {k: getattr(p, k).clone() for k in ("slot_gid", "last_use", "uses", "counters")}
    out.update({k: getattr(st, k).clone() for k in ("weight", "version", "touched")})
    if st.optimizer.state is not None:
        out["state"] = st.optimizer.state.clone()
    out["map"] = [t.clone() for t in p.map.items()]
    a = p.admission  # exact: the pending map's entries; count_min: the sketch's counters
    out["pending"] = None if a is None else [t.clone() for t in (a.items() if a.kind == "exact" else (a.cells,))]
    out["free"] = (list(p._free_from), [h.clone() for h in p._holes])
    out["clock"] = st.clock
    return out


def assert_same_state(a: dict, b: dict) -> None:
    for k in a:
        x, y = a[k], b[k]
        if k == "free":
            assert x[0] == y[0] and all(torch.equal(i, j) for i, j in zip(x[1], y[1])), k
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k
        elif isinstance(x, list):
            assert all(torch.equal(i, j) for i, j in zip(x, y)), k
        else:
            assert x == y, k


# (admit_after, steps before: per step the reads of table 0 then table 1, the journaled step's reads)
ROLLBACK_CASES = {
    # 5 and 7 admitted at their second sighting, evicting 1 and 9 (LRU); 8 and 1 counted; 4 counted
    "admit2": (2, [([1, 2, 3, 9], [1, 2]), ([1, 2, 3, 9], [1, 2]), ([2, 3, 5, 7], [])],
               [(0, [2, 5, 7, 8]), (0, [1, 8]), (1, [1, 4, 4])], Counting()),
    # the same counted by a count-min sketch (admission.py): its raised counters journaled
    "admit2-count_min": (2, [([1, 2, 3, 9], [1, 2]), ([1, 2, 3, 9], [1, 2]), ([2, 3, 5, 7], [])],
                         [(0, [2, 5, 7, 8]), (0, [1, 8]), (1, [1, 4, 4])], Counting("count_min", 4096)),
    # 5 evicts 1 (slot 0), then 1 comes back in the same step and evicts 9 (slot 3): it moved;
    # table 1 takes free slots
    "admit1-moved": (1, [([1, 2, 3, 9], [1]), ([2, 3], [])], [(0, [2, 5]), (0, [1]), (1, [1, 4, 4])],
                     Counting()),
}


@pytest.mark.parametrize("case", sorted(ROLLBACK_CASES))
def test_a_pools_rollback_undoes_admissions_evictions_and_counts(case):
    """begin / admissions (counting, evicting, an id evicted and readmitted in the same step, free
    slots taken) / rollback == the state before, map and the lookups' memo included; the same
    step again then gives what it gave before the rollback."""
    k, steps, journaled, counting = ROLLBACK_CASES[case]
    st = store(capacity=4, admit_after=k, optimizer="adagrad", counting=counting)
    for step, (t0, t1) in enumerate(steps):
        st.clock = step
        st.admit(gid(0, t0))
        st.admit(gid(1, t1))
    before = pool_state(st)

    def the_step():
        st.begin()
        st.clock = len(steps)
        for t, ids in journaled:
            st.admit(gid(t, ids))
        return pool_state(st)

    during = the_step()
    evicted = 3 if counting.kind == "count_min" else 2  # a sketch remembers 1: back at once, evicting a third
    assert int(st.pool.c["evictions"].sum()) == evicted and int(st.pool.c["admissions"].sum()) > 2 * k
    if k > 1:
        assert not torch.equal(during["pending"][0], before["pending"][0])
    else:  # 1 holds another slot than before
        assert int(st.pool.lookup(gid(0, [1]))[0]) != before["map"][1][before["map"][0] == int(gid(0, [1]))]
    st.rollback()
    assert_same_state(before, pool_state(st))
    probe = gid(0, [1, 2, 3, 5, 7, 8, 9])
    assert torch.equal(st.pool.lookup(probe)[0], st.pool.map.lookup(probe)[0])
    with pytest.raises(RuntimeError, match="without begin"):
        st.rollback()
    assert_same_state(during, the_step())
    st.commit()


@pytest.mark.parametrize("how", ["nonfinite-skip", "fp16-overflow", "nonfinite-skip-count_min"])
def test_a_skipped_step_leaves_the_pool_as_it_was(monkeypatch, how):
    """W = 1, 30-row pools (evicting every step), admit_after = 2: the state after a skipped step
    (its lookup admitted and evicted, then the step was discarded: a non-finite loss with
    train.nonfinite=skip, or an overflowing gradient under fp16's loss scaler) equals the state
    before it, and the run then trains on; with a count-min sketch counting, its counters too."""
    if how == "fp16-overflow":
        monkeypatch.setattr(Trainer, "train_step", Trainer.train_step)  # inject's patch undone after
        inject("rows", (6,), 0)
        extra = FP16
    else:
        poison_w1(monkeypatch, (6,))
        extra = SKIP + (["embedding.admit_counter=count_min", "embedding.count_min_bytes=8192"]
                        if how.endswith("count_min") else [])
    t = Trainer(load_config(make_cfg(DYN + EVICT + extra)), LocalCollectives(), None)
    st = t.emb.store
    for s in range(6):
        t.train_step(s)
    before = pool_state(st)
    seen = {}
    real = t.emb.discard

    def discard(flight):
        seen.update(pool_state(st))
        real(flight)

    monkeypatch.setattr(t.emb, "discard", discard)
    t.train_step(6)
    assert seen, "the step was not discarded"
    grew = seen["counters"] - before["counters"]
    assert int(grew[0].sum()) > 0 and int(grew[1].sum()) > 0  # it admitted and evicted
    assert not torch.equal(seen["slot_gid"], before["slot_gid"])
    assert_same_state(before, pool_state(st))
    assert torch.isfinite(torch.tensor(t.train_step(7)))
    if how == "fp16-overflow":
        assert t.precision.overflow_at == [6]


def test_a_skipped_step_gives_replicated_hot_rows_no_life(monkeypatch):
    """placement=fae at W = 1, admit_after = 2: step 1, where the hot ids are seen the second time,
    is skipped: the replica's rows it admitted get their life (none), value and optimizer state
    back with the pool, and they are admitted the next step instead; the run ends with every
    replicated row written back into its life (flush checks it)."""
    poison_w1(monkeypatch, (1,))
    t = Trainer(load_config(make_cfg(DYN + EVICT + FAE + SKIP)), LocalCollectives(), None)
    rep = t.emb.replica
    t.train_step(0)
    before = pool_state(t.emb.store)
    kept = [rep.life.clone(), rep.weight.clone(), rep.optimizer.state.clone()]
    seen = []
    real = t.emb.discard

    def discard(flight):
        seen.append(rep.life.clone())
        real(flight)

    monkeypatch.setattr(t.emb, "discard", discard)
    t.train_step(1)
    assert int((seen[0] > 0).sum()) > 10 and not bool((kept[0] > 0).any())  # hot ids got lives, undone
    assert_same_state(before, pool_state(t.emb.store))
    for a, b in zip(kept, [rep.life, rep.weight, rep.optimizer.state]):
        assert torch.equal(a, b)
    for s in range(2, t.c.train.steps):
        t.train_step(s)
    assert int((rep.life > 0).sum()) > 10
    t.emb.flush()


def same_w_worker(rank: int, world: int, overrides: list[str], bad: tuple[int, ...], bad_rank: int) -> dict:
    """Spawned rank: the skip run, then the same trainer never calling train_step for `bad`, with
    its dynamic block."""
    poison(bad, bad_rank)
    out = {"skip": run(make_cfg(overrides + SKIP + ["comm=torch"]), return_state=True)}
    comm = make_collectives("torch", 60.0, "gloo")
    try:
        t = Trainer(load_config(make_cfg(overrides + ["comm=torch"])), comm, None)
        out["ref"] = reference(comm, [], bad, t)
        out["ref_dynamic"] = dynamic_summary(comm, t.emb.store)
    finally:
        comm.close()
    return out


def skip_worker(rank: int, world: int, overrides: list[str], bad: tuple[int, ...], bad_rank: int) -> RunResult:
    poison(bad, bad_rank)
    return run(make_cfg(overrides + SKIP + ["comm=torch"]), return_state=True)


@pytest.mark.dist
def test_two_workers_skip_with_evictions_as_if_the_batch_never_came():
    """W = 2, 30-row pools (hundreds of evictions), admit_after = 2, the HET cache: skipping steps 4
    and 9 (rank 1's batch) equals the same trainer never running them: every loss, dense parameter,
    admitted id and row, and the dynamic block (a skipped step counts no admission, eviction,
    rejection, dropped gradient or pending id)."""
    overrides = DYN + EVICT + ["cache=lru", "cache.capacity_rows=200"]
    bad = (4, 9)
    res = spawn(2, same_w_worker, overrides, bad, 1)
    for r, out in enumerate(res):
        got = out["skip"]
        assert_same_ids(out["ref"], got)
        assert_same_run(out["ref"], RunResult({}, r, without(got.losses, bad), got.state))
        assert got.summary["skipped_steps"] == 2
    d = res[0]["skip"].summary["dynamic"]
    assert d["evictions"] > 100 and d["pending_ids"] > 0 and res[0]["skip"].summary["cache"]["hits"] > 0
    assert d == res[0]["ref_dynamic"]


@pytest.mark.dist
def test_two_workers_skip_equal_the_single_process_that_never_saw_the_batch():
    """Without evictions (W = 2 equals one process then), admit_after = 2, hot rows replicated at
    W = 2 (FAE): the W = 2 run skipping steps 1 (where the hot ids are seen the second time) and 5
    (rank 0's batches) equals the single process, without placement, that never ran them."""
    overrides = DYN + NO_EVICTION + ["embedding.admit_after=2", "optim=adagrad"]
    bad = (1, 5)
    res = spawn(2, skip_worker, overrides + FAE + ["placement.hot_batches=false"], bad, 0)
    t = Trainer(load_config(make_cfg(overrides + ["comm=local"])), LocalCollectives(), None)
    ref = reference(t.comm, [], bad, t)
    ref_dynamic = dynamic_summary(t.comm, t.emb.store)
    for r, got in enumerate(res):
        assert_same_ids(ref, got)
        assert_same_run(ref, RunResult({}, r, without(got.losses, bad), got.state))
    d = res[0].summary["dynamic"]
    assert d["pending_ids"] > 0 and d["dropped_grads"] > 0 and res[0].summary["placement"]["hot_rows"] > 10
    for key in ("admissions", "rows_in_use", "dropped_grads", "pending_ids", "evictions"):
        assert d[key] == ref_dynamic[key], key


@pytest.mark.dist
def test_two_workers_skip_with_expiry_equal_the_single_process_skipping_the_same_steps(monkeypatch):
    """embedding.ttl_steps = 1 (a row unread in the previous step expires when read), hot rows
    replicated at W = 2 (FAE, each replica expires its rows too): a skipped step's expiries and
    the last reads it stamped are undone on owners and replicas, while its step number stays used
    (expiry counts steps, so the reference skips the same steps, rather than never running them):
    W = 2 equals the single process, without placement, skipping steps 2 and 5."""
    overrides = DYN + NO_EVICTION + ["embedding.admit_after=2", "optim=adagrad", "embedding.ttl_steps=1"]
    bad = (2, 5)
    res = spawn(2, skip_worker, overrides + FAE + ["placement.hot_batches=false"], bad, 0)
    poison_w1(monkeypatch, bad)
    ref = run(make_cfg(overrides + SKIP + ["comm=local"]), return_state=True)
    for r, got in enumerate(res):
        assert_same_ids(ref, got)
        assert_same_run(RunResult({}, r, without(ref.losses, bad), ref.state),
                        RunResult({}, r, without(got.losses, bad), got.state))
    d = res[0].summary["dynamic"]
    assert d["evictions"] > 0 and res[0].summary["placement"]["hot_rows"] > 10  # rows expired
    for key in ("admissions", "rows_in_use", "dropped_grads", "pending_ids", "evictions"):
        assert d[key] == ref.summary["dynamic"][key], key
