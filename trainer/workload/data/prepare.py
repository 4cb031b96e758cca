"""Streaming, parallel, resumable Criteo preprocessing: raw TSV (or .gz) files -> blocks + meta.json.

Why this shape: a Terabyte day file is ~45 GB and Kaggle's train.txt 11 GB, so a file is never read
whole: the parent reads chunks of whole lines (gzip decompresses as a stream) and hands them to a
pool of worker processes, at most 2 per worker in flight (bounded memory). Workers parse, encode and
write their block themselves and return only counts, so results are collected in order, which is
what makes bad-row line numbers exact. A file is finished when its marker (progress/*.json) is
written; a re-run skips finished files and redoes the others, so an interrupted run resumes per file.

Vocabulary mode (min_count) needs a counting pass over the training files first; its memory is
O(distinct values) (numpy arrays of (value, count), no dicts). Hashing mode is one pass, O(1) memory.

Here: the options, the passes, the output directory (its signature, resume and undo) and meta.json;
chunks.py: the reading in chunks and the worker processes the passes run on.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ...base.core.atomic import replacing, write_json_atomic
from ...base.core.progress import Bar
from .chunks import KEEP_BAD, ChunkStat, Workers, count_task, encode_task, iter_chunks, ordered_with_pos
from .criteo import FORMAT, META, NUM_CAT, NUM_DENSE, CriteoFormatError, Encoder, check_block

SPLITS = ("train", "test")


@dataclass
class PrepOptions:
    out: str  # output directory
    train: list[str]  # training files, in order
    test: list[str] = field(default_factory=list)  # test files (empty = the trainer holds out a tail)
    hash_rows: Optional[list[int]] = None  # hashing mode: 26 table sizes (reserved ids included)
    min_count: Optional[int] = None  # vocabulary mode: keep values seen at least this often
    raw_ids: bool = False  # raw mode: the values' 32 bits are the ids (embedding.kind=dynamic)
    strict: bool = False  # fail at the first bad row instead of skipping it
    workers: int = 1  # worker processes
    chunk_mb: float = 16.0  # MB of text per chunk (one block per chunk; a worker needs ~12x in memory)
    progress: bool = True  # tqdm progress bar on stderr


# ---- progress -------------------------------------------------------------------------------------
class Progress:
    """A progress bar over input bytes (compressed bytes for .gz) with the bad-row count."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = Bar(total, "prepare", enabled, unit="B", unit_scale=True)
        self.bad = 0

    def advance(self, nbytes: int, bad: int) -> None:
        self.bad += bad
        self.bar.update(nbytes, {"bad_rows": self.bad} if bad else None)

    def note(self, text: str) -> None:
        self.bar.note(text)

    def close(self) -> None:
        self.bar.close()


