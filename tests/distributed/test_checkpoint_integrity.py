"""Damaged or foreign checkpoints are refused with one clear error, on every rank, before anything
changes: a corrupt or truncated file (its checksum), another table schema or optimizer, a dense
state of another shape, a missing manifest, a step beyond train.steps, a bad checkpoint config
value; `python -m trainer ... checkpoint.resume=auto` continues, and a corrupt checkpoint exits 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from failure_helpers import BASE, _dir, _step
from helpers import make_cfg, run_single, run_world

import trainer.run.checkpoint as ckpt
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config


def _copy(saved: str, tmp_path) -> str:
    dst = _dir(tmp_path, os.path.basename(saved))
    shutil.copytree(saved, dst)
    return dst


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("name", [f"{ckpt.shard_dir(0, 1)}/weight.bin", f"{ckpt.shard_dir(0, 1)}/state_sum.bin",
                                  f"{ckpt.shard_dir(0, 1)}/version.bin", ckpt.TRAINER_FILE])
def test_corrupt_or_truncated_file_fails_its_checksum(saved, tmp_path, damage, name):
    path = _copy(saved, tmp_path)
    f = os.path.join(path, name)
    data = bytearray(open(f, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) - 100]
    open(f, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=rf"{name} fails its checksum \(corrupt or truncated\)"):
        run_single(BASE + ["optim=adagrad", f"checkpoint.resume={path}"])


@pytest.mark.parametrize("override,needle", [
    ("data.table_rows=[97,1000,13,250]",
     "table_rows: checkpoint [97, 1001, 13, 250], this run [97, 1000, 13, 250]"),
    ("model.embedding_dim=8", "dim: checkpoint 16, this run 8"),
    ("model=wdl", "model: checkpoint 'dlrm', this run 'wdl'"),
    ("optim=sgd", "optim_sparse: checkpoint 'adagrad', this run 'sgd'"),
])
def test_incompatible_schema_is_rejected(saved, override, needle):
    with pytest.raises(ckpt.CheckpointError, match="incompatible") as err:
        run_single(BASE + ["optim=adagrad", override, f"checkpoint.resume={saved}"])
    assert needle in str(err.value)


def test_dense_shape_mismatch_is_rejected(saved):
    with pytest.raises(ckpt.CheckpointError, match="dense state does not fit"):
        run_single(BASE + ["optim=adagrad", "model.top_mlp=[8]", f"checkpoint.resume={saved}"])


def test_missing_manifest_is_rejected(saved, tmp_path):
    path = _copy(saved, tmp_path)
    os.remove(os.path.join(path, ckpt.MANIFEST))
    with pytest.raises(ckpt.CheckpointError, match="manifest.json cannot be read"):
        run_single(BASE + ["optim=adagrad", f"checkpoint.resume={path}"])


def test_checkpoint_beyond_train_steps_is_rejected(saved):
    with pytest.raises(ckpt.CheckpointError, match="beyond train.steps=2"):
        run_single(BASE + ["optim=adagrad", "train.steps=2", f"checkpoint.resume={saved}"])


def _damage_manifest(path: str, damage: str) -> None:
    f = os.path.join(path, ckpt.MANIFEST)
    if damage == "missing":
        os.remove(f)
    else:
        with open(f, "r+b") as fh:
            fh.truncate(100)


@pytest.mark.parametrize("damage,why", [("truncated", "its manifest.json cannot be read"),
                                        ("missing", "it has no manifest.json")])
def test_damaged_manifest_stops_auto_and_rotation_keeps_it(tmp_path, capsys, damage, why):
    """The issue's reproduction: saves of steps 2, 4, 6, then step 6's manifest truncated (or
    gone). resume=auto stops, naming step 6 (what is wrong) and the override that continues from
    step 4, instead of resuming step 4 without a word. That override's run saves 5 and 9 with
    keep_last=2: rotation deletes steps 2 and 4, never the damaged step 6 (it warns once), and its
    saves record step 6 as seen, so auto then continues step 9, saying it passes over step 6;
    more damage to step 6 afterwards stops auto again."""
    root = str(tmp_path / "ck")
    common = BASE + ["optim=adagrad", f"checkpoint.dir={root}"]
    run_single(common + ["train.steps=6", "checkpoint.every=2"], return_state=False)
    bad = _step(root, 6)
    _damage_manifest(bad, damage)
    with pytest.raises(ckpt.CheckpointDamaged) as err:
        run_single(common + ["train.steps=8", "checkpoint.resume=auto"], return_state=False)
    msg = str(err.value)
    assert msg.startswith(f"checkpoint.resume=auto: a checkpoint in {root} cannot be read: {bad} ({why}")
    assert f"continue from it, run with checkpoint.resume={_step(root, 4)} " in msg, msg

    capsys.readouterr()
    res = run_single(common + ["train.steps=9", "checkpoint.every=5", "checkpoint.keep_last=2",
                               f"checkpoint.resume={_step(root, 4)}"], return_state=False)
    assert res.summary["start_step"] == 4
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [5, 9]
    assert ckpt.damaged_checkpoints(root) == [(bad, ckpt.damaged_checkpoints(root)[0][1])] and os.path.isdir(bad)
    assert capsys.readouterr().err.count(f"checkpoint rotation leaves {bad} alone") == 1
    assert [d["name"] for d in json.load(open(os.path.join(_step(root, 9), ckpt.MANIFEST)))["damaged_seen"]] \
        == ["step_00000006"]

    res = run_single(common + ["train.steps=10", "checkpoint.resume=auto"], return_state=False)
    assert res.summary["resumed_from"] == _step(root, 9) and res.summary["start_step"] == 9
    assert f"passes over the damaged checkpoint {bad}" in capsys.readouterr().err
    st = os.stat(bad)
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched again since that save saw it
    with pytest.raises(ckpt.CheckpointDamaged, match=f"run with checkpoint.resume={_step(root, 10)} "):
        run_single(common + ["train.steps=11", "checkpoint.resume=auto"], return_state=False)


def test_damaged_shard_under_auto_names_the_checkpoint_before_it(tmp_path):
    """resume=auto picks the newest save; a shard of it failing its checksum stops the run naming
    the newest checkpoint saved before it and the override; an explicit path gets the plain error."""
    root = str(tmp_path / "ck")
    common = BASE + ["optim=adagrad", f"checkpoint.dir={root}"]
    run_single(common + ["train.steps=4", "checkpoint.every=2"], return_state=False)
    shard = os.path.join(_step(root, 4), ckpt.shard_dir(0, 1), "weight.bin")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointDamaged) as err:
        run_single(common + ["checkpoint.resume=auto"], return_state=False)
    assert f"{shard} fails its checksum" in str(err.value)
    assert str(err.value).endswith(f"the newest checkpoint saved before it is {_step(root, 2)}: to continue "
                                   f"from it, run with checkpoint.resume={_step(root, 2)}")
    with pytest.raises(ckpt.CheckpointDamaged) as err:
        run_single(common + [f"checkpoint.resume={_step(root, 4)}"], return_state=False)
    assert "fails its checksum" in str(err.value) and "checkpoint.resume=auto" not in str(err.value)


@pytest.mark.dist
def test_bad_checkpoint_fails_on_every_rank_without_hanging(saved, tmp_path):
    path = _copy(saved, tmp_path)
    with open(os.path.join(path, ckpt.shard_dir(0, 1), "weight.bin"), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 failed:.*fails its checksum"):
        run_world(2, BASE + ["optim=adagrad", f"checkpoint.resume={path}"])


def test_cli_resume_auto_and_bad_checkpoint_exit_code(tmp_path):
    """`python -m trainer ... checkpoint.resume=auto` continues; a corrupt checkpoint exits 2."""
    root = str(tmp_path / "ck")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    def cli(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "trainer", *BASE, "train.steps=6", f"checkpoint.dir={root}", *args]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    first = cli("train.steps=4", f"hydra.run.dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-3000:]
    second = cli("checkpoint.resume=auto", f"hydra.run.dir={tmp_path / 'b'}")
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["start_step"] == 4 and summary["checkpoint"] == _step(root, 6)
    with open(os.path.join(_step(root, 6), ckpt.TRAINER_FILE), "r+b") as f:
        f.truncate(10)
    bad = cli("checkpoint.resume=auto", f"hydra.run.dir={tmp_path / 'c'}")
    assert bad.returncode == 2
    assert "trainer.pt fails its checksum" in bad.stderr, bad.stderr[-3000:]
    assert f"run with checkpoint.resume={_step(root, 4)}\n" in bad.stderr, bad.stderr[-3000:]


@pytest.mark.parametrize("override,key", [
    ("checkpoint.every=-1", "checkpoint.every"),
    ("checkpoint.keep_last=-2", "checkpoint.keep_last"),
    ("checkpoint.resume=/no/such/checkpoint", "checkpoint.resume"),
    ("checkpoint.dir=' '", "checkpoint.dir"),
    ("checkpoint.every=often", "checkpoint.every"),
])
def test_bad_checkpoint_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(make_cfg(BASE + [override]))


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_save_over_a_checkpoint_whose_shard_fails_its_checksum_moves_it_aside(tmp_path, capsys, damage):
    """A shard file of step 6 truncated or with one byte changed (its manifest reads): the run that
    saves step 6 again (resumed from step 4) moves the damaged step 6 aside with one line naming
    the file, never writes over it; the new step 6 is complete and resume=auto continues it."""
    root = str(tmp_path / "ck")
    common = BASE + ["optim=adagrad", f"checkpoint.dir={root}"]
    run_single(common + ["train.steps=6", "checkpoint.every=2"], return_state=False)
    bad = _step(root, 6)
    weight = os.path.join(bad, ckpt.shard_dir(0, 1), "weight.bin")
    data = bytearray(open(weight, "rb").read())
    if damage == "truncated":
        data = data[:len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x40
    open(weight, "wb").write(bytes(data))
    capsys.readouterr()
    run_single(common + ["train.steps=6", "checkpoint.every=2", f"checkpoint.resume={_step(root, 4)}"],
               return_state=False)
    aside = [n for n in os.listdir(root) if n.startswith("step_00000006.damaged-")]
    assert len(aside) == 1, os.listdir(root)
    assert open(os.path.join(root, aside[0], ckpt.shard_dir(0, 1), "weight.bin"), "rb").read() == bytes(data)
    err = capsys.readouterr().err
    assert err.count(f"[trainer] warning: {bad} was damaged (checkpoint file {weight} fails its checksum") == 1, err
    res = run_single(common + ["train.steps=8", "checkpoint.resume=auto"], return_state=False)
    assert res.summary["resumed_from"] == bad and res.summary["start_step"] == 6


def test_a_save_of_a_damaged_checkpoints_step_moves_it_aside(tmp_path, capsys):
    """The run the error advises (checkpoint.resume=<step 4>) saves step 6 again: the damaged step 6
    the error named is not overwritten but moved aside under a name that says so, with its files
    as they were and one warning line; the new step 6 is complete and resume=auto continues it."""
    root = str(tmp_path / "ck")
    common = BASE + ["optim=adagrad", f"checkpoint.dir={root}"]
    run_single(common + ["train.steps=6", "checkpoint.every=2"], return_state=False)
    bad = _step(root, 6)
    _damage_manifest(bad, "truncated")
    kept = open(os.path.join(bad, ckpt.MANIFEST), "rb").read()
    with pytest.raises(ckpt.CheckpointDamaged, match="a save of the same step moves it aside"):
        run_single(common + ["train.steps=8", "checkpoint.resume=auto"], return_state=False)
    capsys.readouterr()
    run_single(common + ["train.steps=6", "checkpoint.every=2", f"checkpoint.resume={_step(root, 4)}"],
               return_state=False)
    aside = [n for n in os.listdir(root) if n.startswith("step_00000006.damaged-")]
    assert len(aside) == 1 and open(os.path.join(root, aside[0], ckpt.MANIFEST), "rb").read() == kept
    err = capsys.readouterr().err
    assert err.count(f"[trainer] warning: {bad} was damaged (its manifest.json cannot be read") == 1, err
    assert f"moved aside to {os.path.join(root, aside[0])}" in err
    assert ckpt.damaged_checkpoints(root) == [] and [s for s, _ in ckpt.complete_checkpoints(root)][-1] == 6
    res = run_single(common + ["train.steps=8", "checkpoint.resume=auto"], return_state=False)
    assert res.summary["resumed_from"] == bad and res.summary["start_step"] == 6
