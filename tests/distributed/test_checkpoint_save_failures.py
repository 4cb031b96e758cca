"""A save that fails never costs the earlier checkpoints nor the model in memory: a crash in the middle
of a save leaves the previous checkpoint for resume=auto; one rank failing mid-save stops every
rank, naming it; a failed save (a real full disk, a failed write) removes its own partial
directory; a peer lost after the rename still names that checkpoint; a save that fails mid-run
keeps the model (a fallback save into the output dir, an evaluation and summary.json with
`checkpoint_error`, then exit 2), and without another place still writes the summary."""
from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
from failure_helpers import BASE, CLI_BASE, STEPS, K, _cli, _dir, _records, _step
from helpers import make_cfg, run_single, run_world, spawn, tmpfs, train_worker
from parity_helpers import assert_same_run

import trainer.run.checkpoint as ckpt
import trainer.base.core.procs as procs
from trainer.run.checkpoint import saver
from trainer.run.runner import run


def _failed_save(rank: int, world: int, overrides: list[str], out_dir: str):
    try:
        run(make_cfg(list(overrides) + ["comm=torch"]), out_dir=out_dir)
    except ckpt.CheckpointError as exc:
        return str(exc), getattr(exc, "summary", None)
    return "no error", None


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs (a tiny checkpoint is ~180 KiB): real ENOSPC. Unmounted afterwards."""
    with tmpfs(tmp_path / "small") as mnt:
        yield mnt


def _rank1_fails_in_final_save(rank: int, world: int, overrides: list[str]):
    """Spawned worker: rank 1 raises right after writing its shard of the final checkpoint."""
    real = ckpt.CheckpointWriter._write_shard

    def write_then_fail(self, tmp: str, store):
        out = real(self, tmp, store)
        if rank == 1 and os.path.basename(tmp).startswith(f"step_{STEPS:08d}.tmp-"):
            raise OSError("simulated crash of rank 1 after its shard")
        return out

    ckpt.CheckpointWriter._write_shard = write_then_fail
    return train_worker(rank, world, overrides, False)


def test_crash_during_save_leaves_previous_checkpoint_and_auto_resumes(tmp_path, monkeypatch, capsys):
    """A save that fails after the shard is written (before the manifest) removes its .tmp dir and
    leaves the earlier checkpoints; auto skips the unfinished save of a run killed mid-save
    (removed when its dead lock is taken over) and picks the newest complete checkpoint, from which
    the run finishes equal to an uninterrupted one. (A step_K without a manifest is damaged, not
    unfinished: test_checkpoint_integrity.py.)"""
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


def test_failed_save_on_a_full_disk_removes_its_partial_dir(tiny_fs):
    """The final save runs out of space: the run fails naming the error, its step_K.tmp-* is gone
    (relaunching on the same full disk does not pile them up) and the lock is released."""
    root = os.path.join(tiny_fs, "ck")
    for attempt in range(2):
        with pytest.raises(ckpt.CheckpointError, match=r"No space left on device"):
            run_single(CLI_BASE + ["train.steps=2", f"checkpoint.dir={root}", "checkpoint.space_check=false"])
        assert os.listdir(root) == [], (attempt, os.listdir(root))


def test_a_checkpoint_dir_too_small_is_refused_at_start(tmp_path, tiny_fs):
    """checkpoint.space_check (the default): a 64 KiB checkpoint.dir for a ~125 KB checkpoint stops
    the run at start-up in one line naming both figures (exit 2), before any step and with nothing
    written there; the tests above start anyway (checkpoint.space_check=false) to reach the save."""
    root = os.path.join(tiny_fs, "ck")
    out = tmp_path / "out"
    proc = _cli(tmp_path, "train.steps=30", f"checkpoint.dir={root}", f"hydra.run.dir={out}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(f"error: checkpoint.dir {root}: rank 0's part of a checkpoint needs about "), err
    assert "kB free" in err and "checkpoint.space_check=false starts anyway" in err, err
    assert not os.path.exists(root) or os.listdir(root) in ([], ["lock.json"]), os.listdir(root)
    assert not (out / "summary.json").exists()


def test_failed_trainer_file_write_removes_the_partial_dir(tmp_path, monkeypatch):
    """An injected failure half-way through rank 0's trainer file (after the shards): same."""
    root = str(tmp_path / "ck")
    real = saver.write_file

    def half_then_fail(path: str, obj):
        if os.path.basename(path) == ckpt.TRAINER_FILE:
            with open(path, "wb") as f:
                f.write(b"x" * 1000)
            raise OSError(28, "No space left on device (injected)", path)
        return real(path, obj)

    monkeypatch.setattr(saver, "write_file", half_then_fail)
    with pytest.raises(ckpt.CheckpointError, match=r"injected"):
        run_single(CLI_BASE + ["train.steps=4", "checkpoint.every=2", f"checkpoint.dir={root}"])
    assert os.listdir(root) == []


