"""Counter-based random numbers: value = f(seed, stream, index), no sequential state.

Why: every sample, planted weight and embedding row must be reproducible from its index alone, so
that any rank can generate exactly its slice of the global batch (or its shard of a table) and a
W-worker run sees the very same numbers as the single-process reference.
"""
from __future__ import annotations

import numpy as np

from kernels import SPLITMIX_GAMMA as _GOLD
from kernels import SPLITMIX_M2 as _M2
from kernels import splitmix as _mix  # splitmix64's finaliser: a new array (or scalar)
from kernels import splitmix_inplace


def hash64(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """[...] uint64 hash of (seed, stream, index); index is any integer array."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _GOLD + np.uint64(stream) * _M2)
        x = np.asarray(index).astype(np.uint64)  # a copy, hashed in place (no temporaries: the data
        # and the initial rows of dynamic tables hash millions of values a step)
        if not x.ndim:
            return _mix(_mix(x * _GOLD + key) + key)
        t = np.empty_like(x)
        np.multiply(x, _GOLD, out=x)
        np.add(x, key, out=x)
        splitmix_inplace(x, t)
        np.add(x, key, out=x)
        return splitmix_inplace(x, t)


def uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """[...] float64 in [0, 1), deterministic per (seed, stream, index)."""
    h = hash64(seed, stream, index)
    h >>= np.uint64(11)
    out = h.astype(np.float64)
    out *= 1.0 / (1 << 53)
    return out


def uniform_rows(seed: int, stream: int, index: np.ndarray, width: int) -> np.ndarray:
    """[n, width] float32 in [0, 1), row i a pure function of (seed, stream, index[i]), for rows
    made on the hot path (the initial rows of dynamic tables, every step): one hash64 per row
    seeds a SplitMix64 sequence (state + k x golden ratio, one finaliser per word), and each
    64-bit word gives two 24-bit uniforms (exact in float32). A quarter of uniform()'s hashing."""
    idx = np.asarray(index).reshape(-1)
    words = (width + 1) // 2
    with np.errstate(over="ignore"):
        x = hash64(seed, stream, idx)[:, None] + np.arange(1, words + 1, dtype=np.uint64)[None, :] * _GOLD
    splitmix_inplace(x, np.empty_like(x))
    out = np.empty((idx.size, 2 * words), dtype=np.float32)
    out[:, 0::2] = x >> np.uint64(40)
    out[:, 1::2] = (x >> np.uint64(8)) & np.uint64(0xFFFFFF)
    out *= np.float32(1.0 / (1 << 24))
    return out[:, :width]


def normal(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """[...] float64 standard normal (Box-Muller over two hashed uniforms)."""
    idx = np.asarray(index).astype(np.uint64)
    u1 = uniform(seed, stream, idx * np.uint64(2))
    u2 = uniform(seed, stream, idx * np.uint64(2) + np.uint64(1))
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
