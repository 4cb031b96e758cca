"""Dynamic tables' parts without processes: the hashed owner, the slot pool (admission, eviction,
a returning id's new life), the store's default rows and dropped gradients, the scrambled ids,
and the combinations refused at config time (docs/dynamic.md)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dynamic_helpers import CPU, gid, store
from helpers import Mirror, make_cfg
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.workload.data.scramble import scramble
from trainer.sparse.embedding.cache.rows import RowCache, make_policy
from trainer.sparse.embedding.cache.consistency import CURRENT_LIFE
from trainer.sparse.embedding.dynamic.shard import LIFE_SHIFT, DynamicStore, dynamic_init_rows
from trainer.sparse.embedding.remote.het import HetWire
from trainer.sparse.embedding.types import Pushes
from trainer.sparse.embedding.dynamic.pool import SlotPool
from trainer.sparse.embedding.sharding import ID_BITS, HashSharding


def test_owner_is_a_hash_of_table_and_id_and_every_rank_agrees():
    ids = torch.randint(0, 1 << ID_BITS, (20000,))
    owners = [HashSharding(3, 8, 4, r).owner(gid(1, ids)) for r in range(4)]
    assert all(torch.equal(o, owners[0]) for o in owners)
    counts = torch.bincount(owners[0], minlength=4)
    assert counts.min() > 4500  # spread evenly over the 4 owners (5000 expected)
    same_id_other_table = HashSharding(3, 8, 4, 0).owner(gid(2, ids))
    assert (same_id_other_table != owners[0]).float().mean() > 0.6  # the table is part of the key
    assert (HashSharding(3, 8, 4, 0).owner(gid(1, ids).numpy()) == owners[0].numpy()).all()  # numpy: the same rule


def test_scramble_is_a_bijection_into_the_dynamic_id_space():
    v = torch.arange(300000)
    s = scramble(v, torch.zeros_like(v), 5)
    assert s.unique().numel() == v.numel() and int(s.min()) >= 0 and int(s.max()) < 1 << ID_BITS
    assert not torch.equal(s, scramble(v, torch.ones_like(v), 5))  # per table


def test_admission_at_once_gives_each_id_its_initial_row():
    st = store()
    g = gid(0, [5, 1 << 40, 5])
    assert torch.count_nonzero(st.rows(g)) == 0  # not admitted: the default, zeros
    st.admit(g)
    expect = dynamic_init_rows(7, 3, g, 0.1)
    torch.testing.assert_close(st.rows(g), expect)
    assert st.pool.c["admissions"].tolist() == [2, 0]


def test_admit_after_counts_once_per_step_and_drops_gradients_until_then():
    st = store(admit_after=3)
    g = gid(1, [9])
    for step in range(3):
        st.clock = step
        st.admit(torch.cat([g, g]))  # two reads in one step count once
        st.admit(g)  # ... and so does a second call in the same step (a peer's request)
        if step < 2:
            assert torch.count_nonzero(st.rows(g)) == 0
            st.apply(g, torch.ones(1, 3))
            assert st.pool.c["dropped_grads"].tolist() == [0, step + 1]
            assert st.pool.pending_ids() == 1
    torch.testing.assert_close(st.rows(g), dynamic_init_rows(7, 3, g, 0.1))
    assert st.pool.pending_ids() == 0  # admitted ids leave the counter
    st.apply(g, torch.ones(1, 3))
    torch.testing.assert_close(st.rows(g), dynamic_init_rows(7, 3, g, 0.1) - 0.5)
    assert st.pool.c["dropped_grads"].tolist() == [0, 2]


def test_lru_evicts_the_least_recently_read_and_never_a_row_of_this_step():
    st = store(capacity=3)
    for step, ids in enumerate([[1, 2, 3], [2], [3]]):
        st.clock = step
        st.admit(gid(0, ids))
    st.clock = 3
    st.admit(gid(0, [3, 4]))  # full: 1 (read at step 0) goes; 3 is read now and stays
    held = set((st.held()[0] & ((1 << ID_BITS) - 1)).tolist())
    assert held == {2, 3, 4}
    st.admit(gid(0, [5, 6, 7]))  # step 3 again: only 2 may go; 6 and 7 are rejected
    assert set((st.held()[0] & ((1 << ID_BITS) - 1)).tolist()) == {3, 4, 5}
    assert st.pool.c["evictions"].tolist() == [2, 0] and st.pool.c["rejected"].tolist() == [2, 0]
    assert torch.count_nonzero(st.rows(gid(0, [6, 7]))) == 0


def test_lfu_evicts_the_least_used():
    st = store(capacity=2, eviction="lfu")
    for step, ids in enumerate([[1, 2], [1], [1], [2]]):
        st.clock = step
        st.admit(gid(0, ids))
    st.clock = 4
    st.admit(gid(0, [3]))  # 2 was read last but twice; 1 three times: 2 goes
    assert set((st.held()[0] & ((1 << ID_BITS) - 1)).tolist()) == {1, 3}


@pytest.mark.parametrize("half_life,kept", [(0, {1, 3}), (5, {2, 3})])
def test_lfu_decay_lets_old_popularity_fade(half_life, kept):
    """embedding.lfu_half_life: id 1 read 10 times long ago, id 2 twice just now. Without decay
    LFU keeps 1 (10 uses against 2); halved per 5 idle steps, 1's uses are 10 >> 4 = 0 at step 30
    and it goes. The score is a function of the saved uses, last read and step alone."""
    sh = HashSharding(2, 2, 1, 0)
    st = DynamicStore(sh, 3, 7, 0.1, "sgd", 0.5, 1e-8, CPU, 0.1, eviction="lfu", lfu_half_life=half_life)
    for step in range(10):
        st.clock = step
        st.admit(gid(0, [1]))
    for step in (28, 29):
        st.clock = step
        st.admit(gid(0, [2]))
    st.clock = 30
    st.admit(gid(0, [3]))
    assert set((st.held()[0] & ((1 << ID_BITS) - 1)).tolist()) == kept
    pool = st.pool
    scores = pool.lfu_scores(torch.tensor([10, 2]), torch.tensor([9, 29]), 30)
    assert scores.tolist() == ([10, 2] if half_life == 0 else [0, 2])


def test_lfu_half_life_needs_lfu():
    with pytest.raises(ConfigError, match="embedding.lfu_half_life.*eviction=lfu"):
        load_config(make_cfg(["embedding.kind=dynamic", "embedding.capacity=10", "embedding.lfu_half_life=4"]))
    c = load_config(make_cfg(["embedding.kind=dynamic", "embedding.capacity=10", "embedding.eviction=lfu",
                              "embedding.lfu_half_life=4"]))
    assert c.embedding.lfu_half_life == 4


def test_a_row_unread_past_its_ttl_expires_and_its_id_starts_a_new_life():
    """embedding.ttl_steps=3: id 1 read at steps 0 and 2 (idle 2: kept, trained), then at step 6
    (idle 4 > 3): it reads its initial row again, with fresh optimizer state and the version of a
    new life, in the same slot; counted as an eviction and an admission. Id 2, read every 3 steps,
    never expires."""
    sh = HashSharding(1, 4, 1, 0)
    st = DynamicStore(sh, 3, 7, 0.1, "adagrad", 0.5, 1e-8, CPU, 0.1, ttl_steps=3)
    init = dynamic_init_rows(7, 3, gid(0, [1, 2]), 0.1)
    for step in (0, 2, 3, 6):
        st.clock = step
        ids = [1, 2] if step in (0, 2, 6) else [2]
        st.admit(gid(0, ids))
        st.apply(gid(0, ids), torch.ones(len(ids), 3))
        if step == 2:
            trained = st.rows(gid(0, [1])).clone()
            assert not torch.equal(trained, init[:1])
    slots, miss = st.pool.lookup(gid(0, [1, 2]))
    assert not miss.any()
    v = st.version.index_select(0, slots)
    assert int(v[0]) >> LIFE_SHIFT == 7 and int(v[1]) >> LIFE_SHIFT == 1  # 1 reborn at step 6, 2 not
    # id 1's row: its initial row after one update from fresh state (the same as a first admission)
    fresh = DynamicStore(sh, 3, 7, 0.1, "adagrad", 0.5, 1e-8, CPU, 0.1)
    fresh.clock = 6
    fresh.admit(gid(0, [1]))
    fresh.apply(gid(0, [1]), torch.ones(1, 3))
    assert torch.equal(st.rows(gid(0, [1])), fresh.rows(gid(0, [1])))
    c = st.pool.c
    assert int(c["evictions"][0]) == 1 and int(c["admissions"][0]) == 3


def test_an_expired_row_with_admission_after_k_sightings_is_reborn_without_waiting_again():
    """embedding.ttl_steps with admit_after = 2: an id waits for its second sighting once; when its
    row expires, the id (already admitted) starts its new life the next time it is read, without
    being counted again: expiry resets what the row learnt, not the admission."""
    c = load_config(make_cfg(["embedding.kind=dynamic", "embedding.capacity=10", "embedding.ttl_steps=4",
                              "embedding.admit_after=2", "checkpoint.enabled=false"]))
    assert c.embedding.ttl_steps == 4 and c.embedding.admit_after == 2
    sh = HashSharding(1, 4, 1, 0)
    st = DynamicStore(sh, 3, 7, 0.1, "sgd", 0.5, 1e-8, CPU, 0.1, admit_after=2, ttl_steps=2)
    x = gid(0, [5])
    for step in (0, 1):  # seen twice: admitted at step 1 (life 2)
        st.clock = step
        st.admit(x)
        st.apply(x, torch.ones(1, 3))
    assert not bool(st.pool.lookup(x)[1]) and int(st.pool.c["dropped_grads"][0]) == 1
    st.clock = 6  # idle 5 > 2: expired; reborn at once, from its initial row
    st.admit(x)
    slot = int(st.pool.lookup(x)[0])
    assert int(st.version[slot]) == 7 << LIFE_SHIFT
    assert torch.equal(st.rows(x), dynamic_init_rows(7, 3, x, 0.1))
    assert int(st.pool.c["admissions"][0]) == 2 and int(st.pool.c["evictions"][0]) == 1


def test_a_returning_id_restarts_from_its_initial_row_with_a_later_version():
    st = store(capacity=1, optimizer="rowwise_adagrad")
    a, b = gid(0, [11]), gid(0, [12])
    st.admit(a)
    st.apply(a, torch.ones(1, 3))
    st.apply(a, torch.ones(1, 3))
    slot = int(st.pool.lookup(a)[0])
    old_version = int(st.version[slot])
    assert int(st.optimizer.state[slot]) != pytest.approx(0.1)
    st.clock = 1
    st.admit(b)  # evicts a; b takes its slot
    assert int(st.pool.lookup(b)[0]) == slot and bool(st.pool.lookup(a)[1])
    assert torch.count_nonzero(st.rows(a)) == 0
    st.clock = 2
    st.admit(a)  # a's new life: its initial row, a fresh optimizer state
    torch.testing.assert_close(st.rows(a), dynamic_init_rows(7, 3, a, 0.1))
    assert float(st.optimizer.state[slot]) == pytest.approx(0.1)
    new_version = int(st.version[slot])
    assert new_version == 3 << LIFE_SHIFT and new_version > old_version  # a copy of the old life is "behind"


def test_a_push_held_back_past_an_eviction_never_reaches_the_ids_next_life():
    """HET with bounds > 0: a worker may push updates made on a copy of an id's earlier life after
    the owner evicted it and admitted it again; each push carries its life, and the owner drops
    the earlier life's (counted like the gradients of ids without a row)."""
    st = store(capacity=1)
    a, b = gid(0, [11]), gid(0, [12])
    st.admit(a)
    slot = int(st.pool.lookup(a)[0])
    old_life = int(st.version[slot]) >> LIFE_SHIFT
    st.clock = 1
    st.admit(b)  # evicts a
    st.clock = 2
    st.admit(a)  # a's next life
    new_life = int(st.version[slot]) >> LIFE_SHIFT
    assert new_life > old_life
    fresh = st.rows(a).clone()
    st.apply(a, torch.ones(1, 3), counts=torch.tensor([3]), lives=torch.tensor([old_life]))
    assert torch.equal(st.rows(a), fresh) and int(st.version[slot]) == new_life << LIFE_SHIFT
    assert int(st.pool.c["dropped_grads"][0]) == 1
    st.apply(a, torch.ones(1, 3), counts=torch.tensor([2]), lives=torch.tensor([new_life]))
    assert not torch.equal(st.rows(a), fresh) and int(st.version[slot]) == (new_life << LIFE_SHIFT) + 2
    st.apply(a, torch.ones(1, 3), lives=torch.tensor([CURRENT_LIFE]))  # the owner's own read
    assert int(st.version[slot]) == (new_life << LIFE_SHIFT) + 3


