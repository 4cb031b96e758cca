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
from failure_helpers import (
    BASE,
    _dir,
    _step,
    saved,  # noqa: F401 (fixtures)
)
from helpers import make_cfg, run_single, run_world

import trainer.checkpoint as ckpt
from trainer.config import ConfigError
from trainer.configure import load_config


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
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
