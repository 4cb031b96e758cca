"""Typed config schemas (one dataclass per Hydra group) and validation with clear messages.

Why: Hydra composes YAML; this package turns the composed tree into typed dataclasses (OmegaConf
rejects unknown keys and wrong types, naming the full key) and then checks ranges and cross-field
rules, so a bad sweep value fails at start-up with `key=value: reason`, not deep inside a step.

Where things are (a newcomer adding a key touches schema.py, the default option's YAML and, by
regenerating it, docs/config.md):
- schema.py: the dataclasses; each key's one doc (its field's comment) and its default (= the value
  `python -m trainer` composes from conf/); the tuples of allowed values.
- load.py: conf/'s directory, Hydra's composition (compose), the tree parsed onto the schema (parse),
  old key names moved to their new ones (RENAMED).
- validate.py: every check, one function per config block (_validate_<block>) run in order by
  validate (BLOCK_CHECKS); validate_world; the data-source checks.
- derive.py: values computed from a config (the run's device and transport, rows per table, cache
  capacities, staleness bounds, batch sizes, the validation split, threads).
- errors.py: ConfigError and the helpers that raise it naming the key.
- doc.py: docs/config.md's key reference, generated from schema.py and conf/ (python -m trainer.base.config.doc).
This module re-exports their public names: import from trainer.base.config.

A leaf: it imports nothing else of trainer/ (the `kernels` package is outside it), so any module may
use the schemas. It stays the schema (keys, defaults, checks), not the resolution: the one function
that returns the resolved config is trainer/run/resolve/configure.py's load_config, since a file
dataset's shape (dense features, table rows, training rows) can only be read by trainer.workload.data;
it reads that shape and chooses the recipe once, carries both on the config (Config.resolved, not a
key) and applies them with the pure helpers here (check_data_source, apply_data_shape, epoch_steps).
The values a null key takes (the recipes: tuning policy, measured on data) are not here but in
trainer/run/resolve/recipes.py (one table); this package only names the recipes (RECIPES) and
refuses a key left unresolved.
"""
from __future__ import annotations

from .errors import (  # noqa: F401
    ConfigError,
)
from .schema import (  # noqa: F401
    MODELS, DATASETS, FILE_DATASETS, LOADERS, DENSE_OPTIMS, SPARSE_OPTIMS, POOLINGS, BACKENDS,
    CACHE_POLICIES, KERNEL_BACKENDS, PLACEMENTS, SCHEDULES, OUT_OF_RANGE,
    NONFINITE, ON_SIGNAL, CONSISTENCY_PRESETS, LR_DECAYS, RECIPES, WIRE_PRECISIONS, TABLE_KINDS,
    ADMIT_COUNTERS, EVICTIONS, EMBEDDING_DTYPES, ROUNDINGS, SETTLED_ROWS, DEVICES, DIST_BACKENDS,
    PIPELINES, PRECISIONS, ModelConfig, DataConfig, OptimConfig, CommConfig, EmbeddingConfig,
    TableCacheConfig, CacheConfig, TableBoundsConfig, ConsistencyConfig, KernelsConfig,
    PlacementConfig, ScheduleConfig, EarlyStopConfig, LossScaleConfig, TrainConfig,
    CheckpointConfig, Config,
)
from .load import (  # noqa: F401
    CONF_DIR, compose, parse, RENAMED, renamed_overrides, get_key, launcher_rank, adopt_slurm,
)
from .derive import (  # noqa: F401
    epoch_steps, val_range, val_rows, needs_global_view, resolve_device, run_device, dist_transport,
    cache_capacities, staleness_bounds, table_rows, source_rows, local_batch_size, auto_threads,
)
from .validate import (  # noqa: F401
    check_data_source, data_source_error, apply_data_shape, check_min_count, validate,
    validate_world,
)
