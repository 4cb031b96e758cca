"""Half-precision rows (embedding.dtype=fp16|bf16, embedding.rounding; docs/config.md "Row precision").

- The rule: stochastic rounding is unbiased (a statistical test whose tolerance a biased rule,
  toward zero or to nearest, fails: the test checks that too), picks one of the two neighbours,
  is a function of (seed, step, row, column) only, and keeps updates far below half an ulp that
  round-to-nearest loses.
- The store: rows in the asked type, optimizer state float32, versions int64, bytes per row.
- The trainer: fp16 and bf16 runs at W = 1 and W = 2 (real gloo processes) equal the single-process
  reference with the same dtype on the same global batch at BSP, with the HET cache, replicated
  (FAE) and lent (Herald) rows; the fp16 wire halves the row bytes.
- Checkpoints: the stored type round-trips bit for bit and is recorded in the manifest; another
  dtype is converted (exact when wider, to nearest when narrower, a value fp16 cannot hold refused);
  a half-precision run saved and resumed equals the uninterrupted run; the best model is restored
  in half precision.
- A bad value is one error line.

Why the parity tolerance is "within one unit in the last place, and almost every element equal"
instead of 1e-5: any rounding of a row to 10 or 7 bits has decision boundaries, and W workers sum a
row's gradient in another order than the single process (fp32, ~1e-7 apart), so an update that
lands within ~1e-7 of a boundary may round the other way (a probability of about 1e-7 / 2^-11 per
element and update for fp16). Everything that does not depend on the summation order (the random
bits: keyed by the row's flat id, never by where it is stored) must agree, so nearly all elements
are bit-equal (on these runs all were). Another key does not pass: keying the rows by flat id + 1
left 70% of the fp16-sgd case's row elements bit-equal (the rows never updated), far below 99%.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers import assert_same_eval, make_cfg, run_single, run_world
from parity_helpers import assert_same_run

import kernels
from kernels.rounding import StochasticRounding, random_bits, round_rows, round_stochastic, salt_of
from trainer.run.checkpoint import shard_io
from trainer.run.checkpoint.manifest import CheckpointError
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.sparse.embedding import RowSharding, ShardStore
from trainer.sparse.embedding.optim import Rounding

HALF = [torch.float16, torch.bfloat16]
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
BASE = ["data=tiny", "train.steps=24", "data.global_batch_size=48", "data.test_samples=480",
        "data.eval_batch_size=40", "train.threads=1", "train.progress=off"]


# ---------------------------------------------------------------------------- the rounding rule


def _neighbours(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (y, z) of adjacent values of dtype, z one step away from zero: both signs, several
    magnitudes, fp16's subnormals; as float32."""
    vals = [1.0, -3.0, 0.013, -200.0, 7e-5, -1e-3]
    if dtype == torch.float16:
        vals += [3e-6, -4e-7]  # subnormal: a gap of 2^-24
    y = torch.tensor(vals).to(dtype)
    z = (y.view(torch.int16) + 1).view(dtype)
    return y.float(), z.float()


def _unbiased(samples: torch.Tensor, x: torch.Tensor, gap: torch.Tensor, f: torch.Tensor) -> bool:
    """Whether the mean of `samples` [N, V] (roundings of x [V]) is within 5 standard errors of x
    for every value: a choice of z with probability f has a standard deviation gap sqrt(f (1 - f))."""
    se = gap.double() * (f * (1 - f) / samples.shape[0]).sqrt()
    return bool(((samples.double().mean(0) - x.double()).abs() <= 5 * se).all())


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_stochastic_rounding_is_unbiased_and_a_biased_rule_would_fail(dtype):
    y, z = _neighbours(dtype)
    gap = (z - y).abs()
    n = 8192
    keys = torch.arange(n, dtype=torch.int64) * 7919 + (1 << 35)  # high bits of the key used too
    for f in (0.05, 0.25, 0.5, 0.8):
        x = (y + f * (z - y)).float()  # strictly between the neighbours
        f_exact = ((x - y).abs() / gap).double()  # f as float32 could represent it
        xs = x.expand(n, -1).contiguous()
        got = round_rows(xs, dtype, StochasticRounding(salt_of(3, 11), keys)).float()
        assert bool(((got == y) | (got == z)).all()), "a result that is neither neighbour"
        assert _unbiased(got, x, gap, f_exact), (f, (got.double().mean(0) - x.double()) / gap)
        frac = (got == z).double().mean(0)
        assert bool(((frac - f_exact).abs() < 0.05).all()), frac
        # the same criterion rejects rounding toward zero and to nearest, so it cannot pass by accident
        toward_zero = y.expand(n, -1)
        nearest = xs.to(dtype).float()
        assert not _unbiased(toward_zero, x, gap, f_exact)
        assert not _unbiased(nearest, x, gap, f_exact)