def test_a_cached_copy_reread_in_another_life_drops_its_pending_updates():
    """The worker's side: local updates made on a copy of an earlier life (or of an id that has
    no row now) are dropped when the copy is re-read, never re-applied to the new row nor pushed;
    within one life they are kept, and every push names the life of its copy."""
    cache = RowCache([4], 3, make_policy("lru"), n_ids=100, local_lr=0.5)
    x = torch.tensor([5])
    slots, _ = cache.install(x, torch.tensor([0]), torch.zeros(1, 3), torch.tensor([(2 << LIFE_SHIFT) + 1]), 0)
    g = torch.ones(1, 3)
    cache.record_updates(slots, g)
    row = torch.full((1, 3), 2.0)
    kept = cache.refresh(slots, row, torch.tensor([(2 << LIFE_SHIFT) + 9]))  # same life, newer
    assert int(kept[0]) == 0 and int(cache.count[slots]) == 1
    torch.testing.assert_close(cache.rows[slots], row - 0.5 * g)
    pushed = cache.take_all()
    assert pushed.lives.tolist() == [2] and pushed.counts.tolist() == [1]
    for new_version in ((5 << LIFE_SHIFT), (4 << LIFE_SHIFT) - 1):  # a new life; no row (absent)
        cache.record_updates(slots, g)
        dropped = cache.refresh(slots, row, torch.tensor([new_version]))
        assert int(dropped[0]) == 1 and int(cache.count[slots]) == 0
        assert torch.equal(cache.rows[slots], row) and torch.count_nonzero(cache.pending) == 0
    assert len(cache.take_all()) == 0


