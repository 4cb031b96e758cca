"""Count-min admission counting (embedding.admit_counter=count_min; trainer/sparse/embedding/dynamic/admission.py,
docs/dynamic.md#admission): the sketch never under-counts, so it admits every id no later than
exact counting (and exactly as it does without collisions), in memory that stays fixed while the
distinct ids grow; halving lets old sightings fade; checkpoints keep it (the same W: as saved;
another W: never under-counting); the config refuses what makes no sense; W = 2 keeps the pools'
invariants and resumes as if uninterrupted."""
from __future__ import annotations

import os

import pytest
import torch

from helpers import make_cfg
from kernel_helpers import gpu, needs_cuda
from dynamic_helpers import gid, resume_at_step_8_equals_uninterrupted, store
from trainer.run.checkpoint.manifest import CheckpointError
from trainer.run.checkpoint.pool_io import read_pool_shard, write_pool_shard
from trainer.run.checkpoint.shard_io import shard_dir
from trainer.base.comm import LocalCollectives
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.sparse.embedding.dynamic.admission import Counting
from trainer.sparse.embedding.dynamic.shard import DynamicStore
from trainer.sparse.embedding.sharding import ID_BITS, HashSharding
from trainer.run.report import dynamic_summary


def sketch(nbytes: int, halve: int = 0) -> Counting:
    return Counting("count_min", nbytes, 4, halve)


def held(st) -> set[int]:
    return set(st.pool.slot_gid[st.pool.slot_gid >= 0].tolist())


def exact_counts(st) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, steps seen) of an exact counter's pending ids."""
    ids, val = st.pool.admission.items()
    return ids, val & 0xFFFF


def zipf_stream(steps: int, per_step: int, ids: int, seed: int = 0) -> list[torch.Tensor]:
    """Per step, the gids read (repeats allowed) over 2 tables, a few ids read often, most rarely."""
    gen = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, ids + 1, dtype=torch.float64)
    out = []
    for _ in range(steps):
        i = torch.multinomial(w, per_step, replacement=True, generator=gen)
        out.append(i * 7919 + 3 | (i % 2) << ID_BITS)  # wide ids, both tables
    return out


def test_count_min_admits_every_id_no_later_than_exact_counting():
    """One owner, the same stream (each step read in two overlapping calls: the owner's own ids
    and a peer's request, counted once per step), admit_after = 3, pools that never evict: an 8 KiB
    sketch (collisions) admits a superset of exact counting's ids at every step, and more; its
    estimate of every pending id is at least the exact count; a 512 KiB sketch (no collision among
    the ~2,000 ids) admits exactly the same ids at every step."""
    k, stream = 3, zipf_stream(30, 300, 4000)
    exact, tiny, big = (store(capacity=5000, admit_after=k, counting=c)
                        for c in (Counting(), sketch(8192), sketch(512 << 10)))
    grew = 0
    for step, g in enumerate(stream):
        for st in (exact, tiny, big):
            st.clock = step
            st.admit(torch.unique(g[:200]))  # the owner's own ids
            st.admit(torch.unique(g[100:]))  # a peer's request: ids 100..199 again, counted once
        ref = held(exact)
        assert ref <= held(tiny), step
        assert held(big) == ref, step
        grew = max(grew, len(held(tiny) - ref))
        ids, seen = exact_counts(exact)
        assert bool((tiny.pool.admission.estimate(ids) >= seen).all()), step
        assert torch.equal(big.pool.admission.estimate(ids), seen), step
    assert grew > 50 and len(ref) > 400 and exact.pool.pending_ids() > 1000


def test_conservative_update_counts_no_more_than_a_plain_count_min():
    """The same 8 KiB sketch's cells counted plainly (every cell of a counted id + 1) bound the
    conservative update's estimates from above, and are above them for many ids (the update
    raises only the cells below estimate + 1)."""
    st = store(capacity=5000, admit_after=3, counting=sketch(8192))
    a = st.pool.admission
    plain = torch.zeros(a.cells.numel(), dtype=torch.int64)
    seen = torch.zeros(0, dtype=torch.int64)
    for step, g in enumerate(zipf_stream(30, 300, 4000)):
        u = torch.unique(g)
        new = u[st.pool.lookup(u)[1]]  # the ids the step counts: those without a row
        plain.index_add_(0, a.where(new).reshape(-1), torch.ones(new.numel() * a.depth, dtype=torch.int64))
        st.clock = step
        st.admit(u)
        seen = torch.unique(torch.cat([seen, new]))
    pending = seen[st.pool.lookup(seen)[1]]
    cu, cm = a.estimate(pending), plain[a.where(pending)].amin(0)
    assert bool((cu <= cm).all()) and int((cu < cm).sum()) > 100


