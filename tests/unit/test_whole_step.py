"""train.cuda_graph=on at W = 1 (trainer/step/whole_step.py): the whole step as one function of fixed
shapes, over a lookup plan padded to a capacity set by the config (trainer/sparse/embedding/fixed/padded.py).
On a CPU it runs eagerly and must equal train.cuda_graph=off bit for bit: every loss, dense
parameter and embedding row, for the four models, SGD / Adagrad / row-wise Adagrad, fp32 and bf16
autocast, ragged and fixed bags, skipped steps. That no tensor's size follows the data is checked
by the device audit (tests/unit/test_step_device.py). The capture itself needs a GPU (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from helpers import make_cfg, run_single
from parity_helpers import BASE, assert_same_run
from trainer.base.config import validate_world
from trainer.run.resolve.configure import load_config
from trainer.sparse.embedding.exchange import plan_lookup
from trainer.sparse.embedding.fixed.padded import padded_plan, unique_capacity
from trainer.sparse.embedding.sharding import RowSharding
from trainer.run.runner import RunResult

SHORT = BASE + ["train.steps=8"]
CASES = {
    "dlrm-sgd-momentum": ["model=dlrm", "optim=sgd", "optim.momentum=0.9"],
    "dlrm-adagrad-bf16": ["model=dlrm", "optim=adagrad", "train.precision=bf16"],
    "deepfm-adagrad-onehot": ["model=deepfm", "optim=adagrad", "data.min_bag=1", "data.max_bag=1"],
    "dcn-sgd-bf16-emptybags": ["model=dcn", "optim=sgd", "train.precision=bf16", "data.min_bag=0"],
    "wdl-rowwise-dropout": ["model=wdl", "optim=adam", "model.dropout=0.2"],
    "mean-decay-halfrows-serial": ["optim=adagrad", "model.pooling=mean", "optim.sparse_weight_decay=0.01",
                                   "embedding.dtype=bf16", "embedding.rounding=nearest", "train.pipeline=off"],
    # the rounding's salt a device value (one graph for every step's): the same bits as the host's
    "fp16-rows-stochastic": ["optim=adagrad", "embedding.dtype=fp16", "embedding.rounding=stochastic"],
    "bf16-rows-stochastic-sgd": ["optim=sgd", "embedding.dtype=bf16", "embedding.rounding=stochastic"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_step_equals_the_eager_step_bit_for_bit(case):
    ref = run_single(SHORT + CASES[case])
    got = run_single(SHORT + CASES[case] + ["train.cuda_graph=on"])
    assert got.losses == ref.losses
    assert_same_run(ref, got, rtol=0, atol=0)
    graph = got.summary["cuda_graph"]
    assert graph["scope"] == "step" and graph["eager_steps"] == 8 and not graph["captured"]
    assert graph["optimizer"] == {"captured": False, "replays": 0, "eager_steps": 8}  # dense_update.py
    for key in ("ids_per_step", "unique_per_step", "remote_per_step"):  # counted on the device, read once
        assert got.summary["embedding"][key] == ref.summary["embedding"][key], key


def test_whole_step_keeps_skip_semantics(monkeypatch):
    """train.nonfinite=skip: a poisoned batch changes no row (the update's mask holds the loss's
    finiteness, on the device) and no dense parameter, as in the eager step."""
    from skip_helpers import poison_w1
    poison_w1(monkeypatch, (2,))
    extra = ["train.nonfinite=skip", "train.steps=6", "optim=adagrad"]
    ref = run_single(BASE + extra)
    got = run_single(BASE + extra + ["train.cuda_graph=on"])
    assert got.summary["skipped_steps"] == ref.summary["skipped_steps"] == 1
    assert [str(x) for x in got.losses] == [str(x) for x in ref.losses]  # the nan of step 2 too
    assert_same_run(RunResult({}, 0, [], ref.state), RunResult({}, 0, [], got.state), rtol=0, atol=0)


def test_padded_plan_is_the_eager_plan_in_fixed_slots():
    """The first `count` slots are plan_lookup's unique ids (same order, same inverse); the rest are
    distinct rows the batch does not hold; padding entries (ids >= the sentinel) join no slot."""
    sh = RowSharding([97, 1001, 13, 250], 1, 0)
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        high = sh.n_ids if trial % 2 else 20  # many repeats, or few
        gids = torch.randint(0, high, (n,), generator=gen)
        eager = plan_lookup(sh, gids)
        u, cap = eager.uniq.numel(), unique_capacity(n, 1, [sh.local_rows])
        for pad in (0, 9):
            ids = torch.cat([gids, torch.full((pad,), sh.n_ids)])
            plan = padded_plan(sh, ids, min(cap + pad, sh.local_rows), sh.n_ids if pad else None)
            c = plan.rows.numel()
            assert int(plan.count) == u and plan.valid.tolist() == [True] * u + [False] * (c - u)
            assert torch.equal(plan.rows[:u], sh.local_index(eager.uniq))
            assert torch.equal(plan.inverse[:n], eager.inverse)
            assert (plan.inverse[n:] == c - 1).all()
            assert plan.rows.unique().numel() == c and 0 <= int(plan.rows.min()) and int(plan.rows.max()) < sh.local_rows
            assert not torch.isin(plan.rows[u:], plan.rows[:u]).any()
    every = padded_plan(sh, torch.arange(sh.n_ids).flip(0), sh.local_rows)  # a batch holding every row
    assert int(every.count) == sh.local_rows and torch.equal(every.rows, torch.arange(sh.local_rows))


@pytest.mark.parametrize("override, what", [
    ("embedding.kind=dynamic", "dynamic tables"), ("embedding.audit=true", "audit")])
def test_what_has_no_fixed_shapes_yet_runs_dense_only_at_w1(override, what, capsys):
    """At W = 1, dynamic tables and the audit have no whole-step mode yet: train.cuda_graph=on
    captures the dense half only, says why once, and equals cuda_graph=off bit for bit."""
    extra = ["embedding.capacity=64"] if "dynamic" in override else []
    base = SHORT + [override] + extra
    validate_world(load_config(make_cfg(base + ["train.cuda_graph=on"])), 1)  # no refusal
    off = run_single(base)
    capsys.readouterr()
    on = run_single(base + ["train.cuda_graph=on"])
    assert capsys.readouterr().err.count("train.cuda_graph=on: ") == 1
    assert on.losses == off.losses
    assert_same_run(off, on, rtol=0, atol=0)
    graph = on.summary["cuda_graph"]
    assert graph["scope"] == "dense" and what in graph["dense_only"], graph


PLACED = ["data=tiny", "data.max_bag=1", "train.steps=24", "data.global_batch_size=48", "data.test_samples=480",
          "data.eval_batch_size=40", "train.threads=1", "train.progress=off", "placement.window_batches=8"]
AT_W1 = {
    "fae-adagrad": ["placement=fae", "placement.budget_bytes=16000", "optim=adagrad"],
    "fae-sgd-ragged-skip": ["placement=fae", "placement.budget_bytes=16000", "optim=sgd", "data.min_bag=0",
                            "data.max_bag=3", "train.nonfinite=skip"],
    "sca-adam": ["placement=sca", "optim=adam"],
    # every row is local at W = 1: no cache is built, the bounds bound nothing (as off)
    "lru-ssp": ["cache=lru", "consistency=ssp", "optim=adagrad"],
    # Herald lends nothing at W = 1 (every row is the one worker's): its order of samples only
    "herald-lru": ["schedule=herald", "cache=lru", "optim=adagrad"],
}


@pytest.mark.parametrize("case", sorted(AT_W1))
def test_the_whole_step_with_replicated_rows_or_a_cache_at_w1_equals_the_eager_step(case):
    """Replicated rows in the workspace's last H rows, the touched ones updated under a mask."""
    ref = run_single(PLACED + AT_W1[case])
    got = run_single(PLACED + AT_W1[case] + ["train.cuda_graph=on"])
    assert got.losses == ref.losses
    assert_same_run(ref, got, rtol=0, atol=0)
    for key in ("unique_per_step", "remote_per_step"):
        assert got.summary["embedding"][key] == ref.summary["embedding"][key]
    if "placement" in AT_W1[case][0]:  # sca's costs replicate nothing at W = 1 (no wire to save)
        assert got.summary["placement"]["hot_rows"] == ref.summary["placement"]["hot_rows"] >= ("fae" in case)
    assert got.summary["cuda_graph"]["scope"] == "step"


