"""Typed config schemas (one dataclass per Hydra group) and validation with clear messages.

Why: Hydra composes YAML; this module turns the composed tree into typed dataclasses (OmegaConf
rejects unknown keys and wrong types, naming the full key) and then checks ranges and cross-field
rules, so a bad sweep value fails at start-up with `key=value: reason`, not deep inside a step.

A leaf: it imports nothing else of trainer/ (the `kernels` package is outside it), so any module may
use the schemas. What a file dataset says about itself (dense features, table rows, training rows)
is read by trainer.data and applied by the entry point (trainer/plan/configure.py: load_config) with the
pure helpers here (check_data_source, apply_data_shape, epoch_steps). The values a null key takes
(the recipes: tuning policy, measured on data) are not here but in trainer/plan/recipes.py; this module
only names the recipes (RECIPES) and refuses a key left unresolved.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

MODELS = ("dlrm", "wdl", "deepfm", "dcn")
DATASETS = ("synthetic", "criteo", "movielens")
FILE_DATASETS = ("criteo", "movielens")  # shape (dense, table rows) comes from the files
LOADERS = ("dali", "memmap")
DENSE_OPTIMS = ("sgd", "adagrad", "adam")
SPARSE_OPTIMS = ("sgd", "adagrad", "rowwise_adagrad")
POOLINGS = ("sum", "mean")
BACKENDS = ("auto", "local", "torch", "horovod")
CACHE_POLICIES = ("none", "lru", "lfu", "lfu_pinned")
KERNEL_BACKENDS = ("auto", "triton", "reference")  # = kernels.BACKENDS
PLACEMENTS = ("none", "fae", "sca")  # = placement.PLANNERS
SCHEDULES = ("random", "herald")
GLOBAL_VIEW_DATASETS = ("synthetic", "movielens")  # random access to any sample: schedulers, profiles
OUT_OF_RANGE = ("error", "hash")  # data.out_of_range (trainer/data/ids.py)
NONFINITE = ("stop", "skip")  # train.nonfinite
ON_SIGNAL = ("save", "stop")  # train.on_signal (trainer/run/signals.py)
CONSISTENCY_PRESETS = ("bsp", "ssp", "asp")  # consistency.name (conf/consistency/*.yaml)
LR_DECAYS = ("none", "poly")  # optim.decay (trainer/train/lr.py)
RECIPES = ("auto", "tiny", "small", "large", "none")  # train.recipe (trainer/plan/recipes.py)


WIRE_PRECISIONS = ("fp32", "fp16", "bf16")
TABLE_KINDS = ("fixed", "dynamic")  # embedding.tables
ADMIT_COUNTERS = ("exact", "count_min")  # embedding.admit_counter (trainer/embedding/admission.py)
EVICTIONS = ("lru", "lfu")  # embedding.eviction
EMBEDDING_DTYPES = ("fp32", "fp16", "bf16")  # embedding.dtype (= embedding/store.ROW_DTYPES)
ROUNDINGS = ("stochastic", "nearest")  # embedding.rounding (= embedding/optim.ROUNDINGS)
SETTLED_ROWS = ("auto", "always", "never")
DEVICES = ("auto", "cpu", "cuda")  # train.device (resolve_device)
DIST_BACKENDS = ("auto", "gloo", "nccl")  # comm.dist_backend (dist_transport)
PIPELINES = ("off", "ids", "rows")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # train.precision (trainer/train/precision.py)


class ConfigError(ValueError):
    """A config value is out of range or inconsistent; the message names the key."""


@dataclass
class ModelConfig:
    name: str = MISSING  # model architecture: dlrm
    embedding_dim: Optional[int] = 16  # d, the width of every embedding row; null = the recipe's (WDL's and DCN's presets: 32 on tiny and small data, else 16)
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32])  # hidden widths of the dense MLP (a d-wide layer is appended)
    top_mlp: Optional[list[int]] = field(default_factory=lambda: [64, 32])  # hidden widths of the top MLP (a 1-wide logit layer is appended); null = the recipe's (DLRM's preset)
    pooling: str = "sum"  # bag pooling of multi-hot features: sum | mean
    cross_layers: int = 3  # dcn: number of cross layers
    cross_rank: int = 0  # dcn: rank of each cross layer's weight (0 = full rank, DCN-v2's W)
    dropout: Optional[float] = None  # dropout rate after every hidden layer of the MLPs (training only); null = the recipe's (0 unless it says otherwise)


@dataclass
class DataConfig:
    name: str = MISSING  # dataset kind: synthetic
    preset: str = "custom"  # informational name of the preset (tiny, criteo_like, bench)
    num_dense: int = 13  # number of dense (continuous) features
    table_rows: list[int] = MISSING  # rows per embedding table (cardinalities), before the cap
    max_table_rows: int = 0  # cap applied to every table's rows; 0 = no cap
    min_bag: int = 1  # fewest ids in one sample's bag of a table (0 allows empty bags)
    max_bag: int = 1  # most ids in one bag (> 1 = multi-hot)
    zipf_alpha: float = 1.1  # skew of id popularity, p(rank k) ~ 1 / (k + 1) ** alpha
    signal: float = 2.0  # strength of the planted label signal (0 = labels are coin flips)
    batch_size: int = 128  # samples per rank per step (ignored when global_batch_size is set)
    global_batch_size: Optional[int] = None  # if set: samples per step over all ranks (must divide by W)
    train_samples: int = 0  # size of the training set (epochs wrap); 0 = a fresh stream every step
    eval_samples: int = 4096  # size of the held-out eval split
    eval_batch_size: int = 1024  # eval samples per rank per eval step
    seed: int = 1234  # data seed (ids, labels, planted weights)
    dir: Optional[str] = None  # criteo: directory from scripts/prepare_criteo.py; movielens: folder with ml-100k.* (null = recbole's)
    loader: str = "dali"  # criteo reader: dali (default) | memmap (the reference)
    loader_threads: int = 1  # threads per rank: DALI pipeline threads (criteo), batch row chunks (synthetic)
    eval_fraction: float = 0.1  # held-out share: criteo's tail (when no test split), movielens' random split
    shuffle: bool = True  # criteo/movielens: seeded shuffle of training rows (criteo: block order + rows in a block)
    epochs: Optional[float] = 0.0  # criteo/movielens: > 0 sets train.steps = ceil(epochs * training rows / global batch); null = the recipe's
    standardize: Optional[bool] = None  # criteo: dense features -> (x - mean) / std of the training rows (the first 1M); null = the recipe's (tiny and small: true, else false)
    val_fraction: Optional[float] = None  # validation split: the last share of the training rows (never the test split), evaluated every train.eval_every steps; 0 = none; null = the recipe's (dynamic tables too: the best model's snapshot keeps each slot's id and life)
    min_count: Optional[int] = None  # criteo: ids seen fewer times in the training rows share one out-of-vocabulary row per table, and the tables shrink to the ids kept (trainer/data/vocab.py); 0 = off; null = the recipe's (tiny and small: 1, else 0)
    val_slice: int = 1  # criteo: which slice of val_fraction of the training rows is the validation split, counted from the end (1 = the last; dev/recipe_study/val_rotations.py)
    out_of_range: str = "error"  # an id < 0 or >= its table's rows: error (stop, naming table, id, rows) | hash (id mod rows)
    drift: float = 0.0  # synthetic, embedding.tables=dynamic: ids drift by floor(drift x stream position): new ids keep arriving, popularity moves (0 = no drift)
    drift_eval_at: int = 0  # with drift: evaluation samples are drawn as at this training sample position
    cycle_batches: int = 0  # synthetic: K > 0: the training stream repeats its first K global batches, each made once (benchmarks)
    scramble_ids: bool = False  # synthetic, embedding.tables=dynamic: present table t's id i as a random-looking id in [0, 2^56) (a bijection per table)
    hash_rows: int = 0  # synthetic, embedding.tables=fixed: N > 0 hashes every (scrambled, drifting) id into N rows per table (splitmix64 mod N; collisions share a row): dynamic tables' same-memory baseline, as prepare_criteo --hash-rows; 0 = off


@dataclass
class OptimConfig:
    name: Optional[str] = "sgd"  # preset name (informational); optim=auto (the default): the recipe's
    dense: Optional[str] = "sgd"  # optimizer of dense parameters: sgd | adagrad | adam; null = the recipe's
    sparse: Optional[str] = "sgd"  # owner-side optimizer of embedding rows: sgd | adagrad | rowwise_adagrad; null = the recipe's
    lr: Optional[float] = 0.1  # learning rate of dense parameters (and of rows unless sparse_lr is set); null = the recipe's
    sparse_lr: Optional[float] = None  # learning rate of embedding rows; null = lr (or the recipe's, under optim=auto)
    eps: Optional[float] = 1e-10  # Adagrad/Adam epsilon (torch's placement: lr * g / (sqrt(state) + eps)); null = the recipe's
    momentum: float = 0.0  # SGD momentum of dense parameters
    initial_accumulator: float = 0.1  # Adagrad state start (TensorFlow's 0.1; 0 = torch's, ill-conditioned: see README)
    weight_decay: Optional[float] = None  # L2 of dense parameters (torch.optim's weight_decay: g += wd * w); null = the recipe's (0 unless it says otherwise)
    sparse_weight_decay: Optional[float] = None  # L2 of embedding rows, applied by the owner once per touched row per step (g += wd * w); null = the recipe's
    warmup_steps: Optional[int] = None  # lr ramps linearly to its value over these steps (factor (k + 1) / (warmup + 1) at step k); null = the recipe's
    decay: Optional[str] = None  # lr decay after warmup: none | poly (MLPerf DLRM: (1 - k / decay_steps) ** decay_power); null = the recipe's
    decay_start: int = -1  # first step of the decay; -1 = right after the warmup
    decay_steps: int = 0  # length of the decay in steps (lr reaches 0 at its end, then stays there); 0 = until train.steps
    decay_power: float = 2.0  # exponent of the polynomial decay (2 = MLPerf DLRM's)


@dataclass
class CommConfig:
    backend: str = "auto"  # auto | local | torch | horovod (auto follows the launcher)
    dist_backend: str = "auto"  # torch backend's transport: auto (nccl when the run's device is cuda and each rank of the host has a GPU, else gloo: dist_transport) | gloo | nccl (cuda only)
    timeout_s: float = 60.0  # a collective waiting longer than this raises, naming the operation
    wire_precision: str = "fp32"  # rows and row gradients on the wire: fp32 | fp16 | bf16 (owners keep their embedding.dtype)
    settled_rows: str = "auto"  # train.pipeline=ids, no cache: send the next step's rows this step does not update early: auto (when the ranks span hosts) | always | never


@dataclass
class EmbeddingConfig:
    init_scale: Optional[float] = None  # rows ~ U(-s, s); 0 = sqrt(1 / rows) per table (DLRM); null = the recipe's (tiny and small: 0.01, else 0)
    audit: bool = False  # record every read's version and every computed row gradient (tests; slow)
    dtype: str = "fp32"  # how owners store rows: fp32 | fp16 | bf16 (optimizer state stays fp32; updates computed in fp32)
    rounding: str = "stochastic"  # how an updated fp16 / bf16 row is written back: stochastic (unbiased, seeded by train.seed, step, row) | nearest
    tables: str = "fixed"  # fixed (rows 0..table_rows-1, owner id mod W) | dynamic (any id in [0, 2^56): hashed owner, id -> row map, admission, eviction; docs/dynamic.md)
    capacity: int = 0  # dynamic: rows per table on each owner (the pool); > 0, or set by capacity_bytes
    capacity_bytes: int = 0  # dynamic: each owner's budget for its pool in bytes (rows, optimizer state, version, the pool's map and scores): sets capacity to the most rows per table that fit (memplan.capacity_for_budget); 0 = give capacity
    admit_after: int = 1  # dynamic: an id gets a row the k-th step it is seen (1 = at once); before that it reads zeros and its gradient is dropped
    eviction: str = "lru"  # dynamic, full pool: lru (least recently used) | lfu (fewest uses, ties least recent)
    ttl_steps: int = 0  # dynamic: a row not read for more than this many steps expires: its id starts a new life (its initial row) when next seen; 0 = never
    lfu_half_life: int = 0  # dynamic, eviction=lfu: a row's use count halves for every this many steps it is not read (old popularity fades); 0 = no decay
    admit_counter: str = "exact"  # dynamic, admit_after > 1: how ids are counted until admitted: exact (a map entry per id not admitted yet, 32-86 B each: grows with the distinct ids) | count_min (a count-min sketch of count_min_bytes per owner: fixed memory, never under-counts, so ids may be admitted early; docs/dynamic.md#admission)
    count_min_bytes: int = 16 << 20  # count_min: the sketch's bytes per owner, count_min_depth rows of int16 counters (16 MiB: 4 x 2M counters, about 2% of 1M ids seen once admitted at once with admit_after=2)
    count_min_depth: int = 4  # count_min: rows of the sketch (hashes per id)
    count_min_halve_steps: int = 0  # count_min: halve every counter each time the step passes a multiple of this (old sightings fade); 0 = never


@dataclass
class TableCacheConfig:
    """Per-table override of the cache capacity (either field; null = inherit)."""

    capacity_rows: Optional[int] = None  # rows of this table a worker may cache
    capacity_fraction: Optional[float] = None  # ... or this fraction of the table's rows


@dataclass
class CacheConfig:
    """HET's per-worker cache of remote rows (docs/design.md, section 5)."""

    policy: str = "none"  # none | lru | lfu | lfu_pinned
    capacity_fraction: float = 0.1  # cached rows per table, as a fraction of the table's rows
    capacity_rows: Optional[int] = None  # cached rows per table (overrides capacity_fraction)
    pin_threshold: int = 8  # lfu_pinned: an entry used at least this often is never evicted
    tables: dict[str, TableCacheConfig] = field(default_factory=dict)  # per-table overrides, key = table index


