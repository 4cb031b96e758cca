"""Config validation: every bad value is rejected at start-up with a message naming the key."""
from __future__ import annotations

import pytest

from helpers import make_cfg
from trainer.config import ConfigError, local_batch_size, to_config, validate_world

BAD = [
    ("data.batch_size=0", "data.batch_size"),
    ("data.batch_size=-4", "data.batch_size"),
    ("model.embedding_dim=0", "model.embedding_dim"),
    ("model.name=transformer", "model.name"),
    ("model.pooling=max", "model.pooling"),
    ("data.table_rows=[10,0,5]", "data.table_rows[1]"),
    ("data.table_rows=[]", "data.table_rows"),
    ("data.max_bag=0", "data.max_bag"),
    ("data.min_bag=-1", "data.min_bag"),
    ("data.zipf_alpha=-0.5", "data.zipf_alpha"),
    ("data.global_batch_size=0", "data.global_batch_size"),
    ("data.eval_batch_size=0", "data.eval_batch_size"),
    ("optim.lr=0", "optim.lr"),
    ("optim.dense=lamb", "optim.dense"),
    ("optim.sparse=adam", "optim.sparse"),
    ("comm.backend=mpi", "comm.backend"),
    ("comm.timeout_s=0", "comm.timeout_s"),
    ("train.steps=0", "train.steps"),
    ("train.progress=maybe", "train.progress"),
    ("data.batch_size=abc", "data.batch_size"),  # type error from the schema
]


@pytest.mark.parametrize("override,key", BAD, ids=[b[0] for b in BAD])
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        to_config(make_cfg([override]))
    assert key in str(err.value)


def test_unknown_key_is_rejected_by_hydra():
    with pytest.raises(Exception, match="batchsize"):
        make_cfg(["data.batchsize=3"])


def test_more_ranks_than_rows_is_rejected():
    cfg = to_config(make_cfg(["data.table_rows=[100,2,50]"]))
    validate_world(cfg, 2)
    with pytest.raises(ConfigError, match=r"data.table_rows\[1\]=2.*3 workers"):
        validate_world(cfg, 3)


def test_global_batch_must_divide_by_world():
    cfg = to_config(make_cfg(["data.global_batch_size=64"]))
    assert local_batch_size(cfg, 4) == 16
    with pytest.raises(ConfigError, match="data.global_batch_size=64.*3"):
        validate_world(cfg, 3)


@pytest.mark.parametrize("preset", ["tiny", "criteo_like", "bench"])
def test_presets_are_valid(preset):
    cfg = to_config(make_cfg([f"data={preset}"]))
    assert cfg.data.preset == preset


def test_criteo_like_has_kaggle_cardinalities_capped():
    from trainer.config import table_rows
    cfg = to_config(make_cfg(["data=criteo_like", "data.max_table_rows=50000"]))
    rows = table_rows(cfg)
    assert len(rows) == 26 and cfg.data.num_dense == 13
    assert max(rows) == 50000 and rows[8] == 3  # the 3-value feature is untouched by the cap
