"""The DALI loader (CPU pipeline, device_id=None) against the numpy-memmap reference: identical
batches for the same shard, rank and seed, over epoch boundaries and repeated evaluations; and the
shards together cover each split exactly once."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from data_helpers import N_TRAIN, prepare_sample
from helpers import make_cfg, spawn
from trainer.run.resolve.configure import load_config
from trainer.workload.data import make_data
from trainer.workload.data.blocks import CriteoData
from trainer.workload.data.criteo import from_block


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("criteo")
    prepare_sample(str(out), with_test=False)  # held-out tail cuts a block in the middle
    return str(out / "prepared")


def _data(d: str, loader: str, rank: int, world: int, *extra: str) -> CriteoData:
    cfg = load_config(make_cfg(["data=criteo", f"data.dir={d}", f"data.loader={loader}", "data.batch_size=96",
                              "data.eval_batch_size=70", "data.test_fraction=0.15", *extra]))
    return make_data(cfg, rank, world)


def _same(a, b) -> None:
    for x, y in ((a.dense, b.dense), (a.values, b.values), (a.lengths, b.lengths), (a.labels, b.labels)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("world,shuffle", [(1, True), (2, True), (3, False)])
def test_dali_and_memmap_yield_identical_batches(prepared, world, shuffle):
    for rank in range(world):
        dali = _data(prepared, "dali", rank, world, f"data.shuffle={shuffle}")
        ref = _data(prepared, "memmap", rank, world, f"data.shuffle={shuffle}")
        steps = 2 * -(-dali.train_rows // (96 * world)) + 1  # more than two epochs of the training rows
        for step in range(steps):
            _same(dali.train_batch(step), ref.train_batch(step))
        _same(dali.train_batch(3), ref.train_batch(3))  # a restart (non-sequential step)
        for _ in range(2):  # the second eval pass must read the same rows again
            pairs = list(zip(dali.eval_batches(), ref.eval_batches(), strict=True))
            for a, b in pairs:
                _same(a, b)


def _rows(batches) -> list[tuple]:
    return [tuple(b.dense[i].tolist() + b.values.view(-1, 26)[i].tolist() + [float(b.labels[i])])
            for b in batches for i in range(b.batch_size)]


def _epoch_rows(d) -> list[tuple]:
    """The first epoch of d's training order as row tuples."""
    return _rows([d.sample_batch(d.stream_keys(np.arange(d.train_rows)))])


def test_shards_cover_each_split_once(prepared):
    """Eval and validation: every rank yields the same number of batches and together they hold
    the split exactly; train: an epoch of the training order visits every training row once, and
    the ranks' batches of a step together are the single process's batch of that step (the same
    global batch size). The validation split (the small-data recipe's data.val_fraction=0.2) is the tail of
    the training rows: training + validation rows = the whole training split, the eval tail apart."""
    world = 2
    RAW = ("data.standardize=false", "data.min_count=0")  # row tuples compared with the block streams' raw columns
    whole = _data(prepared, "memmap", 0, 1, "data.shuffle=false", *RAW)
    n_train = 1999 - int(np.ceil(0.15 * 1999))
    assert whole.val_rows == int(np.floor(0.2 * n_train)) == 339
    assert whole.train_rows == n_train - 339
    no_val = _data(prepared, "memmap", 0, 1, "data.shuffle=false", "data.val_fraction=0", *RAW)
    assert sorted(_epoch_rows(whole) + _rows(whole.eval_batches("val"))) == sorted(_epoch_rows(no_val))
    shuffled = _data(prepared, "memmap", 0, 1, "data.global_batch_size=192", *RAW)
    assert sorted(_epoch_rows(shuffled)) == sorted(_epoch_rows(whole)) and _epoch_rows(shuffled) != _epoch_rows(whole)
    want_eval = sorted(_rows(whole.eval_batches()))
    want_val = sorted(_rows(whole.eval_batches("val")))
    got_eval, got_val, got_train, counts = [], [], [[] for _ in range(9)], []
    for rank in range(world):
        d = _data(prepared, "dali", rank, world, "data.global_batch_size=192", *RAW)
        batches = list(d.eval_batches())
        val = list(d.eval_batches("val"))
        counts.append((len(batches), len(val)))
        got_eval += _rows(batches)
        got_val += _rows(val)
        for step in range(9):  # 9 x 192 rows: into the second epoch
            got_train[step] += _rows([d.train_batch(step)])
    assert counts[0] == counts[1] and sorted(got_eval) == want_eval and len(want_eval) == 300
    assert sorted(got_val) == want_val and len(want_val) == 339 and not set(want_val) & set(want_eval)
    assert got_train == [_rows([shuffled.train_batch(step)]) for step in range(9)]


def test_prepared_test_split_is_the_eval_split(tmp_path):
    prepare_sample(str(tmp_path))
    d = _data(str(tmp_path / "prepared"), "dali", 0, 1)
    assert sum(b.batch_size for b in d.eval_batches()) == 1999 - N_TRAIN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dali_gpu_pipeline_matches_memmap(prepared):
    """On a GPU machine (train.device=cuda) the DALI pipeline runs on the GPU; same batches."""
    for rank in range(2):
        gpu = _data(prepared, "dali", rank, 2, "train.device=cuda")
        ref = _data(prepared, "memmap", rank, 2)
        for step in range(12):
            a = gpu.train_batch(step)
            assert a.dense.is_cuda and a.values.is_cuda
            _same(a.to(torch.device("cpu")), ref.train_batch(step))
        for a, b in zip(gpu.eval_batches(), ref.eval_batches(), strict=True):
            _same(a.to(torch.device("cpu")), b)


