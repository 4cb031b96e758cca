"""The order of a table's rows in a checkpoint shard's files (shard_io.py writes and reads them in it).

Rank r of W owns the ids id = r + q W of every table (trainer/sparse/embedding/sharding.py), q
in [0, n_t). Its file holds the tables one after the other, and within table t the rows in the
order of the bit-reversed q (B bits, B = bit_length(n_t - 1)): j = 0, 1, ... 2^B - 1 gives
q = rev_B(j), skipping q >= n_t. Then the rows with q = c (mod 2^m) are one contiguous range for
every m (the m low bits of q are the m high bits of j). A reader at W' = 2^m W needs, from the one
shard r = r' mod W, exactly the rows with q = (r' - r) / W (mod 2^m): 1 / 2^m of that shard, in one
read per table, whose position is known in closed form (q_range, _count_before). At W' dividing W a reader
needs W / W' whole shards; at any other W' it reads the shards that share ids with it and keeps its
rows piece by piece (at most all of them).
"""
from __future__ import annotations

import numpy as np

_REV16 = np.zeros(1 << 16, dtype=np.int64)  # the 16 bits of each value, reversed
for _b in range(16):
    _REV16 |= ((np.arange(1 << 16, dtype=np.int64) >> _b) & 1) << (15 - _b)


def bit_reverse(j: np.ndarray, bits: int) -> np.ndarray:
    """The `bits` low bits of each j (int64, bits <= 48), reversed: three 16-bit table lookups."""
    j = np.asarray(j, dtype=np.int64)
    full = (_REV16[j & 0xFFFF] << 32) | (_REV16[(j >> 16) & 0xFFFF] << 16) | _REV16[(j >> 32) & 0xFFFF]
    return full >> (48 - bits) if bits else np.zeros_like(j)


def order_bits(n: int) -> int:
    return max(int(n - 1).bit_length(), 0) if n > 1 else 0


def q_range(n: int, m: int, c: int) -> tuple[int, int]:
    """[lo, hi) of the rows of a table segment of n rows whose q = c (mod 2^m), in file order: the
    positions j whose m high bits are rev_m(c mod 2^m) (when 2^m exceeds the segment's positions,
    the one candidate q = c at j = rev(c))."""
    bits = order_bits(n)
    if m <= bits:
        a = int(bit_reverse(np.array([c % (1 << m)], dtype=np.int64), m)[0])
        span = 1 << (bits - m)
        return _count_before(n, bits, a * span), _count_before(n, bits, (a + 1) * span)
    if c >= n:
        return 0, 0
    lo = _count_before(n, bits, int(bit_reverse(np.array([c], dtype=np.int64), bits)[0]))
    return lo, lo + 1


def q_in_order(n: int, start: int, count: int) -> np.ndarray:
    """The q of rows [start, start + count) of a table segment of n rows, in file order."""
    bits = order_bits(n)
    if bits == 0:
        return np.arange(n, dtype=np.int64)[start:start + count]
    out, pos = [], 0
    # walk j in windows; each window of 2^k positions yields at most 2^k rows
    window = max(1 << 16, count)
    j = first_j(n, bits, start)
    pos = start
    while pos < start + count:
        js = np.arange(j, min(j + window, 1 << bits), dtype=np.int64)
        q = bit_reverse(js, bits)
        q = q[q < n]
        take = q[: start + count - pos]
        out.append(take)
        pos += take.size
        j += js.size
        if js.size == 0:
            break
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def first_j(n: int, bits: int, start: int) -> int:
    """The smallest j whose rows before it number `start` (the j of file row `start`)."""
    lo, hi = 0, 1 << bits
    while lo < hi:  # rows_before(j) is non-decreasing in j
        mid = (lo + hi) // 2
        if _count_before(n, bits, mid) < start:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _count_before(n: int, bits: int, j: int) -> int:
    """#{j' < j : rev_bits(j') < n}: split j into its top bits one level at a time."""
    count, base = 0, 0
    for m in range(1, bits + 1):
        step = 1 << (bits - m)
        if j >= base + step:  # the whole half [base, base + step) comes before j
            a = base >> (bits - m)  # prefix of the half, m bits
            low = int(bit_reverse(np.array([a], np.int64), m)[0])
            count += int(np.clip(-(-(n - low) // (1 << m)), 0, step))
            base += step
    if base < j:  # j - base == 1 at the last level: position `base` itself
        count += int(bit_reverse(np.array([base], np.int64), bits)[0] < n)
    return count
