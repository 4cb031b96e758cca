"""Validation-driven training: early stopping on validation AUC and the best model kept in memory.

EarlyStopping is the decision: each validation evaluation either is a new best (AUC above the best
so far by more than min_delta) or counts towards `patience`; the run stops once `patience`
evaluations in a row brought no new best. Every rank computes the same AUC from the same gathered
logits, so every rank takes the same decision with no message, and at BSP a W-worker run stops at
the same step as the single process.

BestSnapshot keeps the best model beside the run, not in a checkpoint. Why: a checkpoint writes every
row of every shard (1.6 GB for 26 tables of 1M rows at d = 16) and would be written at every new
best; the snapshot copies only what changed, in memory for a small shard or in a temporary file for
a big one (snapshot_rows.py: a huge shard is never doubled in memory). At a validation evaluation the caches are already
flushed (evaluate() flushes: pending cache pushes applied, replicated rows and Herald's lent rows
written back), so the owners' shards hold every row. The snapshot then takes
- the dense model's state (parameters and buffers, a few MB at most);
- the shard rows written since the previous snapshot (ShardStore.touched), one window of rows at a
  time, over the values it already holds. A row never written still has its initial value, a pure
  function of (seed, table, id), so it needs no copy.
Sparse optimizer state is not kept: the restored model is evaluated, never trained further.
Dynamic tables (a row is a pool slot, which an id may lose and another take after the snapshot):
each written slot's id and version are kept too (snapshot_rows.SnapshotSlots, 16 B per slot), and
restoring puts them back before the rows (a slot free at the snapshot is free again: zeros), then
rebuilds the pool's id -> slot map, so the restored pool holds the ids of the best step, in the
same slots and lives, with their rows; ids it does not hold read the default row (zeros) as ever.
The pool's scores, pending counts and counters stay the end's (nothing trains after the restore;
summary.json's `dynamic` block is the run's as trained, taken before it).

Restoring puts back the dense state and every row written since the snapshot (its snapshot value,
or its initial value if the snapshot never saw it), then reloads the replica of hot rows from the
owners (collective). It is the run's last change to the model: the final checkpoint (for resume) is
written before it, at the step training stopped, and holds the live model.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Optional

import torch

from ...base.core.errors import phase
from ...base.core.snapshot_rows import SnapshotRows, SnapshotSlots, in_memory


class EarlyStopping:
    """Best validation AUC so far, its step, and evaluations since then (patience 0: never stop;
    no stop before min_evals evaluations)."""

    def __init__(self, patience: int, min_delta: float, min_evals: int = 0) -> None:
        self.patience, self.min_delta, self.min_evals = patience, min_delta, min_evals
        self.evals = 0  # validation evaluations so far
        self.best_auc: Optional[float] = None
        self.best_step: Optional[int] = None
        self.best: Optional[dict[str, Any]] = None  # the best evaluation record
        self.since = 0  # evaluations since the best
        self.stopped_at: Optional[int] = None

    def update(self, step: int, ev: dict[str, Any]) -> bool:
        """Record validation evaluation `ev` after `step` steps; True when it is a new best."""
        auc = ev.get("eval_auc")
        self.evals += 1
        better = auc is not None and math.isfinite(auc) and (
            self.best_auc is None or auc > self.best_auc + self.min_delta)
        if better:
            self.best_auc, self.best_step, self.best, self.since = auc, step, dict(ev), 0
        else:
            self.since += 1
        if self.patience > 0 and self.since >= self.patience and self.evals >= self.min_evals \
                and self.stopped_at is None:
            self.stopped_at = step
        return better

    @property
    def stop(self) -> bool:
        return self.stopped_at is not None

    def state(self) -> dict[str, Any]:
        return {"best_auc": self.best_auc, "best_step": self.best_step, "best": self.best,
                "since": self.since, "stopped_at": self.stopped_at, "evals": self.evals}

    def load(self, state: Optional[dict[str, Any]]) -> None:
        if state:
            self.best_auc, self.best_step, self.best = state["best_auc"], state["best_step"], state["best"]
            self.since, self.stopped_at = state["since"], state["stopped_at"]
            self.evals = state.get("evals", self.min_evals)  # a checkpoint from before the count: no minimum


class BestSnapshot:
    """The best model of this rank: dense state + the shard rows trained so far (see module doc)."""

    def __init__(self, model: torch.nn.Module, emb: Any, fresh: bool = True, mode: str = "auto",
                 directory: Optional[str] = None) -> None:
        """fresh: the shard still holds its initial rows. A resumed run's shard does not (the
        checkpoint's rows), so its first snapshot copies every row of the shard. mode / directory:
        where the rows are kept (snapshot_rows.in_memory; the file's directory)."""
        self.model, self.emb, self.store = model, emb, emb.store
        self.step: Optional[int] = None
        self.dense: Optional[dict[str, torch.Tensor]] = None
        with self.store.raw(write=False):
            w = self.store.weight
            self.kept = SnapshotRows(w, in_memory(mode, w.shape[0], w.shape[1] * w.element_size()), directory)
            self.slots = SnapshotSlots(self.store.pool.slot_gid) if self.store.dynamic else None
        # from here on, touched = written since the last snapshot (all rows: not at their init)
        self.store.mark_all_touched(not fresh)

    def take(self, step: int) -> None:
        """Snapshot the model as it is now (caches must be flushed: evaluate() does it)."""
        self.dense = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        with self.store.raw(write=False):
            if self.slots is not None:
                self.slots.put(self.store.pool.slot_gid, self.store.version, self.store.touched, self.kept.windows())
            self.kept.put(self.store.weight, self.store.touched, self.store.release)
        self.store.mark_all_touched(False)
        self.step = step

    @property
    def held_rows(self) -> int:
        return self.kept.held_rows

    def restore(self, comm: Any) -> int:
        """Put the snapshot back (collective when hot rows are replicated); returns the rows this
        rank reset. Caches must be flushed (the final validation evaluation did it)."""
        if self.dense is None:
            raise RuntimeError("no snapshot to restore")
        self.model.load_state_dict(self.dense)
        with self.store.raw(write=True):
            n = self._restore_rows()
        if self.emb.replica is not None:  # the replica follows its owners again
            self.emb.replica.load_from_owners(comm, self.store)
        return n

    def _restore_rows(self) -> int:
        store, n = self.store, 0
        for a, b in self.kept.windows():  # temporaries: one window of rows
            changed = torch.nonzero(store.touched[a:b]).squeeze(1) + a
            if changed.numel():
                self._restore_window(changed)
                n += int(changed.numel())
            store.release()  # a shard on disk: the window's pages leave the process
        store.mark_all_touched(False)
        if self.slots is not None:
            store.pool.reindex()  # the id -> slot map and free slots of the restored ids
        return n

    def _restore_window(self, changed: torch.Tensor) -> None:
        """Rows `changed` (of one window) back to their snapshot values, or their initial ones
        where the snapshot held none."""
        store = self.store
        seen = self.kept.held[changed]
        if self.slots is not None:  # ids first: a slot's initial row is its id's (free: zeros)
            self.slots.restore(store.pool.slot_gid, store.version, changed, seen)
        values = torch.empty(changed.numel(), store.dim, dtype=store.dtype, device=store.device)
        if bool(seen.any()):
            values[seen] = self.kept.values(changed[seen])
        if bool((~seen).any()):
            values[~seen] = store.initial_rows(changed[~seen])
        store.weight.index_copy_(0, changed, values)

    def close(self) -> None:
        """Free the kept rows (the disk file goes)."""
        self.kept.close()


def restore_best(best: Optional[BestSnapshot], early: EarlyStopping, comm: Any, end: int) -> dict[str, Any]:
    """Put the best validation model back for the final test evaluation (if another model was
    trained after it; collective then); returns summary.json's early-stopping fields. `end`: the
    step training stopped at."""
    e = early
    restored = False
    if best is not None and best.step is not None and best.step != end:
        with phase(comm, "other"):
            best.restore(comm)
        restored = True
    elif best is not None and best.step is None and e.best_step is not None and e.best_step != end \
            and comm.rank == 0:
        print(f"[trainer] warning: the best validation model (step {e.best_step}) was trained before "
              "the resume and is not in memory: the test evaluation uses the last model", file=sys.stderr)
    record = e.best or {}
    return {"best_step": e.best_step, "val_auc": record.get("eval_auc"), "val_logloss": record.get("eval_logloss"),
            "val_samples": record.get("eval_samples", 0),
            "early_stop": {"patience": e.patience, "min_delta": e.min_delta, "stopped_early": e.stop,
                           "stopped_at": e.stopped_at, "evaluated_model_step": e.best_step if restored or (
                               e.best_step == end) else end, "restored": restored,
                           "snapshot_rows": best.held_rows if best is not None else 0}}
