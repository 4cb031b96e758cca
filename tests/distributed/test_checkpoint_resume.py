"""Checkpoints and resume: a BSP run saved at step k and resumed, on the same or another number of
workers, equals the uninterrupted run (every loss, dense parameter and embedding row; how rows,
versions and optimizer state reach their new owners is tests/unit/test_checkpoint_format.py's); rotation keeps exactly keep_last and
follows the save order (a branch from an older step keeps its newest save, and resume=auto follows
it); a Criteo checkpoint is refused at another W; a resume at the final step reports null rates.
Runs are tiny (12 steps of the tiny preset)."""
from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from data_helpers import train_models
from failure_helpers import BASE, CLI_BASE, STEPS, K, _cli, _dir, _manifest, _step
from helpers import make_cfg, run_single, run_world, spawn
from parity_helpers import assert_same_run

import trainer.run.checkpoint as ckpt
from trainer.run.checkpoint.manifest import WORK_DIR
from trainer.run.runner import run

RESUME_CASES = {
    "lru-sgd": ["cache=lru", "optim=sgd"],
    # a tiny accumulator start: the restored Adagrad state (dense and rows) decides the updates
    "lru-adagrad": ["cache=lru", "optim=adagrad", "optim.initial_accumulator=1e-8"],
}


def _resume_run(world: int, overrides: list[str], path: str, out: str):
    extra = overrides + [f"checkpoint.resume={path}", f"checkpoint.dir={out}"]
    return run_single(extra) if world == 1 else run_world(world, extra)[0]


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_on_2_3_and_1_workers_equals_uninterrupted(case, tmp_path):
    """W = 2 saves at step K (periodic) and at the end; resuming step K on W = 2, 3 and 1 (rows
    resharded to the new owners, optimizer state with them) reproduces the uninterrupted run."""
    overrides = BASE + RESUME_CASES[case]
    root = _dir(tmp_path, "w2")
    full = run_world(2, overrides + [f"checkpoint.dir={root}", f"checkpoint.every={K}"])[0]
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [K, 10, STEPS]
    assert full.summary["cache"]["hits"] > 0  # the cache was really on
    for world in (2, 3, 1):
        got = _resume_run(world, overrides, _step(root, K), _dir(tmp_path, f"to{world}"))
        assert got.summary["start_step"] == K and got.summary["world_size"] == world
        assert len(got.losses) == STEPS
        assert_same_run(full, got)
        assert got.summary["final_loss"] == pytest.approx(full.summary["final_loss"], rel=1e-5)


def test_keep_last_rotation_keeps_exactly_n(tmp_path):
    root = _dir(tmp_path, "ck")
    run_single(BASE + ["train.steps=10", "checkpoint.every=2", "checkpoint.keep_last=2",
                       f"checkpoint.dir={root}"])
    assert sorted(os.listdir(root)) == ["step_00000008", "step_00000010"]