def test_the_het_wire_carries_each_pushs_life_to_the_owner():
    """Dynamic tables: (life, count) share the count's int64 on the wire and arrive apart."""
    st = store(capacity=8, world=2, rank=0)
    sh, wire = st.sharding, HetWire(Mirror(), st)
    gids = gid(1, [7, 9, 3])
    lives, counts = torch.tensor([CURRENT_LIFE, 4, 1 << 20]), torch.tensor([1, 7, (1 << 32) - 2])
    got = wire.push_updates(Pushes(gids, torch.randn(3, 3), counts, lives))
    order = torch.argsort(sh.owner(gids), stable=True)
    assert torch.equal(got.gids, gids[order]) and torch.equal(got.counts, counts[order])
    assert torch.equal(got.lives, lives[order])


def test_no_two_ids_ever_share_a_slot_under_random_traffic():
    st = store(capacity=16, admit_after=2, tables=3)
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        st.clock = step
        t = torch.randint(0, 3, (40,), generator=gen)
        i = torch.randint(0, 60, (40,), generator=gen)
        st.admit(i | (t << ID_BITS))
        st.apply(i | (t << ID_BITS), torch.randn(40, 3, generator=gen))
        slots = st.pool.slot_gid
        held = slots[slots >= 0]
        assert held.unique().numel() == held.numel()
        got, miss = st.pool.lookup(held)
        assert not miss.any() and torch.equal(st.pool.slot_gid[got], held)  # map and slots agree
        assert ((held >> ID_BITS) == torch.nonzero(slots >= 0).squeeze(1) // 16).all()  # own table's slots
    c = st.pool.c
    assert torch.equal(c["admissions"] - c["evictions"], st.pool.rows_in_use())
    assert int(c["evictions"].sum()) > 0


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_eviction_order_equals_a_sort_of_the_whole_table(eviction):
    """The pool picks victims with topk / kthvalue (O(capacity), no sort of the table); they must be
    the slots a full sort by score picks: LRU (last read, slot), LFU (uses, last read, slot), never
    a slot read in this step, in that order (the new ids take them in it)."""
    pool = SlotPool(2, 40, 1, eviction, CPU)
    gen = torch.Generator().manual_seed(1)
    evicted = 0
    for step in range(80):
        ids = torch.randint(0, 90, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen)
        t = torch.randint(0, 2, ids.shape, generator=gen)
        gids = torch.unique(ids | (t << ID_BITS))
        before = (pool.slot_gid.clone(), pool.last_use.clone(), pool.uses.clone())
        slots, miss = pool.lookup(gids)
        read = set(slots[~miss].tolist())
        new = gids[miss]
        got = pool.admit(gids, step)
        for tab in range(2):
            want_new = new[(new >> ID_BITS) == tab]
            lo = tab * 40
            free = [s for s in range(lo, lo + 40) if before[0][s] < 0]
            scored = sorted((s for s in range(lo, lo + 40) if before[0][s] >= 0 and s not in read),
                            key=lambda s: (int(before[2][s]), int(before[1][s]), s) if eviction == "lfu"
                            else (int(before[1][s]), s))
            expect = (free + scored)[: want_new.numel()]
            mine = [] if got is None else got[1][(got[0] >> ID_BITS) == tab].tolist()
            assert mine == expect
            evicted += max(len(expect) - len(free), 0)
    assert evicted > 100 and int(pool.c["evictions"].sum()) == evicted


def test_free_slots_after_a_load_go_lowest_first_and_lookups_stay_exact():
    """reindex() (a checkpoint load) rebuilds the map and the free slots from slot_gid, holes
    below the last held slot included: they are handed out first, lowest first; the pool's
    remembered answers follow every insert and erase."""
    pool = SlotPool(1, 8, 1, "lru", CPU)
    pool.slot_gid[torch.tensor([0, 2, 3, 6])] = gid(0, [10, 20, 30, 40])
    pool.last_use[torch.tensor([0, 2, 3, 6])] = torch.tensor([0, 1, 2, 3])
    pool.reindex()
    assert pool.lookup(gid(0, [20, 40, 50]))[0].tolist() == [2, 6, -1]
    ids, slots = pool.admit(gid(0, [20, 41, 42, 43, 44, 45]), step=4)
    assert slots.tolist() == [1, 4, 5, 7, 0]  # holes 1, 4, 5, the free tail 7, then 10's slot (LRU)
    assert ids.tolist() == gid(0, [41, 42, 43, 44, 45]).tolist()
    for g in (gid(0, [10, 20, 41, 45]), gid(0, [20, 41, 42, 43, 44, 45])):
        assert [t.tolist() for t in pool.lookup(g)] == [t.tolist() for t in pool.map.lookup(g)]


@pytest.mark.parametrize("overrides,key", [
    (["placement=sca"], "placement.name"),
    (["schedule=herald", "cache=lru", "train.nonfinite=skip"], "train.nonfinite"),
    (["schedule=herald", "cache=lru", "train.precision=fp16"], "train.precision"),
    (["embedding.audit=true"], "embedding.audit"),
    (["comm.settled_rows=always"], "comm.settled_rows"),
])
def test_combinations_not_supported_yet_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match="embedding.kind=dynamic does not support") as err:
        load_config(make_cfg(["embedding.kind=dynamic", "embedding.capacity=10",
                              "checkpoint.enabled=false"] + overrides))
    assert str(err.value).startswith(f"{key}=")


