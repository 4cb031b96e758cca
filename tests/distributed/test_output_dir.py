"""The output directory: an unusable one (read-only, full, a file as hydra.run.dir) stops every rank at
start-up with exit 2 naming it, before the data and the sparse side are built; one in use by another
run too (one run per output dir: its lock.json, taken over from a killed run); a disk that fills
during the run costs the metrics (one warning, counted in summary.json), never the training or the
final checkpoint; after a resume metrics.jsonl holds each step once and a resume line, also when
its rewrite fails. Hydra's own config errors are one error line with exit 2."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from failure_helpers import CLI_BASE, _cli, _env, _popen, _records, _wait_for
from helpers import fill, make_cfg, spawn, tmpfs

import trainer.run.checkpoint as ckpt
import trainer.run.runner as runner
from trainer.base.core.errors import TrainingError
from trainer.run.outdir import OUTPUT_DIR
from trainer.run.runner import run


def _start_error(rank: int, world: int, overrides: list[str], out_dir: str) -> str:
    """Spawned worker: one rank of a run on out_dir; returns its error (every rank must get one)."""
    try:
        run(make_cfg(list(overrides) + ["comm=torch"]), out_dir=out_dir)
    except Exception as exc:  # noqa: BLE001 - the test looks at every rank's error
        return f"{type(exc).__name__}: {exc}"
    return "no error"


TINY = ["data=tiny", "data.global_batch_size=48", "data.test_samples=96", "data.eval_batch_size=48",
        "train.threads=1", "train.progress=off", "comm=local"]


class _FailingFile:
    """A file whose writes fail with ENOSPC after `ok` successful ones (first one half-written)."""

    def __init__(self, f, ok: int) -> None:
        self.f, self.ok = f, ok

    def write(self, data) -> int:
        if self.ok == 0:
            self.f.write(bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device (injected)")
        self.ok -= 1
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.dist
def test_unwritable_output_dir_stops_every_rank_at_start(tmp_path, read_only, monkeypatch):
    """W = 2: rank 0 probes the output dir, every rank gets its verdict and stops before any
    set-up (no data built: the lock of a checkpoint.dir elsewhere is never taken)."""
    root = str(tmp_path / "ck")
    for out in (os.path.join(read_only, "out"), os.path.join(read_only, "new", "run")):
        errors = spawn(2, _start_error, CLI_BASE + ["train.steps=4", f"checkpoint.dir={root}"], out, timeout=120)
        for err in errors:
            assert err.startswith(f"TrainingError: output dir {out} ") and "Read-only file system" in err, err
        assert not os.path.exists(root)  # stopped before the checkpoint dir was even locked

    # W = 1, in process: make_data is never reached
    def no_data(*a, **k):
        raise AssertionError("the data was built before the output dir was checked")

    monkeypatch.setattr(runner, "make_data", no_data)
    with pytest.raises(TrainingError, match=r"output dir .*/ro/out is not writable"):
        run(make_cfg(CLI_BASE + ["comm=local", "train.steps=4"]), out_dir=os.path.join(read_only, "out"))


def test_full_output_dir_is_refused_by_the_command(tmp_path, small_fs):
    """The command on an output dir with no space left: exit 2 naming it, no traceback, no step."""
    fill(small_fs)
    out = os.path.join(small_fs, "run")
    os.makedirs(out)  # a directory costs no data page; any file written into it does
    proc = _cli(tmp_path, "train.steps=4", f"hydra.run.dir={out}", "hydra.output_subdir=null",
                f"checkpoint.dir={tmp_path / 'ck'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: output dir {out} is not writable"), proc.stderr
    assert "No space left on device" in proc.stderr
    assert sorted(os.listdir(out)) == [] and not (tmp_path / "ck").exists()


def test_output_disk_full_mid_run_command_ends_with_one_error_line(tmp_path, small_fs):
    """The command, with TensorBoard on (the default), on an output dir with a few pages left:
    TensorBoard's writer, the metrics log and summary.json each fail in turn; training and the
    final checkpoint (elsewhere) complete, each failure is one warning (no thread traceback), the
    summary goes to stdout and the run exits 2 naming summary.json."""
    fill(small_fs, leave=16384)
    out, root = os.path.join(small_fs, "run"), str(tmp_path / "ck")
    proc = _cli(tmp_path, "train.steps=60", "train.log_every=1", f"hydra.run.dir={out}", "hydra.output_subdir=null",
                f"checkpoint.dir={root}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    plan, *lines = proc.stderr.strip().splitlines()  # the memory plan first (trainer/run/resolve/memplan.py)
    assert plan.startswith("[trainer] memory plan, rank 0/1: "), proc.stderr
    assert lines[-1] == f"error: {out}/summary.json: No space left on device", proc.stderr
    assert sum("TensorBoard events in" in line for line in lines) == 1, proc.stderr
    assert len(lines) == 4, proc.stderr  # TensorBoard, metrics.jsonl, summary.json warnings + the error
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["end_step"] == 60 and summary["checkpoint"] == ckpt.step_dir(root, 60)


def test_hydra_run_dir_that_is_a_file_or_read_only(tmp_path, read_only_path):
    (tmp_path / "afile").write_text("x")
    for where, needle in ((tmp_path / "afile", "is a file, not a directory"),
                          (tmp_path / "afile" / "sub", "is a file, not a directory"),
                          (read_only_path / "inside", "is read-only"),
                          (read_only_path / "new" / "run", "cannot be created")):
        proc = subprocess.run([sys.executable, "-m", "trainer", f"hydra.run.dir={where}"], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.startswith(f"error: hydra.run.dir={where}: ") and needle in proc.stderr, proc.stderr


def test_full_disk_under_the_output_dir_does_not_stop_training(tmp_path, capfd):
    """metrics.jsonl on a full tmpfs: one warning, training and the final checkpoint (elsewhere)
    complete, metrics.jsonl holds whole lines only; summary.json cannot be written either, so
    the run ends with that error, the summary (saying how many records were lost) on stdout."""
    out = tmp_path / "out"
    with tmpfs(out):
        fill(out, leave=12288)  # three pages left: the output dir's lock.json takes one
        root = str(tmp_path / "ck")
        with pytest.raises(OSError, match="No space left on device"):
            run(make_cfg(TINY + ["train.steps=60", "train.log_every=1", f"checkpoint.dir={root}"]),
                out_dir=str(out))
        captured = capfd.readouterr()
        assert captured.err.count("warning: cannot write") == 2  # metrics once, summary once
        assert captured.err.count("warning: TensorBoard events in") == 1  # and TensorBoard once
        assert ckpt.latest(root) == ckpt.step_dir(root, 60)  # trained to the end and saved
        lines = (out / "metrics.jsonl").read_text().splitlines()
        assert 0 < len(lines) < 60 and all(json.loads(line)["step"] for line in lines)
        summary = json.loads(captured.out.strip().splitlines()[-1])
        assert summary["steps"] == 60 and summary["checkpoint"] == ckpt.step_dir(root, 60)
        log = summary["metrics_log"]
        assert "No space left on device" in log["error"] and log["records_written"] == len(lines)
        assert log["records_lost"] == 60 + 1 - len(lines)  # 60 step records + the final eval
        assert not [n for n in os.listdir(out) if n.startswith("summary.json")]


def test_metrics_failure_is_reported_in_the_summary(tmp_path, monkeypatch):
    import trainer.run.report.writers as writers
    real_open = open

    def failing_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return _FailingFile(f, 3) if str(path).endswith("metrics.jsonl") else f

    monkeypatch.setattr(writers, "open", failing_open, raising=False)
    res = run(make_cfg(TINY + ["train.steps=10", "train.log_every=1"]), out_dir=str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics_log"] == res.summary["metrics_log"]
    assert summary["metrics_log"]["records_written"] == 3 and summary["metrics_log"]["records_lost"] == 8
    assert "injected" in summary["metrics_log"]["error"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # the half line was cut off


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    """A run of 30 steps (evals every 5, saves every 10) is resumed from step_20 into the same
    output dir, as after a crash at step 30: the records after step 20 (and a line cut by the
    crash) are dropped, a resume line follows, then the resumed run's own records."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")
    args = CLI_BASE + ["comm=local", "train.steps=30", "train.log_every=1", "train.eval_every=5",
                   "checkpoint.every=10", "checkpoint.keep_last=0", f"checkpoint.dir={root}"]
    run(make_cfg(args), out_dir=out)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 31, "loss": 0.')  # a line cut short by a kill
    path = ckpt.step_dir(root, 20)
    run(make_cfg(args + [f"checkpoint.resume={path}"]), out_dir=out)
    recs = _records(os.path.join(out, "metrics.jsonl"))
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == list(range(1, 31))
    evals = [r["step"] for r in recs if r.get("event") == "eval"]
    assert evals == [5, 10, 15, 20, 25, 30]
    at = recs.index({"event": "resume", "from": path, "step": 20, "saved_world_size": 1, "world_size": 1})
    assert [r.get("step") for r in recs[at - 2:at + 2]] == [20, 20, 20, 21]  # step 20, its eval, resume, 21
    assert not [n for n in os.listdir(out) if n.startswith("metrics.jsonl.")]  # no temporary file left


