"""A prepared Criteo directory as the trainer's Batch stream: splits, rank shards, row order, batching,
and the numpy-memmap reference reader.

Why one module around the reader: DALI (trainer/workload/data/dali.py) only reads blocks, one block per
sample, and picks this rank's blocks with shard_id/num_shards. Everything else (which rows of which
block belong to a split, the seeded block and row order, how blocks become batches of exactly b
rows) lives here and is shared by both readers, so the memmap reference differs from DALI only in
who reads the file: that is what the loader-equivalence test pins down.

Sharding follows DALI's reader rule: of N blocks, rank r of W reads blocks [N*r//W, N*(r+1)//W) and
loops over them (stick_to_shard). So the data order depends on W (as with any sharded reader); the
eval split is still covered exactly once, and every rank yields the same number of eval batches.
A split with fewer blocks than workers (a small file prepared as one block, a small validation or
test split) is sharded by rows instead: of its R rows in file order, rank r reads rows
[R*r//W, R*(r+1)//W), through numpy memmaps (DALI's numpy reader reads whole files), so any
prepared directory trains at any W (rank_segments).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import torch

from ...base.config import ConfigError, DataConfig, val_range
from ...base.core.device import resident
from .batch import Batch
from .criteo import CriteoFormatError, check_block, from_block, raw_ids, read_meta
from .ids import IdGuard
from .order import BlockReader, Columns, RowReader, SequentialRows, TrainOrder, open_block
from .segment import Segment
from .vocab import Vocab, build_vocab


def _cut(segs: list[Segment], start: int, stop: int) -> list[Segment]:
    """The segments covering rows [start, stop) of the concatenation of segs."""
    out, pos = [], 0
    for s in segs:
        lo, hi = max(start - pos, 0), min(stop - pos, s.rows)
        if lo < hi:
            out.append(Segment(s.file, s.lo + lo, s.lo + hi))
        pos += s.rows
    return out


def split_segments(meta: dict, directory: str, cfg: DataConfig) -> tuple[list[Segment], list[Segment]]:
    """(train, eval) segments: the test split when prepared, else the last test_fraction of train;
    data.train_samples / data.test_samples (> 0) keep only the first rows of each."""
    blocks = lambda s: [Segment(os.path.join(directory, b["file"]), 0, b["rows"])
                        for b in meta["splits"][s]["blocks"]]
    train = blocks("train")
    if "test" in meta["splits"]:
        evals = blocks("test")
    else:
        n = sum(s.rows for s in train)
        n_eval = math.ceil(cfg.test_fraction * n)
        train, evals = _cut(train, 0, n - n_eval), _cut(train, n - n_eval, n)
    if cfg.train_samples > 0:
        train = _cut(train, 0, cfg.train_samples)
    if cfg.test_samples > 0:
        evals = _cut(evals, 0, cfg.test_samples)
    return train, evals


def split_validation(train: list[Segment], cfg: DataConfig) -> tuple[list[Segment], list[Segment]]:
    """(train, validation) of the training segments split_segments returned: the validation split
    is their last data.val_fraction of rows (file order, so it is the same rows at any W and any
    data.seed), or with data.val_slice = j the j-th such slice from the end (the training rows are
    the rest, in file order); the test split is never touched. No validation split: (train, [])."""
    n = sum(s.rows for s in train)
    lo, hi = val_range(n, cfg.val_fraction or 0.0, cfg.val_slice)
    return (_cut(train, 0, lo) + _cut(train, hi, n), _cut(train, lo, hi)) if hi > lo else (train, [])


def train_vocab(cfg: DataConfig) -> Vocab:
    """data.min_count's vocabulary of the prepared directory cfg.dir: counted on the training rows
    CriteoData trains on (validation and test rows left out)."""
    meta = read_meta(cfg.dir)
    _no_raw_vocab(meta, cfg)
    train = split_validation(split_segments(meta, cfg.dir, cfg)[0], cfg)[0]
    check_blocks(train, cfg.dir, 1 + int(meta["num_dense"]) + len(meta["table_rows"]))
    return build_vocab(train, int(meta["num_dense"]), [int(n) for n in meta["table_rows"]], cfg.min_count)


def _no_raw_vocab(meta: dict, cfg: DataConfig) -> None:
    if raw_ids(meta) and cfg.min_count:
        raise ConfigError(f"data.min_count={cfg.min_count}: data.dir={cfg.dir!r} keeps raw ids "
                          "(prepare_criteo.py --raw-ids), which take no vocabulary: set data.min_count=0")


STATS_ROWS = 1_000_000  # data.standardize: mean and std from the first training rows (all of a small set)


def dense_stats(segs: list[Segment], num_dense: int, max_rows: int = STATS_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [F], std [F]) float32 of the dense features of the first max_rows rows of segs (file
    order), accumulated in float64: the same numbers on every rank and every W. std 0 -> 1."""
    total = np.zeros(num_dense)
    squares = np.zeros(num_dense)
    n = 0
    for s in segs:
        take = min(s.rows, max_rows - n)
        if take <= 0:
            break
        dense = from_block(np.load(s.file, mmap_mode="r")[s.lo:s.lo + take], num_dense)[1].astype(np.float64)
        total += dense.sum(0)
        squares += (dense * dense).sum(0)
        n += take
    mean = total / max(n, 1)
    std = np.sqrt(np.maximum(squares / max(n, 1) - mean * mean, 0.0))
    std = np.where(std > 1e-12, std, 1.0)
    return torch.from_numpy(mean.astype(np.float32)), torch.from_numpy(std.astype(np.float32))


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """DALI's reader sharding: shard r of n samples is [n*r//W, n*(r+1)//W)."""
    return n * rank // world, n * (rank + 1) // world


