"""train.cuda_graph=dense (trainer/step/dense_step.py): the dense half of the step as one function of
(dense features, pooled rows, labels), captured in a CUDA graph on a GPU. On a CPU the same split
step runs eagerly, and W = 2 must equal the single process. train.cuda_graph=on runs the whole step
padded instead (at W = 1 trainer/step/whole_step.py, tests/unit/test_whole_step.py; at W > 1
trainer/step/padded_step.py, tests/distributed/test_padded_step.py)."""
from __future__ import annotations

import pytest

from helpers import make_cfg, run_single, run_world
from parity_helpers import BASE, assert_same_run
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config

SHORT = BASE + ["train.steps=8"]


@pytest.mark.dist
def test_split_step_two_workers_equal_one_process():
    overrides = SHORT + ["optim=adagrad", "train.cuda_graph=dense"]
    ref = run_single(overrides)
    assert ref.summary["cuda_graph"]["scope"] == "dense"
    for res in run_world(2, overrides):
        assert_same_run(ref, res)
        assert res.summary["cuda_graph"]["scope"] == "dense" and res.summary["cuda_graph"]["eager_steps"] == 8
        assert res.summary["cuda_graph"]["optimizer"]["eager_steps"] == 8  # trainer/step/dense_update.py


def test_cuda_graph_config():
    for value in ("on", "dense", "off"):
        assert load_config(make_cfg([f"train.cuda_graph={value}"])).train.cuda_graph == value
    with pytest.raises(ConfigError, match="train.cuda_graph"):
        load_config(make_cfg(["train.cuda_graph=yes"]))
    for value in ("on", "dense"):
        with pytest.raises(ConfigError, match="train.cuda_graph.*fp16"):
            load_config(make_cfg([f"train.cuda_graph={value}", "train.precision=fp16"]))
