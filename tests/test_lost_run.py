"""Nothing lost, ever (issue 18), the run's side: an unusable output dir or checkpoint.dir stops
every rank at start-up (exit 2 naming the dir, before the data and the sparse side are built); a
save that fails mid-run (a real full tmpfs) keeps the model still in memory: a fallback save into
the output dir, an evaluation and summary.json with `checkpoint_error`, then exit 2; a resume at the
final step reports null rates instead of a division by ~0; after a resume metrics.jsonl holds each
step once (the interrupted run's records after the checkpoint are dropped) and a resume line.

The relaunch command printed after a killed worker is tested in test_worker_failure.py."""
from __future__ import annotations

import json
import os
import sys

import pytest

import trainer.checkpoint as ckpt
import trainer.relaunch as relaunch
import trainer.runner as runner
from helpers import fill, make_cfg, run_single, spawn, tmpfs
from trainer.build import TrainingError
from trainer.runner import run

from test_lost_checkpoint import BASE, ROOT, _cli, _env  # noqa: F401 (the same command-line runs)


@pytest.fixture
def small_fs(tmp_path):
    with tmpfs(tmp_path / "small") as mnt:
        yield mnt


@pytest.fixture
def read_only(tmp_path):
    """A read-only directory (a tmpfs remounted ro: root ignores permission bits)."""
    with tmpfs(tmp_path / "ro", dirs=("out",), read_only=True) as mnt:
        yield mnt


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------- start-up checks
def _start_error(rank: int, world: int, overrides: list[str], out_dir: str) -> str:
    """Spawned worker: one rank of a run on out_dir; returns its error (every rank must get one)."""
    try:
        run(make_cfg(list(overrides) + ["comm=torch"]), out_dir=out_dir)
    except Exception as exc:  # noqa: BLE001 - the test looks at every rank's error
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.dist
def test_unwritable_output_dir_stops_every_rank_at_start(tmp_path, read_only, monkeypatch):
    """W = 2: rank 0 probes the output dir, every rank gets its verdict and stops before any
    set-up (no data built: the lock of a checkpoint.dir elsewhere is never taken)."""
    root = str(tmp_path / "ck")
    for out in (os.path.join(read_only, "out"), os.path.join(read_only, "new", "run")):
        errors = spawn(2, _start_error, BASE + ["train.steps=4", f"checkpoint.dir={root}"], out, timeout=120)
        for err in errors:
            assert err.startswith(f"TrainingError: output dir {out} ") and "Read-only file system" in err, err
        assert not os.path.exists(root)  # stopped before the checkpoint dir was even locked

    # W = 1, in process: make_data is never reached
    def no_data(*a, **k):
        raise AssertionError("the data was built before the output dir was checked")

    monkeypatch.setattr(runner, "make_data", no_data)
    with pytest.raises(TrainingError, match=r"output dir .*/ro/out is not writable"):
        run(make_cfg(BASE + ["comm=local", "train.steps=4"]), out_dir=os.path.join(read_only, "out"))


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
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == f"error: {out}/summary.json: No space left on device", proc.stderr
    assert sum("TensorBoard events in" in line for line in lines) == 1, proc.stderr
    assert len(lines) == 4, proc.stderr  # TensorBoard, metrics.jsonl, summary.json warnings + the error
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["end_step"] == 60 and summary["checkpoint"] == ckpt.step_dir(root, 60)


def test_unwritable_checkpoint_dir_is_refused_before_the_sparse_side_is_built(tmp_path, read_only, monkeypatch):
    """checkpoint.dir read-only (or a file): the lock cannot be created; that is found before the
    data and the placement planning (build_sparse) run."""
    (tmp_path / "afile").write_text("x")

    def no_build(*a, **k):
        raise AssertionError("the sparse side was built before the checkpoint dir was checked")

    monkeypatch.setattr(runner, "build_sparse", no_build)
    monkeypatch.setattr(runner, "make_data", no_build)
    for root, needle in ((os.path.join(read_only, "out"), "Read-only file system"),
                         (str(tmp_path / "afile" / "ck"), "Not a directory")):
        with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint\.dir {root} .*{needle}"):
            run(make_cfg(BASE + ["comm=local", "train.steps=4", f"checkpoint.dir={root}"]),
                out_dir=str(tmp_path / "out"))


