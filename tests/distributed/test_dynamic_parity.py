"""Dynamic tables (embedding.kind=dynamic) at W workers against one process (docs/dynamic.md).

With a pool large enough that nothing is evicted, a W-worker run at BSP equals the single-process
reference on the same global batch, with ids spread over [0, 2^56) (data.scramble_ids): every loss,
every dense parameter, every admitted row and every eval logit, and the very same set of admitted
ids. With eviction the rule is per owner, so only invariants hold (no id shares a row, counts add
up over owners).
"""
from __future__ import annotations

import math

import pytest
import torch

from dynamic_helpers import BASE, NO_EVICTION, assert_same_ids, counts, resume_at_step_8_equals_uninterrupted
from helpers import assert_same_eval, run_single, run_world
from parity_helpers import assert_same_run


@pytest.mark.dist
@pytest.mark.parametrize("world,extra", [
    (2, ["optim=sgd"]),
    (3, ["optim=adagrad", "embedding.admit_after=2", "data.min_bag=0", "data.max_bag=4"]),
    (2, ["optim=adam", "embedding.dtype=bf16", "train.pipeline=off"]),  # rounding keyed by (table, id)
], ids=["w2-sgd", "w3-adagrad-admit2-emptybags", "w2-adam-bf16-serial"])
def test_dynamic_tables_equal_the_single_process_reference(world, extra):
    overrides = BASE + NO_EVICTION + extra
    ref = run_single(overrides)
    assert max(int(i.max()) for i in ref.state["table_ids"]) > 1 << 50  # the ids really are wide
    got = run_world(world, overrides)
    for res in got:
        assert_same_ids(ref, res)
        assert_same_run(ref, res)
    s, r = got[0].summary["dynamic"], ref.summary["dynamic"]
    if "embedding.admit_after=2" in extra:  # ids seen once read zeros and lose their gradient
        assert r["dropped_grads"] > 0 and r["pending_ids"] > 0
    assert s["evictions"] == r["evictions"] == 0
    for key in ("admissions", "rows_in_use", "dropped_grads", "pending_ids"):  # summed over owners
        assert s[key] == r[key], key
    assert s["rows_in_use"] == sum(i.numel() for i in ref.state["table_ids"])
    assert got[0].summary["bytes"]["rows"] > 0  # rows really travelled
    for res in got:  # every eval logit within the parity tolerance, the AUC within the pairs it lets turn
        assert_same_eval(ref, res)


@pytest.mark.dist
def test_expiry_equals_the_single_process_reference():
    """embedding.ttl_steps: whether a row expired depends on its id's own last read and the step,
    not on the owner: with pools large enough that nothing is evicted for room, W = 2 with expiring
    rows equals one process, expiries (counted as evictions) included."""
    overrides = BASE + NO_EVICTION + ["optim=adagrad", "embedding.ttl_steps=2", "cache=lru",
                                      "embedding.admit_after=2"]  # expiry never re-counts admission
    ref = run_single(overrides)
    got = run_world(2, overrides)
    assert ref.summary["dynamic"]["evictions"] > 0  # rows really expired
    for res in got:
        assert_same_ids(ref, res)
        assert_same_run(ref, res)
    assert counts(got[0].summary["dynamic"]) == counts(ref.summary["dynamic"])


@pytest.mark.dist
@pytest.mark.parametrize("eviction", [["embedding.eviction=lru"], ["embedding.eviction=lfu", "embedding.lfu_half_life=3"]],
                         ids=["lru", "lfu-decay"])
def test_dynamic_tables_with_eviction_keep_their_invariants(eviction):
    cap = 40
    res = run_world(2, BASE + [f"embedding.capacity={cap}", "embedding.admit_after=1", "optim=sgd",
                               "train.log_every=4", *eviction])
    s = res[0].summary["dynamic"]
    assert s["evictions"] > 0
    for tab, ids in zip(s["tables"], res[0].state["table_ids"]):
        assert tab["rows_in_use"] == ids.numel() <= 2 * cap  # W pools of `cap` rows
        assert ids.unique().numel() == ids.numel()  # no id holds two rows, on one owner or two
        assert tab["admissions"] - tab["evictions"] == tab["rows_in_use"]
    assert s["rows_in_use"] == sum(t["rows_in_use"] for t in s["tables"])


@pytest.mark.dist
@pytest.mark.parametrize("admit_after", [1, 2])
def test_het_cache_never_serves_a_row_of_an_ids_earlier_life(admit_after):
    """At BSP the HET cache changes bytes, never values: with rows evicted and ids coming back
    (a new life, from their initial row), cache=lru equals cache=none on the same owners. A copy
    cached in an earlier life (or a locally updated copy of an id without a row) would be "fresh"
    if versions restarted at each admission, and the runs would part."""
    overrides = BASE + ["embedding.capacity=30", f"embedding.admit_after={admit_after}", "optim=adagrad",
                        "train.steps=24"]
    plain = run_world(2, overrides)
    cached = run_world(2, overrides + ["cache=lru", "cache.capacity_rows=200"])
    d = plain[0].summary["dynamic"]
    assert d["evictions"] > 50 and d == cached[0].summary["dynamic"]
    assert cached[0].summary["cache"]["hits"] > 0  # the cache held copies when they were read
    for a, b in zip(plain, cached):
        assert_same_ids(a, b)
        assert_same_run(a, b)


