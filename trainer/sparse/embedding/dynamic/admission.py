"""Admission counting of a dynamic pool (embedding.admit_after = k > 1): how many steps each id
without a row has been seen, exactly or as a count-min sketch (embedding.admit_counter).

The pool (pool.py) asks `count(ids, step)` for the ids a step reads that hold no row (ascending,
distinct) and gets which of them are due (seen k steps, or estimated so); an id is counted once per
step however many calls (its owner's own batch, each peer's request) bring it. Both counters undo
a step's counts between begin() and rollback() (train.nonfinite=skip, fp16's skipped steps),
keeping what they save bounded by the step's ids, and both run on CPU and CUDA tensors alike.

- ExactCounts (`exact`, the default): an id -> (last step counted << 16 | steps seen) hash map
  (kernels.make_id_slot_map), an entry per id until it is admitted: 32 B per pending id as
  reported (a cell of two int64 at load 1/2; up to 86 B after a rebuild). Ids seen once and never
  again (the long tail) keep their entries: it grows with the distinct ids.
- CountMinCounts (`count_min`): `depth` rows of `width` int16 counters, one sketch per owner for
  all its tables (keyed by the gid, which carries the table: one memory budget spread where the
  traffic is, no per-table split to tune; the price is that a table's long tail raises every
  table's collisions). Row r hashes an id by splitmix64 (sharding.mix64) of gid + (r + 1) x
  splitmix64's increment, i.e. the id's SplitMix64 sequence past the owner's hash, and maps the
  high 32 bits to [0, width) by multiply-shift. Conservative update: a step's fresh id raises only
  its cells below its estimate + 1 (each cell to max(cell, estimate + 1), scatter amax: the same
  result in any order), counts saturate at k (more changes nothing), and an id is due when its
  estimate (the least of its cells) reaches k. Every cell of an id is at least its true count, so
  the estimate never under-counts: an id is admitted no later than with exact counting, sooner
  where it shares all its cells with busier ids. Its memory is fixed (depth x width x 2 B,
  embedding.count_min_bytes) whatever the number of distinct ids. A sketch cannot forget one id:
  an admitted id's cells keep their counts, so an evicted id that comes back is readmitted at once
  while they stand; `halve_steps` (embedding.count_min_halve_steps) halves every counter each
  time the step passes a multiple of it, so old sightings fade. Which ids share cells depends on
  which ids share an owner: W workers equal one process only where no id's estimate is raised by
  a collision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

import kernels
from ....base.core.hashing import mix64

_COUNT_BITS = 16  # exact: (step << 16) | count
_GAMMA = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: splitmix64's increment
COUNTERS = ("exact", "count_min")
CELL_BYTES = 2  # int16 counters
MAX_SKETCH_COUNT = (1 << 15) - 1


@dataclass(frozen=True)
class Counting:
    """How a pool counts ids before admission (embedding.admit_counter, count_min_bytes,
    count_min_depth, count_min_halve_steps)."""
    kind: str = "exact"
    sketch_bytes: int = 0
    depth: int = 4
    halve_steps: int = 0

    @classmethod
    def of(cls, e: Any) -> Counting:
        """The counting of an EmbeddingConfig (trainer/base/config/)."""
        return cls(e.admit_counter, e.count_min_bytes, e.count_min_depth, e.count_min_halve_steps)

    def sketch_width(self) -> int:
        """Counters per row of the sketch that fits sketch_bytes (0: none fits)."""
        return self.sketch_bytes // (CELL_BYTES * self.depth)

    def sketch_bytes_held(self) -> int:
        """The bytes a count-min sketch holds (depth x width int16 counters; 0 for exact)."""
        return CELL_BYTES * self.depth * self.sketch_width() if self.kind == "count_min" else 0


Counter = Union["ExactCounts", "CountMinCounts"]


def make_counter(admit_after: int, device: torch.device, counting: Counting) -> Counter | None:
    """The pool's admission counter; None when ids are admitted at once (admit_after 1)."""
    if admit_after <= 1:
        return None
    if counting.kind == "exact":
        return ExactCounts(admit_after, device)
    if counting.kind == "count_min":
        return CountMinCounts(admit_after, device, counting)
    raise ValueError(f"embedding.admit_counter={counting.kind!r} is not one of {', '.join(COUNTERS)}")


