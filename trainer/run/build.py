"""Assembling one rank's training parts from the config: the parallelism is applied here, from
outside the model (the dense model stays a plain nn.Module).

- dense side: the model (identical on every rank: built from the same seed, then broadcast from
  rank 0) and its optimizer; its gradients are allreduced by the training loop;
- sparse side (`build_sparse`): the sharding, the owner's shard store, the placement plan and the
  replica of hot rows, the remote-row protocol chosen by cache / consistency / schedule, the
  scheduler's global feed, all wired into one HybridEmbedding.

Nothing here runs a training step; runner.py's loop only uses what these functions return.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Callable, Optional

import torch

from ..base.comm import Collectives
from ..base.core.disk import free_share
from ..base.core.errors import TrainingError, allocating, phase
from ..base.config import (Config, ConfigError, cache_capacities, needs_global_view, run_device, staleness_bounds,
                     table_rows)
from ..workload.data import id_rows
from ..workload.data.source import GlobalData
from ..sparse.embedding import HybridEmbedding, RowSharding, ShardStore
from ..sparse.embedding.dynamic.admission import Counting
from ..sparse.embedding.cache.rows import RowCache, make_policy
from ..sparse.embedding.cache.consistency import Bounds
from ..sparse.embedding.dynamic.shard import DynamicStore
from ..sparse.embedding.optim import Rounding
from ..sparse.embedding.remote import Audit, CacheStats, HeraldRemote, HetRemote, HetWire, RemoteRows
from ..sparse.embedding.replica import Replica
from ..sparse.embedding.sharding import HashSharding
from ..sparse.embedding.store.shard import row_dtype
from ..sparse.embedding.store.tiered import TieredStore, log_rows, record_fields
from ..sparse.embedding.store.tier.disk import DiskTier
from ..sparse.embedding.store.tier.records import log_records, record_layout
from ..sparse.embedding.store.tier.scratch import reap
from ..workload.models import build_model
from ..sparse.placement import Plan, plan_run
from ..base.core.progress import fmt_bytes
from .resolve.memplan import available_memory, store_cache_bytes, tier_page_bytes
from ..sparse.schedule import Feed
from ..sparse.schedule.feed import make_order
from ..sparse.schedule.herald import HeraldPlanner, IdSpace
from ..sparse.schedule.partition import HeraldPartition
from ..sparse.side import Sparse


def device_of(c: Config) -> torch.device:
    """The run's torch.device: config.run_device's choice (train.device=auto: cuda when a GPU is
    visible); "cuda" is this rank's GPU, the current device the collectives set (LOCAL_RANK)."""
    device = run_device(c)
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device='cuda' but no CUDA device is available")
    return torch.device(device)


