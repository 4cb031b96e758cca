"""The training rows of a prepared Criteo directory in one global order, the same at every W.

Why: batch k of a run must be the same rows whatever the number of workers, so that a checkpoint
resumes at another W (the saved step names the same rows there) and so that every rank can know
every sample of a global batch (FAE's hot batches, its profile, SCA's trace, Herald's partition).
The order is a function of (training segments, data.seed) only; a rank's batch of step k is the
stream positions [k G + r b, k G + (r + 1) b) of it (G = b W), as for synthetic data and MovieLens.

The order: epoch e visits the training segments (blocks, or the pieces of blocks a validation
split leaves) in a seeded permutation of (seed, e), and the rows of each segment in a seeded
permutation of (seed, e, segment): the same shuffle as "block order + rows in a block", drawn
afresh every epoch. data.shuffle=false: file order. A position past the split's end is the next
epoch's. Memory: the segment table (O(segments)) and a few per-segment row permutations (8 B per
row of a block), never O(rows of the split).

Reading rows by index (RowReader): the rows of one segment are read from its block's memory map
in sorted order (np.load mmap_mode='r'), so a rank reads the pages of its own rows. Within a block
the rows of one batch are spread (the row shuffle), so over a block's lifetime every rank reads
its pages: the page cache holds them once per host, and each host reads the training split once
per epoch (not 1 / hosts of it). That is the price of a W-invariant shuffled order; the test split
and the validation split are still read by shards (blocks.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np
import torch

from .criteo import CriteoFormatError, from_block
from .segment import Segment

Columns = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # labels [n] f32, dense [n, F] f32, ids [n, T] i64
BlockReader = Callable[[list[str], int, int], Iterator[Columns]]  # (files, shard_id, num_shards): blocks, looping
CACHED_PERMS = 8  # row permutations kept (a window of FAE's hot/cold order spans a few segments)
OPEN_BLOCKS = 32  # block memory maps kept open


class TrainOrder:
    """Stream positions -> training rows (keys: the row's index in the concatenation of the
    training segments, file order), identical on every rank and at every W."""

    def __init__(self, segs: list[Segment], seed: int | None) -> None:
        self.segs = segs
        self.sizes = np.asarray([s.rows for s in segs], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.n = int(self.starts[-1])
        self.seed = seed  # None: file order
        self._orders: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def segment_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(segments in epoch's visiting order, the position each of them ends at in the epoch)."""
        if epoch not in self._orders:
            order = (np.arange(len(self.segs), dtype=np.int64) if self.seed is None
                     else np.random.default_rng([self.seed, 7, epoch]).permutation(len(self.segs)))
            self._orders[epoch] = (order, np.cumsum(self.sizes[order]))
            if len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def row_order(self, epoch: int, seg: int) -> np.ndarray | None:
        """The visiting order of segment seg's rows in epoch (None: file order)."""
        if self.seed is None:
            return None
        key = (epoch, seg)
        if key not in self._perms:
            self._perms[key] = np.random.default_rng([self.seed, epoch, seg]).permutation(int(self.sizes[seg]))
            if len(self._perms) > CACHED_PERMS:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return self._perms[key]

    def locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, segment, row within the segment) of each stream position."""
        pos = np.asarray(pos, np.int64)
        epoch, p = np.divmod(pos, self.n)
        seg, row = np.empty_like(pos), np.empty_like(pos)
        for e in np.unique(epoch):
            at = epoch == e
            order, ends = self.segment_order(int(e))
            j = np.searchsorted(ends, p[at], side="right")
            seg[at] = order[j]
            row[at] = p[at] - (ends[j] - self.sizes[order[j]])
        for e, s in {(int(a), int(b)) for a, b in zip(epoch, seg)}:
            perm = self.row_order(e, s)
            if perm is not None:
                at = (epoch == e) & (seg == s)
                row[at] = perm[row[at]]
        return epoch, seg, row

    def keys(self, pos: np.ndarray) -> np.ndarray:
        """The training row (key) at each stream position."""
        _, seg, row = self.locate(pos)
        return self.starts[seg] + row

    def segment_of(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment, row within it) of each key."""
        seg = np.searchsorted(self.starts, keys, side="right") - 1
        return seg, keys - self.starts[seg]