def test_peer_lost_after_the_rename_still_names_that_checkpoint(tmp_path, monkeypatch):
    """A peer dies in a save's closing broadcast, after rank 0 renamed the checkpoint into place
    (seen in CI: the test of a killed worker killed it right when the checkpoint appeared). The
    checkpoint is complete on disk, so the failure message must offer to continue from it, not
    to start over."""
    from trainer.base.comm import CollectiveError
    from trainer.base.comm.local import LocalCollectives
    root = str(tmp_path / "ck")
    real_finish, real_bcast = ckpt.CheckpointWriter._finish, LocalCollectives.broadcast_object
    lost = {"armed": False}

    def finish(self, tmp, step, *args):
        out = real_finish(self, tmp, step, *args)
        lost["armed"] = step == 4  # the second save: the first one completes normally
        return out

    def bcast(self, obj, root=0):
        if lost["armed"]:
            raise CollectiveError("collective 'broadcast' failed on rank 0/2 (injected: the peer died)")
        return real_bcast(self, obj, root)

    monkeypatch.setattr(ckpt.CheckpointWriter, "_finish", finish)
    monkeypatch.setattr(LocalCollectives, "broadcast_object", bcast)
    with pytest.raises(CollectiveError) as err:
        run_single(CLI_BASE + ["train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=0",
                           f"checkpoint.dir={root}"])
    msg = str(err.value)
    step, path = ckpt.complete_checkpoints(root)[-1]
    assert step == 4, ckpt.complete_checkpoints(root)
    assert f"The newest complete checkpoint of this run is {os.path.abspath(path)}; to continue from it" in msg, msg
    assert f"checkpoint.resume={os.path.abspath(path)}" in msg, msg


def test_failed_save_mid_run_keeps_the_model(tmp_path, small_fs):
    """checkpoint.dir on a full 64 KiB tmpfs: the save of step 10 fails. The run stops there but
    the model in memory is saved into the output dir instead, evaluated, and summary.json says
    where it could not go and where it went; exit 2, one error line. The fallback resumes."""
    root = os.path.join(small_fs, "ck")
    out = tmp_path / "out"
    proc = _cli(tmp_path, "train.steps=30", "checkpoint.every=10", "train.log_every=1",
                f"checkpoint.dir={root}", f"hydra.run.dir={out}", "checkpoint.space_check=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    fallback = ckpt.step_dir(str(out / "checkpoints"), 10)
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error: checkpoint save of step 10 into ") and "No space left on device" in err, err
    assert f"saved instead to {fallback}" in err and str(out / "summary.json") in err, err

    summary = json.loads((out / "summary.json").read_text())
    failed = summary["checkpoint_error"]
    assert failed["step"] == 10 and failed["checkpoint_dir"] == root
    assert "No space left on device" in failed["error"]
    assert failed["fallback"] == fallback and failed["fallback_error"] is None
    assert summary["checkpoint"] == fallback and summary["end_step"] == summary["steps"] == 10
    assert summary["config"]["train"]["steps"] == 30
    assert summary["eval_auc"] is not None and summary["evals"][-1]["step"] == 10
    assert summary["samples_per_sec"] > 0 and summary["samples"] == 10 * 48
    assert [r["step"] for r in _records(out / "metrics.jsonl") if "loss" in r] == list(range(1, 11))
    assert ckpt.complete_checkpoints(str(out / "checkpoints")) == [(10, fallback)]
    assert os.listdir(root) == []  # no partial save, no lock left on the full disk

    again = _cli(tmp_path, "train.steps=30", f"checkpoint.resume={fallback}", f"checkpoint.dir={tmp_path / 'ck2'}",
                 f"hydra.run.dir={tmp_path / 'out2'}")
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert resumed["start_step"] == 10 and resumed["checkpoint"] == ckpt.step_dir(str(tmp_path / "ck2"), 30)
    assert resumed["checkpoint_error"] is None and resumed["end_step"] == 30


@pytest.mark.dist
def test_failed_save_without_another_place_still_writes_the_summary(tmp_path):
    """W = 2, checkpoints in the output dir's default place (a small tmpfs mounted there): no
    fallback (it would be the same place); every rank stops with the error, summary.json says the
    model of step 8 was not saved anywhere and still carries its evaluation."""
    out = tmp_path / "out"
    with tmpfs(out / "checkpoints") as mnt:
        # train.pipeline=ids: step 9 is prepared (its reads begun) when the save fails: dropped
        results = spawn(2, _failed_save, CLI_BASE + ["train.steps=16", "checkpoint.every=8", "train.pipeline=ids",
                                                     "checkpoint.space_check=false"],
                        str(out), timeout=180)
        for msg, _ in results:  # rank 0 names its own error; a rank whose shard was written names rank 0
            assert msg.startswith(f"checkpoint save of step 8 into {out / 'checkpoints'} failed on rank"), msg
            assert "the model of step 8 was not saved anywhere (no other place to save it: the output dir's " \
                   "checkpoints/ is checkpoint.dir itself)" in msg, msg
        # whichever rank's write found the disk full says so (the other names that rank)
        assert any("No space left on device" in msg for msg, _ in results), [m for m, _ in results]
        written = json.loads((out / "summary.json").read_text())
        assert written == json.loads(json.dumps(results[0][1]))
        failed = written["checkpoint_error"]
        assert failed["checkpoint_dir"] == str(out / "checkpoints") and failed["fallback"] is None
        assert "output dir" in failed["fallback_error"]
        assert written["checkpoint"] is None and written["end_step"] == 8 and written["eval_auc"] is not None
        assert os.listdir(mnt) == []
