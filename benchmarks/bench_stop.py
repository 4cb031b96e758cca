"""How long a stop request takes to end a run, by the phase it arrives in: one JSON line per phase.

A scheduler's grace (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds, torchrun's
TORCH_ELASTIC_SHUTDOWN_TIMEOUT) must cover the time from its SIGTERM to the trainer's exit
(docs/operations.md, "Preemption"). This runs `python -m trainer` (W = 1, or torchrun W = 2 with
--world 2) on a workload and sends SIGTERM in each phase:

    startup  as the sparse side is built (after the memory plan's line: the shard's rows, FAE's
             profile with placement=fae), then the first step and the stop's save
    resume   as a run resuming a checkpoint of the same workload begins its load ("resuming from")
    step     after step 3 (the step boundary, then the stop's save)
    eval     as the evaluation after step 5 begins (train.eval_every=5): it ends within a batch
    save     as a save begins (checkpoint.every=5; the one after step 5 unless it ended between two
             looks): the save finishes first, the stop comes after the next step

Each line: the phase, seconds from the signal to the process's exit, its exit status, the step it
stopped at and whether that checkpoint is complete; in the save phase also `save_step`, the step of
the save the signal arrived in.

    python -m benchmarks.bench_stop                        # the bench workload, every phase
    python -m benchmarks.bench_stop --world 2 --phases step eval save
    python -m benchmarks.bench_stop --phases startup -- placement=fae

Positional arguments after `--` are trainer overrides added to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from trainer.run.checkpoint.manifest import WORK_DIR

PHASES = ("startup", "resume", "step", "eval", "save")
BASE = ["train.progress=off", "train.log_every=1", "train.tensorboard=false"]


def log(msg: str) -> None:
    print(f"[bench_stop] {msg}", file=sys.stderr, flush=True)


def _command(world: int, args: list[str]) -> list[str]:
    """The trainer alone, or torchrun under the job wrapper (its exit status: the job's)."""
    if world == 1:
        return [sys.executable, "-m", "trainer", *args]
    return [sys.executable, "-m", "trainer.run.job", "--", sys.executable, "-m", "torch.distributed.run",
            "--standalone", "--nproc_per_node", str(world), "-m", "trainer", "comm=torch", *args]


def trained_steps(out: str) -> int:
    """Steps the run in output dir `out` has written to metrics.jsonl so far (0: none yet)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return sum(1 for line in f if '"loss"' in line)
    except OSError:
        return 0


def _saving(root: str) -> int | None:
    """The step of a save under way in checkpoint dir `root` (its `step_K.tmp-...` directory), or None."""
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = [int(m["step"]) for m in map(WORK_DIR.match, names) if m and m["kind"] == "tmp"]
    return steps[0] if steps else None


def measure(phase: str, world: int, extra: list[str], work: str, timeout: float) -> dict:
    """One run, signalled in `phase`; its line."""
    out = os.path.join(work, f"{phase}-w{world}")
    root = os.path.join(out, "checkpoints")
    args = BASE + ["train.steps=100000", f"hydra.run.dir={out}", f"checkpoint.dir={root}"]
    ready: Callable[[], bool]
    saving: list[int | None] = [None]  # the save phase: the step of the save the signal arrives in
    if phase == "resume":
        log("resume: a first run saves step 3")
        first = subprocess.run(_command(world, BASE + ["train.steps=3", f"hydra.run.dir={out}-first",
                                                       f"checkpoint.dir={root}", *extra]),
                               capture_output=True, text=True, timeout=timeout)
        if first.returncode != 0:
            raise RuntimeError(f"the run to resume failed: {first.stderr[-2000:]}")
        args += ["checkpoint.resume=auto"]
    if phase == "eval":
        args += ["train.eval_every=5"]
        ready = lambda: trained_steps(out) >= 5  # noqa: E731 - the evaluation follows step 5's line
    elif phase == "save":
        args += ["checkpoint.every=5"]

        def ready() -> bool:
            saving[0] = _saving(root)
            return saving[0] is not None
    elif phase == "step":
        ready = lambda: trained_steps(out) >= 3  # noqa: E731
    else:  # startup, resume: a line the trainer prints as the phase begins
        marker = "resuming from" if phase == "resume" else "memory plan"
        ready = lambda: any(marker in line for line in lines)  # noqa: E731
    proc = subprocess.Popen(_command(world, args + extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    t0 = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{phase}: the run ended before its phase: {''.join(lines)[-2000:]}")
        if time.monotonic() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{phase}: not reached within {timeout} s")
        time.sleep(0.01)
    t_signal = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler signals a job: the launcher and its workers
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"{phase}: no exit within {timeout} s of the signal") from None
    took = time.monotonic() - t_signal
    reader.join(timeout=10)
    err = "".join(lines)
    try:
        with open(os.path.join(out, "summary.json")) as f:
            stopped = json.load(f).get("stopped") or {}
    except (OSError, ValueError):
        stopped = {}
    ckpt = stopped.get("checkpoint")
    return {"phase": phase, "world": world, "signal_to_exit_s": round(took, 2), "exit_status": proc.returncode,
            "stopped_at": stopped.get("step"), "checkpoint_complete": bool(ckpt and os.path.isfile(
                os.path.join(ckpt, "manifest.json"))), **({"save_step": saving[0]} if phase == "save" else {}),
            "overrides": extra, "stderr_tail": err.strip()[-200:]
            if proc.returncode not in (143, 0) else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_stop", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    ap.add_argument("--world", type=int, choices=(1, 2), default=1,
                    help="1: the trainer alone; 2: torchrun under trainer.run.job")
    ap.add_argument("--data", default="bench", help="the data preset (default bench)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to reach a phase, and to exit after it")
    ap.add_argument("overrides", nargs="*", help="trainer overrides (after --)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-stop-") as work:
        for phase in a.phases:
            log(f"{phase}: W = {a.world}")
            print(json.dumps(measure(phase, a.world, [f"data={a.data}", *a.overrides], work, a.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
