"""Device handling of a training step, checked on CPU (no GPU in CI).

What can fail here without a GPU:
- ``Batch.offsets()`` / ``table_index()`` run on a ``meta`` batch: a tensor they made on the CPU
  instead of on the batch's device fails at once (a meta tensor cannot meet a CPU one);
- one training step (``Trainer.train_step``: its batch, lookup, model, backward, owner update and
  dense allreduce; with train.pipeline also the next step's batch, plan and requests) runs, after
  two warm-up steps, under ``device_audit.StepAudit``, which keeps a virtual device per tensor
  (host-born or following the trainer's device) and lists every factory called without
  ``device=``, every op mixing the two, every host read, every op whose output size depends on
  device values and every host -> device copy. Each must be at a site of the allow-lists below,
  each entry with the reason it is allowed; a new site fails the test with the list. Every copy
  must be asynchronous (pinned memory, ``trainer/base/core/device.py``), and every tensor of the step's
  lookup plan must follow the device.

Entries marked TODO are host syncs the algorithm does not need, in code another change owns
(RowCache in trainer/sparse/embedding/cache/rows.py); each names what remains there. HetRemote's read, write
and push announcement (remote/het.py) have none left: their selections take sizes the host knows. Entries marked CPU-ONLY are paths a GPU run does not
take. Entries marked AUDIT are artefacts of auditing on a CPU (said why); the real GPU behaviour
of those sites is on the checklist of docs/gpu.md.

Sites are (file, function), not lines, so moving code inside a function keeps the lists valid;
moving it to another function or file fails the test until the list is updated: on purpose, the
move is where device handling gets lost.

Host syncs: run with ``-s`` to see, per configuration, every record with call counts and the
step's host-sync count (host reads + data-dependent sizes + blocking copies; AUDIT sites and
torch's own CPU reads left out).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from device_audit import DEV, HOST, Record, StepAudit, outside, table
from helpers import make_cfg, spawn

TINY = ["data=tiny", "train.steps=4", "data.batch_size=16", "data.test_samples=32",
        "data.eval_batch_size=32", "train.threads=1", "train.progress=off", "data.min_bag=0"]
WARMUP_STEPS = 2  # optimizer state, cache fills and the first lent rows happen here, not audited

# ---------------------------------------------------------------------------------- allow-lists

SPLITS_TENSOR = ("alltoall split sizes are host integers by nature (the backends take them as a "
                 "Python list); the torch backend moves the tensor to the process group's device")
GUARD = ("AUDIT: the data source's id guard (data/ids.py) checks the batch on the host, before "
         "TrainPipeline.batch moves it; the audit takes its device=lengths.device / .to(values.device) "
         "tensors for device ones (a CPU .to returns the same tensor). With DALI on GPU the batch "
         "arrives on the device and this is one sync per batch: docs/gpu.md")
FACTORY_OK: dict[tuple[str, str], str] = {
    ("trainer/base/comm/base.py", "exchange_splits_async"): SPLITS_TENSOR,
}
MIX_OK: dict[tuple[str, str], str] = {
    ("trainer/base/comm/torch_dist.py", "_alltoall_start"):
        "gloo stages through host memory: the split-size tensor (host by nature, see "
        "exchange_splits_async) meets `out`, made on the process group's device; the audit cannot tell "
        "the group's device from the trainer's",
    ("trainer/workload/data/ids.py", "values"): GUARD,
    ("trainer/workload/data/batch.py", "table_index"): GUARD + " (the guard's table_index() of the host batch)",
}
INHERENT = "needed by the algorithm"
CACHE_TODO = ("TODO(cache.py, being vectorised in another change: do not edit here): ")
HOST_OK: dict[tuple[str, str], str] = {
    ("trainer/step/pipeline.py", "_end"):
        f"{INHERENT}: the step's global loss (recorded every step, checked for NaN/inf; with "
        "train.nonfinite=skip every rank needs it before updating). Possible: read the loss one "
        "step late in stop mode",
    ("trainer/step/pipeline.py", "_dense_step"):
        "torch.optim's step counters (Adam's, Adagrad's .item() inside torch.optim: CPU tensors by "
        "torch's design unless fused/capturable, so no device sync); with train.cuda_graph dense / "
        "on the step is DenseUpdate's, which reads none",
    ("trainer/base/core/signals.py", "take_values"):
        f"{INHERENT}: the step's global loss read back (TrainPipeline._end's one read, with the stop "
        "signal's flag that rides the same reduction: no extra read or message per step; with "
        "train.precision=fp16 also the ranks' overflow count, in the same read)",
    ("trainer/sparse/embedding/exchange.py", "plan_lookup"):
        f"{INHERENT}: the step's one read-back of the plan: unique ids per owner and replicated "
        "([W + 1]), the alltoall split sizes, which also fix every size of the plan",
    ("trainer/base/comm/base.py", "_received_splits"): f"{INHERENT}: received alltoall split sizes",
    ("trainer/sparse/embedding/sharding.py", "per_owner"):
        f"{INHERENT}: the split sizes of HetWire.push_updates_start (read once, when HetWire.announce "
        "sends them ahead of the rows; or in push_updates_start when nothing was announced)",
    ("trainer/sparse/embedding/exchange.py", "serve_settled"):
        f"{INHERENT}: one read of the settled rows each peer gets from / sends to this rank early "
        "(train.pipeline=ids without a cache: the early row alltoall's split sizes, both "
        "directions in one [2W] vector)",
    ("trainer/sparse/embedding/remote/het.py", "serve"):
        f"{INHERENT}: one read of the rows each peer gets from / sends to this rank after the "
        "version check (the row alltoall's split sizes, both directions in one [2W] vector)",
    ("trainer/sparse/embedding/cache/rows.py", "_choose_slots"):
        CACHE_TODO + "one read of [3T] counts (misses left per table after its free slots, where "
        "each table's victims start, the free slots taken) before a Python loop over the tables "
        "that need victims; a segmented victim choice for all tables (sort by (table, key)) would "
        "read them with the victims' counts",
    ("trainer/sparse/embedding/cache/rows.py", "_victims"): CACHE_TODO + "the last key of each table's "
        "selection (one read), int(ok.sum()) for a region that runs out; goes with _choose_slots",
    ("trainer/sparse/embedding/cache/slotmap.py", "insert"):
        "CPU-ONLY: DirectSlotMap's live counter (int(new.sum())): the direct map is the CPU path "
        "only; on a GPU the cache and Herald's lent rows use the Triton hash map",
    ("trainer/sparse/embedding/cache/slotmap.py", "erase"): "CPU-ONLY: DirectSlotMap, as insert",
    ("trainer/workload/data/ids.py", "values"): GUARD + " (bool(bad.any()))",
}
SHAPE_OK: dict[tuple[str, str], str] = {
    ("trainer/sparse/embedding/cache/rows.py", "_evict"): CACHE_TODO + "slots[old >= 0] and live[count > 0]: "
        "masked selections; mask-weighted fixed-size ops (index_fill_ under a mask) need no size",
    ("trainer/sparse/embedding/cache/rows.py", "take_due"): CACHE_TODO + "slots[push_due(...)]: the due slots; "
        "their count can join the push's split-size read",
    ("trainer/sparse/embedding/cache/rows.py", "record_and_take_due"): CACHE_TODO + "nonzero(push_due(...)) "
        "where the caller does not know the due count (no push announcement: Horovod, one rank); "
        "with one, HetRemote passes the count and the selection is fixed-size",
    ("trainer/sparse/embedding/cache/rows.py", "versions_of"): CACHE_TODO + "out[hit] = version[slots[hit]]: "
        "torch.where over a clamped index_select needs no size",
    ("kernels/reference.py", "first_and_sums"):
        "CPU-ONLY: the owner update's torch reference (sum_repeats, first_and_sums: the first "
        "occurrences' positions for half rows' rounding keys) selects the first occurrence of each row "
        "(nonzero); on CUDA kernels.row_update is the Triton segment kernel, which reads nothing "
        "back (the plain-triton configuration audits it)",
}
ASYNC_COPY = "pinned host memory, non_blocking (trainer/base/core/device.py)"
COPY_OK: dict[tuple[str, str], str] = {
    ("trainer/workload/data/batch.py", "to"):
        f"the step's batch, made on the host by the data source: {ASYNC_COPY}; with "
        "train.pipeline the next batch is made and copied during this step",
    ("trainer/step/pipeline.py", "batch"):
        f"the scheduler's hot slots of the global batch (host: every rank computes them from the "
        f"global view), moved with the batch: {ASYNC_COPY}",
    ("trainer/sparse/embedding/exchange.py", "segment_counts"):
        f"the alltoall split sizes (host integers) to count rows per peer on the device: {ASYNC_COPY}",
    ("trainer/sparse/embedding/remote/on_demand.py", "_t"):
        "Herald's sync plan (writebacks, pulls, lends, pushes per worker) is host numpy by design: "
        f"every rank computes the same plan from the global batch; its id lists per step: {ASYNC_COPY}",
}
ALLOWED = {"factory": FACTORY_OK, "mix": MIX_OK, "host": HOST_OK, "shape": SHAPE_OK, "copy": COPY_OK}
# host reads per step at the sites the algorithm needs: one each (the pipelined step plans two
# steps in one call of train_step: its own lookup was planned a step early, so still one)
READS_AT_MOST: dict[tuple[str, str], int] = {
    ("trainer/sparse/embedding/exchange.py", "plan_lookup"): 1,
    ("trainer/sparse/embedding/remote/het.py", "serve"): 1,
    ("trainer/sparse/embedding/exchange.py", "serve_settled"): 1,
    ("trainer/sparse/embedding/sharding.py", "per_owner"): 1,
}
# host syncs per step where no TODO site runs (the cache's do vary with its contents): W = 1 and
# no cache: the loss and the plan's count read-back (+ the received split sizes at W = 2; + the CPU
# reference's torch.unique in the owner update when it sums pushed rows; + the settled rows' split
# sizes with train.pipeline=ids)
SYNCS_AT_MOST = {"w1": 2, "plain-triton": 3, "pipeline-ids": 5}
PLAN_TENSORS = ("uniq", "inverse", "owned_pos", "remote_pos", "hot_pos", "hot_slots")


# ---------------------------------------------------------------------------------- the audit


def audit_worker(rank: int, world: int, overrides: list[str],
                 need_plans: bool = True) -> tuple[list[Record], list[dict]]:
    """Build the trainer and run WARMUP_STEPS + 1 steps under the audit; return the last step's
    records and, for every lookup plan made in it, the virtual device of each plan tensor.
    Module level: the W > 1 runs call it in spawned ranks."""
    from trainer.base.comm import make_collectives
    from trainer.run.resolve.configure import load_config as to_config
    from trainer.run.runner import Trainer

    comm_key = ["comm=torch"] if world > 1 else ["comm=local"]
    c = to_config(make_cfg(TINY + list(overrides) + comm_key))
    comm = make_collectives(c.comm.backend, c.comm.timeout_s, c.comm.dist_backend)
    audit = StepAudit()
    plans: list[dict] = []
    try:
        with audit:
            trainer = Trainer(c, comm, None)
            for step in range(WARMUP_STEPS):
                trainer.train_step(step)
            inner = trainer.train_step  # batch, lookup, model, backward, owner update, allreduce
            make_plan = trainer.emb.plan  # lookup and prepare (train.pipeline) plan through it

            def audited(*args: Any, **kw: Any) -> Any:
                audit.recording = True
                try:
                    return inner(*args, **kw)
                finally:
                    audit.recording = False

            def planned(batch: Any) -> Any:
                plan = make_plan(batch)
                plans.append({f: audit.label.get(getattr(plan, f)) for f in PLAN_TENSORS})
                return plan

            trainer.train_step, trainer.emb.plan = audited, planned
            trainer.train_step(WARMUP_STEPS)
    finally:
        comm.close()
    assert audit.records, "nothing was recorded: is Trainer.train_step still the step?"
    assert plans or not need_plans, "no lookup plan was made in the audited step: is HybridEmbedding.plan still it?"
    return audit.records, plans


def host_syncs(records: list[Record]) -> int:
    """Host syncs of a step on CUDA as the audit sees them: host reads, data-dependent sizes and
    blocking copies (torch's own reads of CPU tensors and the AUDIT sites left out)."""
    audit_only = {site for lst in ALLOWED.values() for site, why in lst.items() if why.startswith("AUDIT")}
    return sum(1 for r in records if r.site not in audit_only and not r.by_torch and (
        r.kind in ("host", "shape") or (r.kind == "copy" and "non_blocking" not in r.op)))


def _check(result: tuple[list[Record], list[dict]], what: str, most_syncs: int | None = None) -> None:
    """Every record at an allowed site, copies asynchronous, the needed reads once, the plan on
    the device, and (most_syncs) at most that many host syncs in the step."""
    records, plans = result
    counts = {k: len([r for r in records if r.kind == k]) for k in ALLOWED}
    print(f"\n--- {what}: {counts}, host syncs {host_syncs(records)}\n{table(records)}")
    bad = [r for kind, allowed in ALLOWED.items()
           for r in outside([r for r in records if r.kind == kind], allowed)]
    bad += [r for r in records if r.kind == "copy" and "non_blocking" not in r.op]
    for site, most in READS_AT_MOST.items():
        reads = [r for r in records if r.kind == "host" and r.site == site]
        if len(reads) > most:
            bad += reads
    assert not bad, (f"{what}: device handling outside the allow-lists of {__file__} (copies must be "
                     f"non_blocking; reads at most {READS_AT_MOST}):\n"
                     + "\n".join(sorted({str(r) for r in bad})))
    off = [(f, lab) for p in plans for f, lab in p.items() if lab != DEV]
    assert not off, f"{what}: lookup plan tensors not on the storage's device: {off}"
    if most_syncs is not None:
        syncs = host_syncs(records)
        assert syncs <= most_syncs, f"{what}: {syncs} host syncs, at most {most_syncs}"


# ---------------------------------------------------------------------------------- tests


def _batch(device: str):
    from trainer.workload.data.batch import Batch

    lengths = torch.tensor([[2, 0, 1], [0, 3, 1]])
    b = Batch(torch.zeros(2, 4), torch.arange(7), lengths, torch.zeros(2))
    return b.to(torch.device(device))


def test_batch_helpers_make_their_tensors_on_the_batch_device():
    """offsets() and table_index() follow the batch: on a meta batch, a CPU-made tensor fails."""
    cpu, meta = _batch("cpu"), _batch("meta")
    assert cpu.offsets().tolist() == [0, 2, 2, 3, 3, 6, 7]
    assert cpu.table_index().tolist() == [0, 0, 2, 1, 1, 1, 2]
    assert meta.offsets().device.type == "meta" and meta.offsets().shape == (7,)
    assert meta.table_index().device.type == "meta" and meta.table_index().shape == (7,)


def test_audit_catches_host_factories_mixes_and_reads():
    """The audit itself: each kind of problem is recorded at the right site, and nothing else."""
    dev = torch.ones(4, device="cpu")  # explicit device: follows the trainer's device
    with StepAudit() as audit:
        audit.recording = True
        dev = dev.to("cpu")
        host = torch.arange(4)  # no device: host-born (factory)
        fine = torch.arange(4, device=dev.device)
        mixed = dev + host  # mix
        int(fine.sum())  # host read of a device value
        torch.nonzero(mixed > 1)  # size depends on device values
        host.tolist()  # reading a host tensor is no sync: not recorded
        scalar = dev * torch.tensor(2.0)  # a 0-dim host tensor is a scalar for CUDA ops: no mix
        del scalar
        staged = torch.from_numpy(np.arange(3))  # host (not a factory call)
        staged.to(dev.device)  # a blocking host -> device copy
        torch.from_numpy(np.arange(2)).to(dev.device, non_blocking=True)  # the pinned, async one
        torch.tensor([1, 2], device=dev.device)  # Python data: built on the host, then copied
        dev.to(dev.device)  # already on the device: no copy
    assert audit.label[host] == HOST and audit.label[mixed] == "dev"
    kinds = sorted((r.kind, r.op) for r in audit.records)
    assert kinds == [("copy", "tensor(device=)"), ("copy", "to"), ("copy", "to(non_blocking)"),
                     ("factory", "arange"), ("factory", "tensor"), ("host", "int"),
                     ("mix", "add"), ("shape", "nonzero")], kinds
    assert {r.file for r in audit.records} == {"<outside>"}  # this file is not trainer/ or kernels/


@pytest.mark.parametrize("model", ["dlrm", "wdl", "deepfm", "dcn"])
def test_one_step_w1(model: str):
    """W = 1 (every row owned): lookup, pooled gather and its backward, owner update, dense step."""
    _check(audit_worker(0, 1, [f"model={model}", "optim=adagrad"]), f"W=1 model={model}",
           most_syncs=SYNCS_AT_MOST["w1"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_step_w1_mixed_precision(precision: str):
    """train.precision: autocast and fp16's loss scaler (unscale, the overflow decision, the
    scale's update) add no host sync: fp16's overflow count rides the loss's read."""
    _check(audit_worker(0, 1, [f"train.precision={precision}", "optim=adam"]), f"W=1 precision={precision}",
           most_syncs=SYNCS_AT_MOST["w1"])


CAPTURED = ("trainer/step/whole_step.py", "trainer/step/dense_step.py", "trainer/step/dense_update.py",
            "trainer/sparse/embedding/fixed/padded.py", "trainer/workload/models/")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_step_w1_whole_graph(precision: str):
    """train.cuda_graph=on at W = 1 (trainer/step/whole_step.py): the step passes the same audit with
    one host sync, the loss (no plan count read back), and what a CUDA graph captures (the padded
    plan, the gather, the model, the rows' update) makes nothing on the host, mixes nothing, reads
    nothing back and makes no tensor whose size depends on device values. Ragged bags (TINY's
    data.min_bag=0) take the padded-entries path."""
    # no plan of plan_lookup's is made: the whole step pads its own
    records, plans = audit_worker(0, 1, ["train.cuda_graph=on", f"train.precision={precision}", "optim=adagrad"],
                                  need_plans=False)
    _check((records, plans), f"W=1 cuda_graph=on {precision}", most_syncs=1)
    inside = [r for r in records if r.file.startswith(CAPTURED)]
    assert not inside, "the captured step must be free of host work:\n" + "\n".join(map(str, inside))
    assert not [r for r in records if r.kind == "shape"], "a tensor sized by device values"


FIXED_BAGS = ["data.min_bag=2", "data.max_bag=2", "optim=adagrad", "data.zipf_alpha=1.3"]


def sizes_of_two_steps(overrides: list[str], rank: int = 0, world: int = 1) -> tuple[list, list, list[int]]:
    """Every op's output sizes (device_audit's `sizes`) in two consecutive steps, and the unique
    ids of each step's batch (they must differ, or the comparison proves nothing). Module level:
    the W > 1 runs call it in spawned ranks."""
    from trainer.base.comm import make_collectives
    from trainer.run.resolve.configure import load_config as to_config
    from trainer.run.runner import Trainer

    comm_key = ["comm=torch"] if world > 1 else ["comm=local"]
    c = to_config(make_cfg(TINY + ["train.steps=5"] + list(overrides) + comm_key))
    comm = make_collectives(c.comm.backend, c.comm.timeout_s, c.comm.dist_backend)
    audit, steps, unique = StepAudit(), [], []
    try:
        with audit:
            trainer = Trainer(c, comm, None)
            for step in range(WARMUP_STEPS + 2):
                audit.sizes, audit.recording = [], step >= WARMUP_STEPS
                trainer.train_step(step)
                audit.recording = False
                trainer.emb.stats.settle()
                unique.append(trainer.emb.stats.unique)
                steps.append(audit.sizes)
    finally:
        comm.close()
    return steps[-2], steps[-1], unique[-2:]


def _first_difference(a: list, b: list) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"op {at} of {len(a)} / {len(b)}: {a[at] if at < len(a) else None} vs {b[at] if at < len(b) else None}"


def test_whole_step_makes_no_tensor_sized_by_the_data():
    """train.cuda_graph=on at W = 1: two steps whose batches hold different numbers of unique ids
    make the same tensors, op for op, size for size (what a CUDA graph replays). The eager step
    (train.cuda_graph=off) fails the same comparison (its plan, workspace and update are sized by
    the unique count), which is what makes this a test."""
    first, second, unique = sizes_of_two_steps(FIXED_BAGS + ["train.cuda_graph=on"])
    assert unique[0] != unique[1], f"both batches hold {unique[0]} unique ids: nothing is compared"
    assert first == second, "a size depends on the data: " + _first_difference(first, second)
    first, second, unique = sizes_of_two_steps(FIXED_BAGS)
    assert unique[0] != unique[1] and first != second, "the eager step's sizes did not follow the data"


def _sizes_worker(rank: int, world: int, overrides: list[str]) -> tuple[list, list, list[int]]:
    return sizes_of_two_steps(overrides, rank, world)


# the plain wire, and the HET cache's (fixed/het.py: version checks, installs over victims, pushes)
W2_FIXED = {"plain": [], "het-lru-ssp": ["cache=lru", "consistency=ssp"]}  # the CPU's direct id map (slotmap.py)


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(W2_FIXED))
def test_padded_step_makes_no_tensor_sized_by_the_data_at_w2(case):
    """train.cuda_graph=on at W = 2 (trainer/step/padded_step.py): on both ranks two steps whose
    batches hold different numbers of unique ids make the same tensors, op for op, size for size,
    the alltoalls included (their split sizes are the config's). The eager W = 2 step fails the
    same comparison."""
    extra = FIXED_BAGS + W2_FIXED[case]
    for rank, (first, second, unique) in enumerate(spawn(2, _sizes_worker, extra + ["train.cuda_graph=on"])):
        assert unique[0] != unique[1], f"rank {rank}: both batches hold {unique[0]} unique ids: nothing is compared"
        assert first == second, f"rank {rank}: a size depends on the data: " + _first_difference(first, second)
    first, second, unique = spawn(2, _sizes_worker, extra)[0]
    assert unique[0] != unique[1] and first != second, "the eager step's sizes did not follow the data"


# Herald's sync is sized by its plan on the host (no read; its sizes follow the data, which a step
# between collectives may): the host-sync audit only
W2_PADDED = {**W2_FIXED, "herald": ["schedule=herald", "cache=lru"]}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(W2_PADDED))
def test_one_step_w2_padded(case):
    """train.cuda_graph=on at W = 2: one host sync per step (the loss), and the padded step's own
    code (the request, the owners' reads and sums, the update; with the HET cache its version
    checks, installs and pushes) makes nothing on the host, reads nothing back and makes no tensor
    whose size depends on device values (the CPU's id map: cache/slotmap.py's masked calls)."""
    overrides = ["train.cuda_graph=on", "optim=adagrad"] + W2_PADDED[case]
    for rank, (records, plans) in enumerate(spawn(2, audit_worker, overrides, False)):
        _check((records, plans), f"W=2 cuda_graph=on {case} rank {rank}", most_syncs=1)
        inside = [r for r in records if r.file.startswith(CAPTURED + (
            "trainer/step/padded_step.py", "trainer/sparse/embedding/fixed/", "trainer/sparse/embedding/cache/"))]
        assert not inside, "the padded step must be free of host work:\n" + "\n".join(map(str, inside))
        assert not [r for r in records if r.kind == "shape"], "a tensor sized by device values"


W2_CONFIGS = {
    # no cache, the serial step: RowExchange.pull / push; the Triton kernels (interpreted) on the
    # sparse side
    "plain-triton": ["optim=adagrad", "train.pipeline=off"],
    # HET cache at bounded staleness, FAE replicated rows, skip mode's journal, row-wise Adagrad
    "het-fae": ["cache=lru", "consistency=ssp", "placement=fae", "placement.hot_batches=true",
                "optim=adam", "train.nonfinite=skip"],
    # Herald's partition and on-demand sync (lent rows)
    "herald": ["schedule=herald", "cache=lru"],
    # pipelined step (the default): the audited step also makes step + 1's batch and plan, sends
    # its requests and the rows this step does not update
    "pipeline-ids": ["train.pipeline=ids", "comm.settled_rows=always", "optim=adagrad"],
    # ... and the owners answer step + 1's version checks during this step (a cache is required)
    "pipeline-rows": ["train.pipeline=rows", "cache=lfu", "consistency=ssp", "optim=adagrad"],
}


@pytest.mark.parametrize("shortcut", [True, False])
def test_positions_checks_its_count_on_both_paths(shortcut: bool, monkeypatch: pytest.MonkeyPatch):
    """trainer.base.core.device.positions: the CPU shortcut (torch.nonzero) and the device path
    (nonzero_static, the one the audit sees) give the same positions and both refuse a wrong count."""
    import kernels.reference
    import trainer.base.core.device as device
    monkeypatch.setattr(kernels.reference, "CPU_SHORTCUTS", shortcut)
    mask = torch.tensor([False, True, True, False, True])
    assert device.positions(mask, 3).tolist() == [1, 2, 4]
    assert device.select(torch.arange(10, 15), mask, 3).tolist() == [11, 12, 14]
    for wrong in (2, 4):
        with pytest.raises(RuntimeError, match="count is not the mask's"):
            device.positions(mask, wrong)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(W2_CONFIGS))
