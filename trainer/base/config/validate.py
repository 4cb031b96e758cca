"""Range and cross-field checks of a parsed config, each failing with `key=value: reason`: one
function per config block (_validate_<block>; a block's sub-blocks and cross-block rules with it),
run in BLOCK_CHECKS' order by validate; validate_world: the checks that need W."""
from __future__ import annotations

import math
import os

from .derive import (
    _cuda_available, local_batch_size, run_device, staleness_bounds, table_rows,
)
from .errors import _UNRESOLVED, ConfigError, _check, _finite, _one_of
from .schema import (
    ADMIT_COUNTERS, BACKENDS, CACHE_POLICIES, CONSISTENCY_PRESETS, DATASETS, DENSE_OPTIMS, DEVICES,
    DIST_BACKENDS, EMBEDDING_DTYPES, EVICTIONS, KERNEL_BACKENDS, LOADERS, LR_DECAYS,
    MODELS, NONFINITE, ON_SIGNAL, OUT_OF_RANGE, PIPELINES, PLACEMENTS, POOLINGS, PRECISIONS, RECIPES,
    ROUNDINGS, SCHEDULES, SETTLED_ROWS, SPARSE_OPTIMS, TABLE_KINDS, WIRE_PRECISIONS, Config, DataConfig,
    EmbeddingConfig,
)


def check_data_source(c: Config) -> None:
    """What a file dataset needs before its files can be read: data=criteo names its directory."""
    d = c.data
    _check(d.name != "criteo" or bool(d.dir), "data.dir", d.dir,
           "data=criteo needs the directory written by scripts/prepare_criteo.py --out DIR")


def data_source_error(c: Config, exc: Exception) -> ConfigError:
    """A file dataset that cannot be read (missing or malformed files), as an error naming data.dir."""
    return ConfigError(f"data.dir={c.data.dir!r}: {exc}")


def apply_data_shape(c: Config, num_dense: int, rows: list[int]) -> None:
    """Fill data.num_dense / data.table_rows from what a file dataset reports about itself.
    A value the user set must agree with the data; data.table_rows may be left empty ([])."""
    d = c.data
    _check(d.num_dense == num_dense, "data.num_dense", d.num_dense, f"the data has {num_dense} dense features")
    _check(not d.table_rows or list(d.table_rows) == rows, "data.table_rows", d.table_rows,
           f"the data has tables of {rows} rows; leave data.table_rows empty ([])")
    d.table_rows = list(rows)


def check_min_count(d: DataConfig) -> None:
    """data.min_count is resolved, >= 0, and a data=criteo option."""
    _check(d.min_count is not None, "data.min_count", d.min_count, _UNRESOLVED)
    _check(d.min_count >= 0, "data.min_count", d.min_count, "must be >= 0 (0 = every id keeps its own row)")
    _check(d.min_count == 0 or d.name == "criteo", "data.min_count", d.min_count,
           "a vocabulary of the training rows is a data=criteo option")


def validate(c: Config) -> None:
    """Range and consistency checks that do not depend on the world size: each block's checks
    (BLOCK_CHECKS) in turn; the first that fails raises, so their order decides which error wins."""
    for check in BLOCK_CHECKS:
        check(c)


def _validate_model(c: Config) -> None:
    """model: the architecture, row width, MLP widths, pooling."""
    m = c.model
    _one_of("model.name", m.name, MODELS)
    _check(m.embedding_dim is not None, "model.embedding_dim", m.embedding_dim, _UNRESOLVED)
    _check(m.embedding_dim > 0, "model.embedding_dim", m.embedding_dim, "must be > 0")
    _one_of("model.pooling", m.pooling, POOLINGS)
    _check(m.top_mlp is not None, "model.top_mlp", m.top_mlp, _UNRESOLVED)
    for key, widths in (("model.bottom_mlp", m.bottom_mlp), ("model.top_mlp", m.top_mlp)):
        _check(all(w > 0 for w in widths), key, widths, "every layer width must be > 0")


