"""Hydra composition and the composed tree parsed onto the schema (old key names renamed)."""
from __future__ import annotations

import os
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError, _check
from .schema import Config


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


def get_key(c: Config, key: str) -> Any:
    obj = c
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
