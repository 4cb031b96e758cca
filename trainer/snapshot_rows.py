"""Where the best-model snapshot keeps its rows: in memory, or in a file for a shard too big to copy.

SnapshotRows holds, for the storage rows of this rank's shard that were written before the last
snapshot (`held`), their value at that snapshot; a row never written is at its initial value (a pure
function of seed, table and id) and holds nothing. Layout: by storage row (row r at r x row bytes),
in a tensor (memory) or in an unnamed temporary file in the run's directory (disk: a sparse file,
only written rows take disk blocks; the file vanishes when the run ends, however it ends).

Both `put` (take a snapshot) and `values` (restore) walk the shard one window of rows at a time
(checkpoint.shard_io.PIECE_BYTES of row bytes), so no phase needs more than a window or two of
temporaries, whatever the shard's size. Memory per storage row: the `held` flag (1 B) beside the
store's `touched` flag (1 B); plus the row's bytes (dim x element size) in memory, or on disk.

Which one: train.early_stop.snapshot = memory | disk | auto (memory when the rank's rows take at
most MEMORY_MAX_BYTES, else disk: a huge shard is never doubled in memory).
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterator, Optional

import numpy as np
import torch

PIECE_BYTES = 64 << 20  # row bytes per window (the checkpoint's piece size: checkpoint.shard_io)
MEMORY_MAX_BYTES = 256 << 20  # auto: a larger copy of the rank's rows goes to disk
MODES = ("auto", "memory", "disk")


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
        return int(self.held.sum())

    def put(self, weight: torch.Tensor, touched: torch.Tensor) -> None:
        """Keep the current values of the rows flagged in `touched` (they become held)."""
        for a, b in self.windows():
            t = torch.nonzero(touched[a:b]).squeeze(1)
            if not t.numel():
                continue
            vals = weight[a:b] if t.numel() == b - a else weight.index_select(0, t + a)
            if self.memory:
                if self._mem is None:
                    self._mem = torch.empty(self.rows, self.dim, dtype=self.dtype, device=self.device)
                self._mem.index_copy_(0, t + a, vals)
            else:
                self._write(a, b, t, vals)
            self.held[a:b] |= touched[a:b]

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, dim] kept values of held storage rows `rows` (ascending, within one window)."""
        if self.memory:
            assert self._mem is not None
            return self._mem.index_select(0, rows)
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        buf = self._read(lo, hi)
        return self._rows_of(buf[(rows - lo).cpu().numpy()])

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

    def _read(self, lo: int, hi: int) -> np.ndarray:
        """[hi - lo, row_bytes] uint8: storage rows lo..hi-1 as the file has them."""
        want = (hi - lo) * self.row_bytes
        data = os.pread(self._file.fileno(), want, lo * self.row_bytes)
        if len(data) != want:
            raise OSError(f"snapshot file: read {len(data)} of {want} bytes at row {lo}")
        return np.frombuffer(data, dtype=np.uint8).reshape(hi - lo, self.row_bytes).copy()

    def _write(self, a: int, b: int, t: torch.Tensor, vals: torch.Tensor) -> None:
        if t.numel() == b - a:  # the whole window: one sequential write
            buf, lo = self._bytes_of(vals), a
        else:  # read the span the rows fall in, patch them, write it back
            lo, hi = a + int(t[0]), a + int(t[-1]) + 1
            buf = self._read(lo, hi)
            buf[(t + a - lo).cpu().numpy()] = self._bytes_of(vals)
        view = memoryview(buf.reshape(-1))
        off, fd = lo * self.row_bytes, self._file.fileno()
        while len(view):
            n = os.pwrite(fd, view, off)
            view, off = view[n:], off + n