@pytest.mark.parametrize("consistency", ["bsp", "ssp", "asp"])
def test_the_het_cache_is_accepted_at_any_bounds(consistency):
    c = load_config(make_cfg(["embedding.kind=dynamic", "embedding.capacity=10", "checkpoint.enabled=false",
                              "cache=lru", f"consistency={consistency}"]))
    assert c.cache.policy == "lru" and c.embedding.kind == "dynamic"


def test_dynamic_tables_need_a_capacity():
    with pytest.raises(ConfigError, match="embedding.capacity=0"):
        load_config(make_cfg(["embedding.kind=dynamic", "checkpoint.enabled=false"]))


def test_a_byte_budget_sets_the_most_rows_per_table_that_fit():
    """embedding.capacity_bytes: the memory plan's rows of the resolved capacity fit the budget,
    one row more per table does not; the resolved config loads again unchanged; too small a
    budget, a disagreeing capacity and fixed tables are refused naming the key."""
    from trainer.run.resolve.memplan import plan_memory

    base = ["embedding.kind=dynamic", "checkpoint.enabled=false"]
    for budget in (200_000, 30_000_000):
        c = load_config(make_cfg(base + [f"embedding.capacity_bytes={budget}"]))
        assert c.embedding.capacity > 0 and plan_memory(c, 1, 0).parts["rows"] <= budget
        cap = c.embedding.capacity
        assert load_config(c).embedding.capacity == cap  # a resolved config is valid as it is
        c.embedding.capacity = cap + 1
        assert plan_memory(c, 1, 0).parts["rows"] > budget
    with pytest.raises(ConfigError, match="embedding.capacity_bytes=100: too small for one row per table"):
        load_config(make_cfg(base + ["embedding.capacity_bytes=100"]))
    with pytest.raises(ConfigError, match="give one of them"):
        load_config(make_cfg(base + ["embedding.capacity_bytes=200000", "embedding.capacity=7"]))
    with pytest.raises(ConfigError, match="embedding.capacity_bytes=5.*needs embedding.kind=dynamic"):
        load_config(make_cfg(["embedding.capacity_bytes=5", "checkpoint.enabled=false"]))