# ---------------------------------------------------------------------------- a save that fails
def test_failed_save_mid_run_keeps_the_model(tmp_path, small_fs):
    """checkpoint.dir on a full 64 KiB tmpfs: the save of step 10 fails. The run stops there but
    the model in memory is saved into the output dir instead, evaluated, and summary.json says
    where it could not go and where it went; exit 2, one error line. The fallback resumes."""
    root = os.path.join(small_fs, "ck")
    out = tmp_path / "out"
    proc = _cli(tmp_path, "train.steps=30", "checkpoint.every=10", "train.log_every=1",
                f"checkpoint.dir={root}", f"hydra.run.dir={out}")
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


def _failed_save(rank: int, world: int, overrides: list[str], out_dir: str):
    try:
        run(make_cfg(list(overrides) + ["comm=torch"]), out_dir=out_dir)
    except ckpt.CheckpointError as exc:
        return str(exc), getattr(exc, "summary", None)
    return "no error", None


@pytest.mark.dist
def test_failed_save_without_another_place_still_writes_the_summary(tmp_path):
    """W = 2, checkpoints in the output dir's default place (a small tmpfs mounted there): no
    fallback (it would be the same place); every rank stops with the error, summary.json says the
    model of step 8 was not saved anywhere and still carries its evaluation."""
    out = tmp_path / "out"
    with tmpfs(out / "checkpoints") as mnt:
        # train.pipeline=ids: step 9 is prepared (its reads begun) when the save fails: dropped
        results = spawn(2, _failed_save, BASE + ["train.steps=16", "checkpoint.every=8", "train.pipeline=ids"],
                        str(out), timeout=180)
        for msg, _ in results:  # rank 0 names its own error; a rank whose shard was written names rank 0
            assert msg.startswith(f"checkpoint save of step 8 into {out / 'checkpoints'} failed on rank"), msg
            assert "the model of step 8 was not saved anywhere (no other place to save it: the output dir's " \
                   "checkpoints/ is checkpoint.dir itself)" in msg, msg
        assert "No space left on device" in results[0][0]
        written = json.loads((out / "summary.json").read_text())
        assert written == json.loads(json.dumps(results[0][1]))
        failed = written["checkpoint_error"]
        assert failed["checkpoint_dir"] == str(out / "checkpoints") and failed["fallback"] is None
        assert "output dir" in failed["fallback_error"]
        assert written["checkpoint"] is None and written["end_step"] == 8 and written["eval_auc"] is not None
        assert os.listdir(mnt) == []


# ---------------------------------------------------------------------------- summary figures
def test_resume_at_the_final_step_reports_null_rates(tmp_path):
    """Nothing trained: samples/s and per-sample figures are null, not a division by ~0, and the
    summary has the same keys as a run that trained."""
    root = str(tmp_path / "ck")
    first = run_single(BASE + ["train.steps=4", f"checkpoint.dir={root}"], return_state=False).summary
    again = run(make_cfg(BASE + ["comm=local", "train.steps=4", f"checkpoint.resume={ckpt.step_dir(root, 4)}",
                                 f"checkpoint.dir={tmp_path / 'ck2'}"]), out_dir=str(tmp_path / "out")).summary
    assert again["start_step"] == 4 and again["end_step"] == 4
    assert again["samples_per_sec"] is None and again["train_time_s"] == 0
    assert again["bytes_per_sample"] is None and again["embedding_bytes_per_sample"] is None
    assert set(again["bytes_per_sample_by_kind"]) == set(first["bytes_per_sample_by_kind"])
    assert all(v is None for v in again["bytes_per_sample_by_kind"].values())
    assert all(v is None for k, v in again["embedding"].items() if k.endswith("_per_step"))
    assert set(again) == set(first) and again["eval_auc"] == pytest.approx(first["eval_auc"])
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["samples_per_sec"] is None


