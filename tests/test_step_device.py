"""Device handling of a training step, checked on CPU (no GPU in CI; issue 16).

What can fail here without a GPU:
- ``Batch.offsets()`` / ``table_index()`` run on a ``meta`` batch: a tensor they made on the CPU
  instead of on the batch's device fails at once (a meta tensor cannot meet a CPU one);
- one training step (after two warm-up steps) runs under ``device_audit.StepAudit``, which keeps a
  virtual device per tensor (host-born or following the trainer's device) and lists every factory
  called without ``device=``, every op mixing the two, and every host read. Each must be at a site
  of the allow-lists below, each entry with the reason it is allowed; the entries marked TODO are
  device bugs in files being refactored right now (trainer/embedding/, trainer/runner.py), to be
  fixed there afterwards (the fix is named in the entry). A new site fails the test with the list.

Sites are (file, function), not lines, so moving code inside a function keeps the lists valid;
moving it to another function or file fails the test until the list is updated: on purpose, the
move is where device handling gets lost.

Host syncs: run with ``-s`` to see, per configuration, every host read and every op whose output
size depends on device values, with call counts.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from device_audit import HOST, Record, StepAudit, outside, table
from helpers import make_cfg, spawn

TINY = ["data=tiny", "train.steps=4", "data.batch_size=16", "data.eval_samples=32",
        "data.eval_batch_size=32", "train.threads=1", "train.progress=off", "data.min_bag=0"]
WARMUP_STEPS = 2  # optimizer state, cache fills and the first lent rows happen here, not audited

# ---------------------------------------------------------------------------------- allow-lists

SPLITS_TENSOR = ("alltoall split sizes are host integers by nature (the backends take them as a "
                 "Python list); the torch backend moves the tensor to the process group's device")
FACTORY_OK: dict[tuple[str, str], str] = {
    ("trainer/comm/base.py", "_exchange_splits"): SPLITS_TENSOR,
    ("trainer/embedding/exchange.py", "_segment_counts"):
        "TODO(exchange.py _segment_counts): torch.arange(len(splits)) and torch.tensor(splits) are "
        "made on the host while `mask` is on the device; count with cumsum(mask) read at the split "
        "ends on mask.device (one .tolist() for the sizes)",
}
MIX_OK: dict[tuple[str, str], str] = {
    ("trainer/comm/torch_dist.py", "_alltoall"):
        "gloo stages through host memory: the split-size tensor (host by nature, see "
        "_exchange_splits) meets `out`, made on the process group's device; the audit cannot tell "
        "the group's device from the trainer's",
    ("trainer/embedding/sharding.py", "global_ids"):
        "TODO(sharding.py global_ids): table_offsets is a CPU tensor indexed by the batch's device "
        "table index (an error on CUDA); keep the offsets on the store's device",
    ("trainer/embedding/sharding.py", "decode"):
        "TODO(sharding.py decode): searchsorted / index of the CPU table_offsets with device gids "
        "(an error on CUDA); same fix",
    ("trainer/embedding/exchange.py", "check"):
        "TODO(exchange.py RowExchange.check): searchsorted over the CPU local_table_offsets and "
        "Bounds.pull (CPU, consistency.py) indexed by a device table index; move both to the "
        "store's device once (Bounds.to(device) at HetRemote / RowExchange construction)",
    ("trainer/embedding/exchange.py", "_segment_counts"): FACTORY_OK[
        ("trainer/embedding/exchange.py", "_segment_counts")],
    ("trainer/embedding/cache.py", "take_due"):
        "TODO(cache.py RowCache.take_due): Bounds.push (CPU) indexed by device slot tables; same "
        "fix as check",
}
INHERENT = "needed by the algorithm"
HOST_OK: dict[tuple[str, str], str] = {
    ("trainer/runner.py", "_step"):
        f"{INHERENT}: the step's global loss (recorded every step, checked for NaN/inf; with "
        "train.nonfinite=skip every rank needs it before updating). Also Adam's step counters "
        "(.item() inside torch.optim: CPU tensors by torch's design unless fused/capturable, so no "
        "device sync). Possible: read the loss one step late in stop mode",
    ("trainer/embedding/exchange.py", "plan_lookup"):
        f"{INHERENT}: the alltoall split sizes per owner (one .tolist() per step)",
    ("trainer/comm/base.py", "_exchange_splits"): f"{INHERENT}: received alltoall split sizes",
    ("trainer/embedding/exchange.py", "push_updates"): f"{INHERENT}: alltoall split sizes",
    ("trainer/embedding/exchange.py", "_segment_counts"):
        f"{INHERENT}: alltoall split sizes of the rows a version check sends (see FACTORY_OK)",
    ("trainer/embedding/cache.py", "_choose_slots"):
        "TODO(cache.py RowCache._choose_slots): a Python loop over tables with two .tolist() and one "
        "int(need[t]) per table with misses; choose every table's victims in one segmented pass "
        "(sort by (table, key)) and read one count vector",
    ("trainer/embedding/cache.py", "_victims"):
        "TODO(cache.py RowCache._victims): int(ok.sum()) per table; goes with _choose_slots",
    ("trainer/embedding/cache.py", "insert"):
        "DirectSlotMap's live counter (int(new.sum())): the direct map is the CPU path only; on a GPU "
        "the cache uses the Triton hash map",
    ("trainer/embedding/cache.py", "erase"): "DirectSlotMap, as insert",
    ("trainer/embedding/module.py", "_reduce_hot"):
        "TODO(module.py HybridEmbedding._reduce_hot): a consistency check, int(at.max()) and "
        "torch.equal, 2 syncs per step with replicated rows; make it torch._assert_async or debug-only",
    ("trainer/embedding/herald.py", "find"):
        "TODO(herald.py LentRows.find): bool(missing.any()) consistency check per call (4 per "
        "step); torch._assert_async or debug-only",
    ("trainer/embedding/herald.py", "_positions"):
        "TODO(herald.py HeraldRemote._positions): torch.equal consistency check per call; same",
}


# ---------------------------------------------------------------------------------- the audit


def audit_worker(rank: int, world: int, overrides: list[str]) -> list[Record]:
    """Build the trainer and run WARMUP_STEPS + 1 steps under the audit; return the last step's
    records. Module level: the W > 1 runs call it in spawned ranks."""
    from trainer.comm import make_collectives
    from trainer.configure import load_config as to_config
    from trainer.runner import Trainer

    comm_key = ["comm=torch"] if world > 1 else ["comm=local"]
    c = to_config(make_cfg(TINY + list(overrides) + comm_key))
    comm = make_collectives(c.comm.backend, c.comm.timeout_s, c.comm.dist_backend)
    audit = StepAudit()
    try:
        with audit:
            trainer = Trainer(c, comm, None)
            for step in range(WARMUP_STEPS):
                trainer.train_step(step)
            inner = trainer._step  # lookup, model, backward, owner update, dense allreduce

            def audited(*args: Any, **kw: Any) -> Any:
                audit.recording = True
                try:
                    return inner(*args, **kw)
                finally:
                    audit.recording = False

            trainer._step = audited
            trainer.train_step(WARMUP_STEPS)
    finally:
        comm.close()
    assert audit.records, "nothing was recorded: is Trainer._step still the step?"
    return audit.records


def _check(records: list[Record], what: str) -> None:
    counts = {k: len([r for r in records if r.kind == k]) for k in ("factory", "mix", "host", "shape")}
    print(f"\n--- {what}: {counts}\n{table(records)}")
    bad = (outside([r for r in records if r.kind == "factory"], FACTORY_OK)
           + outside([r for r in records if r.kind == "mix"], MIX_OK)
           + outside([r for r in records if r.kind == "host"], HOST_OK))
    assert not bad, (f"{what}: device handling outside the allow-lists of {__file__}:\n"
                     + "\n".join(sorted({str(r) for r in bad})))


# ---------------------------------------------------------------------------------- tests


def _batch(device: str):
    from trainer.data.batch import Batch

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
    assert audit.label[host] == HOST and audit.label[mixed] == "dev"
    kinds = sorted((r.kind, r.op) for r in audit.records)
    assert kinds == [("factory", "arange"), ("factory", "tensor"), ("host", "int"),
                     ("mix", "add"), ("shape", "nonzero")], kinds
    assert {r.file for r in audit.records} == {"<outside>"}  # this file is not trainer/ or kernels/


@pytest.mark.parametrize("model", ["dlrm", "wdl", "deepfm", "dcn"])
def test_one_step_w1(model: str):
    """W = 1 (every row owned): lookup, pooled gather and its backward, owner update, dense step."""
    _check(audit_worker(0, 1, [f"model={model}", "optim=adagrad"]), f"W=1 model={model}")


W2_CONFIGS = {
    # no cache: RowExchange.pull / push; the Triton kernels (interpreted) on the sparse side
    "plain-triton": ["optim=adagrad"],
    # HET cache at bounded staleness, FAE replicated rows, skip mode's journal, row-wise Adagrad
    "het-fae": ["cache=lru", "consistency=ssp", "placement=fae", "placement.hot_batches=true",
                "optim=adam", "train.nonfinite=skip"],
    # Herald's partition and on-demand sync (lent rows)
    "herald": ["schedule=herald", "cache=lru"],
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(W2_CONFIGS))
def test_one_step_w2(name: str, monkeypatch: pytest.MonkeyPatch):
    """W = 2 gloo ranks (remote rows: the exchange, the cache, replicas, Herald)."""
    if name == "plain-triton":  # the spawned ranks import triton fresh, in the interpreter
        monkeypatch.setenv("TRAINER_KERNELS", "triton")
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, records in enumerate(spawn(2, audit_worker, W2_CONFIGS[name])):
        _check(records, f"W=2 {name} rank {rank}")


def test_allow_lists_give_reasons():
    for lst in (FACTORY_OK, MIX_OK, HOST_OK):
        for (file, function), why in lst.items():
            assert os.path.exists(os.path.join(os.path.dirname(os.path.dirname(__file__)), file))
            assert function and len(why) > 20
