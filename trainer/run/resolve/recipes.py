"""Recipes: the values of the keys a config leaves null (null = "the recipe's"), by data size.

Why a module of its own: the tuning policy (which optimizer, how many epochs, how often to
evaluate, how long to wait for a better validation AUC, how many models to average) is measured
on data (README "Real data", "The recipe per data size") and changes with it, while the schemas
and their checks (trainer/base/config/) do not. Every rule about a recipe lives here:

- the values: one table, ROWS (a row per key, a column per recipe: none, large, small, tiny) and
  MODEL_ROWS on top of it per model; RECIPE_VALUES / MODEL_RECIPE_VALUES are its columns;
- the choice: train.recipe=auto picks tiny / small / large for data=criteo by the size of its
  training split, none for other data (choose_recipe, called once, by load_config, which carries
  it on the config with the data's shape: Resolved, c.resolved; recipe_of reads it back);
- applying them: apply_recipe fills the null keys (trainer/run/resolve/configure.py calls it while loading a
  config); the evaluation cadence "k times per epoch" and the epoch counts of early stopping need
  the world size W, so apply_data_steps finishes them once W is known (the Trainer, tools that
  simulate W workers);
- saying so: Recipe.line / describe (stderr, summary.json's `recipe`), announce_recipe once per run.

A value the user set is always kept; what a recipe set apart from the user is reported as
"overridden".
"""
from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ...base.config import RECIPES, Config, ConfigError, epoch_steps, get_key, local_batch_size
from ...workload.data import DataShape
from ...workload.data import epoch_rows as rows_per_epoch

SMALL_DATA_ROWS = 1_000_000  # train.recipe=auto: data=criteo with fewer training rows takes the small recipe
TINY_DATA_ROWS = 100_000  # ... and with fewer than these, the tiny one (small + an ensemble of 5 models)
EVAL_PER_EPOCH = "epoch"  # a recipe's train.eval_every: once per pass over the training rows (needs W) ...
RECIPE_EVAL_ROWS = 1_280  # ... or more often: no more than this many training rows between evaluations ...
RECIPE_EVALS_PER_EPOCH = 4  # ... up to this many evaluations per epoch (see evals_per_epoch)
EPOCH_COUNTS = ("train.early_stop.patience", "train.early_stop.min_evals")  # the recipe's count epochs
DEFAULT_STEPS = 300  # train.steps left null without epochs (and the placeholder until W gives data.epochs' steps)
# The recipes' values: one table. A row per key a recipe fills, a column per recipe (COLUMNS);
# UNSET: that recipe leaves the key to the preset (optim=auto's null sparse_lr: = lr). none sets
# every key to its neutral value (train.steps, no validation, the optim=sgd preset); large: one
# epoch, the DLRM Kaggle recipe, right for 45M rows. small data (README "Real data", measured
# there): dense Adam + row-wise Adagrad rows (the optim=adam preset), standardised dense features,
# up to 30 epochs, evaluated once per epoch (up to 4 times on longer epochs: evals_per_epoch) on a
# 20% validation split, stopped after 3 epochs without a new best (never before 10: the two counts
# are epochs, see apply_recipe), best model tested with its logits scaled by a temperature fitted
# on the validation split (train.calibrate). tiny data (README): the small recipe, and an ensemble
# of 5 models, one per 20% validation slice (train.ensemble, trainer/run/evaluation/ensemble.py):
# on a few thousand rows one model's test AUC moves by ~0.02 with its validation rows; five cost
# five trainings, which only tiny data makes cheap. The optimizer rows are the conf/optim presets
# they name (tests/unit/test_configure.py checks it).
# Per model, on top (MODEL_ROWS; README "The recipe per data size"): DCN's cross layers, and WDL
# too (measured later, over 32 splits), did better on tiny data with the rare ids folded into the
# OOV row, the per-table sqrt(1 / rows) init (larger rows) and rows of 32 (their presets leave
# model.embedding_dim null; 16 elsewhere) than with the small recipe's values; DLRM's top MLP (its
# preset leaves it null) is [64, 32] as in the bench workload, and [256, 128] (the other models'
# deep tower) on tiny and small data, where that width did better.
UNSET = object()
COLUMNS = ("none", "large", "small", "tiny")
ROWS: dict[str, tuple[Any, Any, Any, Any]] = {
    # key                           none     large    small              tiny
    "data.epochs":                  (0.0,    1.0,     30.0,              30.0),
    "data.val_fraction":            (0.0,    0.0,     0.2,               0.2),
    "data.standardize":             (False,  False,   True,              True),
    "data.min_count":               (0,      0,       1,                 1),
    "embedding.init_scale":         (0.0,    0.0,     0.01,              0.01),
    "train.eval_every":             (0,      0,       EVAL_PER_EPOCH,    EVAL_PER_EPOCH),
    "train.early_stop.patience":    (0,      0,       3,                 3),
    "train.early_stop.min_evals":   (0,      0,       10,                10),
    "train.calibrate":              (False,  False,   True,              True),
    "train.ensemble":               (1,      1,       1,                 5),
    "model.dropout":                (0.0,    0.0,     0.0,               0.0),
    "optim.name":                   ("sgd",  "sgd",   "adam",            "adam"),
    "optim.dense":                  ("sgd",  "sgd",   "adam",            "adam"),
    "optim.sparse":                 ("sgd",  "sgd",   "rowwise_adagrad", "rowwise_adagrad"),
    "optim.lr":                     (0.1,    0.1,     0.001,             0.001),
    "optim.eps":                    (1e-10,  1e-10,   1e-8,              1e-8),
    "optim.weight_decay":           (0.0,    0.0,     0.0,               0.0),
    "optim.sparse_weight_decay":    (0.0,    0.0,     0.0,               0.0),
    "optim.warmup_steps":           (0,      0,       0,                 0),
    "optim.decay":                  ("none", "none",  "none",            "none"),
    "optim.sparse_lr":              (UNSET,  UNSET,   0.05,              0.05),
}
MODEL_ROWS: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {
    # (model, key)                  none      large     small       tiny
    ("dlrm", "model.top_mlp"):      ([64, 32], [64, 32], [256, 128], [256, 128]),
    ("dcn", "data.min_count"):      (UNSET,   UNSET,    2,          2),
    ("dcn", "embedding.init_scale"): (UNSET,  UNSET,    0.0,        0.0),
    ("dcn", "model.embedding_dim"): (16,      16,       32,         32),
    ("wdl", "data.min_count"):      (UNSET,   UNSET,    2,          2),
    ("wdl", "embedding.init_scale"): (UNSET,  UNSET,    0.0,        0.0),
    ("wdl", "model.embedding_dim"): (16,      16,       32,         32),
}
# the table by recipe: {recipe: {key: value}} and {recipe: {model: {key: value}}} (the recipes in
# COLUMNS' order, the keys in the rows' order)
RECIPE_VALUES: dict[str, dict[str, Any]] = {
    r: {k: v[i] for k, v in ROWS.items() if v[i] is not UNSET} for i, r in enumerate(COLUMNS)}
