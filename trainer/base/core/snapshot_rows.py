"""Where the best-model snapshot keeps its rows: in memory, or in a file for a shard too big to copy.

SnapshotRows holds, for the storage rows of this rank's shard that were written before the last
snapshot (`held`), their value at that snapshot; a row never written is at its initial value (a pure
function of seed, table and id) and holds nothing. Layout: by storage row (row r at r x row bytes),
in a tensor (memory) or in an unnamed temporary file in the run's directory (disk: a sparse file,
only written rows take disk blocks; the file vanishes when the run ends, however it ends).

Both `put` (take a snapshot) and `values` (restore) walk the shard one window of rows at a time
(checkpoint.shard_io.PIECE_BYTES of row bytes), so no phase needs more than a window or two of
temporaries, whatever the shard's size; on disk a whole window of written rows is one sequential
write, scattered rows are patched through a mapping of their span (the kernel writes back only the
pages they dirty), unmapped before the next window. Memory per storage row: the `held` flag (1 B) beside the
store's `touched` flag (1 B); plus the row's bytes (dim x element size) in memory, or on disk.

Dynamic tables (embedding.kind=dynamic): a storage row is a pool slot, which may hold another id
at the restore than at the snapshot, so SnapshotSlots keeps beside the rows each held slot's id and
version (its id's life) at the last snapshot: two int64 per slot (16 B), in memory, written for the
touched slots only. A slot never written before the snapshot was free then (an admission writes
its row), so it restores to free: no id, zeros, version 0.

Which one: train.early_stop.snapshot = memory | disk | auto (memory when the rank's rows take at
most MEMORY_MAX_BYTES, else disk: a huge shard is never doubled in memory).
"""
from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

PIECE_BYTES = 64 << 20  # row bytes per window (the checkpoint's piece size: checkpoint.shard_io)
MEMORY_MAX_BYTES = 256 << 20  # auto: a larger copy of the rank's rows goes to disk
MODES = ("auto", "memory", "disk")
SNAPSHOT_SLOT_BYTES = 16  # dynamic tables: a slot's id and version at the snapshot (SnapshotSlots)


def in_memory(mode: str, rows: int, row_bytes: int) -> bool:
    """Whether the snapshot of `rows` rows of `row_bytes` each is kept in memory."""
    if mode not in MODES:
        raise ValueError(f"snapshot mode {mode!r}: one of {', '.join(MODES)}")
    return mode == "memory" or (mode == "auto" and rows * row_bytes <= MEMORY_MAX_BYTES)