@dataclass
class TableBoundsConfig:
    """Per-table override of the staleness bounds (null = inherit)."""

    pull_bound: Optional[int] = None
    push_bound: Optional[int] = None


@dataclass
class ConsistencyConfig:
    """HET bounded staleness: bounds of 0 are exact synchronous training (BSP); -1 = unbounded."""

    name: str = "bsp"  # preset chosen (bsp | ssp | asp); summary.json reports the label of the bounds in force
    pull_bound: int = 0  # a cached row is re-read when its owner is more than this many updates ahead
    push_bound: int = 0  # local updates are pushed once a row holds more than this many
    tables: dict[str, TableBoundsConfig] = field(default_factory=dict)  # per-table overrides, key = table index


@dataclass
class KernelsConfig:
    """Which implementation runs the sparse hot path (pooled gather, scatter + optimizer, id map)."""

    backend: str = "auto"  # auto (Triton on CUDA tensors, torch reference otherwise) | triton | reference; $TRAINER_KERNELS overrides


@dataclass
class PlacementConfig:
    """Which rows are replicated on every worker (hot) instead of sharded (trainer/placement/)."""

    name: str = "none"  # none (every row sharded) | fae (hot rows by budget + hot/cold batches) | sca (cost-model planner)
    budget_bytes: int = 1048576  # per-worker memory for replicated rows (sca: replicated + cached rows), bytes
    profile_fraction: float = 0.05  # share of the run's training samples the profiler counts (every k-th sample)
    hot_batches: bool = False  # schedule hot batches (every id replicated: no alltoall) apart from cold ones
    hot_rate: float = 0.5  # at most this share of a window's steps are hot batches
    window_batches: int = 16  # hot/cold batches are formed within windows of this many global batches
    buckets: int = 32  # sca: frequency buckets the planner decides for (replicate / cache / shard)
    plan_steps: int = 32  # sca: steps of the run's stream each candidate placement is replayed on (simulator)