def test_the_random_bits_are_a_function_of_seed_step_row_and_column():
    keys = torch.tensor([0, 1, 2, 1 << 40, (1 << 40) + 1])
    a = random_bits(salt_of(0, 5), keys, 6)
    assert torch.equal(a, random_bits(salt_of(0, 5), keys, 6))  # deterministic
    assert torch.equal(a[2:3], random_bits(salt_of(0, 5), keys[2:3], 6))  # no dependence on neighbours
    assert bool((a >= 0).all() and (a < 1 << 32).all())
    for other in (random_bits(salt_of(0, 6), keys, 6), random_bits(salt_of(1, 5), keys, 6)):
        assert (other != a).float().mean() > 0.99  # another step or seed: other bits
    assert len(set(a.flatten().tolist())) == a.numel()  # rows (high key bits too) and columns differ
    assert salt_of(0, 5) != salt_of(0, 5 + (1 << 32))  # the step's high bits count


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_special_values_round_as_to_nearest(dtype):
    x = torch.tensor([[0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, 1e30 if dtype == torch.float16 else 1.0]])
    bits = random_bits(salt_of(0, 0), torch.tensor([9]), x.shape[1])
    got = round_stochastic(x, dtype, bits)
    want = x.to(dtype)
    same = (got.float() == want.float()) | (torch.isnan(got.float()) & torch.isnan(want.float()))
    assert bool(same.all()), (got, want)
    assert torch.equal(torch.signbit(got.float()[:, :2]), torch.tensor([[False, True]]))


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_small_updates_survive_stochastic_rounding_and_vanish_to_nearest(dtype):
    """200 SGD steps of -1e-4 each on rows of 1.0: a bf16 ulp below 1 is 2^-8 ~ 3.9e-3 (fp16:
    4.9e-4), so every single update is below half an ulp. To nearest the rows never move; with
    stochastic rounding they reach 0.98 on average, as in float32."""
    rows, dim, steps = 256, 16, 200
    keys = torch.arange(rows) + 1000
    out = {}
    for rule in ("stochastic", "nearest"):
        w = torch.ones(rows, dim, dtype=dtype)
        clock = Rounding(rule, seed=4)
        for step in range(steps):
            clock.step = step
            kernels.row_update(w, torch.arange(rows), torch.full((rows, dim), 0.1), optimizer="sgd",
                               lr=1e-3, unique=True, rounding=clock.at(keys))
        out[rule] = w.float()
    assert bool((out["nearest"] == 1.0).all())
    assert abs(float(out["stochastic"].mean()) - 0.98) < 1e-3, float(out["stochastic"].mean())


# ---------------------------------------------------------------------------- the store


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_stored_dtype_state_and_bytes_per_row(name, dtype):
    sh = RowSharding([97, 13], 2, 1)
    want_state = {"sgd": 0, "adagrad": 16 * 4, "rowwise_adagrad": 4}
    for optimizer, state_bytes in want_state.items():
        s = ShardStore(sh, 16, 0, None, optimizer, 0.1, 1e-8, torch.device("cpu"), 0.1, dtype=dtype)
        assert s.weight.dtype == dtype and s.weight.element_size() == dtype.itemsize
        assert s.version.dtype == torch.int64
        for st in s.optimizer.state_tensors().values():
            assert st.dtype == torch.float32
        row = 16 * dtype.itemsize  # fp32 d = 16: 64 B; fp16 / bf16: 32 B
        assert s.bytes_per_row() == {"row": row, "state": state_bytes, "version": 8,
                                     "total": row + state_bytes + 8}
        # initial rows: the float32 values rounded to nearest
        idx = torch.arange(sh.local_rows)
        assert torch.equal(s.weight, s._initial(idx).to(dtype))
        assert torch.equal(s.initial_rows(idx[:5]), s.weight[:5])
    assert s.bytes_per_row()["row"] == {"fp32": 64, "fp16": 32, "bf16": 32}[name]


