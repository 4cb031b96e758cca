"""Dynamic tables with copies of rows held away from their owner (docs/dynamic.md): FAE's replicated
hot rows (placement=fae) and Herald's lent rows (schedule=herald), real gloo processes.

- No eviction: W workers at BSP equal the single-process reference without placement or Herald
  (random 56-bit ids, admit_after = 2: hot and lent ids are admitted by the same count, read zeros
  and drop their gradients until then, exactly as in one process).
- Eviction: the owner pins every id copied elsewhere, so a copy never outlives its id's life: the
  replica writes back only into the life it was admitted in (an error otherwise), Herald drops and
  counts a writeback of another life (`stale_copies`, 0 here); the pool invariants hold.
- Expiry (embedding.ttl_steps): copies expire with their ids, by the owner's rule, so W = 2 with
  FAE and Herald still equals one process without copies.
- A checkpoint resume with replicated (and lent) rows equals the uninterrupted run at the same W,
  and the single process at another W without eviction; with eviction at another W the
  invariants hold.
"""
from __future__ import annotations

import pytest
import torch

from helpers import make_cfg, run_single, run_world
from dynamic_helpers import BASE, NO_EVICTION, assert_same_ids, resume_at_step_8_equals_uninterrupted
from parity_helpers import assert_same_run
from trainer.run.resolve.configure import load_config
from trainer.workload.data import make_data
from trainer.sparse.embedding.dynamic.shard import DynamicStore
from trainer.sparse.embedding.sharding import HashSharding
from trainer.sparse.placement import plan_run

FAE = ["placement=fae", "placement.budget_bytes=4000"]  # ~31 hot rows of the tiny preset (128 B each)
HOT = ["placement=fae", "placement.budget_bytes=40000", "placement.profile_fraction=0.5", "placement.window_batches=8",
       "data.max_bag=1"]  # 312 hot rows, one id per bag: hot batches (every id replicated, no alltoall)
HERALD = ["schedule=herald", "cache=lru", "cache.capacity_rows=100"]


def _hot_ids(overrides: list[str], world: int) -> torch.Tensor:
    """The replicated global ids a run of `overrides` on `world` workers plans (rank 0's plan)."""
    c = load_config(make_cfg(overrides))
    return torch.from_numpy(plan_run(c, make_data(c, 0, world), world).hot)


@pytest.mark.dist
@pytest.mark.parametrize("world,extra", [
    (2, FAE + ["placement.hot_batches=false"] + HERALD),
    (3, HOT),
], ids=["w2-fae-herald", "w3-fae-hot-batches"])
def test_replicated_and_lent_rows_equal_the_single_process_reference(world, extra):
    """W = 2: hot rows replicated and the others lent by Herald, against one process with neither;
    W = 3: hot batches (they change the order of the global batches), against one process with the
    same placement."""
    overrides = BASE + NO_EVICTION + ["optim=adagrad", "embedding.admit_after=2"]
    ref = run_single(overrides + (extra if extra == HOT else []))
    got = run_world(world, overrides + extra)
    for res in got:
        assert_same_ids(ref, res)
        assert_same_run(ref, res)
    s, r = got[0].summary, ref.summary
    assert r["dynamic"]["dropped_grads"] > 0 and r["dynamic"]["evictions"] == 0
    for key in ("admissions", "rows_in_use", "dropped_grads", "pending_ids"):  # summed over owners
        assert s["dynamic"][key] == r["dynamic"][key], key
    assert s["placement"]["hot_rows"] > 20 and s["bytes"]["replica"] > 0
    if extra == HOT:
        assert s["placement"]["hot_steps"] > 0
    else:
        assert s["placement"]["schedule"]["lend_pulls"] > 0 and s["placement"]["schedule"]["local_reads"] > 0


@pytest.mark.dist
def test_copied_rows_are_pinned_on_their_owner_under_eviction():
    """30-row pools on 2 owners, hot rows replicated and the others lent by Herald: hundreds of
    evictions, yet a replicated or lent id is never evicted while its copy lives (without the pin,
    the replica's write-back into a later life stops the run, and Herald's writebacks of an ended
    life are counted in stale_copies)."""
    cap = 30
    overrides = BASE + [f"embedding.capacity={cap}", "optim=adagrad", "train.steps=24", *FAE, *HERALD]
    res = run_world(2, overrides)
    assert res[0].summary["dynamic"]["evictions"] > 100
    assert_copies_kept_their_invariants(res[0], overrides, 2, cap)


