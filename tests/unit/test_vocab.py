"""data.min_count (trainer/workload/data/vocab.py): the ids seen at least min_count times in the training
rows keep a row each, every other id (rare in them, or only seen in the validation or test rows)
shares the out-of-vocabulary row 1, the empty field keeps row 0, and the model's tables have the
vocabulary's sizes. Checked against a plain-Python count of the prepared blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data_helpers import reference_vocab
from helpers import make_cfg, run_world
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.workload.data import make_data
from trainer.workload.data.vocab import OOV_ROW, build_vocab

N_FIT = 1280  # the sample's 1,600 training rows less the 20% validation split


def _over(d: str, *extra: str) -> list[str]:
    return ["data=criteo", f"data.dir={d}", "data.loader=memmap", "data.shuffle=false", "data.val_fraction=0.2",
            "data.batch_size=64", "train.progress=off", "train.ensemble=1", *extra]


def _expect(raw: torch.Tensor, vocab: list[list[int]]) -> torch.Tensor:
    """The plain mapping of stored ids [b, T]: 0 -> 0, kept -> 2 + rank, else the OOV row."""
    rank = [{v: i for i, v in enumerate(k)} for k in vocab]
    out = [[0 if v == 0 else 2 + rank[t][v] if v in rank[t] else OOV_ROW for t, v in enumerate(row)]
           for row in raw.tolist()]
    return torch.tensor(out, dtype=torch.int64)


def _pairs(d, raw, split: str):
    if split == "train":
        return [(d.train_batch(s), raw.train_batch(s)) for s in range(N_FIT // 64)]
    return list(zip(d.eval_batches(split), raw.eval_batches(split)))


@pytest.mark.parametrize("min_count", [1, 2, 3])
def test_ids_map_to_the_vocabulary_of_the_fitting_rows(prepared, min_count):
    ref = reference_vocab(prepared, N_FIT, min_count)
    c = load_config(make_cfg(_over(prepared, f"data.min_count={min_count}")))
    assert c.data.table_rows == [2 + len(k) for k in ref]
    d = make_data(c, 0, 1)
    raw = make_data(load_config(make_cfg(_over(prepared, "data.min_count=0"))), 0, 1)
    assert raw.source.vocab is None and d.source.vocab.min_count == min_count
    oov_outside = 0
    for split in ("train", "val", "test"):
        for got, stored in _pairs(d, raw, split):
            ids = stored.values.reshape(-1, 26)
            assert torch.equal(got.values.reshape(-1, 26), _expect(ids, ref)), split
            assert torch.equal(got.labels, stored.labels) and torch.equal(got.dense, stored.dense)
            if split != "train":  # ids of these rows that the fitting rows never saw
                seen = [set(np.unique(np.concatenate([[0], k]))) for k in ref]
                oov_outside += sum(v not in seen[t] for row in ids.tolist() for t, v in enumerate(row))
    assert oov_outside > 100  # the validation and test rows bring ids of their own: all -> OOV


def test_min_count_one_keeps_every_fitting_id_and_the_cap_folds_after(prepared):
    ref = reference_vocab(prepared, N_FIT, 1)
    c = load_config(make_cfg(_over(prepared, "data.min_count=1", "data.max_table_rows=50")))
    assert c.data.table_rows == [2 + len(k) for k in ref]  # the cap applies to the model's tables
    d = make_data(c, 0, 1)
    raw = make_data(load_config(make_cfg(_over(prepared, "data.min_count=0"))), 0, 1)
    got, stored = d.train_batch(0), raw.train_batch(0)
    assert torch.equal(got.values.reshape(-1, 26), _expect(stored.values.reshape(-1, 26), ref) % 50)


def test_the_vocabulary_follows_the_validation_slice(prepared):
    """Other validation rows, other fitting rows: the vocabulary is counted on the rows trained on."""
    a = load_config(make_cfg(_over(prepared, "data.min_count=2")))
    b = load_config(make_cfg(_over(prepared, "data.min_count=2", "data.val_slice=3")))
    whole = reference_vocab(prepared, 1600, 2)
    assert a.data.table_rows != b.data.table_rows
    assert all(x <= 2 + len(k) and y <= 2 + len(k) for x, y, k in zip(a.data.table_rows, b.data.table_rows, whole))


def test_the_recipe_counts_and_other_data_refuse(prepared):
    c = load_config(make_cfg(["data=criteo", f"data.dir={prepared}", "data.loader=memmap"]))
    assert c.data.min_count == 1 and c.data.table_rows == [2 + len(k) for k in reference_vocab(prepared, N_FIT, 1)]
    assert c.embedding.init_scale == 0.01
    dcn = load_config(make_cfg(["data=criteo", f"data.dir={prepared}", "model=dcn"]))  # its per-model values
    assert (dcn.data.min_count, dcn.embedding.init_scale) == (2, 0.0)
    wdl = load_config(make_cfg(["data=criteo", f"data.dir={prepared}", "model=wdl"]))  # WDL takes DCN's values
    assert (wdl.data.min_count, wdl.embedding.init_scale, wdl.data.table_rows) == (2, 0.0, dcn.data.table_rows)
    deepfm = load_config(make_cfg(["data=criteo", f"data.dir={prepared}", "model=deepfm"]))  # the recipe's own
    assert (deepfm.data.min_count, deepfm.embedding.init_scale) == (1, 0.01)
    assert dcn.data.table_rows == [2 + len(k) for k in reference_vocab(prepared, N_FIT, 2)]
    mine = load_config(make_cfg(["data=criteo", f"data.dir={prepared}", "model=dcn", "data.min_count=1"]))
    assert (mine.data.min_count, mine.embedding.init_scale) == (1, 0.0)  # a value given on the command line wins
    from trainer.run.resolve.recipes import recipe_of
    assert recipe_of(dcn).describe(dcn)["overridden"] == {} and recipe_of(mine).describe(mine)["overridden"] == {
        "data.min_count": 1}
    big = load_config(make_cfg(["data=criteo", f"data.dir={prepared}", "train.recipe=large"]))
    assert big.data.min_count == 0 and big.data.table_rows == [1000] * 26 and big.embedding.init_scale == 0
    with pytest.raises(ConfigError, match=r"data\.min_count=-1: must be >= 0"):
        load_config(make_cfg(_over(prepared, "data.min_count=-1")))
    with pytest.raises(ConfigError, match=r"data\.min_count=2: .*data=criteo option"):
        load_config(make_cfg(["data=tiny", "data.min_count=2"]))
    with pytest.raises(ValueError, match="min_count >= 1"):
        build_vocab([], 13, [10] * 26, 0)


@pytest.mark.dist
def test_two_workers_build_the_same_vocabulary(prepared):
    """Every rank counts the whole training split (not its shard): W = 2 has the tables of W = 1,
    and the ranks agree on every step's loss."""
    want = [2 + len(k) for k in reference_vocab(prepared, N_FIT, 2)]
    ranks = run_world(2, _over(prepared, "data.epochs=0", "train.steps=6", "data.min_count=2"), return_state=False)
    for r in ranks:
        assert r.summary["embedding"]["table_rows"] == want
    assert ranks[0].losses == ranks[1].losses
