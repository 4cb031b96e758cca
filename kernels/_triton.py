"""Lazy Triton: imported at the first kernel launch, never at ``import kernels``.

Why:
- ``import kernels`` must work where Triton is not installed (the reference path needs no Triton).
- Triton fixes compiled-vs-interpreted (``TRITON_INTERPRET=1``) when it is imported: its own
  library functions (``tl.sum``, ``tl.zeros``...) are jitted at import. The trainer imports ``kernels``
  long before a test module sets ``TRITON_INTERPRET=1``, so importing Triton there would lock the
  wrong mode. Hence the kernel files use string annotations (``from __future__ import annotations``)
  and a module-level ``tl = None`` that :class:`jit` binds to ``triton.language`` at first launch.

Kernels decorated with :class:`jit` must not call other jitted helpers (inline them): the compiled
code generator only accepts real ``JITFunction`` callees.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Optional, Tuple

_loaded: Optional[Tuple[Any, Any, bool]] = None  # (triton, triton.language, interpret at import)


def interpret_enabled() -> bool:
    """True when Triton's interpreter is requested (kernels run on CPU tensors, slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def has_triton() -> bool:
    """Whether Triton is installed (does not import it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def require_triton() -> None:
    """Raise a clear error when a Triton path is requested but Triton is not installed."""
    if not has_triton():
        raise RuntimeError(
            "the Triton kernel path was requested but `triton` is not installed; "
            "install triton==3.7.1 (the version torch 2.13 pins) or use the reference backend"
        )


def _import_mode(triton: Any) -> bool:
    """Whether an already-imported Triton jitted its own library for the interpreter."""
    return type(triton.language.standard.zeros).__name__ == "InterpretedFunction"


def load_triton() -> Tuple[Any, Any]:
    """Import Triton once; fail clearly if TRITON_INTERPRET now differs from its import mode."""
    global _loaded
    if _loaded is None:
        require_triton()
        import triton
        import triton.language as tl

        _loaded = (triton, tl, _import_mode(triton))
    triton, tl, imported_interpreted = _loaded
    if imported_interpreted != interpret_enabled():
        raise RuntimeError(
            f"triton was imported with TRITON_INTERPRET={'1' if imported_interpreted else '0'} but "
            "it is now different; set TRITON_INTERPRET before anything imports triton"
        )
    return triton, tl


def interpreter_ready() -> bool:
    """True when Triton kernels can run on CPU tensors now (installed, interpreter mode usable)."""
    if not (has_triton() and interpret_enabled()):
        return False
    try:
        load_triton()
    except RuntimeError:
        return False
    return True


class jit:  # noqa: N801 - used as a decorator, mirrors triton.jit
    """``triton.jit`` applied at first launch: ``kernel[grid](*args)`` imports Triton, binds ``tl``
    in the kernel's module, then compiles (or interprets) as ``triton.jit`` would."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._kernel: Any = None

    def resolve(self) -> Any:
        """The ``JITFunction`` (or ``InterpretedFunction``) for this kernel."""
        triton, tl = load_triton()
        if self._kernel is None:
            self.fn.__globals__["tl"] = tl
            self._kernel = triton.jit(self.fn)
        return self._kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.resolve()[grid]


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def block_sizes(dim: int, max_block_d: int = 256) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D) for rows of width dim: a tile of at most 2K elements and 32 rows.

    Bags are 1..64 entries, so taller tiles would mostly be masked lanes at small d.
    """
    block_d = min(next_pow2(dim), next_pow2(max_block_d))
    return min(max(2048 // block_d, 1), 32), block_d


def cdiv(a: int, b: int) -> int:
    """Ceil division for grid sizes."""
    return (a + b - 1) // b


def dense_1d(*tensors: Any) -> Tuple[Any, ...]:
    """The kernels address entry i of slots / offsets / weights at base + i: make strided views
    (slots[::2]) dense. A no-op (no copy) for the contiguous tensors the trainer passes."""
    return tuple(None if t is None else t.contiguous() for t in tensors)
