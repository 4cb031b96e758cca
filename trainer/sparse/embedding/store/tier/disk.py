"""embedding.store=disk: an owner's shard (rows, optimizer state, versions, touched marks) in a
file, mapped into memory (records.py: RecordFile), with the write-back log's file beside it; the
row buffer in front of it is tiered.py's, the log's appends and merges writelog.py's (WriteLog,
which reads and writes the log through this tier: its files, reads ahead and merging thread).

Why a mapped file: every path that reads or writes the shard directly (checkpoints, the best-model
snapshot, gathers of whole tables) indexes the same arrays as in memory; mapped, they are still
tensors, so those paths run the very same code. A row's parts are one record (`define`): its
values, state, version and mark side by side, so reading or writing back a row touches one page.
A fixed table's row r is record r: no per-row index in RAM.

Pages: the RAM this process holds of the file is the pages it has mapped, at most `page_bytes`
(the share of embedding.store_cache_bytes that is not rows); when a read-ahead finds that passed,
every page is unmapped at once (madvise DONTNEED, one call per file): the row buffer holds what the
steps use, a page is only needed while its rows are copied in or written back, and a dirty page
unmapped is not lost (the page cache keeps it until the kernel writes it back). The mapping is
MADV_RANDOM: a fault reads its page only, not the kernel's read-around window (hot ids are spread
over a table, so neighbours are rarely wanted).
Reads ahead: `prefetch` copies the records a coming step will touch. They are read through
io_uring where the kernel allows it (uring.py): each record straight into the copy, up to 1,024 in
flight, by one thread that waits with the GIL released, and no page mapped. Otherwise a pool of
threads reads them, each its share with one torch gather (which faults the pages in with the GIL
released), so `threads` reads are in flight. `ready` waits for them (the time counted as the
step's wait on the disk). A page never read ahead is read by a fault on the step's own thread
(counted: `sync_faults`).
The log (`log.bin`, the same records, two halves): the row buffer's changed rows appended in
whole-page writes with O_DIRECT (nothing read first, no page kept), then merged into `rows.bin` in
sequential pieces read and written the same way, beside the steps where the ring reads, on this
tier's merging thread with a ring of its own (writelog.py).
Whatever reads or writes much of the file at once (the initial rows and state, the changed slots
written back before a direct phase, a checkpoint's save and load, the snapshot's marks) goes around
the mapping too, in sequential pieces (records.py; `read_records`, `write`, `fill`).
The files are scratch: created empty (sparse: unwritten rows read zeros) for each run, removed at
exit; a checkpoint is the only copy of the model that outlives the run. Their folder names its
owner, and a killed run's is removed by the next start on that store_dir (scratch.py).
"""
from __future__ import annotations

import os
import resource
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from .records import (CHUNK, MADV_DONTNEED, MADV_RANDOM, MADV_SEQUENTIAL, RecordFile, field_view, log_records,
                      madvise, piece_buffer, record_layout)
from .scratch import ScratchDir
from .seal import FIELD as SUM_FIELD, Seal
from .uring import open_ring

LATENCY_SAMPLES = 4096  # prefetch latencies kept for the percentiles (a ring)

@dataclass
class TierStats:
    """What the tier did, summed over the run (summary.json's `store` block)."""
    steps: int = 0
    chunks_used: int = 0  # distinct chunks the steps touched
    chunks_hit: int = 0  # ... already mapped when the step's rows were known
    chunks_read: int = 0  # ... mapped by the prefetch threads (read from the page cache or the disk)
    evicted: int = 0  # chunks unmapped to keep the budget
    wait_s: float = 0.0  # time the steps waited for their prefetch
    sync_faults: int = 0  # major page faults on the training thread (reads it waited for itself)
    latencies: list = field(default_factory=list)  # seconds per prefetched run of chunks (a ring)


