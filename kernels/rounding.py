"""Stochastic rounding of updated rows to half precision: the rule, its random numbers, the reference.

Why stochastic: rows stored in fp16 / bf16 (config embedding.dtype) are updated in fp32 (the row is
upcast, the sparse optimizer runs with its fp32 state) and written back rounded. Round-to-nearest
drops every update smaller than half a unit in the last place: a bf16 row of magnitude 0.05 has
ulps of 2^-12 ~ 2.4e-4, so SGD steps of lr x g below ~1.2e-4 would never move it. Stochastic
rounding keeps the row right in expectation: x (fp32) becomes the half value y just below or z just
above it with probabilities that make E[result] = x, so small updates accumulate on average.

The rule, for an fp32 value x: the two values of the half type next to x (x itself when it is one)
are chosen with probabilities proportional to closeness, so that E[result] = x. It is computed
from 32 random bits e per element (a hash of (seed, step, row key, column), below):
- bfloat16 keeps the high 16 of x's 32 bits: add the 16 random bits e >> 16 to the bits of x as an
  integer and drop the low 16 (truncation towards zero, with a carry into the kept bits, i.e. one
  step away from zero, exactly when the random bits reach the dropped ones). P(away) = dropped /
  2^16 exactly, hence E = x exactly. Integer operations only (a NaN stays a NaN: 0x7FC0).
- float16: y = x rounded to nearest (IEEE, ties to even); z = the neighbour of y on the side of x
  (y's bits +1 when |x| > |y|, else -1: sign-magnitude, so that works for either sign);
  u = (e >> 8) / 2^24 in [0, 1); result = z if u |z - y| < |x - y| else y. P(z) = |x - y| / |z - y|
  (up to u's 2^-24 granularity), hence E = y + (z - y) P(z) = x. Every operation of the decision is
  exact in fp32 (|x - y| by Sterbenz's lemma, |z - y| a power of two, u |z - y| a 24-bit number
  times a power of two), and the cast is IEEE round-to-nearest on every backend (numpy's in the
  Triton interpreter, cvt.rn on a GPU). Overflow (|x| beyond 65504) behaves as round to nearest.
Why not one rule for both: the float16 rule needs the float -> bfloat16 cast to round to nearest,
and Triton's interpreter truncates it (the tests run Triton there); bfloat16 is the upper half of
a float32, so its rule needs no cast at all. The Triton kernel (kernels/scatter_update.py) repeats
both in-kernel and writes the same bits as this reference on the same x.

Why a hash and not a generator: the random number of an element is a pure function of (seed, step,
row key, column). The trainer passes the training step and a row key that does not depend on the
world size (the row's flat id, trainer/sparse/embedding/sharding.py), so a row is rounded the same way
by its owner at any W, by a replica of it, by a worker it is lent to and by the single-process
reference: runs stay reproducible and W-independent, and no generator state needs checkpointing.
The hash is 32-bit integer arithmetic (Chris Wellons' lowbias32 finaliser) that torch emulates in
int64 with masks and Triton runs in uint32, so both give the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

HALF_DTYPES = (torch.float16, torch.bfloat16)
MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_GOLDEN = 0x9E3779B9  # odd constant separating the hash's inputs


@dataclass(frozen=True)
class StochasticRounding:
    """How row_update writes half-precision rows: `salt` (32 bits, from the seed and the step:
    salt_of; a Python int, or a one-element int64 tensor on the rows' device holding it, which a
    CUDA graph reads at each replay) and one int64 key per entry of the update's `rows` (entries of
    one storage row share it); keys live on the rows' device."""

    salt: int | Tensor
    keys: Tensor


def mix32(x: int) -> int:
    """lowbias32 on a Python int (the host part of the hash: seed and step)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def salt_of(seed: int, step: int) -> int:
    """The 32-bit salt of the updates of training step `step` in a run seeded `seed`."""
    h = mix32((seed & MASK32) ^ _GOLDEN)
    h = mix32(h ^ ((seed >> 32) & MASK32))
    h = mix32(h ^ (step & MASK32))
    return mix32(h ^ ((step >> 32) & MASK32) ^ _GOLDEN)


def _mix_t(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding uint32 values (every product masked back to 32 bits: the
    low 32 bits of an int64 product are those of the uint32 product, wrapped or not)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def random_bits(salt: int | Tensor, keys: Tensor, dim: int) -> Tensor:
    """[n, dim] int64 holding 32 random bits: those of column c of the row with key keys[i]
    (salt: an int, or a one-element int64 tensor holding it)."""
    k = keys.long()
    if isinstance(salt, Tensor):
        salt = salt.reshape(())
    h = _mix_t((k & MASK32) ^ salt)
    h = _mix_t(h ^ ((k >> 32) & MASK32) ^ _GOLDEN)
    cols = torch.arange(dim, dtype=torch.int64, device=keys.device)
    return _mix_t((h[:, None] + cols[None, :] * _GOLDEN) & MASK32)


def round_stochastic(x: Tensor, dtype: torch.dtype, bits: Tensor) -> Tensor:
    """x [n, d] float32 -> dtype (float16 | bfloat16) by the rule of the module doc, with the
    random bits [n, d] of random_bits."""
    if dtype == torch.bfloat16:
        # on x's bits as int32: the add never overflows but for NaNs (replaced below), and the
        # arithmetic shift of a negative x leaves the same low 16 bits as a logical one would
        kept = ((x.view(torch.int32) + (bits >> 16).to(torch.int32)) >> 16).to(torch.int16)
        return torch.where(torch.isnan(x), 0x7FC0, kept).view(torch.bfloat16)
    u = (bits >> 8).to(torch.float32) * (2.0 ** -24)
    y = x.to(dtype)
    yf = y.float()
    toward = torch.where(x.abs() > yf.abs(), 1, -1).to(torch.int16)
    z = (y.view(torch.int16) + toward).view(dtype)
    # False where x == y; and where y is inf or nan (inf * u is inf or nan, never below |x - y|),
    # or z is inf (y is the largest finite value): overflow behaves as round to nearest
    take_z = u * (z.float() - yf).abs() < (x - yf).abs()
    return torch.where(take_z, z, y)


def round_rows(x: Tensor, dtype: torch.dtype, rounding: StochasticRounding | None,
               keys: Tensor | None = None) -> Tensor:
    """Updated rows x [n, d] (float32) as `dtype`: stochastic when `rounding` is given and dtype is
    half (keys [n]: the rows' keys, default rounding.keys), else round to nearest (a plain cast)."""
    if rounding is None or dtype not in HALF_DTYPES:
        return x.to(dtype)
    keys = rounding.keys if keys is None else keys
    return round_stochastic(x.float(), dtype, random_bits(rounding.salt, keys, x.shape[1]))