# ---- vocabulary (counting pass) ---------------------------------------------------------------------
def _merge(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sum (values, counts) pairs into one sorted (values, counts) pair."""
    if len(parts) == 1:
        return parts[0]
    keys = np.concatenate([k for k, _ in parts])
    counts = np.concatenate([c for _, c in parts])
    uniq, inv = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inv, weights=counts, minlength=uniq.size).astype(np.int64)


def _count_file(opt: PrepOptions, workers: Workers, progress: Progress, i: int,
                path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-table value counts of one training file, cached in progress/count-NNN.npz."""
    marker = os.path.join(opt.out, "progress", f"count-{i:03d}.npz")
    if os.path.exists(marker):
        progress.advance(os.path.getsize(path), 0)
        z = np.load(marker)
        return [(z[f"k{t}"], z[f"c{t}"]) for t in range(NUM_CAT)]
    acc: list[list] = [[] for _ in range(NUM_CAT)]
    last = 0
    chunks = iter_chunks(path, int(opt.chunk_mb * 2**20))
    for k, (res, pos) in enumerate(ordered_with_pos(workers, count_task, chunks)):
        for t in range(NUM_CAT):
            acc[t].append(res[t])
        if k % 16 == 15:
            acc = [[_merge(a)] for a in acc]
        progress.advance(pos - last, 0)
        last = pos
    merged = [_merge(a) if a else (np.zeros(0, np.uint64), np.zeros(0, np.int64)) for a in acc]
    if any(m[0].size for m in merged):  # a file without one good value leaves nothing to resume
        _save_npz(marker, {**{f"k{t}": m[0] for t, m in enumerate(merged)},
                           **{f"c{t}": m[1] for t, m in enumerate(merged)}})
    return merged


def _save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    with replacing(path, "wb") as f:
        np.savez(f, **arrays)


def build_vocab(opt: PrepOptions, progress: Progress) -> Encoder:
    """Counting pass over the training files -> the min_count vocabulary (saved as vocab.npz)."""
    workers = Workers(opt.workers, None)
    try:
        per_file = [_count_file(opt, workers, progress, i, p) for i, p in enumerate(opt.train)]
    finally:
        workers.close()
    vocab = []
    for t in range(NUM_CAT):
        keys, counts = _merge([f[t] for f in per_file])
        vocab.append(keys[counts >= opt.min_count])
    _save_npz(os.path.join(opt.out, "vocab.npz"), {f"t{t}": v for t, v in enumerate(vocab)})
    return Encoder.from_vocab(vocab, opt.min_count)


# ---- encoding pass --------------------------------------------------------------------------------
def _source(path: str) -> dict[str, Any]:
    """What identifies an input's content: path, size and modification time (ns). Any write to
    the file changes its mtime, even one that keeps the size (a label flipped in place)."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _finished(opt: PrepOptions, marker: str, path: str) -> dict[str, Any] | None:
    """The marker's record when this file was finished before from the same content (size and
    mtime) and its blocks are all there and whole; None (redo it) otherwise."""
    if not os.path.exists(marker):
        return None
    try:
        with open(marker) as f:
            rec = json.load(f)
        blocks_ok = all(check_block(os.path.join(opt.out, b["file"]), b["rows"]) is None
                        for b in rec["blocks"])
        same = rec["source"] == _source(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec if same and blocks_ok else None


def _remove_blocks(directory: str, prefix: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(prefix):
            os.remove(os.path.join(directory, name))


def _add_chunk(rec: dict[str, Any], stat: ChunkStat, opt: PrepOptions, progress: Progress,
               block: str) -> None:
    """Fold one chunk's counts into the file record; bad rows get their 1-based line numbers."""
    for line, reason in stat.first_bad:
        where = f"{rec['path']}:{rec['lines'] + line + 1}"
        if opt.strict:
            raise CriteoFormatError(f"{where}: bad row: {reason} (--strict)")
        if len(rec["first_bad"]) < KEEP_BAD:
            rec["first_bad"].append({"file": rec["path"], "line": rec["lines"] + line + 1, "reason": reason})
            progress.note(f"{where}: bad row skipped: {reason}")
    rec["lines"] += stat.lines
    rec["rows"] += stat.rows
    rec["positives"] += stat.positives
    for k, v in stat.bad.items():
        rec["bad"][k] = rec["bad"].get(k, 0) + v
    if stat.rows:
        rec["blocks"].append({"file": block, "rows": stat.rows})


def _encode_file(opt: PrepOptions, workers: Workers, progress: Progress, split: str, i: int,
                 path: str) -> dict[str, Any]:
    """Encode one input file into blocks SPLIT/bIII-KKKKK.npy; skipped when finished before."""
    marker = os.path.join(opt.out, "progress", f"{split}-{i:03d}.json")
    done = _finished(opt, marker, path)
    if done is not None:
        progress.advance(os.path.getsize(path), 0)
        progress.note(f"{path}: finished in an earlier run (same size and mtime), skipped")
        return done
    if os.path.exists(marker):
        progress.note(f"{path}: changed since an earlier run (or its blocks are missing or truncated), redone")
    _remove_blocks(os.path.join(opt.out, split), f"b{i:03d}-")
    rec: dict[str, Any] = {"source": _source(path), "path": path, "lines": 0, "rows": 0, "positives": 0,
                           "bad": {}, "first_bad": [], "blocks": []}
    name = lambda k: f"{split}/b{i:03d}-{k:05d}.npy"  # noqa: E731
    tasks = (((buf, os.path.join(opt.out, name(k))), pos)
             for k, (buf, pos) in enumerate(iter_chunks(path, int(opt.chunk_mb * 2**20))))
    last = 0
    for k, (stat, pos) in enumerate(ordered_with_pos(workers, encode_task, tasks)):
        _add_chunk(rec, stat, opt, progress, name(k))
        progress.advance(pos - last, sum(stat.bad.values()))
        last = pos
    write_json_atomic(marker, rec, indent=1)
    return rec