@pytest.mark.dist
def test_resume_at_the_same_world_size_equals_uninterrupted(tmp_path):
    """Dynamic shards (rows, versions, optimizer state, the pool's slot ids and scores, the
    pending counts, the counters) saved at step 8 of 16 and resumed on W = 2 reproduce the
    uninterrupted run, evictions and admissions included; W = 3 is refused naming both."""
    full = resume_at_step_8_equals_uninterrupted(tmp_path, ["embedding.capacity=30", "embedding.admit_after=2",
                                                            "optim=adagrad"])
    assert full[0].summary["dynamic"]["evictions"] > 0 and full[0].summary["dynamic"]["pending_ids"] > 0


@pytest.mark.dist
def test_resume_at_another_world_size_moves_ids_to_their_new_owners(tmp_path):
    """A W = 2 checkpoint (admit_after=2: pending counts too) resumed on W = 3 and on one process,
    with pools large enough that nothing is evicted: every id moves to its new owner with its row,
    optimizer state, version and scores, and the run equals the uninterrupted single process (which
    equals any W): every loss, dense parameter and admitted row, the same ids, the same counters."""
    import trainer.run.checkpoint as ckpt
    overrides = [o for o in BASE if o != "checkpoint.enabled=false"] + NO_EVICTION + [
        "embedding.admit_after=2", "optim=adagrad", "checkpoint.every=8"]
    ref = run_single(overrides + [f"checkpoint.dir={tmp_path / 'ref'}"])
    root = str(tmp_path / "w2")
    run_world(2, overrides + [f"checkpoint.dir={root}"])
    step8 = dict(ckpt.complete_checkpoints(root))[8]
    for world in (3, 1):
        extra = [f"checkpoint.resume={step8}", f"checkpoint.dir={tmp_path / f'again{world}'}"]
        got = run_world(world, overrides + extra) if world > 1 else [run_single(overrides + extra)]
        assert got[0].summary["start_step"] == 8
        for res in got:
            assert_same_ids(ref, res)
            assert_same_run(ref, res)
        assert counts(got[0].summary["dynamic"]) == counts(ref.summary["dynamic"])
        assert ref.summary["dynamic"]["pending_ids"] > 0 and ref.summary["dynamic"]["evictions"] == 0


@pytest.mark.dist
def test_resume_on_fewer_owners_evicts_by_score_and_counts_it(tmp_path):
    """W = 3 with 40 rows per table and owner, saved at step 8 and resumed on W = 2 with the same
    capacity (no step run after it): the owners are over full, keep the best-scored ids and evict
    the rest; no id shares a row, and per table the ids kept plus the ids evicted are the ids saved,
    while admissions - evictions = rows in use still holds."""
    import trainer.run.checkpoint as ckpt
    overrides = [o for o in BASE if o != "checkpoint.enabled=false"] + [
        "embedding.capacity=40", "optim=sgd", "checkpoint.every=8", "train.steps=8"]
    root = str(tmp_path / "w3")
    saved = run_world(3, overrides + [f"checkpoint.dir={root}"])[0]
    step8 = dict(ckpt.complete_checkpoints(root))[8]
    got = run_world(2, overrides + [f"checkpoint.resume={step8}", f"checkpoint.dir={tmp_path / 'w2'}"])[0]
    evicted = 0
    for t, (before, after) in enumerate(zip(saved.summary["dynamic"]["tables"], got.summary["dynamic"]["tables"])):
        ids = got.state["table_ids"][t]
        assert after["rows_in_use"] == ids.numel() <= 2 * 40
        assert ids.unique().numel() == ids.numel()
        assert set(ids.tolist()) <= set(saved.state["table_ids"][t].tolist())
        assert after["admissions"] == before["admissions"]
        moved_out = after["evictions"] - before["evictions"]
        assert after["rows_in_use"] + moved_out == before["rows_in_use"]
        assert after["admissions"] - after["evictions"] == after["rows_in_use"]
        evicted += moved_out
    assert evicted > 0  # 3 x 40 rows of a table do not fit in 2 x 40


@pytest.mark.dist
def test_bounded_staleness_across_evictions_drops_only_earlier_lives():
    """consistency=ssp with rows evicted and ids coming back: copies of an earlier life are
    re-read (their local updates dropped, counted), held-back pushes of an earlier life are
    dropped by the owner, and the pools' invariants hold (tests/unit/test_dynamic.py tests each guard
    alone: the two tests fail with it removed)."""
    cap = 30
    res = run_world(2, BASE + [f"embedding.capacity={cap}", "optim=adagrad", "train.steps=24", "cache=lru",
                               "cache.capacity_rows=200", "consistency=ssp"])
    d, cache = res[0].summary["dynamic"], res[0].summary["cache"]
    assert d["evictions"] > 50 and cache["fresh_hits"] > 0  # stale copies really were used
    assert cache["old_life_updates"] > 0  # ... and some were of an id's earlier life
    for tab, ids in zip(d["tables"], res[0].state["table_ids"]):
        assert tab["rows_in_use"] == ids.numel() <= 2 * cap
        assert ids.unique().numel() == ids.numel()
        assert tab["admissions"] - tab["evictions"] == tab["rows_in_use"]
    assert all(bool(torch.isfinite(v).all()) for v in res[0].state["dense"].values())
    assert all(math.isfinite(x) for x in res[0].losses)
