"""Checkpoints and resume (issue 8): a BSP run saved at step k and resumed, on the same or another
number of workers, equals the uninterrupted run (every loss, dense parameter and embedding row);
saves are atomic, rotation keeps exactly keep_last, and bad checkpoints or config fail clearly.

Runs are tiny (12 steps of the tiny preset) so the whole file stays within about two minutes.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import trainer.checkpoint as ckpt
import trainer.procs as procs
from trainer.checkpoint import saver  # where Checkpointer writes its files
from helpers import make_cfg, run_single, run_world, spawn, train_worker
from test_parity import assert_same_run
from trainer.config import ConfigError
from trainer.configure import load_config
from trainer.embedding import RowSharding, ShardStore

STEPS, K = 12, 5
BASE = ["data=tiny", f"train.steps={STEPS}", "data.global_batch_size=48", "data.eval_samples=96",
        "data.eval_batch_size=48", "train.threads=1", "train.progress=off"]

RESUME_CASES = {
    "lru-sgd": ["cache=lru", "optim=sgd"],
    # a tiny accumulator start: the restored Adagrad state (dense and rows) decides the updates
    "lru-adagrad": ["cache=lru", "optim=adagrad", "optim.initial_accumulator=1e-8"],
}


def _dir(tmp_path, name: str) -> str:
    return str(tmp_path / name)


def _step(root: str, step: int) -> str:
    return ckpt.step_dir(root, step)


def _resume_run(world: int, overrides: list[str], path: str, out: str):
    extra = overrides + [f"checkpoint.resume={path}", f"checkpoint.dir={out}"]
    return run_single(extra) if world == 1 else run_world(world, extra)[0]


# ---------------------------------------------------------------------------- resharding (unit)
ROWS = [97, 1001, 13, 250]


def _stores(world: int, optimizer: str) -> list[ShardStore]:
    return [ShardStore(RowSharding(ROWS, world, r), 4, 0, None, optimizer, 0.1, 1e-10,
                       torch.device("cpu"), 0.1) for r in range(world)]


def _by_row(store: ShardStore) -> dict[str, torch.Tensor]:
    """Every real row of a store keyed by its position in the unpadded concatenation of tables."""
    st = ckpt.shard_state(store)
    key = torch.tensor([0] + ROWS).cumsum(0)[st["table"]] + st["id"]
    out = {"weight": st["weight"], "version": st["version"], **st["optim"]}
    return {k: v[torch.argsort(key)] for k, v in out.items()} | {"key": key.sort().values}


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (2, 1), (1, 3)])
def test_reshard_moves_rows_versions_and_optimizer_state_to_their_new_owners(old, new, optimizer):
    torch.manual_seed(old * 10 + new)
    before = _stores(old, optimizer)
    for s in before:  # give every row its own weight, version and state
        s.weight.uniform_()
        s.version.random_(0, 1000)
        for v in s.optimizer.state_tensors().values():
            v.uniform_()
    saved = [ckpt.shard_state(s) for s in before]
    after = _stores(new, optimizer)
    for s in after:
        loaded = sum(ckpt.load_shard_rows(s, sv, f"shard{i}") for i, sv in enumerate(saved))
        assert loaded == int(s.sharding.valid(s.sharding.local_gids()).sum())
    want = [_by_row(s) for s in before]
    got = [_by_row(s) for s in after]
    for k in want[0]:
        a, b = torch.cat([w[k] for w in want]), torch.cat([g[k] for g in got])
        order_a, order_b = torch.argsort(torch.cat([w["key"] for w in want])), \
            torch.argsort(torch.cat([g["key"] for g in got]))
        assert torch.equal(a[order_a], b[order_b]), k
    assert sum(len(w["key"]) for w in want) == sum(ROWS)


# ---------------------------------------------------------------------------- resume == uninterrupted
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


# ---------------------------------------------------------------------------- atomicity, auto, rotation
def test_crash_during_save_leaves_previous_checkpoint_and_auto_resumes(tmp_path, monkeypatch, capsys):
    """A save that fails after the shard is written (before the manifest) removes its .tmp dir and
    leaves the earlier checkpoints; auto skips incomplete dirs (and the unfinished save of a run
    killed mid-save, removed when its dead lock is taken over) and picks the newest complete
    checkpoint, from which the run finishes equal to an uninterrupted one."""
    root = _dir(tmp_path, "ck")
    real = saver.write_manifest

    def crash_at_final(tmp: str, manifest: dict) -> None:
        if manifest["step"] == STEPS:
            raise OSError("simulated crash while saving")
        real(tmp, manifest)

    monkeypatch.setattr(saver, "write_manifest", crash_at_final)
    with pytest.raises(ckpt.CheckpointError, match="simulated crash"):
        run_single(BASE + [f"checkpoint.dir={root}", f"checkpoint.every={K}", "checkpoint.keep_last=0"])
    monkeypatch.setattr(saver, "write_manifest", real)
    names = sorted(os.listdir(root))
    assert names == ["step_00000005", "step_00000010"], names  # no .tmp- dir, lock released
    os.makedirs(os.path.join(root, "step_00000011"))  # no manifest: incomplete, ignored
    dead = subprocess.Popen(["true"])  # a run killed mid-save: its lock and its unfinished save
    dead.wait()
    with open(os.path.join(root, ckpt.LOCK), "w") as f:
        json.dump({"run_id": "0123456789ab", "pid": dead.pid, "host": socket.gethostname(),
                   "pid_ns": procs.pid_namespace()}, f)
    os.makedirs(os.path.join(root, "step_00000099.tmp-0123456789ab-00000000"))
    assert ckpt.latest(root) == _step(root, 10)

    got = run_single(BASE + [f"checkpoint.dir={root}", "checkpoint.resume=auto"])
    assert got.summary["resumed_from"] == _step(root, 10)
    assert_same_run(run_single(BASE), got)
    assert not [n for n in os.listdir(root) if ".tmp-" in n]  # leftovers cleaned after a good save

    fresh = _dir(tmp_path, "empty")
    capsys.readouterr()
    run_single(BASE + ["train.steps=2", f"checkpoint.dir={fresh}", "checkpoint.resume=auto"])
    assert "no complete checkpoint" in capsys.readouterr().err


def _rank1_fails_in_final_save(rank: int, world: int, overrides: list[str]):
    """Spawned worker: rank 1 raises right after writing its shard of the final checkpoint."""
    real = ckpt.Checkpointer._write_shard

    def write_then_fail(self, tmp: str, store):
        out = real(self, tmp, store)
        if rank == 1 and os.path.basename(tmp).startswith(f"step_{STEPS:08d}.tmp-"):
            raise OSError("simulated crash of rank 1 after its shard")
        return out

    ckpt.Checkpointer._write_shard = write_then_fail
    return train_worker(rank, world, overrides, False)


@pytest.mark.dist
def test_one_rank_failing_mid_save_stops_every_rank_and_auto_resumes(tmp_path):
    """W = 2, cache on: rank 1 fails mid-save; rank 0 stops too (naming rank 1), the earlier
    checkpoints stay complete, and auto resumes from the newest to the reference result."""
    root = _dir(tmp_path, "ck")
    overrides = BASE + ["cache=lru", f"checkpoint.dir={root}", f"checkpoint.every={K}"]
    with pytest.raises(RuntimeError, match=rf"rank 0 failed:\nCheckpointError: checkpoint save of step {STEPS} "
                                           rf"into {root} failed on rank\(s\) \[1\]"):
        spawn(2, _rank1_fails_in_final_save, overrides)
    assert ckpt.latest(root) == _step(root, 10)
    assert not [n for n in os.listdir(root) if ".tmp-" in n]  # the failed save removed its dir
    got = run_world(2, overrides + ["checkpoint.resume=auto"])[0]
    assert got.summary["resumed_from"] == _step(root, 10)
    assert_same_run(run_single(BASE + ["cache=lru"]), got)


def test_keep_last_rotation_keeps_exactly_n(tmp_path):
    root = _dir(tmp_path, "ck")
    run_single(BASE + ["train.steps=10", "checkpoint.every=2", "checkpoint.keep_last=2",
                       f"checkpoint.dir={root}"])
    assert sorted(os.listdir(root)) == ["step_00000008", "step_00000010"]


def test_no_output_dir_means_no_checkpoint_and_out_dir_default(tmp_path):
    res = run_single(BASE + ["train.steps=2"])
    assert res.summary["checkpoint"] is None
    from trainer.runner import run
    out = _dir(tmp_path, "run")
    res = run(make_cfg(BASE + ["train.steps=2", "comm=local"]), out_dir=out)
    assert res.summary["checkpoint"] == _step(os.path.join(out, "checkpoints"), 2)
    off = _dir(tmp_path, "off")
    res = run(make_cfg(BASE + ["train.steps=2", "comm=local", "checkpoint.enabled=false"]), out_dir=off)
    assert res.summary["checkpoint"] is None and not os.path.exists(os.path.join(off, "checkpoints"))


# ---------------------------------------------------------------------------- bad checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """One complete W = 1 checkpoint (adagrad) at step 3, never modified by tests (copy it)."""
    root = str(tmp_path_factory.mktemp("saved"))
    run_single(BASE + ["train.steps=3", "optim=adagrad", f"checkpoint.dir={root}"])
    return _step(root, 3)


def _copy(saved: str, tmp_path) -> str:
    dst = _dir(tmp_path, os.path.basename(saved))
    shutil.copytree(saved, dst)
    return dst


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("name", [ckpt.shard_file(0, 1), ckpt.TRAINER_FILE])
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
    with open(os.path.join(path, ckpt.shard_file(0, 1)), "r+b") as f:
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


# ---------------------------------------------------------------------------- config
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


def test_rng_state_round_trips():
    state = ckpt.rng_state(torch.device("cpu"))
    first = (torch.rand(3), np.random.rand(3), random.random())
    ckpt.set_rng_state(state, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all() and first[2] == again[2]