def test_a_refused_combination_exits_2_with_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "trainer", "embedding.kind=dynamic", "embedding.capacity=10",
                        "placement=sca", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "embedding.kind=dynamic does not support sca's cost model" in lines[0]


def test_raw_ids_keep_criteos_32_bit_values_and_train_dynamic_tables(tmp_path):
    """prepare_criteo.py --raw-ids: every id is its value's 32 bits (0: empty), read back unsigned;
    such a directory trains embedding.kind=dynamic (a vocabulary is refused, naming the key), with
    the small-data recipe's validation split."""
    from data_helpers import N_TRAIN, prepare_sample, sample_lines
    from trainer.workload.data import make_data
    from trainer.workload.data.criteo import parse_line
    from trainer.run.runner import run

    from trainer.tools.prepare_criteo import parse_args
    opt = parse_args(["--train", "t.tsv", "--out", "o", "--raw-ids"])
    assert opt.raw_ids and opt.hash_rows is None and opt.min_count is None
    meta = prepare_sample(str(tmp_path), hash_rows=None, raw_ids=True)
    assert meta["table_rows"] == [1 << 32] * 26 and meta["categorical"]["kind"] == "raw"
    d = str(tmp_path / "prepared")
    rows = [parse_line(line)[2] for line in sample_lines()[:N_TRAIN]]
    want = torch.tensor([[0 if v is None else v for v in r] for r in rows], dtype=torch.int64)
    assert int(want.max()) >= 1 << 31  # values past int32's range really occur
    base = ["data=criteo", f"data.dir={d}", "data.loader=memmap", "embedding.kind=dynamic",
            "embedding.capacity=2000", "checkpoint.enabled=false", "train.ensemble=1",
            "data.epochs=0", "train.steps=3", "data.batch_size=64", "data.shuffle=false", "train.progress=off"]
    with pytest.raises(ConfigError, match="data.min_count=1: .* keeps raw ids"):
        make_data(load_config(make_cfg(base + ["data.min_count=1"])), 0, 1)
    cfg = load_config(make_cfg(base + ["data.min_count=0"]))
    got = make_data(cfg, 0, 1).train_batch(0)
    assert torch.equal(got.values.reshape(-1, 26), want[:64])
    res = run(make_cfg(base + ["data.min_count=0", "comm=local"]), str(tmp_path / "out"))
    assert res.summary["dynamic"]["admissions"] > 0 and res.summary["dynamic"]["rows_in_use"] > 0
    assert res.summary["val_samples"] > 0 and res.summary["best_step"] is not None  # the recipe's validation split


