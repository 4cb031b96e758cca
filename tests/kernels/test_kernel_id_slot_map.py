"""The id -> slot hash map: the Triton map (kernels/id_slot_map_triton.py) and its reference
(kernels/id_slot_map_reference.py) against a Python dict under random inserts, lookups and deletes,
duplicate ids, odd batch sizes, growth and tombstone reuse; compiled on a GPU.

Shared set-up (Triton's interpreter on CPU machines, the autouse fixtures, bag and storage
factories) is in kernel_helpers.py."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from kernel_helpers import DEV, RUN_TRITON, gpu, needs_cuda, needs_triton

import kernels


def _map_factories() -> Iterator[Any]:
    yield pytest.param(lambda: kernels.ReferenceIdSlotMap(4, "cpu"), id="reference")
    if RUN_TRITON:
        yield pytest.param(lambda: kernels.TritonIdSlotMap(4, DEV), id="triton")


MAP_FACTORIES = list(_map_factories())


@pytest.mark.parametrize("factory", MAP_FACTORIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_hashmap_random_ops_match_dict(factory, seed):
    gen = torch.Generator().manual_seed(seed)
    table, model = factory(), {}
    for step in range(40):
        ids = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
        op = step % 3 if step > 5 else 0
        if op == 0:
            ids = ids.unique()[torch.randperm(ids.unique().numel(), generator=gen)]
            vals = torch.randint(0, 10_000, ids.shape, generator=gen)
            new = table.insert(ids, vals)
            assert new.tolist() == [i not in model for i in ids.tolist()]
            model.update(zip(ids.tolist(), vals.tolist()))
        elif op == 1:
            found = table.erase(ids)
            assert found.tolist() == [i in model for i in ids.tolist()]
            for i in ids.tolist():
                model.pop(i, None)
        slots, miss = table.lookup(ids)
        assert miss.tolist() == [i not in model for i in ids.tolist()]
        assert slots.tolist() == [model.get(i, -1) for i in ids.tolist()]
        assert len(table) == len(model)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == model


@pytest.mark.parametrize("factory", MAP_FACTORIES)
def test_hashmap_insert_absent_matches_dict_through_tombstones(factory):
    """insert_absent (the ids a lookup just missed; the reference skips finding them) claims free
    and tombstoned cells alike: with erases in between, every answer is the dict's."""
    gen = torch.Generator().manual_seed(3)
    table, model = factory(), {}
    for step in range(60):
        ids = torch.randint(0, 200, (int(torch.randint(1, 50, (1,), generator=gen)),), generator=gen).unique()
        if step % 3 == 2:
            table.erase(ids)
            for i in ids.tolist():
                model.pop(i, None)
            continue
        _, miss = table.lookup(ids)
        absent = ids[miss]
        vals = torch.randint(0, 10_000, absent.shape, generator=gen)
        table.insert_absent(absent, vals)
        model.update(zip(absent.tolist(), vals.tolist()))
        slots, miss = table.lookup(ids)
        assert not bool(miss.any()) and slots.tolist() == [model[i] for i in ids.tolist()]
        assert len(table) == len(model)
    keys, vals = table.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == model


@pytest.mark.parametrize("factory", MAP_FACTORIES)
def test_hashmap_duplicate_ids_in_one_insert(factory):
    table = factory()
    ids = torch.tensor([5, 9, 5, 5, 1 << 40, 9])
    vals = torch.tensor([1, 2, 3, 4, 5, 6])
    new = table.insert(ids, vals)
    assert int(new.sum()) == 3 and len(table) == 3
    slots, miss = table.lookup(torch.tensor([5, 9, 1 << 40, 7]))
    assert miss.tolist() == [False, False, False, True]
    assert int(slots[0]) in (1, 3, 4) and int(slots[1]) in (2, 6) and int(slots[2]) == 5
    assert table.erase(torch.tensor([5, 5])).tolist() == [True, True]
    assert table.lookup(torch.tensor([5]))[1].tolist() == [True]


