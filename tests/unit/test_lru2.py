"""LRU-2's victims (trainer/sparse/embedding/store/lru2.py) and the row cache's shortcuts (tiered.py): each is a
saving of time only, so each is checked against the plain computation it replaces."""
from __future__ import annotations

import numpy as np
import torch

from trainer.sparse.embedding.store.lru2 import SlotUses
from trainer.sparse.embedding.optim import Rounding
from trainer.sparse.embedding.sharding import RowSharding
from trainer.sparse.embedding.store.shard import ShardStore
from trainer.sparse.embedding.store.tier.disk import DiskTier
from trainer.sparse.embedding.store.tiered import TieredStore


def _keys(uses: SlotUses, slots: np.ndarray) -> np.ndarray:
    return (uses.before.numpy()[slots].astype(np.int64) << 32) | uses.last.numpy()[slots]


def test_the_kept_slots_give_the_smallest_keys_of_all():
    """A random run of a 4,000-slot cache (Zipf-like reuse, steps of several calls): every
    eviction's victims have exactly the keys of the n smallest over all slots not used in the
    call, and most evictions choose among the kept slots, not over all of them."""
    n_slots, rng = 4000, np.random.default_rng(0)
    uses = SlotUses(n_slots)
    rows = np.full(n_slots, -1, dtype=np.int64)  # the storage row in each slot
    where: dict[int, int] = {}
    evictions = 0
    for step in range(300):
        uses.new_step()
        for _ in range(int(rng.integers(1, 4))):
            call = uses.new_call()
            want = np.unique((rng.zipf(1.2, int(rng.integers(50, 600))) - 1) % 20_000)
            held = np.array([where[r] for r in want if r in where], dtype=np.int64)
            if held.size:
                uses.touch(torch.from_numpy(held))
            new = np.array([r for r in want if r not in where], dtype=np.int64)
            free = np.flatnonzero(rows < 0)
            if free.size < new.size:
                n = max(new.size - free.size, n_slots // 32)
                can = np.flatnonzero((rows >= 0) & (uses.last.numpy() < call))
                want_keys = np.sort(_keys(uses, can))[:n]
                got = uses.victims(rows, n)
                assert np.array_equal(np.sort(_keys(uses, got)), want_keys), (step, n)
                assert np.unique(got).size == got.size and (uses.last.numpy()[got] < call).all()
                for s in got.tolist():
                    del where[int(rows[s])]
                rows[got] = -1
                evictions += 1
                free = np.flatnonzero(rows < 0)
            put = free[:new.size]
            rows[put] = new[:put.size]
            where.update(zip(new[:put.size].tolist(), put.tolist()))
            if put.size:
                uses.loaded(torch.from_numpy(put))
    assert evictions > 50 and uses.selections < evictions / 3, (evictions, uses.selections)


def _store_pair(tmp_path, name: str):
    args = (RowSharding([400, 300], 1, 0), 8, 3, None, "rowwise_adagrad", 0.05, 1e-8, torch.device("cpu"), 0.1, 0.0,
            torch.float32, Rounding("stochastic", 3))
    tier = DiskTier(str(tmp_path / name), 0, 1 << 16)
    return ShardStore(*args), TieredStore(*args, tier=tier, buffer_bytes=12_000), tier


def test_an_update_of_the_rows_just_read_changes_nothing_but_time(tmp_path, monkeypatch):
    """A step's update after its lookup reuses the lookup's slots (no unique, no map lookup, no
    touch): the same values as memory, and the same counts, evictions and rows held as a cache
    that looks every call up again; sorted rows skip the sort."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mem, fast, tier_a = _store_pair(tmp_path, "a")
    _, plain, tier_b = _store_pair(tmp_path, "b")
    monkeypatch.setattr(plain, "_same_rows", lambda idx, call: False)
    unique_calls = []
    sort = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: unique_calls.append(1) or sort(*a, **k))
    try:
        g = torch.Generator().manual_seed(0)
        for step in range(40):
            if step % 3 != 2:  # else the rows of the step before again: a new step touches them (no reuse)
                ids = torch.unique(torch.where(torch.rand(120, generator=g) < 0.6, torch.randint(0, 60, (120,), generator=g),
                                               torch.randint(0, 700, (120,), generator=g)))  # a step's owned rows: sorted
            grads = torch.randn(ids.numel(), 8, generator=g)
            for s in (mem, fast, plain):
                s.rounding.step = step
            unique_calls.clear()
            got = [s.rows(ids) for s in (mem, fast, plain)]
            assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2]) and not unique_calls
            if step % 5 == 4:  # another call between the lookup and the update: no reuse
                other = torch.randint(0, 700, (30,), generator=g)
                assert all(torch.equal(mem.versions(other), s.versions(other)) for s in (fast, plain))
            for s in (mem, fast, plain):
                s.apply(ids, grads, unique=True)
        assert fast.counts == plain.counts and fast.counts["evicted"] > 0, (fast.counts, plain.counts)
        every = torch.arange(700)
        assert torch.equal(fast._map.lookup(every)[0] >= 0, plain._map.lookup(every)[0] >= 0)
        ranks = [torch.unique(torch.from_numpy(_keys(s._uses, np.arange(s._slots_n))), return_inverse=True)[1]
                 for s in (fast, plain)]  # the uses are numbered apart (no touch), but in the same order
        assert torch.equal(*ranks)
        assert torch.equal(mem.rows(every), fast.rows(every))
    finally:
        tier_a.close()
        tier_b.close()