def test_the_drifting_preset_brings_new_ids_and_moves_popularity():
    """data=drift: a later stretch of the stream holds ids the start never had and the start's most
    read ids fade; the same data without drift stays inside its table; eval is drawn as at
    data.drift_eval_at."""
    from trainer.workload.data.synthetic import SyntheticData
    c = load_config(make_cfg(["data=drift", "embedding.kind=dynamic", "embedding.capacity=100",
                              "checkpoint.enabled=false", "data.drift_eval_at=200000"]))
    data = SyntheticData(c.data, list(c.data.table_rows), 0, 1, 4096)
    early, late = data.train_batch(0).values, data.train_batch(60).values  # samples 0.. and 245760..
    t0 = torch.arange(early.numel()) % 8 == 0  # table 0 (one id per bag)
    a, b = set(early[t0].tolist()), set(late[t0].tolist())
    assert max(b) >= 100000 + 0.05 * 245760 - 1 and len(b - a) > 0.8 * len(b)  # new ids keep arriving
    top = torch.mode(early[t0]).values.item()
    assert (late[t0] == top).sum() < (early[t0] == top).sum() / 4  # the start's most read id fades
    ev = next(iter(data.eval_batches())).values
    assert int(ev.min()) >= int(0.05 * 200000)  # evaluation as at position 200000
    flat = SyntheticData(load_config(make_cfg(["data=drift", "data.drift=0", "data.scramble_ids=false"])).data,
                         list(c.data.table_rows), 0, 1, 4096)
    assert int(flat.train_batch(60).values.max()) < 100000


