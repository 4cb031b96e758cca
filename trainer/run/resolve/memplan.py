"""The memory plan: what a rank will hold, known before it allocates, and a refusal when it cannot fit.

Why: the sparse side is most of a rank's memory and its size is known from the config alone (rows
per rank x bytes per row). A config that cannot fit used to fail in the allocator with a raw
traceback minutes into start-up (or take the host into swap); now every rank computes its plan,
rank 0 prints one line with it, and a rank whose plan exceeds the memory it can have stops every
rank with one error line (exit 2) naming the figures.

What is counted, per rank (docs/design.md, "bytes per row"):
- rows: local rows x (d x weight bytes + the sparse optimizer's state + 8 (version) + 1 (touched));
- the worker cache: its slots x (row + pending update + 5 int64) and its id -> slot map (a direct
  int32 array over the whole id space on the CPU while that is at most 16 ids per slot: 4 B per
  id, bounded by the cache's size; else a hash map sized by the slots: slotmap.uses_direct_map);
- the replica of hot rows (placement fae / sca): at most its budget_bytes;
- dynamic tables' count-min sketch (embedding.admit_counter=count_min): its counters (admission.py;
  exact counting grows with the ids not admitted yet, 32-86 B each, and is not planned);
- the best-model snapshot (validation with restore_best): its held flag (1 B per row), and in memory
  (train.early_stop.snapshot, snapshot_rows.in_memory) at most one copy of the rows' weights;
  dynamic tables add each slot's id and version at the snapshot (SNAPSHOT_SLOT_BYTES, 16 B per slot);
- the batch and the dense model's activations: an estimate (local batch x the widths of the MLPs);
- the padded step (train.cuda_graph=on at W = 1, trainer/step/whole_step.py): per slot of its padded
  plan, the workspace, its gradient and the update's rows before and after (4 x d float32) and
  the plan (17 B), held between steps by a CUDA graph's pool; at W > 1 (trainer/step/padded_step.py)
  per slot of its W blocks, the rows and gradients out and in, the workspace, its gradient, the
  owner's ordered gradients and sums (8 x d float32) and the request's integers (48 B); with the
  HET cache (fixed/het.py) 6 x d float32 and HET_ENTRY_BYTES more per entry, and the dirty
  evictions' block (the blocks at their bound: the first steps'); where its push blocks follow
  the traffic (train.unique_capacity != 0) the cache's journal of the step, 4 saves of each entry's
  slot (JOURNAL_SLOT_BYTES + 2 x d float32 each). Not with what runs the dense half only (dynamic tables).
Available: MemAvailable, or the room the process's memory cgroup leaves when it is less (v1 or v2,
the own cgroup and its ancestors: base/core/cgroup.py), shared by the ranks on this host; on a
GPU, the device's free memory.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ...base.config import Config, ConfigError, cache_capacities, local_batch_size, table_rows
from kernels import cells_bound
from ...sparse.embedding.dynamic.admission import Counting
from ...base.core.cgroup import memory_room
from ...sparse.embedding.fixed.het import HET_ENTRY_BYTES, JOURNAL_SLOT_BYTES
from ...sparse.embedding.fixed.padded import PLAN_SLOT_BYTES, REQUEST_SLOT_BYTES, unique_capacity
from ...sparse.embedding.dynamic.pool import pool_slot_bytes
from ...sparse.embedding.sharding import RowSharding
from ...sparse.embedding.cache.slotmap import map_bytes
from ...sparse.embedding.store.shard import VERSION_BYTES, row_dtype
from ...sparse.placement.plan import row_bytes
from ...sparse.placement.sca import slot_bytes
from ...base.core.progress import fmt_bytes
from ...base.core.snapshot_rows import SNAPSHOT_SLOT_BYTES, in_memory

ADVICE = {"rows": "more workers, embedding.dtype=fp16 or bf16 (half the weight bytes), smaller data.table_rows",
          "cache": "a smaller cache.capacity_fraction or cache.capacity_rows", "cache map": "cache=none",
          "replica": "a smaller placement.budget_bytes", "admission": "a smaller embedding.count_min_bytes",
          "best snapshot": "train.early_stop.snapshot=disk or restore_best=false",
          "batch": "a smaller data.batch_size or more workers",
          "padded step": "a smaller train.unique_capacity or data.batch_size, or train.cuda_graph=off"}


def state_bytes(dim: int, optimizer: str) -> int:
    """The sparse optimizer's state per row (float32): placement's row_bytes without the row."""
    return row_bytes(dim, optimizer, row_elem=0)


def weight_elem(c: Config) -> int:
    return row_dtype(c.embedding.dtype).itemsize


@dataclass
class MemoryPlan:
    """One rank's bytes by part; available memory and where that figure comes from."""
    rank: int
    world: int
    local_rows: int
    row_parts: dict[str, int]  # bytes per local row, by part
    parts: dict[str, int] = field(default_factory=dict)  # bytes, by part (rows first)
    available: int | None = None
    source: str = ""
    disk: int = 0  # embedding.store=disk: the shard's bytes in files (the rows part is then its RAM cache)

    @property
    def bytes_per_row(self) -> int:
        return sum(self.row_parts.values())

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        per = ", ".join(f"{k} {v} B" for k, v in self.row_parts.items() if v)
        rest = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.parts.items() if k != "rows" and v)
        avail = (f" of {fmt_bytes(self.available)} available ({self.source})" if self.available is not None
                 else f" ({self.source})")
        rows = (f"rows {self.local_rows:,} x {self.bytes_per_row} B ({per}) = {fmt_bytes(self.disk)} on disk, "
                f"RAM cache {fmt_bytes(self.parts['rows'])}" if self.disk else
                f"rows {self.local_rows:,} x {self.bytes_per_row} B ({per}) = {fmt_bytes(self.parts['rows'])}")
        return (f"memory plan, rank {self.rank}/{self.world}: {rows}" + (f", {rest}" if rest else "")
                + f"; total {fmt_bytes(self.total)}{avail}")

    def record(self) -> dict[str, Any]:
        return {"local_rows": self.local_rows, "bytes_per_row": self.bytes_per_row, "row_parts": self.row_parts,
                "parts": self.parts, "total": self.total, "available": self.available, "source": self.source,
                "disk": self.disk}