def counter_figures(counter: Counter | None) -> dict[str, int]:
    """What a pool's counter reports (report.dynamic_summary, per owner): pending_ids (exact: the
    ids counted and not admitted; count_min: an estimate, CountMinCounts.pending_ids),
    pending_bytes_per_id (exact: 32, the map's cell at load 1/2, up to 86 B after a rebuild, on the
    CPU and in the Triton table alike; count_min: 0, its bytes are fixed) and admission_bytes (what
    counting holds now)."""
    if counter is None:
        return {"pending_ids": 0, "pending_bytes_per_id": 0, "admission_bytes": 0}
    return {"pending_ids": counter.pending_ids(), "admission_bytes": counter.bytes(),
            "pending_bytes_per_id": ExactCounts.BYTES_PER_ID if counter.kind == "exact" else 0}


class ExactCounts:
    """Exact counting: an id -> (last step counted << 16 | steps seen) map (module docstring)."""

    kind = "exact"
    BYTES_PER_ID = 32  # a map cell of key + packed value (16 B) at load 1/2

    def __init__(self, admit_after: int, device: torch.device) -> None:
        self.admit_after = admit_after
        self.map = kernels.make_id_slot_map(1024, device)
        self._journal: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def count(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        """Count ids [n] (ascending, distinct, holding no row) seen in `step`, once per step;
        [n] bool: due (seen admit_after steps)."""
        val, absent = self.map.lookup(ids)
        seen = val & ((1 << _COUNT_BITS) - 1)
        counted = (val >> _COUNT_BITS) == step
        cnt = torch.where(absent, torch.ones_like(val), torch.where(counted, seen, seen + 1))
        if self._journal is not None:  # 17 B per rewritten count
            self._journal.append((ids.clone(), val.clone(), absent.clone()))
        self.map.insert(ids, (step << _COUNT_BITS) | cnt)
        return cnt >= self.admit_after

    def admitted(self, ids: torch.Tensor) -> None:
        """Ids [m] got a row: their counts go."""
        self.map.erase(ids)

    def pending_ids(self) -> int:
        return len(self.map)

    def bytes(self) -> int:
        """The figure reported for what counting holds now: BYTES_PER_ID per pending id."""
        return self.BYTES_PER_ID * len(self.map)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [m], values [m]) of every pending count (checkpoints)."""
        return self.map.items()

    def load(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Replace every count by those of ids [m] (a checkpoint's)."""
        self.map.erase(self.map.items()[0])
        if ids.numel():
            self.map.insert(ids.to(self.map.device), values.to(self.map.device))

    def begin(self) -> None:
        self._journal = []

    def commit(self) -> None:
        self._journal = None

    def rollback(self) -> None:
        """Every count rewritten since begin() back (newest first; ids that had none erased)."""
        for ids, val, absent in reversed(self._journal or []):
            if bool(absent.any()):
                self.map.erase(ids[absent])
            if not bool(absent.all()):
                self.map.insert(ids[~absent], val[~absent])
        self._journal = None


