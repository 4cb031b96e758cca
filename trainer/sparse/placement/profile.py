"""Access profile: how often each embedding row is read, counted on a strided sample of the run's
training stream (FAE's profiler; the input of every planner).

Why strided over the whole run: the planners need row frequencies of the data the run will train
on, so the profile takes every k-th sample of the first steps x global-batch stream positions
(k = 1 / profile_fraction), not a prefix that would miss any drift. Rows are named by their flat id
(table start + id over the unpadded tables), which does not depend on W: the same data gives the
same profile, hence the same plan, for any number of workers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ...base.core.stop import StopRequested
from ...workload.data.source import GlobalData
from ..embedding.sharding import flat_ids


@dataclass
class AccessProfile:
    """Reads per row over `samples` profiled samples.

    ids:    [n] sorted flat ids (table start + id) of the rows read at least once
    counts: [n] reads of each (a multi-hot bag reading a row twice counts twice)
    """

    table_rows: list[int]
    samples: int
    ids: np.ndarray
    counts: np.ndarray

    def table_of(self, flat: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.cumsum(self.table_rows), flat, side="right")

    def by_frequency(self) -> np.ndarray:
        """Positions into ids/counts, most read first (ties: smaller flat id first)."""
        return np.lexsort((self.ids, -self.counts))

    def summary(self) -> dict[str, Any]:
        return {"samples": int(self.samples), "rows_seen": int(self.ids.size),
                "reads": int(self.counts.sum())}


def profile_stream(data: GlobalData, table_rows: list[int], stream_samples: int, fraction: float,
                   chunk: int = 1 << 16, interrupt: Optional[Callable[[], bool]] = None) -> AccessProfile:
    """Count reads per row over every k-th of the first `stream_samples` stream positions
    (k = round(1 / fraction)); `data` offers stream_keys(pos) and sample_ids(keys). interrupt():
    asked before each chunk; True raises StopRequested (a stop signal during start-up)."""
    stride = max(1, int(round(1.0 / fraction)))
    pos = np.arange(0, max(stream_samples, 1), stride, dtype=np.int64)
    ids, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for lo in range(0, pos.size, chunk):
        if interrupt is not None and interrupt():
            raise StopRequested("placement profiling")
        values, lengths = data.sample_ids(data.stream_keys(pos[lo:lo + chunk]))
        u, c = np.unique(flat_ids(values, lengths, table_rows), return_counts=True)
        ids, counts = _merge(ids, counts, u, c)
    return AccessProfile(list(table_rows), int(pos.size), ids, counts)


def _merge(a: np.ndarray, ca: np.ndarray, b: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    both = np.concatenate([a, b])
    u, inv = np.unique(both, return_inverse=True)
    return u, np.bincount(inv, weights=np.concatenate([ca, cb]), minlength=u.size).astype(np.int64)