def test_one_step_w2(name: str, monkeypatch: pytest.MonkeyPatch):
    """W = 2 gloo ranks (remote rows: the exchange, the cache, replicas, Herald)."""
    fresh = name == "plain-triton"  # the ranks import triton fresh, in the interpreter (not the forkserver's)
    if fresh:
        monkeypatch.setenv("TRAINER_KERNELS", "triton")
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, result in enumerate(spawn(2, audit_worker, W2_CONFIGS[name], fresh=fresh)):
        _check(result, f"W=2 {name} rank {rank}", most_syncs=SYNCS_AT_MOST.get(name))


def test_allow_lists_give_reasons():
    for lst in ALLOWED.values():
        for (file, function), why in lst.items():
            assert os.path.exists(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), file))
            assert function and len(why) > 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (docs/gpu.md, item 1)")
@pytest.mark.parametrize("pipeline, graph, most", [("off", "off", SYNCS_AT_MOST["w1"]),
                                                   ("ids", "off", SYNCS_AT_MOST["w1"]), ("ids", "on", 1)])
def test_cuda_step_syncs_w1(pipeline: str, graph: str, most: int):
    """On a GPU: the audited W = 1 step's host syncs, counted by CUDA itself
    (torch.cuda.set_sync_debug_mode("warn") warns once per synchronizing call): at most the
    loss and the plan's count read-back, as the CPU audit predicts (SYNCS_AT_MOST["w1"]); with
    train.cuda_graph=on (the whole step, captured at the first step, since the compiled update
    reads the sparse rate on the device, and replayed by the audited step) the loss only."""
    import warnings

    from trainer.base.comm import make_collectives
    from trainer.run.resolve.configure import load_config as to_config
    from trainer.run.runner import Trainer

    c = to_config(make_cfg(TINY + ["comm=local", "train.device=cuda", "optim=adagrad",
                                   f"train.pipeline={pipeline}", f"train.cuda_graph={graph}"]))
    comm = make_collectives(c.comm.backend, c.comm.timeout_s, c.comm.dist_backend)
    try:
        trainer = Trainer(c, comm, None)
        for step in range(WARMUP_STEPS):
            trainer.train_step(step)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(WARMUP_STEPS)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        comm.close()
    # one warning per synchronising call; torch also warns, once per process, that the mode is a
    # prototype ("... does not yet detect all synchronizing operations"): not a sync
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    print(f"--- cuda W=1 pipeline={pipeline} cuda_graph={graph}: {len(syncs)} host syncs in one step")
    assert len(syncs) <= most, syncs
    if graph == "on":  # the compiled update reads the rate on the device: captured at step 0, every step replayed
        s = trainer.pipeline.strategy.summary()
        assert s["replays"] == WARMUP_STEPS + 1 and s["eager_steps"] == 0, s


