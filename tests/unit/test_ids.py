"""Ids outside their table (data.out_of_range): rejected before any state changes, or folded in.

- error: the message names the table, the id and the table's size; the run's state is exactly the
  state before the bad batch (nothing was looked up, pulled or updated);
- hash: the id is replaced by id mod rows, deterministically: the run equals one whose data held
  the folded id in the first place; summary.json counts the folded ids;
- the prepared-Criteo path: blocks are checked against meta.json's table sizes (then
  data.max_table_rows folds them, as before), `python -m trainer` exits 2 with the message;
- the global view (placement / Herald) sees the same guarded ids as the batches.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import make_cfg, run_single
from parity_helpers import assert_same_run
from trainer.base.comm import LocalCollectives
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.workload.data import Batch, GuardedData, IdGuard, IdRangeError
from trainer.workload.data.synthetic import SyntheticData
from trainer.run.runner import RunResult, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["data=tiny", "train.steps=10", "data.global_batch_size=48", "data.test_samples=480",
        "data.eval_batch_size=40", "train.threads=1", "train.progress=off", "optim=adagrad"]
ROWS = [97, 1001, 13, 250]  # the tiny preset


# ---------------------------------------------------------------------------- the guard itself
def _batch(values: list[int], lengths: list[list[int]]) -> Batch:
    b = len(lengths)
    return Batch(torch.zeros(b, 2), torch.tensor(values), torch.tensor(lengths), torch.zeros(b))


@pytest.mark.parametrize("bad,table", [(13, 2), (-1, 0), (1001, 1)])
def test_error_names_table_id_and_size(bad, table):
    lengths = [[1, 2, 1, 1], [1, 1, 0, 2]]
    values = [5, 7, 8, 3, 9, 96, 1000, 249, 0]  # sample-major bags: t0, t1 x2, t2, t3 | t0, t1, t3 x2
    pos = {0: 0, 1: 2, 2: 3}[table]
    values[pos] = bad
    g = IdGuard(ROWS, "error")
    with pytest.raises(IdRangeError, match=rf"id {bad} of table {table} is outside the table's "
                                           rf"{ROWS[table]} rows .*1 of the 9 ids of the test batch"):
        g.batch(_batch(values, lengths), "test batch")


def test_hash_folds_only_out_of_range_ids_mod_rows():
    lengths = [[1, 2, 1, 1], [1, 1, 0, 2]]
    values = [5, 7, 1001 + 8, -3, 9, 96 + 97 * 4, 1000, 249, 250 * 7 + 1]
    g = IdGuard(ROWS, "hash")
    got = g.batch(_batch(values, lengths), "b").values.tolist()
    assert got == [5, 7, 8, 10, 9, 96, 1000, 249, 1]  # -3 mod 13 = 10 (floored)
    assert g.hashed == 4
    ok = _batch([1, 2, 3, 4, 5], [[1, 1, 1, 1], [1, 0, 0, 0]])
    assert g.batch(ok, "b") is ok and g.hashed == 4  # an in-range batch is passed through untouched


@pytest.mark.parametrize("n", [1, 2])
def test_bags_of_one_length_take_the_column_check_with_the_same_result(n):
    """Every bag holds n ids: the guard checks by column (no per-id table index): the same folded
    ids and count (hash) and the same message (error) as the general check."""
    rng = np.random.default_rng(0)
    lengths = [[n] * 4 for _ in range(3)]
    values = [int(rng.integers(-5, 2 * r)) for _ in range(3) for r in ROWS for _ in range(n)]
    b = _batch(values, lengths)
    assert b.uniform_bag_length() == n and _batch([1, 2], [[1, 1, 0, 0]]).uniform_bag_length() is None
    fast, general = IdGuard(ROWS, "hash"), IdGuard(ROWS, "hash")
    got = fast.batch(b, "b").values
    want = general.values(b.values, b.table_index(), "b")
    assert torch.equal(got, want) and fast.hashed == general.hashed > 0
    messages = []
    for check in (lambda g: g.batch(b, "b"), lambda g: g.values(b.values, b.table_index(), "b")):
        with pytest.raises(IdRangeError) as err:
            check(IdGuard(ROWS, "error"))
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_a_batch_that_passed_is_not_checked_again_and_a_bad_one_always_is(monkeypatch):
    """data.cycle_batches hands the guard the same batch objects again: one that passed unchanged
    is passed through without a second look; a new (even equal) batch is checked; a bad one
    is refused every time it comes."""
    g = IdGuard(ROWS, "error")
    checks = []
    real = g._check
    monkeypatch.setattr(g, "_check", lambda b, where: checks.append(b) or real(b, where))
    ok = _batch([1, 2, 3, 4, 5], [[1, 1, 1, 1], [1, 0, 0, 0]])
    assert g.batch(ok, "b") is ok and g.batch(ok, "b") is ok and len(checks) == 1
    twin = _batch([1, 2, 3, 4, 5], [[1, 1, 1, 1], [1, 0, 0, 0]])
    assert g.batch(twin, "b") is twin and len(checks) == 2
    bad = _batch([1, 2, 13, 4, 5], [[1, 1, 1, 1], [1, 0, 0, 0]])
    for _ in range(2):
        with pytest.raises(IdRangeError):
            g.batch(bad, "b")
    assert len(checks) == 4
    folding = IdGuard(ROWS, "hash")
    for _ in range(2):
        folding.batch(bad, "b")
    assert folding.hashed == 2  # a folded batch is folded (and counted) at each use


def test_global_view_and_batches_see_the_same_guarded_ids(monkeypatch):
    """GuardedData.sample_ids (what placement and Herald plan with) and sample_batch (what a rank
    trains on) fold identically; the numpy path agrees with the torch path."""
    c = load_config(make_cfg(["data=tiny", "data.out_of_range=hash"]))
    src = SyntheticData(c.data, ROWS, 0, 1, 16)
    real_ids, real_batch = SyntheticData.sample_ids, SyntheticData.sample_batch

    def shifted(values):
        return values + 500  # pushes most ids of the small tables out of range

    monkeypatch.setattr(SyntheticData, "sample_ids", lambda self, k: (shifted(real_ids(self, k)[0]), real_ids(self, k)[1]))
    monkeypatch.setattr(SyntheticData, "sample_batch", lambda self, k: dataclasses.replace(
        real_batch(self, k), values=torch.from_numpy(shifted(real_batch(self, k).values.numpy()))))
    data = GuardedData(src, IdGuard(ROWS, "hash"))
    keys = np.arange(100, 140)
    values, lengths = data.sample_ids(keys)
    batch = data.sample_batch(keys)
    assert np.array_equal(values, batch.values.numpy())
    assert (values < np.repeat(np.tile(ROWS, 40), lengths.reshape(-1))).all() and values.min() >= 0
    assert data.b == 16 and data.source is src  # every other attribute is the source's


# ---------------------------------------------------------------------------- in a run
def _poison(monkeypatch, step: int, table: int, value: int) -> None:
    """Rank 0's training batch of `step`: the first id of `table` becomes `value`."""
    real = SyntheticData.train_batch

    def train_batch(self, s):
        b = real(self, s)
        if s != step:
            return b
        first = int(torch.nonzero(b.table_index() == table)[0, 0])
        values = b.values.clone()
        values[first] = value
        return dataclasses.replace(b, values=values)

    monkeypatch.setattr(SyntheticData, "train_batch", train_batch)