@dataclass
class ScheduleConfig:
    """Which worker trains which sample of a global batch, and when updated rows are synchronised."""

    name: str = "random"  # random (equal contiguous slices of the shuffled global batch) | herald
    on_demand_sync: bool = True  # herald: push a row's update only when another worker reads it next step (or at a flush)
    cache_aware: bool = True  # herald: a sample also scores for the rows a worker holds (on-demand sync's lent rows)
    passes: int = 2  # herald: co-location passes after the owner/holder pass (each ~N ids x W lookups)


@dataclass
class EarlyStopConfig:
    """Early stopping on validation AUC (needs data.val_fraction > 0 and train.eval_every > 0)."""

    patience: Optional[int] = None  # stop after this many validation evaluations without a new best; 0 = never stop early; null = the recipe's (tiny and small: 3 epochs, i.e. 3 x the evaluations per epoch when train.eval_every is the recipe's too, else 3)
    min_delta: float = 0.0  # a new best must beat the old one's validation AUC by more than this
    min_evals: Optional[int] = None  # never stop before this many validation evaluations (a model still at its start can score below its first evaluation for a few epochs); null = the recipe's (tiny and small: 10 epochs, counted as patience is, else 0)
    restore_best: bool = True  # with a validation split: the model of the best validation AUC is restored for the final test evaluation
    snapshot: str = "auto"  # where the best model's rows are kept: memory, disk (a temporary file in the run's directory) or auto (memory when the rank's rows take at most 256 MiB)


