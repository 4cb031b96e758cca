"""FixedShapes: the sparse half of a training step at shapes the config fixes (train.cuda_graph=on),
the fixed-shape mode of HybridEmbedding beside its exact-size one (module.py), which it holds.

Why: the exact-size lookup (exchange.plan_lookup) sizes its plan, its alltoalls and every tensor
after them by the batch's unique ids, a count read back from the device each step; a CUDA graph
replays fixed shapes and reads nothing back. Here every size is set by the config: the lookup plan
is padded to a capacity (padded.py: padded_plan at W = 1, padded_request / padded_combine at W > 1),
so the steps that capture (trainer/step/whole_step.py at W = 1, padded_step.py at W > 1) call this
object for the whole sparse half and hold no plan, collective or owner update of their own.

W = 1 (the whole step, one function): `whole_rows` gives the padded plan, the workspace leaf and
the pooled rows of the padded ids; `whole_update` the owner's masked update (ShardStore.apply_masked).
The step calls both inside its one function (lookup, model, backward, update: captured whole).
Replicated rows at W = 1: the workspace's last H rows are the replica; the rows the batch touched
(a mask) take their gradient, the exact-size mode's reduce at W = 1 (the global batch is this
rank's: its hot rows are the touched ones, and a sum over one rank is the value itself).

W > 1: `lookup` / `begin_update` / `discard`, HybridEmbedding's stages in fixed shapes.
  lookup        the request [W x C] (the ids the batch holds of owner w in block w, ascending, then
                padding) -> alltoall of ids -> each owner reads the [W x C] rows asked of it
                (padding: any row) -> alltoall of rows -> the workspace [W x C, d] (this rank's own
                block from its own read, not through the wire, as the exact-size step) -> the
                pooled gather. Nothing is read back.
  begin_update  the workspace's gradient leaves ([W x C, d], alltoall); the function it returns sums
                what each owner received per row (padded_combine: K = min(W x C, its rows) slots;
                its own block first, then the peers' in rank order: the exact-size step's order,
                so the same sums) and updates those rows masked, versions advanced by the updates
                folded in.
The HET cache (cache.policy, any consistency; fixed/het.py: FixedHet): the ids alltoall carries
each entry's cached version, the owners answer a version per entry besides the rows, the cache's
bookkeeping runs masked over the entries (cache/masked.py), and the gradients leave as pushes
(due, transient and dirty evicted rows with their counts) in blocks per owner.
Herald (schedule=herald): its sync is sized by the SyncPlan on the host (no padding needed to know
it before the step); the rows it brings fill the request's slots, the lent rows' updates and the
pushes take their gradients from them, and the owner sums its own block then the pushes by sender.
A rank whose request does not fit its blocks (SyncPlan.reads, on the host) makes that lookup in
exact sizes: Herald's sync moves rows, so its step is never trained twice.
Replicated rows (placement=fae / sca, replica.py): the workspace has a second part, the whole
replica ([H, d], H the replicated rows: a size the placement fixes), which the entries of
replicated ids read (they join no owner's block). Its gradient is reduced as in the exact-size
mode: the rows of the global batch's hot rows (the scheduler's feed, on the host before the step:
no read) are summed over the ranks by one allreduce and every rank updates them alike
(HybridEmbedding.reduce_replica). That buffer is the exact-size mode's own: the same wire bytes,
and the same sums at any W (an allreduce's order of addition follows its buffer's length);
its size follows the batch, which costs no read and no graph, since the collectives run
between the captured parts at W > 1. A hot step (every id of the global batch replicated: the
scheduler says so on the host) runs no alltoall, as the exact-size step.

Equal results: the same rows, the same sums in the same order and the same optimizer arithmetic
as the exact-size mode at the same W, bit for bit on a CPU (tests/distributed/test_padded_step.py).
The capacity, its bound and the cost of the padding are described in padded.py; the counts of a
step (unique and remote ids) stay on the device (LookupStats.record_on_device).
"""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Callable, Optional

import torch

import kernels

