"""run(cfg): the training job, identical on every rank, callable from tests and from Hydra.

Parallelism is applied here, from outside the model: dense parameters are replicated and their
gradients allreduced; embedding rows are sharded and exchanged by HybridEmbedding. The local loss is
sum(BCE over the local slice) / global batch, so gradients summed over ranks equal the gradient of
the single-process reference's mean loss over the global batch (DESIGN.md section 2).
"""
from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

import kernels

from .checkpoint import CheckpointError, Checkpointer, rng_state, set_rng_state
from .checkpoint import latest as latest_checkpoint
from .checkpoint import load as load_checkpoint
from .checkpoint import resolve as resolve_checkpoint
from .comm import EMBEDDING_KINDS, KINDS, CollectiveError, Collectives, make_collectives
from .config import (Config, auto_threads, cache_capacities, local_batch_size, needs_global_view,
                     staleness_bounds, table_rows, to_config, validate_world)
from .data import make_data
from .embedding import HybridEmbedding, RowSharding, ShardStore
from .embedding.cache import RowCache, make_policy
from .embedding.consistency import HIST_BINS, UNBOUNDED, Bounds
from .embedding.exchange import het_wire_bytes
from .embedding.module import CACHE_COUNTERS
from .embedding.replica import Replica
from .placement import Plan, plan_run
from .embedding.herald import HeraldRemote
from .schedule import Feed, HotColdOrder
from .schedule.feed import make_order
from .schedule.herald import HeraldPartition, HeraldPlanner, IdSpace
from .metrics import JsonlWriter, auc_logloss, write_summary
from .models import build_model


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, ...); the message names the step."""


@dataclass
class RunResult:
    summary: dict[str, Any]
    rank: int
    losses: list[float]  # global mean training loss of every step
    state: dict[str, Any] | None = None  # {"dense": state_dict, "tables": [Tensor [rows_t, d]]}


def run(cfg: Any, out_dir: str | None = None, return_state: bool = False,
        comm: Collectives | None = None) -> RunResult:
    """Train with `cfg` (Hydra DictConfig or Config); write metrics and summary.json to out_dir."""
    config = to_config(cfg)
    own = comm is None
    if comm is None:
        comm = make_collectives(config.comm.backend, config.comm.timeout_s, config.comm.dist_backend)
    trainer = None
    try:
        trainer = Trainer(config, comm, out_dir)
        return trainer.fit(return_state)
    except CollectiveError as exc:  # a peer died or stalled: say where we were and how to go on
        raise CollectiveError(f"{exc}\n{_failure_hint(config, comm, trainer)}") from exc
    finally:
        if trainer is not None and trainer.checkpointer is not None:
            trainer.checkpointer.close()  # release checkpoint.dir's lock
        if own:
            comm.close()


def _failure_hint(c: Config, comm: Collectives, trainer: "Trainer | None") -> str:
    """Where this rank stopped and which checkpoint a relaunch with resume=auto continues from."""
    where = f"at step {trainer.current_step} of {c.train.steps}" if trainer and trainer.current_step \
        is not None else "outside the training loop"
    root = trainer.ckpt_dir if trainer is not None else c.checkpoint.dir
    last = latest_checkpoint(root) if root else None
    resume = (f"continues from the newest complete checkpoint ({last})" if last else
              "finds no complete checkpoint yet and starts over (checkpoint.every=N saves every N steps)")
    return (f"rank {comm.rank}/{comm.size} stopped {where}: a worker died or stalled (comm.timeout_s="
            f"{c.comm.timeout_s:g}). Relaunch the same command with checkpoint.resume=auto: it {resume}.")


def _device(c: Config) -> torch.device:
    if c.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if c.train.device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device='cuda' but no CUDA device is available")
    return torch.device(c.train.device)


def _dense_optimizer(c: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    o = c.optim
    if o.dense == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum)
    if o.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=o.lr, eps=o.eps,
                                   initial_accumulator_value=o.initial_accumulator)
    return torch.optim.Adam(params, lr=o.lr, eps=o.eps)


class Trainer:
    """Holds one rank's model, embedding shard, data slice and collectives."""

    def __init__(self, c: Config, comm: Collectives, out_dir: str | None) -> None:
        validate_world(c, comm.size)
        self.c, self.comm = c, comm
        self.rank, self.world = comm.rank, comm.size
        torch.set_num_threads(auto_threads(c))
        self.device = _device(c)
        kernels.configure(c.kernels.backend, self.device)
        self.out_dir = self._agree_out_dir(out_dir)
        self.data = make_data(c, self.rank, self.world)
        self.global_batch = local_batch_size(c, self.world) * self.world
        rows = table_rows(c)
        self.sharding = RowSharding(rows, self.world, self.rank)
        lr = c.optim.sparse_lr if c.optim.sparse_lr is not None else c.optim.lr
        store = ShardStore(self.sharding, c.model.embedding_dim, c.train.seed, c.embedding.init_scale,
                           c.optim.sparse, lr, c.optim.eps, self.device, c.optim.initial_accumulator)
        self.plan = self._make_plan(rows)
        replica = (Replica(self.plan.hot_gids(rows, self.sharding.table_offsets), store)
                   if self.plan.hot.size else None)
        self.space = IdSpace(rows, self.sharding.table_offsets.numpy(), self.plan.hot)
        self.herald = self._make_herald(c)
        remote = HeraldRemote(comm, store, self.herald) if self.herald is not None else None
        cache = self._make_cache(c, lr) if self.herald is None else (None, None)
        with self._phase("other"):
            self.emb = HybridEmbedding(comm, self.sharding, store, c.model.pooling, *cache,
                                       audit=c.embedding.audit, replica=replica, remote=remote)
        if c.train.nonfinite == "skip":
            self.emb.enable_discard()
        self.feed = self._make_feed(rows) if needs_global_view(c) else None
        torch.manual_seed(c.train.seed)
        self.model = build_model(c.model, c.data.num_dense, len(rows)).to(self.device)
        self._broadcast_dense()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = _dense_optimizer(c, self.params)
        self.losses: list[float] = []
        self.alltoalls = {"hot": 0, "cold": 0}  # alltoall calls of this rank in hot / other steps
        self.evals: list[dict[str, Any]] = []
        self.ckpt_dir = c.checkpoint.dir or (os.path.join(self.out_dir, "checkpoints")
                                             if self.out_dir else None)  # None: no checkpoints
        self.checkpointer = (Checkpointer(comm, self.ckpt_dir, c.checkpoint.keep_last)
                             if self.ckpt_dir and c.checkpoint.enabled else None)
        self.last_checkpoint: str | None = None
        self.current_step: int | None = None  # the step in progress (failure reports)
        self.resumed_from: str | None = None
        self.start_step = self._resume()

    # ---- setup helpers ---------------------------------------------------------------------
    def _make_plan(self, rows: list[int]) -> Plan:
        """Rank 0 profiles the run's training stream and plans; every rank gets rank 0's plan."""
        if self.c.placement.name == "none":
            return Plan("none")
        plan = plan_run(self.c, self.data, self.world) if self.rank == 0 else None
        with self._phase("other"):
            return self.comm.broadcast_object(plan)

    def _make_feed(self, rows: list[int]) -> Feed:
        """The global view: FAE's hot/cold order or the data's own, Herald's partition and sync."""
        c, hot = self.c, self.plan.hot
        order = make_order(self.data, self.global_batch, hot, rows, c.placement)
        partition = (HeraldPartition(self.world, self.space, self.herald, c.schedule.cache_aware,
                                     c.schedule.passes)
                     if c.schedule.name == "herald" else None)
        return Feed(self.data, order, rows, self.rank, self.world, hot, partition, self.herald)

    def _make_herald(self, c: Config) -> HeraldPlanner | None:
        """Herald's on-demand sync planner; lent rows live in an LRU cache of the cache config's
        total capacity per worker (0 with cache=none: nothing is lent, pushes are still planned)."""
        if c.schedule.name != "herald" or not c.schedule.on_demand_sync:
            return None
        caps = self.plan.cache_rows if self.plan.cache_rows is not None else cache_capacities(c)
        return HeraldPlanner(self.world, self.space, sum(caps))

    def _make_cache(self, c: Config, lr: float) -> tuple[RowCache | None, Bounds]:
        """The HET cache of remote rows (none at W = 1: nothing is remote) and the bounds."""
        bounds = Bounds.from_lists(*staleness_bounds(c))
        if c.cache.policy == "none" or self.world == 1:
            why = ("cache=none" if c.cache.policy == "none" else
                   f"cache={c.cache.policy} at W=1, where every row is local") if not bounds.is_bsp else None
            if why and self.rank == 0:
                print(f"[trainer] warning: consistency bounds have no effect with {why}: every remote row "
                      "is pulled and pushed every step", file=sys.stderr)
            return None, bounds
        caps = self.plan.cache_rows if self.plan.cache_rows is not None else cache_capacities(c)
        cache = RowCache(caps, c.model.embedding_dim,
                         make_policy(c.cache.policy, c.cache.pin_threshold),
                         int(self.sharding.table_offsets[-1]), lr, self.device)
        return cache, bounds

    def _agree_out_dir(self, out_dir: str | None) -> str | None:
        """Every rank writes into rank 0's output directory (Hydra dirs may differ by a second)."""
        with self._phase("other"):
            agreed = self.comm.broadcast_object(out_dir)
        if agreed is not None and self.rank == 0:
            os.makedirs(agreed, exist_ok=True)
        return agreed

    def _broadcast_dense(self) -> None:
        with self._phase("other"), torch.no_grad():
            for p in self.model.parameters():
                p.copy_(self.comm.broadcast(p.detach(), root=0, kind="dense"))

    # ---- checkpoints -----------------------------------------------------------------------
    def _schema(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be loaded into this run (checkpoint.SCHEMA_KEYS)."""
        c = self.c
        return {"table_rows": list(self.sharding.table_rows), "dim": c.model.embedding_dim,
                "model": c.model.name, "optim_sparse": c.optim.sparse, "optim_dense": c.optim.dense}

    def _trainer_state(self, step: int) -> dict[str, Any]:
        """Rank 0's part: dense model + optimizer, step (= data position: batches are a function
        of the step), RNG states, the loss history and evals so far."""
        return {"step": step, "data_position": step,
                "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": self.opt.state_dict(), "rng": rng_state(self.device),
                "losses": list(self.losses), "evals": list(self.evals)}

    def save_checkpoint(self, step: int) -> str:
        """Flush the caches, then write checkpoint `step` (after `step` steps). Collective."""
        with self._phase("train"):  # the flush's pushes are training traffic, saved or not
            self.emb.flush()
        with self._phase("other"):
            state = self._trainer_state(step) if self.rank == 0 else None
            self.last_checkpoint = self.checkpointer.save(
                step, self.emb.store, state, {**self._schema(), "config": asdict(self.c)})
        return self.last_checkpoint

    def _resume(self) -> int:
        """Load checkpoint.resume (if any) into this rank; returns the step to continue from."""
        with self._phase("other"):
            path = resolve_checkpoint(self.comm, self.c.checkpoint.resume, self.ckpt_dir)
            if path is None:
                return 0
            state = load_checkpoint(self.comm, path, self.emb.store, self._schema())
            if self.emb.replica is not None:
                self.emb.replica.load_from_owners(self.comm, self.emb.store)
        self._load_trainer_state(path, state)
        self.resumed_from = path
        return int(state["step"])

    def _load_trainer_state(self, path: str, state: dict[str, Any]) -> None:
        """Dense model + optimizer, RNG, loss history and step counter from rank 0's file."""
        step = int(state["step"])
        if step > self.c.train.steps:
            raise CheckpointError(f"checkpoint {path} is at step {step}, "
                                  f"beyond train.steps={self.c.train.steps}")
        try:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path}: dense state does not fit this model: {exc}") from exc
        set_rng_state(state["rng"], self.device)
        self.losses, self.evals = list(state["losses"]), list(state["evals"])
        self.emb.step = step - 1  # the cache's clock (LRU ages, audit) continues too

    def _save_due(self, done: int) -> bool:
        every = self.c.checkpoint.every
        return (self.checkpointer is not None and every > 0 and done % every == 0
                and done < self.c.train.steps)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        prev, self.comm.counter.phase = self.comm.counter.phase, name
        try:
            yield
        finally:
            self.comm.counter.phase = prev

    # ---- one step --------------------------------------------------------------------------
    def train_step(self, step: int) -> float:
        """Forward, backward, embedding push + owner update, dense allreduce + step. Collective."""
        batch, info = self.feed.step(step) if self.feed is not None else (self.data.train_batch(step), None)
        calls = self._alltoall_calls()
        value = self._step(batch.to(self.device), info, step)
        self.alltoalls["hot" if info is not None and info.hot else "cold"] += self._alltoall_calls() - calls
        return value

    def _alltoall_calls(self) -> int:
        calls = self.comm.counter.calls
        return calls.get("alltoall", 0) + calls.get("alltoall_splits", 0)

    def _step(self, batch: Any, info: Any, step: int) -> float:
        """One step; returns the global loss. train.nonfinite=stop: the loss travels with the dense
        gradients and a non-finite one raises (the run stops, no checkpoint is written after it).
        skip: the global loss is reduced first (one extra 4-byte allreduce) and, when it is not
        finite, every rank drops the step before anything changed (embedding.discard)."""
        self.model.train()
        pooled = self.emb.lookup(batch, train=True, info=info)
        logits = self.model(batch.dense, pooled)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / self.global_batch
        extra = [loss.detach().reshape(1)]
        if self.c.train.nonfinite == "skip":
            value = float(self.comm.allreduce(extra.pop(), op="sum", kind="dense").item())
            if not math.isfinite(value):
                self.emb.discard()
                return value
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.emb.apply_gradients()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        reduced = self.comm.grouped_allreduce(grads + extra, op="sum", kind="dense")
        for p, g in zip(self.params, reduced):
            p.grad = g
        self.opt.step()
        if extra:
            value = float(reduced[-1].item())
            if not math.isfinite(value):
                raise TrainingError(f"loss is {value} at step {step}; stopping (lower optim.lr? "
                                    "train.nonfinite=skip drops such batches)")
        return value

    def _after_skip(self, step: int) -> None:
        """Step `step` was skipped (non-finite loss): warn; stop after train.max_skips in a row."""
        run = next((i for i, v in enumerate(reversed(self.losses)) if math.isfinite(v)), len(self.losses))
        if self.rank == 0:
            print(f"[trainer] step {step}: loss is {self.losses[-1]}; batch skipped, no update "
                  f"({run} in a row)", file=sys.stderr)
        if run >= self.c.train.max_skips:
            raise TrainingError(f"loss is {self.losses[-1]} at step {step}: {run} consecutive steps "
                                f"had a non-finite loss (train.max_skips={self.c.train.max_skips}); stopping")

    # ---- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Exact AUC / logloss over the whole eval split, gathered from every rank. Collective.
        Cached updates are flushed first, so eval reads exactly what the owners hold."""
        self.emb.flush()
        self.model.eval()
        logits, labels = [], []
        with self._phase("eval"):
            for batch in self.data.eval_batches():
                batch = batch.to(self.device)
                pooled = self.emb.lookup(batch, train=False)
                logits.append(self.model(batch.dense, pooled).float().cpu())
                labels.append(batch.labels.cpu())
            local = torch.stack([torch.cat(logits), torch.cat(labels)], dim=1) if logits \
                else torch.zeros(0, 2)
            both = self.comm.allgather(local, kind="meta").numpy()
        auc, ll = auc_logloss(both[:, 0], both[:, 1])
        return {"eval_auc": auc, "eval_logloss": ll, "eval_samples": int(both.shape[0])}

    # ---- the loop --------------------------------------------------------------------------
    def fit(self, return_state: bool = False) -> RunResult:
        c = self.c
        metrics = JsonlWriter(os.path.join(self.out_dir, "metrics.jsonl")
                              if self.out_dir and self.rank == 0 else None)
        bar = self._progress_bar()
        train_time, window_t, window_start = 0.0, time.perf_counter(), self.start_step
        try:
            for step in range(self.start_step, c.train.steps):
                self.current_step = step
                t0 = time.perf_counter()
                self.losses.append(self.train_step(step))
                train_time += time.perf_counter() - t0
                if not math.isfinite(self.losses[-1]):
                    self._after_skip(step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{self.losses[-1]:.4f}")
                done = step + 1
                if done % c.train.log_every == 0 or done == c.train.steps:
                    now = time.perf_counter()
                    metrics.write(self._step_record(step, (done - window_start) * self.global_batch
                                                    / max(now - window_t, 1e-9)))
                    window_t, window_start = now, done
                if c.train.eval_every and done % c.train.eval_every == 0 and done < c.train.steps:
                    self.evals.append({"step": done, **self.evaluate()})
                    metrics.write({"event": "eval", **self.evals[-1]})
                if self._save_due(done):
                    self.save_checkpoint(done)
            if self.checkpointer is not None and self.start_step < c.train.steps:
                self.save_checkpoint(c.train.steps)
            final_eval = self.evaluate()
            self.evals.append({"step": c.train.steps, **final_eval})
            metrics.write({"event": "eval", **self.evals[-1]})
            summary = self._summary(train_time, final_eval)
            summary["metrics_log"] = metrics.report()  # records lost to a failing disk, if any
            if self.out_dir and self.rank == 0:
                write_summary(os.path.join(self.out_dir, "summary.json"), summary)
            state = self._gather_state() if return_state else None
        finally:
            metrics.close()
            if bar is not None:
                bar.close()
        return RunResult(summary, self.rank, list(self.losses), state)

    def _progress_bar(self):
        mode = self.c.train.progress
        show = self.rank == 0 and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
        if not show:
            return None
        from tqdm import tqdm
        return tqdm(total=self.c.train.steps, initial=self.start_step, desc=f"train W={self.world}",
                    unit="step", dynamic_ncols=True)

    def _global_bytes(self, phase: str) -> dict[str, int]:
        """Bytes per kind summed over ranks (the sum itself runs in phase 'other')."""
        local = torch.tensor([self.comm.counter.totals(phase)[k] for k in KINDS], dtype=torch.float64)
        with self._phase("other"):
            total = self.comm.allreduce(local, op="sum", kind="meta")
        return {k: int(v) for k, v in zip(KINDS, total.tolist())}

    def _step_record(self, step: int, samples_per_sec: float) -> dict[str, Any]:
        s = self.emb.stats
        loss = self.losses[-1] if math.isfinite(self.losses[-1]) else None  # a skipped step
        rec = {"step": step + 1, "loss": loss, "samples_per_sec": samples_per_sec,
               "bytes": self._global_bytes("train"),
               "rank0_ids": s.ids, "rank0_unique": s.unique, "rank0_remote": s.remote}
        if self.emb.cache is not None:
            rec["cache"] = self._cache_summary()  # so far: totals, per table, staleness histogram
        return rec

    def _cache_totals(self) -> dict[str, np.ndarray]:
        """Cache counters [T] summed over ranks (max for staleness), plus the staleness histogram."""
        st, ex, t = self.emb.cache_stats, self.emb.exchange, self.sharding.num_tables
        pending = torch.tensor([float(self.emb.cache.pending_updates())], dtype=torch.float64)
        with self._phase("other"):
            summed = self.comm.allreduce(torch.cat([st.vector(), ex.staleness.flatten().double().cpu(),
                                                    pending]), op="sum", kind="meta").numpy()
            mx = self.comm.allgather(ex.max_staleness.cpu().reshape(1, -1), kind="meta").numpy()
        out = {k: summed[i * t:(i + 1) * t] for i, k in enumerate(CACHE_COUNTERS)}
        n = len(CACHE_COUNTERS) * t
        out["staleness_hist"] = summed[n:n + t * HIST_BINS].reshape(t, HIST_BINS)
        out["pending_updates"] = summed[-1:]
        out["max_staleness"] = mx.max(0)
        return out

    def _cache_summary(self) -> dict[str, Any] | None:
        """summary.json's `cache` block: hit rates, pulls, pushes, version-check bytes, staleness,
        per table and in total (bytes computed from counts and wire sizes)."""
        if self.emb.cache is None:
            return None
        c, tot = self.c, self._cache_totals()
        wire = self.emb.exchange.wire_dtype.itemsize
        nb = het_wire_bytes(tot["requested"], tot["pulled"], tot["pushed_rows"], self.emb.dim,
                            self.emb.store.weight.element_size(), wire)
        check = nb["version_check"]
        pull_b, push_b = self.emb.bounds.pull.tolist(), self.emb.bounds.push.tolist()
        caps = self.emb.cache.capacities
        tables = [{"table": i, "capacity_rows": caps[i], "pull_bound": _bound(pull_b[i]),
                   "push_bound": _bound(push_b[i]),
                   **{k: int(tot[k][i]) for k in CACHE_COUNTERS},
                   "hit_rate": _ratio(tot["hits"][i], tot["requested"][i]),
                   "version_check_bytes": int(check[i]), "row_bytes": int(nb["rows"][i]),
                   "push_bytes": int(nb["pushes"][i]),
                   "max_staleness": int(tot["max_staleness"][i])} for i in range(len(caps))]
        hist = tot["staleness_hist"].sum(0)
        return {"policy": c.cache.policy, "consistency": self.emb.bounds.label,
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

    def _summary(self, train_time: float, final_eval: dict[str, Any]) -> dict[str, Any]:
        c, steps = self.c, self.c.train.steps
        samples = steps * self.global_batch
        trained = max(steps - self.start_step, 1)  # steps run by this process (after a resume)
        run_samples = trained * self.global_batch  # what this process's byte counters cover
        bytes_ = self._global_bytes("train")
        lookups = torch.tensor([float(v) for v in self.emb.stats.totals.values()], dtype=torch.float64)
        with self._phase("other"):
            lookups = self.comm.allreduce(lookups, op="sum", kind="meta").tolist()
        tail = [v for v in self.losses if math.isfinite(v)][-10:]  # skipped steps have no loss
        skipped = [i for i, v in enumerate(self.losses) if not math.isfinite(v)]
        return {
            "world_size": self.world,
            "output_dir": self.out_dir,
            "backend": type(self.comm).__name__,
            "steps": steps,
            "global_batch_size": self.global_batch,
            "samples": samples,
            "train_time_s": train_time,
            "samples_per_sec": run_samples / max(train_time, 1e-9),
            "final_loss": float(np.mean(tail)) if tail else None,
            "skipped_steps": len(skipped),  # train.nonfinite=skip: steps dropped for a non-finite loss
            "skipped_at": skipped[:100],
            "ids_hashed": self._ids_hashed(),  # data.out_of_range=hash: ids folded, all ranks
            "eval_auc": final_eval["eval_auc"],
            "eval_logloss": final_eval["eval_logloss"],
            "eval_samples": final_eval["eval_samples"],
            "bytes": bytes_,
            "bytes_total": sum(bytes_.values()),
            "bytes_per_sample": sum(bytes_.values()) / run_samples,
            "bytes_per_sample_by_kind": {k: v / run_samples for k, v in bytes_.items()},
            "embedding_bytes_per_sample": sum(bytes_[k] for k in EMBEDDING_KINDS) / run_samples,
            "eval_bytes": self._global_bytes("eval"),
            "embedding": {"table_rows": self.sharding.table_rows, "dim": self.emb.dim,
                          **{f"{k}_per_step": v / trained for k, v in
                             zip(self.emb.stats.totals.keys(), lookups)}},
            "evals": self.evals,
            "cache": _after_flush(self._cache_summary()),
            "placement": self._placement_summary(bytes_, run_samples),
            "config": asdict(c),
            "start_step": self.start_step,
            "resumed_from": self.resumed_from,
            "checkpoint": self.last_checkpoint,
        }

    def _ids_hashed(self) -> int:
        local = torch.tensor([float(self.data.ids_hashed)], dtype=torch.float64)
        with self._phase("other"):
            return int(self.comm.allreduce(local, op="sum", kind="meta").item())

    def _placement_summary(self, bytes_: dict[str, int], run_samples: int) -> dict[str, Any]:
        """The plan, hot steps (none ran an alltoall), and predicted vs measured embedding bytes."""
        out = self.plan.summary()
        trained = max(self.c.train.steps - self.start_step, 1)
        if self.feed is not None:
            order = self.feed.order
            out["hot_steps"] = self.feed.hot_steps
            out["alltoalls_in_hot_steps"] = self.alltoalls["hot"]
            out["alltoalls_in_cold_steps"] = self.alltoalls["cold"]
            out["hot_step_fraction"] = self.feed.hot_steps / trained
            if isinstance(order, HotColdOrder):
                out["hot_sample_fraction"] = order.hot_samples / max(order.samples, 1)
        if self.feed is not None and self.feed.partition is not None:
            part = self.feed.partition
            out["schedule"] = {"name": self.c.schedule.name, "remote_reads": part.remote,
                               "random_remote_reads": part.random_remote,
                               **(self.herald.summary() if self.herald is not None else {})}
        if self.plan.predicted is not None:
            measured = {k: bytes_[k] / run_samples for k in EMBEDDING_KINDS}
            pred = sum(self.plan.predicted.values())
            got = sum(measured.values())
            out["measured_bytes_per_sample"] = measured
            out["predicted_vs_measured"] = {"predicted": pred, "measured": got,
                                            "error": (pred - got) / got if got else None}
        return out

    def _gather_state(self) -> dict[str, Any]:
        with self._phase("other"):
            tables = self.emb.full_tables()
        dense = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        audit = self.emb.audit.result() if self.emb.audit is not None else None
        return {"dense": dense, "tables": tables, "audit": audit}


def _bound(b: int) -> int:
    """A bound as configured: -1 for unbounded (int64 max inside)."""
    return -1 if b < 0 or b >= UNBOUNDED else int(b)


def _after_flush(cache: dict[str, Any] | None) -> dict[str, Any] | None:
    """The summary's cache block: pending updates are those left after the final flush (0)."""
    if cache is not None:
        cache["pending_updates_after_flush"] = cache.pop("pending_updates")
    return cache


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else 0.0