@dataclass
class LossScaleConfig:
    """train.precision=fp16's loss scaler (torch.amp.GradScaler's semantics and defaults)."""

    init: float = 65536.0  # the first scale (2 ** 16)
    growth_factor: float = 2.0  # the scale is multiplied by this after growth_interval steps in a row without overflow
    backoff_factor: float = 0.5  # ... and by this at a step whose gradients overflow (that step is skipped on every rank)
    growth_interval: int = 2000  # steps in a row without overflow before the scale grows


@dataclass
class TrainConfig:
    steps: int = 200  # training steps (each consumes one global batch)
    seed: int = 0  # seed of dense init and embedding init
    log_every: int = 10  # write a JSONL metrics line every N steps
    eval_every: Optional[int] = 0  # evaluate every N steps too (0 = only at the end); on the validation split when there is one; null = the recipe's (tiny and small: k times per epoch, k = ceil(epoch rows / 1,280) up to 4; resolved once W is known)
    threads: int = 0  # torch threads per rank; 0 = cores / local ranks
    progress: str = "auto"  # progress bar on rank 0: auto (when interactive) | on | off
    device: str = "auto"  # auto (cuda when a GPU is visible, else cpu: run_device) | cpu | cuda; comm.dist_backend=auto follows it (nccl on cuda)
    nonfinite: str = "stop"  # NaN/inf global loss: stop (error naming the step) | skip (drop the batch, no update anywhere; dynamic tables: the step's admissions, evictions and counts undone too)
    max_skips: int = 10  # nonfinite=skip: stop anyway after this many consecutive skipped steps
    memory_check: bool = True  # stop at start-up (exit 2) when a rank's memory plan (trainer/plan/memplan.py) exceeds the memory it can have; false: warn and start
    on_signal: str = "save"  # SIGTERM / SIGINT / SIGUSR1: stop every rank at the next step boundary and save a checkpoint there (save) or not (stop); exit 128 + signal
    precision: str = "fp32"  # the dense model's forward and backward: fp32 | tf32 (CUDA's TF32 products) | bf16 | fp16 (autocast; fp32 master weights and optimizer; fp16 with a loss scaler); rows: embedding.dtype
    loss_scale: LossScaleConfig = field(default_factory=lambda: LossScaleConfig())
    cuda_graph: str = "off"  # on: the step replayed from one CUDA graph: at W = 1 the whole step, lookups padded to a capacity (trainer/train/whole_step.py), at W > 1 the dense forward + loss + backward (trainer/train/dense_step.py); on a CPU the same functions, eagerly | off
    unique_capacity: int = 0  # cuda_graph=on at W = 1: slots of the padded lookup plan; 0 = the bound (per table min(local batch x data.max_bag, its rows): never exceeded); smaller saves memory and work, and a batch with more unique ids stops the run naming this key
    pipeline: str = "ids"  # off (serial step) | ids (next step's input side + id exchange overlap this step: exact) | rows (also its rows: needs a cache and pull_bound >= 1)
    tensorboard: bool = True  # also write TensorBoard scalars to <output dir>/tensorboard (when there is an output dir)
    recipe: str = "auto"  # defaults for the null keys: auto (data=criteo: tiny below TINY_DATA_ROWS training rows, small below SMALL_DATA_ROWS, else large; other data: none) | tiny | small | large | none
    early_stop: EarlyStopConfig = field(default_factory=lambda: EarlyStopConfig())
    calibrate: Optional[bool] = None  # fit a logit temperature on the validation split for the final test evaluation (README "Validation"); null = the recipe's
    ensemble: Optional[int] = None  # train K models, model k validated (and early-stopped, calibrated) on its own validation slice, and test the mean of their predictions (trainer/evaluation/ensemble.py); 1 = one model; null = the recipe's (tiny: 5, else 1)
    bag: Optional[int] = None  # deprecated: the old name of train.ensemble, read into it with a warning (RENAMED); removed in the next release