class DiskTier:
    """The shard's file of one rank, the pages of it held in RAM and the threads reading ahead."""

    def __init__(self, directory: Optional[str], rank: int, page_bytes: int, total_bytes: int = 0,
                 threads: int = 16) -> None:
        """page_bytes: the pages this process may hold mapped; total_bytes: the whole RAM share of
        the store (those pages and its rows: what a checkpoint's pieces are sized by)."""
        self.scratch = ScratchDir(directory or tempfile.gettempdir(), rank)
        self.rank = rank
        self.dir = self.scratch.path
        self.page_bytes = int(page_bytes)
        self.total_bytes = int(total_bytes or page_bytes)
        self.file: Optional[RecordFile] = None  # define() makes it
        self.log_file: Optional[RecordFile] = None  # the write-back log's (define's log_rows records; writelog.py)
        self.log_rows = 0  # records of each half of the log
        self._io_buf = None  # the sequential pieces' buffer (records.piece_buffer)
        self._fields: dict[str, tuple[int, int, torch.dtype]] = {}  # name -> (offset, bytes, dtype) in a record
        self.seal: Optional[Seal] = None  # each record's checksum (seal.py; define)
        self.mapped_bytes = 0
        self.stats = TierStats()
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ht-store")
        self._pending: list[Future] = []
        self._zapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ht-store-unmap")
        self._unmapping: Optional[Future] = None  # an unmapping beside the step (_evict)
        self._lock = threading.Lock()
        self._lat_n = 0
        self._io0 = _proc_io()
        self._faults0 = _thread_major_faults()
        self._ring = open_ring()  # the reads ahead's copies through io_uring (uring.py); None: the threads read them
        self._ringer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ht-store-ring") if self._ring else None
        self.reader = "io_uring" if self._ring is not None else "threads"
        self.merge_ring = open_ring(256) if self._ring is not None else None  # the merging thread's (WriteLog.merge_records_beside)
        self._merger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ht-store-merge") if self.merge_ring else None
        self._closed = False

    # ---- the files -------------------------------------------------------------------------
    def define(self, rows: int, fields: list[tuple[str, tuple[int, ...], torch.dtype]], log_rows: int = 0) -> None:
        """The shard's arrays as fields of one record per row, in one file (`rows.bin`): a row's
        values, optimizer state, version and touched mark side by side, so reading a row or writing
        one back touches one page, not one page of each array. Each field sits at an offset aligned
        to its element size, the record padded to the largest one; alloc(name) then returns the
        field's strided view. fields: (name, shape of one row's part, dtype); empty parts skipped.
        log_rows: records of each half of the write-back log (`log.bin`, the same layout;
        writelog.py). A last field, `sum`, is the record's checksum (seal.py): stamped by every
        write around the mapping, checked by every read from the disk."""
        layout, record = record_layout(list(fields) + [SUM_FIELD])
        self._fields = layout
        self.seal = Seal(record, layout[SUM_FIELD[0]][0])
        self.file = RecordFile(self.dir, "rows.bin", rows, record)
        if log_rows:
            self.log_file = RecordFile(self.dir, "log.bin", log_records(log_rows, record), record)
            self.log_rows = log_rows
        self._io_buf = piece_buffer(record)
        if not all(f.reserved for f in (self.file, self.log_file) if f is not None):
            print(f"[trainer] embedding.store_dir {os.path.dirname(self.dir)}: its file system does not reserve "
                  f"blocks (fallocate refused), so rank {self.rank}'s store files stay sparse: should that "
                  "disk fill during the run, the next write of the store stops it (exit 2) and the steps since the "
                  "last checkpoint are lost", file=sys.stderr)

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        """The view of field `name` of the records (define) as a tensor of `shape`, every element
        `fill` (0: the sparse file reads zeros, nothing written; else written in sequential pieces:
        fill)."""
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        if name not in self._fields:
            raise ValueError(f"tier: {name} is not a field of the records (define: {sorted(self._fields)})")
        off, nbytes, fdtype = self._fields[name]
        records = self.file.tensor
        if nbytes != row_bytes or fdtype != dtype or shape[0] != records.shape[0]:
            raise ValueError(f"tier: {name} {tuple(shape)} {dtype} is not its record field ({nbytes} B {fdtype})")
        tensor = field_view(records, off, nbytes, dtype, shape)
        if fill:
            self.fill(name, fill)
        return tensor

    def view(self, records: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
        """Field `name` of [n, record bytes] `records` (the file's, the log's, or copies of
        them), shaped as `like` (alloc's view of it) per row."""
        off, nbytes, dtype = self._fields[name]
        return field_view(records, off, nbytes, dtype, (records.shape[0],) + tuple(like.shape[1:]))

    def read(self, rows: torch.Tensor, at: torch.Tensor, logged: torch.Tensor) -> torch.Tensor:
        """[n, record bytes] copies of records: the log's record at[i] where logged[i], else the
        file's record rows[i]; read now as the reads ahead are (prefetch: through the ring with no
        page mapped, or by the threads with their pages counted against the budget), not by
        faults on this thread, whose pages nothing would unmap (an evaluation reads every row it
        misses this way: its RSS grew by the pages it read)."""
        out = torch.empty(rows.numel(), self.file.row_bytes, dtype=torch.uint8)
        lg, fl = torch.nonzero(logged).squeeze(1), torch.nonzero(~logged).squeeze(1)
        futures = self.prefetch_both(at.index_select(0, lg), rows.index_select(0, fl))
        self.ready()
        if futures:
            out.index_copy_(0, torch.cat([lg, fl]), torch.cat([f.result() for f in futures]))
        return out

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in (self.file, self.log_file) if f is not None)

    def sequential(self, on: bool) -> None:
        """The mappings read in order (a direct phase: a checkpoint's save or load, a snapshot): a
        fault reads ahead as the kernel does for a file read in order (MADV_SEQUENTIAL; under
        MADV_RANDOM each 4 KiB fault is one read: ~35-45 MB/s in a memory cgroup here), or each
        page by itself again (off: the steps' reads are scattered)."""
        for f in (self.file, self.log_file):
            if f is not None:
                madvise(f.addr, f.nbytes, MADV_SEQUENTIAL if on else MADV_RANDOM)

    # ---- sequential pieces (records.py) -----------------------------------------------------
    def name_of(self, t: torch.Tensor) -> str:
        """The field whose view of the file's records (alloc's) t is, [rows, ...] as alloc shaped
        it or flattened to [rows, values]; ValueError for any other tensor."""
        records = self.file.tensor
        off = t.data_ptr() - records.data_ptr()
        size = t.element_size()
        for name, (foff, nbytes, dtype) in self._fields.items():
            if foff == off and dtype == t.dtype and t.shape[0] == records.shape[0] and \
                    (t.shape[0] < 2 or t.stride(0) * size == records.shape[1]) and \
                    int(np.prod(t.shape[1:], dtype=np.int64)) * size == nbytes:
                return name
        raise ValueError(f"tier: a tensor {tuple(t.shape)} {t.dtype} at byte {off} of the records is not one of "
                         f"the file's fields ({sorted(self._fields)})")

    def read_records(self, lo: int, hi: int) -> torch.Tensor:
        """[hi - lo, record bytes] copies of the file's records lo..hi-1, read in sequential pieces
        (the changed slots must be in the file: a direct phase)."""
        f = self.file
        rec = f.row_bytes
        out = torch.empty(hi - lo, rec, dtype=torch.uint8)
        if hi <= lo:
            return out

        def copy(first: int) -> Callable[[torch.Tensor], None]:
            def take(room: torch.Tensor) -> None:
                a, b = max(lo, first), min(hi, first + room.shape[0])
                self.seal.check(room[a - first:b - first], lambda i: (f.path, a + i))
                out[a - lo:b - lo] = room[a - first:b - first]
            return take
        for base, end in f.pieces(lo, hi):
            f.rewrite(self._io_buf, base, end, copy(base // rec), write=False)
        return out

    def write(self, rows: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Records `rows` (sorted, distinct) of the file set from `parts` ({field: [n, ...]
        values}), the other fields kept: each piece of the file that holds some of them read,
        changed and written back. Nothing of the file stays mapped (what was is unmapped first: it
        is written around the mapping)."""
        if rows.numel() == 0:
            return
        self._evict()
        f = self.file
        rec = f.row_bytes
        for lo, hi, base, end in f.spans(rows.numpy() * rec):
            at = rows[lo:hi] - base // rec

            def change(room: torch.Tensor, at=at, a=lo, b=hi) -> None:
                for name, values in parts.items():
                    self.view(room, name, values).index_copy_(0, at, values[a:b])
                self.seal.stamp_rows(room, at)
            f.rewrite(self._io_buf, base, end, change)

    def fill(self, name: str, value: float, log: bool = False, lo: int = 0, hi: int | None = None) -> None:
        """Field `name` of records lo..hi-1 (default: all) of the file (of the log: `log`) set to
        `value`, in sequential pieces."""
        off, nbytes, dtype = self._fields[name]
        self._evict()  # nothing mapped while the file is written around the mapping
        f = self.log_file if log else self.file
        rec = f.row_bytes
        hi = f.tensor.shape[0] if hi is None else hi
        if hi <= lo:
            return

        def change(first: int) -> Callable[[torch.Tensor], None]:
            def put(room: torch.Tensor) -> None:
                a, b = max(lo, first) - first, min(hi, first + room.shape[0]) - first
                self.seal.check(room[a:b], lambda i: (f.path, first + a + i))  # a fault is never sealed over
                room[a:b, off:off + nbytes].view(dtype).fill_(value)
                self.seal.stamp(room[a:b])
            return put
        for base, end in f.pieces(lo, hi):
            f.rewrite(self._io_buf, base, end, change(base // rec))

    # ---- the records' checksums (seal.py) -----------------------------------------------------
    def reseal(self) -> int:
        """Every record of the file given the sum of its bytes as they are now, after a phase that
        wrote it through the mapping (what it changed is not known here): read in sequential
        pieces, and only a piece with a record whose sum changed written back. Returns the records
        resealed."""
        self._evict()  # nothing mapped while the file is written around the mapping
        f, n = self.file, self.file.tensor.shape[0]
        done = 0

        def stamp(room: torch.Tensor) -> bool:
            nonlocal done
            bad = self.seal.bad(room)
            self.seal.stamp_rows(room, bad)
            done += bad.numel()
            return bad.numel() > 0
        for base, end in f.pieces(0, n):
            f.rewrite(self._io_buf, base, end, stamp, write=None)
        return done

    def check_rows(self, rows: torch.Tensor) -> None:
        """StoreCorrupt unless the file's records `rows` carry their sums (read through the
        mapping: rows about to be changed there)."""
        self.seal.check(self.file.tensor.index_select(0, rows), lambda i: (self.file.path, int(rows[i])))

    def reseal_rows(self, rows: torch.Tensor) -> None:
        """The file's records `rows` given their sums, through the mapping (rows just changed there)."""
        self.seal.stamp_rows(self.file.tensor, rows)

    # ---- for the write-back log (writelog.py) ------------------------------------------------
    def beside(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) on the merging thread (there only where the tier reads through io_uring:
        `merge_ring` is its ring), the steps going on."""
        return self._merger.submit(fn, *args)

    def drop_log(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) of the log given back (a half merged into the file): the reads in flight
        finish first (they may be reading it), then a hole is punched (its pages leave the page
        cache unwritten and the next appends read nothing back) and its pages are no longer held."""
        self.ready()
        f = self.log_file
        f.punch(lo, hi)
        pages = slice(lo // CHUNK, -(-hi // CHUNK))
        self.mapped_bytes -= int(f.mapped[pages].sum()) * CHUNK
        f.mapped[pages] = False

    # ---- the pages in RAM, the reads ahead----------------------------------------------------
    def tick(self, step: int) -> None:
        """A new step (its count is the per-step figures' denominator)."""
        self.stats.steps += 1

    def prefetch(self, local_rows: torch.Tensor, log: bool = False) -> list[Future]:
        """Copies of records of this shard's file (of the log: `log`) a coming step reads: the
        futures returned give them, [n, record bytes] in the rows' order (a copy, not the page: a
        page read ahead may be reclaimed before it is used). Where the kernel has io_uring, one
        future, read through the ring with no page mapped (_ring_read); else the threads read them
        (each thread one share, with one torch gather, which faults their pages in with the GIL
        released: `threads` reads in flight)."""
        rows = local_rows.detach().cpu().numpy().astype(np.int64, copy=False)
        if rows.size == 0:
            return []
        if self._ring is not None:
            return [self._ring_read([(self.log_file if log else self.file, rows)])]
        if self.mapped_bytes > self.page_bytes:
            self._evict(wait=False)
        f = self.log_file if log else self.file
        chunks = f.chunks_of(rows)
        cold = chunks[~f.mapped[chunks]]
        self.stats.chunks_used += chunks.size
        self.stats.chunks_hit += chunks.size - cold.size
        if cold.size:
            f.mapped[cold] = True
            self.mapped_bytes += cold.size * CHUNK
            self.stats.chunks_read += cold.size
        part = -(-rows.size // self.threads)
        futures = [self._pool.submit(self._touch, f, torch.from_numpy(rows[lo:lo + part]))
                   for lo in range(0, rows.size, part)]
        self._pending.extend(futures)
        return futures

    def prefetch_both(self, log_records: torch.Tensor, file_rows: torch.Tensor) -> list[Future]:
        """prefetch of records of the log, then of the file: the futures give them in that order.
        Through the ring, one stream of reads (a batch's last reads, few in flight, then overlap
        the next's first: no lull of the device between the two)."""
        if self._ring is None:
            return self.prefetch(log_records, log=True) + self.prefetch(file_rows)
        parts = [(f, r.detach().cpu().numpy().astype(np.int64, copy=False)) for f, r in
                 ((self.log_file, log_records), (self.file, file_rows)) if r.numel()]
        return [self._ring_read(parts)] if parts else []

    def _ring_read(self, parts: list[tuple[RecordFile, np.ndarray]]) -> Future:
        """[n, record bytes] copies of records `rows` of each (f, rows) of parts (files of the same
        records), one after the other, read through the ring by its thread (no page mapped:
        nothing to unmap, nothing counted against the page budget)."""
        rec = parts[0][0].row_bytes
        out = torch.empty(sum(rows.size for _, rows in parts), rec, dtype=torch.uint8)
        offsets = np.concatenate([rows * rec for _, rows in parts])  # new: the caller's ids may change once this returns
        fds = parts[0][0].read_fd if len(parts) == 1 else \
            np.repeat(np.array([f.read_fd for f, _ in parts], dtype=np.int32), [rows.size for _, rows in parts])
        path = " and ".join(f.path for f, _ in parts)

        def read() -> torch.Tensor:
            t0 = time.perf_counter()
            self._ring.read(fds, offsets, rec, out.data_ptr(), path)
            self._latency(time.perf_counter() - t0)
            self.seal.check(out, lambda i: _which(parts, i))
            return out
        fut = self._ringer.submit(read)
        self._pending.append(fut)
        return fut

    def ready(self) -> None:
        """Wait for the reads in flight (the step is about to copy the rows)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()
        self.stats.wait_s += time.perf_counter() - t0

    def _touch(self, f: RecordFile, rows: torch.Tensor) -> torch.Tensor:
        """Read file f's records `rows` through its mapping (a thread of the pool), timing the
        read; the copy, its checksums checked."""
        t0 = time.perf_counter()
        got = f.tensor.index_select(0, rows)
        self._latency(time.perf_counter() - t0)
        self.seal.check(got, lambda i: (f.path, int(rows[i])))
        return got

    def _latency(self, took: float) -> None:
        with self._lock:
            if len(self.stats.latencies) < LATENCY_SAMPLES:
                self.stats.latencies.append(took)
            else:
                self.stats.latencies[self._lat_n % LATENCY_SAMPLES] = took
            self._lat_n += 1

    def _evict(self, wait: bool = True) -> None:
        """Past the budget, unmap every page (one madvise per file): the row buffer holds what the
        steps use, and a page is only needed while its rows are copied in or written back.
        wait=False (a read ahead): the unmapping runs on its own thread, beside the step (its cost
        is per page mapped: ~0.45 us, 4 ms a step at 8k pages); a page a thread is reading meanwhile
        is only read again (the mapping is shared: nothing is lost). Else it is done when this
        returns, the reads in flight finished first (a phase that writes around the mapping
        follows)."""
        self._unmapped()
        if wait:
            self.ready()
        files = [f for f in (self.file, self.log_file) if f is not None]
        for f in files:
            self.stats.evicted += int(f.mapped.sum())
            f.mapped[:] = False
        self.mapped_bytes = 0
        zap = [(f.addr, f.nbytes) for f in files]
        if wait:
            self._zap(zap)
        else:
            self._unmapping = self._zapper.submit(self._zap, zap)

    @staticmethod
    def _zap(ranges: list[tuple[int, int]]) -> None:
        for addr, nbytes in ranges:
            madvise(addr, nbytes, MADV_DONTNEED)

    def _unmapped(self) -> None:
        """Wait for an unmapping begun beside the step (_evict(wait=False))."""
        if self._unmapping is not None:
            pending, self._unmapping = self._unmapping, None
            pending.result()

    def release(self) -> None:
        """Unmap everything (after a phase that read or wrote the shard through other paths: its
        initial rows, a checkpoint's load or save, an evaluation), so that the pages it touched
        leave this process (dirty ones stay in the page cache until written back)."""
        self._evict()

    # ---- reporting -------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """summary.json's `store` block (this rank's)."""
        s = self.stats
        io = _proc_io()
        lat = np.sort(np.asarray(s.latencies)) * 1e6 if s.latencies else np.zeros(0)
        pct = {f"p{q}_us": (round(float(np.percentile(lat, q)), 1) if lat.size else None) for q in (50, 90, 99)}
        steps = max(s.steps, 1)
        return {"kind": "disk", "reader": self.reader, "dir": self.dir, "disk_bytes": self.disk_bytes(), "cache_bytes": self.total_bytes, "page_bytes": self.page_bytes,
                "chunk_bytes": CHUNK, "steps": s.steps,
                "hit_rate": round(s.chunks_hit / s.chunks_used, 4) if s.chunks_used else None,
                "chunks_read_per_step": s.chunks_read / steps, "chunks_used_per_step": s.chunks_used / steps,
                "evicted_chunks": s.evicted,
                "bytes_read": io.get("read_bytes", 0) - self._io0.get("read_bytes", 0),
                "bytes_written": io.get("write_bytes", 0) - self._io0.get("write_bytes", 0),
                "read_latency": pct, "wait_s": round(s.wait_s, 4),
                "sync_faults": _thread_major_faults() - self._faults0}

    def close(self) -> None:
        """Stop the threads, drop the mappings, remove the files (the run's scratch)."""
        if self._closed:
            return
        self._closed = True
        for fut in self._pending:
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._zapper.shutdown(wait=True)
        if self._merger is not None:
            self._merger.shutdown(wait=True, cancel_futures=True)
            self.merge_ring.close()
            self.merge_ring = None
        if self._ringer is not None:
            self._ringer.shutdown(wait=True, cancel_futures=True)
            self._ring.close()
            self._ring = None
        self._unmapping = None
        self._pending = []
        files, self.file, self.log_file = (self.file, self.log_file), None, None
        for f in files:
            if f is not None:
                f.close()
        self.scratch.close()


def _which(parts: list[tuple[RecordFile, np.ndarray]], i: int) -> tuple[str, int]:
    """(file, record) of position i of the records read for `parts` ((file, records) one after
    the other)."""
    for f, rows in parts:
        if i < rows.size:
            return f.path, int(rows[i])
        i -= rows.size
    raise IndexError(i)


def _proc_io() -> dict[str, int]:
    """/proc/self/io: bytes this process had read from and written to the storage layer."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f if ": " in line)}
    except (OSError, ValueError):
        return {}


def _thread_major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt
