"""Made-up Criteo-format files: the suite's, the benchmarks' and the docs' examples' stand-in for
Criteo's data, which its terms forbid us to redistribute.

Each row is what Criteo's Kaggle and Terabyte files hold: a 0/1 label, 13 integer fields and 26
categorical fields of 8 hex digits, tab-separated, any feature possibly empty. The columns are
shaped like Criteo's (what its public statistics say; nothing is copied from its rows):
- integer fields are counts with a heavy tail (a log-normal, rounded), some fields mostly empty,
  one of them with small negative values (Criteo's I2 holds -1, -2, -3);
- categorical fields draw from vocabularies of 2 to 10^7 values with a Zipf-like skew (a few
  values take most rows, most values are seen once), some fields empty in a large share of rows;
- the label depends on a few fields (a logistic model over 5 categorical and 5 integer fields)
  with about a fifth of rows positive, so a model has something to learn: logistic regression
  reaches an AUC of about 0.77 on 1,600 rows (about 0.70 on as many of Criteo's).

The rows are a pure function of (row count, seed), made from integer hashes (numpy's log / exp
decide the counts, so another platform's libm could move a rare value by one). Row i is the same
whatever the count, so a shorter file is a prefix of a longer one.

    python -m dev.criteo_file --rows 100000 --out day_0.gz   # .gz: gzip-compressed
"""
from __future__ import annotations

import argparse
import functools
import gzip
import sys

import numpy as np

from trainer.workload.data.criteo import NUM_CAT, NUM_DENSE, splitmix64
from trainer.tools.cli import bad_input

# integer fields: (share empty, median of the count, spread of log(count)); I2 may be negative
DENSE = [(0.44, 1, 1.2), (0.0, 3, 2.0), (0.22, 6, 1.8), (0.21, 4, 1.0), (0.05, 2500, 2.2),
         (0.25, 40, 1.8), (0.05, 3, 1.6), (0.0, 8, 1.0), (0.05, 40, 1.5), (0.44, 1, 0.6),
         (0.05, 1, 1.0), (0.77, 1, 1.5), (0.21, 5, 1.4)]
NEGATIVE_FIELD = 1  # I2
# categorical fields: (share empty, vocabulary size, skew: 1 = log-uniform ranks, larger = more skewed)
CATEGORICAL = [(0.0, 1_460, 2.0), (0.0, 583, 1.3), (0.03, 10_000_000, 1.0), (0.03, 2_200_000, 1.0),
               (0.0, 305, 2.0), (0.13, 24, 2.5), (0.0, 12_517, 1.2), (0.0, 633, 2.0), (0.0, 3, 3.0),
               (0.0, 93_145, 1.2), (0.0, 5_683, 1.1), (0.03, 8_350_000, 1.0), (0.0, 3_194, 1.1),
               (0.0, 27, 2.0), (0.0, 14_992, 1.1), (0.03, 5_460_000, 1.0), (0.0, 10, 2.5),
               (0.0, 5_652, 1.2), (0.48, 2_173, 1.3), (0.48, 4, 2.5), (0.03, 7_046_547, 1.0),
               (0.82, 18, 2.0), (0.0, 15, 2.0), (0.03, 286_181, 1.0), (0.48, 105, 1.8),
               (0.48, 142_572, 1.0)]
# the label's logistic model: weights of categorical fields' value effects and of integer fields
CAT_WEIGHT = {5: 1.2, 8: 0.8, 13: 1.0, 16: 1.2, 22: 0.9}
DENSE_WEIGHT = {0: 0.9, 4: -0.3, 6: -0.6, 10: 0.8, 12: 0.3}
BIAS = -0.35
_STREAMS = 1 + NUM_DENSE + NUM_CAT  # one uniform per field and row, plus the label's