from ....workload.data.batch import Batch
from ..exchange import wire_dtype
from ..module import HybridEmbedding
from ..remote import HeraldRemote, HetRemote, PlainRemote
from ..types import GlobalStep, InFlightStep
from .het import FixedHet, HetBlocks
from .padded import (BagPadding, PaddedPlan, PaddedRequest, owner_sums, padded_plan, padded_request,
                     unique_capacity)

__all__ = ["FixedRead", "FixedShapes", "MARGIN", "MEASURE_STEPS", "without_fixed_shapes"]

# train.unique_capacity < 0: the capacity is the bound for the first MEASURE_STEPS steps, then the
# most slots they needed on any rank times train.capacity_margin (a later step that needs more is
# trained again in exact sizes: the margin trades wire for how often that happens); the HET cache's
# reply and push blocks follow every window of MEASURE_STEPS steps (fixed/het.py)
MEASURE_STEPS = 16
MARGIN = 1.1


def without_fixed_shapes(emb: HybridEmbedding) -> Optional[str]:
    """Why this sparse side has no fixed-shape mode yet (None: it has one). train.cuda_graph=on
    then captures the dense half only and runs the sparse half in exact sizes (the step of
    train.cuda_graph=dense), saying so once and in summary.json (cuda_graph.dense_only); the
    reasons are docs/gpu.md's (the seed systems under train.cuda_graph=on)."""
    w = emb.comm.size
    if emb.store.dynamic:
        return ("dynamic tables (embedding.kind=dynamic): the id map's inserts and the pool's admissions "
                "and evictions change sizes inside the step")
    remote = emb.remote
    if w > 1 and not isinstance(remote, (PlainRemote, HetRemote, HeraldRemote)):
        return f"the remote-row protocol {type(remote).__name__} at W > 1"
    if w == 1 and emb.audit is not None:
        return ("the audit (embedding.audit=true) at W = 1: its records are host reads, and the whole "
                "step's update is inside the graph")
    return None


@dataclass
class FixedRead:
    """What a fixed-shape lookup (W > 1) leaves for its update: the request, the storage rows
    peers asked this rank for ([W x C], by peer), and the replicated rows this rank's batch
    touched ([H] bool, counted as unique ids; None without a replica)."""

    request: PaddedRequest
    served: torch.Tensor
    touched: Optional[torch.Tensor]
    fits: Optional[torch.Tensor] = None  # [] bool: no rank's request overflowed (None: none can)
    het: Optional[HetBlocks] = None  # the HET cache's read (FixedHet), where the protocol is HET
    sync: Any = None  # Herald's SyncPlan of the step, where the protocol is Herald's