@needs_triton
@pytest.mark.parametrize("n", [1, 127, 128, 129, 301])
def test_triton_hashmap_odd_batch_sizes(n):
    """Batches of one id, one short of a block, a block, a block and one, several blocks with a
    tail: every lane of the last (partial) block is masked correctly in insert, lookup, erase."""
    table, want = kernels.TritonIdSlotMap(8, DEV), kernels.ReferenceIdSlotMap(0, "cpu")
    gen = torch.Generator().manual_seed(n)
    ids = torch.randperm(10 * n + 7, generator=gen)[:n] * 3 + 1
    vals = torch.randint(0, 1 << 30, (n,), generator=gen)
    assert torch.equal(table.insert(ids, vals).cpu(), want.insert(ids, vals))
    probe = torch.cat([ids, ids + 1])  # half present, half absent
    for a, b in zip(table.lookup(probe), want.lookup(probe)):
        assert torch.equal(a.cpu(), b)
    gone = ids[::2].contiguous()
    assert torch.equal(table.erase(gone).cpu(), want.erase(gone))
    for a, b in zip(table.lookup(probe), want.lookup(probe)):
        assert torch.equal(a.cpu(), b)
    assert len(table) == len(want) == n - gone.numel()


@needs_triton
def test_triton_hashmap_grows_and_reuses_tombstones():
    table = kernels.TritonIdSlotMap(4, DEV)
    start = table.capacity
    for rnd in range(6):  # churn: tombstones accumulate, rebuilds must clear them
        ids = torch.arange(rnd * 50, rnd * 50 + 50)
        table.insert(ids, ids * 2)
        assert table.erase(ids[:40]).all()
    assert len(table) == 60
    slots, miss = (t.cpu() for t in table.lookup(torch.arange(0, 300)))
    keep = (torch.arange(300) % 50) >= 40
    assert torch.equal(miss, ~keep) and torch.equal(slots[keep], torch.arange(300)[keep] * 2)
    assert table.capacity >= start


