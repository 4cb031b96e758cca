"""The remote-row protocol: how a worker reads the rows it does not own and returns their gradients.

HybridEmbedding (module.py) splits a batch's rows into replicated, owned and remote ones; the remote
ones go through one `RemoteRows` object chosen by config:

- plain.PlainRemote: no cache; every remote row is pulled and its gradient pushed in the same step;
- het.HetRemote: HET's cache with per-row version clocks and bounded pull/push staleness;
- on_demand.HeraldRemote: Herald's on-demand synchronisation, driven by the scheduler's global plan.

Every protocol answers the same calls; read/write/flush are collective (every rank calls them for
the same step), discard communicates nothing. A protocol keeps no state of a step in flight: read
returns it (`read`: what the write or the discard of that step needs) and the caller hands it back
(HybridEmbedding keeps it in the step's InFlightStep, embedding/types.py), so two steps in flight
at once (train.pipeline) can never be confused:

- read(plan, ws, step, sync, token) -> read: fill the workspace rows ws[plan.remote_pos]; a
  pipelined step splits it: begin(plan) -> token (the request, one step early), serve(token) (the
  owners answer; or serve_settled(token, owned, read) one step early for the rows the current step,
  whose read that is, leaves alone), read;
- write(plan, grad, read) -> Pushes: send this step's remote row gradients; return what this rank
  received as owner (applied by the caller once per row, together with its own rows);
  write_start(plan, grad, read) is the same split in two: it starts the push and returns a function
  that waits for what arrives, so the caller can start the dense allreduce behind the pushes;
- flush() -> Pushes | None: push whatever is still pending (before eval, checkpoint, exit); None when
  the protocol never holds anything (no collective runs then);
- discard(read): drop the step instead of write (train.nonfinite=skip): nothing is written anywhere,
  and a protocol with state leaves it exactly as it was before read (its undo journal, switched on
  by enable_undo(), makes that possible);
- stats / staleness: its per-table counters (None when it keeps none).

The wire itself is a separate object (the `exchange` each protocol is given), so the simulator
drives the very same protocol objects through an in-process exchange (trainer/sparse/sim/).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

import torch

from ..cache.consistency import HIST_BINS, staleness_histogram
from ..types import LookupPlan, Pushes

CACHE_COUNTERS = ("requested", "hits", "fresh_hits", "pulled", "transient", "pushed_rows",
                  "pushed_updates", "evicted_dirty", "old_life_updates")


def _read_weights() -> torch.Tensor:
    """[8, 5]: which of the read counters (requested, hits, fresh_hits, pulled, transient) a read
    adds to, for each outcome code hit + 2 * pulled + 4 * transient."""
    rows = []
    for code in range(8):
        hit, pulled, transient = code & 1, (code >> 1) & 1, (code >> 2) & 1
        rows.append([1, hit, hit * (1 - pulled), pulled, transient])
    return torch.tensor(rows, dtype=torch.int64)


_READ_COUNTERS = CACHE_COUNTERS[:5]
_READ_WEIGHTS = _read_weights()


class CacheStats:
    """Per-table counters of a worker's cache traffic ([T] int64 each).

    The counters are rows of one [len(CACHE_COUNTERS), T] tensor (`t` maps names to them), so a
    step's reads are counted with one index_add_ of (table, outcome) and one small weighted sum."""

    def __init__(self, num_tables: int, device: torch.device) -> None:
        self.all = torch.zeros(len(CACHE_COUNTERS), num_tables, dtype=torch.int64, device=device)
        self.t = {k: self.all[i] for i, k in enumerate(CACHE_COUNTERS)}
        self.num_tables = num_tables
        self._read_weights = _READ_WEIGHTS.to(device)

    def add(self, key: str, tables: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Count rows of `tables` [n] (each weighted by weights [n]: a 0/1 mask or a count) into
        counter `key`. index_add_ into the fixed [T] counter: no masked selection, no bincount
        (both would read a size back from the device)."""
        w = torch.ones_like(tables) if weights is None else weights.to(torch.int64)
        self.t[key].index_add_(0, tables, w)

    def reads(self, table: torch.Tensor, hit: torch.Tensor, need: torch.Tensor,
              transient: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """One step's remote reads ([Ur] each): table, cache hit, row pulled, transient (None:
        none was); mask: the entries that are reads (a fixed-shape step's; None: all)."""
        code = (table * 8).add_(hit).add_(need, alpha=2)  # (table, outcome)
        if transient is not None:
            code.add_(transient, alpha=4)
        per = torch.zeros(self.num_tables * 8, dtype=torch.int64, device=table.device)
        per.index_add_(0, code, torch.ones_like(code) if mask is None else mask.long())  # fixed size: no count read back
        # [T, 8] x [8, 5] as a broadcast sum (integer matmul has no CUDA kernel)
        self.all[:len(_READ_COUNTERS)] += (per.view(self.num_tables, 8).unsqueeze(2) * self._read_weights).sum(1).t()

    def pushes(self, table: torch.Tensor, counts: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Rows pushed ([n] table of each) and the updates they carry ([n] counts); mask: the
        entries that are pushes (None: all)."""
        ones = torch.ones_like(table) if mask is None else mask.long()
        self.t["pushed_rows"].index_add_(0, table, ones)
        self.t["pushed_updates"].index_add_(0, table, counts.to(torch.int64) * ones)

    def vector(self) -> torch.Tensor:
        """[len(CACHE_COUNTERS) * T] float64, for one allreduce over ranks."""
        return self.all.flatten().double().cpu()


class StalenessStats:
    """Owner side: the staleness of the reads it let through, per table (histogram + max)."""

    def __init__(self, num_tables: int, device: torch.device) -> None:
        self.num_tables = num_tables
        self.hist = torch.zeros(num_tables, HIST_BINS, dtype=torch.int64, device=device)
        self.max = torch.zeros(num_tables, dtype=torch.int64, device=device)

    def record(self, gap: torch.Tensor, table: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Reads of staleness `gap` [n] (0 where the row was sent) in tables `table` [n]; mask:
        the entries that are reads (None: all)."""
        self.hist += staleness_histogram(gap, table, self.num_tables, mask)
        self.max.scatter_reduce_(0, table, gap if mask is None else gap * mask, reduce="amax")


class Audit:
    """Test-only record (embedding.audit=true): every cached-path remote read (step, gid, version
    read at), every owner version change (step, gid, version after), the sum of row gradients."""

    def __init__(self, n_ids: int, dim: int) -> None:
        self.reads: list[torch.Tensor] = []
        self.updates: list[torch.Tensor] = []
        self.grads = torch.zeros(n_ids, dim, dtype=torch.float64)

    def read(self, step: int, gids: torch.Tensor, versions: torch.Tensor) -> None:
        self.reads.append(torch.stack([torch.full_like(gids, step), gids, versions], 1).cpu())

    def update(self, step: int, gids: torch.Tensor, versions: torch.Tensor) -> None:
        self.updates.append(torch.stack([torch.full_like(gids, step), gids, versions], 1).cpu())

    def result(self) -> dict[str, torch.Tensor]:
        empty = torch.zeros(0, 3, dtype=torch.int64)
        return {"reads": torch.cat(self.reads) if self.reads else empty,
                "updates": torch.cat(self.updates) if self.updates else empty, "grads": self.grads}


class RemoteRows(ABC):
    """A remote-row protocol (see the module docstring for the contract of each call)."""

    stats: Optional[CacheStats] = None
    staleness: Optional[StalenessStats] = None

    def begin(self, plan: LookupPlan) -> Any:
        """Start the part of the read of `plan` that does not depend on any update (a pipelined
        step calls it one step early); returns a token for serve / read, or None when the protocol
        has no such part. Collective."""
        return None

    def serve(self, token: Any) -> None:
        """Answer a begun read from the owners' rows as they are NOW (a pipelined step with
        train.pipeline=rows calls it before the current step's updates). Collective."""

    def serve_settled(self, token: Any, owned: torch.Tensor, read: Any) -> None:
        """Answer now the part of a begun read that the current step's update cannot change
        (train.pipeline=ids: exact), the rest at its read; owned: the global ids of this rank's
        own rows in the current step, read: the current step's read. Protocols without such a
        part do nothing. Collective."""

    def cancel(self, token: Any) -> None:
        """Drop a begun read that will not be used (its step was skipped): wait for what is in
        flight, answer nothing. Collective."""

    @abstractmethod
    def read(self, plan: LookupPlan, ws: torch.Tensor, step: int, sync: Any = None, token: Any = None) -> Any:
        """Fill ws[plan.remote_pos] with the remote rows of this training step (token: from begin,
        for this plan); returns what write or discard of the step need. Collective."""

    def write(self, plan: LookupPlan, grad: torch.Tensor, read: Any) -> Pushes:
        """Send the step's remote row gradients; return the pushes this rank received as owner."""
        return self.write_start(plan, grad, read)()

    @abstractmethod
    def write_start(self, plan: LookupPlan, grad: torch.Tensor, read: Any) -> Callable[[], Pushes]:
        """write(), split: start sending the row gradients; the returned function waits for the
        pushes this rank receives as owner and returns them (the caller may start other
        collectives in between, e.g. the dense allreduce)."""

    @abstractmethod
    def flush(self) -> Optional[Pushes]:
        """Push everything pending; None when nothing can ever be pending (no collective)."""

    @abstractmethod
    def discard(self, read: Any) -> None:
        """Drop the step whose read this is instead of writing it; leave no trace (no communication)."""

    def enable_undo(self) -> None:
        """Journal each read so that discard() can restore the state before it (protocols whose
        read changes local state override this; the others are exact without a journal)."""