def _state(t: Trainer) -> RunResult:
    t.emb.flush()
    return RunResult({}, 0, [], t._gather_state())


@pytest.mark.parametrize("pipeline", ["off", "ids"])
@pytest.mark.parametrize("extra", [[], ["cache=lru"]], ids=["plain", "cache"])
def test_error_stops_before_any_state_change(monkeypatch, extra, pipeline):
    """The bad batch of step 4 stops the run before any update: at the start of step 4, or
    pipelined (the default) while step 3 makes it, after step 3's lookup and before its updates."""
    _poison(monkeypatch, 4, 3, 250)
    extra = extra + [f"train.pipeline={pipeline}"]
    t = Trainer(load_config(make_cfg(BASE + extra)), LocalCollectives(), None)
    ref = Trainer(load_config(make_cfg(BASE + extra)), LocalCollectives(), None)
    stops = 4 if pipeline == "off" else 3
    for s in range(stops):
        t.train_step(s)
        ref.train_step(s)
    calls = dict(t.comm.counter.calls)
    with pytest.raises(IdRangeError, match=r"id 250 of table 3 is outside the table's 250 rows.*"
                                           r"training batch of step 4"):
        t.train_step(stops)
    if pipeline == "off":
        assert dict(t.comm.counter.calls) == calls and t.pipeline.current is None  # nothing was even looked up
    assert_same_run(_state(ref), _state(t), rtol=0, atol=0)  # no row, no dense parameter changed
    with pytest.raises(IdRangeError, match="table 3"):
        run_single(BASE + extra)