# ---- the whole run --------------------------------------------------------------------------------
def check_options(opt: PrepOptions) -> None:
    """Fail early, naming the option, before any file is touched."""
    if not opt.train:
        raise CriteoFormatError("--train: at least one training file is needed")
    for option, files in (("--train", opt.train), ("--test", opt.test)):
        for p in files:
            if os.path.isdir(p):
                raise CriteoFormatError(f"{option} {p!r} is a directory, not a file: name the files in it "
                                        f"(e.g. {option} {os.path.join(p, 'day_0.gz')} ...)")
            if not os.path.isfile(p):
                raise CriteoFormatError(f"{option} input file {p!r} does not exist" if not os.path.exists(p)
                                        else f"{option} {p!r} is not a regular file")
    if (opt.hash_rows is not None) + (opt.min_count is not None) + opt.raw_ids != 1:
        raise CriteoFormatError("give exactly one of --hash-rows (hashing), --min-count (vocabulary) or "
                                "--raw-ids (raw values)")
    if opt.hash_rows is not None and (len(opt.hash_rows) != NUM_CAT or min(opt.hash_rows) < 2
                                      or max(opt.hash_rows) >= 2**31):
        raise CriteoFormatError(f"--hash-rows: need 1 or {NUM_CAT} sizes in [2, 2^31), got {opt.hash_rows}")
    if opt.min_count is not None and opt.min_count < 1:
        raise CriteoFormatError(f"--min-count={opt.min_count}: must be >= 1")
    if opt.workers < 1 or opt.chunk_mb <= 0:
        raise CriteoFormatError("--workers must be >= 1 and --chunk-mb > 0")


OPTIONS = os.path.join("progress", "options.json")  # the signature of a prepared directory
_LAYOUT = ("progress", "train", "test")


def _signature(opt: PrepOptions) -> dict[str, Any]:
    """What a resumed run must share with the earlier one. Hashing encodes every file on its own,
    so the training files are named by path (a file whose content changed is redone by its
    marker); a vocabulary is counted over the training files' contents, so there they must be
    unchanged (size and mtime)."""
    train = [_source(p) for p in opt.train]
    return {"hash_rows": opt.hash_rows, "min_count": opt.min_count, "raw_ids": opt.raw_ids, "chunk_mb": opt.chunk_mb,
            "train": train if opt.min_count is not None else [t["path"] for t in train]}


def _same_signature(old: dict[str, Any], sig: dict[str, Any]) -> bool:
    if old.get("min_count") is None and isinstance(old.get("train"), list):  # hashing: paths only
        old = {**old, "train": [t["path"] if isinstance(t, dict) else t for t in old["train"]]}
    return old == sig


def check_out(opt: PrepOptions) -> bool:
    """--out must be a new or empty directory, or one prepared before from the same inputs and
    options (then the run resumes); never an unrelated directory whose files would be replaced.
    True when it holds nothing of an earlier run (new, empty, or only the empty layout)."""
    out = opt.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise CriteoFormatError(f"--out {out} exists and is not a directory")
    if not os.path.isdir(out):
        return True
    options = os.path.join(out, OPTIONS)
    if os.path.isfile(options):
        try:
            with open(options) as f:
                old = json.load(f)
        except (OSError, ValueError) as exc:
            raise CriteoFormatError(f"--out {out}: {options} cannot be read ({exc}); use a fresh "
                                    "--out directory") from exc
        sig = _signature(opt)
        if not _same_signature(old, sig):
            raise CriteoFormatError(f"--out {out} was prepared with other options or training files "
                                    f"({old} != {sig}); use a fresh --out directory")
        return False
    names = os.listdir(out)
    ours = all(n in _LAYOUT and os.path.isdir(os.path.join(out, n)) and not os.listdir(os.path.join(out, n))
               for n in names)  # a run that stopped before writing its signature
    if not ours:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise CriteoFormatError(f"--out {out} is not empty ({shown}) and is not a directory prepared by "
                                "this script: its files could be replaced or deleted; give a new or "
                                "empty directory")
    return True


def _first_missing(path: str) -> str | None:
    """The outermost directory of `path` (itself included) that does not exist yet: what creating
    it makes; None when it exists."""
    path = os.path.abspath(path)
    missing = None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


BLOCK_NAME = re.compile(r"^b\d{3}-\d{5}\.npy$")


def _resumable(out: str) -> bool:
    """Whether a failed run left work a re-run with the same inputs skips: a block, or the
    vocabulary counts of a training file."""
    def names(sub: str) -> list[str]:
        d = os.path.join(out, sub)
        return os.listdir(d) if os.path.isdir(d) else []
    return (any(BLOCK_NAME.match(n) for split in SPLITS for n in names(split))
            or any(n.startswith("count-") and n.endswith(".npz") for n in names("progress")))


