"""TieredStore (trainer/sparse/embedding/store/tiered.py) against ShardStore, call for call: the same random
sequence of reads, updates (repeated rows, masked, put back) and direct phases on both, with a row
cache of a few slots, so that every path runs: hits, loads, batched evictions with write-back,
calls wanting more rows than the cache holds (served by the file), a direct read (the cache
writes back and keeps its rows) and a direct write (it forgets them). Every result and, at the
end, every array: the same bits.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from trainer.sparse.embedding.optim import Rounding
from trainer.sparse.embedding.sharding import RowSharding
from trainer.sparse.embedding.store.shard import ShardStore
from trainer.sparse.embedding.store.tier import disk as tier_module
from trainer.sparse.embedding.store.tier import writelog as tier_log
from trainer.sparse.embedding.store.tier import uring
from trainer.sparse.embedding.store.tier.disk import DiskTier
from trainer.sparse.embedding.cache.slotmap import map_bytes
from trainer.sparse.embedding.store import tiered
from trainer.sparse.embedding.store.tiered import SLOT_BOOK_BYTES, TieredStore, buffer_slots, log_rows

ROWS = [300, 157, 41]
DIM = 8


def _reader(monkeypatch, reader: str) -> None:
    if reader == "threads":
        monkeypatch.setattr(tier_module, "open_ring", lambda *a: None)
    elif uring.open_ring() is None:
        pytest.skip("io_uring is refused here (the kernel, seccomp or kernel.io_uring_disabled): the threads read")


def _stores(tmp_path, optimizer: str, dtype: torch.dtype, slots_bytes: int):
    args = (RowSharding(ROWS, 1, 0), DIM, 3, None, optimizer, 0.05, 1e-8, torch.device("cpu"), 0.1, 0.01, dtype,
            Rounding("stochastic", 3))
    mem = ShardStore(*args)
    tier = DiskTier(str(tmp_path), 0, 1 << 16)
    disk = TieredStore(*args, tier=tier, buffer_bytes=slots_bytes)
    return mem, disk, tier


@pytest.mark.parametrize("optimizer, dtype, reader", [("adagrad", torch.float32, "ring"), ("rowwise_adagrad", torch.float16, "ring"),
                                                      ("sgd", torch.bfloat16, "ring"), ("adagrad", torch.float32, "threads"),
                                                      ("rowwise_adagrad", torch.float32, "ring, merges by pages")])
def test_every_call_equals_the_store_in_memory(tmp_path, monkeypatch, optimizer, dtype, reader):
    """reader: the reads ahead's copies through io_uring where the kernel has it (every merge
    through the pages of its rows alone: `merges by pages`), or the threads' gathers through the
    mapping."""
    monkeypatch.setattr(tiered, "LOG_SHARE", 8)  # a small log: merges often, some between a read ahead and its load
    if reader.endswith("by pages"):
        monkeypatch.setattr(tier_log, "SCATTERED_PAGE_COST", 0)
    _reader(monkeypatch, reader.split(",")[0])
    mem, disk, tier = _stores(tmp_path, optimizer, dtype, 8000)
    assert (tier._ring is not None) == reader.startswith("ring")
    try:
        assert 40 <= disk._slots_n < 200 and disk._log.capacity == 63  # few slots: most calls evict, some overflow
        g = torch.Generator().manual_seed(0)
        n_ids = sum(ROWS)
        prev = torch.zeros(0, dtype=torch.int64)
        for step in range(60):
            mem.rounding.step = disk.rounding.step = step
            for s in (mem, disk):
                s.optimizer.lr = 0.05 / (1 + step)
            ids = torch.randint(0, n_ids, (int(torch.randint(1, 320, (1,), generator=g)),), generator=g)
            ids = torch.where(torch.rand(ids.shape, generator=g) < 0.5, ids % 20, ids)  # hot rows repeat
            disk.prefetch(ids)
            if step == 30:  # the best snapshot's clearing of the marks, slots and file alike, with a read ahead in flight
                for s in (mem, disk):
                    s.mark_all_touched(False)
            assert torch.equal(mem.rows(ids), disk.rows(ids))
            idx = mem.sharding.local_index(ids)
            assert torch.equal(mem.versions(idx), disk.versions(idx))
            grads = torch.randn(ids.numel(), DIM, generator=g)
            counts = torch.randint(1, 3, (ids.numel(),), generator=g)
            for s in (mem, disk):
                s.apply(ids, grads, unique=False, counts=counts)
            disk.prefetch(prev)  # reads ahead whose copies may go stale before they are used
            prev = ids
            uniq = torch.unique(ids)
            if step % 3 == 0:  # the fixed-size update: distinct rows, some masked out
                mask = torch.rand(uniq.shape, generator=g) < 0.6
                g2 = torch.randn(uniq.numel(), DIM, generator=g) * mask[:, None]
                for s in (mem, disk):
                    s.apply_masked(s.sharding.local_index(uniq), g2, mask, zero_outside=True)
            if step % 5 == 0:  # rows put back by a holder, with state and updates
                rows = torch.randn(uniq.numel(), DIM, generator=g).to(dtype)
                state = torch.rand(uniq.numel(), mem.state_width, generator=g) if mem.state_width else None
                for s in (mem, disk):
                    s.put(uniq, rows, state, torch.ones_like(uniq))
                if mem.state_width:
                    assert torch.equal(mem.state_rows(uniq), disk.state_rows(uniq))
            if step == 20:  # a direct read (a save): the changed rows written back, the slots kept
                held = disk._slots_n - disk._nfree
                with disk.raw(write=False):
                    assert torch.equal(mem.weight, disk.weight)
                assert disk._slots_n - disk._nfree == held and not disk._dirty.any()
            if step == 40:  # a direct write (a load): the slots forgotten, the file is the truth
                for s in (mem, disk):
                    with s.raw(write=True):
                        s.weight[5:9] = 0.25
                        s.version[5:9] += 7
                assert disk._nfree == disk._slots_n
        c = disk.counts
        assert c["evicted"] > 0 and c["written"] > 0 and c["bypassed"] > 0 and 0 < c["hit"] < c["used"], c
        logc = disk._log.counts
        assert c["from_log"] > 0 and logc["merges"] > 2 and logc["merged"] > 0, (c, logc)  # rows came back from the log
        assert (logc["beside"] > 2) == reader.startswith("ring"), logc  # the merges ran beside the calls where the ring reads
        assert 0 < c["staged"] < c["loaded"], c  # ... and from the reads ahead's copies, but for the stale ones
        assert c["emptied"] == 0  # no call above read the arrays behind the cache's back
        with disk.raw(write=False):
            assert torch.equal(mem.weight, disk.weight)
            assert torch.equal(mem.version, disk.version)
            assert torch.equal(mem.touched, disk.touched)
            if mem.optimizer.state is not None:
                assert torch.equal(mem.optimizer.state, disk.optimizer.state)
        assert disk.weight.dtype == dtype and disk.counts["emptied"] == 1  # outside raw(): emptied first
    finally:
        tier.close()


def test_the_cache_is_sized_by_its_bytes_and_its_map():
    """One map holds both the slots and the log's records: direct (4 B per row of the shard) when
    the log holds 1/4 of the rows, which it does while 4 B per row fits in a quarter of the
    budget; else hash cells for the slots and a log sized to a quarter of the budget."""
    assert log_rows(1_000_000, 16_000_000) == 250_000 and map_bytes(1_000_000, 250_000, "cpu") == 4_000_000
    assert buffer_slots(30_000_000, 77, 1_000_000) == (30_000_000 - 4_000_000) // (77 + SLOT_BOOK_BYTES)
    log = log_rows(1_000_000, 10_000_000)  # 4 MB is more than a quarter: a log of <= 2.5 MB of cells
    assert 1 < log < 62_500 and map_bytes(1_000_000, 2 * log, "cpu") <= 2_500_000 < map_bytes(1_000_000, 2 * log + 2, "cpu")
    n = buffer_slots(10_000_000, 77, 1_000_000)  # the map indexes the slots and both halves of the log
    per = 77 + SLOT_BOOK_BYTES
    assert n * per + map_bytes(1_000_000, n + 2 * log, "cpu") <= 10_000_000 < (n + 1) * per + map_bytes(1_000_000, n + 1 + 2 * log, "cpu")
    assert buffer_slots(1 << 40, 77, 1000) == 1000  # never more slots than rows
    assert buffer_slots(100, 77, 1000) == 1  # at least one


def _needs_ring() -> None:
    if uring.open_ring() is None:
        pytest.skip("io_uring is refused here (the kernel, seccomp or kernel.io_uring_disabled): no merge by pages")


def _log_of(tier: DiskTier) -> tier_log.WriteLog:
    """The tier's write-back log alone: its file's appends and merges (no store's map behind it)."""
    return tier_log.WriteLog(tier, None, lambda: None, lambda *a: None)


def _pages_patched(monkeypatch) -> list[int]:
    """The pages of each piece a merge patches through its pages alone (WriteLog._patch_pages), as it goes."""
    patched: list[int] = []
    patch = tier_log.WriteLog._patch_pages
    monkeypatch.setattr(tier_log.WriteLog, "_patch_pages", lambda t, f, s, p, r: patched.append(p.size) or patch(t, f, s, p, r))
    return patched


@pytest.mark.parametrize("rows_of", [lambda n: torch.arange(0, n, 9973),  # sparse: a piece a row
                                     lambda n: torch.arange(3000, 9000, 2),  # dense: sequential pieces
                                     lambda n: torch.unique(torch.randint(0, n, (4000,), generator=torch.Generator().manual_seed(1))),
                                     lambda n: torch.arange(7, n, 173)])  # one row in ~2 pages: pages, or pieces
@pytest.mark.parametrize("pages", ["by cost", "always", "never"])
def test_the_log_is_appended_and_merged_into_the_file(tmp_path, monkeypatch, rows_of, pages):
    """The tier's log: appends in pieces that start inside a page (the page's earlier records
    written again), then a merge of chosen rows into the file (every other record untouched),
    then the half emptied. pages: a piece's rows merged through their pages alone (the merge's
    ring) where they are scattered enough, always, or never (the whole piece read and written)."""
    if pages != "by cost":
        _needs_ring()
    monkeypatch.setattr(tier_log, "SCATTERED_PAGE_COST", {"by cost": tier_log.SCATTERED_PAGE_COST, "always": 0,
                                                         "never": 1 << 30}[pages])
    patched = _pages_patched(monkeypatch)
    n = 100_003
    tier = DiskTier(str(tmp_path), 0, 1 << 16)
    try:
        tier.define(n, [("weight", (5,), torch.float32), ("version", (), torch.int64), ("touched", (), torch.bool)],
                    log_rows=9_000)
        log = _log_of(tier)
        weight = tier.alloc("weight", (n, 5), torch.float32)
        weight[:] = torch.arange(n, dtype=torch.float32)[:, None]
        rows = rows_of(n)
        vals = torch.randn(rows.numel(), 5)
        first = [log.append_records({"weight": vals[lo:lo + 333], "version": torch.full((vals[lo:lo + 333].shape[0],), 7)})
                 for lo in range(0, rows.numel(), 333)]
        assert first == list(range(0, rows.numel(), 333)) and log.end == rows.numel()
        assert torch.equal(tier.view(tier.log_file.tensor, "weight", weight)[:rows.numel()], vals)
        at = torch.randperm(rows.numel())  # the newest record of row rows[i] is log record at[i]
        log.merge_records(rows, at)
        want = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 5)
        want[rows] = vals[at]
        assert torch.equal(weight, want)
        assert torch.equal(tier.alloc("version", (n,), torch.int64)[rows], torch.full((rows.numel(),), 7))
        if pages == "always":
            assert patched and max(patched) <= len(log._merge_buf) // tier_log.CHUNK
        elif pages == "never" or tier.merge_ring is None:
            assert not patched
        log.punch_half(0)
        log.start(0)
        assert log.end == 0 and not tier.view(tier.log_file.tensor, "weight", weight).any()
    finally:
        tier.close()