MODEL_RECIPE_VALUES: dict[str, dict[str, dict[str, Any]]] = {r: {} for r in COLUMNS}
for (_model, _key), _values in MODEL_ROWS.items():
    for _recipe, _value in zip(COLUMNS, _values):
        if _value is not UNSET:
            MODEL_RECIPE_VALUES[_recipe].setdefault(_model, {})[_key] = _value


def evals_per_epoch(epoch_rows: int) -> int:
    """k: how many times per epoch a recipe's train.eval_every (EVAL_PER_EPOCH) evaluates, for an
    epoch of epoch_rows training rows: k = ceil(epoch_rows / RECIPE_EVAL_ROWS), at least 1 and at
    most RECIPE_EVALS_PER_EPOCH. The models' best validation step grows much more slowly than the
    data (+15-40% steps from 800 to 1,600 rows), so once per epoch gets coarse on larger sets: on
    1,280-row epochs (10 steps of 128) evaluating every 32 steps instead cost WDL and DLRM 0.0017
    and 0.0007 AUC, every 5 steps gained nothing (README "Real data"). The cap keeps the
    evaluations' forward passes at most one epoch's rows with a 20% validation split. The recipe's
    patience and min_evals count epochs: they are multiplied by k with it (apply_recipe)."""
    return min(RECIPE_EVALS_PER_EPOCH, max(1, math.ceil(epoch_rows / RECIPE_EVAL_ROWS)))


def per_epoch_cadence(recipe: str) -> bool:
    """Whether `recipe` evaluates per epoch (train.eval_every = EVAL_PER_EPOCH: evals_per_epoch
    times, its patience and min_evals counted in epochs)."""
    return RECIPE_VALUES[recipe]["train.eval_every"] == EVAL_PER_EPOCH


