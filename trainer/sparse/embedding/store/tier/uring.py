"""Reads (and writes) of many fixed-size records or pages through io_uring (Linux 5.6+), with
ctypes and numpy only. The writes are the log's merges of scattered pages (writelog.py).

The SSD tier's reads ahead (disk.py) want thousands of 80 B records a step from random places of
a file. Through the mapping each one is a page fault on a reading thread (~10 µs of CPU per row
when it misses the page cache, with the unmapping later); through one `pread` each, Python's
per-call cost holds the GIL. Here a batch of reads is written into the submission ring's entries
with numpy (no Python call per record) and handed to the kernel with one system call; ctypes drops
the GIL while the thread waits for the completions. Measured on the 2-core VM, 8,000 random
records of a 400 MB file not in the page cache: 72-109k reads/s at 1,024 in flight with 4.5-8.7 µs
of CPU per read, against 67-77k reads/s and 10-12 µs with 16 threads faulting them in
(benchmarks/reports/2026-11-29-ssd-step-split.md).

`open_ring()` returns None where the kernel or a sandbox refuses io_uring (ENOSYS, EPERM:
seccomp, kernel.io_uring_disabled) or the machine is not x86-64 / aarch64 Linux (the system call
numbers below); the tier then reads with its threads. A Ring is used by one thread at a time.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
from typing import Optional

import numpy as np

_u32 = ctypes.c_uint32
NR = {"x86_64": (425, 426), "aarch64": (425, 426)}  # io_uring_setup, io_uring_enter (the same on both)
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
OP_READ, OP_WRITE = 22, 23  # IORING_OP_READ, IORING_OP_WRITE (5.6)
ENTER_GETEVENTS = 1
SQE = np.dtype([("opcode", "u1"), ("flags", "u1"), ("ioprio", "<u2"), ("fd", "<i4"), ("off", "<u8"), ("addr", "<u8"),
                ("len", "<u4"), ("rw_flags", "<u4"), ("user_data", "<u8"), ("buf_index", "<u2"), ("personality", "<u2"),
                ("splice_fd_in", "<i4"), ("pad", "<u8", (2,))])
CQE = np.dtype([("user_data", "<u8"), ("res", "<i4"), ("flags", "<u4")])


class _SqOffsets(ctypes.Structure):
    _fields_ = [(n, _u32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1")] + \
        [("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [(n, _u32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1")] + \
        [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", _u32), ("cq_entries", _u32), ("flags", _u32), ("sq_thread_cpu", _u32),
                ("sq_thread_idle", _u32), ("features", _u32), ("wq_fd", _u32), ("resv", _u32 * 3),
                ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class Ring:
    """One io_uring instance: `read` fills a buffer with records from a file, `write` writes
    pieces of one back."""

    def __init__(self, entries: int = 1024) -> None:
        setup, self._enter_nr = NR[platform.machine()]
        p = _Params()
        fd = _libc.syscall(ctypes.c_long(setup), ctypes.c_uint(entries), ctypes.byref(p))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup: {os.strerror(e)}")
        self.fd = fd
        so, co = p.sq_off, p.cq_off
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        try:
            self._maps = [mmap.mmap(fd, so.array + p.sq_entries * 4, mmap.MAP_SHARED, rw, offset=OFF_SQ_RING),
                          mmap.mmap(fd, co.cqes + p.cq_entries * CQE.itemsize, mmap.MAP_SHARED, rw, offset=OFF_CQ_RING),
                          mmap.mmap(fd, p.sq_entries * SQE.itemsize, mmap.MAP_SHARED, rw, offset=OFF_SQES)]
        except OSError:
            os.close(fd)
            raise
        sq, cq, sqes = self._maps
        word = (lambda m, off, n=1: np.frombuffer(m, np.uint32, n, off))
        self._sq_tail, self._sq_mask = word(sq, so.tail), int(word(sq, so.ring_mask)[0])
        word(sq, so.array, p.sq_entries)[:] = np.arange(p.sq_entries, dtype=np.uint32)  # entry i is slot i
        self._cq_head, self._cq_tail, self._cq_mask = word(cq, co.head), word(cq, co.tail), int(word(cq, co.ring_mask)[0])
        self._cqes = np.frombuffer(cq, CQE, p.cq_entries, co.cqes)
        self._sqes = np.frombuffer(sqes, SQE, p.sq_entries)
        self._sqes[:] = np.zeros(1, SQE)
        self.entries = int(p.sq_entries)

    def _enter(self, submit: int, wait: int) -> None:
        r = _libc.syscall(ctypes.c_long(self._enter_nr), ctypes.c_uint(self.fd), ctypes.c_uint(submit),
                          ctypes.c_uint(wait), ctypes.c_uint(ENTER_GETEVENTS if wait else 0), None, ctypes.c_size_t(0))
        if r < 0:
            e = ctypes.get_errno()
            if e == 4:  # EINTR: a signal; the entries are still queued or done
                return
            raise OSError(e, f"io_uring_enter: {os.strerror(e)}")

    def read(self, fd: int | np.ndarray, offsets: np.ndarray, length: int, addr: int, path: str = "") -> None:
        """Read `length` bytes at each offset (int64) of file fd (or of fd[i], int32, each its
        own) into addr + i * length (a buffer the caller keeps alive); `entries` in flight at most.
        OSError on an error or a short read."""
        self._transfer(OP_READ, fd, offsets, length, addr, path)

    def write(self, fd: int, offsets: np.ndarray, length: int, addr: int, path: str = "") -> None:
        """Write `length` bytes from addr + i * length at each offset (int64) of file fd, as read
        does (in no particular order: the offsets must not overlap)."""
        self._transfer(OP_WRITE, fd, offsets, length, addr, path)

    def _transfer(self, op: int, fd: int | np.ndarray, offsets: np.ndarray, length: int, addr: int, path: str) -> None:
        n, sent, done = int(offsets.size), 0, 0
        error: Optional[OSError] = None
        while done < (sent if error else n):  # after an error, only the transfers in flight (they use addr)
            k = 0 if error else min(self.entries - (sent - done), n - sent)
            if k:
                t = int(self._sq_tail[0])
                slots = (t + np.arange(k, dtype=np.int64)) & self._sq_mask
                e = self._sqes[slots]
                e["opcode"] = op
                e["fd"] = fd if isinstance(fd, int) else fd[sent:sent + k]
                e["off"] = offsets[sent:sent + k]
                e["addr"] = addr + np.arange(sent, sent + k, dtype=np.uint64) * np.uint64(length)
                e["len"] = length
                e["user_data"] = np.arange(sent, sent + k, dtype=np.uint64)
                self._sqes[slots] = e
                self._sq_tail[0] = (t + k) & 0xFFFFFFFF  # published after the entries (x86-64/arm64 stores: the syscall orders them)
                sent += k
            self._enter(k, 1)
            h, tail = int(self._cq_head[0]), int(self._cq_tail[0])
            c = self._cqes[(h + np.arange((tail - h) & 0xFFFFFFFF, dtype=np.int64)) & self._cq_mask]
            bad = c["res"] != length
            if bad.any() and error is None:
                res = int(c["res"][bad][0])
                error = OSError(-res if res < 0 else 5, f"io_uring {'read' if op == OP_READ else 'write'} of {path or fd}: "
                                f"{os.strerror(-res) if res < 0 else f'{res} of {length} bytes'}")
            self._cq_head[0] = tail
            done += c.size
        if error is not None:
            raise error

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a numpy view still holds it: it goes with the object
        os.close(self.fd)


def open_ring(entries: int = 1024) -> Optional[Ring]:
    """A Ring, or None where io_uring is not to be had here (the tier then reads with threads)."""
    if platform.machine() not in NR:
        return None
    try:
        return Ring(entries)
    except (OSError, ValueError):
        return None
