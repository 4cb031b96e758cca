"""splitmix64's finaliser on int64 tensors: the one hash of ids the data (hashed ids), the owners
(which rank holds an id) and admission (count-min rows) share."""
from __future__ import annotations

import torch

from kernels import SPLITMIX_M1, SPLITMIX_M2


def _as_int64(m: int) -> int:
    """The int64 of the same 64 bits as the unsigned m."""
    return m - (1 << 64) if m >= 1 << 63 else m


_M1, _M2 = _as_int64(int(SPLITMIX_M1)), _as_int64(int(SPLITMIX_M2))  # splitmix64's multipliers as int64


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic): a bijection of 64-bit words."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)