def test_hash_rows_folds_the_dynamic_tables_ids_into_fixed_rows():
    """data.hash_rows=N (fixed tables): the very ids a dynamic table sees (drifting, scrambled),
    each hashed into [0, N) of its table by splitmix64 of (table, id): the same-memory baseline.
    Refused with dynamic tables (and on Criteo: its hashing is prepare_criteo.py's)."""
    from trainer.base.config import table_rows
    from trainer.workload.data import make_data
    from trainer.base.core.hashing import mix64
    base = ["data=drift", "checkpoint.enabled=false", "data.batch_size=512"]
    dyn = load_config(make_cfg(base + ["embedding.kind=dynamic", "embedding.capacity=100"]))
    fixed = load_config(make_cfg(base + ["data.hash_rows=300"]))
    assert table_rows(fixed) == [300] * 8
    for step in (0, 40):
        raw, got = make_data(dyn, 0, 1).train_batch(step), make_data(fixed, 0, 1).train_batch(step)
        t = raw.table_index()
        want = (mix64(raw.values | (t << ID_BITS)) & 0x7FFFFFFFFFFFFFFF) % 300
        assert torch.equal(got.values, want) and torch.equal(got.labels, raw.labels)
        assert int(raw.values.max()) >= 1 << 40 and 250 < got.values.unique().numel() <= 300  # wide ids, folded
    for extra in (["data.hash_rows=300", "embedding.kind=dynamic", "embedding.capacity=100"], ["data.hash_rows=-1"]):
        with pytest.raises(ConfigError, match="data.hash_rows"):
            load_config(make_cfg(base + extra))
    with pytest.raises(ConfigError, match="data.drift=0.05: drifting ids are unbounded"):
        load_config(make_cfg(base + ["data.scramble_ids=false"]))  # drift on fixed tables without hashing: refused


