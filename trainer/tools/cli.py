"""What every command-line tool of the package shares: bad input is one `error: ...` line on stderr
and exit status 2, never a traceback."""
from __future__ import annotations

import sys
from typing import Any, Callable


def input_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean bad input to the tools (a bad directory, file, override or config):
    their scripts print them and exit with status 2."""
    from hydra.errors import HydraException

    from ..config import ConfigError
    from ..data.criteo import CriteoFormatError

    return (ConfigError, CriteoFormatError, HydraException, ValueError, OSError)


def error_line(exc: BaseException) -> str:
    """The message of exc on one line, as `error: ...` prints it. Hydra's and OmegaConf's messages
    span lines: "Could not override 'x'.\\nTo append to your config use +x=1", a list of the
    available options one per indented line, then the config search path (dropped: it names
    Hydra's own directories). Lines are joined with "; " (" " after a line ending in "." or ":"),
    the items of an indented list with ", ". An override Hydra could not parse comes first
    (`train.steps=[1: no viable alternative at input '[1'; ...`)."""
    out, indented_before = "", False
    for raw in str(exc).splitlines():
        line = raw.strip()
        if not line:
            continue
        if line == "Config search path:":
            break
        indented = raw[:1].isspace()
        if not out:
            out = line
        elif indented and indented_before:
            out += ", " + line
        else:
            out += (" " if out.endswith((".", ":")) else "; ") + line
        indented_before = indented
    out = out or type(exc).__name__
    override = getattr(exc, "override", None)  # hydra.errors.OverrideParseException
    return f"{override}: {out}" if isinstance(override, str) and override not in out else out


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
