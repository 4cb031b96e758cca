"""Horovod backend (Gloo on CPU, NCCL on GPU, MPI when built with it) behind the Collectives interface.

Why a separate file: this is the only module of the trainer that imports horovod. Horovod ops have no
per-call timeout, and a peer that is alive but never joins an op makes `hvd.synchronize` block
forever (the stall inspector only warns). So every op is issued with the async API and polled against
a deadline; past it, TimeoutError is raised and the base class turns it into a CollectiveError naming
the operation. A dead peer makes Horovod shut down and ops raise HorovodInternalError (same path).

Horovod is initialised once per process and reused: a Hydra multirun under horovodrun calls
`make_collectives` once per job, and `close()` deliberately leaves Horovod running (Horovod's own
atexit hook shuts it down). Results are made bit-identical to the torch backend where the reduction
allows it: sums are reduced with op=Sum and "mean" divides afterwards, exactly as torch_dist does.
"""
from __future__ import annotations

import os
import time

import torch

from ..config import ConfigError, resolve_device
from .base import Collectives

try:  # import errors are re-raised with the fix in HorovodCollectives.__init__
    import horovod.torch as hvd
    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - ImportError, or an ABI mismatch with this torch
    hvd = None  # type: ignore[assignment]
    _IMPORT_ERROR = exc

LAUNCHER_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
POLL_S = 1e-4  # poll period of an op in flight (hvd.synchronize sleeps 100 us too)


def under_horovod_launcher() -> bool:
    """True when horovodrun (or mpirun, for an MPI build) started this process."""
    return any(k in os.environ for k in LAUNCHER_ENV)


def init_horovod(timeout_s: float) -> None:
    """hvd.init() once per process; later calls (next Hydra job) reuse the running Horovod."""
    if hvd is None:
        raise RuntimeError(f"comm.backend=horovod but horovod is not importable ({_IMPORT_ERROR!r}); "
                           "install it with `bash scripts/install_horovod.sh`")
    if hvd.is_initialized():
        return
    if not under_horovod_launcher():
        raise ConfigError("comm.backend=horovod needs a Horovod launcher: run "
                           "`horovodrun -np N -H host:N python -m trainer ...` (or use comm=auto, "
                           "which picks local/torch without one)")
    # Gloo's transport timeout is read at init only; never below the collectives' own deadline.
    if "HOROVOD_GLOO_TIMEOUT_SECONDS" not in os.environ:
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(max(30.0, timeout_s + 5.0)))
    # Horovod's response cache keys on op names; ours are unique per call (alltoall shapes change
    # every step), so the cache would only churn and warn about evictions. HOROVOD_* env wins.
    os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
    hvd.init()


class HorovodCollectives(Collectives):
    """Collectives over the global Horovod process set (one process per GPU / CPU worker)."""

    learns_splits = True  # hvd.alltoall negotiates the receive sizes itself (one collective)

    def __init__(self, timeout_s: float, device: str = "auto") -> None:
        """device: the run's train.device. On cuda each rank takes the GPU of its local rank, and
        the tensors stay there when Horovod was built with NCCL (on_gpu); a CPU run's tensors go
        through Gloo or MPI even on a host with GPUs."""
        init_horovod(timeout_s)
        super().__init__(hvd.rank(), hvd.size(), timeout_s, local_size=hvd.local_size())
        self.local_rank = hvd.local_rank()
        on_cuda = resolve_device(device) == "cuda"
        self.on_gpu = bool(hvd.nccl_built()) and on_cuda
        if on_cuda:  # one GPU per rank: device "cuda" means this rank's GPU
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        self.transport = "nccl" if self.on_gpu else ("gloo" if hvd.gloo_enabled() else "mpi")

    # ---- plumbing ----------------------------------------------------------------------------
    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        """Horovod wants contiguous tensors, on CPU unless it was built with NCCL."""
        if t.is_cuda and not self.on_gpu:
            t = t.cpu()
        return t.contiguous()

    def _wait(self, handle):
        """hvd.synchronize(handle), but raise TimeoutError past timeout_s instead of hanging."""
        deadline = time.monotonic() + self.timeout_s
        while not hvd.poll(handle):  # 100 us steps, as hvd.synchronize itself waits
            if time.monotonic() > deadline:
                raise TimeoutError(f"no completion within {self.timeout_s:g}s "
                                   "(a peer did not join the collective)")
            time.sleep(POLL_S)
        return hvd.synchronize(handle)

    def alltoall(self, t, splits, kind, recv_splits=None):
        """As Collectives.alltoall; unknown recv_splits come back from hvd.alltoall itself.

        Horovod exchanges the split sizes inside its alltoall, so the separate size exchange of
        the base class would be a second round trip. The bytes counted are the same as the base
        class counts (the split sizes as "meta", then the rows), so every backend reports
        identical counters.
        """
        if recv_splits is not None or self.size == 1:
            return super().alltoall(t, splits, kind, recv_splits)
        splits = self._check_splits(t, splits)
        self.counter.add("meta", (self.size - 1) * 8, "alltoall_splits")
        self._count_alltoall(t, splits, kind)
        return self._guard("alltoall", lambda: self._alltoall_any(t, splits))

    def _alltoall_any(self, t: torch.Tensor, splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        """(rows received [sum(recv), ...], recv splits) of hvd.alltoall with `splits`."""
        send_splits = torch.tensor(splits, dtype=torch.int32)
        out, got = self._wait(hvd.alltoall_async(self._dev(t), splits=send_splits))
        got = [int(x) for x in got.tolist()]
        return out.reshape((sum(got),) + tuple(t.shape[1:])).to(t.device), got

    # ---- backend hooks -------------------------------------------------------------------------
    def _allreduce(self, ts, op):
        return self._allreduce_start(ts, op)()

    def _allreduce_start(self, ts, op):
        if op not in ("sum", "mean"):
            raise ValueError(f"unsupported allreduce op {op!r}")
        handle = hvd.grouped_allreduce_async([self._dev(t) for t in ts], op=hvd.Sum)

        def finish() -> list[torch.Tensor]:
            outs = self._wait(handle)
            if op == "mean":  # divide after the sum, like the torch backend (bit-identical results)
                outs = [o / self.size if o.is_floating_point() else o // self.size for o in outs]
            return [o.to(t.device) for o, t in zip(outs, ts)]
        return finish

    def _alltoall(self, t, splits, recv_splits):
        return self._alltoall_start(t, splits, recv_splits)()

    def _alltoall_start(self, t, splits, recv_splits):
        handle = hvd.alltoall_async(self._dev(t), splits=torch.tensor(splits, dtype=torch.int32))

        def finish() -> torch.Tensor:
            out, got = self._wait(handle)
            got = [int(x) for x in got.tolist()]
            if got != list(recv_splits):
                raise RuntimeError(f"alltoall: received splits {got} but expected {list(recv_splits)}")
            return out.reshape((sum(got),) + tuple(t.shape[1:])).to(t.device)
        return finish

    def _allgather(self, t):
        out = self._wait(hvd.allgather_async(self._dev(t)))
        return out.to(t.device)

    def _broadcast(self, t, root):
        out = self._wait(hvd.broadcast_async(self._dev(t.clone()), root_rank=root))
        return out.to(t.device)

    def _barrier(self):
        # hvd.barrier() has no async form (so no deadline); a 1-element allreduce is a barrier too.
        self._wait(hvd.allreduce_async(torch.zeros(1), op=hvd.Sum))

    def close(self) -> None:
        """Keep Horovod initialised: the next Hydra job of a multirun reuses it (atexit shuts it)."""