@dataclass
class CheckpointConfig:
    """Periodic + final checkpoints (trainer/checkpoint/) and resume, also on another W."""

    enabled: bool = True  # false: write no checkpoint at all (benchmarks, throwaway runs); resume still works
    dir: Optional[str] = None  # where step_K directories go (shared by all ranks); null = <run output dir>/checkpoints
    every: int = 0  # also save every N steps (0 = only the final checkpoint)
    keep_last: int = 3  # complete checkpoints kept; older ones are deleted after a new one is complete (0 = keep all)
    resume: Optional[str] = None  # null = start fresh | auto = newest complete checkpoint in dir (none: fresh) | PATH of a step_K dir


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def _conf_dir() -> str:
    """The Hydra configs: trainer/conf/ in an installed package (the wheel ships the repository's
    conf/ there: pyproject.toml's package-dir), else conf/ beside the package (a source checkout
    and an editable install)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the trainer package
    installed = os.path.join(here, "conf")
    return installed if os.path.isfile(os.path.join(installed, "config.yaml")) else \
        os.path.join(os.path.dirname(here), "conf")


CONF_DIR = _conf_dir()


def compose(overrides: list[str]) -> DictConfig:
    """The composed Hydra config of `python -m trainer <overrides>` (same conf/ dir and defaults),
    not yet typed: trainer.plan.configure.compose_config gives the validated Config."""
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def parse(cfg: Any) -> Config:
    """A Hydra/OmegaConf tree (or a plain dict, or a Config) merged onto the schema, renamed keys
    moved to their new names (RENAMED); not yet resolved against the data files nor validated
    (trainer.plan.configure.load_config does both)."""
    if isinstance(cfg, Config):
        return _renamed(cfg)
    base = OmegaConf.structured(Config)
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    plain = {k: v for k, v in dict(plain).items() if k != "hydra"}
    try:
        merged = OmegaConf.merge(base, plain)
        return _renamed(OmegaConf.to_object(merged))
    except ConfigError:
        raise
    except Exception as exc:  # omegaconf errors already name full_key
        raise ConfigError(f"invalid config: {exc}") from exc


# keys renamed in this release: old name -> new name. The old name still works for one release (its
# value moves to the new key, with one warning line); giving both with different values is an error
RENAMED = {"train.bag": "train.ensemble"}


def _renamed(c: Config) -> Config:
    """Move the value of every old key name the config sets (RENAMED) to its new name and clear the
    old one, saying so on stderr once (by the launcher's rank 0 only: this runs before the
    collectives are up)."""
    for old, new in RENAMED.items():
        (old_parent, old_name), (new_parent, new_name) = old.rsplit(".", 1), new.rsplit(".", 1)
        value, now = get_key(c, old), get_key(c, new)
        if value is None:
            continue
        _check(now is None or now == value, f"{old}={value!r} and {new}", now,
               f"{old} is the old name of {new}: give only {new}")
        setattr(get_key(c, new_parent), new_name, value)
        setattr(get_key(c, old_parent), old_name, None)
        if _launcher_rank() == 0:
            print(f"[trainer] warning: {old} is deprecated, use {new} ({old}={value} -> {new}={value}); "
                  f"{old} will be removed in the next release", file=sys.stderr)
    return c


def _launcher_rank() -> int:
    """This process's rank as its launcher set it (torchrun: RANK, horovodrun: HOROVOD_RANK, mpirun:
    OMPI_COMM_WORLD_RANK / PMI_RANK); 0 when started alone."""
    for key in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(key, "").strip().isdigit():
            return int(os.environ[key])
    return 0


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


def epoch_steps(c: Config, train_rows: int, world: int) -> Optional[int]:
    """The train.steps that data.epochs asks for: ceil(epochs x training rows / global batch) at W =
    world (at least 1); None when data.epochs is 0 or the data is a synthetic stream (train.steps
    stands). Only a file dataset knows its training rows, and only a run knows W."""
    if c.data.epochs <= 0 or c.data.name not in FILE_DATASETS:
        return None
    return max(1, math.ceil(c.data.epochs * train_rows / (local_batch_size(c, world) * world)))


def get_key(c: Config, key: str) -> Any:
    obj = c
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def val_range(n: int, fraction: float, slice_: int = 1) -> tuple[int, int]:
    """[lo, hi) of the validation rows among n training rows: slice `slice_` (1 = the last) of
    val_rows(n, fraction) rows, counted from the end; (n, n) without a validation split."""
    k = val_rows(n, fraction)
    _check(slice_ * k <= n or not k, "data.val_slice", slice_,
           f"slice {slice_} of {k} validation rows counted from the end does not fit in {n} training rows "
           f"(at most {n // k} slices)" if k else "")
    return (n - slice_ * k, n - (slice_ - 1) * k) if k else (n, n)


def check_min_count(d: DataConfig) -> None:
    """data.min_count is resolved, >= 0, and a data=criteo option."""
    _check(d.min_count is not None, "data.min_count", d.min_count, _UNRESOLVED)
    _check(d.min_count >= 0, "data.min_count", d.min_count, "must be >= 0 (0 = every id keeps its own row)")
    _check(d.min_count == 0 or d.name == "criteo", "data.min_count", d.min_count,
           "a vocabulary of the training rows is a data=criteo option")


def val_rows(n: int, fraction: float) -> int:
    """Rows of n training rows that data.val_fraction carves off as the validation split: floor(f x n)
    (at least 1 when f > 0); a ConfigError when nothing would be left to train on. Rounded down so
    that 1 / f slices of it always fit in the n rows (train.ensemble's members validate on slices 1..5 of
    20%): rounded up, 5,001 rows would give slices of 1,001 rows and room for only four."""
    if not fraction:
        return 0
    k = max(1, math.floor(fraction * n + 1e-9))
    _check(k < n, "data.val_fraction", fraction, f"leaves no training rows of the {n} there are")
    return k


def _check(ok: bool, key: str, value: Any, reason: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {reason}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, value, f"must be one of {', '.join(allowed)}")


def _finite(key: str, value: float) -> None:
    _check(math.isfinite(value), key, value, "must be a finite number")


def validate(c: Config) -> None:
    """Range and consistency checks that do not depend on the world size."""
    _one_of("model.name", c.model.name, MODELS)
    _check(c.model.embedding_dim is not None, "model.embedding_dim", c.model.embedding_dim, _UNRESOLVED)
    _check(c.model.embedding_dim > 0, "model.embedding_dim", c.model.embedding_dim, "must be > 0")
    _one_of("model.pooling", c.model.pooling, POOLINGS)
    _check(c.model.top_mlp is not None, "model.top_mlp", c.model.top_mlp, _UNRESOLVED)
    for key, widths in (("model.bottom_mlp", c.model.bottom_mlp), ("model.top_mlp", c.model.top_mlp)):
        _check(all(w > 0 for w in widths), key, widths, "every layer width must be > 0")
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
    _check(d.eval_samples >= 0, "data.eval_samples", d.eval_samples, "must be >= 0")
    _check(d.eval_batch_size > 0, "data.eval_batch_size", d.eval_batch_size, "must be > 0")
    _one_of("data.loader", d.loader, LOADERS)
    _check(d.loader_threads > 0, "data.loader_threads", d.loader_threads, "must be > 0")
    _check(d.cycle_batches >= 0, "data.cycle_batches", d.cycle_batches, "must be >= 0 (0 = no repeat)")
    _check(d.name == "synthetic" or not d.cycle_batches, "data.cycle_batches", d.cycle_batches,
           "is a synthetic-data option")
    _check(0 < d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "must be in (0, 1)")
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
    _check(c.model.cross_layers >= 0, "model.cross_layers", c.model.cross_layers, "must be >= 0")
    _check(c.model.cross_rank >= 0, "model.cross_rank", c.model.cross_rank, "must be >= 0 (0 = full rank)")
    _check(c.model.dropout is not None, "model.dropout", c.model.dropout, _UNRESOLVED)
    _check(0 <= c.model.dropout < 1, "model.dropout", c.model.dropout, "must be in [0, 1)")
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
    _validate_schedule(c)
    _one_of("comm.backend", c.comm.backend, BACKENDS)
    _one_of("comm.dist_backend", c.comm.dist_backend, DIST_BACKENDS)
    _one_of("train.device", c.train.device, DEVICES)
    _validate_transport(c)
    _one_of("comm.wire_precision", c.comm.wire_precision, WIRE_PRECISIONS)
    _one_of("comm.settled_rows", c.comm.settled_rows, SETTLED_ROWS)
    _check(c.comm.timeout_s > 0, "comm.timeout_s", c.comm.timeout_s, "must be > 0")
    _finite("comm.timeout_s", c.comm.timeout_s)
    _check(c.embedding.init_scale is not None, "embedding.init_scale", None, _UNRESOLVED)
    _check(c.embedding.init_scale >= 0, "embedding.init_scale", c.embedding.init_scale,
           "must be >= 0 (0 = sqrt(1 / rows) per table)")
    _finite("embedding.init_scale", c.embedding.init_scale)
    _one_of("embedding.dtype", c.embedding.dtype, EMBEDDING_DTYPES)
    _one_of("embedding.rounding", c.embedding.rounding, ROUNDINGS)
    _validate_cache(c)
    _validate_dynamic(c)
    t = c.train
    _check(t.steps > 0, "train.steps", t.steps, "must be > 0")
    _check(t.log_every > 0, "train.log_every", t.log_every, "must be > 0")
    if t.eval_every is not None:  # null: the recipe's, resolved with W (configure.apply_data_steps)
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
    _check(t.unique_capacity >= 0, "train.unique_capacity", t.unique_capacity, "must be >= 0 (0 = the bound)")
    _one_of("train.on_signal", t.on_signal, ON_SIGNAL)
    _validate_early_stop(c)
    _validate_kernels(c)
    _validate_checkpoint(c)
    _validate_placement(c)


def _validate_precision(c: Config) -> None:
    """Mixed precision of the dense model (trainer/train/precision.py)."""
    t, s = c.train, c.train.loss_scale
    _one_of("train.precision", t.precision, PRECISIONS)
    _check(s.init > 0, "train.loss_scale.init", s.init, "must be > 0")
    _finite("train.loss_scale.init", s.init)
    _check(s.growth_factor >= 1, "train.loss_scale.growth_factor", s.growth_factor, "must be >= 1")
    _finite("train.loss_scale.growth_factor", s.growth_factor)
    _check(0 < s.backoff_factor < 1, "train.loss_scale.backoff_factor", s.backoff_factor, "must be in (0, 1)")
    _check(s.growth_interval > 0, "train.loss_scale.growth_interval", s.growth_interval, "must be > 0")
    _one_of("train.cuda_graph", t.cuda_graph, ("off", "on"))
    _check(not (t.cuda_graph == "on" and t.precision == "fp16"), "train.cuda_graph", t.cuda_graph,
           "is not available with train.precision=fp16 (its loss scale changes between steps): use bf16")
    if t.precision == "fp16":  # the scaler skips a step whose gradients overflow: it must be undoable
        _check(t.pipeline != "rows", "train.precision", t.precision,
               "fp16's loss scaler skips a step whose gradients overflow, which train.pipeline=rows "
               "cannot undo (its next step was read before): use train.pipeline=ids or off, or bf16")


_UNRESOLVED = "null (the recipe's) was not resolved: load the config with trainer.plan.configure.load_config"


def _validate_schedule(c: Config) -> None:
    """Regularisation and the learning-rate schedule (trainer/train/lr.py)."""
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
    """Early stopping looks at the validation split only, never at the test split."""
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


def needs_global_view(c: Config) -> bool:
    """Placement or a schedule other than random: every rank reads every global batch's ids."""
    return c.placement.name != "none" or c.schedule.name != "random"