# ---- dense side ------------------------------------------------------------------------------
def build_dense(c: Config, comm: Collectives, num_tables: int, device: torch.device
                ) -> tuple[torch.nn.Module, list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The model (rank 0's initial values on every rank), its trainable parameters and optimizer."""
    torch.manual_seed(c.train.seed)
    model = build_model(c.model, c.data.num_dense, num_tables).to(device)
    with phase(comm, "other"), torch.no_grad():
        for p in model.parameters():
            p.copy_(comm.broadcast(p.detach(), root=0, kind="dense"))
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, dense_optimizer(c, params)


def dense_optimizer(c: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    o = c.optim
    wd = o.weight_decay or 0.0  # coupled L2 (torch.optim's weight_decay)
    if o.dense == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=wd)
    if o.dense == "adagrad":
        return torch.optim.Adagrad(params, lr=o.lr, eps=o.eps,
                                   initial_accumulator_value=o.initial_accumulator, weight_decay=wd)
    return torch.optim.Adam(params, lr=o.lr, eps=o.eps, weight_decay=wd)


# ---- sparse side -----------------------------------------------------------------------------
def sparse_lr(c: Config) -> float:
    return c.optim.sparse_lr if c.optim.sparse_lr is not None else c.optim.lr


def build_sparse(c: Config, comm: Collectives, data: GlobalData, global_batch: int,
                 device: torch.device, resuming: bool = False,
                 interrupt: Optional[Callable[[], bool]] = None) -> Sparse:
    """Sharding -> store -> plan (+ replica) -> remote-row protocol -> HybridEmbedding -> feed.
    resuming: every row will be loaded from a checkpoint (the store skips its initial rows).
    interrupt: a stop request ends the placement's profile (every rank raises StopRequested)."""
    rank, world = comm.rank, comm.size
    with allocating("the embedding shard (rows, optimizer state, versions)"):
        store = _make_store(c, comm, device, resuming)
    sharding = store.sharding
    plan = _make_plan(c, comm, data, interrupt)
    replica = Replica(plan.hot_gids(sharding), store) if plan.hot.size else None
    space = IdSpace(sharding, plan.hot)
    herald = _make_herald(c, world, space, plan)
    bounds = Bounds.from_lists(*staleness_bounds(c))
    audit = Audit(sharding.n_ids, store.dim) if c.embedding.audit else None
    remote = _make_remote(c, comm, store, plan, herald, bounds, audit)
    with phase(comm, "other"):  # the replica is loaded from the owners
        emb = HybridEmbedding(comm, sharding, store, c.model.pooling, remote, replica, audit,
                              c.comm.wire_precision)
    if c.train.nonfinite == "skip" or c.train.precision == "fp16":  # fp16: the loss scaler's skipped steps
        emb.enable_discard()
    feed = _make_feed(c, data, global_batch, rank, world, plan, space, herald) \
        if needs_global_view(c) else None
    return Sparse(sharding, emb, plan, bounds, feed, herald)


def _make_store(c: Config, comm: Collectives, device: torch.device, resuming: bool = False) -> ShardStore:
    """The owner's shard: fixed tables (RowSharding, row gid div W) or dynamic ones (HashSharding,
    a pool of embedding.capacity rows per table found by id: embedding/dynamic/shard.py, whose free
    slots start at zeros anyway). resuming: every row comes from a checkpoint (no initial rows)."""
    e = c.embedding
    args = (c.model.embedding_dim, c.train.seed, e.init_scale, c.optim.sparse, sparse_lr(c), c.optim.eps,
            device, c.optim.initial_accumulator, c.optim.sparse_weight_decay, row_dtype(e.dtype),
            Rounding(e.rounding, c.train.seed))
    if e.kind == "dynamic":
        sharding = HashSharding(len(table_rows(c)), e.capacity, comm.size, comm.rank)
        return DynamicStore(sharding, *args, admit_after=e.admit_after, eviction=e.eviction,
                            lfu_half_life=e.lfu_half_life, ttl_steps=e.ttl_steps, counting=Counting.of(e))
    sharding = RowSharding(table_rows(c), comm.size, comm.rank)
    if e.store != "disk":
        return ShardStore(sharding, *args, initialise=not resuming)
    tier, rows_bytes = make_tier(c, comm, device, sharding.local_rows)
    try:
        return TieredStore(sharding, *args, initialise=not resuming, tier=tier, buffer_bytes=rows_bytes)
    except BaseException:
        if tier is not None:
            tier.close()
        raise


def make_tier(c: Config, comm: Collectives, device: torch.device, local_rows: int) -> tuple[DiskTier, int]:
    """embedding.store=disk: this rank's files under embedding.store_dir, refused in one line when
    the run trains on a GPU or the directory's free space cannot hold them, and the bytes of its
    row cache. The RAM cache (embedding.store_cache_bytes, or a quarter of the memory this rank
    may have) is shared: the pages being read or written back (tier_page_bytes), the rows."""
    e = c.embedding
    if device.type != "cpu":
        raise ConfigError(f"embedding.store=disk maps the shard into host memory: the run trains on {device} "
                          "(train.device=cpu, or embedding.store=memory)")
    record = record_layout(record_fields(c.model.embedding_dim, row_dtype(e.dtype), c.optim.sparse))[1]
    room = None if e.store_cache_bytes else available_memory(device, comm.local_size)[0]
    total = store_cache_bytes(c, room, local_rows * record)
    pages = tier_page_bytes(total)
    files = (local_rows + log_records(log_rows(local_rows, total - pages), record)) * record  # the file and its log
    # a checkpoint's save or load permutes the rows through bucket files beside them (checkpoint/buckets.py:
    # at most a record and an 8 B key a row)
    scratch = local_rows * (record + 8) if c.checkpoint.enabled or c.checkpoint.resume else 0
    need = files + scratch
    where = e.store_dir or tempfile.gettempdir()
    os.makedirs(where, exist_ok=True)
    reap(where)  # dead runs' folders first: their room counts as free
    free = free_share(where, comm.local_size)
    if need > free:
        also = f" (its files {fmt_bytes(files)}, a checkpoint's save or load {fmt_bytes(scratch)} of scratch)" if scratch else ""
        raise ConfigError(f"embedding.store=disk: rank {comm.rank}'s shard needs {fmt_bytes(need)} on disk{also}, "
                          f"{where} has {fmt_bytes(free)} free for it (embedding.store_dir elsewhere, or more workers"
                          f"{', or checkpoint.enabled=false' if scratch else ''})")
    return DiskTier(e.store_dir, comm.rank, pages, total), total - pages


def _make_plan(c: Config, comm: Collectives, data: GlobalData, interrupt: Optional[Callable[[], bool]] = None) -> Plan:
    """Rank 0 profiles the run's training stream and plans; every rank gets rank 0's plan (or its
    StopRequested, when a stop signal ended the profile)."""
    if c.placement.name == "none":
        return Plan("none")
    with phase(comm, "other"):
        return comm.root_decides(lambda: plan_run(c, data, comm.size, interrupt), ConfigError)


def _cache_rows(c: Config, plan: Plan) -> list[int]:
    return plan.cache_rows if plan.cache_rows is not None else cache_capacities(c)


def _make_herald(c: Config, world: int, space: IdSpace, plan: Plan) -> Optional[HeraldPlanner]:
    """Herald's on-demand sync planner; lent rows live in an LRU cache of the cache config's
    total capacity per worker (0 with cache=none: nothing is lent, pushes are still planned)."""
    if c.schedule.name != "herald" or not c.schedule.on_demand_sync:
        return None
    ttl = c.embedding.ttl_steps if c.embedding.kind == "dynamic" else 0  # lent rows expire as their ids do
    return HeraldPlanner(world, space, sum(_cache_rows(c, plan)), ttl)


def _make_remote(c: Config, comm: Collectives, store: ShardStore, plan: Plan,
                 herald: Optional[HeraldPlanner], bounds: Bounds, audit: Optional[Audit]
                 ) -> Optional[RemoteRows]:
    """The remote-row protocol: Herald's, HET's cache, or None (the no-cache default)."""
    if herald is not None:
        return HeraldRemote(comm, store, herald)
    if c.cache.policy == "none" or comm.size == 1:
        why = ("cache=none" if c.cache.policy == "none" else
               f"cache={c.cache.policy} at W=1, where every row is local") if not bounds.is_bsp else None
        if why and comm.rank == 0:
            print(f"[trainer] warning: consistency bounds have no effect with {why}: every remote row "
                  "is pulled and pushed every step", file=sys.stderr)
        return None
    sh = store.sharding
    cache = RowCache(_cache_rows(c, plan), c.model.embedding_dim,
                     make_policy(c.cache.policy, c.cache.pin_threshold), sh.n_ids, sparse_lr(c),
                     store.device)
    return HetRemote(HetWire(comm, store, c.comm.wire_precision), sh, cache, bounds, CacheStats(sh.num_tables, store.device),
                     audit)


def _make_feed(c: Config, data: GlobalData, global_batch: int, rank: int, world: int, plan: Plan,
               space: IdSpace, herald: Optional[HeraldPlanner]) -> Feed:
    """The global view: FAE's hot/cold order or the data's own, Herald's partition and sync."""
    rows = id_rows(c)  # dynamic tables: flat ids are the global ids
    order = make_order(data, global_batch, plan.hot, rows, c.placement)
    partition = (HeraldPartition(world, space, herald, c.schedule.cache_aware, c.schedule.passes)
                 if c.schedule.name == "herald" else None)
    return Feed(data, order, rows, rank, world, plan.hot, partition, herald)
