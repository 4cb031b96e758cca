"""Segment: a run of rows of one prepared block file, the unit the splits are made of."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Rows [lo, hi) of one block file."""

    file: str
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo
