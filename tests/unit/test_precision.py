"""Mixed precision of the dense model (train.precision, trainer/step/precision.py).

- fp32 (the default) runs no autocast and scales nothing: the step is the fp32 step.
- LossScaler follows torch.amp.GradScaler's scale, step for step, for the same overflows.
- bf16 / fp16 train, and W = 2 gloo workers equal one process within PARITY_TOL (the half-type
  products sum a rank's slice of the batch, the reference the whole batch: not exact).
- fp16's loss scaler: an inf in ONE rank's dense or row gradient makes EVERY rank skip that step
  (no row, no dense parameter changes anywhere) and halve the same scale; the run equals a run that
  never trained that step. Interplay with train.nonfinite: an overflow is not a non-finite loss
  (stop does not stop, skip does not count it) and a non-finite loss does not move the scale.
- The scale survives a checkpoint and resume.
- A small criteo_like run: bf16 / fp16 eval AUC within SMALL_AUC_TOL of fp32 at the same steps
  (the full-size figures: benchmarks/reports/2026-11-26-precision.md).
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers import make_cfg, run_single, run_world, spawn
from parity_helpers import BASE, assert_same_run
from skip_helpers import FP16, inject, poison_w1, reference
from trainer.run.checkpoint.manifest import step_dir
from trainer.base.comm import make_collectives
from trainer.base.config import ConfigError, LossScaleConfig
from trainer.run.resolve.configure import load_config
from trainer.step.precision import DensePrecision, LossScaler
from trainer.run.runner import RunResult, Trainer, run

PARITY_TOL = {"bf16": 1e-3, "fp16": 5e-4}  # rtol = atol of W = 2 against W = 1; measured (tiny, adagrad, 24 steps): bf16 1e-4 (losses) / 5e-5 (dense), fp16 3.4e-6 / 3.8e-5
AUC_TOL = 5e-3  # their eval AUC on the 480 rows; measured: bf16 1.1e-3, fp16 2.6e-5
SMALL_AUC_TOL = 0.005  # the small run (150 steps, adam) measured bf16 -4.5e-4, fp16 +1.9e-4 against fp32 0.7952; the full runs: the report


# ---------------------------------------------------------------------------- fp32 and the scaler
def test_fp32_enters_no_autocast_and_scales_nothing(monkeypatch):
    """The default step is the fp32 step: no autocast region, no loss scale, no unscale op."""
    entered = []
    real = torch.autocast.__enter__
    monkeypatch.setattr(torch.autocast, "__enter__", lambda self: entered.append(self) or real(self))
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda *a: pytest.fail("fp32 unscaled gradients"))
    got = run_single(BASE + ["train.steps=4"], return_state=False)
    assert entered == [] and got.summary["precision"] == {"dense": "fp32", "loss_scale": None,
                                                          "overflow_skips": 0, "overflow_at": []}
    # and the spy works: bf16 does enter it
    run_single(BASE + ["train.steps=2", "train.precision=bf16"], return_state=False)
    assert entered and all(a.fast_dtype == torch.bfloat16 for a in entered)


def test_tf32_is_the_fp32_step_on_a_cpu_and_sets_only_cuda_flags():
    """train.precision=tf32: no autocast, no scaling; on a CPU every loss and parameter equals
    fp32's bit for bit; on CUDA it switches on TF32 matrix products (the flags alone)."""
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        flags.allow_tf32 = False
        ref = run_single(BASE + ["train.steps=4"])
        got = run_single(BASE + ["train.steps=4", "train.precision=tf32"])
        assert got.losses == ref.losses and got.summary["precision"]["dense"] == "tf32"
        assert_same_run(ref, got, rtol=0, atol=0)
        assert flags.allow_tf32 is False  # a CPU run leaves CUDA's flags alone
        DensePrecision(load_config(make_cfg(BASE + ["train.precision=tf32"])), torch.device("cuda"))
        assert flags.allow_tf32 is True
    finally:
        flags.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_loss_scaler_follows_gradscaler():
    """The same overflow sequence gives GradScaler's scale after every step (growth and backoff)."""
    cfg = LossScaleConfig(init=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = LossScaler(cfg)
    theirs = torch.amp.GradScaler("cpu", init_scale=cfg.init, growth_factor=cfg.growth_factor,
                                  backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    pattern = [False, False, False, True, False, True, True, False, False, False, False, False, False, True]
    for overflow in pattern:
        opt.zero_grad()
        theirs.scale(p.sum()).backward()
        if overflow:
            p.grad[1] = math.inf
        g = p.grad.clone()
        found = ours.unscale_([g])
        assert bool(found.item()) == overflow
        theirs.step(opt)
        theirs.update()
        ours.update(overflow)
        assert ours.scale == theirs.get_scale(), (pattern, ours.scale, theirs.get_scale())
        if not overflow:  # unscaled in place, like GradScaler.unscale_
            torch.testing.assert_close(g, torch.ones(3), rtol=0, atol=0)
    state = ours.state_dict()
    again = LossScaler(cfg)
    again.load_state_dict(state)
    assert again.state_dict() == state


@pytest.mark.parametrize("override,key", [("train.precision=fp8", "train.precision"),
                                          ("train.loss_scale.backoff_factor=1.0", "backoff_factor"),
                                          ("train.loss_scale.growth_interval=0", "growth_interval")])
def test_precision_config_errors(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(make_cfg([override]))


def test_fp16_refuses_the_rows_pipeline():
    with pytest.raises(ConfigError, match="train.pipeline=rows cannot undo"):
        load_config(make_cfg(["train.precision=fp16", "train.pipeline=rows", "cache=lru", "consistency=ssp"]))


# ---------------------------------------------------------------------------- W = 2 against W = 1
@pytest.mark.dist
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_two_workers_equal_one_process_within_tolerance(precision):
    overrides = BASE + ["optim=adagrad", f"train.precision={precision}"]
    ref = run_single(overrides)
    fp32 = run_single(BASE + ["optim=adagrad"], return_state=False)
    tol = PARITY_TOL[precision]
    for r, got in enumerate(run_world(2, overrides)):
        assert got.rank == r
        assert_same_run(ref, got, rtol=tol, atol=tol)
        assert got.summary["precision"]["dense"] == precision
        assert got.summary["eval_auc"] == pytest.approx(ref.summary["eval_auc"], abs=AUC_TOL)
    # it is the half type that trained: not the fp32 run
    assert ref.losses != fp32.losses
    assert ref.summary["eval_auc"] == pytest.approx(fp32.summary["eval_auc"], abs=0.02)


# ---------------------------------------------------------------------------- the loss scaler's skips
def fp16_reference(comm, overrides: list[str], skip: tuple[int, ...]) -> RunResult:
    """A run that never trains the steps in `skip` and backs the scale off there, as a skip does."""
    t = Trainer(load_config(make_cfg(overrides)), comm, None)
    real = t.train_step

    def step_or_backoff(step: int) -> float:
        if step in skip:
            t.precision.scaler.update(True)
            return math.nan
        return real(step)

    t.train_step = step_or_backoff
    ref = reference(comm, overrides, (), t)
    ref.losses = [v for v in ref.losses if math.isfinite(v)]
    ref.summary = {"loss_scale": t.precision.scaler.scale}
    return ref


def overflow_worker(rank: int, world: int, where: str, bad: tuple[int, ...], bad_rank: int,
                    extra: list[str]) -> dict:
    inject(where, bad, bad_rank)
    got = run(make_cfg(BASE + FP16 + extra + ["comm=torch"]), return_state=True)
    comm = make_collectives("torch", 60.0, "gloo")
    try:
        ref = fp16_reference(comm, BASE + FP16 + extra + ["comm=torch"], bad)
    finally:
        comm.close()
    return {"got": got, "ref": ref}


@pytest.mark.dist
@pytest.mark.parametrize("where,extra", [("dense", []), ("rows", []), ("rows", ["train.nonfinite=skip"])],
                         ids=["dense", "rows", "rows-nonfinite-skip"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(where, extra):
    """(nonfinite=skip: the loss was reduced before backward, the overflow counts travel alone.)"""
    bad, bad_rank = (3, 7), 1
    res = spawn(2, overflow_worker, where, bad, bad_rank, extra)
    for r, out in enumerate(res):
        got, ref = out["got"], out["ref"]
        s = got.summary
        assert s["precision"]["overflow_at"] == list(bad) and s["precision"]["overflow_skips"] == 2, (r, s["precision"])
        assert s["precision"]["loss_scale"] == 1024 / 4 == ref.summary["loss_scale"]
        assert s["skipped_steps"] == 0 and all(math.isfinite(v) for v in got.losses)  # not a non-finite loss
        kept = [v for i, v in enumerate(got.losses) if i not in bad]
        assert_same_run(ref, RunResult({}, r, kept, got.state), rtol=1e-6, atol=1e-7)
    # every rank skipped alike: the same model everywhere
    for name, v in res[0]["got"].state["dense"].items():
        assert torch.equal(v, res[1]["got"].state["dense"][name]), name


def test_overflow_and_nonfinite_loss_are_told_apart(monkeypatch):
    """train.nonfinite=skip + fp16: the poisoned batch (NaN loss) is a skipped step of
    train.nonfinite and leaves the scale; the overflowing gradient is the scaler's skip."""
    monkeypatch.setattr(Trainer, "train_step", Trainer.train_step)  # inject's patch undone after
    poison_w1(monkeypatch, (2,))
    inject("dense", (5,), 0)
    got = run_single(BASE + FP16 + ["train.nonfinite=skip", "train.steps=8"], return_state=False)
    s = got.summary
    assert s["skipped_steps"] == 1 and s["skipped_at"] == [2]
    assert s["precision"]["overflow_at"] == [5] and s["precision"]["loss_scale"] == 512
    # and train.nonfinite=stop still stops on the NaN loss, naming its step
    with pytest.raises(Exception, match="loss is (nan|inf) at step 2; stopping"):
        run_single(BASE + FP16 + ["train.steps=8"], return_state=False)


def test_the_scale_survives_a_resume(tmp_path):
    """Growing every 2 steps, 9 steps in one run == 5 steps, saved, then 4 more after a resume."""
    o = BASE + FP16 + ["train.loss_scale.growth_interval=2", "train.steps=9"]
    whole = run(make_cfg(o + ["comm=local"]), out_dir=str(tmp_path / "whole"), return_state=True)
    first = tmp_path / "first"
    run(make_cfg(o + ["comm=local", "train.steps=5"]), out_dir=str(first))
    resumed = run(make_cfg(o + ["comm=local", f"checkpoint.resume={step_dir(str(first / 'checkpoints'), 5)}"]),
                  out_dir=str(tmp_path / "resumed"), return_state=True)
    assert whole.summary["precision"]["loss_scale"] == 1024 * 2 ** 4
    assert resumed.summary["precision"] == whole.summary["precision"]
    assert_same_run(whole, resumed, rtol=0, atol=0)


# ---------------------------------------------------------------------------- accuracy
@pytest.mark.slow
def test_small_criteo_like_auc_close_to_fp32():
    o = ["data=criteo_like", "data.max_table_rows=20000", "data.batch_size=512", "data.test_samples=16384",
         "optim=adam", "train.steps=150", "train.threads=1", "train.progress=off", "checkpoint.enabled=false"]
    auc = {p: run_single(o + [f"train.precision={p}"], return_state=False).summary["eval_auc"]
           for p in ("fp32", "bf16", "fp16")}
    assert auc["fp32"] > 0.75, auc  # it learnt something (0.795)
    for p in ("bf16", "fp16"):
        assert abs(auc[p] - auc["fp32"]) < SMALL_AUC_TOL, auc


def test_dense_precision_state_only_for_fp16():
    c = load_config(make_cfg(["train.precision=bf16"]))
    assert DensePrecision(c, torch.device("cpu")).state_dict() is None
    c = load_config(make_cfg(["train.precision=fp16", "train.loss_scale.init=8"]))
    p = DensePrecision(c, torch.device("cpu"))
    assert p.state_dict() == {"scaler": {"scale": 8.0, "growth_tracker": 0}, "overflow_skips": 0, "overflow_at": []}