def row_parts(c: Config, device: torch.device, local: int) -> dict[str, int]:
    """Bytes per local row by part, for `local` rows on `device` (dynamic tables: a pool slot)."""
    d = c.model.embedding_dim
    parts = {"weight": d * weight_elem(c), c.optim.sparse: state_bytes(d, c.optim.sparse),
             "version": VERSION_BYTES, "touched": 1}
    if c.embedding.kind == "dynamic":
        parts["pool"] = pool_slot_bytes(device, local)
    return parts


def capacity_for_budget(c: Config, device: torch.device) -> int:
    """embedding.capacity_bytes: the most rows per table (0 if not even one) whose pools, over
    every table, fit the owner's budget at their bytes per slot (row_parts; the CPU map's share
    per slot depends on the slots, so the answer is searched, not divided)."""
    tables, budget = len(table_rows(c)), c.embedding.capacity_bytes

    def fits(cap: int) -> bool:
        return tables * cap * sum(row_parts(c, device, max(tables * cap, 1)).values()) <= budget

    floor = sum(v for k, v in row_parts(c, device, 1).items() if k != "pool")  # a slot costs more
    lo, hi = 0, budget // (tables * floor) + 1  # 0 rows fit, hi rows cannot
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_memory(c: Config, world: int, rank: int, device: torch.device = torch.device("cpu")) -> MemoryPlan:
    """The plan of rank `rank` of `world` on `device` (no allocation: the sharding's offsets only)."""
    rows = table_rows(c)
    d = c.model.embedding_dim
    dynamic = c.embedding.kind == "dynamic"  # a pool of embedding.capacity rows per table
    local = len(rows) * c.embedding.capacity if dynamic else RowSharding(rows, world, rank).local_rows
    plan = MemoryPlan(rank, world, local, row_parts(c, device, local))
    plan.parts["rows"] = local * plan.bytes_per_row
    if c.embedding.store == "disk":  # the rows in files; in RAM, the cache (check_memory sizes the default)
        plan.disk = plan.parts["rows"]
        plan.parts["rows"] = min(c.embedding.store_cache_bytes, plan.disk)
    slots = sum(cache_capacities(c))
    if slots:
        plan.parts["cache"] = slots * slot_bytes(d)
        n_ids = sum(-(-n // world) * world for n in rows)
        # dynamic tables: the hash map (ids of 2^56)
        plan.parts["cache map"] = 16 * cells_bound(slots) if dynamic else map_bytes(n_ids, slots, device)
    if c.placement.name in ("fae", "sca"):
        plan.parts["replica"] = int(c.placement.budget_bytes)
    sketch = Counting.of(c.embedding).sketch_bytes_held() if dynamic and c.embedding.admit_after > 1 else 0
    if sketch:
        plan.parts["admission"] = sketch
    if c.train.early_stop.restore_best and (c.data.val_fraction or 0) > 0:  # its held flags + the rows in memory
        kept = in_memory(c.train.early_stop.snapshot, local, d * weight_elem(c))
        plan.parts["best snapshot"] = local * (1 + (d * weight_elem(c) if kept else 0)
                                               + (SNAPSHOT_SLOT_BYTES if dynamic else 0))
    widths = [c.data.num_dense] + list(c.model.bottom_mlp) + list(c.model.top_mlp or []) + [d * len(rows)]
    ids_per_sample = len(rows) * max(c.data.max_bag, 1)
    plan.parts["batch"] = local_batch_size(c, world) * (sum(widths) * 4 * 4 + ids_per_sample * 8 * 4)
    # the fixed-shape mode (fixed/shapes.py without_fixed_shapes: not with dynamic tables or the
    # audit at W = 1, which run the dense half only)
    fixed = not dynamic and not (world == 1 and c.embedding.audit)
    if c.train.cuda_graph == "on" and fixed:
        herald = c.schedule.name == "herald" and c.schedule.on_demand_sync  # Herald's protocol, not HET's
        het = world > 1 and c.cache.policy != "none" and not herald  # the HET cache's blocks
        slots = unique_capacity(local_batch_size(c, world), max(c.data.max_bag, 1), rows, c.train.unique_capacity,
                                world)
        plan.parts["padded step"] = (slots * (4 * d * 4 + PLAN_SLOT_BYTES) if world == 1 else
                                     world * slots * (8 * d * 4 + REQUEST_SLOT_BYTES))
        if het:  # per entry the cache's rows and pending gradients read (2 x d), the push's gradient
            # and its packed copy out and in (4 x d), the versions, slots and counts; per owner
            # (W - 1) x C entries more for the dirty evictions (fixed/het.py)
            evicts = world * (world - 1) * slots
            plan.parts["padded step"] += world * slots * (6 * d * 4 + HET_ENTRY_BYTES) + evicts * (4 * d * 4 + 24)
            if c.train.unique_capacity != 0:  # the journal that undoes a step whose push block overflows
                plan.parts["padded step"] += world * slots * 4 * (JOURNAL_SLOT_BYTES + 2 * d * 4)
        if c.placement.name in ("fae", "sca"):  # the replica block: its workspace and gradient, fp32
            hot = int(c.placement.budget_bytes) // (d * weight_elem(c))  # at most this many rows fit the budget
            plan.parts["padded step"] += hot * d * 4 * 2
    return plan


def store_cache_bytes(c: Config, available: int | None, disk: int) -> int:
    """embedding.store=disk: the RAM cache of a shard of `disk` bytes: embedding.store_cache_bytes,
    or a quarter of the memory the rank may have (1 GiB's quarter when that is unknown); never more
    than the shard."""
    return min(c.embedding.store_cache_bytes or (available or 1 << 30) // 4, max(disk, 1))


def tier_page_bytes(cache: int) -> int:
    """embedding.store=disk: the part of a RAM cache of `cache` bytes that holds the files' pages
    being read into the row buffer or written back from it (store/tier/disk.py); the rest holds rows
    (tiered.py). An eighth, at least 16 MiB (a step's misses and write-backs), at most half."""
    return max(min(16 << 20, cache // 2), cache // 8)


def available_memory(device: torch.device, local_ranks: int | None) -> tuple[int | None, str]:
    """(bytes this rank may use, where the figure comes from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    avail, source = _meminfo("MemAvailable"), "MemAvailable"
    room = memory_room()  # the process's own memory cgroup, v1 or v2 (base/core/cgroup.py)
    if room is not None and (avail is None or room.bytes < avail):
        avail, source = room.bytes, f"the memory cgroup {room.where}'s limit {fmt_bytes(room.limit)} less its use"
    if avail is None:
        return None, "available memory unknown"
    n = max(local_ranks or 1, 1)
    return avail // n, (f"{source} / {n} ranks on this host" if n > 1 else source)


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(c: Config, comm: Any, device: torch.device) -> MemoryPlan:
    """Every rank's plan against its memory; rank 0 prints its line. A rank that cannot fit stops
    every rank with a ConfigError naming the figures (train.memory_check=false: a warning only).
    Collective."""
    plan = plan_memory(c, comm.size, comm.rank, device)
    plan.available, plan.source = available_memory(device, comm.local_size)
    if plan.disk and not c.embedding.store_cache_bytes:
        plan.parts["rows"] = store_cache_bytes(c, plan.available, plan.disk)

    def fits() -> MemoryPlan:
        if plan.available is not None and plan.total > plan.available:
            big = max(plan.parts, key=plan.parts.get)
            msg = (f"{plan.line()}: the plan needs {fmt_bytes(plan.total - plan.available)} more than this "
                   f"rank can have; the largest part is {big} ({ADVICE[big]}); "
                   f"train.memory_check=false starts anyway")
            if c.train.memory_check:  # every rank raises: exit 2, one line
                raise ConfigError(msg)
            print(f"[trainer] warning: {msg}", file=sys.stderr, flush=True)
        return plan
    comm.all_succeed("memory plan", fits, ConfigError)
    if comm.rank == 0:
        print(f"[trainer] {plan.line()}", file=sys.stderr, flush=True)  # stdout: the JSON lines
    return plan