SCHEDULES = {"constant": ["optim.warmup_steps=0", "optim.decay=none"],
             "warmup-poly": ["optim.warmup_steps=4", "optim.decay=poly"]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision, schedule, backend", [
    ("fp32", "constant", "auto"), ("bf16", "constant", "auto"), ("fp32", "warmup-poly", "auto"),
    ("fp32", "constant", "reference"), ("fp32", "warmup-poly", "reference")])
def test_whole_step_replays_equal_the_eager_step_on_cuda(precision, schedule, backend):
    """On CUDA the whole step is captured and replayed: the same losses, parameters and rows as
    train.cuda_graph=off within float tolerance (the off step's Triton gather adds with atomics).
    With the Triton kernels the sparse rate is read on the device, so one graph serves every step
    from the first, through a warmup and a decay too; with kernels.backend=reference the rate is a
    constant of the graph: captured once it is steady (from the second step), a changing rate
    runs eagerly."""
    extra = ["train.device=cuda", f"train.precision={precision}", "train.steps=12", "optim=adagrad",
             f"kernels.backend={backend}", *SCHEDULES[schedule]]
    ref = run_single(BASE + extra)
    got = run_single(BASE + extra + ["train.cuda_graph=on"])
    graph = got.summary["cuda_graph"]
    if backend == "auto":
        assert graph["captured"] and graph["replays"] == 12 and graph["eager_steps"] == 0, graph
    elif schedule == "constant":
        assert graph["captured"] and graph["replays"] == 11 and graph["eager_steps"] == 1, graph
    else:  # every step of the warmup and the decay has its own rate
        assert not graph["captured"] and graph["eager_steps"] == 12, graph
    # the dense optimizer's own graph: two eager steps, then one graph through every rate
    assert graph["optimizer"] == {"captured": True, "replays": 10, "eager_steps": 2}, graph
    assert_same_run(ref, got, rtol=1e-5, atol=1e-6)