def test_metrics_rewrite_that_fails_keeps_the_log_and_marks_the_resume(tmp_path, monkeypatch, capfd):
    """The rewrite cannot replace the file (a failing disk): the old log stays whole, one warning,
    and the resume line still marks where the resumed run's records begin."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")
    args = CLI_BASE + ["comm=local", "train.steps=6", "train.log_every=1", "checkpoint.every=3", f"checkpoint.dir={root}"]
    run(make_cfg(args), out_dir=out)
    before = open(os.path.join(out, "metrics.jsonl")).read()
    real = os.replace  # what trainer/base/core/atomic.py renames the rewritten log with

    def failing_replace(src, dst):
        if str(dst).endswith("metrics.jsonl"):
            raise OSError(28, "No space left on device (injected)", str(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    capfd.readouterr()
    run(make_cfg(args + [f"checkpoint.resume={ckpt.step_dir(root, 3)}"]), out_dir=out)
    err = capfd.readouterr().err
    assert err.count("cannot rewrite") == 1 and "injected" in err, err
    after = open(os.path.join(out, "metrics.jsonl")).read()
    assert after.startswith(before)
    recs = [json.loads(x) for x in after[len(before):].splitlines()]
    assert recs[0] == {"event": "resume", "from": ckpt.step_dir(root, 3), "step": 3, "saved_world_size": 1, "world_size": 1}
    assert [r["step"] for r in recs[1:] if "loss" in r] == [4, 5, 6]
    assert not [n for n in os.listdir(out) if n.startswith("metrics.jsonl.")]


def _tree(path) -> dict[str, bytes]:
    """Every file under path (relative name -> bytes)."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), path)] = fh.read()
    return out