def _uniform(seed: int, rows: np.ndarray, stream: int) -> np.ndarray:
    """Uniforms in [0, 1) that depend only on (seed, row, stream): rows are independent of the count."""
    key = splitmix64(np.uint64(seed) * np.uint64(_STREAMS + 1) + np.uint64(stream) + np.uint64(1))
    with np.errstate(over="ignore"):
        words = splitmix64(rows.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ key)
    return (words >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _normal(seed: int, rows: np.ndarray, stream: int) -> np.ndarray:
    u1 = _uniform(seed, rows, stream)
    u2 = _uniform(seed + 7919, rows, stream)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)


def _effect(t: int, rank: np.ndarray) -> np.ndarray:
    """A categorical value's effect on the label, in [-1, 1): fixed per (field, value)."""
    h = splitmix64(rank.astype(np.uint64) ^ np.uint64((t + 1) * 0x5851F42D4C957F2D & ((1 << 64) - 1)))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 52) - 1.0


def columns(n: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(labels [n], 13 integer columns (int64; empty = a masked entry), 26 categorical columns
    (uint64 values; empty = a masked entry)) as numpy masked arrays."""
    rows = np.arange(n, dtype=np.int64)
    score = np.full(n, BIAS)
    dense = []
    for i, (empty, median, spread) in enumerate(DENSE):
        u = _uniform(seed, rows, 1 + i)
        x = np.floor(np.maximum(median, 0.5) * np.exp(spread * _normal(seed, rows, 1 + i)) - 0.5 * (median == 0))
        x = np.maximum(x, 0).astype(np.int64)
        if i == NEGATIVE_FIELD:
            x = np.where(u < 0.04, -1 - (rows % 3), x)
        mask = u >= 1.0 - empty
        if i in DENSE_WEIGHT:
            score += DENSE_WEIGHT[i] * np.where(mask, 0.0, np.log1p(np.maximum(x, 0)) - np.log1p(median))
        dense.append(np.ma.masked_array(x, mask))
    cats = []
    for t, (empty, vocab, skew) in enumerate(CATEGORICAL):
        u = _uniform(seed, rows, 1 + NUM_DENSE + t)
        mask = u >= 1.0 - empty
        v = np.minimum(u / max(1.0 - empty, 1e-12), np.nextafter(1.0, 0.0))  # uniform again, given not empty
        rank = np.minimum(np.floor(np.expm1(v ** skew * np.log1p(vocab))), vocab - 1).astype(np.int64)
        if t in CAT_WEIGHT:
            score += CAT_WEIGHT[t] * np.where(mask, 0.0, _effect(t, rank))
        value = splitmix64(rank.astype(np.uint64) + np.uint64(t << 40)) & np.uint64(0xFFFFFFFF)
        cats.append(np.ma.masked_array(value, mask))
    labels = (_uniform(seed, rows, 0) < 1.0 / (1.0 + np.exp(-score))).astype(np.int64)
    return labels, dense, cats


@functools.lru_cache(maxsize=8)
def lines(n: int, seed: int = 0) -> tuple[str, ...]:
    """n rows of Criteo's TSV format, each with its newline."""
    labels, dense, cats = columns(n, seed)
    fields = [labels.astype(str)]
    fields += [np.where(c.mask, "", c.data.astype(str)) for c in dense]
    fields += [np.where(c.mask, "", np.char.zfill(np.char.lower(np.char.mod("%x", c.data.astype(np.int64))), 8))
               for c in cats]
    table = np.stack(fields, axis=1)
    return tuple("\t".join(r) + "\n" for r in table.tolist())


def write(path: str, n: int, seed: int = 0, first: int = 0) -> str:
    """Rows [first, first + n) of the seed's file into `path` (gzip-compressed when it ends in .gz)."""
    text = "".join(lines(first + n, seed)[first:])
    if path.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dev.criteo_file", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1999, help="rows to write (default 1,999)")
    p.add_argument("--seed", type=int, default=0, help="another seed, another file (default 0: the suite's)")
    p.add_argument("--out", required=True, help="the file to write (.gz: gzip-compressed)")
    a = p.parse_args(argv)
    if a.rows <= 0:
        return bad_input(ValueError(f"--rows {a.rows}: must be > 0"))
    write(a.out, a.rows, a.seed)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