def test_fewer_training_rows_than_workers_is_a_config_error(prepared):
    """64 workers on a split of fewer blocks read rows; fewer rows than workers cannot be split."""
    from trainer.base.config import ConfigError
    from trainer.workload.data.blocks import by_rows, rank_segments
    train = _data(prepared, "memmap", 0, 1).train_segs
    shards = [rank_segments(train, r, 64) for r in range(64)]
    assert by_rows(train, 64) and [sum(s.rows for s in m) for m in shards] == [1360 * (r + 1) // 64 - 1360 * r // 64
                                                                               for r in range(64)]
    with pytest.raises(ConfigError, match=r"data\.dir=.*the training split has 3 rows for 4 workers"):
        _data(prepared, "memmap", 0, 4, "data.train_samples=3", "data.val_fraction=0")


@pytest.fixture(scope="module")
def one_block(tmp_path_factory) -> str:
    """The sample prepared with the default --chunk-mb (16): each split is one block."""
    out = tmp_path_factory.mktemp("one_block")
    meta = prepare_sample(str(out), chunk_mb=16.0)
    assert [len(m["blocks"]) for m in meta["splits"].values()] == [1, 1]
    return str(out / "prepared")


def _file_rows(d: str, split: str) -> list[tuple]:
    """The rows of a split's blocks in file order, as _rows tuples."""
    meta = json.load(open(os.path.join(d, "meta.json")))
    out = []
    for b in meta["splits"][split]["blocks"]:
        labels, dense, ids = from_block(np.load(os.path.join(d, b["file"])))
        out += [tuple(dense[i].tolist() + ids[i].tolist() + [float(labels[i])]) for i in range(labels.shape[0])]
    return out


def _read_rows(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Child body: runs of `python -m trainer comm=torch`, recording the rows of every training
    batch the trainer takes, by step."""
    from trainer.run.runner import run
    seen: dict[int, list[tuple]] = {}
    take = CriteoData.train_batch

    def record(self, step):
        batch = take(self, step)
        seen[step] = _rows([batch])
        return batch
    CriteoData.train_batch = record
    out = []
    for overrides in runs:
        seen.clear()
        res = run(make_cfg(overrides + ["comm=torch"]))
        out.append({"summary": res.summary, "losses": res.losses, "rows": dict(seen)})
    return out


@pytest.mark.dist
def test_one_block_trains_at_two_workers_by_row_ranges(one_block, tmp_path):
    """A file prepared as one block trains at W = 2 (real gloo processes, the default DALI loader):
    in each of the two epochs (data.epochs=2: 16 steps of 2 x 100) every training row is read by
    exactly one rank, reshuffled per epoch; the test split is evaluated once in full; a resume at
    step 5 reads what the uninterrupted run read."""
    root = str(tmp_path / "ck")
    base = ["data=criteo", f"data.dir={one_block}", "data.batch_size=100", "data.epochs=2", "data.val_fraction=0",
            "data.standardize=false", "data.min_count=0", "train.ensemble=1", "train.progress=off",
            "train.threads=1"]
    ranks = spawn(2, _read_rows, [base + ["checkpoint.every=5", "checkpoint.keep_last=0", f"checkpoint.dir={root}"],
                                  base + [f"checkpoint.resume={root}/step_00000005"]])
    want = _file_rows(one_block, "train")
    assert len(want) == N_TRAIN
    epochs = [sum((full["rows"][k] for full, _ in ranks for k in range(e * 8, e * 8 + 8)), []) for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(want) and epochs[0] != epochs[1]
    for full, resumed in ranks:
        s = full["summary"]
        assert s["steps"] == 16 and s["world_size"] == 2 and s["eval_samples"] == 1999 - N_TRAIN
        assert full["losses"] == ranks[0][0]["losses"]  # the ranks agree on every global loss
        assert resumed["summary"]["start_step"] == 5
        assert {k: v for k, v in resumed["rows"].items() if k < 16} == {k: full["rows"][k] for k in range(5, 16)}
        assert resumed["losses"] == full["losses"]


def test_small_splits_are_sharded_by_rows_at_any_w(one_block):
    """In-process, W = 3, one block: the training rows of the validation slice's two sides (data.
    val_slice=3 cuts the block in the middle) and data.train_samples are the training order's rows
    (file order: data.shuffle=false), the validation and the test split are each split among the
    ranks by rows, every row once; every rank yields the same number of evaluation batches."""
    RAW = ("data.standardize=false", "data.min_count=0", "data.shuffle=false", "data.eval_batch_size=50")
    train, test = _file_rows(one_block, "train"), _file_rows(one_block, "test")
    for extra, n_val in ((["data.val_slice=3", "train.ensemble=1"], 320), (["data.train_samples=1000", "data.val_fraction=0"], 0)):
        ranks = [_data(one_block, "dali", r, 3, *RAW, *extra) for r in range(3)]
        got_train = _epoch_rows(ranks[1])
        got_val = [row for d in ranks for row in _rows(d.eval_batches("val"))]
        if n_val:
            assert got_val == train[640:960] and got_train == train[:640] + train[960:]
        else:
            assert got_val == [] and got_train == train[:1000]
        evals = [list(d.eval_batches()) for d in ranks]
        assert len({len(e) for e in evals}) == 1 and [row for e in evals for row in _rows(e)] == test