def test_a_run_killed_while_rotation_deletes_leaves_no_damaged_checkpoint(tmp_path, monkeypatch):
    """Rotation renames a checkpoint out of the step_K names before deleting it: a run killed in
    the middle of that delete (rmtree takes manifest.json out first here, then the process dies)
    leaves the run's own work directory, not a step_K without a manifest that resume=auto would
    have to stop at; the newest checkpoint stays the one to resume from."""
    import trainer.run.checkpoint.saver as saver
    real = shutil.rmtree

    class Killed(BaseException):
        pass

    def killed_mid_delete(path, ignore_errors=False):
        if os.path.exists(os.path.join(path, ckpt.MANIFEST)):
            os.remove(os.path.join(path, ckpt.MANIFEST))  # rmtree may take it out first
        raise Killed
    root = _dir(tmp_path, "ck")
    run_single(BASE + ["train.steps=2", "checkpoint.every=2", f"checkpoint.dir={root}"])
    monkeypatch.setattr(saver.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(Killed):
        run_single(BASE + ["train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=1",
                           f"checkpoint.dir={root}", f"checkpoint.resume={_step(root, 2)}"])
    monkeypatch.setattr(saver.shutil, "rmtree", real)
    assert ckpt.damaged_checkpoints(root) == []
    assert ckpt.latest(root) == _step(root, 4)
    left = [n for n in os.listdir(root) if WORK_DIR.match(n)]
    assert len(left) == 1 and left[0].startswith("step_00000002.old-"), os.listdir(root)


def test_no_output_dir_means_no_checkpoint_and_out_dir_default(tmp_path):
    res = run_single(BASE + ["train.steps=2"])
    assert res.summary["checkpoint"] is None
    from trainer.run.runner import run
    out = _dir(tmp_path, "run")
    res = run(make_cfg(BASE + ["train.steps=2", "comm=local"]), out_dir=out)
    assert res.summary["checkpoint"] == _step(os.path.join(out, "checkpoints"), 2)
    off = _dir(tmp_path, "off")
    res = run(make_cfg(BASE + ["train.steps=2", "comm=local", "checkpoint.enabled=false"]), out_dir=off)
    assert res.summary["checkpoint"] is None and not os.path.exists(os.path.join(off, "checkpoints"))


def test_rng_state_round_trips():
    state = ckpt.rng_state(torch.device("cpu"))
    first = (torch.rand(3), np.random.rand(3), random.random())
    ckpt.set_rng_state(state, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all() and first[2] == again[2]


def test_branch_keeps_its_newest_save_and_auto_follows_it(tmp_path):
    """The issue's reproduction, as processes: 40 steps saved every 10, then a branch from step_20
    to step 35 at another lr. keep_last=1 keeps step_35 (the newest save, not step_40); with
    keep_last=3 a later resume=auto continues the branch (step_35), not the abandoned step_40."""
    b = str(tmp_path / "B")
    first = _cli(tmp_path, "train.steps=40", "checkpoint.every=10", f"checkpoint.dir={b}",
                 f"hydra.run.dir={tmp_path / 'r1'}")
    assert first.returncode == 0, first.stderr[-3000:]
    b3 = str(tmp_path / "B3")
    shutil.copytree(b, b3)
    branch = ["train.steps=35", "optim.lr=0.01", "checkpoint.every=10"]
    one = _cli(tmp_path, *branch, "checkpoint.keep_last=1", f"checkpoint.resume={ckpt.step_dir(b, 20)}",
               f"checkpoint.dir={b}", f"hydra.run.dir={tmp_path / 'r2'}")
    assert one.returncode == 0, one.stderr[-3000:]
    summary = json.loads((tmp_path / "r2" / "summary.json").read_text())
    assert summary["checkpoint"] == ckpt.step_dir(b, 35) and os.path.isdir(summary["checkpoint"])
    assert [s for s, _ in ckpt.complete_checkpoints(b)] == [35]

    three = _cli(tmp_path, *branch, "checkpoint.keep_last=3", f"checkpoint.resume={ckpt.step_dir(b3, 20)}",
                 f"checkpoint.dir={b3}", f"hydra.run.dir={tmp_path / 'r3'}")
    assert three.returncode == 0, three.stderr[-3000:]
    assert [s for s, _ in ckpt.complete_checkpoints(b3)] == [40, 30, 35]  # save order
    seqs = [_manifest(p)["save_seq"] for _, p in ckpt.complete_checkpoints(b3)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert _manifest(ckpt.step_dir(b3, 30))["config"]["optim"]["lr"] == 0.01  # the branch's step_30
    auto = _cli(tmp_path, "train.steps=40", "optim.lr=0.01", f"checkpoint.dir={b3}", "checkpoint.resume=auto",
                f"hydra.run.dir={tmp_path / 'r4'}")
    assert auto.returncode == 0, auto.stderr[-3000:]
    summary = json.loads((tmp_path / "r4" / "summary.json").read_text())
    assert summary["resumed_from"] == ckpt.step_dir(b3, 35) and summary["start_step"] == 35


def test_checkpoints_without_save_seq_come_first_by_step(tmp_path):
    """Checkpoints written before save_seq existed are older than any with one, by step."""
    root = tmp_path / "ck"
    for step, seq in ((30, None), (10, None), (20, 1)):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / ckpt.MANIFEST).write_text(json.dumps({"step": step} | ({"save_seq": seq} if seq else {})))
    assert [s for s, _ in ckpt.complete_checkpoints(str(root))] == [10, 30, 20]
    assert ckpt.latest(str(root)) == str(root / "step_00000020") and ckpt.last_save_seq(str(root)) == 1


def test_rotation_touches_only_this_runs_work_dirs(tmp_path):
    """Cleanup after a save removes this run's own leftovers only: another run's save in progress
    (or an unrecognised directory) stays."""
    root = str(tmp_path / "ck")
    foreign = ["step_00000004.tmp-0123456789ab-00000000", "step_00000004.old-0123456789ab-00000000",
               "step_00000099.tmp-leftover"]
    for name in foreign:
        os.makedirs(os.path.join(root, name))
    run_single(CLI_BASE + ["train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=1", f"checkpoint.dir={root}"])
    assert sorted(os.listdir(root)) == sorted(foreign + ["step_00000006"])


def test_stream_world_check_reads_older_manifests():
    """A Criteo checkpoint written while the data order depended on W (data_order_world = W, or a
    manifest from before that key: the data name in its config decides) is refused at another W;
    today's saves write null (tests/distributed/test_criteo_systems.py resumes them at any W)."""
    with pytest.raises(ckpt.CheckpointError, match=r"written by a data=criteo run with 2 workers and this run "
                                                   r"has 1.*Resume it with 2 workers"):
        ckpt.check_stream_world("ck", {"data_order_world": 2, "step": 3, "config": {"data": {"name": "criteo"}}}, 1)
    old = {"world_size": 2, "step": 3, "config": {"data": {"name": "criteo"}}}
    with pytest.raises(ckpt.CheckpointError, match="with 2 workers and this run has 3"):
        ckpt.check_stream_world("ck", old, 3)
    ckpt.check_stream_world("ck", old, 2)
    ckpt.check_stream_world("ck", {**old, "config": {"data": {"name": "synthetic"}}}, 3)
    ckpt.check_stream_world("ck", {**old, "data_order_world": None}, 3)


def test_resume_at_the_final_step_reports_null_rates(tmp_path):
    """Nothing trained: samples/s and per-sample figures are null, not a division by ~0, and the
    summary has the same keys as a run that trained."""
    root = str(tmp_path / "ck")
    first = run_single(CLI_BASE + ["train.steps=4", f"checkpoint.dir={root}"], return_state=False).summary
    again = run(make_cfg(CLI_BASE + ["comm=local", "train.steps=4", f"checkpoint.resume={ckpt.step_dir(root, 4)}",
                                 f"checkpoint.dir={tmp_path / 'ck2'}"]), out_dir=str(tmp_path / "out")).summary
    assert again["start_step"] == 4 and again["end_step"] == 4
    assert again["samples_per_sec"] is None and again["train_time_s"] == 0
    assert again["bytes_per_sample"] is None and again["embedding_bytes_per_sample"] is None
    assert set(again["bytes_per_sample_by_kind"]) == set(first["bytes_per_sample_by_kind"])
    assert all(v is None for v in again["bytes_per_sample_by_kind"].values())
    assert all(v is None for k, v in again["embedding"].items() if k.endswith("_per_step"))
    assert set(again) == set(first) and again["eval_auc"] == pytest.approx(first["eval_auc"])
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["samples_per_sec"] is None


def test_a_resume_loads_every_row_without_computing_initial_rows(tmp_path, monkeypatch):
    """A run that resumes skips the rows' initial values (every row it owns comes from the
    checkpoint; hashing them was half of a big resume's time) and ends as the uninterrupted run."""
    from trainer.sparse.embedding.store.shard import ShardStore
    root = str(tmp_path / "ck")
    whole = run_single(CLI_BASE + ["train.steps=6", "checkpoint.enabled=false"])
    run_single(CLI_BASE + ["train.steps=6", "checkpoint.every=3", f"checkpoint.dir={root}"], return_state=False)

    def no_init(self, local_idx):
        raise AssertionError("a resumed run computed initial rows")
    monkeypatch.setattr(ShardStore, "_initial", no_init)
    again = run(make_cfg(CLI_BASE + ["comm=local", "train.steps=6", f"checkpoint.resume={ckpt.step_dir(root, 3)}",
                                     f"checkpoint.dir={tmp_path / 'ck2'}"]), out_dir=str(tmp_path / "out"),
                return_state=True)
    assert again.summary["start_step"] == 3
    for t, (x, y) in enumerate(zip(whole.state["tables"], again.state["tables"])):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=lambda m: f"table {t}: {m}")