class SnapshotRows:
    """Values of the shard's storage rows at the last snapshot, for the rows written before it."""

    def __init__(self, weight: torch.Tensor, memory: bool, directory: Optional[str] = None) -> None:
        """weight: the store's [rows, dim] rows (shape, dtype and device of what is kept).
        directory: where the disk file lives (default: the system's temporary directory)."""
        self.rows, self.dim = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.row_bytes = self.dim * weight.element_size()
        self.window = max(1, PIECE_BYTES // max(self.row_bytes, 1))
        self.held = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        self.memory = memory
        self._mem: Optional[torch.Tensor] = None  # allocated at the first put
        self._file = None if memory else tempfile.TemporaryFile(dir=directory, prefix=".best-rows-")
        if self._file is not None:
            self._file.truncate(self.rows * self.row_bytes)  # sparse: blocks only for written rows

    def windows(self) -> Iterator[tuple[int, int]]:
        for a in range(0, self.rows, self.window):
            yield a, min(a + self.window, self.rows)

    @property
    def held_rows(self) -> int:
        return int(torch.count_nonzero(self.held))  # a bool's sum() copies it as int64: 8 B a row

    def put(self, weight: torch.Tensor, touched: torch.Tensor, release: Callable[[], None] = lambda: None) -> None:
        """Keep the current values of the rows flagged in `touched` (they become held); release()
        after each window (a shard on disk: its pages read leave the process)."""
        for a, b in self.windows():
            t = torch.nonzero(touched[a:b]).squeeze(1)
            if t.numel():
                self._put(a, b, t, weight[a:b] if t.numel() == b - a else weight.index_select(0, t + a))
                self.held[a:b] |= touched[a:b]
            release()

    def _put(self, a: int, b: int, t: torch.Tensor, vals: torch.Tensor) -> None:
        """Keep vals, the values of rows a + t of window [a, b)."""
        if not self.memory:
            self._write(a, b, t, vals)
            return
        if self._mem is None:
            self._mem = torch.empty(self.rows, self.dim, dtype=self.dtype, device=self.device)
        self._mem.index_copy_(0, t + a, vals)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, dim] kept values of held storage rows `rows` (ascending, within one window)."""
        if self.memory:
            assert self._mem is not None
            return self._mem.index_select(0, rows)
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        at = (rows - lo).cpu().numpy()
        return self._rows_of(self._on_span(lo, hi, False, lambda span: span[at]))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._mem = None

    # ---- the file: a window at a time ------------------------------------------------------
    def _bytes_of(self, vals: torch.Tensor) -> np.ndarray:
        """[n, row_bytes] uint8 of rows (any float dtype, bit for bit)."""
        return vals.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1, self.row_bytes)

    def _rows_of(self, raw: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(np.ascontiguousarray(raw)).view(self.dtype).reshape(-1, self.dim)
        return out.to(self.device)

    def _write(self, a: int, b: int, t: torch.Tensor, vals: torch.Tensor) -> None:
        raw = self._bytes_of(vals)
        if t.numel() == b - a:  # the whole window: one sequential write
            view, off, fd = memoryview(raw.reshape(-1)), a * self.row_bytes, self._file.fileno()
            while len(view):
                n = os.pwrite(fd, view, off)
                view, off = view[n:], off + n
            return
        lo, hi = a + int(t[0]), a + int(t[-1]) + 1  # scattered rows: only their pages are written
        at = (t + a - lo).cpu().numpy()
        self._on_span(lo, hi, True, lambda rows: rows.__setitem__(at, raw))

    def _on_span(self, lo: int, hi: int, writable: bool, fn: Callable[[np.ndarray], Any]) -> Any:
        """fn(the file's storage rows lo..hi-1 as a mapped [n, row_bytes] uint8 array); fn must
        return nothing that points into it. The span is unmapped after: no more than a window of
        the file is ever resident in this process."""
        start, end = lo * self.row_bytes, hi * self.row_bytes
        base = start - start % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(self._file.fileno(), end - base, offset=base,
                       access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        try:
            rows = np.frombuffer(mm, dtype=np.uint8, count=end - start, offset=start - base)
            out = fn(rows.reshape(hi - lo, self.row_bytes))
            del rows
            return out
        finally:
            mm.close()


class SnapshotSlots:
    """Dynamic tables: which id held each slot of the pool, and in which life (its version), at the
    last snapshot, for the slots written before it (SnapshotRows.held says which: see the module
    docstring). 16 B per slot (two int64), in memory."""

    def __init__(self, slot_gid: torch.Tensor) -> None:
        self.gid = torch.full_like(slot_gid, -1)
        self.version = torch.zeros_like(slot_gid)

    def put(self, slot_gid: torch.Tensor, version: torch.Tensor, touched: torch.Tensor,
            windows: Iterable[tuple[int, int]]) -> None:
        """Keep the id and version of the slots flagged in `touched`, a window of slots at a time."""
        for a, b in windows:
            t = torch.nonzero(touched[a:b]).squeeze(1) + a
            self.gid.index_copy_(0, t, slot_gid.index_select(0, t))
            self.version.index_copy_(0, t, version.index_select(0, t))

    def restore(self, slot_gid: torch.Tensor, version: torch.Tensor, slots: torch.Tensor, held: torch.Tensor) -> None:
        """Put back the id and version of slots [n]; those not held (free at the snapshot) get no
        id and version 0. The pool's map is the caller's to rebuild (SlotPool.reindex)."""
        slot_gid.index_copy_(0, slots, self.gid.index_select(0, slots).masked_fill(~held, -1))
        version.index_copy_(0, slots, self.version.index_select(0, slots).masked_fill(~held, 0))