class CountMinCounts:
    """A count-min sketch with conservative update (module docstring)."""

    kind = "count_min"

    def __init__(self, admit_after: int, device: torch.device, counting: Counting) -> None:
        if admit_after > MAX_SKETCH_COUNT:
            raise ValueError(f"embedding.admit_after={admit_after}: count_min's int16 counters count to "
                             f"{MAX_SKETCH_COUNT}")
        self.admit_after, self.depth, self.width = admit_after, counting.depth, counting.sketch_width()
        if self.width < 1 or self.depth < 1:
            raise ValueError(f"embedding.count_min_bytes={counting.sketch_bytes}: too small for "
                             f"{counting.depth} rows of int16 counters")
        self.halve_steps, self.epoch = counting.halve_steps, 0  # epoch: the step // halve_steps halved to
        self.cells = torch.zeros(self.depth * self.width, dtype=torch.int16, device=device)
        # each row's hash offset (the id's SplitMix64 sequence: gid + (r + 1) x gamma) and first cell
        self._offset = (torch.arange(1, self.depth + 1, dtype=torch.int64, device=device) * _GAMMA).unsqueeze(1)
        self._row0 = (torch.arange(self.depth, dtype=torch.int64, device=device) * self.width).unsqueeze(1)
        self._step, self._seen = -1, torch.zeros(0, dtype=torch.int64, device=device)  # ids counted in _step
        self._journal: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._kept: tuple[int, torch.Tensor] = (self._step, self._seen)

    def where(self, ids: torch.Tensor) -> torch.Tensor:
        """[depth, n] the cells (flat indices) of ids [n]."""
        h = mix64(ids.unsqueeze(0) + self._offset)
        return (((h >> 32) & 0xFFFFFFFF) * self.width >> 32) + self._row0

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] int64 the sketch's count of ids [n]: never below the steps each was seen (since its
        cells were last halved)."""
        if not ids.numel():
            return ids.clone()
        return self.cells[self.where(ids)].amin(0).long()

    def count(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        """Count ids [n] (distinct, holding no row) seen in `step`, once per step (ids counted
        earlier in the step are only asked); [n] bool: due (estimate >= admit_after)."""
        self._halve_to(step)
        if step != self._step:
            self._step, self._seen = step, ids[:0]
        at = self.where(ids)
        fresh = ~torch.isin(ids, self._seen) if self._seen.numel() else torch.ones_like(ids, dtype=torch.bool)
        if bool(fresh.any()):
            mine = at[:, fresh]
            value = self.cells[mine].amin(0).clamp_(max=self.admit_after - 1) + 1  # saturates at k
            flat = mine.reshape(-1)
            if self._journal is not None:  # 10 B per cell raised, depth cells per counted id
                self._journal.append((flat, self.cells[flat]))
            self.cells.scatter_reduce_(0, flat, value.expand(self.depth, -1).reshape(-1), "amax")
            self._seen = torch.cat([self._seen, ids[fresh]])
        return self.cells[at].amin(0) >= self.admit_after

    def _halve_to(self, step: int) -> None:
        """Halve every counter once for each multiple of halve_steps passed since the last halving
        (lazily, at the first count of a step: the same counts as halving at every boundary)."""
        if not self.halve_steps:
            return
        epoch = step // self.halve_steps
        if epoch > self.epoch:
            self.cells >>= min(epoch - self.epoch, 15)
            self.epoch = epoch

    def admitted(self, ids: torch.Tensor) -> None:
        """A sketch cannot forget an id: its cells keep their counts (module docstring)."""

    def pending_ids(self) -> int:
        """An estimate of the ids holding a count in the sketch (admitted ones included): linear
        counting over each row's zero cells (every counted id makes its cells nonzero, until
        halving clears them), averaged over the rows."""
        zeros = (self.cells.view(self.depth, self.width) == 0).sum(1).double().clamp(min=1)
        return round(float((-self.width * torch.log(zeros / self.width)).mean()))

    def bytes(self) -> int:
        return self.cells.numel() * self.cells.element_size()

    def load(self, sketches: list[tuple[torch.Tensor, int]],
             exact: tuple[torch.Tensor, torch.Tensor] | None = None, step: int = 0) -> None:
        """The sketch from a checkpoint's: saved sketches, (cells [depth x width], epoch) each, or
        exact counts, (ids [m], (step << 16 | count) [m]) of the ids this owner holds now, saved at
        `step`. Sketches: their element-wise max, each first halved to the latest epoch: each id's
        count lived in its owner's sketch then, so the max never under-counts it, at the same W
        (one sketch: itself) or at another (and adds less of other owners' ids than a sum). Exact
        counts: each id's cells raised to its count (as counted, in the epoch of `step`)."""
        self.cells.zero_()
        self.epoch = max((e for _, e in sketches), default=step // self.halve_steps if self.halve_steps else 0)
        for cells, epoch in sketches:
            if cells.numel() != self.cells.numel():
                raise ValueError(f"{cells.numel()} saved counters, this sketch has {self.cells.numel()}")
            cells = cells.to(self.cells.device, torch.int16) >> min(self.epoch - epoch, 15)
            torch.maximum(self.cells, cells, out=self.cells)
        if exact is not None and exact[0].numel():
            count = (exact[1] & ((1 << _COUNT_BITS) - 1)).clamp(max=self.admit_after).to(torch.int16)
            self.cells.scatter_reduce_(0, self.where(exact[0]).reshape(-1), count.expand(self.depth, -1).reshape(-1),
                                       "amax")
        self._step, self._seen = -1, self._seen[:0]

    def begin(self) -> None:
        self._journal, self._kept = [], (self._step, self._seen)

    def commit(self) -> None:
        self._journal = None

    def rollback(self) -> None:
        """Every counter raised since begin() back (newest first), and the step's counted ids. A
        halving in the step stays: the skipped step's number is spent (as LFU's decay counts it)."""
        for flat, old in reversed(self._journal or []):
            self.cells.index_copy_(0, flat, old)
        self._step, self._seen = self._kept
        self._journal = None

