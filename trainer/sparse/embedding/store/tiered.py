"""embedding.store=disk: the owner's shard in files (tier/disk.py) with a row buffer in RAM in front
(RAM rows in slots; "cache" names HET's cache, ../cache/; the config key, embedding.store_cache_bytes,
and summary.json's cache_* keys keep their names).

Why a row buffer: hot ids are scattered over a table, so caching the files' pages keeps ~50 cold
neighbours in RAM with every hot row and writes back 4 KiB for every 80 B row updated (measured:
0.05 of the in-memory step rate). Here the RAM holds whole rows, by id, in slots (FBGEMM's and
HierarchicalKV's design): a row's values, optimizer state, version and touched mark.

- **One writable copy of each row**, in a slot, else the newest log record, else the file: a
  slot is loaded when the row is first used (read or written) and appended to the log (when
  changed) as it is evicted. Every read and update goes through the slot when there is one and
  through the file otherwise (when a single call wants more rows than the buffer can give it; the
  log merged first), with the very same arithmetic (store.py's _update, _update_masked, _put): a row's
  updates are elementwise and its duplicate gradients are summed in the same order, so `disk`
  equals `memory` bit for bit.
- **Eviction**: LRU-2: the rows whose use before their last, in an earlier step, is the oldest go
  first (a row used in one step only since it was loaded, first of all), then the least recently
  used; never a row of the call being served; in batches of 1/32 of the slots at once. A
  selection over all slots keeps the smallest keys it saw, and the next evictions choose among
  those and the rows loaded since while that is exact (lru2.py). At Zipf 1.1 and a buffer of 13% of the rows, a simulation
  of the bench workload loads 0.25 of a step's distinct rows with it, 0.29 with LRU.
- **Write-back through a log**: an evicted row that changed is appended to the tier's log (whole
  pages straight to the disk, nothing read first) instead of being written in place (a random
  page read and write per 80 B row: that capped the rate near 0.3 of memory). The one map
  `_map` says where a row's newest copy is: its slot (>= 0), its log record r (-2 - r, `writelog.code`),
  or the file (absent); a load reads the log's record (and marks the slot changed: the record is
  forgotten at the next merge). Each half of the log is merged into the file (rows sorted,
  sequential pieces) when full, beside the steps where the tier can (writelog.py); the whole log
  before a call the file serves and before a direct phase, which then writes the changed slots in
  place.
- **Reads ahead**: `prefetch` gets the coming step's rows that no slot holds; the tier's threads
  gather their records (from the file or the log) and the copies are kept (readahead.py, the
  last STAGED_CALLS reads ahead): a load takes a row's copy when it was read from where the row's
  newest record still is and the files have not changed in place since (`_changed`), else reads
  the record itself.
- **Direct phases**: checkpoints, snapshots and whole-table gathers index the shard's arrays
  (`weight`, `version`, `touched`, the optimizer's state), which are the tier's files, not the
  slots. Inside `raw(write)` the changed rows are written back first (the log merged into the
  file, then the changed slots in place), and after a write phase the slots are forgotten (the
  file may hold newer records than they do); outside it, any access to those attributes empties
  the buffer first (always correct, only slower).
- **Cost per slot**: the row's bytes (values + state + 8 B version + 1 B mark) + 19 B (row, last
  two uses, changed, ~1.25 B of LRU-2's kept slots) + the map (slotmap.py: 4 B per row of the shard when the log holds 1/4 of the
  rows, else hash cells for the slots and the log's records; buffer_slots, log_rows).
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Iterator

import torch

import kernels
from ....base.core.progress import fmt_bytes, say_if_slow
from ..optim import SparseOptimizer
from .lru2 import SlotUses
from .tier.readahead import ReadAheadCopies
from ..cache.slotmap import DIRECT_IDS_PER_SLOT, id_slot_map, map_bytes
from .shard import ShardStore, _put, _update, _update_masked
from .tier.disk import DiskTier
from .tier.writelog import WriteLog, code

EVICT_BATCH = 32  # an eviction frees at least 1/EVICT_BATCH of the slots
SLOT_BOOK_BYTES = 8 + 4 + 4 + 1 + 2  # per slot: its row, its last use and the one before, changed, LRU-2's kept slots (lru2.py)
LOG_SHARE = 4  # each half of the write-back log holds at most 1/LOG_SHARE of the shard's rows (on disk)
STAGED_CALLS = 2  # the copies of the last two reads ahead are kept (readahead.py)
LOG_INDEX_SHARE = 4  # ... while a direct map for them fits in 1/LOG_INDEX_SHARE of the row buffer's bytes
FLUSH_ROWS = 1 << 18  # changed slots copied out and written back at a time (~20 MB at d = 16)


def record_fields(dim: int, dtype: torch.dtype, optimizer: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The parts of a row's record in the tier's file (DiskTier.define)."""
    acc = kernels.reference.accumulation_dtype(dtype)
    state = {"adagrad": (dim,), "rowwise_adagrad": ()}.get(optimizer)
    return [("weight", (dim,), dtype)] + ([("state", state, acc)] if state is not None else []) + \
        [("version", (), torch.int64), ("touched", (), torch.bool)]


