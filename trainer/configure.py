"""From what the user typed to the validated Config every entry point runs with.

Why a module of its own: the schemas and their checks (trainer/config.py) import nothing else of
the package, while a file dataset's shape can only be read by its data source (trainer/data/).
This is the one place that joins the two, in a fixed order:

1. parse: the Hydra tree (or dict, or Config) is merged onto the typed schema;
2. shape: a file dataset (criteo, movielens) reports its dense features and table rows
   (trainer.data.resolve), which fill data.num_dense / data.table_rows, before validation;
3. validate: ranges and cross-field rules;
4. steps (only where the world size W is known): data.epochs > 0 turns into train.steps, since the
   number of steps per epoch depends on W. The Trainer does this once its collectives are up
   (apply_data_steps); tools that simulate W workers pass `world` to load_config.

Errors are ConfigError naming the key (a missing or malformed data directory names data.dir).
"""
from __future__ import annotations

from typing import Any, Optional

from .config import (Config, ConfigError, apply_data_shape, check_data_source, compose, data_source_error,
                     parse, validate)
from .data import DataShape, resolve


def load_config(cfg: Any, world: Optional[int] = None) -> Config:
    """The validated Config of a Hydra tree, a plain dict or a Config (a Config is updated in place
    and returned). With `world`, train.steps also follows data.epochs for that many workers."""
    conf = parse(cfg)
    shape = _resolve(conf)
    if shape is not None:
        apply_data_shape(conf, shape.num_dense, shape.table_rows)
    validate(conf)
    if world is not None:
        apply_data_steps(conf, world)
    return conf


def compose_config(overrides: list[str], world: Optional[int] = None) -> Config:
    """The validated Config of `python -m trainer <overrides>` (see load_config for `world`)."""
    return load_config(compose(overrides), world)


def apply_data_steps(c: Config, world: int) -> None:
    """train.steps = the steps data.epochs asks for with `world` workers (file datasets with
    data.epochs > 0); otherwise train.steps stands. c must be validated."""
    shape = _resolve(c, world)
    if shape is not None and shape.steps is not None:
        c.train.steps = shape.steps


def _resolve(c: Config, world: Optional[int] = None) -> Optional[DataShape]:
    check_data_source(c)
    try:
        return resolve(c, world)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise data_source_error(c, exc) from exc


__all__ = ["apply_data_steps", "compose_config", "load_config"]
