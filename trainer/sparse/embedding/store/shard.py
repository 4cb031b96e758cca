"""The owner's shard: its rows of every table, in one [local_rows, d] tensor, plus optimizer state.

Why one tensor: the pooled-gather kernels read one storage with one slot space, and the fused
global id space (sharding.py) makes a row's storage slot simply gid div W.
Row init is a pure function of (seed, table, id), so any world size starts from the same tables.

Row precision (embedding.dtype): the rows are stored as float32, float16 or bfloat16 (ROW_DTYPES);
everything else of a row stays as it is (the optimizer state float32, the version int64), so half
precision halves the rows' bytes and no more (bytes_per_row). Initial rows are computed in float32
and rounded to nearest; updates are computed in float32 and written back by the run's rounding rule
(optim.py). Readers get the stored values (`rows`) and upcast them where they compute: float32
holds every half value exactly, so a read loses nothing.

`touched` marks the rows written since it was last cleared (an owner update, a row put back by a
replica or a holder): the in-memory best-model snapshot (trainer/run/evaluation/best.py) copies only those rows,
and puts a row it never saw back to its initial value, recomputed from (seed, table, id).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

import kernels
from ....workload.data import rng
from ..optim import Rounding, SparseOptimizer, make_sparse_optimizer
from ..sharding import Sharding

if TYPE_CHECKING:
    from .tier.disk import DiskTier

_S_INIT = 77
ROW_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # embedding.dtype
VERSION_BYTES = 8  # int64 per row


def row_dtype(name: str) -> torch.dtype:
    """torch dtype of embedding.dtype `name`."""
    try:
        return ROW_DTYPES[name]
    except KeyError:
        raise ValueError(f"embedding.dtype={name!r} is not one of {', '.join(ROW_DTYPES)}") from None


_INIT_CHUNK_ROWS = 1 << 18  # rows hashed at once: bounds init's temporaries to ~100 MB at d = 16


def init_rows(seed: int, table_rows: list[int], dim: int, table: torch.Tensor, ids: torch.Tensor,
              scale: float | None) -> torch.Tensor:
    """[len(ids), dim] float32 initial rows: U(-s, s), s = scale, or sqrt(1 / rows of the table) when
    scale is 0 or None.
    Element (t, i, k) is a pure function of (seed, t, i, k); computed in chunks of rows, so the
    hashing's uint64/float64 temporaries never exceed a chunk (26 x 1M rows peaked at 15 GB whole)."""
    starts = np.cumsum([0] + list(table_rows[:-1])).astype(np.int64)
    sizes = np.asarray(table_rows, dtype=np.float64)
    t_all, i_all = table.numpy(), ids.numpy()
    out = np.empty((t_all.size, dim), dtype=np.float32)
    for lo in range(0, t_all.size, _INIT_CHUNK_ROWS):
        t, i = t_all[lo:lo + _INIT_CHUNK_ROWS], i_all[lo:lo + _INIT_CHUNK_ROWS]
        key = (starts[t] + i)[:, None] * dim + np.arange(dim)[None, :]
        u = rng.uniform(seed, _S_INIT, key)
        s = np.full(t.size, scale, dtype=np.float64) if scale else np.sqrt(1.0 / sizes[t])
        out[lo:lo + t.size] = (2.0 * u - 1.0) * s[:, None]
    return torch.from_numpy(out)


