"""train.cuda_graph=on at W > 1 (trainer/step/padded_step.py): every tensor between the step's
collectives at a shape fixed by the config, the alltoalls padded to blocks of C slots per owner.

On a CPU it runs eagerly and must equal train.cuda_graph=off at the same W bit for bit (the same
rows, the same sums in the same order, the same optimizer arithmetic): every loss, dense parameter,
table row and evaluation logit; and so the single-process reference within the parity tolerance.
The padded request and the owner's sum are checked against plan_lookup and the eager sum
directly (tests/unit/test_whole_step.py has the W = 1 plan's)."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_same_eval, make_cfg, run_single, run_world
from kernels.reference import first_and_sums
from parity_helpers import BASE, assert_same_run
from trainer.base.config import validate_world
from trainer.sparse.embedding.exchange import plan_lookup
from trainer.sparse.embedding.fixed.padded import padded_combine, padded_request, unique_capacity
from trainer.sparse.embedding.sharding import RowSharding
from trainer.run.resolve.configure import load_config

SHORT = BASE + ["train.steps=10"]


def off_and_on(world: int, overrides: list[str], keys: tuple[str, ...] = ()) -> tuple[list, list]:
    """The run with cuda_graph=off and with on, at `world`: every loss, row, optimizer state, dense
    parameter and eval logit equal bit for bit, and summary.json's `keys` equal."""
    off = run_world(world, overrides)
    on = run_world(world, overrides + ["train.cuda_graph=on"])
    for a, b in zip(off, on):
        assert b.losses == a.losses
        assert_same_run(a, b, rtol=0, atol=0)
        assert_same_eval(a, b)
        for key in keys:
            assert b.summary.get(key) == a.summary.get(key), key
    return off, on

