"""train.ensemble (trainer/run/evaluation/ensemble.py): K members, each a complete run with its own validation slice,
and the test split scored with the mean of their calibrated logits.

Checked: every member is exactly the run `train.ensemble=1 data.val_slice=j` (same test metrics,
same temperature); the ensemble's metrics are those of the mean prediction of the members' saved
test logits; W = 2 members equal W = 2 single runs and the ranks agree; checkpoint.resume=auto
reuses finished members only when their config matches; the config rules. The old name train.bag
still works for one release (it maps to train.ensemble with one warning line on the launcher's rank
0); both names with different values are refused (exit 2 from the command)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import make_cfg, run_single, run_world
from trainer.run.evaluation.ensemble import LOGITS, mean_prediction
from trainer.base.config import ConfigError, val_range, val_rows
from trainer.run.resolve.configure import load_config
from trainer.workload.data import val_slices
from trainer.run.evaluation.metrics import auc_logloss
from trainer.run.runner import run

QUICK = ["data.epochs=4", "train.early_stop.patience=2", "train.progress=off", "train.tensorboard=false",
         "data.loader=memmap", "train.threads=1"]


def _over(d: str, *extra: str) -> list[str]:
    return ["data=criteo", f"data.dir={d}", "data.batch_size=64", *QUICK, *extra]


def _check_ensemble(s: dict, out: str, slices: list[int]) -> None:
    members = s["ensemble"]["members"]
    assert [m["val_slice"] for m in members] == slices
    rows = [np.load(os.path.join(out, f"member{k}", LOGITS)) for k in range(1, len(slices) + 1)]
    for m, r in zip(members, rows):
        assert auc_logloss(r[:, 0], r[:, 1]) == pytest.approx((m["test_auc"], m["test_logloss"]), rel=1e-9)
    auc, ll = auc_logloss(mean_prediction([r[:, 0] for r in rows]), rows[0][:, 1])
    assert (s["test_auc"], s["test_logloss"]) == (auc, ll) and s["eval_auc"] == auc
    assert s["steps"] == sum(m["steps"] for m in members)
    assert s["ensemble"]["member_test_auc_mean"] == pytest.approx(np.mean([m["test_auc"] for m in members]))


def test_members_are_the_single_runs_and_the_ensemble_averages_them(prepared, tmp_path):
    out = str(tmp_path / "ensemble")
    s = run(make_cfg(_over(prepared, "train.ensemble=3")), out_dir=out).summary
    assert s["config"]["train"]["ensemble"] == 3 and s["recipe"]["values"]["train.ensemble"] == 3
    slices = [1, 2, 3]  # 3 of the 5 slices of a 20% split: 1 + i * (5 // 3)
    _check_ensemble(s, out, slices)
    for m in s["ensemble"]["members"]:
        one = run_single(_over(prepared, "train.ensemble=1", f"data.val_slice={m['val_slice']}"), return_state=False).summary
        assert (one["test_auc"], one["test_logloss"], one["best_step"]) == (m["test_auc"], m["test_logloss"], m["best_step"])
        assert one["calibration"]["temperature"] == m["temperature"]
        assert one["embedding"]["table_rows"] == m["table_rows"]  # data.min_count: each member's own vocabulary
        assert json.load(open(os.path.join(m["output_dir"], "summary.json")))["test_auc"] == m["test_auc"]
    assert len({tuple(m["table_rows"]) for m in s["ensemble"]["members"]}) == 3
    assert s["test_auc"] != s["ensemble"]["member_test_auc_mean"]
    assert json.load(open(os.path.join(out, "summary.json")))["test_auc"] == s["test_auc"]


def test_resume_reuses_finished_members_with_the_same_config(prepared, tmp_path):
    out = str(tmp_path / "ensemble")
    first = run(make_cfg(_over(prepared, "train.ensemble=2")), out_dir=out).summary
    again = run(make_cfg(_over(prepared, "train.ensemble=2", "checkpoint.resume=auto")), out_dir=out)
    assert all(m["reused"] for m in again.summary["ensemble"]["members"]) and again.losses == []
    assert again.summary["test_auc"] == first["test_auc"] and again.summary["samples_per_sec"] is None
    # another config: nothing is reused (each member resumes from its own final checkpoint instead)
    other = run(make_cfg(_over(prepared, "train.ensemble=2", "checkpoint.resume=auto", "optim.lr=0.002")),
                out_dir=out).summary
    assert not any(m["reused"] for m in other["ensemble"]["members"])


@pytest.mark.dist
def test_two_workers_members_equal_their_single_runs(prepared, tmp_path):
    """W = 2: the ranks agree on the ensemble and on every loss; member k equals the W = 2 run with its
    slice (criteo's data order depends on W, so the reference is a W = 2 run)."""
    ranks = run_world(2, _over(prepared, "train.ensemble=2", "data.global_batch_size=64"),
                      return_state=False)
    a, b = ranks
    assert a.losses == b.losses and a.summary["test_auc"] == b.summary["test_auc"]
    assert a.summary["world_size"] == 2
    for m in a.summary["ensemble"]["members"]:
        one = run_world(2, _over(prepared, "train.ensemble=1", f"data.val_slice={m['val_slice']}",
                                 "data.global_batch_size=64"), return_state=False)[0].summary
        assert (one["test_auc"], one["test_logloss"]) == pytest.approx((m["test_auc"], m["test_logloss"]), rel=1e-9)


def test_ensemble_config_rules(prepared):
    base = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap"]
    assert load_config(make_cfg(base)).train.ensemble == 5  # the tiny recipe
    assert load_config(make_cfg(base + ["train.recipe=small"])).train.ensemble == 1
    assert load_config(make_cfg(base + ["data.val_fraction=0"])).train.ensemble == 1  # no slices to give
    assert load_config(make_cfg(base + ["train.recipe=large"])).train.ensemble == 1
    for extra, match in [(["train.ensemble=0"], r"train\.ensemble=0: must be >= 1"),
                         (["train.ensemble=3", "data.val_fraction=0"], r"train\.ensemble=3: .*data\.val_fraction > 0"),
                         (["train.ensemble=3", "data.val_slice=2"], r"data\.val_slice=2: train\.ensemble=3 gives"),
                         (["train.ensemble=3", "checkpoint.resume=/x/step_1"], r"checkpoint\.resume='/x/step_1': .*auto")]:
        with pytest.raises(ConfigError, match=match):
            load_config(make_cfg(base + extra))
    with pytest.raises(ConfigError, match=r"train\.ensemble=2: .*data=criteo option"):
        load_config(make_cfg(["data=tiny", "data.train_samples=100", "data.val_fraction=0.2", "train.ensemble=2"]))


def test_every_slice_fits_whatever_the_row_count(prepared):
    """The validation split is floor(f x n) rows, so 1 / f slices of it always fit: 5,001 training
    rows (the size of a held-out set we were asked about) give the ensemble five members, not four
    (ceil gave slices of 1,001 rows and room for four)."""
    assert val_rows(5001, 0.2) == 1000 and val_range(5001, 0.2, 5) == (1, 1001)
    for n in list(range(2, 400)) + [1599, 5001, 5004, 99_999]:
        for k in (2, 3, 4, 5, 10):
            if n > k:
                assert n // val_rows(n, 1 / k) >= k, (n, k)
                assert val_range(n, 1 / k, k)[0] >= 0
    base = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap"]
    for n in (1596, 1597, 1599, 1600):  # the prepared sample has 1,600 training rows
        c = load_config(make_cfg(base + [f"data.train_samples={n}"]))
        assert c.train.ensemble == 5 and val_slices(c.data, 5) == [1, 2, 3, 4, 5], n


def test_command_refuses_both_names_and_runs_the_old_one(tmp_path):
    """`python -m trainer`: both names with different values exit 2 with the error (no traceback, no
    run); the old name alone runs, warns once and the summary's config holds it as train.ensemble."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "trainer", "data=tiny", "train.steps=2", "train.progress=off",
           "train.tensorboard=false", "data.test_samples=64"]
    both = subprocess.run(cmd + ["train.bag=1", "train.ensemble=2", f"hydra.run.dir={tmp_path / 'both'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert both.returncode == 2 and "Traceback" not in both.stderr, both.stderr[-3000:]
    assert both.stderr.strip().splitlines()[-1] == ("error: train.bag=1 and train.ensemble=2: train.bag is the old "
                                                    "name of train.ensemble: give only train.ensemble"), both.stderr
    out = tmp_path / "old"
    old = subprocess.run(cmd + ["train.bag=1", f"hydra.run.dir={out}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr[-3000:]
    assert old.stderr.count("train.bag is deprecated, use train.ensemble (train.bag=1 -> train.ensemble=1)") == 1
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["train"]["ensemble"] == 1 and "bag" not in s["config"]["train"]


def test_the_final_line_says_members_and_their_steps(prepared, tmp_path):
    """`python -m trainer ... train.ensemble=2`: the one JSON line at the end gives the members and
    each member's steps beside the steps of all of them together (summary.json's `steps`)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "trainer", *_over(prepared, "train.ensemble=2"), f"hydra.run.dir={out}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-2])
    s = json.loads((out / "summary.json").read_text())
    assert line["members"] == 2 and line["steps_per_member"] == [m["steps"] for m in s["ensemble"]["members"]]
    assert line["steps"] == sum(line["steps_per_member"]) == s["steps"]