def by_rows(segs: list[Segment], world: int) -> bool:
    """Whether a split is sharded by rows: its segments come from fewer block files than workers
    (DALI's reader needs a block per shard; two pieces of one block would be read twice)."""
    return len({s.file for s in segs}) < world


def rank_segments(segs: list[Segment], rank: int, world: int) -> list[Segment]:
    """Rank `rank`'s part of a split: with a block file per worker DALI's block shard (shard_range
    over the segments, each read whole); with fewer, rows [R*r//W, R*(r+1)//W) of the split's R
    rows in the order given (the same rows at any run)."""
    if not by_rows(segs, world):
        return segs[slice(*shard_range(len(segs), rank, world))]
    return _cut(segs, *shard_range(sum(s.rows for s in segs), rank, world))


def _memmap_rows(segs: list[Segment], num_dense: int) -> Iterator[Columns]:
    """The rows of each segment in turn, looping forever, read from numpy memmaps (only the pages
    of those rows): a row-sharded split's reader."""
    while True:
        for s in segs:
            block = open_block(s.file)
            if block.shape[0] < s.hi:
                raise CriteoFormatError(f"{s.file}: the reader gave {block.shape[0]} rows, expected >= {s.hi}")
            yield tuple(torch.from_numpy(x) for x in from_block(block[s.lo:s.hi], num_dense))


def _block_rows(segs: list[Segment], blocks: Iterator[Columns]) -> Iterator[Columns]:
    """The rows of each segment in turn, cut from the whole blocks a BlockReader yields for them."""
    k = 0
    while True:
        seg = segs[k % len(segs)]
        labels, dense, ids = next(blocks)
        if labels.shape[0] < seg.hi:
            raise CriteoFormatError(f"{seg.file}: the reader gave {labels.shape[0]} rows, expected >= {seg.hi}")
        k += 1
        yield labels[seg.lo:seg.hi], dense[seg.lo:seg.hi], ids[seg.lo:seg.hi]


def memmap_reader(num_dense: int) -> BlockReader:
    """The reference reader: np.load(mmap_mode='r') of this shard's blocks, looping forever."""
    def read(files: list[str], shard_id: int, num_shards: int) -> Iterator[Columns]:
        lo, hi = shard_range(len(files), shard_id, num_shards)
        while True:
            for f in files[lo:hi]:
                yield tuple(torch.from_numpy(x) for x in from_block(open_block(f), num_dense))
    return read


def check_blocks(segs: list[Segment], directory: str, width: int) -> None:
    """Every block file a split names exists and holds the rows meta.json gives it, checked from
    the .npy headers at start-up (by every rank, so all stop together), before any reader opens
    one: a missing or truncated block is an error naming the file, not a reader's traceback."""
    need: dict[str, int] = {}
    for s in segs:
        need[s.file] = max(need.get(s.file, 0), s.hi)
    for path, rows in need.items():
        why = check_block(path, rows, width)
        if why is not None:
            raise CriteoFormatError(
                f"data.dir={directory!r}: block file {path} {why}. Re-run scripts/prepare_criteo.py "
                "with the same inputs and --out: it redoes the input file whose blocks are damaged")