CASES = {
    "w2-adagrad": (2, ["optim=adagrad"]),
    "w3-sgd-ragged-emptybags": (3, ["optim=sgd", "data.min_bag=0", "data.max_bag=4"]),
    "w2-adam-mean-bf16-compute": (2, ["optim=adam", "model.pooling=mean", "train.precision=bf16"]),
    "w2-rowwise-bf16-rows-fp16-wire": (2, ["optim=adagrad", "optim.sparse=rowwise_adagrad", "embedding.dtype=bf16",
                                           "embedding.rounding=nearest", "comm.wire_precision=fp16"]),
    "w2-pipeline-off-wd": (2, ["optim=adagrad", "train.pipeline=off", "optim.weight_decay=0.01"]),
    # stochastic rounding of half rows: the owner's update runs between the collectives, outside a graph
    "w2-fp16-rows-stochastic": (2, ["optim=adagrad", "embedding.dtype=fp16", "embedding.rounding=stochastic"]),
    # four contributions to a row of the 13-row table: the owner's sum order shows (its own first)
    "w4-sgd": (4, ["optim=sgd"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_step_equals_the_eager_step_bit_for_bit(case):
    world, extra = CASES[case]
    off, on = off_and_on(world, SHORT + extra, ("eval_logloss",))
    graph = on[0].summary["cuda_graph"]
    assert graph["scope"] == "step" and graph["eager_steps"] == 10 and not graph["captured"]
    assert graph["optimizer"] == {"captured": False, "replays": 0, "eager_steps": 10}
    assert 0 < graph["most_slots_used"] <= graph["unique_capacity"] == graph["unique_bound"]
    # the same rows were asked for (counted on the device), and the wire carried the padded blocks
    assert on[0].summary["embedding"]["remote_per_step"] == off[0].summary["embedding"]["remote_per_step"] > 0
    assert on[0].summary["bytes"]["rows"] > off[0].summary["bytes"]["rows"]


@pytest.mark.dist
def test_padded_step_equals_one_process():
    """Against the single process within the parity tolerance (a dropped step under
    train.nonfinite=skip: tests/unit/test_nonfinite.py's padded case)."""
    extra = ["optim=adagrad", "data.min_bag=0", "data.max_bag=3"]
    ref = run_single(SHORT + extra)
    for res in run_world(3, SHORT + extra + ["train.cuda_graph=on"]):
        assert_same_run(ref, res)
        assert_same_eval(ref, res)


@pytest.mark.dist
@pytest.mark.parametrize("skip", [False, True])
def test_a_block_of_the_most_slots_used_is_exact_and_a_smaller_one_trains_the_overflow_again(skip):
    """summary.json's most_slots_used (the most unique ids any rank asked one owner for, over the
    ranks) is the smallest block the same run fits in: with it the run is the same bit for bit
    (and the wire smaller), with no step trained again. With fewer slots some rank's request
    overflows: every rank learns it from the ids alltoall (each block carries its requester's
    excess), masks the step's updates off, and trains the step again in exact sizes: still the
    same run bit for bit, the steps counted (cuda_graph.overflow_steps), the counters the exact
    step's. train.nonfinite=skip reads the excess before the backward; stop with the loss."""
    extra = ["optim=adagrad", "data.min_bag=1", "data.max_bag=3"] + (["train.nonfinite=skip"] if skip else [])
    off = run_world(2, SHORT + extra)
    first = run_world(2, SHORT + extra + ["train.cuda_graph=on", "train.unique_capacity=0"])
    most = first[0].summary["cuda_graph"]["most_slots_used"]
    assert [r.summary["cuda_graph"]["most_slots_used"] for r in first] == [most, most]
    assert 0 < most < first[0].summary["cuda_graph"]["unique_bound"]
    assert "overflow_steps" not in first[0].summary["cuda_graph"]  # at the bound none can overflow
    fit = run_world(2, SHORT + extra + ["train.cuda_graph=on", f"train.unique_capacity={most}"])
    assert fit[0].summary["cuda_graph"]["unique_capacity"] == most
    assert fit[0].summary["cuda_graph"]["overflow_steps"] == 0
    assert fit[0].summary["bytes"]["rows"] < first[0].summary["bytes"]["rows"]
    for a, b in zip(off, fit):
        assert_same_run(a, b, rtol=0, atol=0)
    small = most * 3 // 4
    tight = run_world(2, SHORT + extra + ["train.cuda_graph=on", f"train.unique_capacity={small}"])
    again = tight[0].summary["cuda_graph"]["overflow_steps"]
    assert 0 < again <= 10 and [r.summary["cuda_graph"]["overflow_steps"] for r in tight] == [again, again]
    for a, b in zip(off, tight):
        assert b.losses == a.losses
        assert_same_run(a, b, rtol=0, atol=0)
        assert_same_eval(a, b)
        for key in ("ids_per_step", "unique_per_step", "remote_per_step"):
            assert b.summary["embedding"][key] == a.summary["embedding"][key], key


@pytest.mark.dist
def test_the_measured_capacity_is_what_the_first_steps_needed_plus_a_margin():
    """train.unique_capacity=-1 (the default): the bound for the first MEASURE_STEPS steps, then
    the most slots they needed on any rank plus MARGIN; the run equals cuda_graph=off bit for bit
    (a later step that needs more is trained again) and its wire is the smaller blocks'."""
    from trainer.sparse.embedding.fixed.shapes import MARGIN, MEASURE_STEPS
    import math
    extra = ["optim=adagrad", "data.min_bag=1", "data.max_bag=3", "train.steps=40"]
    off = run_world(2, BASE + extra)
    bound = run_world(2, BASE + extra + ["train.cuda_graph=on", "train.unique_capacity=0"])
    measured = run_world(2, BASE + extra + ["train.cuda_graph=on"])
    early = run_world(2, BASE + extra[:-1] + [f"train.steps={MEASURE_STEPS}", "train.cuda_graph=on",
                                              "train.unique_capacity=0"])
    graph = measured[0].summary["cuda_graph"]
    assert graph["capacity_rule"] == "measured" and bound[0].summary["cuda_graph"]["capacity_rule"] == "bound"
    want = math.ceil(early[0].summary["cuda_graph"]["most_slots_used"] * MARGIN)
    assert graph["unique_capacity"] == want < graph["unique_bound"]
    assert measured[0].summary["bytes"]["rows"] < bound[0].summary["bytes"]["rows"]
    for a, b in zip(off, measured):
        assert b.losses == a.losses
        assert_same_run(a, b, rtol=0, atol=0)


def test_the_padded_request_is_the_eager_plan_in_fixed_blocks():
    """Block w holds plan_lookup's ids for owner w, ascending (the order they travel in), then
    padding; the inverse points every entry at its id's slot; padding entries join no slot."""
    gen = torch.Generator().manual_seed(0)
    for world in (2, 3, 4):
        sh = RowSharding([97, 1001, 13, 250], world, world - 1)
        for trial in range(40):
            n = int(torch.randint(1, 300, (1,), generator=gen))
            high = sh.n_ids if trial % 2 else 20
            gids = torch.randint(0, high, (n,), generator=gen)
            gids = gids[sh.valid(gids)]
            n = gids.numel()
            eager = plan_lookup(sh, gids)
            cap = unique_capacity(n, 1, sh.table_rows, world=world)
            for pad in (0, 7):
                ids = torch.cat([gids, torch.full((pad,), sh.n_ids)])
                req = padded_request(sh, ids, cap, sh.n_ids if pad else None)
                assert int(req.count) == eager.uniq.numel() and int(req.excess) == 0
                per_owner = [int((sh.owner(eager.uniq) == w).sum()) for w in range(world)]
                assert int(req.largest) == max(per_owner)
                blocks = req.ids.reshape(world, cap)
                valid = req.valid.reshape(world, cap)
                for w in range(world):
                    want = sh.local_index(eager.uniq[sh.owner(eager.uniq) == w])
                    k = want.numel()
                    assert valid[w].tolist() == [True] * k + [False] * (cap - k)
                    assert torch.equal(blocks[w, :k], want) and (blocks[w, k:] == sh.local_rows).all()
                # every entry's slot holds its id
                slot_gid = sh.global_of(req.ids, torch.arange(world).repeat_interleave(cap))
                assert torch.equal(slot_gid[req.inverse[:n]], gids)
                assert (req.inverse[n:] == world * cap - 1).all()
            small = padded_request(sh, gids, 3)
            assert int(small.excess) == sum(max(int((sh.owner(eager.uniq) == w).sum()) - 3, 0) for w in range(world))


def test_the_owner_sums_as_the_eager_update():
    """padded_combine's slots and sums equal first_and_sums' (the eager owner's), bit for bit,
    -0.0 included; padding entries reach no slot; the slots are distinct rows."""
    gen = torch.Generator().manual_seed(1)
    rows = 50
    for trial in range(50):
        m = int(torch.randint(1, 120, (1,), generator=gen))
        idx = torch.randint(0, rows + 1, (m,), generator=gen)  # rows: a padding entry
        grads = torch.randn(m, 3, generator=gen)
        grads[torch.rand(m, generator=gen) < 0.2] = -0.0
        comb = padded_combine(idx, rows)
        real = idx < rows
        keep, uniq, summed = first_and_sums(idx[real], grads[real], rows)
        order = torch.argsort(uniq)
        u = uniq.numel()
        assert int(comb.valid.sum()) == u and comb.valid[:u].all()
        assert torch.equal(comb.rows[:u], uniq[order])
        got = comb.sums(grads)[:u]
        assert torch.equal(got, summed[order]) and torch.equal(torch.signbit(got), torch.signbit(summed[order]))
        assert torch.equal(comb.counts[:u], torch.bincount(idx[real], minlength=rows)[uniq[order]])
        assert comb.rows.unique().numel() == comb.rows.numel() and int(comb.rows.max()) < rows
        assert (comb.counts[u:] == 0).all()


# what has no fixed-shape mode yet (without_fixed_shapes): the dense half captured, the sparse
# half exact-size; the reason is named in summary.json and once on stderr
DENSE_ONLY = {
    "w2-dynamic": (2, ["embedding.kind=dynamic", "embedding.capacity=64", "optim=adagrad"], "dynamic tables"),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(DENSE_ONLY))
def test_what_has_no_fixed_shapes_yet_runs_dense_only_and_equals_the_eager_step(case):
    """train.cuda_graph=on is refused for no policy: where the sparse side has no fixed-shape mode
    yet, the step captures the dense half only (DenseStep) and equals cuda_graph=off bit for bit:
    losses, rows, optimizer state, dense parameters, eval logits, the cache's counters."""
    world, extra, what = DENSE_ONLY[case]
    c = load_config(make_cfg(SHORT + extra + ["train.cuda_graph=on"]))
    validate_world(c, world)  # no refusal
    _, on = off_and_on(world, SHORT + extra, ("embedding", "cache", "staleness"))
    graph = on[0].summary["cuda_graph"]
    assert graph["scope"] == "dense" and what in graph["dense_only"], graph
    assert "unique_capacity" not in graph and "overflow_steps" not in graph


# Herald at W > 1 in fixed shapes: its sync (writebacks, pulls, lends, pushes) sized by the plan on
# the host, the rows into the request's blocks; a rank whose request does not fit (the plan counts
# it on the host) makes that lookup in exact sizes, never training a step twice
HERALD = {
    "w2-adagrad": (2, ["optim=adagrad"]),
    "w3-sgd-ragged-audit": (3, ["optim=sgd", "data.min_bag=0", "data.max_bag=3", "embedding.audit=true"]),
    # 4 lent rows a worker: evictions and writebacks every step
    "w2-few-lent-adam-pipeline-off": (2, ["optim=adam", "cache.capacity_rows=4", "train.pipeline=off"]),
    "w2-tight-blocks": (2, ["optim=adagrad", "train.unique_capacity=64"]),
    "w3-measured-skip": (3, ["optim=adagrad", "train.steps=24", "train.nonfinite=skip"]),
    "w2-fae": (2, ["placement=fae", "placement.budget_bytes=16000", "optim=adagrad", "data.max_bag=1"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(HERALD))
def test_herald_in_fixed_shapes_equals_the_eager_step(case):
    """Every loss, row, optimizer state, dense parameter and eval logit as cuda_graph=off, and
    Herald's counters (pulls, pushes, writebacks, lends) and the lookup counts equal too."""
    world, extra = HERALD[case]
    off, on = off_and_on(world, SHORT + ["schedule=herald", "cache=lru"] + extra, ("embedding",))
    for a, b in zip(off, on):
        if "audit" in case:
            for key in ("reads", "updates", "grads"):
                assert torch.equal(b.state["audit"][key], a.state["audit"][key]), key
    for a, b in zip(off, on):
        assert b.summary["placement"]["schedule"] == a.summary["placement"]["schedule"]
    graph, sched = on[0].summary["cuda_graph"], on[0].summary["placement"]["schedule"]
    assert graph["scope"] == "step" and "dense_only" not in graph, graph
    assert sched["pulls"] > 0 and sched["writebacks"] > 0 and sched["lend_pulls"] > 0, sched
    exact = graph["exact_size_lookups"]
    if "tight" in case:  # some lookups did not fit, not all; none was trained twice
        assert 0 < exact < 10 * world and graph["overflow_steps"] == 0, graph
    elif "measured" in case:
        assert graph["capacity_rule"] == "measured" and graph["unique_capacity"] < graph["unique_bound"]
    else:
        assert exact == 0


# the HET cache in fixed shapes (fixed/het.py, cache/masked.py): hits, stale copies re-read,
# installs over victims, transient rows, due pushes and dirty evictions, as the exact step
HET = {
    "w2-lru-ssp-adagrad": (2, ["cache=lru", "consistency=ssp", "optim=adagrad"]),
    "w3-lfu-asp-sgd": (3, ["cache=lfu", "consistency=asp", "optim=sgd"]),
    "w2-pinned-adam": (2, ["cache=lfu_pinned", "cache.pin_threshold=3", "consistency.pull_bound=5",
                           "consistency.push_bound=8", "optim=adam"]),
    # no slot at all: every remote row transient, pushed at once
    "w3-no-slots": (3, ["cache=lru", "cache.capacity_fraction=0", "consistency=ssp", "optim=adagrad"]),
    # 4 slots: victims every step, dirty ones pushed; the fp16 wire
    "w2-tiny-cache-fp16-wire": (2, ["cache=lru", "cache.capacity_rows=4", "consistency.pull_bound=2",
                                    "consistency.push_bound=6", "optim=adagrad", "comm.wire_precision=fp16"]),
    "w2-bsp-ragged-audit": (2, ["cache=lru", "consistency=bsp", "optim=adagrad", "data.min_bag=0", "data.max_bag=3",
                                "embedding.audit=true"]),
    "w2-fae-lru-ssp": (2, ["cache=lru", "consistency=ssp", "placement=fae", "placement.budget_bytes=16000",
                           "optim=adagrad", "data.max_bag=1"]),
    "w4-lru-ssp-pipeline-off": (4, ["cache=lru", "consistency=ssp", "optim=sgd", "train.pipeline=off"]),
    # blocks too small for some batches: every change of those steps masked off (cache, counters,
    # staleness records, rows), the steps trained again exactly from the state before them
    "w2-lru-ssp-tight-blocks": (2, ["cache=lru", "consistency=ssp", "optim=adagrad", "train.unique_capacity=56"]),
    "w3-tiny-cache-measured-skip": (3, ["cache=lru", "cache.capacity_rows=4", "consistency.pull_bound=2",
                                        "consistency.push_bound=6", "optim=adagrad", "train.steps=24",
                                        "train.nonfinite=skip"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(HET))
def test_het_cache_in_fixed_shapes_equals_the_eager_step(case):
    """Every loss, row, optimizer state, dense parameter and eval logit as cuda_graph=off, and the
    cache's counters and the owners' staleness histogram (summary.json) equal too."""
    world, extra = HET[case]
    off, on = off_and_on(world, SHORT + extra, ("cache", "embedding"))
    for a, b in zip(off, on):
        if "audit" in case:  # every remote read and owner update, with its version, as off's
            for key in ("reads", "updates"):
                assert torch.equal(b.state["audit"][key], a.state["audit"][key]), key
    graph, cache = on[0].summary["cuda_graph"], on[0].summary["cache"]
    assert graph["scope"] == "step" and "dense_only" not in graph
    if "tight" in case:  # some steps overflowed, not all
        assert 0 < graph["overflow_steps"] < 10, graph
    if "measured" in case:  # the blocks shrank after the measuring window
        assert graph["capacity_rule"] == "measured" and graph["unique_capacity"] < graph["unique_bound"]
    assert cache["requested"] > 0 and cache["pushed_updates"] > 0
    if "no-slots" in case:
        assert cache["transient"] == cache["requested"]
    elif "tiny" in case:
        assert cache["evicted_dirty"] > 0 and cache["hits"] > 0
    if "ssp" in case or "asp" in case or "pinned" in case:
        assert cache["staleness"]["max"] > 0


# the HET cache's reply and push blocks follow the traffic (fixed/het.py): a request block that
# always fits (set at the bound), a margin below 1 so that some windows' blocks are too small for
# later steps' rows or pushes: those steps change nothing, are trained again exactly, and the blocks grow
FOLLOW = {
    "w2-lru-ssp-adagrad": (2, ["cache=lru", "consistency=ssp", "optim=adagrad"]),
    "w3-tiny-cache-audit": (3, ["cache=lru", "cache.capacity_rows=6", "consistency.pull_bound=2",
                                "consistency.push_bound=3", "optim=sgd", "embedding.audit=true"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(FOLLOW))
def test_het_reply_and_push_blocks_follow_the_traffic_and_an_overflow_is_trained_again(case):
    world, extra = FOLLOW[case]
    run = BASE + extra + ["train.steps=40", "train.unique_capacity=100000", "train.capacity_margin=0.75"]
    off, on = off_and_on(world, run, ("cache", "embedding"))
    for a, b in zip(off, on):
        if "audit" in case:
            for key in ("reads", "updates"):
                assert torch.equal(b.state["audit"][key], a.state["audit"][key]), key
    graph = on[0].summary["cuda_graph"]
    blocks = graph["het_blocks"]
    assert graph["capacity_rule"] == "set" and graph["unique_capacity"] == graph["unique_bound"]
    assert blocks["pull_slots"] < blocks["pull_bound"] and blocks["push_slots"] < blocks["push_bound"], blocks
    assert 0 < graph["overflow_steps"] < 40, graph
    assert on[0].summary["cache"]["pushed_updates"] > 0 and on[0].summary["cache"]["hits"] > 0


# replicated rows (placement=fae / sca) in fixed shapes: hot steps among the cold ones
PLACED = ["data=tiny", "data.max_bag=1", "train.steps=24", "data.global_batch_size=48", "data.test_samples=480",
          "data.eval_batch_size=40", "train.threads=1", "train.progress=off", "placement.window_batches=8"]
PLACEMENTS = {
    "w2-fae-sgd": (2, ["placement=fae", "placement.budget_bytes=16000", "optim=sgd"]),
    "w3-fae-adagrad-ragged": (3, ["placement=fae", "placement.budget_bytes=16000", "optim=adagrad",
                                  "data.min_bag=0", "data.max_bag=3"]),
    "w2-fae-adam-pipeline-ids": (2, ["placement=fae", "placement.budget_bytes=16000", "optim=adam",
                                     "train.pipeline=ids"]),
    "w3-sca-adagrad": (3, ["placement=sca", "optim=adagrad"]),
    # blocks too small for some batches: those steps are masked off and trained again exactly
    # the audit's records (every row gradient by id, every owner update with its version)
    "w2-fae-audit": (2, ["placement=fae", "placement.budget_bytes=16000", "optim=adagrad", "embedding.audit=true"]),
    "w2-fae-tight-blocks": (2, ["placement=fae", "placement.budget_bytes=16000", "optim=adagrad",
                                "train.unique_capacity=12"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(PLACEMENTS))
def test_replicated_rows_in_fixed_shapes_equal_the_eager_step(case):
    """The replica read from its own block of the workspace, its gradient and touched flags summed
    by one allreduce of fixed size: every loss, row, dense parameter and logit as cuda_graph=off."""
    world, extra = PLACEMENTS[case]
    off, on = off_and_on(world, PLACED + extra)
    for a, b in zip(off, on):
        for key in ("hot_rows", "hot_steps", "alltoalls_in_hot_steps"):
            assert b.summary["placement"][key] == a.summary["placement"][key]
        assert b.summary["embedding"]["remote_per_step"] == a.summary["embedding"]["remote_per_step"]
        assert b.summary["embedding"]["unique_per_step"] == a.summary["embedding"]["unique_per_step"]
        if "audit" in case:
            for key in ("reads", "updates", "grads"):
                assert torch.equal(b.state["audit"][key], a.state["audit"][key]), key
            assert a.state["audit"]["updates"].shape[0] > 0
    s = on[0].summary
    assert s["placement"]["hot_rows"] > 0 and s["bytes"]["replica"] > 0 and s["cuda_graph"]["scope"] == "step"
    if "fae" in case:
        assert s["placement"]["hot_steps"] > 0 and s["placement"]["alltoalls_in_hot_steps"] == 0
    if "tight" in case:
        assert s["cuda_graph"]["overflow_steps"] > 0


MLPERF = ["data=mlperf", "model=dlrm_mlperf", "data.max_table_rows=2000", "data.global_batch_size=64",
          "data.test_samples=256", "data.eval_batch_size=64", "train.steps=6", "train.threads=1",
          "train.progress=off"]


@pytest.mark.dist
def test_the_mlperf_shape_at_w2_equals_one_process():
    """The MLPerf shape (26 tables, d = 128, bottom 512-256-128, top 1024-1024-512-256-1) at W = 2
    on the CPU, eager and padded, against the single process."""
    ref = run_single(MLPERF)
    off = run_world(2, MLPERF)
    on = run_world(2, MLPERF + ["train.cuda_graph=on"])
    assert len(ref.state["tables"]) == 26 and ref.state["tables"][0].shape == (2000, 128)
    for a, b in zip(off, on):
        assert_same_run(ref, a)
        assert_same_run(a, b, rtol=0, atol=0)
        assert_same_eval(ref, a)
    assert on[0].summary["embedding"]["remote_per_step"] > 0
