"""From what the user typed to the validated Config every entry point runs with.

Why a module of its own: the schemas and their checks (trainer/base/config/) import nothing else of
the package, while a file dataset's shape can only be read by its data source (trainer/workload/data/).
This is the one place that joins the two, in a fixed order:

1. parse: the Hydra tree (or dict, or Config) is merged onto the typed schema;
2. shape: a file dataset (criteo, movielens) reports its dense features, table rows and training
   rows (trainer.workload.data.shape_of), and the recipe in force is chosen (recipes.choose_recipe):
   both once, here, and carried on the config (c.resolved, recipes.Resolved), so nothing after
   loading reads the data's shape or chooses the recipe again;
3. recipe: the keys left null (data.epochs, data.val_fraction, data.min_count, train.eval_every,
   train.early_stop.patience / min_evals (epochs, turned into evaluations), model.dropout,
   optim.weight_decay / sparse_weight_decay / warmup_steps / decay, ...) take the values of the
   recipe in force (trainer/run/resolve/recipes.py: train.recipe, auto picks it from the data); a value the
   user gave is kept; then the shape fills data.num_dense / data.table_rows (with
   data.min_count > 0, the sizes of the training rows' vocabulary, which depends on the recipe's
   validation split);
4. validate: ranges and cross-field rules;
5. steps (only where the world size W is known): data.epochs > 0 turns into train.steps, since the
   number of steps per epoch depends on W (and so does a recipe's per-epoch train.eval_every).
   The Trainer does this once its collectives are up (recipes.apply_data_steps, from the carried
   shape and recipe); tools that simulate W workers pass `world` to load_config.

Errors are ConfigError naming the key (a missing or malformed data directory names data.dir).
"""
from __future__ import annotations

from typing import Any, Optional

from ...base.config import (Config, ConfigError, apply_data_shape, check_min_count, compose, data_source_error, parse,
                     run_device, validate)
from ...workload.data import DataShape, epoch_rows, shape_of, vocab_rows
from ...workload.data.criteo import CriteoFormatError
from .recipes import Resolved, apply_data_steps, apply_recipe, choose_recipe


def load_config(cfg: Any, world: Optional[int] = None) -> Config:
    """The validated Config of a Hydra tree, a plain dict or a Config (a Config is updated in place
    and returned). With `world`, train.steps also follows data.epochs for that many workers."""
    conf = parse(cfg)
    shape = shape_of(conf)  # the data is read here and nowhere after: the shape travels on conf
    recipe = choose_recipe(conf, shape)
    conf.resolved = Resolved(shape, recipe)
    apply_recipe(conf, recipe.name, lambda: epoch_rows(conf, shape))
    if shape is not None:
        apply_data_shape(conf, shape.num_dense, _model_rows(conf, shape))
    validate(conf)
    apply_capacity_budget(conf)
    if world is not None:
        apply_data_steps(conf, world)
    return conf


def apply_capacity_budget(c: Config) -> None:
    """embedding.capacity_bytes > 0: set embedding.capacity to the most rows per table that fit it
    (memplan.capacity_for_budget, on the device the run will use); a capacity given beside it
    must be that figure (a resolved config loads again unchanged)."""
    e = c.embedding
    if not e.capacity_bytes:
        return
    import torch

    from .memplan import capacity_for_budget  # torch and the kernels: only when asked

    cap = capacity_for_budget(c, torch.device(run_device(c)))
    if cap < 1:
        raise ConfigError(f"embedding.capacity_bytes={e.capacity_bytes}: too small for one row per table "
                          f"on each owner (the pool's bytes per slot: docs/dynamic.md#bytes-per-slot)")
    if e.capacity and e.capacity != cap:
        raise ConfigError(f"embedding.capacity={e.capacity} and embedding.capacity_bytes={e.capacity_bytes} "
                          f"(which gives {cap} rows per table): give one of them")
    e.capacity = cap


def compose_config(overrides: list[str], world: Optional[int] = None) -> Config:
    """The validated Config of `python -m trainer <overrides>` (see load_config for `world`)."""
    return load_config(compose(overrides), world)


def _model_rows(c: Config, shape: DataShape) -> list[int]:
    """The tables' rows the model is built with: as stored, or with data.min_count > 0 the sizes
    of the training rows' vocabulary (trainer/workload/data/vocab.py; it needs the recipe's split keys)."""
    if not c.data.min_count:
        return shape.table_rows
    check_min_count(c.data)
    try:
        return vocab_rows(c.data)
    except (ConfigError, CriteoFormatError):  # these already name data.dir (a damaged block: its file)
        raise
    except (OSError, ValueError) as exc:
        raise data_source_error(c, exc) from exc


__all__ = ["compose_config", "load_config"]