class FixedShapes:
    """The fixed-shape mode of a HybridEmbedding (see the module docstring): capacity C slots per
    owner (per table the fewer of local batch x max bag and the rows one owner holds: `bound`,
    never exceeded; train.unique_capacity: a smaller one)."""

    def __init__(self, emb: HybridEmbedding, min_bag: int, max_bag: int, local_batch: int, chosen: int = 0,
                 margin: float = MARGIN) -> None:
        """chosen: train.unique_capacity (0: the bound; < 0: measured, see begin_step); margin:
        train.capacity_margin."""
        self.emb, self.comm, self.sharding, self.store = emb, emb.comm, emb.sharding, emb.store
        self.padding = BagPadding(self.sharding, min_bag, max_bag)
        w, rows = self.comm.size, self.sharding.table_rows
        het = w > 1 and isinstance(emb.remote, HetRemote)
        self.het: Optional[FixedHet] = None
        self.herald = w > 1 and isinstance(emb.remote, HeraldRemote)
        self.exact_lookups = 0  # Herald's steps whose request did not fit its blocks (lookup)
        self.bound = unique_capacity(local_batch, max_bag, rows, world=w)
        self.rule = "measured" if chosen < 0 else ("set" if chosen > 0 else "bound")
        self.measuring = chosen < 0  # at the bound for MEASURE_STEPS steps, then what they needed x the margin
        self.margin = margin
        self.steps = 0  # training lookups made (the measuring window's)
        self.regrow = False  # a step overflowed: the HET blocks follow what it needed at the next step
        self.peak: Optional[torch.Tensor] = None  # the most slots a step has needed (on the device)
        self.resize(unique_capacity(local_batch, max_bag, rows, max(chosen, 0), world=w))
        if het:  # the HET cache's protocol in the request's blocks (fixed/het.py); None: the plain wire
            self.het = FixedHet(self.comm, self.store, emb.remote, self.capacity,
                                [min(local_batch * max_bag, n) for n in rows], emb.exchange.row_dtype)

    def resize(self, capacity: int) -> None:
        """The slots of a block (of the plan at W = 1): every size that follows from them."""
        self.capacity = c = capacity
        w, r = self.comm.size, self.comm.rank
        self.splits = [c] * w
        # below the bound a request may overflow its blocks: each block then carries one slot more,
        # the requester's excess, so every rank learns on the device whether any rank overflowed
        # (the step's updates are masked off, and the step is trained again in exact sizes)
        self.flagged = c < self.bound
        self.id_splits = [c + 1] * w if self.flagged else self.splits
        self.id_dtype = wire_dtype(self.sharding.local_rows + 1)
        self.own = slice(r * c, (r + 1) * c)
        # the owner's entries in the exact-size step's order: its own block, then the peers' by rank
        blocks = [r] + [p for p in range(w) if p != r]
        self.order = torch.cat([torch.arange(b * c, (b + 1) * c) for b in blocks]).to(self.store.device)
        # a slot's key, block x (local_rows + 1) + its storage row: ascending over the request
        # (each block's rows ascend, its padding local_rows last), so a gid's slot is one search
        self.block_base = (torch.arange(w, device=self.store.device).repeat_interleave(c)
                           * (self.sharding.local_rows + 1))
        if self.het is not None:
            self.het.resize(c)

    @property
    def can_overflow(self) -> bool:
        """A block below its bound now: a step may not fit (its excess rides the loss's read)."""
        het = self.het is not None and (self.het.pull_flagged or self.het.push_flagged)
        return self.flagged or het

    def _size(self, most: int, bound: int) -> int:
        return min(bound, max(1, math.ceil(most * self.margin)))

    # ---- the capacity's statistics ----------------------------------------------------------
    def begin_step(self) -> bool:
        """Before a training step's lookup: with a measured capacity (train.unique_capacity < 0),
        once MEASURE_STEPS steps have run at the bound, the capacity becomes the most slots they
        needed on any rank times the margin (collective at W > 1: every rank at the same step).
        The HET cache's reply and push blocks (below the bound: measured or set capacities) follow
        every window of MEASURE_STEPS steps, and the step after one that overflowed. Returns
        whether the capacity changed."""
        self.steps += 1
        window = self.steps > MEASURE_STEPS and self.steps % MEASURE_STEPS == 1
        follow = self.het is not None and self.rule != "bound" and (window or self.regrow)
        measured = self.measuring and self.steps > MEASURE_STEPS
        if not measured and not follow:
            return False
        most, _, pulled, pushed = self._over_ranks()
        if measured:
            self.measuring = False
            self.resize(self._size(most, self.bound))
        if follow:
            het = self.het
            pull, push = self._size(pulled, het.pull_bound), self._size(pushed, het.push_bound)
            if self.regrow and not window:  # after an overflow the blocks only grow
                pull, push = max(pull, het.pull_slots), max(push, het.push_slots)
            het.resize(self.capacity, pull, push)
            het.peaks, self.regrow = None, False
        return measured

    def note_used(self, used: torch.Tensor) -> None:
        """A step needed `used` slots (a device value, outside any graph; read by most_used)."""
        used = used.reshape(())
        self.peak = used.clone() if self.peak is None else torch.maximum(self.peak, used)

    def _over_ranks(self) -> tuple[int, int, int, int]:
        """(the most slots a step needed on any rank, Herald's exact-size lookups summed over the
        ranks, the most rows an owner sent a requester and pushes a sender sent an owner in one
        step of the HET blocks' window): one read, an allgather at W > 1."""
        het = self.het.peaks if self.het is not None and self.het.peaks is not None else None
        mine = [int(self.peak) if self.peak is not None else 0, self.exact_lookups,
                *(het.tolist() if het is not None else [0, 0])]
        if self.comm.size == 1:
            return mine[0], mine[1], mine[2], mine[3]
        got = self.comm.allgather(torch.tensor([mine], dtype=torch.int64), kind="meta")
        return int(got[:, 0].max()), int(got[:, 1].sum()), int(got[:, 2].max()), int(got[:, 3].max())

    def capacity_summary(self) -> dict[str, Any]:
        """summary.json's view of the capacity: the slots in force, how they were chosen (bound,
        set, measured), the bound, and the most any step needed (what train.unique_capacity can
        be set to, with a margin); under Herald, the lookups (summed over the ranks) whose request
        did not fit and that were made in exact sizes. Collective at W > 1."""
        most, exact, _, _ = self._over_ranks()
        out = {"unique_capacity": self.capacity, "capacity_rule": self.rule, "unique_bound": self.bound,
               "most_slots_used": most}
        if self.herald:
            out["exact_size_lookups"] = exact
        if self.het is not None:
            out["het_blocks"] = self.het.blocks()
        return out

    # ---- W = 1: the pieces of the whole step's one function --------------------------------
    def whole_rows(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor
                   ) -> tuple[PaddedPlan, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(plan, workspace leaf [C (+ H), d], pooled rows [B, T, d], the replicated rows the batch
        touched [H] bool or None) of padded inputs (BagPadding). With a replica the workspace's
        last H rows are the replica's, read by the entries of replicated ids."""
        ids = Batch(dense, values, lengths, labels)
        gids = self.sharding.global_ids(values, ids.table_index())
        slot = self._replica_slots(gids)
        plan = padded_plan(self.sharding, gids, self.capacity, self.padding.sentinel,
                           skip=None if slot is None else slot >= 0)
        ws, inverse, touched = self._with_replica(self.store.local_rows(plan.rows).to(self.store.compute_dtype),
                                                  plan.inverse, slot)
        ws.requires_grad_()
        pooled = kernels.pooled_gather(ws, inverse, ids.offsets(), ids.num_tables, mode=self.emb.pooling)
        if self.padding.ragged:
            pooled = pooled[:labels.shape[0]]  # the padding's extra sample
        return plan, ws, pooled, touched

    def whole_update(self, plan: PaddedPlan, grad: Optional[torch.Tensor], ws: torch.Tensor, mask: torch.Tensor,
                     zero_outside: bool, touched: Optional[torch.Tensor] = None,
                     finite: Optional[torch.Tensor] = None) -> None:
        """The owner's masked update of a padded plan's rows (grad None: no gradient reached them);
        with a replica, its rows the batch touched (at W = 1 the global batch's hot rows: the same
        rows and sums as the exact-size mode's reduce), where `finite` (a device bool: the step's
        own mask, a finite loss and a plan that fits; None: always)."""
        grad = grad if grad is not None else torch.zeros_like(ws)
        c = self.capacity
        self.store.apply_masked(plan.rows, grad[:c], mask, zero_outside=zero_outside)
        if touched is not None:
            slots = torch.arange(touched.numel(), dtype=torch.int64, device=touched.device)
            self.emb.replica.apply(slots, grad[c:], self.store, touched if finite is None else touched & finite)

    # ---- the replica's block of the workspace (placement: fae, sca) ---------------------------
    def _replica_slots(self, gids: torch.Tensor) -> Optional[torch.Tensor]:
        """[N] replica slot of every entry, -1 where its row is not replicated (None: no replica)."""
        return self.emb.replica.find(gids) if self.emb.replica is not None else None

    def _with_replica(self, ws: torch.Tensor, inverse: torch.Tensor, slot: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(workspace, inverse, touched): the whole replica appended to the workspace [n, d] as its
        last H rows, the entries of replicated rows pointed there, and [H] bool the replicated rows
        some entry reads (a scatter: fixed-size); without a replica, as they are and None."""
        if slot is None:
            return ws, inverse, None
        replica, hot = self.emb.replica, slot >= 0
        n = len(replica)
        touched = torch.zeros(n + 1, dtype=torch.bool, device=slot.device)
        touched.scatter_(0, torch.where(hot, slot, n), True)
        return (torch.cat([ws, replica.weight.to(ws.dtype)]), torch.where(hot, ws.shape[0] + slot, inverse),
                touched[:n])

    # ---- W > 1: the stages of a step ---------------------------------------------------------
    def lookup(self, flight: InFlightStep) -> torch.Tensor:
        """[B, T, d] pooled rows of a training step; its workspace and read stay in `flight`.
        Herald: a request that does not fit the blocks (the SyncPlan counts it on the host) is
        made in exact sizes instead (HybridEmbedding.lookup), by this rank only: its sync moves
        rows between owners and holders, so its step is never trained twice; both modes read and
        update the same rows with the same sums."""
        emb = self.emb
        emb.clock(flight.step)
        if self.het is not None:
            self.het.settle()
        self.begin_step()
        if self.herald and not flight.info.hot:
            need = int(flight.info.sync.reads[self.comm.rank].max())
            if need > self.capacity:
                self.exact_lookups += 1
                self.note_used(torch.tensor(need, device=self.store.device))
                return emb.lookup(flight)
        dense, values, lengths, labels = self.padding.inputs(flight.batch)
        ids = Batch(dense, values, lengths, labels)
        gids = self.sharding.global_ids(values, ids.table_index())
        slot = self._replica_slots(gids)
        req = padded_request(self.sharding, gids, self.capacity, self.padding.sentinel,
                             skip=None if slot is None else slot >= 0)
        fits, het = None, None
        if flight.info.hot:  # every id replicated: no owner is asked anything (no alltoall)
            served = torch.full_like(req.ids, self.sharding.local_rows)
            ws = torch.zeros(req.ids.numel(), self.store.dim, dtype=self.store.compute_dtype, device=gids.device)
        elif self.het is not None:  # the HET cache: version checks, rows and installs in the blocks
            served = req.ids
            ws, het, fits = self.het.read(req, emb.step, self.flagged)
        elif self.herald:  # Herald's sync (its wire sized by the plan, on the host), into the blocks
            served = req.ids
            ws = self._herald_read(req, flight.info.sync)
        else:
            served, fits = self._ask(req)
            stored = self._read(served)  # as stored; its own block is what this rank asked itself for
            got, _ = self.comm.alltoall(stored.to(emb.exchange.row_dtype), self.splits, kind="rows",
                                        recv_splits=self.splits)
            ws = got.to(self.store.compute_dtype)
            ws[self.own] = stored[self.own].to(ws.dtype)  # as the exact-size step: not through the wire
        ws, inverse, touched = self._with_replica(ws, req.inverse, slot)
        unique = req.count if touched is None else req.count + touched.sum()
        ws.requires_grad_()
        pooled = kernels.pooled_gather(ws, inverse, ids.offsets(), ids.num_tables, mode=emb.pooling)
        flight.ws = ws
        flight.read = FixedRead(req, served, touched, fits, het, flight.info.sync if self.herald else None)
        self.note_used(req.largest)
        own = req.valid[self.own].sum()
        emb.stats.record_on_device(int(flight.batch.values.numel()), unique, req.count - own)
        return pooled[:labels.shape[0]] if self.padding.ragged else pooled  # the padding's extra sample

    def _ask(self, req: PaddedRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The ids alltoall: (storage rows peers asked this rank for [W x C], whether no rank's
        request overflowed its blocks ([] bool on the device; None when no request can))."""
        ids = req.ids.to(self.id_dtype)
        if self.flagged:
            w, c = self.comm.size, self.capacity
            flag = req.excess.to(ids.dtype).reshape(1, 1).expand(w, 1)
            ids = torch.cat([ids.reshape(w, c), flag], 1).reshape(-1)
        got, _ = self.comm.alltoall(ids, self.id_splits, kind="ids", recv_splits=self.id_splits)
        got = got.long()
        if not self.flagged:
            return got, None
        got = got.reshape(self.comm.size, self.capacity + 1)
        return got[:, :-1].reshape(-1), (got[:, -1] == 0).all()

    def excess(self, flight: InFlightStep) -> torch.Tensor:
        """[] the ids past the blocks of the step just looked up, on the device (0 for a Herald
        step made in exact sizes)."""
        if isinstance(flight.read, FixedRead):
            het = flight.read.het
            return flight.read.request.excess + (het.excess if het is not None else 0)
        return torch.zeros((), dtype=torch.int64, device=self.store.device)

    def _herald_read(self, req: PaddedRequest, sync: Any) -> torch.Tensor:
        """The workspace [W x C, d] of a Herald step whose request fits: the step's writebacks,
        pulls and lends (HeraldRemote.fetch, as the exact-size read), the remote rows into their
        request slots, then this rank's own block from its shard (after the writebacks: some of
        its rows may just have come back); padding slots read zeros or any row (no gradient
        leaves them)."""
        src, rows = self.emb.remote.fetch(sync)
        ws = torch.zeros(req.ids.numel(), self.store.dim, dtype=self.store.compute_dtype, device=rows.device)
        ws.index_copy_(0, self._slots(self._keys(req), src), rows.to(ws.dtype))
        ws[self.own] = self._read(req.ids[self.own]).to(ws.dtype)
        remote = req.count - req.valid[self.own].sum()
        torch._assert_async((req.excess == 0) & (remote == src.numel()),
                            "herald: the plan and this rank's batch disagree on its remote rows")
        return ws

    def _keys(self, req: PaddedRequest) -> torch.Tensor:
        """[W x C] each request slot's key, block x (local_rows + 1) + its storage row: ascending."""
        return self.block_base + req.ids

    def _slots(self, keys: torch.Tensor, gids: torch.Tensor) -> torch.Tensor:
        """[k] request slots of gids [k] given the request's keys (_keys; each gid asked in the
        request: checked on the device, no read)."""
        want = self.sharding.owner(gids) * (self.sharding.local_rows + 1) + self.sharding.local_index(gids)
        pos = torch.searchsorted(keys, want).clamp_(max=keys.numel() - 1)
        torch._assert_async((keys.index_select(0, pos) == want).all(),
                            "herald: the plan and this rank's batch disagree on its remote rows")
        return pos

    def _read(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows of storage rows idx, padding slots (local_rows) reading the last row."""
        return self.store.local_rows(idx.clamp(max=self.sharding.local_rows - 1))

    def begin_update(self, flight: InFlightStep) -> Callable[[], None]:
        """The replicated rows reduced and updated, the workspace's owner blocks' gradient sent;
        the function returned sums and applies what this rank receives as owner (module docstring).
        A Herald step made in exact sizes (lookup) is updated by the exact-size mode."""
        if not isinstance(flight.read, FixedRead):
            return self.emb.begin_update(flight)
        ws, read = self.emb.finish_lookup(flight, "apply_gradients")
        grad = ws.grad if ws.grad is not None else torch.zeros_like(ws)
        blocks = read.request.ids.numel()
        if self.emb.audit is not None:
            self._audit_grads(read, grad)
        if read.touched is not None:
            self._reduce_replica(grad[blocks:], flight.info, read.fits)
            grad = grad[:blocks]
        if flight.info.hot:
            return lambda: None
        if read.het is not None:
            return self._het_update(read, grad)
        if read.sync is not None:
            return self._herald_update(read, grad)
        handle = self.comm.alltoall_async(grad.to(self.emb.exchange.row_dtype), self.splits, kind="grads",
                                          recv_splits=self.splits)

        def finish() -> None:
            got = handle.wait()[0].to(grad.dtype)
            got[self.own] = grad[self.own]  # its own gradients as they are, as the exact-size step
            served = read.served
            if read.fits is not None:  # an overflowing step changes no row (it is trained again)
                served = torch.where(read.fits, served, self.sharding.local_rows)
            served = served.index_select(0, self.order)
            comb = owner_sums(self.store, served, torch.ones_like(served), got.index_select(0, self.order))
            if self.emb.audit is not None:  # the rows updated, as the exact-size owner records them
                self._audit_update(comb.rows[comb.valid])
        return finish

    def _het_update(self, read: FixedRead, grad: torch.Tensor) -> Callable[[], None]:
        """The HET cache's update (FixedHet.push); the function returned applies what this rank
        receives as owner, summed per row (own rows first, then by sender), versions advanced by
        the pushed counts."""
        pushed = self.het.push(read.request, read.het, grad)

        def finish() -> None:
            comb = owner_sums(self.store, *pushed())
            if self.emb.audit is not None:
                self._audit_update(comb.rows[comb.valid])
        return finish

    def _herald_update(self, read: FixedRead, grad: torch.Tensor) -> Callable[[], None]:
        """Herald's update (HeraldRemote.send: the lent rows' local updates, the pushes, with
        their gradients from the request's slots); the function returned sums this rank's own
        block and the pushes it receives per row (own first, then by sender: the exact-size
        owner's order) and applies them."""
        req, keys = read.request, self._keys(read.request)  # one search each for the lent rows and the pushes
        pushed = self.emb.remote.send(read.sync, lambda gids: grad.index_select(0, self._slots(keys, gids)))
        own, own_grad = req.ids[self.own], grad[self.own]

        def finish() -> None:
            got = pushed()
            idx = torch.cat([own, self.sharding.local_index(got.gids)])
            comb = owner_sums(self.store, idx, torch.ones_like(idx), torch.cat([own_grad, got.grads.to(grad.dtype)]))
            if self.emb.audit is not None:
                self._audit_update(comb.rows[comb.valid])
        return finish

    def _audit_update(self, rows: torch.Tensor) -> None:
        """embedding.audit: the rows this owner updated, with their versions after (as the exact
        step records them)."""
        g, _ = torch.sort(self.sharding.global_of(rows, self.comm.rank))
        self.emb.audit.update(self.emb.step, g, self.store.versions(self.sharding.local_index(g)))

    def _audit_grads(self, read: FixedRead, grad: torch.Tensor) -> None:
        """embedding.audit (a test tool: it reads back): this step's row gradients by global id, the
        exact-size mode's record (nothing where a request overflowed: the step is trained again)."""
        if read.fits is not None and not bool(read.fits):
            return
        req, c, audit = read.request, self.capacity, self.emb.audit
        rows = req.ids.clamp(max=self.sharding.local_rows - 1)
        gids = torch.cat([self.sharding.global_of(rows[w * c:(w + 1) * c], w) for w in range(self.comm.size)])
        blocks = gids.numel()
        audit.grads.index_add_(0, gids[req.valid].cpu(), grad[:blocks][req.valid].detach().double().cpu())
        if read.touched is not None:
            hot = read.touched
            audit.grads.index_add_(0, self.emb.replica.gids[hot].cpu(), grad[blocks:][hot].detach().double().cpu())

    def _reduce_replica(self, grad: torch.Tensor, info: GlobalStep, fits: Optional[torch.Tensor]) -> None:
        """The replica's gradient [H, d] at the global batch's hot rows (the scheduler's feed: known
        on the host, the same list on every rank), summed over the ranks and applied as in the
        exact-size mode (HybridEmbedding.reduce_replica): the same buffer, so the same sums; not
        applied where a request overflowed (fits False)."""
        union = self.emb.union(info)
        self.emb.reduce_replica(union, grad.index_select(0, union), fits)

    def discard(self, flight: InFlightStep, again: bool = False) -> None:
        """A dropped step (again: one trained again, a block overflowed): nothing changed before
        its update, or the update was masked off; the HET cache's changes are undone."""
        if again:
            self.regrow = True
        if flight.ws is not None and not isinstance(flight.read, FixedRead):
            self.emb.discard(flight)  # a Herald step made in exact sizes
            return
        # a step trained again was updated already (its update masked off): its read is gone
        read = self.emb.finish_lookup(flight, "discard")[1] if flight.ws is not None else None
        if self.het is not None and (read is None or read.het is not None):
            self.het.discard(again)
