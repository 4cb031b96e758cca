"""From what the user typed to the validated Config every entry point runs with.

Why a module of its own: the schemas and their checks (trainer/config.py) import nothing else of
the package, while a file dataset's shape can only be read by its data source (trainer/data/).
This is the one place that joins the two, in a fixed order:

1. parse: the Hydra tree (or dict, or Config) is merged onto the typed schema;
2. shape: a file dataset (criteo, movielens) reports its dense features and table rows
   (trainer.data.resolve);
3. recipe: the keys left null (data.epochs, data.val_fraction, data.min_count, train.eval_every,
   train.early_stop.patience / min_evals (epochs, turned into evaluations), model.dropout, optim.weight_decay / sparse_weight_decay /
   warmup_steps / decay) take the values of the recipe in force (train.recipe; auto picks it from
   the data: see choose_recipe); a value the user gave is kept; then the shape fills
   data.num_dense / data.table_rows (with data.min_count > 0, the sizes of the training rows'
   vocabulary, which depends on the recipe's validation split);
4. validate: ranges and cross-field rules;
5. steps (only where the world size W is known): data.epochs > 0 turns into train.steps, since the
   number of steps per epoch depends on W (and so does a recipe's per-epoch train.eval_every).
   The Trainer does this once its collectives are up (apply_data_steps); tools that simulate W
   workers pass `world` to load_config.

Errors are ConfigError naming the key (a missing or malformed data directory names data.dir).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .config import (EPOCH_COUNTS, EVAL_PER_EPOCH, RECIPES, SMALL_DATA_ROWS, TINY_DATA_ROWS, Config, ConfigError, apply_data_shape,
                     apply_recipe, check_data_source, check_min_count, compose, recipe_values, data_source_error, evals_per_epoch,
                     get_key, local_batch_size, parse, per_epoch_cadence, recipe_keys, val_rows, validate)
from .data import DataShape, resolve, train_rows, vocab_rows
from .data.criteo import CriteoFormatError


def load_config(cfg: Any, world: Optional[int] = None) -> Config:
    """The validated Config of a Hydra tree, a plain dict or a Config (a Config is updated in place
    and returned). With `world`, train.steps also follows data.epochs for that many workers."""
    conf = parse(cfg)
    shape = _resolve(conf)
    apply_recipe(conf, choose_recipe(conf, shape).name, lambda: _epoch_rows(conf, shape))
    if shape is not None:
        apply_data_shape(conf, shape.num_dense, _model_rows(conf, shape))
    validate(conf)
    if world is not None:
        apply_data_steps(conf, world)
    return conf


def compose_config(overrides: list[str], world: Optional[int] = None) -> Config:
    """The validated Config of `python -m trainer <overrides>` (see load_config for `world`)."""
    return load_config(compose(overrides), world)


def apply_data_steps(c: Config, world: int) -> None:
    """train.steps = the steps data.epochs asks for with `world` workers (file datasets with
    data.epochs > 0); otherwise train.steps stands. A null train.eval_every becomes the recipe's
    (k times per epoch: ceil(ceil(training rows / global batch) / k), k = evals_per_epoch of the
    training rows), else 0. c must be validated."""
    shape = _resolve(c, world)
    if shape is not None and shape.steps is not None:
        c.train.steps = shape.steps
    if c.train.eval_every is None:
        per_epoch = (per_epoch_cadence(choose_recipe(c, shape).name)
                     and bool(c.data.val_fraction))  # the recipe's evaluations are validation ones
        rows = _epoch_rows(c, shape)
        steps = math.ceil(rows / (local_batch_size(c, world) * world))
        c.train.eval_every = math.ceil(steps / evals_per_epoch(rows)) if per_epoch and rows else 0


def _epoch_rows(c: Config, shape: Optional[DataShape]) -> int:
    """Training rows of one epoch (validation rows left out); 0 for an endless synthetic stream."""
    if shape is not None:
        return train_rows(c.data)
    n = c.data.train_samples
    return n - val_rows(n, c.data.val_fraction or 0.0) if n > 0 else 0


@dataclass(frozen=True)
class Recipe:
    """The recipe in force and why (the stderr line and summary.json's `recipe`)."""

    name: str  # small | large | none
    why: str

    def describe(self, c: Config) -> dict[str, Any]:
        """{name, why, values: the recipe keys in force, overridden: those set apart from the recipe}."""
        want = recipe_values(self.name, c.model.name)
        values = {k: get_key(c, k) for k in recipe_keys(c.model.name)}
        k_evals = evals_per_epoch(_epoch_rows(c, _resolve(c))) if per_epoch_cadence(self.name) else 1
        ours = lambda k, v: v == want[k] or (k in EPOCH_COUNTS and v == want[k] * k_evals)  # noqa: E731
        over = {k: v for k, v in values.items() if k in want and want[k] != EVAL_PER_EPOCH and not ours(k, v)}
        return {"name": self.name, "why": self.why, "values": values, "overridden": over}

    def line(self, c: Config) -> str:
        d = self.describe(c)
        vals = ", ".join(f"{k}={v}" for k, v in d["values"].items())
        kept = f"; set by you: {', '.join(d['overridden'])}" if d["overridden"] else ""
        return (f"[trainer] recipe {self.name} ({self.why}): {vals}{kept}. Any of these can be set on the "
                "command line; train.recipe=tiny|small|large|none picks another recipe")


def choose_recipe(c: Config, shape: Optional[DataShape]) -> Recipe:
    """The rule: train.recipe=auto takes `small` for data=criteo whose training split (validation
    rows included) has fewer than SMALL_DATA_ROWS rows: several epochs, evaluated once per epoch
    (up to 4 times on longer epochs) on a validation split, early stopping; `tiny` below TINY_DATA_ROWS rows (the same and a bag of 5
    models); `large` for bigger criteo sets (one epoch, the DLRM Kaggle
    recipe); `none` for other data (every null key at its neutral value). Another train.recipe is
    taken as given."""
    if c.train.recipe not in RECIPES:
        raise ConfigError(f"train.recipe={c.train.recipe!r}: must be one of {', '.join(RECIPES)}")
    if c.train.recipe != "auto":
        return Recipe(c.train.recipe, f"train.recipe={c.train.recipe}")
    if c.data.name != "criteo" or shape is None or shape.split_rows is None:
        return Recipe("none", f"data={c.data.name}: the size rule is for data=criteo")
    rows = shape.split_rows
    if rows < TINY_DATA_ROWS:
        return Recipe("tiny", f"data=criteo with {rows:,} training rows < {TINY_DATA_ROWS:,}")
    if rows < SMALL_DATA_ROWS:
        return Recipe("small", f"data=criteo with {rows:,} training rows < {SMALL_DATA_ROWS:,}")
    return Recipe("large", f"data=criteo with {rows:,} training rows >= {SMALL_DATA_ROWS:,}")


def recipe_of(c: Config) -> Recipe:
    """The recipe of a loaded config (re-derived from the data: the rule reads only its size)."""
    return choose_recipe(c, _resolve(c))


def _model_rows(c: Config, shape: DataShape) -> list[int]:
    """The tables' rows the model is built with: as stored, or with data.min_count > 0 the sizes
    of the training rows' vocabulary (trainer/data/vocab.py; it needs the recipe's split keys)."""
    if not c.data.min_count:
        return shape.table_rows
    check_min_count(c.data)
    try:
        return vocab_rows(c.data)
    except (ConfigError, CriteoFormatError):  # these already name data.dir (a damaged block: its file)
        raise
    except (OSError, ValueError) as exc:
        raise data_source_error(c, exc) from exc


def _resolve(c: Config, world: Optional[int] = None) -> Optional[DataShape]:
    check_data_source(c)
    try:
        return resolve(c, world)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise data_source_error(c, exc) from exc


__all__ = ["Recipe", "apply_data_steps", "choose_recipe", "compose_config", "load_config", "recipe_of"]