@gpu
@needs_cuda
def test_gpu_hashmap_vs_reference():
    gpu_map, ref_map = kernels.TritonIdSlotMap(1 << 16, "cuda"), kernels.ReferenceIdSlotMap(0, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(20):
        ids = torch.randint(0, 1 << 40, (200_000,), device="cuda", generator=gen).unique()
        vals = torch.arange(ids.numel(), device="cuda")
        assert torch.equal(gpu_map.insert(ids, vals), ref_map.insert(ids, vals))
        probe = torch.cat([ids[: ids.numel() // 2], ids[:1000] + 1])
        assert torch.equal(gpu_map.erase(probe[::3]), ref_map.erase(probe[::3]))
        for a, b in zip(gpu_map.lookup(probe), ref_map.lookup(probe)):
            assert torch.equal(a, b)
    assert len(gpu_map) == len(ref_map)


def test_reference_map_churn_stays_exact_and_bounded():
    """The CPU map (open addressing, kernels/id_slot_map_reference.py) under the pool's traffic: ids come and
    go at a constant number held, over full int64 range keys (tables in the top bits). Answers
    equal a dict throughout; tombstones are reused or dropped by rebuilds, so the cells stay
    bounded by the ids held, not by the ids ever seen; items() are sorted."""
    gen = torch.Generator().manual_seed(3)
    table, model = kernels.ReferenceIdSlotMap(4, "cpu"), {}
    held = 2000
    for step in range(120):
        ids = (torch.randint(0, 1 << 20, (300,), generator=gen) * 1_000_003 + (step % 5 << 56)).unique()
        ids = ids[torch.randperm(ids.numel(), generator=gen)]
        vals = torch.randint(0, 1 << 40, ids.shape, generator=gen)
        new = table.insert(ids, vals)
        assert new.tolist() == [i not in model for i in ids.tolist()]
        model.update(zip(ids.tolist(), vals.tolist()))
        if len(model) > held:
            drop = torch.tensor(list(model)[: len(model) - held])
            assert table.erase(drop).all()
            for i in drop.tolist():
                del model[i]
        probe = torch.cat([ids, ids + 1])
        slots, miss = table.lookup(probe)
        assert slots.tolist() == [model.get(i, -1) for i in probe.tolist()]
        assert len(table) == len(model)
    assert table.capacity <= 4 * held / 0.5  # 36,000 ids went through, 2,000 held
    keys, vals = table.items()
    assert keys.tolist() == sorted(model) and vals.tolist() == [model[k] for k in sorted(model)]


def test_reference_map_duplicate_ids_keep_the_last_value_and_report_the_first():
    table = kernels.ReferenceIdSlotMap(0, "cpu")
    table.insert(torch.tensor([7]), torch.tensor([70]))
    new = table.insert(torch.tensor([9, 7, 9, 3, 9]), torch.tensor([1, 2, 3, 4, 5]))
    assert new.tolist() == [True, False, False, True, False]
    assert table.lookup(torch.tensor([9, 7, 3]))[0].tolist() == [5, 2, 4]


@needs_triton
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_dynamic_pool_over_the_triton_map_equals_over_the_reference(eviction):
    """A dynamic table's owner (embedding/dynamic/shard.py) keeps its id -> slot map in the Triton hash
    table on CUDA: the same store over TritonIdSlotMap (interpreted here, compiled on a GPU) and
    over the reference map admits, evicts, reads and updates alike: every slot, row, version and
    counter, through admissions (admit_after 2), evictions of full pools and TTL expiry."""
    from trainer.sparse.embedding.dynamic.shard import DynamicStore
    from trainer.sparse.embedding.sharding import ID_BITS, HashSharding

    def make(triton: bool) -> DynamicStore:
        st = DynamicStore(HashSharding(2, 6, 1, 0), 3, 7, 0.1, "adagrad", 0.5, 1e-8, torch.device(DEV), 0.1,
                          admit_after=2, eviction=eviction, ttl_steps=4)
        if triton:
            st.pool.map = kernels.TritonIdSlotMap(12, DEV)
            st.pool.admission.map = kernels.TritonIdSlotMap(16, DEV)
        return st

    ref, tri = make(False), make(True)
    assert isinstance(tri.pool.map, kernels.TritonIdSlotMap)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 25):
        ids = torch.randint(0, 20, (12,), generator=gen)
        gids = (ids | (torch.randint(0, 2, (12,), generator=gen) << ID_BITS)).to(DEV).unique()
        grads = torch.randn(gids.numel(), 3, generator=gen).to(DEV)
        for st in (ref, tri):
            st.clock = step
            st.admit(gids)
            st.apply(gids, grads, unique=True)
        assert torch.equal(ref.rows(gids), tri.rows(gids))
        assert torch.equal(ref.pool.slot_gid, tri.pool.slot_gid) and torch.equal(ref.version, tri.version)
        assert torch.equal(ref.pool.counters, tri.pool.counters)
    assert int(ref.pool.c["evictions"].sum()) > 5 and int(ref.pool.c["admissions"].sum()) > 12
    assert torch.equal(ref.weight, tri.weight) and ref.pool.pending_ids() == tri.pool.pending_ids()


def _masked_factories() -> Iterator[Any]:
    yield from MAP_FACTORIES
    from trainer.sparse.embedding.cache.slotmap import DirectSlotMap
    yield pytest.param(lambda: DirectSlotMap(300, "cpu"), id="direct")


@pytest.mark.parametrize("factory", list(_masked_factories()))
def test_masked_insert_and_erase_touch_only_their_lanes(factory):
    """insert_where / erase_where (a fixed-shape step's installs and evictions, cache/masked.py):
    the lanes where the mask holds, as insert / erase of just those; the masked-off lanes (any id,
    present or not, repeated) change nothing. Every answer is the dict's."""
    gen = torch.Generator().manual_seed(5)
    table, model = factory(), {}
    for step in range(40):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        ids = torch.randint(0, 300, (n,), generator=gen)
        mask = torch.rand(n, generator=gen) < 0.5
        if step % 2 == 0:  # distinct, absent ids on the lanes that insert
            keep = {}
            for i, m in zip(ids.tolist(), mask.tolist()):
                if m and i not in model and i not in keep:
                    keep[i] = True
            mask = torch.tensor([m and i in keep and keep.pop(i) for i, m in zip(ids.tolist(), mask.tolist())])
            vals = torch.randint(0, 10_000, ids.shape, generator=gen)
            table.insert_where(ids, vals, mask)
            model.update((i, v) for i, v, m in zip(ids.tolist(), vals.tolist(), mask.tolist()) if m)
        else:
            table.erase_where(ids, mask)
            for i, m in zip(ids.tolist(), mask.tolist()):
                if m:
                    model.pop(i, None)
        probe = torch.arange(300)
        slots, miss = table.lookup(probe)
        assert slots.tolist() == [model.get(i, -1) for i in range(300)], step
        assert len(table) == len(model)