def test_the_sketchs_memory_stays_fixed_while_the_pending_map_grows():
    """20,000 ids seen once each (the long tail), admit_after = 2: exact counting holds a map
    entry for every one (32 B each as reported, its cells growing with them); a 256 KiB sketch
    holds 256 KiB throughout, estimates the ids it counted within 10 %, and admits < 5 % of them
    at their single sighting (collisions)."""
    exact, cm = store(capacity=30000, admit_after=2), store(capacity=30000, admit_after=2, counting=sketch(256 << 10))
    sizes = set()
    for step in range(20):
        g = gid(step % 2, torch.arange(step * 1000, (step + 1) * 1000) * 104729)
        for st in (exact, cm):
            st.clock = step
            st.admit(g)
        sizes.add(cm.pool.admission.bytes())
    assert exact.pool.pending_ids() == 20000 and exact.pool.admission.bytes() == 32 * 20000
    assert exact.pool.admission.map.capacity * 16 >= 32 * 20000  # the cells really are held
    assert sizes == {256 << 10} and cm.pool.admission.cells.numel() * 2 == 256 << 10
    assert abs(cm.pool.pending_ids() - 20000) < 2000
    admitted = int(cm.pool.c["admissions"].sum())
    assert 0 < admitted < 1000 and int(exact.pool.c["admissions"].sum()) == 0


