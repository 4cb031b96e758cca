"""The one collective interface every part of the trainer talks to.

Why: the design keeps Horovod and torch.distributed behind a single seam so that the embedding
exchange, the dense allreduce and the metrics never know which launcher started them, and so that
every byte that crosses the wire is counted in one place, by kind.

Byte accounting (what "sent" means, identical for every backend):
- alltoall: the bytes of the splits sent to *other* ranks (the self split never leaves the process).
- allreduce / grouped allreduce: 2 * (W - 1) / W * payload bytes, the per-rank traffic of a
  bandwidth-optimal ring allreduce; 0 when W == 1.
- allgather: (W - 1) * local bytes (our piece goes to every peer).
- broadcast: (W - 1) * bytes on the root, 0 elsewhere.
Counters are kept per rank; `summary.json` sums them over ranks.
"""
from __future__ import annotations

import abc
import math
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch

from ..core.stop import StopRequested

KINDS = ("ids", "versions", "rows", "grads", "replica", "dense", "meta")
STOP = "stop requested"  # root_decides' verdict when root raised StopRequested
EMBEDDING_KINDS = ("ids", "versions", "rows", "grads", "replica")  # the sparse side's traffic
# replica: the allreduce of replicated (hot) rows' gradients
T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation and the rank."""


@dataclass
class ByteCounter:
    """Bytes sent by this rank, per kind, split into phases ("train", "eval", "other")."""

    phase: str = "train"
    by_phase: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: float, op: str | None) -> None:
        """Count nbytes of `kind`; op names the call (None: same call as the previous add)."""
        if kind not in KINDS:
            raise ValueError(f"unknown byte kind {kind!r}; expected one of {KINDS}")
        self.by_phase[self.phase][kind] += int(round(nbytes))
        if op is not None:
            self.calls[op] += 1

    def totals(self, phase: str = "train") -> dict[str, int]:
        """Bytes per kind for one phase, every kind present (zeros included)."""
        got = self.by_phase.get(phase, {})
        return {k: int(got.get(k, 0)) for k in KINDS}

    def snapshot(self, phase: str = "train") -> dict[str, int]:
        return dict(self.totals(phase))


class Collectives(abc.ABC):
    """rank/size + collectives; subclasses implement the `_op` methods, this class counts bytes."""

    # True where the backend's alltoall learns the receive sizes itself (Horovod's negotiation):
    # announcing them early (exchange_splits_async) would only add a collective there
    learns_splits = False
    # what carries the collectives' bytes: "gloo" / "nccl" (torch), "gloo" / "mpi" / "nccl"
    # (Horovod); None for the local backend (nothing leaves the process). summary.json's `transport`
    transport: str | None = None

    def __init__(self, rank: int, size: int, timeout_s: float, local_size: int | None = None) -> None:
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.local_size = local_size  # ranks on this rank's host (None: the launcher did not say)
        self.counter = ByteCounter()

    @property
    def spans_hosts(self) -> bool:
        """Whether the ranks run on more than one host (unknown: assumed so)."""
        return self.local_size is None or self.local_size < self.size

    # ----- public API (counts, then delegates) ---------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum", kind: str = "dense") -> torch.Tensor:
        """Reduce `t` over ranks; op is "sum" or "mean". Returns a new tensor."""
        self._count_allreduce([t], kind, "allreduce")
        return self._guard("allreduce", lambda: self._allreduce([t], op)[0])

    def grouped_allreduce(self, ts: Sequence[torch.Tensor], op: str = "sum",
                          kind: str = "dense") -> list[torch.Tensor]:
        """Reduce several tensors in one collective (fused buffer). Returns new tensors."""
        return self.grouped_allreduce_async(ts, op, kind).wait()

    def alltoall(self, t: torch.Tensor, splits: Sequence[int], kind: str | dict[str, int],
                 recv_splits: Sequence[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Send rows t[sum(splits[:j]) : sum(splits[:j+1])] to rank j along dim 0.

        Returns (received rows concatenated in rank order, received split sizes). When the caller
        already knows recv_splits (a reply to a request), pass them to skip the size exchange.
        `kind` may map kinds to column counts of a packed 2-D `t` (e.g. {"ids": 1, "versions": 1}
        for [n, 2] id/version pairs), so each column's bytes are counted under its own kind.
        """
        return self.alltoall_async(t, splits, kind, recv_splits).wait()

    # ----- asynchronous forms (a Handle; its wait() gives what the blocking call returns) --------
    def alltoall_async(self, t: torch.Tensor, splits: Sequence[int], kind: str | dict[str, int],
                       recv_splits: Sequence[int] | None = None) -> "Handle":
        """Start an alltoall; `wait()` on the handle returns (rows, recv_splits) like alltoall.

        Collectives must be started in the same order on every rank (waits may come in any order).
        Unknown recv_splits are exchanged first, blocking (a few bytes), then the rows travel
        while the caller computes."""
        splits = self._check_splits(t, splits)
        if recv_splits is None:
            recv_splits = self._exchange_splits(splits)
        recv_splits = [int(s) for s in recv_splits]
        self._count_alltoall(t, splits, kind)
        finish = self._guard("alltoall", lambda: self._alltoall_start(t.contiguous(), splits, recv_splits))
        return Handle(self, "alltoall", lambda: (finish(), recv_splits))

    def exchange_splits_async(self, splits: Sequence[int]) -> "Handle":
        """Start telling every rank how many rows this rank will send it in a later alltoall;
        `wait()` returns the recv_splits to pass to that alltoall. The size exchange is a latency-
        bound round trip: started early, it completes while the caller computes instead of in
        front of the rows (HET's push: its sizes are known after the read, its rows after the
        backward pass)."""
        splits = [int(s) for s in splits]
        if len(splits) != self.size:
            raise ValueError(f"exchange_splits_async: {len(splits)} splits for world size {self.size}")
        if self.size == 1:
            return Handle(self, "alltoall(split sizes)", lambda: list(splits))
        self.counter.add("meta", (self.size - 1) * 8, "alltoall_splits")
        ones = [1] * self.size
        send = torch.tensor(splits, dtype=torch.int64)
        finish = self._guard("alltoall(split sizes)", lambda: self._alltoall_start(send, ones, ones))
        return Handle(self, "alltoall(split sizes)", lambda: self._received_splits(finish()))

    def grouped_allreduce_async(self, ts: Sequence[torch.Tensor], op: str = "sum",
                                kind: str = "dense") -> "Handle":
        """Start a fused allreduce; `wait()` returns the reduced tensors like grouped_allreduce."""
        if not ts:
            return Handle(self, "grouped_allreduce", lambda: [])
        self._count_allreduce(ts, kind, "grouped_allreduce")
        finish = self._guard("grouped_allreduce", lambda: self._allreduce_start(list(ts), op))
        return Handle(self, "grouped_allreduce", finish)

    def allgather(self, t: torch.Tensor, kind: str = "meta") -> torch.Tensor:
        """Concatenate every rank's `t` along dim 0 (first dims may differ between ranks)."""
        self.counter.add(kind, (self.size - 1) * t.numel() * t.element_size(), "allgather")
        return self._guard("allgather", lambda: self._allgather(t.contiguous()))

    def broadcast(self, t: torch.Tensor, root: int = 0, kind: str = "dense") -> torch.Tensor:
        """Return root's `t` on every rank (same shape everywhere)."""
        if self.rank == root:
            self.counter.add(kind, (self.size - 1) * t.numel() * t.element_size(), "broadcast")
        return self._guard("broadcast", lambda: self._broadcast(t.contiguous(), root))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from root (counted as meta)."""
        payload = pickle.dumps(obj) if self.rank == root else b""
        n = self.broadcast(torch.tensor([len(payload)], dtype=torch.int64), root, kind="meta")
        buf = torch.zeros(int(n.item()), dtype=torch.uint8)
        if self.rank == root:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buf = self.broadcast(buf, root, kind="meta")
        return pickle.loads(buf.numpy().tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, on every rank (counted as meta)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.allgather(torch.tensor([payload.numel()], dtype=torch.int64), kind="meta").tolist()
        data = self.allgather(payload, kind="meta").numpy().tobytes()
        out, pos = [], 0
        for n in sizes:
            out.append(pickle.loads(data[pos:pos + n]))
            pos += n
        return out

    # ----- one outcome on every rank ----------------------------------------------------------
    def root_decides(self, decide: Callable[[], T], error: type[Exception], root: int = 0) -> T:
        """Rank `root` runs decide(); every rank returns its value, or raises when it failed.

        For what only one rank may do or know (create the output directory, take a lock, read a
        file all ranks share): the others get the verdict in the same broadcast, so none of them
        goes on alone or waits for a collective timeout. An `error` raised by decide reaches the
        other ranks as `error` with the same message (root raises its own); any other exception
        too, as `error` naming it (root raises the original). Collective."""
        outcome: tuple[bool, Any] = (True, None)
        failure: BaseException | None = None
        if self.rank == root:
            try:
                outcome = (True, decide())
            except Exception as exc:  # noqa: BLE001 - every rank must learn that root failed
                failure = exc
                outcome = (False, (STOP, str(exc)) if isinstance(exc, StopRequested) else str(exc)
                           if isinstance(exc, error) else f"rank {root} failed: {type(exc).__name__}: {exc}")
        ok, value = self.broadcast_object(outcome, root)
        if failure is not None:
            raise failure
        if not ok:
            if isinstance(value, tuple) and value[:1] == (STOP,):  # a stop signal on root: every rank stops
                raise StopRequested(value[1])
            raise error(value)
        return value

    def all_succeed(self, what: str, run: Callable[[], T], error: type[Exception]) -> T:
        """Every rank runs run(); if it fails on any rank, every rank raises `error` (no rank is
        left waiting in the next collective). A rank whose own run failed raises that error (an
        `error` as it is, another one as `error`: "<what> failed on rank r: ..."); the others
        name the ranks that failed. Collective (one allgather of a flag)."""
        err: Exception | None = None
        out = None
        try:
            out = run()
        except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank
            err = exc
        stop = isinstance(err, StopRequested)  # a stop signal, not a failure: every rank stops (2)
        flags = self.allgather(torch.tensor([0 if err is None else 2 if stop else 1]), kind="meta")
        if stop and not bool((flags == 1).any()):
            raise err  # type: ignore[misc]
        if err is None and bool((flags == 2).any()) and not bool((flags == 1).any()):
            raise StopRequested(f"{what} (a stop signal on another rank)")
        if isinstance(err, error):
            raise err
        if err is not None:
            raise error(f"{what} failed on rank {self.rank}: {err}") from err
        bad = torch.nonzero(flags == 1).flatten().tolist()
        if bad:
            raise error(f"{what} failed on rank(s) {bad}; see their error")
        return out  # type: ignore[return-value]

    def barrier(self) -> None:
        self._guard("barrier", self._barrier)

    def close(self) -> None:
        """Release the backend (idempotent)."""

    # ----- helpers --------------------------------------------------------------------------
    def _exchange_splits(self, splits: list[int]) -> list[int]:
        return self.exchange_splits_async(splits).wait()

    @staticmethod
    def _received_splits(recv: torch.Tensor) -> list[int]:
        return [int(x) for x in recv.tolist()]

    def _check_splits(self, t: torch.Tensor, splits: Sequence[int]) -> list[int]:
        splits = [int(s) for s in splits]
        if len(splits) != self.size or sum(splits) != t.shape[0]:
            raise ValueError(f"alltoall: splits {splits} do not match world size {self.size} "
                             f"and {t.shape[0]} rows")
        return splits

    def _count_alltoall(self, t: torch.Tensor, splits: list[int], kind: str | dict[str, int]) -> None:
        """Count the rows sent to other ranks, each column under its kind (see alltoall)."""
        rows = sum(s for j, s in enumerate(splits) if j != self.rank)
        cols = math.prod(t.shape[1:])
        kinds = {kind: cols} if isinstance(kind, str) else dict(kind)
        if sum(kinds.values()) != cols:
            raise ValueError(f"alltoall: kind columns {kinds} do not add up to {cols} columns")
        for i, (k, n) in enumerate(kinds.items()):
            self.counter.add(k, rows * n * t.element_size(), "alltoall" if i == 0 else None)

    def _count_allreduce(self, ts: Sequence[torch.Tensor], kind: str, op: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        self.counter.add(kind, 2.0 * (self.size - 1) / self.size * nbytes, op)

    def _guard(self, op: str, fn):
        """Run a collective; turn any backend failure (timeout, dead peer) into CollectiveError."""
        try:
            return fn()
        except CollectiveError:
            raise
        except Exception as exc:  # noqa: BLE001 - backends raise RuntimeError, DistBackendError...
            raise CollectiveError(
                f"collective '{op}' failed on rank {self.rank}/{self.size} "
                f"(timeout {self.timeout_s:g}s; a peer may have died or not called it): {exc}"
            ) from exc

    # ----- backend hooks ----------------------------------------------------------------------
    # Asynchronous hooks return a function that waits for completion and returns the result. The
    # defaults run the blocking hook at once (the local backend: nothing to overlap).
    def _alltoall_start(self, t: torch.Tensor, splits: list[int], recv_splits: list[int]):
        out = self._alltoall(t, splits, recv_splits)
        return lambda: out

    def _allreduce_start(self, ts: list[torch.Tensor], op: str):
        out = self._allreduce(ts, op)
        return lambda: out

    @abc.abstractmethod
    def _allreduce(self, ts: list[torch.Tensor], op: str) -> list[torch.Tensor]: ...

    @abc.abstractmethod
    def _alltoall(self, t: torch.Tensor, splits: list[int], recv_splits: list[int]) -> torch.Tensor: ...

    @abc.abstractmethod
    def _allgather(self, t: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _barrier(self) -> None: ...


class Handle:
    """A collective in flight. wait() returns its result (once; later calls return it again) and
    turns a backend failure or timeout into a CollectiveError naming the operation."""

    def __init__(self, comm: Collectives, op: str, finish) -> None:
        self._comm, self._op, self._finish = comm, op, finish
        self._done, self._value = False, None

    def wait(self):
        if not self._done:
            self._value = self._comm._guard(self._op, self._finish)
            self._done, self._finish = True, None
        return self._value


def flatten(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer of all tensors (same dtype), for a fused collective."""
    return torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone()


def unflatten(buf: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for t in like:
        out.append(buf[pos:pos + t.numel()].view_as(t))
        pos += t.numel()
    return out