def _validate_placement(c: Config) -> None:
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
    if needs_global_view(c):
        what = f"placement={p.name}" if p.name != "none" else f"schedule={s.name}"
        _check(c.data.name in GLOBAL_VIEW_DATASETS, "data.name", c.data.name,
               f"{what} needs random access to every sample of a global batch (data="
               f"{' or '.join(GLOBAL_VIEW_DATASETS)}); data=criteo streams per-rank blocks")
    if s.name == "herald":
        _check(c.consistency.pull_bound == 0 and c.consistency.push_bound == 0 and not c.consistency.tables,
               "consistency", c.consistency.name, "schedule=herald is exact (BSP): use consistency=bsp")
        _check(c.cache.policy in ("none", "lru"), "cache.policy", c.cache.policy,
               "schedule=herald holds lent rows in an LRU cache: use cache=lru (or cache=none)")


def _validate_dynamic(c: Config) -> None:
    """embedding.tables=dynamic and what it does not support yet (docs/dynamic.md#what-it-refuses):
    each refusal is one line, before anything starts."""
    e = c.embedding
    _one_of("embedding.tables", e.tables, TABLE_KINDS)
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
    _check(not e.capacity_bytes or e.tables == "dynamic", "embedding.capacity_bytes", e.capacity_bytes,
           "is the pool's budget of dynamic tables: needs embedding.tables=dynamic")
    _check(c.data.drift >= 0 and math.isfinite(c.data.drift), "data.drift", c.data.drift, "must be a finite number >= 0")
    _check(c.data.drift_eval_at >= 0, "data.drift_eval_at", c.data.drift_eval_at, "must be >= 0")
    _check(c.data.hash_rows >= 0, "data.hash_rows", c.data.hash_rows, "must be >= 0 (0 = off)")
    if c.data.hash_rows:
        _check(c.data.name == "synthetic", "data.hash_rows", c.data.hash_rows,
               "is a synthetic-data option (Criteo: prepare_criteo.py --hash-rows)")
        _check(e.tables == "fixed", "data.hash_rows", c.data.hash_rows, "hashes ids into fixed tables: needs embedding.tables=fixed")
    if e.tables != "dynamic":
        if c.data.hash_rows:  # ids hashed into the tables' rows: any id is fine
            return
        _check(not c.data.scramble_ids, "data.scramble_ids", True, "needs embedding.tables=dynamic or data.hash_rows")
        _check(not c.data.drift, "data.drift", c.data.drift,
               "drifting ids are unbounded: needs embedding.tables=dynamic or data.hash_rows")
        return
    _check(c.data.name == "synthetic" or not c.data.drift, "data.drift", c.data.drift, "is a synthetic-data option")
    _check(e.capacity > 0 or e.capacity_bytes > 0, "embedding.capacity", e.capacity,
           "embedding.tables=dynamic needs a pool of > 0 rows per table (or embedding.capacity_bytes)")
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
        _check(ok, key, value, f"embedding.tables=dynamic does not support {why} yet (docs/dynamic.md)")


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
    _check(e.tables == "dynamic", "embedding.admit_counter", e.admit_counter,
           "counts dynamic tables' ids before admission: needs embedding.tables=dynamic")
    _check(e.admit_after > 1, "embedding.admit_counter", e.admit_counter,
           "counts ids before admission: needs embedding.admit_after > 1 (1 admits at once)")
    _check(e.admit_after < 1 << 15, "embedding.admit_after", e.admit_after,
           "must be < 32768 with embedding.admit_counter=count_min (int16 counters)")
    _check(e.count_min_bytes >= 2 * e.count_min_depth, "embedding.count_min_bytes", e.count_min_bytes,
           f"too small for {e.count_min_depth} rows of int16 counters (embedding.count_min_depth)")


