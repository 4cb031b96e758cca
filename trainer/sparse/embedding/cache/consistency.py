"""HET's consistency model as two small pure rules, shared by the trainer and the simulator.

Why pure functions over tensors: the owner answering a version check, the cache deciding which local
updates are due, and scripts/simulate_cache.py replaying a trace must apply the *same* rule; keeping
it here (no comm, no storage) makes that true by construction.

Versions: the owner of a row counts the updates applied to it (its version). A worker's cached copy
remembers the owner version it was read at. Read staleness = owner version now - version read at.
- pull: a cached copy may be used while its staleness is <= pull_bound; otherwise (or when there is
  no copy, version -1) the owner sends the row.
- push: a worker's local updates to a cached row are pushed once it holds more than push_bound of
  them (and on eviction and flush).
A bound of -1 means unbounded; bounds of 0 are bulk-synchronous (exact) training.

Lives (dynamic tables, embedding/dynamic.py): an id's row can be evicted and admitted again, a new
"life" from its initial value. A version then carries the life in its high bits: a row admitted at
step s starts at version (s + 1) << LIFE_SHIFT, and an id without a row answers
((step + 1) << LIFE_SHIFT) - 1 (ABSENT in the low bits). A copy of an earlier life is so far behind
that the pull rule always re-reads it; `life_changed` tells the cache that its pending updates
belong to that earlier life (they are dropped, never pushed into the new one), and every push
carries the life its updates were made in (`life_of`), so the owner drops a held-back push that
arrives after the id was evicted (and maybe admitted again). Fixed tables never leave life 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

UNBOUNDED = torch.iinfo(torch.int64).max
MISSING = -1  # the version sent for an id the worker has no copy of
HIST_BINS = 65  # staleness histogram: bins 0..63 exactly, bin 64 = 64 or more
LIFE_SHIFT = 32  # version = (admission step + 1) << LIFE_SHIFT + updates in this life
ABSENT = (1 << LIFE_SHIFT) - 1  # the low bits of the version an id without a row answers
CURRENT_LIFE = -1  # a push's life when its updates were made on the owner's current row


def _effective(bounds: list[int]) -> torch.Tensor:
    return torch.tensor([UNBOUNDED if b < 0 else b for b in bounds], dtype=torch.int64)


@dataclass
class Bounds:
    """Per-table pull and push bounds ([T] int64 each, unbounded as int64 max)."""

    pull: torch.Tensor
    push: torch.Tensor

    @classmethod
    def from_lists(cls, pull: list[int], push: list[int]) -> "Bounds":
        return cls(_effective(pull), _effective(push))

    def to(self, device: torch.device | str) -> "Bounds":
        """The same bounds on `device` (where the tables that index them live)."""
        return Bounds(self.pull.to(device), self.push.to(device))

    @property
    def is_bsp(self) -> bool:
        return bool((self.pull == 0).all() and (self.push == 0).all())

    @property
    def label(self) -> str:
        """bsp (all bounds 0), asp (all unbounded) or ssp (anything else), from the bounds in force."""
        if self.is_bsp:
            return "bsp"
        return "asp" if bool((self.pull == UNBOUNDED).all() and (self.push == UNBOUNDED).all()) else "ssp"


def needs_row(cached_version: torch.Tensor, owner_version: torch.Tensor,
              pull_bound: torch.Tensor) -> torch.Tensor:
    """[n] bool: the owner must send the row (no copy, or the copy is more than the bound behind).

    cached_version: [n] version the requester read its copy at (MISSING = no copy);
    owner_version:  [n] the owner's current versions; pull_bound: [n] bound of each row's table.
    """
    return (cached_version < 0) | (owner_version - cached_version > pull_bound)


def life_of(version: torch.Tensor) -> torch.Tensor:
    """[n] the life a version belongs to (0 for fixed tables)."""
    return version >> LIFE_SHIFT


def life_changed(old_version: torch.Tensor, new_version: torch.Tensor) -> torch.Tensor:
    """[n] bool: a copy read at old_version, re-read at new_version, is of another life of its id
    (or the id has no row now): the updates made on the old copy must not reach the new one."""
    absent = (new_version & ABSENT) == ABSENT
    return (life_of(old_version) != life_of(new_version)) | absent


def push_due(local_updates: torch.Tensor, push_bound: torch.Tensor) -> torch.Tensor:
    """[n] bool: cached rows whose pending local updates must be pushed now (count > bound)."""
    return local_updates > push_bound


def staleness_histogram(staleness: torch.Tensor, table: torch.Tensor, num_tables: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """[T, HIST_BINS] counts of read staleness per table (last bin: HIST_BINS - 1 or more), on the
    staleness' device; mask [n]: the entries counted (None: all). Counted into a fixed-size vector: bincount's length depends on the values,
    which costs a device sync per call."""
    b = staleness.clamp(0, HIST_BINS - 1)
    flat = torch.zeros(num_tables * HIST_BINS, dtype=torch.int64, device=staleness.device)
    flat.index_add_(0, table * HIST_BINS + b, torch.ones_like(b) if mask is None else mask.long())
    return flat.view(num_tables, HIST_BINS)
