"""ConfigError and the checks that raise it, naming the key."""
from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A config value is out of range or inconsistent; the message names the key."""


def _check(ok: bool, key: str, value: Any, reason: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {reason}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, value, f"must be one of {', '.join(allowed)}")


def _finite(key: str, value: float) -> None:
    _check(math.isfinite(value), key, value, "must be a finite number")


_UNRESOLVED = "null (the recipe's) was not resolved: load the config with trainer.run.resolve.configure.load_config"