def test_a_merge_writes_scattered_rows_by_their_pages_and_dense_ones_by_pieces(tmp_path, monkeypatch):
    """By cost: one row in ~25 pages is merged through its pages alone; rows two records apart
    through whole pieces (the same bits either way: the test above)."""
    _needs_ring()
    patched = _pages_patched(monkeypatch)
    n = 100_003
    tier = DiskTier(str(tmp_path), 0, 1 << 16)
    try:
        tier.define(n, [("weight", (5,), torch.float32), ("version", (), torch.int64)], log_rows=9_000)
        log = _log_of(tier)
        weight = tier.alloc("weight", (n, 5), torch.float32)
        for rows, scattered in ((torch.arange(5, n, 2500), True), (torch.arange(3000, 9000, 2), False)):
            patched.clear()
            log.start(0)
            vals = torch.randn(rows.numel(), 5)
            log.append_records({"weight": vals, "version": torch.zeros(rows.numel(), dtype=torch.int64)})
            log.merge_records(rows, torch.arange(rows.numel()))
            assert torch.equal(weight[rows], vals)
            assert bool(patched) == scattered and sum(patched) <= 2 * rows.numel()
            log.punch_half(0)
    finally:
        tier.close()


def test_the_tier_unmaps_beside_the_step(tmp_path, monkeypatch):
    """Past its page budget a read ahead leaves the unmapping to the tier's own thread (the step
    goes on) and the records read are still right; a direct phase (release) waits for it. (The
    threads' reads: the ring maps no page.)"""
    _reader(monkeypatch, "threads")
    n = 50_000
    tier = DiskTier(str(tmp_path), 0, 16 * 4096)
    try:
        tier.define(n, [("weight", (5,), torch.float32), ("version", (), torch.int64)])
        weight = tier.alloc("weight", (n, 5), torch.float32, fill=1.0)
        weight[::7] = 3.0
        tier.reseal()  # written through the mapping: the sums made current
        rows = torch.arange(0, n, 97)
        got = []
        for lo in (0, 100, 200, 300):  # each read ahead maps ~100 pages: past the budget of 16
            got += tier.prefetch(rows[lo:lo + 100])
            assert tier._unmapping is not None or lo == 0
        tier.ready()
        records = torch.cat([f.result() for f in got])
        want = torch.where((rows[:records.shape[0]] % 7 == 0)[:, None], 3.0, 1.0).repeat(1, 5)
        assert torch.equal(tier.view(records, "weight", weight), want)
        assert tier.stats.evicted > 0
        tier.release()
        assert tier._unmapping is None and tier.mapped_bytes == 0 and not tier.file.mapped.any()
    finally:
        tier.close()