def test_memory_plan_counts_the_padded_step():
    """trainer/run/resolve/memplan.py counts the padded step's [C, d] buffers (workspace, its gradient, the
    update's rows before and after) and its plan, C being the step's own capacity: per table the
    fewer of its ids in a batch (48 samples x 3 ids) and its rows."""
    import trainer.run.resolve.memplan as memplan
    from trainer.sparse.embedding.fixed.het import HET_ENTRY_BYTES, JOURNAL_SLOT_BYTES
    from trainer.sparse.embedding.fixed.padded import PLAN_SLOT_BYTES, REQUEST_SLOT_BYTES
    c = load_config(make_cfg(BASE + ["train.cuda_graph=on"]))
    slots = unique_capacity(48, 3, [97, 1001, 13, 250])
    assert slots == 97 + 144 + 13 + 144
    d = c.model.embedding_dim
    assert memplan.plan_memory(c, 1, 0).parts["padded step"] == slots * (4 * d * 4 + PLAN_SLOT_BYTES)
    # W > 1 (trainer/step/padded_step.py): 2 blocks of the slots rank 0 may ask one owner for
    block = unique_capacity(24, 3, [49, 501, 7, 125])
    assert memplan.plan_memory(c, 2, 0).parts["padded step"] == 2 * block * (8 * d * 4 + REQUEST_SLOT_BYTES)
    assert "padded step" not in memplan.plan_memory(load_config(make_cfg(BASE + ["train.cuda_graph=dense"])), 1, 0).parts
    # the HET cache's blocks at W = 2 (fixed/het.py): its entries and the dirty evictions' block, and
    # where its push blocks follow the traffic (the default) the journal that undoes an overflowing step
    plain = 2 * block * (8 * d * 4 + REQUEST_SLOT_BYTES)
    het = plain + 2 * block * (6 * d * 4 + HET_ENTRY_BYTES) + 2 * block * (4 * d * 4 + 24)
    at_bound = load_config(make_cfg(BASE + ["train.cuda_graph=on", "cache=lru", "train.unique_capacity=0"]))
    assert memplan.plan_memory(at_bound, 2, 0).parts["padded step"] == het
    follows = load_config(make_cfg(BASE + ["train.cuda_graph=on", "cache=lru"]))
    assert memplan.plan_memory(follows, 2, 0).parts["padded step"] == het + 2 * block * 4 * (JOURNAL_SLOT_BYTES + 2 * d * 4)
    # Herald (its own protocol, whatever the cache of its lent rows): the plain blocks
    herald = load_config(make_cfg(BASE + ["train.cuda_graph=on", "schedule=herald", "cache=lru"]))
    assert memplan.plan_memory(herald, 2, 0).parts["padded step"] == plain
    # a placement adds the replica block (workspace and gradient, fp32) of the rows its budget holds
    placed = load_config(make_cfg(BASE + ["train.cuda_graph=on", "placement=fae", "placement.budget_bytes=16000"]))
    hot = 16000 // (d * 4)
    assert memplan.plan_memory(placed, 1, 0).parts["padded step"] == slots * (4 * d * 4 + PLAN_SLOT_BYTES) + hot * d * 8
    got = run_single(BASE + ["train.cuda_graph=on", "train.steps=1"], return_state=False)
    assert got.summary["cuda_graph"]["unique_capacity"] == got.summary["cuda_graph"]["unique_bound"] == slots
    assert 0 < got.summary["cuda_graph"]["most_slots_used"] < slots  # one-hot-to-3 bags of 48 samples


