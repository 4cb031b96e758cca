"""Values derived from a config: the run's device and transport, rows per table, cache capacities,
staleness bounds, batch sizes, the validation split, threads."""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional

from .errors import _check
from .schema import FILE_DATASETS, Config, TableCacheConfig


def epoch_steps(c: Config, train_rows: int, world: int) -> Optional[int]:
    """The train.steps that data.epochs asks for: ceil(epochs x training rows / global batch) at W =
    world (at least 1); None when data.epochs is 0 or the data is a synthetic stream (train.steps
    stands). Only a file dataset knows its training rows, and only a run knows W."""
    if c.data.epochs <= 0 or c.data.name not in FILE_DATASETS:
        return None
    return max(1, math.ceil(c.data.epochs * train_rows / (local_batch_size(c, world) * world)))


def val_range(n: int, fraction: float, slice_: int = 1) -> tuple[int, int]:
    """[lo, hi) of the validation rows among n training rows: slice `slice_` (1 = the last) of
    val_rows(n, fraction) rows, counted from the end; (n, n) without a validation split."""
    k = val_rows(n, fraction)
    _check(slice_ * k <= n or not k, "data.val_slice", slice_,
           f"slice {slice_} of {k} validation rows counted from the end does not fit in {n} training rows "
           f"(at most {n // k} slices)" if k else "")
    return (n - slice_ * k, n - (slice_ - 1) * k) if k else (n, n)


def val_rows(n: int, fraction: float) -> int:
    """Rows of n training rows that data.val_fraction carves off as the validation split: floor(f x n)
    (at least 1 when f > 0); a ConfigError when nothing would be left to train on. Rounded down so
    that 1 / f slices of it always fit in the n rows (train.ensemble's members validate on slices 1..5 of
    20%): rounded up, 5,001 rows would give slices of 1,001 rows and room for only four."""
    if not fraction:
        return 0
    k = max(1, math.floor(fraction * n + 1e-9))
    _check(k < n, "data.val_fraction", fraction, f"leaves no training rows of the {n} there are")
    return k


def needs_global_view(c: Config) -> bool:
    """Placement or a schedule other than random: every rank reads every global batch's ids."""
    return c.placement.name != "none" or c.schedule.name != "random"


def resolve_device(device: str) -> str:
    """"cuda" or "cpu": the run's device for a train.device value. The one rule (auto: cuda when a
    CUDA device is visible, else cpu); everything that asks "does this run use the GPU" asks it
    here: the trainer's torch.device (build.device_of), the collectives' transport
    (dist_transport, Horovod's on-GPU path), the DALI pipeline's GPU, the kernels' backend and
    the memory plan checked before start-up."""
    return "cuda" if device == "cuda" or (device == "auto" and _cuda_available()) else "cpu"


def run_device(c: Config) -> str:
    """"cuda" or "cpu": the device of the run c describes (resolve_device(c.train.device))."""
    return resolve_device(c.train.device)


def dist_transport(dist_backend: str, device: str, gpus_shared: bool = False) -> str:
    """comm.dist_backend resolved for a run on `device` ("cuda" or "cpu", resolve_device): gloo or
    nccl as named; auto is nccl exactly when the run's device is cuda and every rank of this host
    has a GPU of its own, else gloo. gpus_shared: ranks of this host would share a GPU (more
    ranks than GPUs, or no local rank to pick one by), which NCCL refuses ("Duplicate GPU
    detected"); gloo then carries the collectives through host memory."""
    if dist_backend != "auto":
        return dist_backend
    return "nccl" if device == "cuda" and not gpus_shared else "gloo"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cache_capacities(c: Config) -> list[int]:
    """Rows each worker may cache per table (0 everywhere when cache.policy is none)."""
    rows = table_rows(c)
    if c.cache.policy == "none":
        return [0] * len(rows)
    out = []
    for t, n in enumerate(rows):
        o = c.cache.tables.get(str(t), TableCacheConfig())
        cap_rows = o.capacity_rows if o.capacity_rows is not None else (
            None if o.capacity_fraction is not None else c.cache.capacity_rows)
        frac = o.capacity_fraction if o.capacity_fraction is not None else c.cache.capacity_fraction
        out.append(min(n, cap_rows) if cap_rows is not None else int(frac * n))
    return out


def staleness_bounds(c: Config) -> tuple[list[int], list[int]]:
    """(pull_bound, push_bound) per table, overrides applied; -1 = unbounded."""
    n = len(c.data.table_rows)
    pull, push = [c.consistency.pull_bound] * n, [c.consistency.push_bound] * n
    for key, t in c.consistency.tables.items():
        i = int(key)
        pull[i] = t.pull_bound if t.pull_bound is not None else pull[i]
        push[i] = t.push_bound if t.push_bound is not None else push[i]
    return pull, push


def table_rows(c: Config) -> list[int]:
    """Rows per table of the model: after the cap, or data.hash_rows each (ids hashed into them)."""
    if c.data.hash_rows > 0:
        return [c.data.hash_rows] * len(c.data.table_rows)
    return source_rows(c)


def source_rows(c: Config) -> list[int]:
    """Rows per table the data draws its ids from, after the cap (before data.hash_rows)."""
    cap = c.data.max_table_rows
    return [min(n, cap) if cap > 0 else n for n in c.data.table_rows]


def local_batch_size(c: Config, world: int) -> int:
    """Samples per rank per step, from batch_size or global_batch_size."""
    g = c.data.global_batch_size
    if g is None:
        return c.data.batch_size
    _check(g % world == 0, "data.global_batch_size", g, f"must be divisible by the world size {world}")
    return g // world


def auto_threads(c: Config, env: Optional[Mapping[str, str]] = None) -> int:
    """torch threads per rank: the configured value, or the CPUs this rank may use: a Slurm task's
    own (SLURM_CPUS_PER_TASK), else the CPUs this process may run on (its affinity: taskset, a
    container's cpuset), no more than a Slurm step's share of the node (SLURM_CPUS_ON_NODE), divided
    among this host's ranks (LOCAL_WORLD_SIZE, which srun's tasks take from Slurm: load.adopt_slurm).
    More threads than CPUs make every rank's steps wait on the others' (a Slurm node's cores the
    job was not given, or two ranks' threads on one core)."""
    if c.train.threads > 0:
        return c.train.threads
    env = os.environ if env is None else env
    step = "SLURM_STEP_ID" in env
    if step and env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return max(1, int(env["SLURM_CPUS_PER_TASK"]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if step and env.get("SLURM_CPUS_ON_NODE", "").isdigit():
        cpus = min(cpus, int(env["SLURM_CPUS_ON_NODE"]))
    local = int(env.get("LOCAL_WORLD_SIZE", env.get("HOROVOD_LOCAL_SIZE", "1")))
    return max(1, cpus // max(local, 1))