def assert_copies_kept_their_invariants(res, overrides: list[str], world: int, cap: int) -> None:
    """Rank 0's result of a run of `overrides` on `world` workers with `cap`-row pools, FAE and
    Herald: no id holds two rows (on one owner or two), rows in use <= W x cap and admissions -
    evictions = rows in use per table, no stale writeback, rows were lent, and every hot id was
    read, admitted and is still held (pinned)."""
    s = res.summary["dynamic"]
    assert s["stale_copies"] == 0 and res.summary["placement"]["schedule"]["lend_pulls"] > 0
    for tab, ids in zip(s["tables"], res.state["table_ids"]):
        assert tab["rows_in_use"] == ids.numel() <= world * cap
        assert ids.unique().numel() == ids.numel()
        assert tab["admissions"] - tab["evictions"] == tab["rows_in_use"]
    hot = _hot_ids(overrides, world)
    ids = [((t << 56) | i) for t, tab in enumerate(res.state["table_ids"]) for i in tab.tolist()]
    assert hot.numel() > 20 and torch.isin(hot, torch.tensor(ids)).all()


def test_a_pinned_row_is_never_chosen_for_eviction():
    """The pool's victims skip the pinned ids (LRU would take the least recent: the pinned one)."""
    store = DynamicStore(HashSharding(1, 3, 1, 0), 4, 0, None, "sgd", 0.1, 1e-8, torch.device("cpu"))
    for step, ids in enumerate(([5], [6], [7])):
        store.clock = step
        store.admit(torch.tensor(ids))
    store.pool.pins.append(lambda: torch.tensor([5]))
    store.clock = 3
    store.admit(torch.tensor([8]))
    assert store.lives(torch.tensor([5, 6, 7, 8])).tolist() == [1, 0, 3, 4]  # 6 went, not 5


@pytest.mark.dist
def test_resume_with_replicated_rows_equals_uninterrupted(tmp_path):
    """placement=fae with hot batches, 30-row pools (evictions) and admit_after = 2: saved at step 8
    of 16 (the replica written back into its owners first) and resumed on W = 2, every loss,
    parameter, admitted id and counter equals the uninterrupted run (the replica is rebuilt from
    the owners with each row's life)."""
    full = resume_at_step_8_equals_uninterrupted(tmp_path, HOT + ["embedding.capacity=30", "embedding.admit_after=2",
                                                                  "optim=adagrad"])
    assert full[0].summary["dynamic"]["evictions"] > 0 and full[0].summary["placement"]["hot_steps"] > 0


@pytest.mark.dist
def test_replicated_and_lent_rows_resume_at_another_world_size(tmp_path):
    """FAE's replica and Herald's lent rows across a checkpoint at another W, without eviction
    (admit_after = 2, Adagrad): a W = 2 checkpoint (FAE + Herald) resumed on one process (FAE),
    and the single process's checkpoint (neither) resumed on W = 3 (FAE + Herald), each equals the uninterrupted single process in every loss, dense parameter,
    admitted id and row, and counter (the save wrote the replica back and called the lent rows
    home; the resume rebuilt the replica from the new owners with each row's life)."""
    import trainer.run.checkpoint as ckpt
    from dynamic_helpers import counts
    overrides = [o for o in BASE if o != "checkpoint.enabled=false"] + NO_EVICTION + [
        "optim=adagrad", "embedding.admit_after=2", "checkpoint.every=8"]
    copies = FAE + ["placement.hot_batches=false"] + HERALD
    ref = run_single(overrides + [f"checkpoint.dir={tmp_path / 'w1'}"])
    run_world(2, overrides + copies + [f"checkpoint.dir={tmp_path / 'w2'}"])
    saved = {w: dict(ckpt.complete_checkpoints(str(tmp_path / f"w{w}")))[8] for w in (1, 2)}
    for saved_on, world, extra in ((2, 1, FAE + ["placement.hot_batches=false"]), (1, 3, copies)):
        again = overrides + extra + [f"checkpoint.resume={saved[saved_on]}",
                                     f"checkpoint.dir={tmp_path / f'again{saved_on}{world}'}"]
        got = run_world(world, again) if world > 1 else [run_single(again)]
        assert got[0].summary["start_step"] == 8
        for res in got:
            assert_same_ids(ref, res)
            assert_same_run(ref, res)
        assert counts(got[0].summary["dynamic"]) == counts(ref.summary["dynamic"]), (saved_on, world)
        assert got[0].summary["placement"]["hot_rows"] > 20
        if world > 1:  # rows really were replicated and lent after the resume
            assert got[0].summary["bytes"]["replica"] > 0 and got[0].summary["placement"]["schedule"]["lend_pulls"] > 0
    assert ref.summary["dynamic"]["pending_ids"] > 0 and ref.summary["dynamic"]["dropped_grads"] > 0


