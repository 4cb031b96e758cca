"""A checkpoint's shards merged into one row-major file per table, in the order of the table's ids.

Where a row is: rank r of the saving W owns ids r + qW of every table, and its shard's weight.bin
holds the tables one after the other, each in the bit-reversed order of q
(trainer/run/checkpoint/row_order.py). So table t's rows come from every shard's segment of it.

Memory: the output is built in windows of ids [a, b) of at most `window_bytes` of rows; for each
window every shard's segment is read in sequential pieces (each verified against the checkpoint's
block hashes as it is read) and the rows whose ids fall in the window are kept. A table that fits
the window (the default 1 GiB: 16M rows at d = 16) is one pass over its rows; a bigger one is one
pass per window, so peak memory is one window plus one piece, whatever the model's size.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import numpy as np
import torch

from ..run.checkpoint.row_order import q_in_order
from ..run.checkpoint.shard_io import PIECE_BYTES, VerifiedFile, saved_dtype, shard_dir
from ..sparse.embedding.sharding import rows_on_rank

WINDOW_BYTES = 1 << 30



ROWS_AS = ("saved", "fp16", "int8")  # export --rows: as trained, half floats, or row-wise 8-bit codes


def merge_table(ckpt: str, manifest: dict[str, Any], t: int, out_path: str, window_bytes: int = WINDOW_BYTES,
                rows_as: str = "saved", progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Table t of checkpoint ckpt into the .npy file out_path ([rows_t, d], row i = id i); returns
    its manifest entry {"rows", "width", "dtype"[, "qparams"]}. rows_as: the rows as saved, as
    float16 (round to nearest), or int8 (row-wise: codes 0..255 in out_path, uint8, and each
    row's (scale, bias) float32 in out_path's `.qparams.npy` twin: value = code x scale + bias, as
    inference systems store tables; quantize_rows). progress(rows) is called after each window."""
    world, table_rows = int(manifest["world_size"]), [int(n) for n in manifest["table_rows"]]
    info0 = manifest["shards"][shard_dir(0, world)]["fields"]["weight"]
    width, dtype = int(info0["width"]), saved_dtype(info0)
    file_dtype = np.dtype(info0["dtype"])
    rows = table_rows[t]
    row_bytes = width * file_dtype.itemsize
    out_dtype = {"saved": file_dtype, "fp16": np.dtype("<f2"), "int8": np.dtype("u1")}[rows_as]
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=out_dtype, shape=(rows, width))
    qpath = out_path[:-len(".npy")] + ".qparams.npy"
    qparams = np.lib.format.open_memmap(qpath, mode="w+", dtype=np.float32, shape=(rows, 2)) \
        if rows_as == "int8" else None
    per_window = max(1, window_bytes // row_bytes)
    per_piece = max(1, PIECE_BYTES // row_bytes)
    counter = {"bytes_read": 0}
    files = {}
    try:
        for r in range(world):
            name = shard_dir(r, world)
            files[r] = VerifiedFile(os.path.join(ckpt, name, "weight.bin"),
                                    manifest["shards"][name]["fields"]["weight"], counter)
        for a in range(0, rows, per_window):
            b = min(rows, a + per_window)
            window = np.zeros((b - a, width), file_dtype)
            for r in range(world):
                n = rows_on_rank(rows, r, world)
                first = sum(rows_on_rank(table_rows[u], r, world) for u in range(t))  # the segment's first row
                lo_q, hi_q = max(0, -(-(a - r) // world)), max(0, -(-(b - r) // world))
                if lo_q >= min(hi_q, n):
                    continue
                for start in range(0, n, per_piece):
                    count = min(per_piece, n - start)
                    q = q_in_order(n, start, count)
                    keep = (q >= lo_q) & (q < hi_q)
                    if not keep.any():
                        continue
                    lo = (first + start) * row_bytes
                    raw = np.frombuffer(files[r].read(lo, lo + count * row_bytes), file_dtype).reshape(count, width)
                    window[r + q[keep] * world - a] = raw[keep]
            if rows_as == "saved":
                out[a:b] = window
            else:
                values = _as_tensor(window, dtype).float()
                if rows_as == "fp16":
                    out[a:b] = values.half().numpy()
                else:
                    codes, qp = quantize_rows(values)
                    out[a:b], qparams[a:b] = codes.numpy(), qp.numpy()
                    qparams.flush()
            out.flush()
            if progress is not None:
                progress(b)
    finally:
        for f in files.values():
            f.close()
        del out, qparams
    saved = str(dtype).removeprefix("torch.")
    entry = {"rows": rows, "width": width, "dtype": {"saved": saved, "fp16": "float16", "int8": "int8_rowwise"}[rows_as],
             "trained_dtype": saved}
    if rows_as == "int8":
        entry["qparams"] = os.path.basename(qpath)
    return entry


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise 8-bit codes of [n, d] float32 rows: (codes [n, d] uint8, [n, 2] (scale, bias)
    float32), bias = the row's least value, scale = its range / 255 (a constant row: scale 0,
    every code 0), code = round((value - bias) / scale): each value within scale / 2 of
    code x scale + bias."""
    lo, hi = values.min(1).values, values.max(1).values
    scale = (hi - lo) / 255.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((values - lo[:, None]) / safe[:, None]).clamp_(0, 255).to(torch.uint8)
    return codes, torch.stack([scale, lo], 1)


def _as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A table file's rows (numpy) as a tensor of their tensor dtype (bfloat16: viewed from its raw 2 bytes)."""
    with warnings.catch_warnings():  # torch warns of a read-only array (a mapping): nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class TableRows:
    """One table of an artifact, memory-mapped: rows(ids) -> [n, d] float32 (dequantized for
    int8 rows: code x scale + bias)."""

    def __init__(self, directory: str, entry: dict[str, Any]) -> None:
        self.table = load_table(os.path.join(directory, entry["file"]), entry["dtype"])
        q = entry.get("qparams")
        self.qparams = None if q is None else load_table(os.path.join(directory, os.path.dirname(entry["file"]), q),
                                                         "float32")

    @property
    def num_rows(self) -> int:
        return int(self.table.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        got = self.table.index_select(0, ids)
        if self.qparams is None:
            return got.to(torch.float32)
        qp = self.qparams.index_select(0, ids)
        return got.to(torch.float32) * qp[:, :1] + qp[:, 1:]


def load_table(path: str, dtype: str) -> torch.Tensor:
    """A table file, memory-mapped (read-only: nothing is read until used), as a [rows, d] tensor
    of its tensor dtype."""
    return _as_tensor(np.load(path, mmap_mode="r"), torch.bfloat16 if dtype == "bfloat16" else torch.float32)
