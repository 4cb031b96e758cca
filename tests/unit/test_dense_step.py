"""train.cuda_graph=on at W > 1 (trainer/train/dense_step.py): the dense half of the step as one function of
(dense features, pooled rows, labels), captured in a CUDA graph on a GPU. On a CPU the same split
step runs eagerly, and W = 2 must equal the single process. At W = 1 the key runs the whole step
instead (trainer/train/whole_step.py; its tests, bit for bit against the eager step, the CUDA capture
included, are tests/unit/test_whole_step.py)."""
from __future__ import annotations

import pytest

from helpers import make_cfg, run_single, run_world
from parity_helpers import BASE, assert_same_run
from trainer.config import ConfigError
from trainer.plan.configure import load_config

SHORT = BASE + ["train.steps=8"]


@pytest.mark.dist
def test_split_step_two_workers_equal_one_process():
    overrides = SHORT + ["optim=adagrad", "train.cuda_graph=on"]
    ref = run_single(overrides)
    for res in run_world(2, overrides):
        assert_same_run(ref, res)


def test_cuda_graph_config():
    assert load_config(make_cfg(["train.cuda_graph=on"])).train.cuda_graph == "on"
    with pytest.raises(ConfigError, match="train.cuda_graph"):
        load_config(make_cfg(["train.cuda_graph=yes"]))
    with pytest.raises(ConfigError, match="train.cuda_graph.*fp16"):
        load_config(make_cfg(["train.cuda_graph=on", "train.precision=fp16"]))
