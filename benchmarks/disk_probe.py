"""The drive's own random-read limit: 4 KiB random reads that the page cache cannot answer.

The "limit" column of the SSD-tier benchmark (`embedding.store=disk`, issue 54): what the disk under
a directory does by itself, so the store's rows/s can be read against it. A file of `--size` bytes
(random bytes, written once and fsynced) is created in `--dir` and deleted at the end; then, for
`--seconds` each, one JSON line per point on stdout:

- `rand_read`: random 4 KiB reads with O_DIRECT (page-aligned buffers from mmap), one fd per thread,
  for each `--threads` count (1 = queue depth 1; Python threads release the GIL in os.preadv, so
  N threads keep about N reads in flight; at high rates the interpreter, not the drive, may be the
  bound: compare with fio where it matters);
- `seq_read`: sequential 1 MiB O_DIRECT reads, one thread;
- `rand_write`: random 4 KiB O_DIRECT writes (no O_DSYNC: the drive's write cache may absorb them),
  for each `--threads` count;
- `fill`: the initial buffered write of the file plus its fsync;
- `ring_read` (with `--ring-depths`): random 4 KiB reads through io_uring (trainer/sparse/embedding/store/tier/uring.py,
  the SSD tier's reader), `queue_depth` in flight from one thread, with O_DIRECT where the
  filesystem takes it; no per-read latency (p50 .. p99 are null). Where the kernel refuses
  io_uring, one line on stderr says so and these points are left out.

Keys: kind, threads, iops, mb_s, p50_us, p90_us, p99_us (per-operation latency), seconds, ops,
cpu_s (this process's CPU seconds in the point: near seconds x cores, the CPU is the bound, not the
drive), block_bytes, file_bytes, dir, direct. Where the filesystem refuses O_DIRECT (EINVAL), one line on
stderr says so and the reads fall back to plain reads after posix_fadvise(DONTNEED) of the whole
file before each point ("direct": false; on tmpfs that drops nothing: the figures are RAM's);
`--buffered` takes that path on purpose.

Run from the repository root: python -m benchmarks.disk_probe --dir /tmp --size 1G --seconds 3
"""
from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Callable, Sequence

import numpy as np

from trainer.sparse.embedding.store.tier.uring import open_ring

BLOCK = 4096
SEQ_BLOCK = 1 << 20
FILL_CHUNK = 8 << 20
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of '4G', '512M', '64k', '1048576' (binary units)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] != "" else ""
    num = t[:-1] if unit else t
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r} is not a size like 4G, 512M or 1048576") from None
    return int(value * _UNITS[unit])


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of an ascending sequence; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))]


def _open_direct(path: str, flags: int) -> int:
    """os.open with O_DIRECT (its own function: where the filesystem refuses it, EINVAL)."""
    return os.open(path, flags | os.O_DIRECT)


