"""Dynamic tables with copies of rows held away from their owner (docs/dynamic.md): FAE's replicated
hot rows (placement=fae) and Herald's lent rows (schedule=herald), real gloo processes.

- No eviction: W workers at BSP equal the single-process reference without placement or Herald
  (random 56-bit ids, admit_after = 2: hot and lent ids are admitted by the same count, read zeros
  and drop their gradients until then, exactly as in one process).
- Eviction: the owner pins every id copied elsewhere, so a copy never outlives its id's life: the
  replica writes back only into the life it was admitted in (an error otherwise), Herald drops and
  counts a writeback of another life (`stale_copies`, 0 here); the pool invariants hold.
- A checkpoint resume with replicated rows equals the uninterrupted run.
"""
from __future__ import annotations

import pytest
import torch

from helpers import make_cfg, run_single, run_world
from test_dynamic_parity import BASE, NO_EVICTION, assert_same_ids, resume_at_step_8_equals_uninterrupted
from test_parity import assert_same_run
from trainer.configure import load_config
from trainer.data import make_data
from trainer.embedding.dynamic import DynamicStore
from trainer.embedding.sharding import HashSharding
from trainer.placement import plan_run

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
    s = res[0].summary["dynamic"]
    assert s["evictions"] > 100 and s["stale_copies"] == 0
    for tab, ids in zip(s["tables"], res[0].state["table_ids"]):
        assert tab["rows_in_use"] == ids.numel() <= 2 * cap
        assert ids.unique().numel() == ids.numel()  # no id holds two rows, on one owner or two
        assert tab["admissions"] - tab["evictions"] == tab["rows_in_use"]
    assert res[0].summary["placement"]["schedule"]["lend_pulls"] > 0
    hot = _hot_ids(overrides, 2)  # every hot id was read, admitted, and is still held
    ids = [((t << 56) | i) for t, tab in enumerate(res[0].state["table_ids"]) for i in tab.tolist()]
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
