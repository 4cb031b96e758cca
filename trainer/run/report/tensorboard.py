"""TensorBoard's event files (train.tensorboard): the scalars of metrics.jsonl's lines, the cache's
staleness histogram, eval AUC / logloss, in OUT/tensorboard/."""
from __future__ import annotations

import sys
import threading
from typing import Any, Optional

import numpy as np

from ...sparse.embedding.cache.consistency import HIST_BINS

class TensorBoardWriter:
    """train.tensorboard: scalars beside metrics.jsonl (loss, samples/s, bytes per kind, cache hit
    rate, staleness histogram, eval AUC / logloss), in OUT/tensorboard/.

    Like the metrics log it never ends a run: TensorBoard's writer thread keeps a write error (a
    full disk) and raises it at the next call; then one warning goes to stderr and the event file
    is left as it is (later scalars are dropped)."""

    def __init__(self, log_dir: Optional[str]) -> None:
        self._w, self.error = None, None
        self.log_dir = log_dir
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter
            _quiet_tensorboard_thread()
            try:
                self._w = SummaryWriter(log_dir=log_dir)
            except OSError as exc:
                self._fail(exc)

    def step(self, rec: dict[str, Any]) -> None:
        if self._w is not None:
            self._guard(self._step, rec)

    def _step(self, rec: dict[str, Any]) -> None:
        s = rec["step"]
        if rec.get("loss") is not None:
            self._w.add_scalar("train/loss", rec["loss"], s)
        self._w.add_scalar("train/samples_per_sec", rec["samples_per_sec"], s)
        for kind, n in rec["bytes"].items():
            self._w.add_scalar(f"bytes/{kind}", n, s)
        cache = rec.get("cache")
        if cache is not None:
            self._w.add_scalar("cache/hit_rate", cache["hit_rate"], s)
            self._w.add_scalar("cache/fresh_hit_rate", cache["fresh_hit_rate"], s)
            self._w.add_scalar("cache/max_staleness", cache["staleness"]["max"], s)
            hist = cache["staleness"]["hist"]
            if hist:  # read staleness of every cached read so far, as a histogram
                self._w.add_histogram_raw("cache/staleness", **staleness_histogram(hist), global_step=s)
        dyn = rec.get("dynamic")
        if dyn is not None:  # dynamic tables: totals over tables and owners so far
            for key in DYNAMIC_SCALARS:
                self._w.add_scalar(f"dynamic/{key}", dyn[key], s)

    def eval(self, step: int, ev: dict[str, Any]) -> None:
        if self._w is not None:
            self._guard(self._eval, step, ev)

    def _eval(self, step: int, ev: dict[str, Any]) -> None:
        group = "eval" if ev.get("split", "test") == "test" else ev["split"]  # val/auc: the validation split
        for key in ("eval_auc", "eval_logloss"):
            if ev.get(key) is not None:
                self._w.add_scalar(f"{group}/{key[5:]}", ev[key], step)

    def close(self) -> None:
        if self._w is not None:
            self._guard(self._w.close)
            self._w = None

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        w, self._w = self._w, None
        if w is not None:
            try:
                w.close()
            except OSError:
                pass
        print(f"[trainer] warning: TensorBoard events in {self.log_dir} stop here ({exc}); training "
              "goes on (metrics.jsonl has the same figures)", file=sys.stderr)


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread stores a write error for the next call and then re-raises it,
    so Python's thread hook would also print it as a traceback. TensorBoardWriter reports that
    error itself (one warning), so an OSError ending that thread is not printed again; every
    other thread error still goes to the previous hook."""
    prev = threading.excepthook
    if getattr(prev, "quiets_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and args.exc_type is not None \
                and issubclass(args.exc_type, OSError):
            return
        prev(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _bin_value(key: str) -> int:
    return int(key[2:]) if key.startswith(">=") else int(key)


def staleness_histogram(hist: dict[str, int]) -> dict[str, Any]:
    """add_histogram_raw's fields for the staleness counts {bin: reads} (bins 0 .. HIST_BINS - 1,
    the last one ">=64"), computed from the counts: the same proto add_histogram would build from
    one value per read (each bin's reads at its staleness, bins of width 1 centred on it,
    TensorBoard's trimming to the bins with reads and one empty bin to their left), in O(bins)
    instead of O(reads so far), which grew with every step."""
    counts = np.zeros(HIST_BINS, np.int64)
    for k, n in hist.items():
        counts[_bin_value(k)] += n
    limits = np.arange(HIST_BINS + 1) - 0.5
    used = np.flatnonzero(counts)
    start, end = int(used[0]), int(used[-1]) + 1
    kept = counts[start - 1:end] if start > 0 else np.concatenate([[0], counts[:end]])
    v = np.arange(HIST_BINS, dtype=np.float64)
    return {"min": float(start), "max": float(end - 1), "num": int(counts.sum()),
            "sum": float(counts @ v), "sum_squares": float(counts @ (v * v)),
            "bucket_limits": limits[start:end + 1].tolist(), "bucket_counts": kept.tolist()}


DYNAMIC_SCALARS = ("rows_in_use", "admissions", "evictions", "dropped_grads", "rejected", "pending_ids",
                   "admission_bytes")