@pytest.mark.parametrize("halve,admitted_at", [(0, 5), (4, 6)])
def test_halving_lets_old_sightings_fade(halve, admitted_at):
    """admit_after = 2: an id seen at step 1 and again at step 5 is admitted at step 5, unless the
    counters were halved at step 4 (count_min_halve_steps = 4: its count 1 became 0), then at
    step 6. Halving is lazy (at a step's first count) and exact: halving twice = a shift by two."""
    st = store(capacity=8, admit_after=2, counting=sketch(4096, halve))
    a = st.pool.admission
    for step, ids in ((1, [7, 9]), (2, [9]), (5, [7]), (6, [7])):
        st.clock = step
        st.admit(gid(0, ids))
        if step == 2:
            assert held(st) == set(gid(0, [9]).tolist())
        if step == admitted_at:
            assert int(gid(0, [7])) in held(st)
        elif step < admitted_at:
            assert int(gid(0, [7])) not in held(st)
    assert a.epoch == (6 // halve if halve else 0)
    other = sketch(4096, halve)
    if halve:  # loading sketches of two epochs halves the older one to the newer first
        b = store(capacity=8, admit_after=2, counting=other).pool.admission
        old = torch.full_like(a.cells, 2)
        b.load([(old, 0), (torch.zeros_like(a.cells), 2)])
        assert b.epoch == 2 and int(b.cells.max()) == 0
        b.load([(old, 1), (torch.zeros_like(a.cells), 2)])
        assert int(b.cells.min()) == 1


def test_a_sketch_remembers_an_evicted_id():
    """A sketch cannot forget an id: evicted, it comes back at its next sighting while its cells
    stand (exact counting forgets its count and needs admit_after sightings again)."""
    got = {}
    for counting in (Counting(), sketch(4096)):
        st = store(capacity=1, admit_after=2, counting=counting)
        for step, i in enumerate([1, 1, 2, 2, 1]):  # 1 admitted at 1, evicted by 2 at 3, back at 4
            st.clock = step
            st.admit(gid(0, [i]))
        got[counting.kind] = held(st)
    assert got["exact"] == set(gid(0, [2]).tolist()) and got["count_min"] == set(gid(0, [1]).tolist())


def test_a_skipped_step_undoes_the_sketchs_counts_and_keeps_its_halving():
    """begin / counts (the step halves the counters first) / rollback: every counter back to its
    value after the halving (the skipped step's number is spent, as for LFU's decay), and the ids
    counted in the step count again when it is rerun."""
    st = store(capacity=50, admit_after=3, counting=sketch(4096, 4))
    a = st.pool.admission
    for step in range(4):
        st.clock = step
        st.admit(gid(0, [1, 2, 3, step + 10]))
    halved = a.cells >> 1
    st.begin()
    st.clock = 4
    st.admit(gid(0, [1, 5, 6]))
    st.admit(gid(0, [1, 5, 7]))  # a peer's request: 1 and 5 already counted
    counted = a.cells.clone()
    assert not torch.equal(counted, halved)
    st.rollback()
    assert torch.equal(a.cells, halved) and a.epoch == 1
    st.begin()
    st.clock = 4
    st.admit(gid(0, [1, 5, 6]))
    st.admit(gid(0, [1, 5, 7]))
    assert torch.equal(a.cells, counted)
    st.commit()


def _write(tmp_path, stores, step):
    """Save stores (one per rank of one W) as a checkpoint; its manifest."""
    world = len(stores)
    shards = {shard_dir(r, world): write_pool_shard(str(tmp_path / shard_dir(r, world)), st)
              for r, st in enumerate(stores)}
    return {"world_size": world, "step": step, "shards": shards}


def _load(tmp_path, manifest, world, counting, k=3):
    out = []
    for r in range(world):
        st = store(capacity=5000, admit_after=k, world=world, rank=r, counting=counting)
        read_pool_shard(str(tmp_path), manifest, st, {"bytes_read": 0})
        out.append(st)
    return out


def _owner_estimates(stores, ids):
    """Each id's estimate at its owner."""
    s = stores[0].sharding
    owner = s.owner(ids)
    est = torch.zeros_like(ids)
    for r, st in enumerate(stores):
        est[owner == r] = st.pool.admission.estimate(ids[owner == r])
    return est


def test_a_checkpoint_keeps_the_sketch_and_another_w_never_under_counts(tmp_path):
    """W = 2 owners (each counting its ids of a stream in a 4 KiB sketch, collisions and all),
    saved: resumed on W = 2 each sketch is back as it was; on W = 3 and on one process every id's
    estimate at its new owner is at least its old owner's (each new sketch: the element-wise max
    of the saved ones), so at least the exact count of every pending id. An exact checkpoint
    resumed with count_min puts each pending count into its new owner's sketch; a sketch is never
    resumed as exact counts, nor into a sketch of another size (one error naming the key)."""
    k, stream = 3, zipf_stream(12, 300, 3000, seed=1)
    cm = [store(capacity=5000, admit_after=k, world=2, rank=r, counting=sketch(4096)) for r in range(2)]
    ex = [store(capacity=5000, admit_after=k, world=2, rank=r) for r in range(2)]
    for step, g in enumerate(stream):
        g = torch.unique(g)
        for r in range(2):
            mine = g[cm[r].sharding.owner(g) == r]
            for st in (cm[r], ex[r]):
                st.clock = step
                st.admit(mine)
    seen = torch.unique(torch.cat(stream))
    before = _owner_estimates(cm, seen)
    pending = torch.cat([exact_counts(st)[0] for st in ex])
    counts = torch.cat([exact_counts(st)[1] for st in ex])
    assert pending.numel() > 500 and bool((_owner_estimates(cm, pending) >= counts).all())
    manifest = _write(tmp_path / "cm", cm, 12)
    again = _load(tmp_path / "cm", manifest, 2, sketch(4096))
    for a, b in zip(cm, again):
        assert torch.equal(a.pool.admission.cells, b.pool.admission.cells)
    for world in (3, 1):
        moved = _load(tmp_path / "cm", manifest, world, sketch(4096))
        est = _owner_estimates(moved, seen)
        assert bool((est >= before).all()), world
        assert bool((_owner_estimates(moved, pending) >= counts).all()), world
    converted = _load(tmp_path / "ex", _write(tmp_path / "ex", ex, 12), 3, sketch(4096))
    assert bool((_owner_estimates(converted, pending) >= counts).all())
    with pytest.raises(CheckpointError, match="resume with embedding.admit_counter=count_min"):
        _load(tmp_path / "cm", manifest, 2, Counting())
    with pytest.raises(CheckpointError, match="embedding.count_min_bytes"):
        _load(tmp_path / "cm", manifest, 2, sketch(8192))
    assert os.path.getsize(tmp_path / "cm" / shard_dir(0, 2) / "count_min.bin") == 4096


@pytest.mark.parametrize("overrides,match", [
    (["embedding.admit_counter=count_min", "embedding.kind=dynamic", "embedding.capacity=10"],
     "embedding.admit_counter='count_min': .*needs embedding.admit_after > 1"),
    (["embedding.admit_counter=count_min", "embedding.admit_after=2"],
     "embedding.admit_counter='count_min': .*needs embedding.kind=dynamic"),
    (["embedding.count_min_halve_steps=5", "embedding.kind=dynamic", "embedding.capacity=10",
      "embedding.admit_after=2"], "embedding.count_min_halve_steps=5: .*needs embedding.admit_counter=count_min"),
    (["embedding.admit_counter=count_min", "embedding.kind=dynamic", "embedding.capacity=10",
      "embedding.admit_after=2", "embedding.count_min_bytes=7"], "embedding.count_min_bytes=7: too small"),
    (["embedding.admit_counter=count_min", "embedding.kind=dynamic", "embedding.capacity=10",
      "embedding.admit_after=40000"], "embedding.admit_after=40000: must be < 32768"),
    (["embedding.admit_counter=sketch"], "embedding.admit_counter='sketch': must be one of exact, count_min"),
])
def test_count_min_refuses_what_it_cannot_count(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config(make_cfg(["checkpoint.enabled=false"] + overrides))
    assert "\n" not in str(err.value)


def test_the_memory_plan_and_the_summary_report_the_sketchs_bytes():
    """The plan's `admission` part is the sketch a pool holds (count_min_bytes rounded down to
    whole rows); exact counting plans none (it grows with the ids); the dynamic block reports the
    counter, its bytes summed over owners, and 0 B per pending id."""
    from trainer.run.resolve.memplan import plan_memory
    base = ["data=tiny", "embedding.kind=dynamic", "embedding.capacity=50", "checkpoint.enabled=false",
            "embedding.admit_after=2"]
    c = load_config(make_cfg(base + ["embedding.admit_counter=count_min", "embedding.count_min_bytes=10001"]))
    st = store(capacity=50, admit_after=2, counting=Counting.of(c.embedding))
    assert plan_memory(c, 2, 0).parts["admission"] == st.pool.admission.bytes() == 10000
    assert "admission" not in plan_memory(load_config(make_cfg(base)), 2, 0).parts
    st.admit(gid(0, [1, 2, 3]))
    d = dynamic_summary(LocalCollectives(), st)
    assert (d["admit_counter"], d["admission_bytes"], d["pending_bytes_per_id"], d["pending_ids"]) == \
        ("count_min", 10000, 0, 3)


@pytest.mark.dist
def test_two_workers_with_a_sketch_keep_the_invariants_and_resume_as_uninterrupted(tmp_path):
    """W = 2, 30-row pools (evictions), admit_after = 2 counted by a 16 KiB sketch halved every 5
    steps: no id holds two rows, admissions - evictions = rows in use per table, the summary
    reports the sketch; saved at step 8 (between two halvings) and resumed on W = 2, every loss,
    parameter, admitted id and row and the dynamic block equal the uninterrupted run."""
    cap = 30
    full = resume_at_step_8_equals_uninterrupted(tmp_path, [
        f"embedding.capacity={cap}", "embedding.admit_after=2", "optim=adagrad", "embedding.admit_counter=count_min",
        "embedding.count_min_bytes=16384", "embedding.count_min_halve_steps=5"])
    d = full[0].summary["dynamic"]
    assert d["evictions"] > 50 and d["dropped_grads"] > 0
    assert (d["admit_counter"], d["admission_bytes"], d["pending_bytes_per_id"]) == ("count_min", 2 * 16384, 0)
    for tab, ids in zip(d["tables"], full[0].state["table_ids"]):
        assert tab["rows_in_use"] == ids.numel() <= 2 * cap
        assert ids.unique().numel() == ids.numel()
        assert tab["admissions"] - tab["evictions"] == tab["rows_in_use"]


@gpu
@needs_cuda
def test_the_sketch_counts_alike_on_cuda():
    """The same stream (halving, a skipped step) through the sketch on CUDA tensors and on the
    CPU: the same counters, admissions and estimates (int16 scatter-max on the device)."""
    got = []
    for device in ("cpu", "cuda"):
        sh = HashSharding(2, 5000, 1, 0)
        st = DynamicStore(sh, 3, 7, 0.1, "sgd", 0.5, 1e-8, torch.device(device), 0.1, admit_after=3,
                          counting=sketch(8192, 7))
        for step, g in enumerate(zipf_stream(20, 300, 4000)):
            st.clock = step
            if step == 9:
                st.begin()
            st.admit(torch.unique(g).to(device))
            if step == 9:
                st.rollback()
        got.append((st.pool.admission.cells.cpu(), st.pool.slot_gid.cpu()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
