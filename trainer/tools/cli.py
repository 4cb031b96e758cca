"""What every command-line tool of the package shares: bad input is one `error: ...` line on stderr
and exit status 2, never a traceback."""
from __future__ import annotations

import sys
from typing import Any, Callable

from ..core.errors import error_line


def input_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean bad input to the tools (a bad directory, file, override or config):
    their scripts print them and exit with status 2."""
    from hydra.errors import HydraException

    from ..config import ConfigError
    from ..data.criteo import CriteoFormatError

    return (ConfigError, CriteoFormatError, HydraException, ValueError, OSError)


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