def _validate_checkpoint(c: Config) -> None:
    k = c.checkpoint
    _check(k.every >= 0, "checkpoint.every", k.every, "must be >= 0 (0 = only the final checkpoint)")
    _check(k.keep_last >= 0, "checkpoint.keep_last", k.keep_last, "must be >= 0 (0 = keep all)")
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


def resolve_device(device: str) -> str:
    """"cuda" or "cpu": the run's device for a train.device value. The one rule (auto: cuda when a
    CUDA device is visible, else cpu); everything that asks "does this run use the GPU" asks it
    here: the trainer's torch.device (build.device_of), the collectives' transport
    (dist_transport, Horovod's on-GPU path), the DALI pipeline's GPU, the kernels' backend and
    the memory plan checked before start-up."""
    return "cuda" if device == "cuda" or (device == "auto" and _cuda_available()) else "cpu"


def run_device(c: Config) -> str:
    """"cuda" or "cpu": the device of the run c describes (resolve_device(c.train.device))."""
    return resolve_device(c.train.device)


def dist_transport(dist_backend: str, device: str, gpus_shared: bool = False) -> str:
    """comm.dist_backend resolved for a run on `device` ("cuda" or "cpu", resolve_device): gloo or
    nccl as named; auto is nccl exactly when the run's device is cuda and every rank of this host
    has a GPU of its own, else gloo. gpus_shared: ranks of this host would share a GPU (more
    ranks than GPUs, or no local rank to pick one by), which NCCL refuses ("Duplicate GPU
    detected"); gloo then carries the collectives through host memory."""
    if dist_backend != "auto":
        return dist_backend
    return "nccl" if device == "cuda" and not gpus_shared else "gloo"


