"""The DALI loader (CPU pipeline, device_id=None) against the numpy-memmap reference: identical
batches for the same shard, rank and seed, over epoch boundaries and repeated evaluations; and the
shards together cover each split exactly once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data_helpers import N_TRAIN, prepare_sample
from helpers import make_cfg
from trainer.configure import load_config
from trainer.data import make_data
from trainer.data.blocks import CriteoData


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("criteo")
    prepare_sample(str(out), with_test=False)  # held-out tail cuts a block in the middle
    return str(out / "prepared")


def _data(d: str, loader: str, rank: int, world: int, *extra: str) -> CriteoData:
    cfg = load_config(make_cfg(["data=criteo", f"data.dir={d}", f"data.loader={loader}", "data.batch_size=96",
                              "data.eval_batch_size=70", "data.eval_fraction=0.15", *extra]))
    return make_data(cfg, rank, world)


def _same(a, b) -> None:
    for x, y in ((a.dense, b.dense), (a.values, b.values), (a.lengths, b.lengths), (a.labels, b.labels)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("world,shuffle", [(1, True), (2, True), (3, False)])
def test_dali_and_memmap_yield_identical_batches(prepared, world, shuffle):
    for rank in range(world):
        dali = _data(prepared, "dali", rank, world, f"data.shuffle={shuffle}")
        ref = _data(prepared, "memmap", rank, world, f"data.shuffle={shuffle}")
        steps = 2 * -(-dali._new_train().rows // 96) + 1  # more than two epochs of this shard
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


def _stream_rows(stream) -> list[tuple]:
    """One epoch of a train stream as row tuples."""
    labels, dense, ids = stream.take(stream.rows)
    return [tuple(dense[i].tolist() + ids[i].tolist() + [float(labels[i])]) for i in range(stream.rows)]


def test_shards_cover_each_split_once(prepared):
    """Eval and validation: every rank yields the same number of batches and together they hold
    the split exactly; train: one epoch of every rank's shard together is the training split (as a
    multiset). The validation split (the small-data recipe's data.val_fraction=0.2) is the tail of
    the training rows: training + validation rows = the whole training split, the eval tail apart."""
    world = 2
    RAW = ("data.standardize=false", "data.min_count=0")  # row tuples compared with the block streams' raw columns
    whole = _data(prepared, "memmap", 0, 1, "data.shuffle=false", *RAW)
    n_train = 1999 - int(np.ceil(0.15 * 1999))
    assert whole.val_rows == int(np.floor(0.2 * n_train)) == 339
    assert whole._new_train().rows == n_train - 339
    no_val = _data(prepared, "memmap", 0, 1, "data.shuffle=false", "data.val_fraction=0", *RAW)
    assert sorted(_stream_rows(whole._new_train()) + _rows(whole.eval_batches("val"))) == \
        sorted(_stream_rows(no_val._new_train()))
    want_eval = sorted(_rows(whole.eval_batches()))
    want_val = sorted(_rows(whole.eval_batches("val")))
    got_eval, got_val, got_train, counts = [], [], [], []
    for rank in range(world):
        d = _data(prepared, "dali", rank, world, *RAW)
        batches = list(d.eval_batches())
        val = list(d.eval_batches("val"))
        counts.append((len(batches), len(val)))
        got_eval += _rows(batches)
        got_val += _rows(val)
        stream = d._new_train()
        got_train += _stream_rows(stream)
    assert counts[0] == counts[1] and sorted(got_eval) == want_eval and len(want_eval) == 300
    assert sorted(got_val) == want_val and len(want_val) == 339 and not set(want_val) & set(want_eval)
    assert sorted(got_train) == sorted(_stream_rows(whole._new_train()))


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


def test_more_workers_than_blocks_is_a_config_error(prepared):
    from trainer.config import ConfigError
    with pytest.raises(ConfigError, match=r"data\.dir=.*blocks for 64 workers.*--chunk-mb"):
        _data(prepared, "memmap", 0, 64)