def test_a_row_rounds_alike_at_any_w():
    """The same update of the same (table, id) at W = 1 and W = 3 (another storage row, another
    rank) writes the same bits: the rounding is keyed by the flat id."""
    rows, dim = [10, 7], 5
    got = []
    for world, rank in ((1, 0), (3, 2)):
        sh = RowSharding(rows, world, rank)
        s = ShardStore(sh, dim, 0, 0.5, "adagrad", 0.3, 1e-8, torch.device("cpu"), 0.1, dtype=torch.bfloat16)
        gids = sh.global_ids(torch.tensor([5, 2]), torch.tensor([0, 1]))  # table 0 id 5, table 1 id 2
        assert bool(sh.owned_by(gids).all())
        s.rounding.step = 17
        s.apply(gids, torch.full((2, dim), 0.37))
        got.append(s.rows(gids))
    assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16))


# ---------------------------------------------------------------------------- config


def test_a_bad_dtype_is_one_error_line(monkeypatch, capsys, tmp_path):
    with pytest.raises(ConfigError, match=r"^embedding.dtype='fp8': must be one of fp32, fp16, bf16$"):
        load_config(make_cfg(["embedding.dtype=fp8"]))
    with pytest.raises(ConfigError, match=r"^embedding.rounding='up': must be one of stochastic, nearest$"):
        load_config(make_cfg(["embedding.rounding=up"]))
    from trainer.__main__ import cli

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["trainer", "embedding.dtype=half", f"hydra.run.dir={out}"])
    with pytest.raises(SystemExit) as exit_:
        cli()
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exit_.value.code == 2 and lines == ["error: embedding.dtype='half': must be one of fp32, fp16, bf16"], captured.err