def _validate_data_source(c: Config) -> None:
    """data: the source, its shape, ids, batches and reader."""
    d = c.data
    _one_of("data.name", d.name, DATASETS)
    _check(d.num_dense > 0, "data.num_dense", d.num_dense, "must be > 0")
    _check(len(d.table_rows) > 0, "data.table_rows", d.table_rows, "needs at least one table")
    for i, n in enumerate(d.table_rows):
        _check(n > 0, f"data.table_rows[{i}]", n, "every table needs > 0 rows")
    _check(d.max_table_rows >= 0, "data.max_table_rows", d.max_table_rows, "must be >= 0 (0 = no cap)")
    _check(d.min_bag >= 0, "data.min_bag", d.min_bag, "must be >= 0")
    _check(d.max_bag >= max(d.min_bag, 1), "data.max_bag", d.max_bag, "must be >= max(1, data.min_bag)")
    _check(d.zipf_alpha >= 0, "data.zipf_alpha", d.zipf_alpha, "must be >= 0")
    _finite("data.zipf_alpha", d.zipf_alpha)
    _check(d.signal >= 0, "data.signal", d.signal, "must be >= 0 (0 = labels are coin flips)")
    _finite("data.signal", d.signal)
    _check(d.seed >= 0, "data.seed", d.seed, "must be >= 0")
    _one_of("data.out_of_range", d.out_of_range, OUT_OF_RANGE)
    _check(d.batch_size > 0, "data.batch_size", d.batch_size, "must be > 0")
    if d.global_batch_size is not None:
        _check(d.global_batch_size > 0, "data.global_batch_size", d.global_batch_size, "must be > 0")
    _check(d.train_samples >= 0, "data.train_samples", d.train_samples, "must be >= 0")
    _check(d.test_samples >= 0, "data.test_samples", d.test_samples, "must be >= 0")
    _check(d.eval_batch_size > 0, "data.eval_batch_size", d.eval_batch_size, "must be > 0")
    _one_of("data.loader", d.loader, LOADERS)
    _check(d.loader_threads > 0, "data.loader_threads", d.loader_threads, "must be > 0")
    _check(d.cycle_batches >= 0, "data.cycle_batches", d.cycle_batches, "must be >= 0 (0 = no repeat)")
    _check(d.name == "synthetic" or not d.cycle_batches, "data.cycle_batches", d.cycle_batches,
           "is a synthetic-data option")


def _validate_data_splits(c: Config) -> None:
    """data: the test and validation splits, epochs, the training rows' statistics and vocabulary."""
    d = c.data
    _check(0 < d.test_fraction < 1, "data.test_fraction", d.test_fraction, "must be in (0, 1)")
    _check(d.epochs is not None, "data.epochs", d.epochs, _UNRESOLVED)
    _check(d.epochs >= 0, "data.epochs", d.epochs, "must be >= 0 (0 = use train.steps)")
    _finite("data.epochs", d.epochs)
    _check(d.standardize is not None, "data.standardize", d.standardize, _UNRESOLVED)
    _check(not d.standardize or d.name == "criteo", "data.standardize", d.standardize,
           "standardising dense features is a data=criteo option (the other sources are already scaled)")
    _check(d.val_fraction is not None, "data.val_fraction", d.val_fraction, _UNRESOLVED)
    _check(0 <= d.val_fraction < 1, "data.val_fraction", d.val_fraction, "must be in [0, 1) (0 = no validation split)")
    _check(d.val_fraction == 0 or d.name != "synthetic" or d.train_samples > 0, "data.val_fraction",
           d.val_fraction, "synthetic data has a training set to carve a validation split from only "
           "with data.train_samples > 0 (0 is an endless stream)")
    check_min_count(d)
    _check(d.val_slice >= 1, "data.val_slice", d.val_slice, "must be >= 1 (1 = the last slice of the training rows)")
    _check(d.val_slice == 1 or (d.name == "criteo" and d.val_fraction > 0), "data.val_slice", d.val_slice,
           "another validation slice than the last is a data=criteo option and needs data.val_fraction > 0")