def test_second_run_in_an_output_dir_is_refused_and_a_killed_runs_dir_is_taken_over(tmp_path):
    """The issue's reproduction: run A trains in hydra.run.dir=out; run B, given the same
    hydra.run.dir and its own checkpoint.dir, exits 2 naming the directory and A, before it writes
    anything: every byte under out (A's metrics.jsonl, its .hydra record, lock.json; no
    summary.json) is as it was, and B never reached its checkpoint dir. A is then killed; run C
    with checkpoint.resume=auto in the same out takes the dead run's lock over (a warning), resumes
    from A's checkpoint and ends with each step once in metrics.jsonl and its own .hydra record."""
    out, ck_a, ck_b = tmp_path / "out", str(tmp_path / "ckA"), tmp_path / "ckB"
    a = _popen(tmp_path, "train.steps=100000", "train.log_every=1", "checkpoint.every=10", f"checkpoint.dir={ck_a}",
               f"hydra.run.dir={out}")
    try:
        _wait_for(a, lambda: ckpt.complete_checkpoints(ck_a), "run A wrote no checkpoint")
        a.send_signal(signal.SIGSTOP)  # A holds out and stands still: its files must not change
        holder = json.loads((out / ckpt.LOCK).read_text())
        before = _tree(out)
        assert holder["pid"] == a.pid and ".hydra/overrides.yaml" in before and "metrics.jsonl" in before
        b = _cli(tmp_path, "train.steps=20", f"checkpoint.dir={ck_b}", f"hydra.run.dir={out}")
        assert b.returncode == 2 and "Traceback" not in b.stderr, b.stderr[-3000:]
        lines = b.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: output dir {out} is in use by run {holder['run_id']} (pid {a.pid} on "
                                    f"host {socket.gethostname()}") and "hydra.run.dir" in lines[-1], b.stderr
        assert sum(line.startswith("error:") for line in lines) == 1, b.stderr
        assert _tree(out) == before and not ck_b.exists()
    finally:
        a.send_signal(signal.SIGKILL)  # a killed run: no clean-up, its locks stay
        a.communicate()
    step = ckpt.read_manifest(ckpt.latest(ck_a))["step"]
    c = _cli(tmp_path, f"train.steps={step + 5}", "train.log_every=1", "checkpoint.every=10",
             f"checkpoint.dir={ck_a}", "checkpoint.resume=auto", f"hydra.run.dir={out}")
    assert c.returncode == 0, c.stderr[-3000:]
    assert f"output dir {out}: took over the lock of run {holder['run_id']} (pid {a.pid}" in c.stderr, c.stderr
    steps = [r["step"] for r in _records(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, step + 6))
    assert "checkpoint.resume=auto" in (out / ".hydra" / "overrides.yaml").read_text()
    assert json.loads((out / "summary.json").read_text())["start_step"] == step
    assert not (out / ckpt.LOCK).exists()  # released at the end of C