class ShardStore:
    """Rows owned by this rank and their optimizer; `step` applies one update per row."""

    dynamic = False  # dynamic.DynamicStore: rows in a pool found by id, admitted by admit()

    def __init__(self, sharding: Sharding, dim: int, seed: int, init_scale: float | None,
                 optimizer: str, lr: float, eps: float, device: torch.device,
                 accumulator_init: float = 0.0, weight_decay: float = 0.0,
                 dtype: torch.dtype = torch.float32, rounding: Rounding | None = None,
                 initialise: bool = True, tier: "DiskTier | None" = None) -> None:
        """dtype: the rows' (float32, float16, bfloat16); rounding: how updated half rows are
        written back (default: stochastic, seeded by `seed`). initialise=False: zeros instead of
        the initial rows, for a run about to load every row from a checkpoint (the loader checks
        that it wrote every row this rank owns); hashing the initial rows was half a resume's time.
        tier: embedding.store=disk, the files every array of the shard lives in (tier/disk.py)."""
        self.sharding, self.dim = sharding, dim
        self.seed, self.init_scale = seed, init_scale
        self.tier = tier
        self.dtype, self.device = dtype, torch.device(device)  # the rows' (what `weight` holds, where)
        rows = sharding.local_rows
        if tier is not None:
            weight = tier.alloc("weight", (rows, dim), dtype)  # zeros: a sparse file
        else:
            weight = (torch.empty if initialise else torch.zeros)(rows, dim, dtype=dtype, device=device)
        for lo in range(0, rows if initialise else 0, _INIT_CHUNK_ROWS):  # one chunk at a time
            idx = torch.arange(lo, min(lo + _INIT_CHUNK_ROWS, rows), dtype=torch.int64)
            if tier is not None:  # in sequential pieces, around the file's mapping (tier/records.py)
                tier.write(idx, {"weight": self._initial(idx).to(dtype)})
            else:
                weight[lo:lo + idx.numel()] = self._initial(idx).to(device, dtype)
            self.release()
        self.weight = weight
        zeros = (lambda name, dt: tier.alloc(name, (rows,), dt)) if tier is not None else \
            (lambda name, dt: torch.zeros(rows, dtype=dt, device=device))
        self.version = zeros("version", torch.int64)  # updates applied
        self.touched = zeros("touched", torch.bool)  # written since cleared
        self.rounding = rounding if rounding is not None else Rounding("stochastic", seed)
        alloc = (lambda shape, dt, fill: tier.alloc("state", shape, dt, fill)) if tier is not None else None
        self.optimizer: SparseOptimizer = make_sparse_optimizer(optimizer, self.weight, lr, eps,
                                                                 accumulator_init, weight_decay,
                                                                 self.row_keys, self.rounding, alloc)

    # ---- embedding.store=disk's hooks: no-ops in memory (tiered.TieredStore has them) -------
    def tick(self, step: int) -> None:
        """A training step begins."""

    def prefetch(self, gids: torch.Tensor) -> None:
        """Owned gids a coming step reads or updates: their rows may start coming from the disk."""

    def prefetch_local(self, local_idx: torch.Tensor) -> None:
        """prefetch, of storage rows local_idx."""

    def ready(self) -> None:
        """The step is about to read the shard: wait for what was read ahead."""

    def release(self) -> None:
        """After a phase that touched the shard outside the steps (init, a checkpoint, an
        evaluation, a snapshot): what it brought into this process's memory may leave."""

    def store_record(self) -> dict:
        """summary.json's `store` block (this rank's)."""
        return {"kind": "memory"}

    def mark_all_touched(self, value: bool) -> None:
        """Set every row's touched mark (the best-model snapshot clears them after each copy)."""
        self.touched.fill_(value)

    @contextlib.contextmanager
    def raw(self, write: bool) -> Iterator[None]:
        """A phase that reads (write=False: a save, a gather of the shard) or also writes (a load,
        a snapshot's restore) `weight`, `version`, `touched` and the optimizer's state directly,
        not through rows/apply/put. In memory there is nothing to do; a store with a row buffer in
        front of them (tiered.py) writes its changed rows back first, and after a write forgets
        what it holds."""
        yield

    @property
    def compute_dtype(self) -> torch.dtype:
        """What rows are read into for computing (the workspace, a cached copy): float32 for half
        rows, which it holds exactly; float64 stays float64."""
        return kernels.reference.accumulation_dtype(self.dtype)

    def row_keys(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n] flat ids of storage rows local_idx: their identity at any W (the rounding's key)."""
        s = self.sharding
        return s.to_flat(s.global_of(local_idx, s.rank))

    def bytes_per_row(self) -> dict[str, int]:
        """What one row costs its owner, by part: the row itself (dim x its element size), the
        optimizer state (float32 values: 0 for SGD, 1 for row-wise Adagrad, dim for Adagrad),
        its version (int64); and the total."""
        row = self.dim * torch.empty(0, dtype=self.dtype).element_size()
        st = self.optimizer.state
        state = 0 if st is None else (st[0].numel() if st.dim() > 1 else 1) * st.element_size()
        return {"row": row, "state": state, "version": VERSION_BYTES, "total": row + state + VERSION_BYTES}

    def initial_rows(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n, d] initial values of storage rows local_idx (real rows; padding rows are zeros)."""
        return self._initial(local_idx.cpu()).to(self.device, self.dtype)

    def _initial(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n, d] float32 on the CPU: initial rows of storage rows local_idx (CPU int64), zeros for
        padding rows. Needs O(n) memory, never O(local rows)."""
        gids = self.sharding.global_of(local_idx, self.sharding.rank)
        table, ids = self.sharding.decode(gids)
        out = torch.zeros(local_idx.numel(), self.dim)
        at = torch.nonzero(self.sharding.valid(gids)).squeeze(1)
        if at.numel():
            out[at] = init_rows(self.seed, self.sharding.table_rows, self.dim, table[at], ids[at], self.init_scale)
        return out

    def slots(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] storage rows of owned gids (every one must have a row)."""
        return self.sharding.local_index(gids)

    def rows(self, gids: torch.Tensor) -> torch.Tensor:
        """[n, d] current rows of owned gids, as stored (embedding.dtype)."""
        return self.local_rows(self.sharding.local_index(gids))

    def local_rows(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n, d] current rows of storage rows local_idx, as stored."""
        return self.weight.index_select(0, local_idx)

    def versions(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n] current versions (updates applied) of storage rows local_idx."""
        return self.version.index_select(0, local_idx)

    def apply(self, gids: torch.Tensor, grads: torch.Tensor, unique: bool = False,
              counts: torch.Tensor | None = None, lives: torch.Tensor | None = None) -> None:
        """Sum grads [n, d] per row, update each touched row once (kernels.row_update: Triton on
        CUDA, the reference on CPU), and advance its version by the number of updates folded into
        it (counts [n], default 1 each). unique=True: gids are known to be distinct, skip the sum.
        lives: the pushes' lives (Pushes.lives): a fixed row has one life, so they are not read."""
        if gids.numel() == 0:
            return
        idx = self.sharding.local_index(gids)
        _update(self.optimizer, self.version, self.touched, idx, grads, unique,
                torch.ones_like(idx) if counts is None else counts)

    def apply_masked(self, idx: torch.Tensor, grads: torch.Tensor, mask: torch.Tensor,
                     zero_outside: bool = False, counts: torch.Tensor | None = None) -> None:
        """The fixed-size owner update of a padded plan (padded.py): distinct storage rows idx [C]
        take grads [C, d] where mask [C] is True; the others (padding) keep their row, state,
        version and touched mark exactly. The same arithmetic as apply(unique=True) on the
        masked rows; no size depends on the mask. zero_outside: grads are exactly zero where mask
        is False (a padded plan's workspace gradient); when a zero step leaves a row as it is
        (kernels.reference.zero_step_is_identity) the optimizer then runs unmasked: no select.
        counts [C]: the updates folded into each row, its version's advance (default: the mask);
        zero where the mask is False."""
        _update_masked(self.optimizer, self.version, self.touched, idx, grads, mask, zero_outside, counts)

    # ---- whole rows with their optimizer state (replicas and lent rows come and go) ---------
    @property
    def state_width(self) -> int:
        """Optimizer state values per row (0 for SGD)."""
        s = self.optimizer.state
        return 0 if s is None else (s.shape[1] if s.dim() == 2 else 1)

    def state_rows(self, gids: torch.Tensor) -> torch.Tensor:
        """[n, state_width] optimizer state of owned gids."""
        s = self.optimizer.state
        idx = self.slots(gids)
        if s is None:
            return torch.zeros(idx.numel(), 0, dtype=self.compute_dtype, device=self.device)
        return s.index_select(0, idx).reshape(idx.numel(), self.state_width)

    def put(self, gids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None = None,
            updates: torch.Tensor | None = None) -> None:
        """Take owned rows back from a holder: values [n, d] (any float type holding values of the
        rows' type: a copy), optimizer state [n, state_width] (None: keep), and advance versions
        by the updates [n] the holder applied (None: 0)."""
        _put(self.weight, self.optimizer.state, self.version, self.touched, self.slots(gids), rows, state, updates)


# ---- a shard's arithmetic on its arrays (the same on a row buffer's: tiered.py) ------------------
def _update(opt: SparseOptimizer, version: torch.Tensor, touched: torch.Tensor, idx: torch.Tensor,
            grads: torch.Tensor, unique: bool, counts: torch.Tensor) -> None:
    """opt's rows idx take grads (summed per row unless unique); versions += counts; touched."""
    opt.step(idx, grads, unique=unique)
    version.index_add_(0, idx, counts)
    touched.index_fill_(0, idx, True)


def _update_masked(opt: SparseOptimizer, version: torch.Tensor, touched: torch.Tensor, idx: torch.Tensor,
                   grads: torch.Tensor, mask: torch.Tensor, zero_outside: bool,
                   counts: torch.Tensor | None = None) -> None:
    """ShardStore.apply_masked's arithmetic on opt's rows."""
    plain = zero_outside and kernels.reference.zero_step_is_identity(opt.name, opt.lr, opt.eps, opt.weight_decay)
    opt.step(idx, grads, unique=True, mask=None if plain else mask)
    version.index_add_(0, idx, mask.long() if counts is None else counts)
    touched.index_copy_(0, idx, touched.index_select(0, idx) | mask)


def _put(weight: torch.Tensor, state: torch.Tensor | None, version: torch.Tensor, touched: torch.Tensor,
         idx: torch.Tensor, rows: torch.Tensor, got_state: torch.Tensor | None,
         updates: torch.Tensor | None) -> None:
    """ShardStore.put's copy into rows idx of these arrays."""
    weight.index_copy_(0, idx, rows.to(weight.dtype))
    touched.index_fill_(0, idx, True)
    if got_state is not None and state is not None:
        state.index_copy_(0, idx, got_state.reshape((-1,) + tuple(state.shape[1:])).to(state.dtype))
    if updates is not None:
        version.index_add_(0, idx, updates)