def _validate_model_layers(c: Config) -> None:
    """model: DCN's cross layers and the MLPs' dropout (checked after the data, as always)."""
    m = c.model
    _check(m.cross_layers >= 0, "model.cross_layers", m.cross_layers, "must be >= 0")
    _check(m.cross_rank >= 0, "model.cross_rank", m.cross_rank, "must be >= 0 (0 = full rank)")
    _check(m.dropout is not None, "model.dropout", m.dropout, _UNRESOLVED)
    _check(0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")


def _validate_optim(c: Config) -> None:
    """optim: the optimizers, their rates and Adagrad's state."""
    o = c.optim
    for key in ("name", "dense", "sparse", "lr", "eps"):
        _check(getattr(o, key) is not None, f"optim.{key}", None, _UNRESOLVED)
    _one_of("optim.dense", o.dense, DENSE_OPTIMS)
    _one_of("optim.sparse", o.sparse, SPARSE_OPTIMS)
    _check(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    _finite("optim.lr", o.lr)
    if o.sparse_lr is not None:
        _check(o.sparse_lr > 0, "optim.sparse_lr", o.sparse_lr, "must be > 0")
        _finite("optim.sparse_lr", o.sparse_lr)
    _check(o.eps > 0, "optim.eps", o.eps, "must be > 0")
    _finite("optim.eps", o.eps)
    _check(0 <= o.momentum < 1, "optim.momentum", o.momentum, "must be in [0, 1)")
    _check(o.initial_accumulator >= 0, "optim.initial_accumulator", o.initial_accumulator, "must be >= 0")
    _finite("optim.initial_accumulator", o.initial_accumulator)


def _validate_comm(c: Config) -> None:
    """comm: the backend and its transport (which follows train.device), wire precision, timeout."""
    _one_of("comm.backend", c.comm.backend, BACKENDS)
    _one_of("comm.dist_backend", c.comm.dist_backend, DIST_BACKENDS)
    _one_of("train.device", c.train.device, DEVICES)
    _validate_transport(c)
    _one_of("comm.wire_precision", c.comm.wire_precision, WIRE_PRECISIONS)
    _one_of("comm.settled_rows", c.comm.settled_rows, SETTLED_ROWS)
    _check(c.comm.timeout_s > 0, "comm.timeout_s", c.comm.timeout_s, "must be > 0")
    _finite("comm.timeout_s", c.comm.timeout_s)


def _validate_embedding(c: Config) -> None:
    """embedding: the rows' init, storage type and rounding (kind: _validate_dynamic, store: _validate_store)."""
    e = c.embedding
    _check(e.init_scale is not None, "embedding.init_scale", None, _UNRESOLVED)
    _check(e.init_scale >= 0, "embedding.init_scale", e.init_scale, "must be >= 0 (0 = sqrt(1 / rows) per table)")
    _finite("embedding.init_scale", e.init_scale)
    _one_of("embedding.dtype", e.dtype, EMBEDDING_DTYPES)
    _one_of("embedding.rounding", e.rounding, ROUNDINGS)


def _validate_train(c: Config) -> None:
    """train: steps, cadences, threads, the step's pipeline, precision (with its loss scale), seeds,
    non-finite losses, padding, signals."""
    t = c.train
    _check(t.steps > 0, "train.steps", t.steps, "must be > 0")
    _check(t.log_every > 0, "train.log_every", t.log_every, "must be > 0")
    if t.eval_every is not None:  # null: the recipe's, resolved with W (recipes.apply_data_steps)
        _check(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0")
    _check(t.threads >= 0, "train.threads", t.threads, "must be >= 0 (0 = auto)")
    _one_of("train.progress", t.progress, ("auto", "on", "off"))
    _one_of("train.pipeline", t.pipeline, PIPELINES)
    if t.pipeline == "rows":  # the rows of step i+1 are read before step i's updates reach their owners
        _check(c.cache.policy != "none" and 0 not in staleness_bounds(c)[0], "train.pipeline", t.pipeline,
               "rows reads the next step's rows one step early: it needs a cache (cache=lru|lfu|...) "
               "and a pull_bound >= 1 (or -1) for every table; use train.pipeline=ids for exact training")
        _check(t.nonfinite != "skip", "train.pipeline", t.pipeline,
               "rows cannot undo a prefetched step: use train.nonfinite=stop or train.pipeline=ids")
    _validate_precision(c)
    _check(t.seed >= 0, "train.seed", t.seed, "must be >= 0")
    _one_of("train.nonfinite", t.nonfinite, NONFINITE)
    _check(t.max_skips > 0, "train.max_skips", t.max_skips, "must be > 0")
    _check(t.unique_capacity >= -1, "train.unique_capacity", t.unique_capacity,
           "must be >= 0 (0 = the bound), or -1 (measured)")
    _check(t.capacity_margin > 0, "train.capacity_margin", t.capacity_margin, "must be > 0")
    _one_of("train.on_signal", t.on_signal, ON_SIGNAL)


def _validate_precision(c: Config) -> None:
    """Mixed precision of the dense model (trainer/step/precision.py)."""
    t, s = c.train, c.train.loss_scale
    _one_of("train.precision", t.precision, PRECISIONS)
    _check(s.init > 0, "train.loss_scale.init", s.init, "must be > 0")
    _finite("train.loss_scale.init", s.init)
    _check(s.growth_factor >= 1, "train.loss_scale.growth_factor", s.growth_factor, "must be >= 1")
    _finite("train.loss_scale.growth_factor", s.growth_factor)
    _check(0 < s.backoff_factor < 1, "train.loss_scale.backoff_factor", s.backoff_factor, "must be in (0, 1)")
    _check(s.growth_interval > 0, "train.loss_scale.growth_interval", s.growth_interval, "must be > 0")
    _one_of("train.cuda_graph", t.cuda_graph, ("off", "dense", "on"))
    _check(not (t.cuda_graph != "off" and t.precision == "fp16"), "train.cuda_graph", t.cuda_graph,
           "is not available with train.precision=fp16 (its loss scale changes between steps): use bf16")
    if t.precision == "fp16":  # the scaler skips a step whose gradients overflow: it must be undoable
        _check(t.pipeline != "rows", "train.precision", t.precision,
               "fp16's loss scaler skips a step whose gradients overflow, which train.pipeline=rows "
               "cannot undo (its next step was read before): use train.pipeline=ids or off, or bf16")


def _validate_lr_schedule(c: Config) -> None:
    """optim: regularisation and the learning-rate schedule (trainer/step/lr.py)."""
    o = c.optim
    for key, v in (("optim.weight_decay", o.weight_decay), ("optim.sparse_weight_decay", o.sparse_weight_decay)):
        _check(v is not None, key, v, _UNRESOLVED)
        _check(v >= 0, key, v, "must be >= 0 (0 = none)")
        _finite(key, v)
    _check(o.warmup_steps is not None, "optim.warmup_steps", o.warmup_steps, _UNRESOLVED)
    _check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0 (0 = no warmup)")
    _check(o.decay is not None, "optim.decay", o.decay, _UNRESOLVED)
    _one_of("optim.decay", o.decay, LR_DECAYS)
    _check(o.decay_start >= -1, "optim.decay_start", o.decay_start, "must be >= 0, or -1 (right after the warmup)")
    _check(o.decay_steps >= 0, "optim.decay_steps", o.decay_steps, "must be >= 0 (0 = until train.steps)")
    _check(o.decay_power > 0, "optim.decay_power", o.decay_power, "must be > 0")
    _finite("optim.decay_power", o.decay_power)


def _validate_early_stop(c: Config) -> None:
    """train: the recipe, early stopping, calibration, ensembles. Early stopping looks at the
    validation split only, never at the test split."""
    t, e = c.train, c.train.early_stop
    _one_of("train.recipe", t.recipe, RECIPES)
    _check(e.patience is not None, "train.early_stop.patience", e.patience, _UNRESOLVED)
    _check(e.patience >= 0, "train.early_stop.patience", e.patience, "must be >= 0 (0 = never stop early)")
    _check(e.min_evals is not None, "train.early_stop.min_evals", e.min_evals, _UNRESOLVED)
    _check(e.min_evals >= 0, "train.early_stop.min_evals", e.min_evals, "must be >= 0 (0 = may stop at any evaluation)")
    _check(e.min_delta >= 0, "train.early_stop.min_delta", e.min_delta, "must be >= 0")
    _finite("train.early_stop.min_delta", e.min_delta)
    _check(e.snapshot in ("auto", "memory", "disk"), "train.early_stop.snapshot", e.snapshot,
           "must be auto, memory or disk")
    if e.patience > 0:
        _check(bool(c.data.val_fraction), "train.early_stop.patience", e.patience,
               "early stopping needs a validation split (data.val_fraction > 0); it never looks at the test split")
        _check(t.eval_every != 0, "train.early_stop.patience", e.patience,
               "early stopping needs validation evaluations: set train.eval_every > 0")
    _check(t.calibrate is not None, "train.calibrate", t.calibrate, _UNRESOLVED)
    if t.calibrate:
        _check(bool(c.data.val_fraction), "train.calibrate", t.calibrate,
               "the temperature is fitted on the validation split (data.val_fraction > 0), never on the test split")
    _check(t.ensemble is not None, "train.ensemble", t.ensemble, _UNRESOLVED)
    _check(t.ensemble >= 1, "train.ensemble", t.ensemble, "must be >= 1 (1 = one model)")
    if t.ensemble > 1:
        _check(c.data.name == "criteo" and bool(c.data.val_fraction), "train.ensemble", t.ensemble,
               "the members differ by their validation slice: a data=criteo option that needs data.val_fraction > 0")
        _check(c.data.val_slice == 1, "data.val_slice", c.data.val_slice,
               f"train.ensemble={t.ensemble} gives every member its own validation slice; leave data.val_slice at 1")
        _check(c.checkpoint.resume in (None, "auto"), "checkpoint.resume", c.checkpoint.resume,
               f"train.ensemble={t.ensemble} keeps a checkpoint directory per member: resume with checkpoint.resume=auto")


def _validate_placement(c: Config) -> None:
    """placement and schedule (herald: with the consistency and cache it works with)."""
    p, s = c.placement, c.schedule
    _one_of("placement.name", p.name, PLACEMENTS)
    _one_of("schedule.name", s.name, SCHEDULES)
    _check(p.budget_bytes >= 0, "placement.budget_bytes", p.budget_bytes, "must be >= 0")
    _check(0 < p.profile_fraction <= 1, "placement.profile_fraction", p.profile_fraction, "must be in (0, 1]")
    _check(0 <= p.hot_rate <= 1, "placement.hot_rate", p.hot_rate, "must be in [0, 1]")
    _check(p.window_batches > 0, "placement.window_batches", p.window_batches, "must be > 0")
    _check(p.buckets > 0, "placement.buckets", p.buckets, "must be > 0")
    _check(p.plan_steps > 0, "placement.plan_steps", p.plan_steps, "must be > 0")
    _check(s.passes >= 0, "schedule.passes", s.passes, "must be >= 0")
    if s.name == "herald":
        _check(c.consistency.pull_bound == 0 and c.consistency.push_bound == 0 and not c.consistency.tables,
               "consistency", c.consistency.name, "schedule=herald is exact (BSP): use consistency=bsp")
        _check(c.cache.policy in ("none", "lru"), "cache.policy", c.cache.policy,
               "schedule=herald holds lent rows in an LRU cache: use cache=lru (or cache=none)")


STORES = ("memory", "disk")


def _validate_store(c: Config) -> None:
    """embedding.store=disk (embedding/store/tier/) and what it does not support yet: one line each."""
    e = c.embedding
    _one_of("embedding.store", e.store, STORES)
    _check(e.store_cache_bytes >= 0, "embedding.store_cache_bytes", e.store_cache_bytes,
           "must be >= 0 (0 = a quarter of the memory a rank may have)")
    if e.store == "memory":
        return
    _check(e.kind == "fixed", "embedding.store", e.store,
           "keeps fixed tables on disk (a row's place in the file is its id): needs embedding.kind=fixed")
    _check(c.train.device != "cuda", "embedding.store", e.store,
           "maps the shard into host memory: needs train.device=cpu (or auto on a machine without a GPU)")
    _check(not e.audit, "embedding.audit", e.audit, "keeps an array over every id: not with embedding.store=disk")


def _validate_dynamic(c: Config) -> None:
    """embedding.kind=dynamic and what it does not support yet (docs/dynamic.md#what-it-refuses):
    each refusal is one line, before anything starts."""
    e = c.embedding
    _one_of("embedding.kind", e.kind, TABLE_KINDS)
    _one_of("embedding.eviction", e.eviction, EVICTIONS)
    _check(e.admit_after >= 1, "embedding.admit_after", e.admit_after, "must be >= 1 (1 = admit at once)")
    _check(e.lfu_half_life >= 0, "embedding.lfu_half_life", e.lfu_half_life, "must be >= 0 (0 = no decay)")
    _check(e.ttl_steps >= 0, "embedding.ttl_steps", e.ttl_steps, "must be >= 0 (0 = rows never expire)")
    _check(not e.lfu_half_life or e.eviction == "lfu", "embedding.lfu_half_life", e.lfu_half_life,
           "decays LFU's use counts: needs embedding.eviction=lfu")
    _check(e.admit_after < 1 << 16, "embedding.admit_after", e.admit_after, "must be < 65536")
    _validate_admit_counter(e)
    _check(e.capacity >= 0, "embedding.capacity", e.capacity, "must be >= 0 (rows per table on each owner)")
    _check(e.capacity_bytes >= 0, "embedding.capacity_bytes", e.capacity_bytes, "must be >= 0 (0 = give embedding.capacity)")
    _check(not e.capacity_bytes or e.kind == "dynamic", "embedding.capacity_bytes", e.capacity_bytes,
           "is the pool's budget of dynamic tables: needs embedding.kind=dynamic")
    _check(c.data.drift >= 0 and math.isfinite(c.data.drift), "data.drift", c.data.drift, "must be a finite number >= 0")
    _check(c.data.drift_eval_at >= 0, "data.drift_eval_at", c.data.drift_eval_at, "must be >= 0")
    _check(c.data.hash_rows >= 0, "data.hash_rows", c.data.hash_rows, "must be >= 0 (0 = off)")
    if c.data.hash_rows:
        _check(c.data.name == "synthetic", "data.hash_rows", c.data.hash_rows,
               "is a synthetic-data option (Criteo: prepare_criteo.py --hash-rows)")
        _check(e.kind == "fixed", "data.hash_rows", c.data.hash_rows, "hashes ids into fixed tables: needs embedding.kind=fixed")
    if e.kind != "dynamic":
        if c.data.hash_rows:  # ids hashed into the tables' rows: any id is fine
            return
        _check(not c.data.scramble_ids, "data.scramble_ids", True, "needs embedding.kind=dynamic or data.hash_rows")
        _check(not c.data.drift, "data.drift", c.data.drift,
               "drifting ids are unbounded: needs embedding.kind=dynamic or data.hash_rows")
        return
    _check(c.data.name == "synthetic" or not c.data.drift, "data.drift", c.data.drift, "is a synthetic-data option")
    _check(e.capacity > 0 or e.capacity_bytes > 0, "embedding.capacity", e.capacity,
           "embedding.kind=dynamic needs a pool of > 0 rows per table (or embedding.capacity_bytes)")
    _check(c.data.name == "synthetic" or not c.data.scramble_ids, "data.scramble_ids", True,
           "is a synthetic-data option")
    lent = c.schedule.name == "herald"
    for key, value, ok, why in (
            ("placement.name", c.placement.name, c.placement.name != "sca",
             "sca's cost model (it simulates fixed tables): use placement=fae"),
            ("embedding.audit", e.audit, not e.audit, "the audit (an array over every id)"),
            ("train.nonfinite", c.train.nonfinite, not (c.train.nonfinite == "skip" and lent),
             "skipped steps with rows lent (schedule=herald): their admissions are not undone"),
            ("train.precision", c.train.precision, not (c.train.precision == "fp16" and lent),
             "fp16's skipped steps with rows lent (schedule=herald): their admissions are not undone"),
            ("comm.settled_rows", c.comm.settled_rows, c.comm.settled_rows != "always", "early settled rows")):
        _check(ok, key, value, f"embedding.kind=dynamic does not support {why} yet (docs/dynamic.md)")


def _validate_admit_counter(e: EmbeddingConfig) -> None:
    """embedding.admit_counter and the count-min sketch's keys (docs/dynamic.md#admission)."""
    _one_of("embedding.admit_counter", e.admit_counter, ADMIT_COUNTERS)
    _check(e.count_min_bytes > 0, "embedding.count_min_bytes", e.count_min_bytes, "must be > 0")
    _check(1 <= e.count_min_depth <= 16, "embedding.count_min_depth", e.count_min_depth, "must be in [1, 16]")
    _check(e.count_min_halve_steps >= 0, "embedding.count_min_halve_steps", e.count_min_halve_steps,
           "must be >= 0 (0 = never)")
    _check(not e.count_min_halve_steps or e.admit_counter == "count_min", "embedding.count_min_halve_steps",
           e.count_min_halve_steps, "halves the sketch's counters: needs embedding.admit_counter=count_min")
    if e.admit_counter != "count_min":
        return
    _check(e.kind == "dynamic", "embedding.admit_counter", e.admit_counter,
           "counts dynamic tables' ids before admission: needs embedding.kind=dynamic")
    _check(e.admit_after > 1, "embedding.admit_counter", e.admit_counter,
           "counts ids before admission: needs embedding.admit_after > 1 (1 admits at once)")
    _check(e.admit_after < 1 << 15, "embedding.admit_after", e.admit_after,
           "must be < 32768 with embedding.admit_counter=count_min (int16 counters)")
    _check(e.count_min_bytes >= 2 * e.count_min_depth, "embedding.count_min_bytes", e.count_min_bytes,
           f"too small for {e.count_min_depth} rows of int16 counters (embedding.count_min_depth)")


def _validate_checkpoint(c: Config) -> None:
    """checkpoint: cadence, retention, lease, directories."""
    k = c.checkpoint
    _check(k.every >= 0, "checkpoint.every", k.every, "must be >= 0 (0 = only the final checkpoint)")
    _check(k.keep_last >= 0, "checkpoint.keep_last", k.keep_last, "must be >= 0 (0 = keep all)")
    _check(k.lock_lease_s > 0, "checkpoint.lock_lease_s", k.lock_lease_s, "must be > 0 (seconds)")
    if k.dir is not None:
        _check(bool(k.dir.strip()), "checkpoint.dir", k.dir, "must be a directory path or null")
    if k.resume is not None and k.resume != "auto":
        _check(os.path.isdir(k.resume), "checkpoint.resume", k.resume,
               "must be null, auto, or an existing checkpoint directory (step_K)")


def _validate_kernels(c: Config) -> None:
    """kernels.backend is known and can run on train.device ($TRAINER_KERNELS, when set, is the
    value in force and is checked instead): forcing triton needs triton, and CUDA or
    TRITON_INTERPRET=1. The same check runs again in kernels.configure at start-up."""
    _one_of("kernels.backend", c.kernels.backend, KERNEL_BACKENDS)
    import kernels  # torch + the dispatch; triton itself is never imported here

    env = os.environ.get(kernels.ENV_VAR, "").strip().lower()
    name, source = (env, kernels.ENV_VAR) if env else (c.kernels.backend, "kernels.backend")
    try:
        kernels.check_backend(name, run_device(c), source)
    except kernels.BackendError as exc:
        raise ConfigError(str(exc)) from None


def _validate_transport(c: Config) -> None:
    """comm.dist_backend=nccl needs the run on CUDA: NCCL moves CUDA tensors only."""
    if c.comm.dist_backend != "nccl":
        return
    _check(c.train.device != "cpu", "comm.dist_backend", c.comm.dist_backend,
           "NCCL moves CUDA tensors only, and train.device=cpu trains on the CPU: use "
           "comm.dist_backend=gloo (or auto), or train.device=cuda")
    _check(_cuda_available(), "comm.dist_backend", c.comm.dist_backend,
           "needs a CUDA device, and none is visible here: use comm.dist_backend=gloo (or auto)")


def _table_key(group: str, key: str, num_tables: int) -> int:
    _check(key.isdigit() and int(key) < num_tables, f"{group}.tables.{key}", key,
           f"table keys are table indices 0..{num_tables - 1}")
    return int(key)


def _validate_cache(c: Config) -> None:
    """cache: the policy and capacities, and per table."""
    k = c.cache
    _one_of("cache.policy", k.policy, CACHE_POLICIES)
    _check(0 <= k.capacity_fraction <= 1, "cache.capacity_fraction", k.capacity_fraction, "must be in [0, 1]")
    if k.capacity_rows is not None:
        _check(k.capacity_rows >= 0, "cache.capacity_rows", k.capacity_rows, "must be >= 0")
    _check(k.pin_threshold > 0, "cache.pin_threshold", k.pin_threshold, "must be > 0")
    n = len(c.data.table_rows)
    for key, t in k.tables.items():
        _table_key("cache", key, n)
        if t.capacity_rows is not None:
            _check(t.capacity_rows >= 0, f"cache.tables.{key}.capacity_rows", t.capacity_rows, "must be >= 0")
        if t.capacity_fraction is not None:
            _check(0 <= t.capacity_fraction <= 1, f"cache.tables.{key}.capacity_fraction",
                   t.capacity_fraction, "must be in [0, 1]")


def _validate_consistency(c: Config) -> None:
    """consistency: the staleness bounds, and per table."""
    n = len(c.data.table_rows)
    s = c.consistency
    _one_of("consistency.name", s.name, CONSISTENCY_PRESETS)
    for key, v in (("consistency.pull_bound", s.pull_bound), ("consistency.push_bound", s.push_bound)):
        _check(v >= -1, key, v, "must be >= 0, or -1 for unbounded")
    for key, t in s.tables.items():
        _table_key("consistency", key, n)
        for name, v in (("pull_bound", t.pull_bound), ("push_bound", t.push_bound)):
            if v is not None:
                _check(v >= -1, f"consistency.tables.{key}.{name}", v, "must be >= 0, or -1 for unbounded")


# validate's order: each block's checks, the first failing one wins (model's layers after the
# data, the device with the transport it decides, placement with the schedule it works with)
BLOCK_CHECKS = (_validate_model, _validate_data_source, _validate_data_splits, _validate_model_layers,
                _validate_optim, _validate_lr_schedule, _validate_comm, _validate_embedding, _validate_cache,
                _validate_consistency, _validate_dynamic, _validate_store, _validate_train, _validate_early_stop,
                _validate_kernels, _validate_checkpoint, _validate_placement)


def validate_world(c: Config, world: int) -> None:
    """Checks that need the world size (known only once the collectives are up)."""
    local_batch_size(c, world)
    for i, n in enumerate(table_rows(c)):
        _check(n >= world, f"data.table_rows[{i}]", n,
               f"has fewer rows than the {world} workers; every worker must own at least one row")
