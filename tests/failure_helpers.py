"""What the checkpoint, output-directory and data-error tests share: the tiny run they start (BASE with
its step counts for in-process runs, CLI_BASE for `python -m trainer` processes started by _cli),
and a few readers (their fixtures, the small file systems they fill or make read-only, a prepared
sample and a saved checkpoint, are tests/conftest.py's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable


import trainer.run.checkpoint as ckpt


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CLI_BASE = ["data=tiny", "data.global_batch_size=48", "data.test_samples=96", "data.eval_batch_size=48",
        "train.threads=1", "train.progress=off"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _command(args: tuple[str, ...]) -> list[str]:
    """`python -m trainer [-m] CLI_BASE ARGS` (Hydra's -m must come before the overrides)."""
    sweep = [a for a in args if a in ("-m", "--multirun")]
    return [sys.executable, "-m", "trainer", *sweep, *CLI_BASE, *(a for a in args if a not in sweep)]


def _cli(cwd, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_command(args), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _popen(cwd, *args: str) -> subprocess.Popen:
    """`python -m trainer` started in the background (a run that holds its directories meanwhile)."""
    return subprocess.Popen(_command(args), cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for(proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll until ready() while proc runs; fail with its stderr if it ends first, or after timeout."""
    t0 = time.monotonic()
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.05)


def _manifest(path: str) -> dict:
    with open(os.path.join(path, ckpt.MANIFEST)) as f:
        return json.load(f)


STEPS, K = 12, 5


BASE = ["data=tiny", f"train.steps={STEPS}", "data.global_batch_size=48", "data.test_samples=96",
        "data.eval_batch_size=48", "train.threads=1", "train.progress=off"]


def _dir(tmp_path, name: str) -> str:
    return str(tmp_path / name)


def _step(root: str, step: int) -> str:
    return ckpt.step_dir(root, step)