@pytest.mark.dist
def test_replicated_and_lent_rows_resume_under_eviction_and_expiry(tmp_path):
    """30-row pools (evictions), rows expiring after 3 steps unread, hot rows replicated and the
    others lent by Herald, admit_after = 2: saved at step 8 of 16 on W = 2 and resumed on W = 2,
    every loss, parameter, admitted id and counter equals the uninterrupted run (the replica takes
    its rows' last reads from the owners, so it expires them as they do); the same checkpoint
    resumed on W = 3 with 20-row pools (over-full owners evict by score at the load) keeps the
    per-owner invariants: no id shares a row, rows in use <= W x capacity, admissions - evictions
    = rows in use, no stale writeback, every hot id is held again."""
    import trainer.run.checkpoint as ckpt
    extra = ["embedding.admit_after=2", "optim=adagrad", "embedding.ttl_steps=3", *FAE, *HERALD]
    full = resume_at_step_8_equals_uninterrupted(tmp_path, extra + ["embedding.capacity=30"])
    d = full[0].summary["dynamic"]
    assert d["evictions"] > 50 and d["stale_copies"] == 0 and d["dropped_grads"] > 0
    assert full[0].summary["placement"]["schedule"]["lend_pulls"] > 0
    step8 = dict(ckpt.complete_checkpoints(str(tmp_path / "full")))[8]
    cap, world = 20, 3
    overrides = [o for o in BASE if o != "checkpoint.enabled=false"] + extra + [
        f"embedding.capacity={cap}", f"checkpoint.resume={step8}", f"checkpoint.dir={tmp_path / 'w3'}"]
    res = run_world(world, overrides)[0]
    assert res.summary["start_step"] == 8
    assert_copies_kept_their_invariants(res, overrides, world, cap)


@pytest.mark.dist
def test_replicated_and_lent_rows_expire_as_in_one_process():
    """embedding.ttl_steps=2 with hot rows replicated and the others lent by Herald (admit_after = 2,
    Adagrad, no eviction for room): a replicated or lent row read after more than 2 steps unread
    starts its new life on its owner and on its copies alike (the replica by the owner's rule, from
    the same reads; Herald's plan names the lent ones), so one process with FAE alone, and W = 2 with
    FAE and Herald, equal one process without copies in every loss, dense parameter, admitted id
    and row, and counter (expiries included), with no stale writeback."""
    from dynamic_helpers import counts
    overrides = BASE + NO_EVICTION + ["optim=adagrad", "embedding.admit_after=2", "embedding.ttl_steps=2"]
    fae = FAE + ["placement.hot_batches=false"]
    ref = run_single(overrides)
    assert ref.summary["dynamic"]["evictions"] > 100  # rows really expired (nothing is evicted for room)
    for got in ([run_single(overrides + fae)], run_world(2, overrides + fae + HERALD)):
        for res in got:
            assert_same_ids(ref, res)
            assert_same_run(ref, res)
        assert counts(got[0].summary["dynamic"]) == counts(ref.summary["dynamic"])
        assert got[0].summary["dynamic"]["stale_copies"] == 0 and got[0].summary["placement"]["hot_rows"] > 20
    assert got[0].summary["placement"]["schedule"]["lend_pulls"] > 0
