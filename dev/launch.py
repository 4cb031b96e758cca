"""Command lines that start the trainer (or any Python program) on W workers of one machine or of
several: with no launcher (W = 1), under torchrun (comm=torch) or under horovodrun (comm=horovod).
The benchmarks, the dev harnesses and the tests build their runs with these, so a launcher's options
are written once (beside the package, not in it: no user command needs them).

    trainer_command(2, ["data=tiny"], "torchrun")
    -> [python, -m, torch.distributed.run, --standalone, --nproc_per_node, 2, -m, trainer, comm=torch, data=tiny]

torchrun is run as `python -m torch.distributed.run` (the same thing as the `torchrun` script, without
depending on where that script was installed) and horovodrun through the interpreter too, from the
directory of that interpreter (a virtual environment's bin/), so a relocated venv still works.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Mapping, Optional, Sequence

LAUNCHERS = ("local", "torchrun", "horovodrun")
BACKEND = {"local": None, "torchrun": "torch", "horovodrun": "horovod"}  # the comm= each launcher needs
STANDALONE = ("--standalone",)  # torchrun's rendezvous on this machine alone

# The repository root: the working directory of every run the benchmarks and the dev harnesses
# start (their own commands run from it too: `python -m benchmarks.bench_train`). The workers are
# modules (`python -m benchmarks.phases`, `torchrun ... -m benchmarks.bench_comm`), and `-m` looks
# for a module first in the working directory; benchmarks/ and dev/ are never installed, so the root
# is the one place they import from. The working directory, not PYTHONPATH, since every launcher
# keeps it (torchrun's workers inherit it, `ip netns exec` keeps it, horovodrun's gloo launcher cds
# to it on every host, over ssh too), it does not leak into what the workers start, and, searched
# first, it gives the workers this checkout's trainer/ even where the venv's editable install points
# at another checkout (a git worktree). The paths handed to the workers are absolute.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def horovodrun_path(python: str = sys.executable) -> str:
    """The horovodrun script installed beside the interpreter `python`."""
    return os.path.join(os.path.dirname(python), "horovodrun")


def launch_command(launcher: str, nproc: int, command: Sequence[str], launcher_args: Sequence[str] = (),
                   python: Optional[str] = None) -> list[str]:
    """argv that runs `command` (one worker's argv, a Python interpreter first) as `nproc` workers
    under `launcher` (LAUNCHERS; local: the command itself, nproc must be 1).

    launcher_args: torchrun's rendezvous options (default --standalone), e.g. --nnodes N
    --node_rank k --master_addr A --master_port P (nproc is then the workers of this node);
    horovodrun's hosts and options (default -H localhost:nproc), e.g. -H h0:1,h1:1 -p 22.
    python: the interpreter that runs horovodrun (default: the command's)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if nproc < 1:
        raise ValueError(f"{nproc} workers: must be >= 1")
    if not command:
        raise ValueError("no command to launch")
    if launcher == "local":
        if nproc != 1:
            raise ValueError(f"launcher local runs one worker, not {nproc} (use torchrun or horovodrun)")
        return list(command)
    python = python or command[0]
    if launcher == "torchrun":  # torchrun starts the workers with its own interpreter: the command's
        return [command[0], "-m", "torch.distributed.run", *(launcher_args or STANDALONE),
                "--nproc_per_node", str(nproc), *command[1:]]
    return [python, horovodrun_path(python), "-np", str(nproc),
            *(launcher_args or ("-H", f"localhost:{nproc}")), "--gloo", *command]


def names_group(overrides: Sequence[str], group: str) -> bool:
    """Whether an override selects config group `group` (comm=torch, +comm=..., ~comm)."""
    return any(o.split("=", 1)[0].lstrip("+~") == group for o in overrides)


def resolve_launcher(world: int, launcher: str = "auto") -> str:
    """auto: local at W = 1, torchrun above; any other launcher stands."""
    return ("local" if world == 1 else "torchrun") if launcher == "auto" else launcher


def worker_overrides(launcher: str, overrides: Sequence[str]) -> list[str]:
    """The overrides every worker gets under `launcher`: the matching backend (comm=torch under
    torchrun, comm=horovod under horovodrun) first, unless an override chooses comm itself."""
    backend = BACKEND.get(launcher)
    if backend is None or names_group(overrides, "comm"):
        return list(overrides)
    return [f"comm={backend}", *overrides]


def trainer_command(world: int, overrides: Sequence[str], launcher: str = "auto", python: str = sys.executable,
                    module: str = "trainer", launcher_args: Sequence[str] = ()) -> list[str]:
    """argv of `python -m trainer <overrides>` on `world` workers (resolve_launcher, worker_overrides).
    module: what runs instead of trainer with the same arguments (benchmarks.phases: the trainer
    with timers around the step's phases)."""
    launcher = resolve_launcher(world, launcher)
    return launch_command(launcher, world, [python, "-m", module, *worker_overrides(launcher, overrides)],
                          launcher_args)


def check_trainer(world: int, overrides: Sequence[str], launcher: str = "auto") -> None:
    """Compose and validate the config the workers of trainer_command(world, overrides, launcher)
    would start from, without starting them: a bad override or value raises here (ConfigError,
    Hydra's errors: trainer.tools.cli.input_errors) instead of in every launched worker."""
    from trainer.base.config import validate_world
    from trainer.run.resolve.configure import compose_config

    if world < 1:
        raise ValueError(f"{world} workers: must be >= 1")
    launcher = resolve_launcher(world, launcher)
    validate_world(compose_config(worker_overrides(launcher, overrides), world), world)


def run_trainer(argv: Sequence[str], out_dir: str, cwd: Optional[str] = None,
                env: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """Run a trainer command line (trainer_command) whose hydra.run.dir is out_dir and return its
    summary.json, with "wall_s": the seconds the whole command took. env: variables set for the
    command on top of this process's. A failed run raises RuntimeError with its exit status, the
    command and the end of its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the trainer failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    summary["wall_s"] = wall
    return summary