def log_rows(local_rows: int, budget: int) -> int:
    """Records of each half of the write-back log of a shard of local_rows rows behind a row buffer
    of `budget` bytes: 1/LOG_SHARE of the rows when their index, a direct map (4 B per row), fits in
    1/LOG_INDEX_SHARE of the budget; else as many as a hash index of that size holds for both
    halves (at least one)."""
    room, most = budget // LOG_INDEX_SHARE, max(1, -(-local_rows // LOG_SHARE))
    if map_bytes(local_rows, 2 * most, "cpu") <= room:
        return most
    lo, hi = 1, max(1, (-(-local_rows // DIRECT_IDS_PER_SLOT) - 1) // 2)  # the hash map's range
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if map_bytes(local_rows, 2 * mid, "cpu") <= room else (lo, mid - 1)
    return lo


def buffer_slots(budget: int, row_bytes: int, local_rows: int) -> int:
    """Slots a row buffer of `budget` bytes holds for a shard of local_rows rows of row_bytes each
    (the record's parts): with their bookkeeping and the one map of slots and log records
    (log_rows) counted; never more than the rows, at least one."""
    per, log = row_bytes + SLOT_BOOK_BYTES, log_rows(local_rows, budget)
    lo, hi = 1, max(1, min(budget // per, local_rows))  # the most slots whose map fits too
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mid * per + map_bytes(local_rows, mid + 2 * log, "cpu") <= budget else (lo, mid - 1)
    return int(lo)


PARTS = ("weight", "state", "version", "touched")  # a record's fields, in _buffered's order


def _pick(t: torch.Tensor | None, at: torch.Tensor | None) -> torch.Tensor | None:
    """t's rows at positions `at` (None: all of them, as they are)."""
    return t if t is None or at is None else t.index_select(0, at)


def _distinct(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sorted distinct rows, the inverse: None where idx is them already, as a step's owned rows
    are: one comparison instead of a sort)."""
    if idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all()):
        return idx, None
    return torch.unique(idx, return_inverse=True)


class TieredStore(ShardStore):
    """A ShardStore whose arrays are the tier's files, with `buffer_bytes` of rows in RAM in front
    (the row buffer: slots)."""

    def __init__(self, *args, tier: DiskTier, buffer_bytes: int, **kw) -> None:
        self._slots_n = 0  # no buffer until it is built (ShardStore's init writes the files)
        a = inspect.signature(ShardStore.__init__).bind(self, *args, **kw)
        a.apply_defaults()
        p = a.arguments
        local = p["sharding"].local_rows
        t0 = time.monotonic()
        tier.define(local, record_fields(p["dim"], p["dtype"], p["optimizer"]), log_rows(local, buffer_bytes))
        super().__init__(*args, tier=tier, **kw)
        say_if_slow(t0, lambda took: f"embedding.store=disk: rank {p['sharding'].rank}'s shard, {local:,} rows "
                                     f"({fmt_bytes(tier.disk_bytes())} of files in {tier.dir}), set up in {took:.0f} s")
        self._build(buffer_slots(buffer_bytes, self.bytes_per_row()["total"] + 1, local))

    def _build(self, n: int) -> None:
        self._slots_n = n
        opt = self.optimizer
        self._w = torch.zeros(n, self.dim, dtype=self.dtype)
        self._opt = SparseOptimizer(opt.name, self._w, opt.lr, opt.eps, opt.init, opt.weight_decay,
                                    lambda s: self.row_keys(self._rid.index_select(0, s)), self.rounding)
        self._v = torch.zeros(n, dtype=torch.int64)
        self._t = torch.zeros(n, dtype=torch.bool)
        self._rid = torch.full((n,), -1, dtype=torch.int64)  # the storage row in each slot (-1: free)
        self._uses = SlotUses(n)  # LRU-2 (lru2.py)
        self._dirty = torch.zeros(n, dtype=torch.bool)
        self._free = torch.arange(n - 1, -1, -1, dtype=torch.int64)  # a stack: [:_nfree] are free
        self._nfree = n
        self._map = id_slot_map(self.sharding.local_rows, n + 2 * self.tier.log_rows, "cpu")  # slot, or writelog.code
        self._copies = ReadAheadCopies(self.tier.file.row_bytes, STAGED_CALLS)  # the reads ahead's records
        self._log = WriteLog(self.tier, self._map, self._changed, self._copies.merged)
        self._memo = None  # (call, its rows, their slots, distinct rows) of the last call that loaded them all
        self._in_raw = False
        self._unsealed = False  # the file was written through the mapping: its sums are stale (tier/seal.py)
        self.counts = {"used": 0, "hit": 0, "loaded": 0, "staged": 0, "from_log": 0, "written": 0, "evicted": 0, "bypassed": 0,
                       "emptied": 0, "forgotten": 0}

    # ---- the files changing ------------------------------------------------------------------
    def _changed(self) -> None:
        """Records of the file or the log may change in place: the reads ahead's copies are stale."""
        self._copies.changed()

    # ---- the slots -------------------------------------------------------------------------
    def _at(self, idx: torch.Tensor) -> torch.Tensor:
        """[n] slots of storage rows idx, loading the rows no slot holds (evicting the least
        recently used); -1 for those the buffer cannot take in this call (more than it holds)."""
        self._sealed()
        call = self._uses.new_call()
        if self._same_rows(idx, call):
            return self._memo[2]
        uniq, inv = _distinct(idx)
        where, _ = self._map.lookup(uniq)  # a slot, a log record's code, or -1: the file
        held = where >= 0
        slots = torch.where(held, where, -1)
        self._uses.touch(where[held])
        gone = torch.nonzero(~held).squeeze(1)
        self.counts["used"] += uniq.numel()
        self.counts["hit"] += uniq.numel() - gone.numel()
        k = 0
        if gone.numel():
            got = self._take(gone.numel())
            k = got.numel()
            if k:  # where again: the evictions may have merged the log
                rows = uniq.index_select(0, gone[:k])
                self._load(rows, got, self._map.lookup(rows)[0])
                slots.index_copy_(0, gone[:k], got)
            self.counts["bypassed"] += gone.numel() - k
        slots = slots if inv is None else slots.index_select(0, inv)
        self._memo = (call, idx.clone(), slots, uniq.numel()) if k == gone.numel() else None
        return slots

    def _same_rows(self, idx: torch.Tensor, call: int) -> bool:
        """Whether idx are the rows of the call just before, which left every one in a slot (a
        step's update after its lookup): that call's slots still hold them (only a call loads or
        evicts), and they need no touch: no other slot was used in between, so the order of all
        the slots' uses is what the touch would leave. Counted as the hits they are."""
        memo = self._memo
        if memo is None or memo[0] != call - 1 or memo[0] <= self._uses.step_call or not torch.equal(memo[1], idx):
            return False  # (a call of a later step touches the slots: their uses become the uses before)
        self._memo = (call,) + memo[1:]
        self.counts["used"] += memo[3]
        self.counts["hit"] += memo[3]
        return True

    def _take(self, n: int) -> torch.Tensor:
        """Up to n free slots, evicting first when fewer are free."""
        if self._nfree < n:
            self._evict(max(n - self._nfree, self._slots_n // EVICT_BATCH))
        k = min(n, self._nfree)
        got = self._free[self._nfree - k:self._nfree].clone()
        self._nfree -= k
        return got

    def _evict(self, n: int) -> None:
        """Free n slots held, by LRU-2 (lru2.py; never one used in this call)."""
        cand = self._uses.victims(self._rid.numpy(), n)
        if cand.size == 0:
            return
        victims = torch.from_numpy(cand)
        changed = self._dirty.index_select(0, victims)
        self._append(victims[changed])  # the log will (first: a full disk changes nothing)
        self._map.erase(self._rid.index_select(0, victims[~changed]))  # the file has them
        self._rid.index_fill_(0, victims, -1)
        self._free[self._nfree:self._nfree + victims.numel()] = victims
        self._nfree += victims.numel()
        self.counts["evicted"] += victims.numel()

    def _append(self, slots: torch.Tensor) -> None:
        """Changed slots' rows, evicted, appended to the write-back log (writelog.py)."""
        if slots.numel():
            self._log.append(self._rid.index_select(0, slots), self._parts(slots))
            self._dirty.index_fill_(0, slots, False)
            self.counts["written"] += slots.numel()

    def _load(self, rows: torch.Tensor, slots: torch.Tensor, where: torch.Tensor) -> None:
        """Sorted storage rows (the file in order) into free slots, each from its newest record:
        the log's (where: its code) or the file's (where: -1): the copy a read ahead made of it
        when there is one still valid, else the record itself. A row read from the log is marked
        changed: it goes back to the log when evicted (its record there is about to be forgotten)."""
        self.tier.ready()
        new = where <= -2
        got, copies = self._copies.take(rows, where)
        todo = torch.ones(rows.numel(), dtype=torch.bool).index_fill_(0, got, False)
        recs = torch.empty(rows.numel(), self.tier.file.row_bytes, dtype=torch.uint8).index_copy_(0, got, copies)
        if got.numel() < rows.numel():  # the rest from the records themselves
            i = torch.nonzero(todo).squeeze(1)
            recs.index_copy_(0, i, self.tier.read(rows.index_select(0, i), code(where.index_select(0, i)),
                                                  new.index_select(0, i)))
        self.counts["staged"] += got.numel()
        for name, ram, file in zip(PARTS, self._buffered(), self._files()):
            if file is not None:
                ram.index_copy_(0, slots, self.tier.view(recs, name, file))
        self._rid.index_copy_(0, slots, rows)
        self._map.insert(rows, slots)
        self._uses.loaded(slots)
        self._dirty.index_copy_(0, slots, new)
        self.counts["from_log"] += int(new.sum())
        self.counts["loaded"] += rows.numel()

    def _parts(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """{field: values} of slots' rows, the record's fields the shard has."""
        return {n: c.index_select(0, slots) for n, c, f in zip(PARTS, self._buffered(), self._files()) if f is not None}

    def _buffered(self) -> tuple:
        """The slots' arrays: values, optimizer state (None for SGD), versions, touched marks."""
        return self._w, self._opt.state, self._v, self._t

    def _files(self) -> tuple:
        """The file's arrays, in _buffered's order (not the properties: no emptying)."""
        d = self.__dict__
        return d["_weight"], self.optimizer.state, d["_version"], d["_touched"]

    def _split(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(slots, positions held by a slot (None: all), positions the files serve) of storage
        rows idx."""
        slots = self._at(idx)
        held = slots >= 0
        cold = torch.nonzero(~held).squeeze(1)
        if cold.numel() == 0:
            return slots, None, cold
        self._log.merge()  # the file serves these rows: it must hold their newest records
        self._changed()  # ... and may change them in place
        return slots, torch.nonzero(held).squeeze(1), cold

    def _sync_rate(self) -> SparseOptimizer:
        self._opt.lr, self._opt.lr_on_device = self.optimizer.lr, self.optimizer.lr_on_device
        return self._opt

    # ---- direct access to the files' arrays --------------------------------------------------
    def _direct(name: str):  # noqa: N805 (a property factory for the class body)
        def get(self):
            if self._slots_n and not self._in_raw:
                self._empty()
                self._unsealed = True  # the caller may write the file through it
            return self.__dict__["_" + name]

        def put(self, value):
            self.__dict__["_" + name] = value
        return property(get, put)

    weight = _direct("weight")
    version = _direct("version")
    touched = _direct("touched")
    del _direct

    def _sealed(self) -> None:
        """Before the file is read again: its records' sums made current where it was written
        through the mapping (a direct write phase, or its arrays handed out outside one)."""
        if self._unsealed:
            self._unsealed = False
            self.tier.reseal()

    @contextlib.contextmanager
    def raw(self, write: bool) -> Iterator[None]:
        self._sealed()
        self._flush()
        self._unsealed |= write  # written through the mapping from now on: resealed before a read (_sealed)
        outer, self._in_raw = self._in_raw, True  # phases may nest
        self.tier.sequential(True)  # a phase reads or writes the shard in order
        try:
            yield
        finally:
            self._in_raw = outer
            self.tier.sequential(outer)
            if write:
                self._changed()
                self._unsealed = True
                if self._nfree < self._slots_n:
                    self._forget()
                    self.counts["forgotten"] += 1

    def _empty(self) -> None:
        """Write every changed row back and forget every slot (the files are then the shard)."""
        if self._nfree == self._slots_n and self._log.empty:
            return
        self._flush()
        self._forget()
        self.counts["emptied"] += 1

    def _flush(self) -> None:
        """Make the file the shard: the log merged into it, then the changed slots written in
        place (sorted by row, in sequential pieces: tier/disk.py; FLUSH_ROWS of them copied out at a
        time); the slots stay, unchanged now."""
        self._log.merge()
        self._changed()  # the file is written in place
        slots = torch.nonzero(self._dirty).squeeze(1)
        if slots.numel():
            rows, order = torch.sort(self._rid.index_select(0, slots))
            slots = slots.index_select(0, order)
            for lo in range(0, rows.numel(), FLUSH_ROWS):
                self.tier.write(rows[lo:lo + FLUSH_ROWS], self._parts(slots[lo:lo + FLUSH_ROWS]))
            self._dirty.zero_()
            self.counts["written"] += slots.numel()

    def _forget(self) -> None:
        """Free every slot (some are held; their changes are in the file) and drop the log (merged
        already, or older than what was just written into the file)."""
        self._changed()
        self._memo = None
        self._uses.forget()
        self._map.erase(self._rid[self._rid >= 0])
        self._rid.fill_(-1)
        self._dirty.zero_()
        self._free = torch.arange(self._slots_n - 1, -1, -1, dtype=torch.int64)
        self._nfree = self._slots_n
        self._log.drop()

    # ---- the shard's interface -------------------------------------------------------------
    def tick(self, step: int) -> None:
        self._log.poll()
        self.tier.tick(step)

    def ready(self) -> None:
        self.tier.ready()

    def release(self) -> None:
        self.tier.release()

    def prefetch(self, gids: torch.Tensor) -> None:
        if gids.numel():
            self.prefetch_local(self.sharding.local_index(gids))

    def prefetch_local(self, local_idx: torch.Tensor) -> None:
        if local_idx.numel():
            self._sealed()
            uniq = _distinct(local_idx)[0]
            where, _ = self._map.lookup(uniq)
            inlog, infile = where <= -2, where == -1
            futures = self.tier.prefetch_both(code(where[inlog]), uniq[infile])
            self._copies.add(torch.cat([uniq[inlog], uniq[infile]]), torch.cat([where[inlog], where[infile]]), futures)

    def _gather(self, idx: torch.Tensor, part: int) -> torch.Tensor:
        """Values of storage rows idx of one part (_buffered's order) from the slots or the file."""
        ram, file = self._buffered()[part], self._files()[part]
        slots, held, cold = self._split(idx)
        if held is None:
            return ram.index_select(0, slots)
        out = torch.empty((idx.numel(),) + tuple(ram.shape[1:]), dtype=ram.dtype)
        out.index_copy_(0, held, ram.index_select(0, slots.index_select(0, held)))
        if cold.numel():  # their records read as copies (tier.read), not faulted in here
            rows = idx.index_select(0, cold)
            records = self.tier.read(rows, rows, torch.zeros(rows.numel(), dtype=torch.bool))
            out.index_copy_(0, cold, self.tier.view(records, PARTS[part], file))
        return out

    def local_rows(self, local_idx: torch.Tensor) -> torch.Tensor:
        self._uses.new_step()  # a step's lookup: the calls before it were earlier steps' (LRU-2)
        return self._gather(local_idx, 0)

    def versions(self, local_idx: torch.Tensor) -> torch.Tensor:
        return self._gather(local_idx, 2)

    def state_rows(self, gids: torch.Tensor) -> torch.Tensor:
        if self._opt.state is None:
            return super().state_rows(gids)
        return self._gather(self.slots(gids), 1).reshape(gids.numel(), self.state_width)

    def _change(self, idx: torch.Tensor, fn) -> None:
        """fn(optimizer, arrays (_buffered's order), rows of them, positions of idx) on the slots of
        storage rows idx (marked changed), then on the file for the rows no slot can hold."""
        slots, held, cold = self._split(idx)
        s = slots if held is None else slots.index_select(0, held)
        fn(self._sync_rate(), self._buffered(), s, held)
        self._dirty.index_fill_(0, s, True)
        if cold.numel():
            self.tier.ready()
            rows = idx.index_select(0, cold)
            self.tier.check_rows(rows)
            fn(self.optimizer, self._files(), rows, cold)
            self.tier.reseal_rows(rows)
            self.tier.release()  # the pages the update faulted in leave the process (such calls are rare)

    def apply(self, gids: torch.Tensor, grads: torch.Tensor, unique: bool = False,
              counts: torch.Tensor | None = None, lives: torch.Tensor | None = None) -> None:
        if gids.numel() == 0:
            return
        idx = self.sharding.local_index(gids)
        counts = torch.ones_like(idx) if counts is None else counts
        self._change(idx, lambda opt, a, at, i: _update(opt, a[2], a[3], at, _pick(grads, i), unique,
                                                         _pick(counts, i)))

    def apply_masked(self, idx: torch.Tensor, grads: torch.Tensor, mask: torch.Tensor,
                     zero_outside: bool = False, counts: torch.Tensor | None = None) -> None:
        self._change(idx, lambda opt, a, at, i: _update_masked(opt, a[2], a[3], at, _pick(grads, i),
                                                                _pick(mask, i), zero_outside, _pick(counts, i)))

    def put(self, gids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None = None,
            updates: torch.Tensor | None = None) -> None:
        self._change(self.slots(gids), lambda opt, a, at, i: _put(*a, at, _pick(rows, i), _pick(state, i),
                                                                  _pick(updates, i)))

    def mark_all_touched(self, value: bool) -> None:
        """The slots' marks and the file's alike: nothing to write back, nothing forgotten."""
        self._sealed()  # fill checks the records' sums
        self._log.settle()  # no merge writes the file meanwhile
        self._changed()
        self._t.fill_(value)
        self.tier.fill("touched", value)  # in sequential pieces, around the mappings (tier/records.py)
        first = self._log.starts[self._log.half]
        self.tier.fill("touched", value, log=True, lo=first, hi=first + self._log.used)

    def store_record(self) -> dict:
        c, steps, log = self.counts, max(self.tier.stats.steps, 1), self._log
        per_step = {"used": "rows_used", "loaded": "rows_read", "written": "rows_written", "from_log": "rows_read_from_log",
                    "staged": "rows_copied_ahead"}
        return {**self.tier.record(), "cache_slots": self._slots_n, "row_hit_rate": round(c["hit"] / c["used"], 4) if c["used"] else None,
                **{f"{name}_per_step": c[k] / steps for k, name in per_step.items()},
                "rows_evicted": c["evicted"], "rows_bypassed": c["bypassed"], "cache_emptied": c["emptied"],
                "cache_forgotten": c["forgotten"], "log_rows": log.capacity, "log_merges": log.counts["merges"],
                "log_merges_beside": log.counts["beside"], "log_merge_wait_s": round(log.counts["wait_s"], 4),
                "rows_merged": log.counts["merged"]}