@pytest.mark.dist
def test_output_dir_in_use_stops_every_rank_at_start(tmp_path, monkeypatch):
    """W = 2: only rank 0 takes the output dir's lock; its refusal reaches rank 1 too, before the
    checkpoint dir is locked (the data and the sparse side come later still), and the holder's
    directory keeps only its lock."""
    out, root = str(tmp_path / "out"), str(tmp_path / "ck")
    held = ckpt.DirLock(out, "0123456789ab", OUTPUT_DIR)  # held by this test process, which lives on
    held.acquire()
    try:
        errors = spawn(2, _start_error, CLI_BASE + ["train.steps=4", f"checkpoint.dir={root}"], out, timeout=120)
        for err in errors:
            assert err.startswith(f"TrainingError: output dir {out} is in use by run 0123456789ab "
                                  f"(pid {os.getpid()} on host"), err
        assert os.listdir(out) == [ckpt.LOCK] and not os.path.exists(root)
    finally:
        held.release()
    assert not os.listdir(out)


def test_hydra_config_errors_are_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    """The command (cli, in this process) on an unknown option of a config group, an unknown key, a
    malformed override (or a hydra.output_subdir that would make Hydra write before the run holds
    its dir): one `error:` line naming it and exit 2, nothing written, sys.argv and the environment
    as they were; with HYDRA_FULL_ERROR=1, Hydra's own exception as before."""
    from hydra.errors import MissingConfigException

    from trainer.__main__ import cli

    out = tmp_path / "out"
    models = ", ".join(sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf", "model"))))
    assert "dlrm" in models and "wdl" in models
    cases = [("model=nosuch", f"Could not find 'model/nosuch'; Available options in 'model': {models}"),
             ("nosuch.key=1", "Could not override 'nosuch.key'. To append to your config use +nosuch.key=1"),
             ("train.steps=[1", "train.steps=[1: no viable alternative at input '[1'"),
             ("hydra.output_subdir=.h", "hydra.output_subdir=.h: the trainer writes the run's record into .hydra/")]
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for bad, says in cases:
        argv = ["trainer", bad, f"hydra.run.dir={out}"]
        monkeypatch.setattr(sys, "argv", list(argv))
        with pytest.raises(SystemExit) as exit_:
            cli()
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (bad, captured.err)
        assert says in lines[0] and not captured.out, (bad, captured.err)
        assert sys.argv == argv and "HYDRA_FULL_ERROR" not in os.environ
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["trainer", "model=nosuch", f"hydra.run.dir={out}"])
    with pytest.raises(MissingConfigException, match="Could not find 'model/nosuch'"):
        cli()
    assert not out.exists()