def test_hash_equals_data_that_held_the_folded_id(monkeypatch):
    _poison(monkeypatch, 4, 1, 1001 * 3 + 17)
    got = run_single(BASE + ["data.out_of_range=hash"])
    assert got.summary["ids_hashed"] == 1
    _poison(monkeypatch, 4, 1, 17)
    want = run_single(BASE)
    assert want.summary["ids_hashed"] == 0
    assert_same_run(want, got, rtol=0, atol=0)


def test_out_of_range_config_key():
    with pytest.raises(ConfigError, match="data.out_of_range"):
        load_config(make_cfg(["data.out_of_range=clip"]))


# ---------------------------------------------------------------------------- prepared Criteo
def _shrunk(prepared: str, dest: str, rows: dict[int, int]) -> str:
    """A copy of the prepared dir whose meta.json declares smaller tables (blocks linked)."""
    os.makedirs(dest)
    for name in os.listdir(prepared):
        if name != "meta.json":
            os.symlink(os.path.join(prepared, name), os.path.join(dest, name))
    with open(os.path.join(prepared, "meta.json")) as f:
        meta = json.load(f)
    for t, n in rows.items():
        meta["table_rows"][t] = n
    with open(os.path.join(dest, "meta.json"), "w") as f:
        json.dump(meta, f)
    return dest


def _criteo(d: str, *extra: str) -> list[str]:
    return ["data=criteo", f"data.dir={d}", "data.batch_size=64", "data.epochs=0", "train.steps=12",
            "data.loader=memmap", "train.progress=off", "train.threads=1",
            "data.min_count=0", "train.ensemble=1", *extra]  # ids as stored: the guard and the cap see them directly


def test_criteo_blocks_are_checked_against_meta_rows(prepared, tmp_path):
    small = _shrunk(prepared, str(tmp_path / "small"), {5: 100})
    with pytest.raises(IdRangeError, match=r"data.dir=.*: id \d+ of table 5 is outside the table's 100 rows"):
        run_single(_criteo(small))
    # hash == the cap's folding: every table declared 100 rows and hashed, or 1000 rows capped at 100
    every = _shrunk(prepared, str(tmp_path / "every"), {t: 100 for t in range(26)})
    got = run_single(_criteo(every, "data.out_of_range=hash"))
    want = run_single(_criteo(prepared, "data.max_table_rows=100"))
    assert got.summary["ids_hashed"] > 0 and want.summary["ids_hashed"] == 0
    assert_same_run(want, got, rtol=0, atol=0)
    proc = subprocess.run([sys.executable, "-m", "trainer", *_criteo(small), f"hydra.run.dir={tmp_path / 'cli'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: data.dir=" in proc.stderr and "of table 5 is outside the table's 100 rows" in proc.stderr
    assert "Traceback" not in proc.stderr