# ---------------------------------------------------------------------------- the trainer at W = 1 and 2


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of b (half types; the subnormal spacing at the bottom)."""
    fi = torch.finfo(b.dtype)
    return (a.float() - b.float()).abs() / (b.float().abs().clamp_min(fi.tiny) * fi.eps)


def assert_same_half_run(ref, got, dtype: torch.dtype) -> None:
    """`got` equals the reference with half rows: losses and dense parameters within 1e-4
    relative; every table in dtype, every element within one ulp and at least 99% bit-equal."""
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-4, atol=1e-6)
    for name, value in ref.state["dense"].items():
        torch.testing.assert_close(got.state["dense"][name], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"dense param {name}: {m}")
    equal = total = 0
    for t, (a, b) in enumerate(zip(got.state["tables"], ref.state["tables"])):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        assert float(_ulps(a, b).max()) <= 1.0, f"table {t}: an element more than one ulp off"
        equal += int((a.view(torch.int16) == b.view(torch.int16)).sum())
        total += a.numel()
    assert equal >= 0.99 * total, f"only {equal} of {total} row elements bit-equal"


HERALD = ["data.table_rows=[97,3001,13,1250]", "schedule=herald", "cache=lru", "cache.capacity_fraction=0.05"]
PARITY = {  # dtype, extra overrides, worlds besides the reference
    "fp16-sgd": (torch.float16, ["optim=sgd"], (1, 2)),
    "bf16-adagrad-mean": (torch.bfloat16, ["optim=adagrad", "model.pooling=mean"], (1, 2)),
    # the HET cache at BSP (fp32 copies) and replicated hot rows (FAE): Adagrad state with them
    "fp16-cache-fae-adagrad": (torch.float16, ["optim=adagrad", "cache=lru", "placement=fae",
                                               "placement.budget_bytes=16000", "placement.hot_batches=false"], (2,)),
    # Herald's lent rows (row-wise Adagrad state travels with them) and replicated rows
    "bf16-herald-fae-rowwise": (torch.bfloat16, HERALD + ["optim=adam", "placement=fae", "placement.budget_bytes=6000",
                                                          "placement.window_batches=8", "data.max_bag=1"], (2,)),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(PARITY))
def test_half_runs_equal_the_single_process_reference(case):
    dtype, extra, worlds = PARITY[case]
    overrides = BASE + extra + [f"embedding.dtype={NAMES[dtype]}"]
    ref = run_single(overrides)
    assert ref.summary["embedding"]["dtype"] == NAMES[dtype]
    assert ref.summary["embedding"]["bytes_per_row"]["row"] == 16 * 2
    for world in worlds:
        results = run_world(world, overrides)
        for res in results:
            assert res.summary["world_size"] == world
            assert_same_half_run(ref, res, dtype)
            assert_same_eval(ref, res, rtol=1e-4, atol=1e-6)  # the losses' tolerance; the AUC: the pairs it lets turn
    s = results[0].summary
    assert s["bytes"]["rows"] > 0 and s["bytes"]["grads"] > 0  # rows really moved between workers
    if "placement=fae" in extra:
        assert s["placement"]["hot_rows"] > 0 and s["bytes"]["replica"] > 0
    if "cache=lru" in extra and "schedule=herald" not in extra:
        assert s["cache"]["hits"] > 0
    if "schedule=herald" in extra:
        assert s["placement"]["schedule"]["lend_pulls"] > 0


@pytest.mark.dist
def test_fp16_rows_over_the_fp16_wire_move_half_the_row_bytes():
    """fp16 rows sent as fp16 arrive exact at half the bytes of the fp32 wire (the gradients are
    rounded on the wire, so the run is near, not equal to, the fp32-wire one)."""
    overrides = BASE + ["optim=sgd", "embedding.dtype=fp16"]
    wide = run_world(2, overrides)[0].summary
    narrow = run_world(2, overrides + ["comm.wire_precision=fp16"])[0]
    assert narrow.summary["bytes"]["rows"] * 2 == wide["bytes"]["rows"] > 0
    assert narrow.summary["bytes"]["grads"] * 2 == wide["bytes"]["grads"]
    assert narrow.state["tables"][0].dtype == torch.float16
    assert narrow.summary["eval_auc"] == pytest.approx(wide["eval_auc"], abs=5e-3)


# ---------------------------------------------------------------------------- checkpoints


ROWS, DIM = [97, 1001, 13], 4


def _half_stores(world: int, dtype: torch.dtype, optimizer: str = "adagrad") -> list[ShardStore]:
    return [ShardStore(RowSharding(ROWS, world, r), DIM, 0, None, optimizer, 0.1, 1e-10, torch.device("cpu"),
                       0.1, dtype=dtype) for r in range(world)]


def _save(stores: list[ShardStore], root) -> tuple[str, dict]:
    world = len(stores)
    shards = {shard_io.shard_dir(r, world): shard_io.write_shard(str(root / shard_io.shard_dir(r, world)), s)
              for r, s in enumerate(stores)}
    return str(root), {"world_size": world, "table_rows": ROWS, "shards": shards}


def _all_rows(stores: list[ShardStore]) -> torch.Tensor:
    """Every real row by flat id (table, id order), as stored."""
    parts, keys = [], []
    for s in stores:
        gids = s.sharding.local_gids()
        real = torch.nonzero(s.sharding.valid(gids)).flatten()
        keys.append(s.sharding.to_flat(gids[real]))
        parts.append(s.weight.index_select(0, real))
    return torch.cat(parts)[torch.argsort(torch.cat(keys))]


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_half_shards_round_trip_bit_for_bit_and_record_their_dtype(tmp_path, dtype):
    before = _half_stores(2, dtype)
    for s in before:
        s.weight.uniform_(-3, 3)
        s.optimizer.state.uniform_()
    path, manifest = _save(before, tmp_path)
    fields = manifest["shards"][shard_io.shard_dir(0, 2)]["fields"]
    assert fields["weight"]["torch_dtype"] == {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    assert fields["state_sum"]["torch_dtype"] == "float32" and fields["version"]["torch_dtype"] == "int64"
    rows = sum(max(-(-(n - r) // 2), 0) for n in ROWS for r in (0,))
    assert fields["weight"]["bytes"] == rows * DIM * 2  # two bytes per element on disk
    after = _half_stores(3, dtype)
    for s in after:
        shard_io.read_shards(path, manifest, s, {"bytes_read": 0})
    assert torch.equal(_all_rows(after).view(torch.int16), _all_rows(before).view(torch.int16))


def test_a_checkpoint_resumed_under_another_dtype_is_converted(tmp_path):
    """bf16 / fp16 saved -> fp32 read: exact; fp32 saved -> fp16 read: rounded to nearest; a value
    fp16 cannot hold: refused with a CheckpointError naming the file and the way out."""
    for saved, read in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float16), (torch.float32, torch.bfloat16)):
        root = tmp_path / f"{NAMES[saved]}-{NAMES[read]}"
        before = _half_stores(1, saved)
        before[0].weight.uniform_(-3, 3)
        path, manifest = _save(before, root)
        after = _half_stores(2, read)
        for s in after:
            shard_io.read_shards(path, manifest, s, {"bytes_read": 0})
        assert torch.equal(_all_rows(after), _all_rows(before).to(read))
    big = _half_stores(1, torch.float32)
    big[0].weight[3, 1] = 1e6
    path, manifest = _save(big, tmp_path / "big")
    with pytest.raises(CheckpointError, match=r"weight.bin: saved float32 values .*do not fit in float16: "
                                              r"resume with the embedding.dtype they were saved with"):
        shard_io.read_shards(path, manifest, _half_stores(1, torch.float16)[0], {"bytes_read": 0})


def test_checkpoints_written_before_torch_dtype_still_read(tmp_path):
    before = _half_stores(1, torch.float32)
    path, manifest = _save(before, tmp_path)
    for info in manifest["shards"].values():
        for meta in info["fields"].values():
            del meta["torch_dtype"]
    after = _half_stores(1, torch.float32)
    after[0].weight.zero_()
    shard_io.read_shards(path, manifest, after[0], {"bytes_read": 0})
    assert torch.equal(after[0].weight, before[0].weight)


@pytest.mark.dist
def test_a_half_run_saved_and_resumed_equals_the_uninterrupted_run(tmp_path, capsys):
    """bf16 rows at W = 2 with the cache and Adagrad: resumed at step 10 on W = 2 it is the same run
    bit for bit (the rounding is keyed by the step, not by anything a resume loses), on W = 1 the
    same within the half-precision parity; an fp32 checkpoint resumed in fp16 runs (converted)."""
    overrides = BASE + ["cache=lru", "optim=adagrad", "embedding.dtype=bf16", "train.steps=20"]
    root = str(tmp_path / "w2")
    full = run_world(2, overrides + [f"checkpoint.dir={root}", "checkpoint.every=10"])[0]
    step10 = os.path.join(root, "step_00000010")
    again = run_world(2, overrides + [f"checkpoint.resume={step10}", f"checkpoint.dir={tmp_path / 'again'}"])[0]
    assert again.summary["start_step"] == 10
    assert_same_run(full, again, rtol=0, atol=0)
    one = run_single(overrides + [f"checkpoint.resume={step10}", f"checkpoint.dir={tmp_path / 'one'}"])
    assert_same_half_run(full, one, torch.bfloat16)
    fp16 = run_single(BASE + ["cache=lru", "optim=adagrad", "embedding.dtype=fp16", "train.steps=20",
                              f"checkpoint.resume={step10}", f"checkpoint.dir={tmp_path / 'fp16'}"])
    assert "rows saved as bfloat16 are read as float16 (embedding.dtype), rounded to nearest" in capsys.readouterr().err
    assert fp16.state["tables"][0].dtype == torch.float16 and fp16.summary["start_step"] == 10
    assert fp16.losses[-1] == pytest.approx(full.losses[-1], rel=1e-2)


# ---------------------------------------------------------------------------- the best model


def test_the_best_model_is_restored_in_half_precision():
    """Early stopping with bf16 rows: the restored model is bit for bit the model a run stopped at
    the best step ends with (the snapshot holds the stored rows; untouched rows go back to their
    initial values, rounded to nearest as at the start)."""
    es = ["data=tiny", "data.train_samples=480", "data.val_fraction=0.25", "data.global_batch_size=48",
          "data.test_samples=480", "data.eval_batch_size=40", "train.threads=1", "train.progress=off",
          "train.steps=80", "train.eval_every=4", "train.early_stop.patience=3", "optim=adagrad", "optim.lr=0.5",
          "embedding.dtype=bf16"]
    ref = run_single(es)
    e = ref.summary["early_stop"]
    assert e["stopped_early"] and e["restored"] and ref.summary["best_step"] < ref.summary["steps"]
    plain = run_single(es + [f"train.steps={ref.summary['best_step']}", "train.early_stop.patience=0",
                             "train.early_stop.restore_best=false"])
    for name, value in plain.state["dense"].items():
        assert torch.equal(ref.state["dense"][name], value), name
    for a, b in zip(plain.state["tables"], ref.state["tables"]):
        assert b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert plain.summary["test_auc"] == ref.summary["test_auc"]