def test_the_ring_reads_records_as_the_mapping_holds_them(tmp_path):
    """uring.Ring: thousands of records at random places, more than the ring holds in flight, equal
    the file's, from one file or from two in one stream; a read past the end is an error, not
    zeros."""
    ring = uring.open_ring(64)
    if ring is None:
        pytest.skip("io_uring is refused here (the kernel, seccomp or kernel.io_uring_disabled): the threads read")
    try:
        data = torch.randint(0, 256, (20_000, 80), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
        path = tmp_path / "records.bin"
        path.write_bytes(data.numpy().tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            rows = torch.randint(0, 20_000, (3_000,), generator=torch.Generator().manual_seed(3)).numpy()
            out = torch.empty(rows.size, 80, dtype=torch.uint8)
            ring.read(fd, rows * 80, 80, out.data_ptr())
            assert torch.equal(out, data[torch.from_numpy(rows)])
            past = rows[:200] * 80
            past[7] = 20_000 * 80  # one read past the end among many: the error, once the others are done
            with pytest.raises(OSError, match="0 of 80 bytes"):
                ring.read(fd, past, 80, out.data_ptr(), str(path))
            ring.read(fd, rows * 80, 80, out.data_ptr())  # the ring is whole after it
            assert torch.equal(out, data[torch.from_numpy(rows)])
            other = tmp_path / "other.bin"  # one stream of reads from two files (tier.prefetch_both)
            other.write_bytes(data.flip(0).numpy().tobytes())
            fd2 = os.open(other, os.O_RDONLY)
            try:
                fds = np.where(np.arange(rows.size) % 3 == 0, fd2, fd).astype(np.int32)
                ring.read(fds, rows * 80, 80, out.data_ptr())
                want = torch.where(torch.from_numpy(fds == fd2)[:, None], data.flip(0)[torch.from_numpy(rows)],
                                   data[torch.from_numpy(rows)])
                assert torch.equal(out, want)
            finally:
                os.close(fd2)
        finally:
            os.close(fd)
    finally:
        ring.close()


def test_a_merge_keeps_the_copies_it_leaves_good():
    """ReadAheadCopies.merged: a copy of the record a merge wrote into the file is the file's now;
    copies of other records of merged rows, and copies read from the half merged (emptied), never
    match; copies read from the other half stay."""
    from concurrent.futures import Future

    from trainer.sparse.embedding.store.tier.readahead import ReadAheadCopies
    from trainer.sparse.embedding.store.tier.writelog import code

    done = Future()
    done.set_result(torch.arange(24, dtype=torch.uint8).view(6, 4))
    copies = ReadAheadCopies(4)
    rows = torch.tensor([1, 2, 3, 4, 5, 6])
    # 1: the file's (not merged); 2: the half's newest (merged); 3: an older record (merged from a
    # newer one); 4: the file's, the row appended since (merged); 5: the half's, its row now in a
    # slot; 6: the other half's (records 10..19)
    where = torch.tensor([-1, *code(torch.tensor([0, 1])).tolist(), -1, *code(torch.tensor([2, 14])).tolist()])
    copies.add(rows, where, [done])
    copies.merged(torch.tensor([2, 3, 4]), code(torch.tensor([0, 7, 9])), (0, 10))
    got, recs = copies.take(rows, torch.tensor([-1, -1, -1, -1, -1, int(code(torch.tensor(14)))]))
    assert got.tolist() == [0, 1, 5] and torch.equal(recs, done.result()[[0, 1, 5]])
    got, _ = copies.take(rows, where)  # the half's records are reused after a merge; 4's file record changed
    assert got.tolist() == [0, 5]


def test_the_eviction_keeps_rows_used_in_two_steps(tmp_path, monkeypatch):
    """LRU-2: rows read in one step only since they were loaded go before rows read in two, even
    when the latter were read less recently (plain LRU would evict those first)."""
    _reader(monkeypatch, "threads")
    mem, disk, tier = _stores(tmp_path, "sgd", torch.float32, 6000)
    try:
        s = disk._slots_n
        twice, once = torch.arange(0, 16), torch.arange(100, 116)
        fresh = torch.arange(200, 200 + s - 32 + 8)  # 8 rows more than the free slots
        for rows in (twice, twice, once, fresh):  # each a step's read
            assert torch.equal(disk.local_rows(rows), mem.local_rows(rows))
        held = lambda rows: (disk._map.lookup(rows)[0] >= 0)
        assert held(twice).all() and held(fresh).all() and int(held(once).sum()) == 8, (s, held(once))
    finally:
        tier.close()


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile"))


def test_rows_read_without_a_read_ahead_leave_no_pages_in_the_process(tmp_path, monkeypatch):
    """An evaluation reads rows no read ahead asked for: they are read as copies through the ring,
    so the pages of a 16 MB file do not pile up in the process (they were faulted in on the
    caller's thread, and nothing unmapped them: the RSS grew by the whole file). (The threads'
    reads map pages, within the page budget and the kernel's fault-around: not measured here.)"""
    _reader(monkeypatch, "ring")
    args = (RowSharding([100_000, 100_000], 1, 0), 16, 3, None, "rowwise_adagrad", 0.05, 1e-8, torch.device("cpu"),
            0.1, 0.0, torch.float32, Rounding("stochastic", 3))
    tier = DiskTier(str(tmp_path), 0, 1 << 16)
    disk = TieredStore(*args, tier=tier, buffer_bytes=1 << 20)
    mem = ShardStore(*args)
    try:
        assert tier.file.nbytes >= 16_000_000
        g = torch.Generator().manual_seed(0)
        for _ in range(3):  # the code these calls run is mapped in too: first
            disk.local_rows(torch.randint(0, 200_000, (500,), generator=g))
        before = _rss_file()
        for _ in range(40):
            idx = torch.randint(0, 200_000, (500,), generator=g)
            assert torch.equal(disk.local_rows(idx), mem.local_rows(idx))
        grown = _rss_file() - before
        assert grown < 4 << 20, f"the process holds {grown / 1e6:.1f} MB more of files after reading rows"
    finally:
        tier.close()