def direct_supported(path: str) -> tuple[bool, str]:
    """(True, '') when an O_DIRECT open and aligned 4 KiB read of path work; else (False, why) for
    EINVAL (the filesystem refuses O_DIRECT); other errors are raised."""
    buf = mmap.mmap(-1, BLOCK)
    try:
        fd = _open_direct(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False, f"open: {exc.strerror}"
        raise
    try:
        os.preadv(fd, [buf], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False, f"read: {exc.strerror}"
        raise
    finally:
        os.close(fd)
        buf.close()
    return True, ""


def fill(path: str, size: int, seed: int = 0) -> float:
    """Write size random bytes to path (buffered, then fsync); the seconds it took."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < size:
            n = min(FILL_CHUNK, size - done)
            os.write(fd, rng.randbytes(n))
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def drop_cache(path: str) -> None:
    """posix_fadvise(DONTNEED) of the whole file (written pages are synced first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_point(path: str, kind: str, threads: int, seconds: float, file_bytes: int, direct: bool) -> dict:
    """One point: `threads` threads, each on its own fd, doing `kind` until `seconds` have passed."""
    block = SEQ_BLOCK if kind == "seq_read" else BLOCK
    writing = kind == "rand_write"
    flags = os.O_WRONLY if writing else os.O_RDONLY
    nblocks = file_bytes // block
    if not direct:
        drop_cache(path)
    lat: list[list[int]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def worker(k: int) -> None:
        fd = _open_direct(path, flags) if direct else os.open(path, flags)
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        if writing:
            buf.write(random.Random(k).randbytes(block))
        rng = random.Random(1000 + k)
        mine, op = lat[k], (os.pwritev if writing else os.preadv)
        clock = time.perf_counter_ns
        seq = (k * nblocks) // threads
        try:
            start.wait()
            end = deadline[0]
            while True:
                if kind == "seq_read":
                    off, seq = seq * block, (seq + 1) % nblocks
                else:
                    off = rng.randrange(nblocks) * block
                t = clock()
                n = op(fd, [buf], off)
                mine.append(clock() - t)
                if n != block:
                    raise OSError(f"{kind} at {off}: {n} of {block} bytes")
                if t > end:
                    break
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            os.close(fd)
            buf.close()

    pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for th in pool:
        th.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    deadline[0] = time.perf_counter_ns() + int(seconds * 1e9)
    start.wait()
    for th in pool:
        th.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if errors:
        raise errors[0]
    all_lat = sorted(x for one in lat for x in one)
    ops = len(all_lat)
    return {"kind": kind, "threads": threads, "iops": round(ops / wall, 1), "mb_s": round(ops * block / wall / 1e6, 2),
            "p50_us": round(percentile(all_lat, 0.50) / 1e3, 1), "p90_us": round(percentile(all_lat, 0.90) / 1e3, 1),
            "p99_us": round(percentile(all_lat, 0.99) / 1e3, 1), "seconds": round(wall, 3), "ops": ops,
            "cpu_s": round(cpu, 3), "block_bytes": block, "file_bytes": file_bytes, "direct": direct}


def ring_point(path: str, depth: int, seconds: float, file_bytes: int, direct: bool) -> dict | None:
    """Random BLOCK reads through an io_uring of `depth` entries, batches of 4 x depth, until
    `seconds` have passed; None where io_uring is refused here."""
    ring = open_ring(depth)
    if ring is None:
        return None
    fd = _open_direct(path, os.O_RDONLY) if direct else os.open(path, os.O_RDONLY)
    if not direct:
        drop_cache(path)
    batch, nblocks = 4 * depth, file_bytes // BLOCK
    buf = mmap.mmap(-1, batch * BLOCK)  # page-aligned, as O_DIRECT needs
    view = np.frombuffer(buf, np.uint8)
    rng = np.random.default_rng(depth)
    ops = 0
    try:
        t0, cpu0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            ring.read(fd, rng.integers(0, nblocks, batch, dtype=np.int64) * BLOCK, BLOCK, view.ctypes.data, path)
            ops += batch
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        del view
        os.close(fd)
        ring.close()
        buf.close()
    return {"kind": "ring_read", "threads": 1, "queue_depth": depth, "iops": round(ops / wall, 1),
            "mb_s": round(ops * BLOCK / wall / 1e6, 2), "p50_us": None, "p90_us": None, "p99_us": None,
            "seconds": round(wall, 3), "ops": ops, "cpu_s": round(cpu, 3), "block_bytes": BLOCK,
            "file_bytes": file_bytes, "direct": direct}


def probe(directory: str, size: int, seconds: float, threads: Sequence[int], buffered: bool = False,
          emit: Callable[[dict], None] = lambda line: print(json.dumps(line), flush=True),
          ring_depths: Sequence[int] = ()) -> list[dict]:
    """Every point on a file of `size` bytes made in `directory` (deleted at the end); each line is
    passed to emit as it is measured."""
    fd, path = tempfile.mkstemp(prefix="disk_probe-", suffix=".bin", dir=directory)
    os.close(fd)
    out: list[dict] = []

    def put(line: dict) -> None:
        line["dir"] = directory
        out.append(line)
        emit(line)

    try:
        took = fill(path, size)
        if buffered:
            direct, why = False, "--buffered"
        else:
            direct, why = direct_supported(path)
            if not direct:
                print(f"disk_probe: O_DIRECT refused by the filesystem of {directory} (EINVAL, {why}): reads after "
                      "posix_fadvise(DONTNEED) of the whole file instead; the page cache may answer some",
                      file=sys.stderr, flush=True)
        put({"kind": "fill", "threads": 1, "iops": round(size / FILL_CHUNK / took, 1), "mb_s": round(size / took / 1e6, 2),
             "p50_us": None, "p90_us": None, "p99_us": None, "seconds": round(took, 3), "ops": -(-size // FILL_CHUNK),
             "block_bytes": FILL_CHUNK, "file_bytes": size, "direct": False})
        for n in threads:
            put(run_point(path, "rand_read", n, seconds, size, direct))
        for depth in ring_depths:
            line = ring_point(path, depth, seconds, size, direct)
            if line is None:
                print("disk_probe: io_uring is refused here (the kernel, seccomp or kernel.io_uring_disabled): "
                      "no ring_read points", file=sys.stderr, flush=True)
                break
            put(line)
        put(run_point(path, "seq_read", 1, seconds, size, direct))
        for n in threads:
            put(run_point(path, "rand_write", n, seconds, size, direct))
    finally:
        os.unlink(path)
    return out


def _bad(message: str) -> int:
    """Bad input: one `error: ...` line on stderr, exit status 2 (no usage text, no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.disk_probe",
        description="The drive's own random-read limit: 4 KiB random reads with O_DIRECT (the page cache "
                    "cannot answer) at 1 and N threads, sequential 1 MiB reads and 4 KiB random writes on a "
                    "file made in --dir and deleted at the end; one JSON line per point (IOPS, MB/s, latency "
                    "p50 / p90 / p99).")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the file is made (the disk to probe)")
    ap.add_argument("--size", default="1G", help="file size: 4G, 512M, ... (larger than the drive's cache)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per point")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16, 64], help="thread counts (queue depths)")
    ap.add_argument("--ring-depths", type=int, nargs="*", default=[], metavar="N",
                    help="also random reads through io_uring with N in flight from one thread (the SSD tier's reader)")
    ap.add_argument("--buffered", action="store_true",
                    help="no O_DIRECT: plain reads after posix_fadvise(DONTNEED) (what the fallback does)")
    args = ap.parse_args(argv)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        return _bad(f"--size {args.size}: {exc}")
    if size < SEQ_BLOCK:
        return _bad(f"--size {args.size}: must be at least 1M")
    size -= size % SEQ_BLOCK
    if not args.seconds > 0:
        return _bad(f"--seconds {args.seconds:g}: must be > 0")
    if any(n <= 0 for n in args.threads):
        return _bad(f"--threads {' '.join(map(str, args.threads))}: each must be > 0")
    if any(not 0 < n <= 4096 for n in args.ring_depths):
        return _bad(f"--ring-depths {' '.join(map(str, args.ring_depths))}: each must be in 1..4096")
    if not os.path.isdir(args.dir):
        return _bad(f"--dir {args.dir}: no such directory")
    free = shutil.disk_usage(args.dir).free
    if size > free:
        return _bad(f"--size {args.size}: only {free / 2**30:.1f} GiB free in {args.dir}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the file is deleted on the way out
    probe(os.path.abspath(args.dir), size, args.seconds, args.threads, args.buffered, ring_depths=args.ring_depths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
