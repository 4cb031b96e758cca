"""train.cuda_graph=on (trainer/dense_step.py): the dense half of the step as one function of (dense
features, pooled rows, labels), captured in a CUDA graph on a GPU. On a CPU the same split step
runs eagerly, and it must equal the one-piece step bit for bit: every loss, dense parameter and
embedding row, for every model, for W = 2 against the single process, with skipped steps, with
bf16 autocast. The capture itself needs a GPU (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from helpers import make_cfg, run_single, run_world
from test_parity import BASE, assert_same_run
from trainer.config import ConfigError
from trainer.configure import load_config
from trainer.runner import RunResult

SHORT = BASE + ["train.steps=8"]


@pytest.mark.parametrize("extra", [["model=dlrm"], ["model=deepfm"], ["model=dcn"], ["model=wdl"],
                                   ["train.precision=bf16", "optim=adam"], ["model.dropout=0.2"],
                                   ["train.pipeline=off", "optim=adagrad"]])
def test_split_step_equals_the_one_piece_step_bit_for_bit(extra):
    ref = run_single(SHORT + extra)
    got = run_single(SHORT + extra + ["train.cuda_graph=on"])
    assert got.losses == ref.losses
    assert_same_run(ref, got, rtol=0, atol=0)
    assert got.summary["cuda_graph"] == {"captured": False, "replays": 0, "eager_steps": 8}
    assert ref.summary["cuda_graph"] is None


def test_split_step_keeps_skip_semantics(monkeypatch):
    """train.nonfinite=skip: a poisoned batch is dropped before the rows' backward, as before."""
    from test_nonfinite import poison_w1
    poison_w1(monkeypatch, (2,))
    extra = ["train.nonfinite=skip", "train.steps=6"]
    ref = run_single(BASE + extra)
    got = run_single(BASE + extra + ["train.cuda_graph=on"])
    assert got.summary["skipped_steps"] == ref.summary["skipped_steps"] == 1
    assert [str(x) for x in got.losses] == [str(x) for x in ref.losses]  # the nan of step 2 too
    assert_same_run(RunResult({}, 0, [], ref.state), RunResult({}, 0, [], got.state), rtol=0, atol=0)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_replays_equal_the_eager_split_step_on_cuda(precision):
    """On CUDA the graph is captured once and replayed: the same losses and parameters as the
    eager run within float tolerance (the same kernels, replayed)."""
    extra = ["train.device=cuda", f"train.precision={precision}", "train.steps=12"]
    ref = run_single(BASE + extra)
    got = run_single(BASE + extra + ["train.cuda_graph=on"])
    assert got.summary["cuda_graph"]["captured"] and got.summary["cuda_graph"]["replays"] == 12
    assert_same_run(ref, got, rtol=1e-5, atol=1e-6)
