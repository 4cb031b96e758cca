"""One rank's reporting (Reporter): counters summed over ranks and formatted into metrics.jsonl's
lines, TensorBoard's scalars, the progress bar and summary.json; the `dynamic` block.

Collective: every rank calls step_record / summary at the same points (they allreduce counters);
only rank 0 writes files.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict
from typing import Any, Optional

import numpy as np
import torch

from ...sparse.side import Sparse
from ...base.comm import EMBEDDING_KINDS, KINDS, Collectives
from ...base.config import Config
from ...base.core.errors import phase
from ...base.core.progress import Bar
from ...sparse.embedding.dynamic.admission import counter_figures
from ...sparse.embedding.cache.consistency import HIST_BINS, UNBOUNDED
from ...sparse.embedding.module import CACHE_COUNTERS
from ...sparse.embedding.dynamic.pool import POOL_COUNTERS
from ...sparse.embedding.remote import het_wire_bytes
from ...sparse.schedule import HotColdOrder
from ...workload.data.source import GuardedSource
from .tensorboard import TensorBoardWriter
from .writers import JsonlWriter, keep_records_until, write_summary



class Reporter:
    """One rank's reporting: counters summed over ranks, files written by rank 0."""

    def __init__(self, c: Config, comm: Collectives, sparse: Sparse, data: GuardedSource, global_batch: int,
                 out_dir: Optional[str]) -> None:
        self.c, self.comm, self.sparse, self.data = c, comm, sparse, data
        self.emb, self.global_batch, self.out_dir = sparse.emb, global_batch, out_dir
        self.metrics, self.tb = JsonlWriter(None), TensorBoardWriter(None)  # no files before start()
        self.bar: Optional[Bar] = None  # rank 0's progress bar, from start()

    # ---- lines during the run -----------------------------------------------------------
    def start(self, start_step: int, resumed_from: Optional[str] = None, saved_world: Optional[int] = None) -> None:
        """Open metrics.jsonl (appended to), TensorBoard and the progress bar (rank 0). After a
        resume, metrics.jsonl first loses the records after the resumed step (the interrupted
        run's steps that are trained again) and gains a resume line: the checkpoint, its step, the
        W that saved it and this run's (an elastic restart changes W)."""
        if self.out_dir is not None and self.comm.rank == 0:
            path = os.path.join(self.out_dir, "metrics.jsonl")
            if resumed_from is not None:
                keep_records_until(path, start_step)
            self.metrics = JsonlWriter(path)
            if resumed_from is not None:
                self.metrics.write({"event": "resume", "from": resumed_from, "step": start_step,
                                    "saved_world_size": saved_world, "world_size": self.comm.size})
            if self.c.train.tensorboard:
                self.tb = TensorBoardWriter(os.path.join(self.out_dir, "tensorboard"))
        mode = self.c.train.progress
        if self.comm.rank == 0 and (mode == "on" or (mode == "auto" and sys.stderr.isatty())):
            self.bar = Bar(self.c.train.steps, f"train W={self.comm.size}", unit="step", initial=start_step)

    def progress(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1, {"loss": f"{loss:.4f}"})

    def step(self, step: int, loss: float, samples_per_sec: float) -> None:
        """The metrics line of `step` (0-based; the line says step + 1 steps done). Collective."""
        s = self.emb.stats
        s.settle()
        rec = {"step": step + 1, "loss": loss if math.isfinite(loss) else None,  # None: a skipped step
               "samples_per_sec": samples_per_sec, "bytes": self.global_bytes("train"),
               "rank0_ids": s.ids, "rank0_unique": s.unique, "rank0_remote": s.remote}
        if self.emb.cache is not None:
            rec["cache"] = self.cache_summary()  # so far: totals, per table, staleness histogram
        if self.emb.store.dynamic:
            rec["dynamic"] = dynamic_summary(self.comm, self.emb.store)
        self.metrics.write(rec)
        self.tb.step(rec)

    def eval(self, ev: dict[str, Any]) -> None:
        self.metrics.write({"event": "eval", **ev})
        self.tb.eval(ev["step"], ev)

    def close(self) -> None:
        self.metrics.close()
        self.tb.close()
        if self.bar is not None:
            self.bar.close()

    # ---- counters summed over ranks -----------------------------------------------------
    def global_bytes(self, phase_name: str) -> dict[str, int]:
        """Bytes per kind summed over ranks (the sum itself runs in phase 'other')."""
        local = torch.tensor([self.comm.counter.totals(phase_name)[k] for k in KINDS], dtype=torch.float64)
        with phase(self.comm, "other"):
            total = self.comm.allreduce(local, op="sum", kind="meta")
        return {k: int(v) for k, v in zip(KINDS, total.tolist())}

    def _sum(self, values: list[float]) -> list[float]:
        local = torch.tensor(values, dtype=torch.float64)
        with phase(self.comm, "other"):
            return self.comm.allreduce(local, op="sum", kind="meta").tolist()

    def _cache_totals(self) -> dict[str, np.ndarray]:
        """Cache counters [T] summed over ranks (max for staleness), plus the staleness histogram."""
        remote, t = self.emb.remote, self.sparse.sharding.num_tables
        st, stale = remote.stats, remote.staleness
        pending = torch.tensor([float(self.emb.cache.pending_updates())], dtype=torch.float64)
        with phase(self.comm, "other"):
            summed = self.comm.allreduce(torch.cat([st.vector(), stale.hist.flatten().double().cpu(),
                                                    pending]), op="sum", kind="meta").numpy()
            mx = self.comm.allgather(stale.max.cpu().reshape(1, -1), kind="meta").numpy()
        out = {k: summed[i * t:(i + 1) * t] for i, k in enumerate(CACHE_COUNTERS)}
        n = len(CACHE_COUNTERS) * t
        out["staleness_hist"] = summed[n:n + t * HIST_BINS].reshape(t, HIST_BINS)
        out["pending_updates"] = summed[-1:]
        out["max_staleness"] = mx.max(0)
        return out

    def cache_summary(self) -> Optional[dict[str, Any]]:
        """summary.json's `cache` block: hit rates, pulls, pushes, version-check bytes, staleness,
        per table and in total (bytes computed from counts and wire sizes)."""
        if self.emb.cache is None:
            return None
        c, tot, bounds = self.c, self._cache_totals(), self.sparse.bounds
        wire = self.emb.remote.wire.wire_dtype.itemsize
        nb = het_wire_bytes(tot["requested"], tot["pulled"], tot["pushed_rows"], self.emb.dim,
                            self.emb.remote.wire.row_elem, wire)
        check = nb["version_check"]
        pull_b, push_b = bounds.pull.tolist(), bounds.push.tolist()
        caps = self.emb.cache.capacities
        tables = [{"table": i, "capacity_rows": caps[i], "pull_bound": _bound(pull_b[i]),
                   "push_bound": _bound(push_b[i]),
                   **{k: int(tot[k][i]) for k in CACHE_COUNTERS},
                   "hit_rate": _ratio(tot["hits"][i], tot["requested"][i]),
                   "version_check_bytes": int(check[i]), "row_bytes": int(nb["rows"][i]),
                   "push_bytes": int(nb["pushes"][i]),
                   "max_staleness": int(tot["max_staleness"][i])} for i in range(len(caps))]
        hist = tot["staleness_hist"].sum(0)
        return {"policy": c.cache.policy, "consistency": bounds.label,
                "pull_bound": _bound(c.consistency.pull_bound), "push_bound": _bound(c.consistency.push_bound),
                "capacity_rows": int(sum(caps)),
                **{k: int(tot[k].sum()) for k in CACHE_COUNTERS},
                "hit_rate": _ratio(tot["hits"].sum(), tot["requested"].sum()),
                "fresh_hit_rate": _ratio(tot["fresh_hits"].sum(), tot["requested"].sum()),
                "version_check_bytes": int(check.sum()),
                "pending_updates": int(tot["pending_updates"][0]),
                "staleness": {"max": int(tot["max_staleness"].max()),
                              "hist": {str(b) if b < HIST_BINS - 1 else f">={b}": int(n)
                                       for b, n in enumerate(hist) if n}},
                "tables": tables}

    # ---- summary.json -------------------------------------------------------------------
    def summary(self, train_time: float, final_eval: dict[str, Any], losses: list[float],
                evals: list[dict[str, Any]], start_step: int, resumed_from: Optional[str],
                checkpoint: Optional[str], alltoalls: dict[str, int], end_step: Optional[int] = None,
                checkpoint_error: Optional[dict[str, Any]] = None,
                extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """The run's summary (collective); rank 0 also writes it to OUT/summary.json. end_step: the
        step the run reached (train.steps unless an early stop, a stop signal or a failed save stopped
        it, see checkpoint_error); extra: the validation / early-stopping fields and the recipe
        (runner.Trainer). Rates and per-sample / per-step figures are None when this process
        trained no step (a resume at the final step): there is nothing to divide."""
        c, emb = self.c, self.emb
        end = c.train.steps if end_step is None else end_step
        samples = end * self.global_batch
        trained = end - start_step  # steps run by this process (after a resume)
        run_samples = trained * self.global_batch  # what this process's byte counters cover
        per = (lambda x, n: x / n) if trained > 0 else (lambda x, n: None)
        bytes_ = self.global_bytes("train")
        emb.stats.settle()
        lookups = self._sum([float(v) for v in emb.stats.totals.values()])
        tail = [v for v in losses if math.isfinite(v)][-10:]  # skipped steps have no loss
        skipped = [i for i, v in enumerate(losses) if not math.isfinite(v)]
        out = {
            "world_size": self.comm.size,
            "threads": torch.get_num_threads(),  # rank 0's torch threads (train.threads; 0: the CPUs it may use)
            "output_dir": self.out_dir,
            "backend": type(self.comm).__name__,
            "steps": end,  # the steps trained (fewer than train.steps after an early stop or a failed save)
            "end_step": end,
            "global_batch_size": self.global_batch,
            "samples": samples,
            "train_time_s": train_time,
            "samples_per_sec": per(run_samples, max(train_time, 1e-9)),
            "final_loss": float(np.mean(tail)) if tail else None,
            "skipped_steps": len(skipped),  # train.nonfinite=skip: steps dropped for a non-finite loss
            "skipped_at": skipped[:100],
            "ids_hashed": int(self._sum([float(self.data.ids_hashed)])[0]),  # data.out_of_range=hash
            "eval_auc": final_eval["eval_auc"],
            "eval_logloss": final_eval["eval_logloss"],
            "eval_samples": final_eval["eval_samples"],
            "test_auc": final_eval["eval_auc"],  # = eval_auc: the test split, on the best model when restored
            "test_logloss": final_eval["eval_logloss"],
            "best_step": None, "val_auc": None, "val_logloss": None, "val_samples": 0,  # no validation split
            "calibration": None,  # train.calibrate: the temperature fitted on the validation split
            "stopped": None,  # a stop signal that ended the run (trainer/run/signals.py)
            **(extra or {}),
            "bytes": bytes_,
            "bytes_total": sum(bytes_.values()),
            "bytes_per_sample": per(sum(bytes_.values()), run_samples),
            "bytes_per_sample_by_kind": {k: per(v, run_samples) for k, v in bytes_.items()},
            "embedding_bytes_per_sample": per(sum(bytes_[k] for k in EMBEDDING_KINDS), run_samples),
            "eval_bytes": self.global_bytes("eval"),
            "embedding": {"table_rows": self.sparse.sharding.table_rows, "dim": emb.dim,
                          "dtype": c.embedding.dtype, "rounding": c.embedding.rounding,
                          "bytes_per_row": emb.store.bytes_per_row(),
                          "shard_bytes": emb.store.sharding.local_rows * emb.store.bytes_per_row()["total"],
                          **{f"{k}_per_step": per(v, trained) for k, v in zip(emb.stats.totals.keys(), lookups)}},
            "evals": evals,
            "cache": _after_flush(self.cache_summary()),
            "dynamic": (extra or {}).get("dynamic") or (dynamic_summary(self.comm, emb.store) if emb.store.dynamic
                                                        else None),  # extra's: taken before a restore
            "placement": self._placement_summary(bytes_, run_samples, trained, alltoalls),
            "config": asdict(c),
            "start_step": start_step,
            "resumed_from": resumed_from,
            "checkpoint": checkpoint,
            # a failed save that stopped the run: where the model could not go, the fallback
            "checkpoint_error": checkpoint_error,
        }
        out["metrics_log"] = self.metrics.report()  # records lost to a failing disk, if any
        if self.tb.error is not None:
            out["tensorboard_error"] = self.tb.error
        if self.out_dir and self.comm.rank == 0:
            path = os.path.join(self.out_dir, "summary.json")
            try:
                write_summary(path, out)
            except OSError as exc:  # a write that fails at close names no file: name it (exit 2)
                if exc.filename is None:
                    raise OSError(exc.errno, exc.strerror or str(exc), path) from exc
                raise
        return out

    def _placement_summary(self, bytes_: dict[str, int], run_samples: int, trained: int,
                           alltoalls: dict[str, int]) -> dict[str, Any]:
        """The plan, hot steps (none ran an alltoall), and predicted vs measured embedding bytes."""
        sp = self.sparse
        out = sp.plan.summary()
        if sp.feed is not None:
            order = sp.feed.order
            out["hot_steps"] = sp.feed.hot_steps
            out["alltoalls_in_hot_steps"] = alltoalls["hot"]
            out["alltoalls_in_cold_steps"] = alltoalls["cold"]
            out["hot_step_fraction"] = sp.feed.hot_steps / trained if trained > 0 else None
            if isinstance(order, HotColdOrder):
                out["hot_sample_fraction"] = order.hot_samples / max(order.samples, 1)
        if sp.feed is not None and sp.feed.partition is not None:
            part = sp.feed.partition
            out["schedule"] = {"name": self.c.schedule.name, "remote_reads": part.remote,
                               "random_remote_reads": part.random_remote,
                               **(sp.herald.summary() if sp.herald is not None else {})}
        if sp.plan.predicted is not None:
            pred = sum(sp.plan.predicted.values())
            if run_samples > 0:
                measured = {k: bytes_[k] / run_samples for k in EMBEDDING_KINDS}
                got = sum(measured.values())
            else:  # nothing measured without a step
                measured, got = {k: None for k in EMBEDDING_KINDS}, None
            out["measured_bytes_per_sample"] = measured
            out["predicted_vs_measured"] = {"predicted": pred, "measured": got,
                                            "error": (pred - got) / got if got else None}
        return out


def _bound(b: int) -> int:
    """A bound as configured: -1 for unbounded (int64 max inside)."""
    return -1 if b < 0 or b >= UNBOUNDED else int(b)


def dynamic_summary(comm: Collectives, store: Any) -> dict[str, Any]:
    """The `dynamic` block of metrics.jsonl and summary.json (embedding.kind=dynamic): rows in
    use, admissions, evictions, dropped gradients and rejected admissions, per table and in total,
    summed over the owners, and copies written back to another life of their id (stale_copies,
    dropped: remote/on_demand.py); the admission counter's pending ids (count_min: an estimate) and
    bytes (admission.counter_figures) (collective: one allreduce)."""
    pool, t = store.pool, store.sharding.num_tables
    figures = counter_figures(pool.admission)
    tail = torch.tensor([figures["pending_ids"], figures["admission_bytes"], pool.stale_copies],
                        device=pool.counters.device)
    local = torch.cat([pool.counters.flatten(), pool.rows_in_use(), tail]).double().cpu()
    with phase(comm, "other"):
        tot = comm.allreduce(local, op="sum", kind="meta").long().tolist()
    per = {k: tot[i * t:(i + 1) * t] for i, k in enumerate(POOL_COUNTERS + ("rows_in_use",))}
    tables = [{"table": i, "capacity_rows": comm.size * pool.capacity, **{k: v[i] for k, v in per.items()}}
              for i in range(t)]
    return {"capacity_rows_per_owner": pool.capacity, "admit_after": pool.admit_after,
            "eviction": pool.eviction, "admit_counter": pool.admission.kind if pool.admission else "none",
            **{k: sum(v) for k, v in per.items()},
            "pending_ids": tot[-3], "admission_bytes": tot[-2], "stale_copies": tot[-1],
            "bytes_per_slot": pool.bytes_per_slot(), "pending_bytes_per_id": figures["pending_bytes_per_id"],
            "tables": tables}


def _after_flush(cache: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The summary's cache block: pending updates are those left after the final flush (0)."""
    if cache is not None:
        cache["pending_updates_after_flush"] = cache.pop("pending_updates")
    return cache


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else 0.0