class BlockStream:
    """This rank's rows of a split (rank_segments), in order, as an endless (or one-pass) stream of
    batches: whole blocks from `reader` when the split has a block per worker, else this rank's row
    range through memmaps."""

    def __init__(self, segs: list[Segment], reader: BlockReader, rank: int, world: int,
                 seed: int | None, num_dense: int) -> None:
        self.mine = rank_segments(segs, rank, world)
        self.seed = seed  # None = file order; else rows shuffled per (seed, epoch, segment)
        self._rows: Iterator[Columns] = (iter(()) if not self.mine
                                         else _block_rows(self.mine, reader([s.file for s in segs], rank, world))
                                         if not by_rows(segs, world) else _memmap_rows(self.mine, num_dense))
        self._buf: list[Columns] = []
        self._have = 0
        self._read = 0  # segments read so far

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.mine)

    def _next_block(self) -> Columns:
        labels, dense, ids = next(self._rows)
        if self.seed is None:
            self._read += 1
            return labels, dense, ids
        epoch, k = divmod(self._read, len(self.mine))
        perm = np.random.default_rng([self.seed, epoch, k]).permutation(labels.shape[0])
        idx = torch.from_numpy(perm).to(labels.device)
        self._read += 1
        return labels[idx], dense[idx], ids[idx]

    def take(self, n: int) -> Columns:
        """The next n > 0 rows, across block boundaries (the shard repeats: epochs)."""
        while self._have < n:
            self._buf.append(self._next_block())
            self._have += self._buf[-1][0].shape[0]
        cols = [torch.cat([b[i] for b in self._buf]) if len(self._buf) > 1 else self._buf[0][i]
                for i in range(3)]
        tail = (cols[0][n:], cols[1][n:], cols[2][n:])
        self._buf, self._have = ([tail], self._have - n) if self._have > n else ([], 0)
        return cols[0][:n], cols[1][:n], cols[2][:n]


def to_batch(cols: Columns, num_dense: int, rows: torch.Tensor, guard: IdGuard | None = None,
             where: str = "batch", norm: tuple[torch.Tensor, torch.Tensor] | None = None,
             vocab: Vocab | None = None, raw: bool = False) -> Batch:
    """Columns -> Batch (one id per bag). Ids are checked against the data's own table sizes by
    `guard` (data.out_of_range), mapped through the training rows' vocabulary (data.min_count,
    vocab.py), then folded into the configured table sizes (id mod rows: the data.max_table_rows
    cap). norm = (mean, std): dense -> (dense - mean) / std (data.standardize). raw: the ids are
    raw 32-bit values (prepare_criteo.py --raw-ids), stored as int32 bits: read as unsigned."""
    labels, dense, ids = cols
    if norm is not None:
        dense = (dense - resident(norm[0], dense.device)) / resident(norm[1], dense.device)
    b, t = labels.shape[0], rows.numel()
    ids = ids.reshape(b, t)
    if raw:
        ids = ids.long() & 0xFFFFFFFF
    if guard is not None:
        ids = guard.columns(ids, where)
    if vocab is not None:
        ids = vocab.map(ids)
    ids = torch.remainder(ids, resident(rows, ids.device))
    return Batch(dense.reshape(b, num_dense).contiguous(), ids.reshape(-1).contiguous(),
                 torch.ones((b, t), dtype=torch.int64, device=ids.device), labels.contiguous())