def test_dynamic_tables_train_on_the_drifting_preset_and_evict(tmp_path):
    from trainer.run.runner import run
    res = run(make_cfg(["data=drift", "embedding.kind=dynamic", "embedding.capacity=1500",
                        "checkpoint.enabled=false", "train.steps=12", "data.test_samples=1024",
                        "train.progress=off", "comm=local"]), str(tmp_path))
    d = res.summary["dynamic"]
    assert d["evictions"] > 0 and d["rows_in_use"] == 8 * 1500
    assert d["admissions"] - d["evictions"] == d["rows_in_use"]


def test_the_cache_simulator_refuses_dynamic_tables():
    from trainer.tools.simulate import TraceError, build
    with pytest.raises(TraceError, match="embedding.kind=dynamic: the simulator models fixed tables"):
        build(["embedding.kind=dynamic", "embedding.capacity=10", "checkpoint.enabled=false", "cache=lru"], 2,
              log=None)


def test_the_memory_plan_counts_the_pool_and_its_bookkeeping():
    """Dynamic tables: the plan's rows are the store's (T x capacity slots of weight, state,
    version, touched) plus the pool's slot ids and scores and a bound on the map's cells (CPU:
    16 B a cell; the map of a full pool never holds more than the bound)."""
    import trainer.run.resolve.memplan as memplan
    from kernels.id_slot_map_reference import cells_bound
    c = load_config(make_cfg(["data=tiny", "embedding.kind=dynamic", "embedding.capacity=50",
                              "checkpoint.enabled=false", "optim.sparse=rowwise_adagrad", "model.embedding_dim=16"]))
    plan = memplan.plan_memory(c, 2, 1)
    st = DynamicStore(HashSharding(4, 50, 2, 1), 16, 0, None, "rowwise_adagrad", 0.1, 1e-8, CPU)
    held = [st.weight, st.version, st.touched, *st.optimizer.state_tensors().values(),
            st.pool.slot_gid, st.pool.last_use, st.pool.uses]
    rows_bytes = sum(t.numel() * t.element_size() for t in held)
    cells = []
    for step in range(30):  # a full pool with churn: ids come and go, tombstones, rebuilds
        st.clock = step
        i = torch.arange(step * 20, step * 20 + 200)
        st.admit(i | (i % 4 << ID_BITS))
        cells.append(st.pool.map.capacity)
    map_share = plan.bytes_per_row - st.bytes_per_row()["total"] - 1 + st.bytes_per_row()["map"]
    assert plan.local_rows == 200 and plan.parts["rows"] == rows_bytes + 200 * map_share
    assert max(cells) * 16 <= 200 * map_share and map_share == -(-16 * cells_bound(200) // 200)
    assert st.bytes_per_row()["total"] + 1 == plan.bytes_per_row  # + touched: the plan's part only, as for fixed tables