def recipe_values(recipe: str, model: str) -> dict[str, Any]:
    """The values of `recipe` for model `model` (its per-model values win)."""
    return {**RECIPE_VALUES[recipe], **MODEL_RECIPE_VALUES.get(recipe, {}).get(model, {})}


def recipe_keys(model: Optional[str] = None) -> list[str]:
    """The keys a recipe may set (those a null leaves to it), with those of `model`'s own values."""
    own = (k for per_model in MODEL_RECIPE_VALUES.values() for k in per_model.get(model, {}))
    return list(dict.fromkeys([*(k for values in RECIPE_VALUES.values() for k in values), *own]))


def apply_recipe(c: Config, recipe: str, epoch_rows: Callable[[], int] = lambda: 0) -> dict[str, Any]:
    """Fill every recipe key that is null with `recipe`'s value (train.eval_every's once-per-epoch
    stays null until W is known); keys the user set are kept. Returns {key: value} it set.
    epoch_rows() (asked once the recipe's validation split is set): the training rows of an epoch;
    when the recipe also sets the cadence (train.eval_every left null), its patience and min_evals,
    counted in epochs, become evals_per_epoch(epoch_rows()) times as many evaluations."""
    done = {}
    if c.train.steps is not None and c.data.epochs is None:  # the user's train.steps wins over the recipe's epochs
        c.data.epochs = 0.0
    chosen_optimizer = c.optim.sparse is not None  # a preset's null sparse_lr means "= lr", not "the recipe's"
    for key, value in recipe_values(recipe, c.model.name).items():
        *path, name = key.split(".")
        obj = get_key(c, ".".join(path))
        if key == "optim.sparse_lr" and chosen_optimizer:
            continue
        if getattr(obj, name) is None and value != EVAL_PER_EPOCH:
            value = list(value) if isinstance(value, list) else value  # never the table's own list
            setattr(obj, name, value)
            done[key] = value
    counts = [k for k in EPOCH_COUNTS if k in done]
    if counts and c.train.eval_every is None and per_epoch_cadence(recipe) and c.data.val_fraction:
        k = evals_per_epoch(epoch_rows())
        for key in counts:
            done[key] *= k
            parent, name = key.rsplit(".", 1)
            setattr(get_key(c, parent), name, done[key])
    if "train.early_stop.patience" in done and not c.data.val_fraction:
        c.train.early_stop.patience = done["train.early_stop.patience"] = 0  # data.val_fraction=0: nothing to stop on
    if "train.calibrate" in done and not c.data.val_fraction:
        c.train.calibrate = done["train.calibrate"] = False  # nothing to calibrate on either
    if "train.ensemble" in done and not c.data.val_fraction:
        c.train.ensemble = done["train.ensemble"] = 1  # nor validation slices to give the members
    if c.train.steps is None:  # data.epochs' steps replace it once W is known (apply_data_steps)
        c.train.steps = DEFAULT_STEPS
    return done


def apply_data_steps(c: Config, world: int) -> None:
    """train.steps = the steps data.epochs asks for with `world` workers (file datasets with
    data.epochs > 0); otherwise train.steps stands. A null train.eval_every becomes the recipe's
    (k times per epoch: ceil(ceil(training rows / global batch) / k), k = evals_per_epoch of the
    training rows), else 0. c must be loaded (load_config): the data's shape and the recipe are
    those it carries (c.resolved), the data is not read again."""
    done = resolved(c)
    shape = done.shape
    if shape is not None and c.data.epochs and c.data.epochs > 0:
        steps = epoch_steps(c, rows_per_epoch(c, shape), world)
        if steps is not None:
            c.train.steps = steps
    if c.train.eval_every is None:
        per_epoch = (per_epoch_cadence(done.recipe.name)
                     and bool(c.data.val_fraction))  # the recipe's evaluations are validation ones
        rows = rows_per_epoch(c, shape)
        steps = math.ceil(rows / (local_batch_size(c, world) * world))
        c.train.eval_every = math.ceil(steps / evals_per_epoch(rows)) if per_epoch and rows else 0