# ---------------------------------------------------------------------------- metrics.jsonl
def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
    """A run of 30 steps (evals every 5, saves every 10) is resumed from step_20 into the same
    output dir, as after a crash at step 30: the records after step 20 (and a line cut by the
    crash) are dropped, a resume line follows, then the resumed run's own records."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")
    args = BASE + ["comm=local", "train.steps=30", "train.log_every=1", "train.eval_every=5",
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
    at = recs.index({"event": "resume", "from": path, "step": 20})
    assert [r.get("step") for r in recs[at - 2:at + 2]] == [20, 20, 20, 21]  # step 20, its eval, resume, 21
    assert not [n for n in os.listdir(out) if n.startswith("metrics.jsonl.")]  # no temporary file left


def test_metrics_rewrite_that_fails_keeps_the_log_and_marks_the_resume(tmp_path, monkeypatch, capfd):
    """The rewrite cannot replace the file (a failing disk): the old log stays whole, one warning,
    and the resume line still marks where the resumed run's records begin."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")
    args = BASE + ["comm=local", "train.steps=6", "train.log_every=1", "checkpoint.every=3", f"checkpoint.dir={root}"]
    run(make_cfg(args), out_dir=out)
    before = open(os.path.join(out, "metrics.jsonl")).read()
    import trainer.report as report
    real = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith("metrics.jsonl"):
            raise OSError(28, "No space left on device (injected)", str(src))
        return real(src, dst)

    monkeypatch.setattr(report.os, "replace", failing_replace)
    capfd.readouterr()
    run(make_cfg(args + [f"checkpoint.resume={ckpt.step_dir(root, 3)}"]), out_dir=out)
    err = capfd.readouterr().err
    assert err.count("cannot rewrite") == 1 and "injected" in err, err
    after = open(os.path.join(out, "metrics.jsonl")).read()
    assert after.startswith(before)
    recs = [json.loads(x) for x in after[len(before):].splitlines()]
    assert recs[0] == {"event": "resume", "from": ckpt.step_dir(root, 3), "step": 3}
    assert [r["step"] for r in recs[1:] if "loss" in r] == [4, 5, 6]
    assert not [n for n in os.listdir(out) if n.startswith("metrics.jsonl.")]


# ---------------------------------------------------------------------------- the relaunch command
def _hydra_values(tokens: list[str]) -> dict[str, str]:
    """Override tokens as Hydra parses them and OmegaConf then resolves the values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf
    parsed = OverridesParser.create().parse_overrides(tokens)
    return {o.key_or_group: OmegaConf.create({"v": o.value()}).v for o in parsed}


def test_relaunch_command_replaces_the_run_dirs_and_quotes_paths(monkeypatch, tmp_path):
    """The command of a plain run (no launcher above it): this process's command line, any
    checkpoint.resume / checkpoint.dir / hydra.run.dir (also with + or ++) replaced by the absolute
    ones given; paths with spaces, commas, quotes, backslashes and ${ survive the shell, Hydra's
    parser and OmegaConf."""
    args = ["data=tiny", "+checkpoint.resume=auto", "optim.lr=0.5", "++checkpoint.dir=old",
            "hydra.run.dir=outputs/x"]
    monkeypatch.setattr(sys, "argv", ["/somewhere/trainer/__main__.py", *args])
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "-u", "-m", "trainer", *args])
    cwd = tmp_path / "launch dir"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    odd = str(tmp_path / "a b,c'd\\e${f}")
    cmd = relaunch.relaunch_command(f"{odd}/ck/step_00000010", f"{odd}/ck", odd, size=2)
    import shlex
    tokens = shlex.split(cmd)
    assert tokens[:4] == ["cd", str(cwd), "&&", "/venv/bin/python"]
    assert tokens[4:11] == ["-u", "-m", "trainer", "data=tiny", "optim.lr=0.5", tokens[9], tokens[10]]
    assert _hydra_values(tokens[9:]) == {"checkpoint.resume": f"{odd}/ck/step_00000010",
                                         "checkpoint.dir": f"{odd}/ck", "hydra.run.dir": odd}
    monkeypatch.chdir(tmp_path)
    plain = relaunch.relaunch_command(None, "ck", "out", size=1)  # no checkpoint yet: no resume
    assert plain == f"cd {tmp_path} && /venv/bin/python -u -m trainer data=tiny optim.lr=0.5 " \
                    f"checkpoint.dir={tmp_path}/ck hydra.run.dir={tmp_path}/out"


def test_relaunch_command_of_a_sweep_job_is_that_job_alone(monkeypatch, tmp_path):
    """A job of a Hydra sweep (-m): -m and the sweep's values go, this job's values come in."""
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    args = ["-m", "data=tiny", "optim.lr=0.1,0.5", "hydra.sweep.dir=ms", "hydra/job_logging=stdout"]
    monkeypatch.setattr(sys, "argv", ["/somewhere/trainer/__main__.py", *args])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "trainer", *args])
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(
        lambda: SimpleNamespace(overrides=SimpleNamespace(task=["data=tiny", "optim.lr=0.5"]))))
    monkeypatch.chdir(tmp_path)
    cmd = relaunch.relaunch_command("/ck/step_00000004", "/ck", "/ms/1")
    assert cmd == (f"cd {tmp_path} && python -m trainer hydra/job_logging=stdout data=tiny optim.lr=0.5 "
                   "checkpoint.resume=/ck/step_00000004 checkpoint.dir=/ck hydra.run.dir=/ms/1")