def _undo_out(out: str, created: str | None) -> None:
    """After a failed run that found --out new or empty and left nothing to resume: remove what it
    made (--out itself and the parents it created, else everything inside --out), so that --out
    takes other inputs afterwards."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    for name in os.listdir(out) if os.path.isdir(out) else []:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:  # the failure being reported matters more
                pass


def _make_out(opt: PrepOptions) -> None:
    """Create --out and its layout and make sure it takes files (before any input is read)."""
    try:
        for sub in _LAYOUT:
            os.makedirs(os.path.join(opt.out, sub), exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=os.path.join(opt.out, "progress"), prefix=".probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise CriteoFormatError(f"--out {opt.out} is not writable: {exc}") from exc


def _check_signature(opt: PrepOptions) -> None:
    """Record this run's signature (check_out compared it with an earlier one)."""
    write_json_atomic(os.path.join(opt.out, OPTIONS), _signature(opt), indent=1)


def _split_meta(recs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"rows": sum(r["rows"] for r in recs), "positives": sum(r["positives"] for r in recs),
            "blocks": [b for r in recs for b in r["blocks"]],
            "sources": [{k: r[k] for k in ("path", "lines", "rows", "bad")} for r in recs]}


def _bad_meta(recs: list[dict[str, Any]]) -> dict[str, Any]:
    by_reason: dict[str, int] = {}
    for r in recs:
        for k, v in r["bad"].items():
            by_reason[k] = by_reason.get(k, 0) + v
    first = [b for r in recs for b in r["first_bad"]][:KEEP_BAD]
    return {"total": sum(by_reason.values()), "by_reason": by_reason, "first": first}


def make_meta(opt: PrepOptions, encoder: Encoder, recs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {"format": FORMAT, "num_dense": NUM_DENSE, "num_tables": NUM_CAT,
            "table_rows": list(encoder.rows),
            "dense_rule": "log(1 + max(x, 0)) as float32; missing -> 0",
            "categorical": encoder.rule(),
            "block_layout": f"int32 [n, {1 + NUM_DENSE + NUM_CAT}]: label, {NUM_DENSE} dense float32 "
                            f"bit patterns, {NUM_CAT} ids",
            "splits": {s: _split_meta(r) for s, r in recs.items()},
            "bad_rows": _bad_meta([x for r in recs.values() for x in r]),
            "options": {k: v for k, v in asdict(opt).items() if k != "progress"},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


def prepare(opt: PrepOptions) -> dict[str, Any]:
    """Prepare opt.out from the raw files; returns (and writes) meta.json. Every failure that is
    not a bug (bad input, --out unusable, a full disk) raises CriteoFormatError saying where."""
    check_options(opt)
    fresh = check_out(opt)
    created = _first_missing(opt.out)
    try:
        _make_out(opt)
        return _prepare(opt)
    except OSError as exc:
        where = exc.filename or opt.out
        _failed(opt, fresh, created)
        raise CriteoFormatError(f"preparing {opt.out} failed at {where}: {exc.strerror or exc}") from exc
    except BaseException:
        _failed(opt, fresh, created)
        raise


def _failed(opt: PrepOptions, fresh: bool, created: str | None) -> None:
    """A run that found --out new or empty leaves it so when it fails with nothing to resume (an
    empty input, no row surviving, a bad first file); otherwise its work stays for the re-run."""
    if fresh and not _resumable(opt.out):
        _undo_out(opt.out, created)


def _prepare(opt: PrepOptions) -> dict[str, Any]:
    _check_signature(opt)
    sizes = sum(os.path.getsize(p) for p in opt.train + opt.test)
    counting = sum(os.path.getsize(p) for p in opt.train) if opt.min_count is not None else 0
    progress = Progress(sizes + counting, opt.progress)
    try:
        encoder = (Encoder.raw() if opt.raw_ids else Encoder.hashing(opt.hash_rows) if opt.hash_rows is not None
                   else build_vocab(opt, progress))
        workers = Workers(opt.workers, encoder)
        try:
            recs = {s: [_encode_file(opt, workers, progress, s, i, p) for i, p in enumerate(files)]
                    for s, files in (("train", opt.train), ("test", opt.test)) if files}
        finally:
            workers.close()
    finally:
        progress.close()
    meta = make_meta(opt, encoder, recs)
    for split, files in (("train", opt.train), ("test", opt.test)):
        if files and meta["splits"][split]["rows"] == 0:  # meta.json is not written: not trainable
            bad = meta["bad_rows"]
            first = "; ".join(f"{b['file']}:{b['line']}: {b['reason']}" for b in bad["first"][:3])
            raise CriteoFormatError(
                f"no row of the {split} files ({', '.join(files)}) survived: {bad['total']} bad rows "
                f"({', '.join(f'{k}: {v}' for k, v in bad['by_reason'].items()) or 'the files are empty'})"
                + (f"; first: {first}" if first else "") + f". {META} was not written")
    write_json_atomic(os.path.join(opt.out, META), meta, indent=1)
    return meta