@pytest.mark.parametrize("policy", ["error", "hash"])
def test_criteo_batch_on_the_device_is_made_there(policy: str):
    """DALI's GPU pipeline hands `to_batch` its columns on the device (docs/gpu.md, item 4): the
    id guard, the vocabulary, the folding into the configured tables and the standardisation must
    then make nothing on the host, copy nothing per batch (their constants are copied once:
    trainer/base/core/device.py resident) and read back nothing, except policy error's one flag per batch
    (a bad batch is refused before anything uses it). Ids out of range under hash are folded."""
    from trainer.workload.data.blocks import to_batch
    from trainer.workload.data.ids import IdGuard
    from trainer.workload.data.vocab import Vocab

    b, t, f = 8, 3, 2

    def constants():  # made on the host, as the data source makes them
        vocab = Vocab(keys=torch.tensor([1, 2, 12, 35]), offsets=torch.tensor([0, 10, 30]),
                      starts=torch.tensor([0, 2, 3]), kept=[2, 1, 1], min_count=1)
        # the configured (folded) table sizes, the id guard, the dense statistics
        return torch.tensor([5, 7, 11]), IdGuard([10, 20, 30], policy), vocab, (torch.zeros(f), torch.ones(f))

    gen = torch.Generator().manual_seed(0)
    cols = (torch.randint(0, 2, (b,)).float(), torch.rand(b, f, generator=gen),
            torch.randint(0, 10, (b, t), generator=gen))
    if policy == "hash":
        cols[2][0, 1] = 25  # table 1 has 20 rows: folded to 5
    rows, guard, vocab, norm = constants()
    want = to_batch(cols, f, rows, guard, "batch", norm, vocab)
    with StepAudit() as audit:
        rows, guard, vocab, norm = constants()
        dev = tuple(c.to("cpu") for c in cols)  # "on the device"
        for _ in range(2):  # the first batch copies the constants once
            got = to_batch(dev, f, rows, guard, "batch", norm, vocab)
        audit.recording = True
        got = to_batch(dev, f, rows, guard, "batch", norm, vocab)
        audit.recording = False
    assert torch.equal(got.values, want.values) and torch.equal(got.dense, want.dense)
    assert audit.label.get(got.values) == DEV and audit.label.get(got.dense) == DEV
    records = [r for r in audit.records if r.kind != "host" or policy == "hash"]
    assert not records, table(records)
    reads = audit.of("host")
    assert len(reads) == (1 if policy == "error" else 0), table(reads)
    if policy == "hash":
        assert guard.hashed == 3  # one id in each of the three batches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (docs/gpu.md, item 1)")
def test_fixed_size_replacements_do_not_sync_on_cuda():
    """The fixed-size replacements the step relies on instead of host reads (docs/gpu.md, item 1)
    must not synchronise on this torch's CUDA kernels: set_sync_debug_mode("error") raises at a
    synchronising call. A plain nonzero is checked to raise, so the mode is known to be on."""
    mask = torch.tensor([False, True, True, False, True], device="cuda")
    vals = torch.arange(5, device="cuda")
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    lengths = torch.tensor([2, 0, 3], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.nonzero(mask)
        assert torch.nonzero_static(mask, size=3).shape == (3, 1)
        torch._assert_async(mask.sum() == 3, "count")
        counts.index_add_(0, vals % 4, torch.ones_like(vals))
        rep = torch.repeat_interleave(torch.arange(3, device="cuda"), lengths, output_size=5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.tolist() == [2, 1, 1, 1] and rep.tolist() == [0, 0, 2, 2, 2]