@dataclass(frozen=True)
class Recipe:
    """The recipe in force and why (the stderr line and summary.json's `recipe`)."""

    name: str  # small | large | none
    why: str

    def describe(self, c: Config, world: Optional[int] = None) -> dict[str, Any]:
        """{name, why, values: the recipe keys in force, overridden: those set apart from the recipe,
        derived: what data.epochs gave with `world` workers (c has it applied: apply_data_steps)}."""
        want = recipe_values(self.name, c.model.name)
        values = {k: get_key(c, k) for k in recipe_keys(c.model.name)}
        k_evals = evals_per_epoch(rows_per_epoch(c, resolved(c).shape)) if per_epoch_cadence(self.name) else 1
        ours = lambda k, v: v == want[k] or (k in EPOCH_COUNTS and v == want[k] * k_evals)  # noqa: E731
        over = {k: v for k, v in values.items() if k in want and want[k] != EVAL_PER_EPOCH and not ours(k, v)}
        if over.get("data.epochs") == 0 and want.get("data.epochs"):  # train.steps given: the epochs not applied
            del over["data.epochs"]
            over["train.steps"] = c.train.steps
        return {"name": self.name, "why": self.why, "values": values, "overridden": over,
                "derived": derived_values(c, world) if world else {}}

    def line(self, c: Config, world: Optional[int] = None) -> str:
        d = self.describe(c, world)
        vals = ", ".join(f"{k}={v}" for k, v in d["values"].items())
        derived = "".join(f"; {k}={v}" for k, v in d["derived"].items())
        kept = f"; set by you: {', '.join(d['overridden'])}" if d["overridden"] else ""
        return (f"[trainer] recipe {self.name} ({self.why}): {vals}{derived}{kept}. Any of these can be set on "
                "the command line; train.recipe=tiny|small|large|none picks another recipe")


def derived_values(c: Config, world: int) -> dict[str, str]:
    """What a config with W applied (apply_data_steps) derived from data.epochs, and from what:
    {"train.steps": "75 (data.epochs=30 x 1,280 training rows / 512 a step)"}; {} without epochs."""
    if not c.data.epochs:
        return {}
    rows, g = rows_per_epoch(c, resolved(c).shape), local_batch_size(c, world) * world
    return {"train.steps": f"{c.train.steps} (data.epochs={c.data.epochs:g} x {rows:,} training rows / {g:,} a step)"}


def choose_recipe(c: Config, shape: Optional[DataShape]) -> Recipe:
    """The rule: train.recipe=auto takes `small` for data=criteo whose training split (validation
    rows included) has fewer than SMALL_DATA_ROWS rows: several epochs, evaluated once per epoch
    (up to 4 times on longer epochs) on a validation split, early stopping; `tiny` below TINY_DATA_ROWS rows (the same and an
    ensemble of 5 models); `large` for bigger criteo sets (one epoch, the DLRM Kaggle
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


@dataclass(frozen=True)
class Resolved:
    """What loading a config found beside its keys, carried on it as c.resolved (not a key: a
    class attribute of Config, not a field, so asdict, OmegaConf and == ignore it): the file
    dataset's shape as read once (None: synthetic data) and the recipe chosen once. Everything
    after loading (the steps once W is known, the recipe's line and summary) reads these."""

    shape: Optional[DataShape]
    recipe: Recipe


def resolved(c: Config) -> Resolved:
    """The shape and recipe c was loaded with (trainer.run.resolve.configure.load_config)."""
    if c.resolved is None:
        raise ConfigError("the config was not loaded: trainer.run.resolve.configure.load_config resolves "
                          "its data's shape and recipe")
    return c.resolved


def recipe_of(c: Config) -> Recipe:
    """The recipe of a loaded config (the one load_config chose)."""
    return resolved(c).recipe


def announce_recipe(c: Config, comm: Any) -> dict[str, Any]:
    """Say once, on rank 0's stderr, which recipe the run trains with and its values (nothing for
    recipe none); returns summary.json's `recipe`. c is the run's loaded config; the values are
    those a Trainer sees once it knows W (apply_data_steps on a copy: the cadence per epoch)."""
    view = copy.deepcopy(c)
    apply_data_steps(view, comm.size)
    recipe = recipe_of(view)
    if comm.rank == 0 and recipe.name != "none":
        print(recipe.line(view, comm.size), file=sys.stderr)
    return recipe.describe(view, comm.size)


__all__ = ["EPOCH_COUNTS", "EVAL_PER_EPOCH", "MODEL_RECIPE_VALUES", "RECIPE_VALUES", "SMALL_DATA_ROWS",
           "TINY_DATA_ROWS", "DEFAULT_STEPS", "Recipe", "Resolved", "announce_recipe", "apply_data_steps", "apply_recipe", "choose_recipe",
           "derived_values", "evals_per_epoch", "per_epoch_cadence", "recipe_keys", "recipe_of", "recipe_values", "resolved"]
