"""Criteo raw TSV rows -> validated, encoded blocks; the on-disk format and its metadata.

Why vectorised: Criteo Kaggle is 45M rows and Terabyte 4B; a per-field Python parser runs at a few
MB/s per core. Here a chunk of text is parsed with numpy over byte positions (tabs, newlines, one
digit position at a time over all fields at once), which validates every field as it converts it.

Row format: label, 13 integer fields, 26 hex categorical fields, tab-separated; any of the 39
features may be empty. A row is bad when it has the wrong field count, a label other than 0/1, a
dense field that is not a (signed) integer of at most 18 digits (longer ones are reported as out of
range) or a categorical field that is not hex (<= 16 digits).

Encoding (the rule is written into meta.json):
- dense: log(1 + max(x, 0)) as float32, missing -> 0.
- categorical, `hash` mode: id = 0 when empty, else 1 + splitmix64(value ^ salt_t) mod (rows_t - 1).
- categorical, `vocab` mode: id = 0 when empty, 1 when the value was seen fewer than min_count
  times in the training files (out of vocabulary), else 2 + its rank in the sorted vocabulary.
- categorical, `raw` mode (for embedding.kind=dynamic): id = the value's 32 bits (Criteo's values
  are 8 hex digits; a wider one keeps its low 32 bits), 0 when empty (a value 00000000 would share
  it); stored in the int32 column as its bit pattern, read back as unsigned (raw_ids).

Block format: one .npy file per block, int32 [n, 1 + 13 + 26]: column 0 the label, columns 1..13 the
dense float32 values stored bit-for-bit (numpy .view), columns 14..39 the ids. One array per block
lets DALI's numpy reader deliver a whole block as one sample (trainer/workload/data/dali.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels import SPLITMIX_GAMMA, splitmix

NUM_DENSE, NUM_CAT = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CAT
WIDTH = NUM_FIELDS  # int32 columns of a block
EMPTY_ID, OOV_ID = 0, 1
RAW_ROWS = 1 << 32  # raw mode: ids are 32-bit values
FORMAT = "criteo-blocks-v1"
META = "meta.json"
MAX_INT_DIGITS, MAX_HEX_DIGITS = 18, 16

# reasons of bad rows, in the order they are checked
FIELD_COUNT, BAD_LABEL, BAD_DENSE, BAD_CAT = "field_count", "label", "dense", "categorical"
REASONS = (FIELD_COUNT, BAD_LABEL, BAD_DENSE, BAD_CAT)

_HEX = np.full(256, -1, dtype=np.int64)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


class CriteoFormatError(ValueError):
    """A bad row under --strict, or a malformed prepared directory; the message says where."""


@dataclass
class Parsed:
    """A parsed chunk: the good rows (in order) and where the bad ones were."""

    labels: np.ndarray  # [n] int32 in {0, 1}
    dense: np.ndarray  # [n, 13] float32, already log(1 + max(x, 0)); missing -> 0
    cats: np.ndarray  # [n, 26] uint64 raw hex values
    empty: np.ndarray  # [n, 26] bool, True where the categorical field was empty
    bad_lines: np.ndarray  # [k] int64 0-based line index within the chunk, ascending
    bad_reasons: list[str] = field(default_factory=list)  # [k] human-readable reason per bad line
    num_lines: int = 0


# ---- vectorised field parsers --------------------------------------------------------------
def _parse_int(a: np.ndarray, start: np.ndarray, length: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Signed decimal integers at a[start : start + length] ([m] each) -> (int64 values, ok,
    too_long): too_long marks integers of more than MAX_INT_DIGITS digits (not ok either: out of
    int64's safe range), so they are reported as such rather than as non-integers."""
    neg = (length > 0) & (a[start] == ord("-"))
    s, n = start + neg, length - neg
    ok = (n > 0) & (n <= MAX_INT_DIGITS)
    val = np.zeros(start.size, np.int64)
    for p in range(int(min(n.max(initial=0), MAX_INT_DIGITS))):
        act = p < n
        d = a[np.minimum(s + p, a.size - 1)].astype(np.int64) - ord("0")
        ok &= ~act | ((d >= 0) & (d <= 9))
        val = np.where(act, val * 10 + d, val)
    too_long = np.zeros(start.size, bool)
    for i in np.flatnonzero(n > MAX_INT_DIGITS):  # rare: one field at a time
        digits = a[s[i]:s[i] + n[i]]
        too_long[i] = bool(((digits >= ord("0")) & (digits <= ord("9"))).all())
    return np.where(neg, -val, val), ok, too_long


