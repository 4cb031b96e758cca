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
replica or a holder): the in-memory best-model snapshot (trainer/evaluation/best.py) copies only those rows,
and puts a row it never saw back to its initial value, recomputed from (seed, table, id).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

import kernels
from ..data import rng
from .optim import Rounding, SparseOptimizer, make_sparse_optimizer
from .sharding import Sharding

if TYPE_CHECKING:
    from .tier import DiskTier

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
        tier: embedding.store=disk, the files every array of the shard lives in (tier.py)."""
        self.sharding, self.dim = sharding, dim
        self.seed, self.init_scale = seed, init_scale
        self.tier = tier
        rows = sharding.local_rows
        if tier is not None:
            weight = tier.alloc("weight", (rows, dim), dtype)  # zeros: a sparse file
        else:
            weight = (torch.empty if initialise else torch.zeros)(rows, dim, dtype=dtype, device=device)
        for lo in range(0, rows if initialise else 0, _INIT_CHUNK_ROWS):  # one chunk at a time
            idx = torch.arange(lo, min(lo + _INIT_CHUNK_ROWS, rows), dtype=torch.int64)
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

    # ---- embedding.store=disk: the tier's hooks (no-ops in memory) -------------------------
    def tick(self, step: int) -> None:
        """A training step begins (the RAM cache's clock)."""
        if self.tier is not None:
            self.tier.tick(step)

    def prefetch(self, gids: torch.Tensor) -> None:
        """Owned gids a coming step reads or updates: their rows start coming from the disk."""
        if self.tier is not None and gids.numel():
            self.tier.prefetch(self.sharding.local_index(gids))

    def prefetch_local(self, local_idx: torch.Tensor) -> None:
        """prefetch, of storage rows local_idx."""
        if self.tier is not None and local_idx.numel():
            self.tier.prefetch(local_idx)

    def ready(self) -> None:
        """The step is about to read the shard: wait for its prefetches."""
        if self.tier is not None:
            self.tier.ready()

    def release(self) -> None:
        """After a phase that touched the shard outside the steps (init, a checkpoint, an
        evaluation, a snapshot): what it mapped leaves this process (tier.release)."""
        if self.tier is not None:
            self.tier.release()

    @property
    def compute_dtype(self) -> torch.dtype:
        """What rows are read into for computing (the workspace, a cached copy): float32 for half
        rows, which it holds exactly; float64 stays float64."""
        return kernels.reference.accumulation_dtype(self.weight.dtype)

    def row_keys(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n] flat ids of storage rows local_idx: their identity at any W (the rounding's key)."""
        s = self.sharding
        return s.to_flat(s.global_of(local_idx, s.rank))

    def bytes_per_row(self) -> dict[str, int]:
        """What one row costs its owner, by part: the row itself (dim x its element size), the
        optimizer state (float32 values: 0 for SGD, 1 for row-wise Adagrad, dim for Adagrad),
        its version (int64); and the total."""
        row = self.dim * self.weight.element_size()
        st = self.optimizer.state
        state = 0 if st is None else (st[0].numel() if st.dim() > 1 else 1) * st.element_size()
        return {"row": row, "state": state, "version": VERSION_BYTES, "total": row + state + VERSION_BYTES}

    def initial_rows(self, local_idx: torch.Tensor) -> torch.Tensor:
        """[n, d] initial values of storage rows local_idx (real rows; padding rows are zeros)."""
        return self._initial(local_idx.cpu()).to(self.weight.device, self.weight.dtype)

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
        self.ready()
        return self.weight.index_select(0, self.sharding.local_index(gids))

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
        self.ready()
        idx = self.sharding.local_index(gids)
        self.optimizer.step(idx, grads, unique=unique)
        self.version.index_add_(0, idx, torch.ones_like(idx) if counts is None else counts)
        self.touched.index_fill_(0, idx, True)

    def apply_masked(self, idx: torch.Tensor, grads: torch.Tensor, mask: torch.Tensor,
                     zero_outside: bool = False) -> None:
        """The fixed-size owner update of a padded plan (padded.py): distinct storage rows idx [C]
        take grads [C, d] where mask [C] is True; the others (padding) keep their row, state,
        version and touched mark exactly. The same arithmetic as apply(unique=True) on the
        masked rows; no size depends on the mask. zero_outside: grads are exactly zero where mask
        is False (a padded plan's workspace gradient); when a zero step leaves a row as it is
        (kernels.reference.zero_step_is_identity) the optimizer then runs unmasked: no select."""
        opt = self.optimizer
        plain = zero_outside and kernels.reference.zero_step_is_identity(opt.name, opt.lr, opt.eps, opt.weight_decay)
        opt.step(idx, grads, unique=True, mask=None if plain else mask)
        self.version.index_add_(0, idx, mask.long())
        self.touched.index_copy_(0, idx, self.touched.index_select(0, idx) | mask)

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
            return torch.zeros(idx.numel(), 0, dtype=self.compute_dtype, device=self.weight.device)
        return s.index_select(0, idx).reshape(idx.numel(), self.state_width)

    def put(self, gids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None = None,
            updates: torch.Tensor | None = None) -> None:
        """Take owned rows back from a holder: values [n, d] (any float type holding values of the
        rows' type: a copy), optimizer state [n, state_width] (None: keep), and advance versions
        by the updates [n] the holder applied (None: 0)."""
        idx = self.slots(gids)
        self.weight.index_copy_(0, idx, rows.to(self.weight.dtype))
        self.touched.index_fill_(0, idx, True)
        s = self.optimizer.state
        if state is not None and s is not None:
            s.index_copy_(0, idx, state.reshape((-1,) + tuple(s.shape[1:])).to(s.dtype))
        if updates is not None:
            self.version.index_add_(0, idx, updates)
