"""Launch helpers for the horovodrun / torchrun tests: run tests/horovod_worker.py and read results;
find a launched rank's process (worker) and wait for a launcher to end (finish)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
WORKER = os.path.join(ROOT, "tests", "horovod_worker.py")
HOROVODRUN = os.path.join(BIN, "horovodrun")
TORCHRUN = os.path.join(BIN, "torchrun")


def require_horovod() -> None:
    """CI installs Horovod (scripts/setup.sh); a missing one is a failure, not a skip."""
    if importlib.util.find_spec("horovod") is None or not os.path.exists(HOROVODRUN):
        pytest.fail("horovod is not installed in this venv: run `bash scripts/setup.sh` "
                    "(builds Horovod 0.28.1, cached wheel after the first time)")


def require_netns() -> None:
    """The emulated hosts (dev/netcluster.py) need root and `ip netns`; the netns-marked tests are
    skipped, saying why, where they are not."""
    from dev import netcluster
    ok, why = netcluster.availability()
    if not ok:
        pytest.skip(f"emulated hosts need root and `ip netns`: {why}")


def env() -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("HOROVOD_", "OMPI_", "PMI_")) and k not in ("RANK", "WORLD_SIZE")}
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e["TC_MASTER_PORT"] = str(free_port())
    e["PYTHONUNBUFFERED"] = "1"
    return e


def horovodrun(args: list[str], np_: int = 2, cwd: str | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """`horovodrun -np N -H localhost:N --gloo python ARGS` (no ssh needed on localhost)."""
    require_horovod()
    cmd = [sys.executable, HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
           sys.executable] + args
    return subprocess.run(cmd, cwd=cwd or ROOT, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def torchrun(args: list[str], np_: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, TORCHRUN, "--standalone", "--nproc_per_node", str(np_)] + args
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-n:]}\nstderr:\n{proc.stderr[-n:]}"


def worker_results(proc: subprocess.CompletedProcess, out_dir: str, world: int = 2) -> list[dict]:
    """Per-rank results of tests/horovod_worker.py; fails with the worker's traceback."""
    results = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.pt")
        assert os.path.exists(path), f"rank {r} wrote no result\n{tail(proc)}"
        res = torch.load(path, weights_only=False)
        assert res["ok"], f"rank {r} failed:\n{res['error']}\n{tail(proc)}"
        results.append(res)
    assert proc.returncode == 0, tail(proc)
    return results


# ---- the launchers' processes -------------------------------------------------------------------
def worker(marker: str, rank: int) -> int:
    """pid of the `-m trainer` process of `rank` started with `marker` (torchrun: RANK,
    horovodrun: HOROVOD_RANK; launchers and shell wrappers are not `-m trainer` processes)."""
    want = str(rank).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                envs = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if envs.get(b"TEST_RUN") == marker.encode() and b"-m\0trainer\0" in cmd and \
                want in (envs.get(b"RANK"), envs.get(b"HOROVOD_RANK")):
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} found")


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The launcher's output once it exits; fails, killing it, if it runs past `timeout` s."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the launcher hangs {timeout}s after the failure:\n{proc.communicate()[0][-3000:]}")