def _validate_transport(c: Config) -> None:
    """comm.dist_backend=nccl needs the run on CUDA: NCCL moves CUDA tensors only."""
    if c.comm.dist_backend != "nccl":
        return
    _check(c.train.device != "cpu", "comm.dist_backend", c.comm.dist_backend,
           "NCCL moves CUDA tensors only, and train.device=cpu trains on the CPU: use "
           "comm.dist_backend=gloo (or auto), or train.device=cuda")
    _check(_cuda_available(), "comm.dist_backend", c.comm.dist_backend,
           "needs a CUDA device, and none is visible here: use comm.dist_backend=gloo (or auto)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _table_key(group: str, key: str, num_tables: int) -> int:
    _check(key.isdigit() and int(key) < num_tables, f"{group}.tables.{key}", key,
           f"table keys are table indices 0..{num_tables - 1}")
    return int(key)


def _validate_cache(c: Config) -> None:
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
    s = c.consistency
    _one_of("consistency.name", s.name, CONSISTENCY_PRESETS)
    for key, v in (("consistency.pull_bound", s.pull_bound), ("consistency.push_bound", s.push_bound)):
        _check(v >= -1, key, v, "must be >= 0, or -1 for unbounded")
    for key, t in s.tables.items():
        _table_key("consistency", key, n)
        for name, v in (("pull_bound", t.pull_bound), ("push_bound", t.push_bound)):
            if v is not None:
                _check(v >= -1, f"consistency.tables.{key}.{name}", v, "must be >= 0, or -1 for unbounded")


def cache_capacities(c: Config) -> list[int]:
    """Rows each worker may cache per table (0 everywhere when cache.policy is none)."""
    rows = table_rows(c)
    if c.cache.policy == "none":
        return [0] * len(rows)
    out = []
    for t, n in enumerate(rows):
        o = c.cache.tables.get(str(t), TableCacheConfig())
        cap_rows = o.capacity_rows if o.capacity_rows is not None else (
            None if o.capacity_fraction is not None else c.cache.capacity_rows)
        frac = o.capacity_fraction if o.capacity_fraction is not None else c.cache.capacity_fraction
        out.append(min(n, cap_rows) if cap_rows is not None else int(frac * n))
    return out


def staleness_bounds(c: Config) -> tuple[list[int], list[int]]:
    """(pull_bound, push_bound) per table, overrides applied; -1 = unbounded."""
    n = len(c.data.table_rows)
    pull, push = [c.consistency.pull_bound] * n, [c.consistency.push_bound] * n
    for key, t in c.consistency.tables.items():
        i = int(key)
        pull[i] = t.pull_bound if t.pull_bound is not None else pull[i]
        push[i] = t.push_bound if t.push_bound is not None else push[i]
    return pull, push


def table_rows(c: Config) -> list[int]:
    """Rows per table of the model: after the cap, or data.hash_rows each (ids hashed into them)."""
    if c.data.hash_rows > 0:
        return [c.data.hash_rows] * len(c.data.table_rows)
    return source_rows(c)


def source_rows(c: Config) -> list[int]:
    """Rows per table the data draws its ids from, after the cap (before data.hash_rows)."""
    cap = c.data.max_table_rows
    return [min(n, cap) if cap > 0 else n for n in c.data.table_rows]


def local_batch_size(c: Config, world: int) -> int:
    """Samples per rank per step, from batch_size or global_batch_size."""
    g = c.data.global_batch_size
    if g is None:
        return c.data.batch_size
    _check(g % world == 0, "data.global_batch_size", g, f"must be divisible by the world size {world}")
    return g // world


def validate_world(c: Config, world: int) -> None:
    """Checks that need the world size (known only once the collectives are up)."""
    local_batch_size(c, world)
    for i, n in enumerate(table_rows(c)):
        _check(n >= world, f"data.table_rows[{i}]", n,
               f"has fewer rows than the {world} workers; every worker must own at least one row")
    if c.train.cuda_graph == "on" and world == 1:
        _validate_whole_step(c)


def _validate_whole_step(c: Config) -> None:
    """train.cuda_graph=on at W = 1 runs the whole step with a padded plan (trainer/train/whole_step.py):
    what it cannot pad yet is refused, naming the key."""
    e, why = c.embedding, "train.cuda_graph=on at W = 1 runs the whole step padded, which "
    for key, value, ok, what in (
            ("embedding.tables", e.tables, e.tables == "fixed", "supports fixed tables only"),
            ("cache.policy", c.cache.policy, c.cache.policy == "none", "supports no cache"),
            ("consistency.name", c.consistency.name, c.consistency.name == "bsp", "supports bsp only"),
            ("placement.name", c.placement.name, c.placement.name == "none", "supports no placement"),
            ("schedule.name", c.schedule.name, c.schedule.name == "random", "supports schedule=random only"),
            ("embedding.rounding", e.rounding, e.dtype == "fp32" or e.rounding == "nearest",
             f"supports half rows (embedding.dtype={e.dtype}) rounded to nearest only (the stochastic key changes every step)"),
            ("embedding.audit", e.audit, not e.audit, "does not record the audit")):
        _check(ok, key, value, why + what + "; use train.cuda_graph=off")


def auto_threads(c: Config) -> int:
    """torch threads per rank: the configured value, or cores / local ranks."""
    if c.train.threads > 0:
        return c.train.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("HOROVOD_LOCAL_SIZE", "1")))
    return max(1, (os.cpu_count() or 1) // max(local, 1))
