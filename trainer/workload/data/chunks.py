"""Criteo preprocessing's reading and parallel work (prepare.py runs the passes over them): raw
TSV (or .gz) files read in chunks of whole lines, each chunk parsed and encoded (or counted) in a
worker process that writes its block itself and returns only counts (ChunkStat), and the in-order
map over a pool with at most 2 tasks per worker in flight (bounded memory; results in order, so
bad-row line numbers are exact)."""
from __future__ import annotations

import gzip
import zlib
from collections import deque
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Callable, Iterator

import numpy as np

from ...base.core.atomic import replacing
from .criteo import NUM_CAT, REASONS, CriteoFormatError, Encoder, parse_chunk, to_block

KEEP_BAD = 20  # first bad rows kept (line numbers) per file and overall


@dataclass
class ChunkStat:
    """What a worker reports back for one chunk (no row data)."""

    lines: int
    rows: int
    positives: int
    bad: dict[str, int]  # reason -> count
    first_bad: list[tuple[int, str]]  # (0-based line in chunk, reason), at most KEEP_BAD


# ---- reading ----------------------------------------------------------------------------------
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, written by some editors and exporters


def iter_chunks(path: str, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(chunk of whole lines, compressed bytes read so far); .gz files are decompressed, and a
    UTF-8 byte order mark at the start of the text is dropped (row 1 is a row). A .gz file that is
    truncated, corrupt or not gzip at all raises CriteoFormatError naming it."""
    with open(path, "rb") as raw:
        src = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        first = True
        while True:
            try:
                buf = src.read(chunk_bytes)
                if buf and not buf.endswith(b"\n"):
                    buf += src.readline()
            except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
                raise CriteoFormatError(_gzip_problem(path, exc, raw.tell())) from exc
            if first and buf.startswith(BOM):
                buf = buf[len(BOM):]
            first = False
            if not buf:
                return
            yield buf, raw.tell()


def _gzip_problem(path: str, exc: BaseException, at: int) -> str:
    if isinstance(exc, EOFError):
        what = "is truncated (the compressed stream ends early)"
    elif isinstance(exc, gzip.BadGzipFile) and str(exc).startswith("Not a gzipped file"):
        what = "is not gzip data (plain text named .gz? rename it without .gz)"
    else:
        what = "holds corrupt gzip data"
    return f"{path} {what}, near compressed byte {at}: {exc}"


# ---- worker side --------------------------------------------------------------------------------
_ENCODER: Encoder | None = None


def _init_worker(encoder: Encoder | None) -> None:
    global _ENCODER
    _ENCODER = encoder


def _bad_stats(p: Any) -> tuple[dict[str, int], list[tuple[int, str]]]:
    kinds = [r.split(":", 1)[0] for r in p.bad_reasons]
    counts = {k: kinds.count(k) for k in REASONS if k in kinds}
    return counts, [(int(i), r) for i, r in zip(p.bad_lines[:KEEP_BAD], p.bad_reasons[:KEEP_BAD])]


def encode_task(args: tuple[bytes, str]) -> ChunkStat:
    """Parse + encode one chunk and write its block (atomically) to `path` if it has rows."""
    buf, path = args
    p = parse_chunk(buf)
    if p.labels.size:
        block = to_block(p.labels, p.dense, _ENCODER.encode(p.cats, p.empty))
        try:
            with replacing(path, "wb") as f:  # a full disk leaves no partial block behind
                np.save(f, block)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, exc.filename or path) from exc
    bad, first = _bad_stats(p)
    return ChunkStat(p.num_lines, int(p.labels.size), int(p.labels.sum()), bad, first)


def count_task(buf: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per table: (distinct non-empty values, their counts) over the good rows of one chunk."""
    p = parse_chunk(buf)
    return [np.unique(p.cats[~p.empty[:, t], t], return_counts=True) for t in range(NUM_CAT)]


# ---- ordered parallel map ---------------------------------------------------------------------------
class Workers:
    """In-order map over a task stream with at most 2 tasks per worker in flight."""

    def __init__(self, n: int, encoder: Encoder | None) -> None:
        self.n = n
        _init_worker(encoder)
        self.pool = get_context("fork").Pool(n, _init_worker, (encoder,)) if n > 1 else None

    def map(self, fn: Callable[[Any], Any], tasks: Iterator[Any]) -> Iterator[Any]:
        if self.pool is None:
            yield from (fn(t) for t in tasks)
            return
        pending: deque = deque()
        for t in tasks:
            pending.append(self.pool.apply_async(fn, (t,)))
            if len(pending) >= 2 * self.n:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def ordered_with_pos(workers: Workers, fn: Callable[[Any], Any],
                      tasks: Iterator[tuple[Any, int]]) -> Iterator[tuple[Any, int]]:
    """workers.map over (payload, position) pairs, yielding (result, position) in order."""
    positions: deque = deque()

    def payloads() -> Iterator[Any]:
        for payload, pos in tasks:
            positions.append(pos)
            yield payload

    for result in workers.map(fn, payloads()):
        yield result, positions.popleft()