def _parse_hex(a: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex numbers at a[start : start + length] -> (uint64 values, ok); length 0 is not ok."""
    ok = (length > 0) & (length <= MAX_HEX_DIGITS)
    val = np.zeros(start.size, np.uint64)
    for p in range(int(min(length.max(initial=0), MAX_HEX_DIGITS))):
        act = p < length
        d = _HEX[a[np.minimum(start + p, a.size - 1)]]
        ok &= ~act | (d >= 0)
        val = np.where(act, (val << np.uint64(4)) | d.clip(min=0).astype(np.uint64), val)
    return val, ok


def _line_bounds(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[L] start and end (exclusive, before any '\\r') of every line; a ends with a newline."""
    nl = np.flatnonzero(a == 10)
    starts = np.concatenate([[0], nl[:-1] + 1]).astype(np.int64)
    ends = nl.astype(np.int64)
    cr = (ends > starts) & (a[np.maximum(ends - 1, 0)] == 13)
    return starts, ends - cr


def _field_bounds(tabs: np.ndarray, first_tab: np.ndarray, starts: np.ndarray,
                  ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 40] start and length of every field of rows that have exactly 39 tabs."""
    tpos = tabs[first_tab[:, None] + np.arange(NUM_FIELDS - 1)[None, :]]
    fstart = np.concatenate([starts[:, None], tpos + 1], axis=1)
    fend = np.concatenate([tpos, ends[:, None]], axis=1)
    return fstart, fend - fstart


def _reason(code: int, col: int, nfields: int) -> str:
    if code == 0:
        return f"{FIELD_COUNT}: expected {NUM_FIELDS} tab-separated fields, got {nfields}"
    if code == 1:
        return f"{BAD_LABEL}: label must be 0 or 1"
    if code == 2:
        return f"{BAD_DENSE}: field I{col} is not an integer"
    if code == 4:
        return f"{BAD_DENSE}: field I{col} is an integer of more than {MAX_INT_DIGITS} digits (out of range)"
    return f"{BAD_CAT}: field C{col} is not hex"


def parse_chunk(buf: bytes) -> Parsed:
    """Parse and validate whole lines of Criteo TSV (a final newline is optional)."""
    a = np.frombuffer(buf, np.uint8)
    if a.size == 0:
        return Parsed(np.zeros(0, np.int32), np.zeros((0, NUM_DENSE), np.float32),
                      np.zeros((0, NUM_CAT), np.uint64), np.zeros((0, NUM_CAT), bool),
                      np.zeros(0, np.int64))
    if a[-1] != 10:
        a = np.append(a, np.uint8(10))
    starts, ends = _line_bounds(a)
    tabs = np.flatnonzero(a == 9)
    first_tab = np.searchsorted(tabs, starts)
    ntabs = np.searchsorted(tabs, ends) - first_tab
    code = np.where(ntabs == NUM_FIELDS - 1, -1, 0)  # -1 = good so far
    col = np.zeros(starts.size, np.int64)
    rows = np.flatnonzero(code < 0)
    fstart, flen = _field_bounds(tabs, first_tab[rows], starts[rows], ends[rows])
    label_ok = (flen[:, 0] == 1) & ((a[fstart[:, 0]] == ord("0")) | (a[fstart[:, 0]] == ord("1")))
    dense, dense_ok, too_long = _parse_int(a, fstart[:, 1:14].ravel(), flen[:, 1:14].ravel())
    dense_ok = (dense_ok | (flen[:, 1:14].ravel() == 0)).reshape(-1, NUM_DENSE)
    too_long = too_long.reshape(-1, NUM_DENSE)
    cats, cat_ok = _parse_hex(a, fstart[:, 14:].ravel(), flen[:, 14:].ravel())
    empty = flen[:, 14:] == 0
    cat_ok = cat_ok.reshape(-1, NUM_CAT) | empty
    for c, ok in ((3, cat_ok), (2, dense_ok)):  # reverse order: the earliest check wins
        bad = ~ok.all(axis=1)
        code[rows[bad]], col[rows[bad]] = c, ok[bad].argmin(axis=1) + 1
    long_ = np.flatnonzero(code[rows] == 2)  # the first bad dense field is a too-long integer
    long_ = long_[too_long[long_, col[rows[long_]] - 1]]
    code[rows[long_]] = 4
    code[rows[~label_ok]] = 1
    good = code[rows] < 0
    x = np.where(flen[:, 1:14] == 0, 0, dense.reshape(-1, NUM_DENSE))[good]
    bad_lines = np.flatnonzero(code >= 0)
    return Parsed(
        labels=(a[fstart[good, 0]] == ord("1")).astype(np.int32),
        dense=np.log1p(np.maximum(x, 0).astype(np.float64)).astype(np.float32),
        cats=cats.reshape(-1, NUM_CAT)[good], empty=empty[good], bad_lines=bad_lines,
        bad_reasons=[_reason(int(code[i]), int(col[i]), int(ntabs[i]) + 1) for i in bad_lines],
        num_lines=int(starts.size))


def parse_line(line: str) -> tuple[int, list[float], list[int | None]]:
    """One row parsed the plain way (the reference the vectorised parser is tested against):
    (label, 13 transformed dense values, 26 raw categorical values or None when empty)."""
    f = line.rstrip("\r\n").split("\t")
    if len(f) != NUM_FIELDS or f[0] not in ("0", "1"):
        raise CriteoFormatError(f"bad row: {line!r}")
    dense = [float(np.float32(np.log1p(max(int(x), 0)))) if x else 0.0 for x in f[1:14]]
    return int(f[0]), dense, [int(x, 16) if x else None for x in f[14:]]


# ---- categorical encoding -------------------------------------------------------------------
def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a fast, well-mixed 64-bit hash (uint64 -> uint64)."""
    with np.errstate(over="ignore"):
        return splitmix(x + SPLITMIX_GAMMA)


def table_salt(t: int) -> np.uint64:
    """Per-table salt, so equal values in different tables hash independently."""
    return splitmix64(np.asarray([t + 1], np.uint64))[0]


@dataclass
class Encoder:
    """Maps raw categorical values to row ids, by hashing or by a min_count vocabulary."""

    kind: str  # hash | vocab
    rows: list[int]  # [26] rows per table, including the reserved ids
    vocab: list[np.ndarray] | None = None  # vocab mode: [26] sorted uint64 kept values
    min_count: int = 0

    @classmethod
    def hashing(cls, rows: list[int]) -> "Encoder":
        if len(rows) != NUM_CAT or min(rows) < 2:
            raise ValueError(f"hash rows must be {NUM_CAT} values >= 2, got {rows}")
        return cls("hash", list(rows))

    @classmethod
    def raw(cls) -> "Encoder":
        return cls("raw", [RAW_ROWS] * NUM_CAT)

    @classmethod
    def from_vocab(cls, vocab: list[np.ndarray], min_count: int) -> "Encoder":
        return cls("vocab", [2 + v.size for v in vocab], vocab, min_count)

    def encode(self, cats: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """[n, 26] uint64 values + empty mask -> [n, 26] int32 ids."""
        out = np.empty(cats.shape, np.int32)
        for t in range(NUM_CAT):
            out[:, t] = self._encode_table(t, cats[:, t])
        out[empty] = EMPTY_ID
        return out

    def _encode_table(self, t: int, v: np.ndarray) -> np.ndarray:
        if self.kind == "raw":  # the 32 bits as the int32 column's bit pattern
            return (v & np.uint64(RAW_ROWS - 1)).astype(np.uint32).view(np.int32)
        if self.kind == "hash":
            return 1 + (splitmix64(v ^ table_salt(t)) % np.uint64(self.rows[t] - 1)).astype(np.int64)
        keys = self.vocab[t]
        if keys.size == 0:
            return np.full(v.size, OOV_ID, np.int64)
        pos = np.searchsorted(keys, v).clip(max=keys.size - 1)
        return np.where(keys[pos] == v, 2 + pos, OOV_ID)

    def rule(self) -> dict[str, Any]:
        """The encoding rule as written into meta.json."""
        if self.kind == "hash":
            return {"kind": "hash", "empty_id": EMPTY_ID,
                    "rule": "id = 0 if empty else 1 + splitmix64(value ^ splitmix64(t + 1)) mod (rows_t - 1)",
                    "hash_rows": self.rows}
        if self.kind == "raw":
            return {"kind": "raw", "empty_id": EMPTY_ID,
                    "rule": "id = the value's low 32 bits, unsigned (stored as int32 bits); 0 if empty"}
        return {"kind": "vocab", "empty_id": EMPTY_ID, "oov_id": OOV_ID, "min_count": self.min_count,
                "rule": "id = 0 if empty, 1 if seen < min_count times in train, else 2 + rank in sorted vocab",
                "vocab_sizes": [int(v.size) for v in self.vocab]}

    def signature(self) -> dict[str, Any]:
        """What must match for a resumed run to reuse finished files."""
        return {"kind": self.kind, "rows": self.rows, "min_count": self.min_count}


def raw_ids(meta: dict[str, Any]) -> bool:
    """The directory keeps raw 32-bit values as ids (prepare_criteo.py --raw-ids): its int32 id
    columns are read as unsigned."""
    return meta.get("categorical", {}).get("kind") == "raw"


def to_block(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Good rows -> one int32 [n, 40] block (dense stored bit-for-bit)."""
    block = np.empty((labels.size, WIDTH), np.int32)
    block[:, 0] = labels
    block[:, 1:1 + NUM_DENSE] = np.ascontiguousarray(dense, np.float32).view(np.int32)
    block[:, 1 + NUM_DENSE:] = ids
    return block


def from_block(block: np.ndarray, num_dense: int = NUM_DENSE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int32 [n, 1 + F + T] block -> (labels [n] float32, dense [n, F] float32, ids [n, T] int64)."""
    labels = block[:, 0].astype(np.float32)
    dense = np.ascontiguousarray(block[:, 1:1 + num_dense]).view(np.float32)
    return labels, dense, block[:, 1 + num_dense:].astype(np.int64)


def check_block(path: str, rows: int, width: int = WIDTH) -> str | None:
    """Why block file `path` cannot give `rows` rows of `width` int32 columns (missing, not an
    .npy, another shape, or shorter than its header says: truncated), or None when it can. Reads
    the .npy header only."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            offset, size = f.tell(), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError) as exc:
        return f"is not a readable .npy block ({exc})"
    if dtype != np.int32 or fortran or len(shape) != 2 or shape[1] != width or shape[0] < rows:
        return f"holds {dtype} {list(shape)}, expected int32 [>= {rows}, {width}]"
    want = offset + shape[0] * shape[1] * 4
    if size < want:
        return f"is truncated ({size} bytes, its header needs {want})"
    return None


# ---- metadata ---------------------------------------------------------------------------------
def read_meta(directory: str) -> dict[str, Any]:
    """meta.json of a prepared directory, checked for the keys the trainer needs."""
    path = os.path.join(directory, META)
    if not os.path.isdir(directory):
        raise CriteoFormatError(f"{directory!r} is not a directory")
    if not os.path.exists(path):
        raise CriteoFormatError(f"{path} is missing: prepare the directory first "
                                f"(scripts/prepare_criteo.py --train FILE --out {directory})")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CriteoFormatError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    for key in ("num_dense", "table_rows", "splits"):
        if key not in meta:
            raise CriteoFormatError(f"{path}: no {key!r} entry")
    return meta