def open_block(path: str) -> np.ndarray:
    """A block file as a read-only memmap; one removed or cut short while training is an error
    naming it."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise CriteoFormatError(f"block file {path} cannot be read: {exc}") from exc


class RowReader:
    """Rows of the training segments by key, from the blocks' memory maps (random access)."""

    def __init__(self, order: TrainOrder, num_dense: int) -> None:
        self.order, self.F = order, num_dense
        self._maps: OrderedDict[str, np.ndarray] = OrderedDict()

    def _block(self, path: str) -> np.ndarray:
        if path not in self._maps:
            self._maps[path] = open_block(path)
            if len(self._maps) > OPEN_BLOCKS:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(path)
        return self._maps[path]

    def raw(self, keys: np.ndarray, width: int) -> np.ndarray:
        """The stored int32 rows [n, width = 1 + F + T] of keys, in the order given."""
        keys = np.asarray(keys, np.int64)
        seg, row = self.order.segment_of(keys)
        out = np.empty((keys.size, width), np.int32)
        for s in np.unique(seg):
            at = np.flatnonzero(seg == s)
            segment = self.order.segs[int(s)]
            block = self._block(segment.file)
            if block.shape[0] < segment.hi:
                raise CriteoFormatError(f"{segment.file}: the block holds {block.shape[0]} rows, expected >= {segment.hi}")
            local = row[at]
            sort = np.argsort(local, kind="stable")
            out[at[sort]] = block[segment.lo + local[sort]]
        return out

    def columns(self, keys: np.ndarray, width: int) -> Columns:
        return tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in from_block(self.raw(keys, width), self.F))



class SequentialRows:
    """Rows by stream position for a rank reading the stream in order through a block reader
    (DALI): the epoch's segments are read whole, in the order's sequence, by every rank (the
    reader's only shard), and a request takes its rows from the segments read. Positions come in
    stream order (a rank's batches, step after step); the first request, or one behind what was
    read, starts the reader at the request's segment, so a resumed run reads no block before its
    position. Held: the last HELD segments read."""

    HELD = 3

    def __init__(self, order: TrainOrder, reader: BlockReader) -> None:
        self.order, self.reader = order, reader
        self._blocks: Iterator[Columns] | None = None
        self._at: tuple[int, int] = (-1, -1)  # (epoch, index in its segment order) of the last segment read
        self._held: OrderedDict[tuple[int, int], Columns] = OrderedDict()

    def _start(self, epoch: int, index: int) -> None:
        order, _ = self.order.segment_order(epoch)
        self._blocks = self.reader([self.order.segs[int(s)].file for s in order[index:]], 0, 1)
        self._at = (epoch, index - 1)
        self._held.clear()

    def _read_next(self) -> None:
        epoch, index = self._at
        if index + 1 >= len(self.order.segs):  # the next epoch, in its own order
            self._start(epoch + 1, 0)
            epoch, index = self._at
        assert self._blocks is not None
        labels, dense, ids = next(self._blocks)
        seg = self.order.segs[int(self.order.segment_order(epoch)[0][index + 1])]
        if labels.shape[0] < seg.hi:
            raise CriteoFormatError(f"{seg.file}: the reader gave {labels.shape[0]} rows, expected >= {seg.hi}")
        self._at = (epoch, index + 1)
        self._held[self._at] = (labels[seg.lo:seg.hi], dense[seg.lo:seg.hi], ids[seg.lo:seg.hi])
        while len(self._held) > self.HELD:
            self._held.popitem(last=False)

    def columns(self, pos: np.ndarray) -> Columns:
        """The rows at stream positions pos (increasing), in that order."""
        epoch, seg, row = self.order.locate(pos)
        index = np.empty_like(seg)
        for e in np.unique(epoch):
            order, _ = self.order.segment_order(int(e))
            where = np.empty(len(order), np.int64)
            where[order] = np.arange(len(order))
            index[epoch == e] = where[seg[epoch == e]]
        first = (int(epoch[0]), int(index[0]))
        if self._blocks is None or (first not in self._held and first <= self._at):
            self._start(*first)
        out: list[torch.Tensor] | None = None
        for e, i in sorted({(int(a), int(b)) for a, b in zip(epoch, index)}):
            while (e, i) not in self._held:
                self._read_next()
            at = np.flatnonzero((epoch == e) & (index == i))
            held = self._held[(e, i)]
            device = held[0].device  # DALI on a GPU: the columns are there
            cols = [c[torch.from_numpy(row[at]).to(device)] for c in held]
            if out is None:
                out = [torch.empty((pos.size, *c.shape[1:]), dtype=c.dtype, device=device) for c in cols]
            for k in range(3):
                out[k][torch.from_numpy(at).to(device)] = cols[k]
        assert out is not None
        return out[0], out[1], out[2]
