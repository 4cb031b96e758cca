"""The config schema: one dataclass per Hydra group (or block of conf/config.yaml), and the one
place every key is documented: the comment on its field's line. docs/config.md's key reference is
generated from these comments and defaults (python -m trainer.base.config.doc); the defaults are the
values `python -m trainer` composes from conf/ (tests/docs/test_config_docs.py checks all three agree).

The tuples name each key's allowed values (validate.py checks them). A key whose value a recipe
fills (null = "the recipe's") says so; the recipes' values are in trainer/run/resolve/recipes.py
(docs/recipe.md), not here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MODELS = ("dlrm", "wdl", "deepfm", "dcn")  # model.name (the one list: docs/recipe.md's columns too)
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
OUT_OF_RANGE = ("error", "hash")  # data.out_of_range (trainer/workload/data/ids.py)
NONFINITE = ("stop", "skip")  # train.nonfinite
ON_SIGNAL = ("save", "stop")  # train.on_signal (trainer/run/signals.py)
CONSISTENCY_PRESETS = ("bsp", "ssp", "asp")  # consistency.name (conf/consistency/*.yaml)
LR_DECAYS = ("none", "poly")  # optim.decay (trainer/step/lr.py)
RECIPES = ("auto", "tiny", "small", "large", "none")  # train.recipe (trainer/run/resolve/recipes.py)


WIRE_PRECISIONS = ("fp32", "fp16", "bf16")
TABLE_KINDS = ("fixed", "dynamic")  # embedding.kind
ADMIT_COUNTERS = ("exact", "count_min")  # embedding.admit_counter (trainer/sparse/embedding/dynamic/admission.py)
EVICTIONS = ("lru", "lfu")  # embedding.eviction
EMBEDDING_DTYPES = ("fp32", "fp16", "bf16")  # embedding.dtype (= embedding/store.ROW_DTYPES)
ROUNDINGS = ("stochastic", "nearest")  # embedding.rounding (= embedding/optim.ROUNDINGS)
SETTLED_ROWS = ("auto", "always", "never")
DEVICES = ("auto", "cpu", "cuda")  # train.device (resolve_device)
DIST_BACKENDS = ("auto", "gloo", "nccl")  # comm.dist_backend (dist_transport)
PIPELINES = ("off", "ids", "rows")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # train.precision (trainer/step/precision.py)


@dataclass
class ModelConfig:
    """The dense model: architecture, row width, MLP widths, pooling (conf/model/)."""

    name: str = "dlrm"  # architecture: dlrm | wdl | deepfm | dcn
    embedding_dim: Optional[int] = 16  # d, the width of every embedding row; null = the recipe's
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32])  # hidden widths of the dense features' MLP (a d-wide layer is appended)
    top_mlp: Optional[list[int]] = None  # hidden widths of the top MLP (a 1-wide logit layer is appended); null = the recipe's
    pooling: str = "sum"  # pooling of a multi-hot bag's rows: sum | mean
    cross_layers: int = 3  # dcn: number of cross layers x_{l+1} = x0 * (W x_l + b) + x_l
    cross_rank: int = 0  # dcn: rank r of each cross layer's W: 0 = full rank (DCN-v2's W), r > 0 = low rank U V^T
    dropout: Optional[float] = None  # dropout rate after every hidden layer of the MLPs (training only); null = the recipe's


@dataclass
class DataConfig:
    """The data: a synthetic Zipf stream or a file dataset (criteo, movielens), batch sizes, and its
    splits: training, test (data.test_*: the final evaluation) and validation (data.val_*:
    train.eval_every's evaluations, early stopping) (conf/data/)."""

    name: str = "synthetic"  # dataset kind: synthetic | criteo | movielens
    preset: str = "tiny"  # informational name of the preset (the conf/data/ file), reported in summary.json
    num_dense: int = 4  # number of dense (continuous) features (file datasets: must equal their files' count)
    table_rows: list[int] = field(default_factory=lambda: [97, 1001, 13, 250])  # rows per embedding table (cardinalities), before max_table_rows; file datasets: [] (read from the files)
    max_table_rows: int = 0  # cap on every table's rows (synthetic: ids are drawn below it; file datasets: ids folded, id mod rows); 0 = no cap
    min_bag: int = 1  # fewest ids in one sample's bag of a table (0 allows empty bags)
    max_bag: int = 3  # most ids in one bag of a table (> 1 = multi-hot)
    zipf_alpha: float = 1.05  # synthetic: skew of id popularity, p(rank k) ~ 1 / (k + 1) ** alpha
    signal: float = 2.5  # synthetic: strength of the planted label signal (0 = labels are coin flips)
    batch_size: int = 64  # training samples per rank per step (ignored when global_batch_size is set)
    global_batch_size: Optional[int] = None  # if set: training samples per step over all ranks (must divide by W)
    train_samples: int = 0  # synthetic: size of the training set (epochs wrap), 0 = a fresh stream every step; criteo/movielens: > 0 keeps only the first rows of the training split
    test_samples: int = 4096  # the TEST split (not validation): synthetic: its size; criteo/movielens: > 0 keeps only its first rows (0 = all)
    eval_batch_size: int = 512  # samples per rank per evaluation step (test and validation alike)
    seed: int = 1234  # data seed (ids, labels, planted weights, shuffles)
    dir: Optional[str] = None  # criteo: the directory written by scripts/prepare_criteo.py --out DIR; movielens: a folder with ml-100k.inter/.user/.item (null = the installed recbole's)
    loader: str = "dali"  # criteo reader: dali | memmap (the reference)
    loader_threads: int = 1  # threads per rank: DALI pipeline threads (criteo); synthetic: threads that make a batch in row chunks of >= 4,096 samples (the same values at any count)
    test_fraction: float = 0.1  # the TEST split's share of the rows: criteo: the last rows of the training files when no test split was prepared; movielens: a seeded random share of the ratings
    shuffle: bool = True  # criteo/movielens: seeded shuffle of the training rows (criteo: block order + rows in a block)
    epochs: Optional[float] = 0.0  # criteo/movielens: > 0 sets train.steps = ceil(epochs x training rows / global batch); 0 = train.steps stands; null = the recipe's
    standardize: Optional[bool] = None  # criteo: dense features -> (x - mean) / std of the training rows (the first 1M); null = the recipe's
    val_fraction: Optional[float] = None  # the validation split: this share of the training rows, carved from their end (never from the test split; synthetic: needs train_samples > 0); 0 = none; null = the recipe's
    min_count: Optional[int] = None  # criteo: ids seen fewer times in the training rows share one out-of-vocabulary row per table, and the tables shrink to the ids kept (trainer/workload/data/vocab.py); 0 = off; null = the recipe's
    val_slice: int = 1  # criteo: which slice of val_fraction of the training rows, counted from the end, is the validation split (1 = the last; dev/recipe_study/val_rotations.py tries others)
    out_of_range: str = "error"  # an id < 0 or >= its table's rows: error (stop, naming table, id and rows) | hash (id mod rows)
    drift: float = 0.0  # synthetic, embedding.kind=dynamic: ids drift by floor(drift x stream position): new ids keep arriving, popularity moves (0 = no drift)
    drift_eval_at: int = 0  # with drift: evaluation samples are drawn as at this training sample position (the run's last sample: evaluate "now")
    cycle_batches: int = 0  # synthetic: K > 0: the training stream repeats its first K global batches, each made once (benchmarks: the data generator out of the step)
    scramble_ids: bool = False  # synthetic, embedding.kind=dynamic: present table t's id i as a random-looking id in [0, 2^56) (a bijection per table, as raw hashes are)
    hash_rows: int = 0  # synthetic, embedding.kind=fixed: N > 0 hashes every (scrambled, drifting) id into N rows per table (splitmix64 mod N; collisions share a row): dynamic tables' same-memory baseline, as prepare_criteo --hash-rows; 0 = off


@dataclass
class OptimConfig:
    """Optimizers of the dense parameters and (owner-side) of the embedding rows, and the learning
    rate's schedule; optim=auto (the default) leaves the choice to the recipe (conf/optim/)."""

    name: Optional[str] = None  # preset name (informational): sgd | adagrad | adam; null = the recipe's
    dense: Optional[str] = None  # optimizer of the dense parameters: sgd | adagrad | adam; null = the recipe's
    sparse: Optional[str] = None  # owner-side optimizer of the embedding rows: sgd | adagrad | rowwise_adagrad; null = the recipe's
    lr: Optional[float] = None  # learning rate of the dense parameters (and of the rows unless sparse_lr is set); null = the recipe's
    sparse_lr: Optional[float] = None  # learning rate of the embedding rows; null = lr (under optim=auto: the recipe's)
    eps: Optional[float] = None  # Adagrad/Adam epsilon (torch's placement: lr * g / (sqrt(state) + eps)); null = the recipe's
    momentum: float = 0.0  # SGD momentum of the dense parameters
    initial_accumulator: float = 0.1  # Adagrad state start (TensorFlow's 0.1; 0 = torch's, ill-conditioned: docs/design.md section 10)
    weight_decay: Optional[float] = None  # L2 of the dense parameters (torch.optim's weight_decay: g += wd * w); null = the recipe's
    sparse_weight_decay: Optional[float] = None  # L2 of the embedding rows, applied by the owner once per touched row per step (g += wd * w); null = the recipe's
    warmup_steps: Optional[int] = None  # the lr (dense and rows) ramps linearly to its value over these steps (factor (k + 1) / (warmup + 1) at step k); null = the recipe's
    decay: Optional[str] = None  # lr decay after the warmup: none | poly (MLPerf DLRM's: (1 - k / decay_steps) ** decay_power); null = the recipe's
    decay_start: int = -1  # first step of the decay; -1 = right after the warmup
    decay_steps: int = 0  # length of the decay in steps (the lr reaches 0 at its end, then stays there); 0 = until train.steps
    decay_power: float = 2.0  # exponent of the polynomial decay (2 = MLPerf DLRM's)


@dataclass
class CommConfig:
    """The collectives: which backend, its transport, timeout and wire precision (conf/comm/)."""

    backend: str = "auto"  # auto (horovod under horovodrun, torch under torchrun, else local) | local | torch | horovod
    dist_backend: str = "auto"  # the torch backend's transport: auto (nccl when the run's device is cuda and each rank of the host has a GPU, else gloo: dist_transport) | gloo | nccl (cuda only); horovod ignores it (NCCL on cuda when built with it, else Gloo or MPI)
    timeout_s: float = 60.0  # a collective waiting longer than this raises, naming the operation
    wire_precision: str = "fp32"  # rows and row gradients on the wire: fp32 | fp16 | bf16 (owners keep their rows in embedding.dtype and update them in fp32)
    settled_rows: str = "auto"  # train.pipeline=ids without a cache: send the next step's rows that this step does not update early: auto (when the ranks span hosts) | always | never


@dataclass
class EmbeddingConfig:
    """The embedding rows: their kind (fixed or dynamic tables), storage type, rounding and init
    (a block of conf/config.yaml)."""

    init_scale: Optional[float] = None  # rows ~ U(-s, s); 0 = sqrt(1 / rows) per table (DLRM); null = the recipe's
    audit: bool = False  # record every read's version and every computed row gradient (invariant tests; slow)
    dtype: str = "fp32"  # how owners store rows: fp32 | fp16 | bf16 (half the row bytes; optimizer state stays fp32, updates computed in fp32)
    rounding: str = "stochastic"  # how an updated fp16 / bf16 row is written back: stochastic (unbiased, seeded by train.seed, step, row) | nearest
    kind: str = "fixed"  # every table's kind (one value for all): fixed (rows 0..table_rows-1, owner id mod W) | dynamic (any id in [0, 2^56): hashed owner, id -> row map, admission, eviction; docs/dynamic.md)
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
    store: str = "memory"  # where each owner keeps its shard (rows, optimizer state, versions): memory | disk (a file under store_dir, with a row cache in RAM of store_cache_bytes: tables larger than memory; docs/store.md)
    store_dir: Optional[str] = None  # disk: a local directory for the shard files (one folder per rank and run, removed at exit); null = the system's temp dir
    store_cache_bytes: int = 0  # disk: the RAM of each owner's row cache (an eighth of it for the file's pages; the rest of the rows stays on disk, read a step ahead); 0 = a quarter of the memory it may have


@dataclass
class TableCacheConfig:
    """Per-table override of the cache capacity (either field; null = inherit)."""

    capacity_rows: Optional[int] = None  # rows of this table a worker may cache
    capacity_fraction: Optional[float] = None  # ... or this fraction of the table's rows


@dataclass
class CacheConfig:
    """HET's per-worker cache of remote rows (docs/design.md, section 5; conf/cache/)."""

    policy: str = "none"  # none | lru | lfu (fewest uses, ties least recent) | lfu_pinned (lfu, and an entry used pin_threshold times is never evicted: HET's LFUOpt)
    capacity_fraction: float = 0.0  # cached rows per table, as a fraction of the table's rows
    capacity_rows: Optional[int] = None  # cached rows per table (overrides capacity_fraction)
    pin_threshold: int = 8  # lfu_pinned: an entry used at least this often is never evicted
    tables: dict[str, TableCacheConfig] = field(default_factory=dict)  # per-table overrides of the capacity, keyed by table index: +cache.tables.<t>.capacity_rows=N (not a kind of table: that is embedding.kind)


@dataclass
class TableBoundsConfig:
    """Per-table override of the staleness bounds (null = inherit)."""

    pull_bound: Optional[int] = None  # this table's consistency.pull_bound
    push_bound: Optional[int] = None  # this table's consistency.push_bound


@dataclass
class ConsistencyConfig:
    """HET bounded staleness: bounds of 0 are exact synchronous training (BSP); -1 = unbounded (conf/consistency/)."""

    name: str = "bsp"  # preset chosen (bsp | ssp | asp); summary.json reports the label of the bounds in force
    pull_bound: int = 0  # a cached row is re-read when its owner is more than this many updates ahead
    push_bound: int = 0  # local updates are pushed once a row holds more than this many
    tables: dict[str, TableBoundsConfig] = field(default_factory=dict)  # per-table overrides of the bounds, keyed by table index: +consistency.tables.<t>.pull_bound=N


@dataclass
class KernelsConfig:
    """Which implementation runs the sparse hot path (pooled gather, scatter + optimizer, id map)."""

    backend: str = "auto"  # auto (Triton on CUDA tensors, torch reference otherwise) | triton (on CPU: needs TRITON_INTERPRET=1) | reference; $TRAINER_KERNELS overrides


@dataclass
class PlacementConfig:
    """Which rows are replicated on every worker (hot) instead of sharded (trainer/sparse/placement/; conf/placement/)."""

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
    """Which worker trains which sample of a global batch, and when updated rows are synchronised (conf/schedule/)."""

    name: str = "random"  # random (equal contiguous slices of the shuffled global batch) | herald
    on_demand_sync: bool = True  # herald: push a row's update only when another worker reads it next step (or at a flush)
    cache_aware: bool = True  # herald: a sample also scores for the rows a worker holds (on-demand sync's lent rows)
    passes: int = 2  # herald: co-location passes after the owner/holder pass (each ~N ids x W lookups)


@dataclass
class EarlyStopConfig:
    """Early stopping on validation AUC (needs data.val_fraction > 0 and train.eval_every > 0)."""

    patience: Optional[int] = None  # stop after this many validation evaluations without a new best; 0 = never stop early; null = the recipe's (counted in epochs when train.eval_every is the recipe's too)
    min_delta: float = 0.0  # a new best must beat the old one's validation AUC by more than this
    min_evals: Optional[int] = None  # never stop before this many validation evaluations (a model still at its start can score below its first evaluation for a few epochs); null = the recipe's (counted as patience is)
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
    """The run: steps, seeds, evaluation cadence, device, precision, the step's pipeline, the
    recipe, early stopping and ensembles (conf/train/)."""

    steps: Optional[int] = None  # training steps (each consumes one global batch); null = the recipe's: data.epochs' steps once W is known (file datasets with data.epochs > 0), else 300. Given while data.epochs is left to the recipe, it wins (data.epochs=0: the recipe's epochs not applied); given beside data.epochs > 0, data.epochs decides (the recipe's line shows the steps it derived)
    seed: int = 0  # seed of the dense and embedding init (and of stochastic rounding)
    log_every: int = 10  # write a metrics.jsonl line every N steps
    eval_every: Optional[int] = None  # evaluate every N steps too, on the validation split (data.val_fraction) when there is one, else on the test split (data.test_*); the test split is always evaluated after the last step; 0 = only then; null = the recipe's (resolved once W is known)
    threads: int = 0  # torch threads per rank; 0 = the CPUs this rank may use (its affinity, a Slurm step's share of the node, SLURM_CPUS_PER_TASK) / local ranks
    progress: str = "auto"  # progress bar on rank 0: auto (when interactive) | on | off
    device: str = "auto"  # auto (cuda when a GPU is visible, else cpu: run_device) | cpu | cuda; comm.dist_backend=auto follows it (nccl on cuda, else gloo)
    nonfinite: str = "stop"  # NaN/inf global loss: stop (error naming the step) | skip (drop the batch on every rank, no update anywhere; dynamic tables: the step's admissions, evictions and counts undone too)
    max_skips: int = 10  # nonfinite=skip: stop with an error after this many consecutive skipped steps
    memory_check: bool = True  # stop at start-up (exit 2) when a rank's memory plan (trainer/run/resolve/memplan.py, docs/operations.md) exceeds the memory it can have; false: warn and start
    on_signal: str = "save"  # SIGTERM / SIGINT / SIGUSR1: stop every rank at the next step boundary and save a checkpoint there (save) or not (stop); exit status 128 + the signal
    precision: str = "fp32"  # the dense model's forward and backward: fp32 | tf32 (CUDA's TF32 products) | bf16 | fp16 (autocast; fp32 master weights and optimizer; fp16 with a loss scaler); rows: embedding.dtype
    loss_scale: LossScaleConfig = field(default_factory=lambda: LossScaleConfig())  # precision=fp16's loss scaler
    cuda_graph: str = "off"  # on: every tensor of the step at a shape fixed by the config, so a GPU can replay it: at W = 1 the whole step from one CUDA graph, lookups padded to a capacity (trainer/step/whole_step.py), at W > 1 the alltoalls padded to fixed blocks per owner, the dense half from a graph (trainer/step/padded_step.py); where the sparse side has no fixed-shape mode yet (dynamic tables, the audit at W = 1) the dense half only, as dense (said once; summary.json cuda_graph.dense_only); dense: the dense forward + loss + backward only, from one graph, the sparse half eager (trainer/step/dense_step.py); with both, the dense optimizer's step from a graph of its own (trainer/step/dense_update.py); on a CPU the same functions, eagerly | off
    unique_capacity: int = -1  # cuda_graph=on: slots of the padded lookup plan (W = 1), of the block a rank asks each owner for (W > 1); -1 = measured (the bound for the first 16 steps, then the most slots they needed on any rank + 10%); 0 = the bound (per table min(local batch x data.max_bag, the rows one owner holds): never exceeded); smaller saves memory, work and (W > 1) wire; a step whose batch needs more changes nothing and is trained again in exact sizes (summary.json cuda_graph.overflow_steps): any value is exact
    capacity_margin: float = 1.1  # cuda_graph=on, measured blocks: their slots = the most the measuring window needed on any rank x this (the request's once, after the first 16 steps; the HET cache's reply and push blocks every 16 steps, and after a step that overflowed): larger = more wire, fewer steps trained again
    pipeline: str = "ids"  # off (serial step) | ids (the next step's input side + id exchange overlap this step: exact) | rows (also its rows: needs a cache and pull_bound >= 1)
    tensorboard: bool = True  # also write TensorBoard scalars beside metrics.jsonl, to <output dir>/tensorboard (when there is an output dir)
    recipe: str = "auto"  # fills the keys left null: auto (data=criteo: tiny, small or large by its training rows; other data: none) | tiny | small | large | none (docs/recipe.md)
    early_stop: EarlyStopConfig = field(default_factory=lambda: EarlyStopConfig())  # early stopping on validation AUC
    calibrate: Optional[bool] = None  # fit a logit temperature on the validation split for the final test evaluation (AUC unchanged; docs/recipe.md); null = the recipe's
    ensemble: Optional[int] = None  # train K models, model k validated (and early-stopped, calibrated) on its own validation slice, and test the mean of their predictions (trainer/run/evaluation/ensemble.py); 1 = one model; null = the recipe's


@dataclass
class CheckpointConfig:
    """Periodic + final checkpoints (trainer/run/checkpoint/) and resume, also on another W (a block of
    conf/config.yaml)."""

    enabled: bool = True  # false: write no checkpoint at all (benchmarks, throwaway runs); resume still works
    dir: Optional[str] = None  # where step_K directories go (visible to every rank); null = <run output dir>/checkpoints
    every: int = 0  # also save every N steps (0 = only the final checkpoint)
    keep_last: int = 3  # complete checkpoints kept; older ones are deleted after a new one is complete (0 = keep all)
    resume: Optional[str] = None  # null = start fresh | auto = newest complete checkpoint in dir (none: fresh) | PATH of a step_K dir
    space_check: bool = True  # stop at start-up (exit 2) when checkpoint.dir's free space cannot hold one more checkpoint (each rank's shard, rank 0's dense model and optimizer; the ranks of a host share its disk); false: start anyway (a save that fails keeps the model elsewhere)
    lock_lease_s: float = 60.0  # the dir's lock is a lease: the run refreshes it every lease / 4 s; a lock from another host or container is watched (said once): refused when its holder refreshes it, taken over (one warning) once not refreshed for this long, so a restarted pod or container gets in on its first try


@dataclass
class Config:
    """The whole config: one block per Hydra group (conf/<group>/) or block of conf/config.yaml."""

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

    # Not a key (unannotated: a class attribute, no dataclass field, so asdict, OmegaConf, == and
    # docs/config.md ignore it): what loading found beside the keys, the file dataset's shape and
    # the recipe in force (trainer.run.resolve.recipes.Resolved), set once by
    # trainer.run.resolve.configure.load_config; None on a config not loaded.
    resolved = None