def test_a_smaller_capacity_is_exact_and_an_overflowing_step_is_trained_again():
    """train.unique_capacity below the bound (398 slots here): with room for every batch's unique
    ids (this run holds at most ~200) the same run bit for bit, no step trained again; with too
    little, a step whose plan overflows changes nothing (its update masked by count <= capacity on
    the device) and is trained again in exact sizes (the excess rides the loss's read): still the
    same run, the steps counted in cuda_graph.overflow_steps, the counters the exact step's."""
    extra = ["train.steps=4", "optim=adagrad"]
    ref = run_single(BASE + extra)
    got = run_single(BASE + extra + ["train.cuda_graph=on", "train.unique_capacity=300"])
    assert got.summary["cuda_graph"]["unique_capacity"] == 300
    assert got.summary["cuda_graph"]["overflow_steps"] == 0
    assert got.losses == ref.losses
    assert_same_run(ref, got, rtol=0, atol=0)
    for skip in ([], ["train.nonfinite=skip"]):
        tight = run_single(BASE + extra + skip + ["train.cuda_graph=on", "train.unique_capacity=50"])
        assert tight.summary["cuda_graph"]["overflow_steps"] == 4
        assert tight.losses == ref.losses
        assert_same_run(ref, tight, rtol=0, atol=0)
        for key in ("ids_per_step", "unique_per_step", "remote_per_step"):
            assert tight.summary["embedding"][key] == ref.summary["embedding"][key], key


def test_the_measured_capacity_at_w1_is_exact():
    """train.unique_capacity=-1 (the default) at W = 1: the bound for 16 steps, then what they
    needed + 10% (the plan's shapes change once: a graph is captured again); the same run."""
    extra = ["train.steps=30", "optim=adagrad"]
    ref = run_single(BASE + extra)
    got = run_single(BASE + extra + ["train.cuda_graph=on"])
    graph = got.summary["cuda_graph"]
    assert graph["capacity_rule"] == "measured" and graph["unique_capacity"] < graph["unique_bound"]
    assert graph["unique_capacity"] >= graph["most_slots_used"] or graph["overflow_steps"] > 0
    assert got.losses == ref.losses
    assert_same_run(ref, got, rtol=0, atol=0)