"""Is the installed `trainer` / `kernels` pair hybrid-trainer's own?

Other distributions install top-level packages of the same names (`trainer`: Coqui's TTS trainer;
`kernels`: Hugging Face's kernel hub, common in torch environments). pip installs one over the
other into the same site-packages directory, so the second install replaces the files both have
and leaves the others: a silent mix. Both of our packages carry `__distribution__ =
"hybrid-trainer"` in their __init__; check_install() reads the marks (a few attribute lookups) and,
only when one is missing, names the distributions that claim the name (importlib.metadata, slow).
The fix is one virtual environment per project; the README says so.
"""
from __future__ import annotations

import importlib
import os

OURS = "hybrid-trainer"


class InstallError(RuntimeError):
    """One of our two packages is another distribution's (or a mix of both)."""


def _claimants(name: str) -> list[str]:
    try:
        from importlib.metadata import packages_distributions

        return sorted(set(packages_distributions().get(name, [])))
    except Exception:  # noqa: BLE001 - only to name them in the error
        return []


def check_install() -> None:
    """Raise InstallError naming what was found when `trainer` or `kernels` is not ours."""
    for name in ("trainer", "kernels"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise InstallError(f"the package {name!r} of {OURS} cannot be imported ({exc}); "
                               f"reinstall {OURS}") from exc
        if getattr(module, "__distribution__", None) == OURS:
            continue
        where = os.path.dirname(getattr(module, "__file__", None) or "?")
        others = [d for d in _claimants(name) if d.replace("_", "-").lower() != OURS]
        by = f" (installed by {', '.join(others)}{' and ' + OURS if OURS in _claimants(name) else ''})" \
            if others else ""
        raise InstallError(f"the package {name!r} at {where} is not {OURS}'s{by}: another distribution uses "
                           f"the same import name; install {OURS} in its own virtual environment")