class CriteoData:
    """make_data's source for data=criteo: this rank's slice of every batch, DALI or memmap reader."""

    def __init__(self, cfg: DataConfig, rows: list[int], rank: int, world: int, local_batch: int,
                 reader: BlockReader) -> None:
        self.cfg, self.rank, self.world, self.b, self.reader = cfg, rank, world, local_batch, reader
        self.meta = read_meta(cfg.dir)
        self.F, self.rows = int(self.meta["num_dense"]), torch.tensor(rows, dtype=torch.int64)
        self.guard = IdGuard([int(n) for n in self.meta["table_rows"]], cfg.out_of_range,
                             f"data.dir={cfg.dir!r}")
        self.raw = raw_ids(self.meta)  # prepare_criteo.py --raw-ids: 32-bit values as ids
        _no_raw_vocab(self.meta, cfg)
        self.train_segs, self.eval_segs = split_segments(self.meta, cfg.dir, cfg)
        check_blocks(self.train_segs + self.eval_segs, cfg.dir, 1 + self.F + len(self.meta["table_rows"]))
        if not self.train_segs:
            raise ConfigError(f"data.dir={cfg.dir!r}: the training split has no rows (did every row of "
                              f"the input fail preparation? see {os.path.join(cfg.dir, 'meta.json')})")
        self.train_segs, self.val_segs = split_validation(self.train_segs, cfg)
        # data.standardize: statistics of the training rows (validation and test rows left out)
        self.norm = dense_stats(self.train_segs, self.F) if cfg.standardize else None
        self.vocab = (build_vocab(self.train_segs, self.F, [int(n) for n in self.meta["table_rows"]], cfg.min_count)
                      if cfg.min_count else None)
        rows = sum(s.rows for s in self.train_segs)
        if rows < world:
            raise ConfigError(f"data.dir={cfg.dir!r}: the training split has {rows} rows for {world} workers; "
                              "every worker needs at least one (see data.train_samples, data.val_fraction)")
        # one order of the training rows for every W (order.py): batch k is the same rows at any W
        self.order = TrainOrder(self.train_segs, cfg.seed if cfg.shuffle else None)
        self._rows = RowReader(self.order, self.F)
        self._stream = SequentialRows(self.order, reader) if cfg.loader == "dali" else None
        self._eval: dict[str, BlockStream] = {}

    @property
    def train_rows(self) -> int:
        """Rows of the training split (all ranks)."""
        return sum(s.rows for s in self.train_segs)

    @property
    def global_batch(self) -> int:
        return self.b * self.world

    def train_batch(self, step: int) -> Batch:
        """This rank's slice [rank*b, (rank+1)*b) of global batch `step` of the training order: the
        block reader's stream (DALI) or the rows read by index (memmap); the same rows either way."""
        start = step * self.global_batch + self.rank * self.b
        pos = np.arange(start, start + self.b, dtype=np.int64)
        cols = self._stream.columns(pos) if self._stream is not None else \
            self._rows.columns(self.order.keys(pos), self._width)
        return self._to_batch(cols, f"training batch of step {step}")

    # ---- the global view (schedulers, placement profiles): any training row by its key ---------
    def stream_keys(self, pos: np.ndarray) -> np.ndarray:
        """The training rows (keys) at stream positions pos."""
        return self.order.keys(np.asarray(pos, np.int64))

    def sample_ids(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = self.sample_batch(keys)
        return b.values.cpu().numpy(), b.lengths.cpu().numpy()

    def sample_batch(self, keys: np.ndarray) -> Batch:
        return self._to_batch(self._rows.columns(np.asarray(keys, np.int64), self._width), "training batch")

    @property
    def _width(self) -> int:
        return 1 + self.F + self.rows.numel()

    def _to_batch(self, cols: Columns, where: str) -> Batch:
        return to_batch(cols, self.F, self.rows, self.guard, where, self.norm, self.vocab, self.raw)

    def _split_segs(self, split: str) -> list[Segment]:
        if split not in ("test", "val"):
            raise ValueError(f"split={split!r}: must be test or val")
        return self.eval_segs if split == "test" else self.val_segs

    @property
    def val_rows(self) -> int:
        """Rows of the validation split (all ranks; 0 without one)."""
        return sum(s.rows for s in self.val_segs)

    def num_eval_steps(self, split: str = "test") -> int:
        segs = self._split_segs(split)
        per_rank = [sum(s.rows for s in rank_segments(segs, r, self.world)) for r in range(self.world)]
        return max(-(-n // self.cfg.eval_batch_size) for n in per_rank)

    def eval_batches(self, split: str = "test") -> Iterator[Batch]:
        """One pass over this rank's shard of the test (or validation) split; every rank yields
        num_eval_steps(split) batches."""
        if split not in self._eval:  # one reader per split for all evals: each pass reads one epoch
            self._eval[split] = BlockStream(self._split_segs(split), self.reader, self.rank, self.world, None,
                                            self.F)
        stream = self._eval[split]
        left = stream.rows
        for _ in range(self.num_eval_steps(split)):
            n = min(left, self.cfg.eval_batch_size)
            left -= n
            cols = stream.take(n) if n else self._empty()
            yield self._to_batch(cols, f"{'eval' if split == 'test' else 'validation'} batch")

    def _empty(self) -> Columns:
        return (torch.zeros(0), torch.zeros((0, self.F)), torch.zeros((0, self.rows.numel()), dtype=torch.int64))
