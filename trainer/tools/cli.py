"""What every command-line tool of the package shares: bad input is one `error: ...` line on stderr
and exit status 2, never a traceback; so is a tool's optional package that is not installed (the
line names the extra that brings it: EXTRAS, pyproject.toml's [project.optional-dependencies])."""
from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable

from ..base.core.errors import error_line


# extra -> {module a tool imports: the distribution that provides it}
EXTRAS: dict[str, dict[str, str]] = {
    "baseline": {"sklearn": "scikit-learn", "scipy": "scipy"},  # the LR baseline (baseline.py)
    "plot": {"matplotlib": "matplotlib"},  # the sweep's plot (sweep.py)
}


class MissingExtra(RuntimeError):
    """A tool needs a package of one of the project's extras that is not installed."""


def require_extra(extra: str, what: str) -> None:
    """Raise MissingExtra, one line naming the packages and `pip install 'hybrid-trainer[extra]'`,
    unless every module of EXTRAS[extra] can be imported (looked up, not imported)."""
    missing = [dist for module, dist in EXTRAS[extra].items() if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtra(f"{what} needs {' and '.join(missing)}, not installed here: "
                           f"pip install 'hybrid-trainer[{extra}]' (in a checkout: pip install -e '.[{extra}]')")


def input_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean bad input to the tools (a bad directory, file, override or config) or a
    missing extra: their scripts print them and exit with status 2."""
    from hydra.errors import HydraException

    from ..base.config import ConfigError
    from ..workload.data.criteo import CriteoFormatError

    return (ConfigError, CriteoFormatError, HydraException, MissingExtra, ValueError, OSError)


def bad_input(exc: BaseException) -> int:
    """Report exc, an input error, as the one line `error: ...` on stderr; the exit status 2."""
    print(f"error: {error_line(exc)}", file=sys.stderr)
    return 2


def exit_status(fn: Callable[[], Any]) -> int:
    """A tool script's exit status: 0 once fn() has run; 2, with one `error: ...` line on stderr,
    when it stopped on bad input (input_errors)."""
    try:
        fn()
    except input_errors() as exc:
        return bad_input(exc)
    return 0
