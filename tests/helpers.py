"""Test helpers: compose configs like `python -m trainer` does, and run real W-process gloo jobs.

Distributed tests start W real processes (spawn), each calling trainer.run() with the torch
backend over gloo on localhost, and compare against an in-process single-worker reference.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import tempfile
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
import torch
from trainer.config import compose
from trainer.runner import RunResult, run

def make_cfg(overrides: list[str]):
    """The composed Hydra config of `python -m trainer <overrides>`."""
    return compose(overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Workers are forked from a server that has imported torch and the trainer once (the
# "forkserver" start method with a preload): a spawned worker would import them again, ~3 s of
# CPU each, a large share of the suite's time (the dist tests take ~45% less). torch._dynamo too:
# the first torch.optim optimizer imports it (~2.5 s; tests/test_dynamic_parity.py 76 s -> 41 s). A worker gets the
# test's environment and working directory as they are at spawn() (a forked worker would otherwise
# keep the server's). TEST_START_METHOD=spawn goes back to fresh interpreters.
PRELOAD = ["torch", "torch._dynamo", "trainer.runner", "trainer.config", "trainer.comm"]
_CTX = mp.get_context(os.environ.get("TEST_START_METHOD", "forkserver"))
if _CTX.get_start_method() == "forkserver":
    _CTX.set_forkserver_preload(PRELOAD)


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, path: str,
           env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        out = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    torch.save(out, path)


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run fn(rank, world, *args) in `world` processes with torchrun-like env; return the values.

    fn must be importable (module level). Raises if any rank fails, dies or exceeds timeout.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [_CTX.Process(target=_child, args=(r, world, port, fn, args, paths[r], dict(os.environ), os.getcwd()))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"{len(alive)} rank(s) still running after {timeout}s")
        results = []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died with exit code {procs[r].exitcode}")
            out = torch.load(path, weights_only=False)
            if not out["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{out['error']}")
            results.append(out["value"])
        return results


def train_worker(rank: int, world: int, overrides: list[str], return_state: bool) -> RunResult:
    """Child body: one rank of `python -m trainer comm=torch <overrides>`."""
    return run(make_cfg(list(overrides) + ["comm=torch"]), return_state=return_state)


def run_world(world: int, overrides: list[str], return_state: bool = True) -> list[RunResult]:
    """Train on `world` gloo workers; index 0 is rank 0's result."""
    return spawn(world, train_worker, list(overrides), return_state)


def run_single(overrides: list[str], return_state: bool = True) -> RunResult:
    """The single-process reference, in this process (local backend)."""
    return run(make_cfg(list(overrides) + ["comm=local"]), return_state=return_state)


@contextmanager
def tmpfs(path: Any, size: str = "64k", dirs: tuple[str, ...] = (), read_only: bool = False) -> Iterator[str]:
    """A small tmpfs mounted at `path` (made if missing) for the block, unmounted after (lazily).
    `dirs` are made inside it first; read_only then remounts it ro (root ignores permission bits:
    a ro mount is the only refusal root gets). 64 KiB is a real ENOSPC for a tiny checkpoint
    (~180 KiB). Mounting needs root: without it the test is skipped, naming why."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        for d in dirs:
            os.makedirs(os.path.join(path, d))
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", path], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=True)


def fill(directory: Any, leave: int = 0) -> None:
    """Fill the file system of `directory` with a file `filler` until a write fails (ENOSPC), then
    give back the last `leave` bytes of it (whole 4 KiB pages: a few writes will succeed)."""
    fd = os.open(os.path.join(str(directory), "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    if leave:
        os.ftruncate(fd, os.fstat(fd).st_size - leave)
    os.close(fd)
