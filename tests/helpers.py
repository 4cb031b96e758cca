"""Test helpers: compose configs like `python -m trainer` does, and run real W-process gloo jobs.

Distributed tests start W real processes (spawn), each calling trainer.run() with the torch
backend over gloo on localhost, and compare against an in-process single-worker reference.
Also: small file systems (tmpfs, fill), two runs' evaluations compared (assert_same_eval; their
losses and parameters: parity_helpers.assert_same_run), and a peer without processes (Mirror).
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

import numpy as np
import pytest
import torch
from trainer.base.comm.base import Collectives
from trainer.base.config import compose
from trainer.run.evaluation.metrics import auc_logloss
from trainer.run.runner import RunResult, run

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
# the first torch.optim optimizer imports it (~2.5 s; tests/distributed/test_dynamic_parity.py 76 s -> 41 s). A worker gets the
# test's environment and working directory as they are at spawn() (a forked worker would otherwise
# keep the server's). TEST_START_METHOD=spawn goes back to fresh interpreters.
PRELOAD = ["torch", "torch._dynamo", "trainer.run.runner", "trainer.base.config", "trainer.base.comm"]
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


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0,
          fresh: bool = False) -> list[Any]:
    """Run fn(rank, world, *args) in `world` processes with torchrun-like env; return the values.

    fn must be importable (module level). Raises if any rank fails, dies or exceeds timeout.
    fresh: start each rank in a new interpreter, for a test whose environment must reach imports
    (TRITON_INTERPRET): the forkserver imported them with the environment it started under.
    """
    ctx = mp.get_context("spawn") if fresh else _CTX
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, paths[r], dict(os.environ), os.getcwd()))
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


# ---- comparing the evaluations of runs that differ in W, launcher, backend or pipelining ----------
# What is exact between such runs is what the parity tolerance covers: the eval logits (like the
# losses and the parameters) agree within (rtol, atol). The AUC is a rank statistic: the share of
# (positive, negative) pairs whose logits are in order, a tie counting one half. A pair ordered the
# other way by a last-bit difference of one logit moves it by 1 / (n_pos n_neg), ~2e-5 on 480 rows:
# more than any relative tolerance on the AUC itself, so it is compared in pairs.

def assert_auc_close(got: float, ref: float, n_pos: int, n_neg: int, pairs: float = 1) -> None:
    """The AUCs `got` and `ref` of n_pos positives and n_neg negatives differ by at most `pairs`
    (positive, negative) pairs ordered the other way (a tie made or undone is half a pair)."""
    apart = abs(got - ref) * n_pos * n_neg  # numerators are whole halves: exact up to the division
    assert apart <= pairs + 1e-6, (f"AUC {got!r} vs {ref!r}: {apart:.3f} (positive, negative) pairs apart, "
                                   f"{pairs} allowed ({n_pos} positives, {n_neg} negatives)")


def flippable_pairs(rows: np.ndarray, rtol: float, atol: float) -> int:
    """(positive, negative) pairs of these [n, 2] (logit, label) rows that another run can order
    differently while each of its logits is within atol + rtol |z| of these: those whose logits are
    within the sum of their two tolerances (assert_auc_close's `pairs` then follows from the logits)."""
    z, pos = rows[:, 0].astype(np.float64), rows[:, 1] > 0.5
    zp, zn = z[pos], z[~pos]
    en = atol + rtol * np.abs(zn)
    count = 0
    for lo in range(0, zp.size, 512):  # [512, n_neg] at a time
        p = zp[lo:lo + 512, None]
        count += int((np.abs(p - zn) <= (atol + rtol * np.abs(p) + en) * (1 + 1e-9)).sum())
    return count


def gathered_positions(n: int, batch: int, world: int) -> np.ndarray:
    """Split positions of the rows an evaluation gathers from `world` ranks (rank 0's rows, then
    rank 1's, ...), for the sources whose eval batch k of rank r holds the rows from
    (k W + r) batch on (synthetic.py and movielens.py, eval_batches)."""
    steps = -(-n // (batch * world)) if n else 0
    parts = [np.arange(s, min(s + batch, n)) for r in range(world) for k in range(steps)
             for s in [(k * world + r) * batch] if s < n]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def eval_rows(res: RunResult) -> np.ndarray:
    """The final test evaluation's [n, 2] (logit, label) rows of a run (return_state), in split order
    (criteo: rank r evaluates the r-th contiguous part of the split, so the gathered rows are in
    split order already)."""
    rows = res.state["eval_rows"]
    assert rows is not None, "no test evaluation in this run"
    if res.summary["config"]["data"]["name"] == "criteo":
        return rows
    pos = gathered_positions(rows.shape[0], res.summary["config"]["data"]["eval_batch_size"],
                             res.summary["world_size"])
    out = np.empty_like(rows)
    out[pos] = rows
    return out


def assert_same_eval(ref: RunResult, got: RunResult, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """`got`'s final test evaluation against `ref`'s (both with return_state; W, launcher, backend,
    pipelining may differ): each reports the AUC and log loss of its own rows; the same rows with
    the same labels; every logit within (rtol, atol) of the reference's (the parity tolerance); the
    AUCs within the pairs those logits may order differently (flippable_pairs; none: equal)."""
    for r in (ref, got):  # the summary's metrics are those of the rows compared here
        rows = r.state["eval_rows"]
        assert auc_logloss(rows[:, 0], rows[:, 1]) == (r.summary["eval_auc"], r.summary["eval_logloss"])
    a, b = eval_rows(ref), eval_rows(got)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_array_equal(b[:, 1], a[:, 1], err_msg="eval labels (rows in another order?)")
    np.testing.assert_allclose(b[:, 0], a[:, 0], rtol=rtol, atol=atol, err_msg="eval logits")
    n_pos = int((a[:, 1] > 0.5).sum())
    assert_auc_close(got.summary["eval_auc"], ref.summary["eval_auc"], n_pos, a.shape[0] - n_pos,
                     pairs=flippable_pairs(a, rtol, atol))


def eval_label_counts(overrides: list[str], split: str = "test") -> tuple[int, int]:
    """(positives, negatives) of a config's test (or validation) split, read from its data source:
    assert_auc_close's counts for runs whose eval rows are not at hand (summary.json only)."""
    from trainer.run.resolve.configure import load_config
    from trainer.workload.data import make_data
    labels = torch.cat([b.labels for b in make_data(load_config(make_cfg(overrides)), 0, 1).eval_batches(split)])
    n_pos = int((labels > 0.5).sum())
    return n_pos, int(labels.numel()) - n_pos


# ---- a peer without processes ------------------------------------------------------------------
class Mirror(Collectives):
    """Rank 0 of 2 whose peer sends exactly what it sends (one process, no wire)."""

    def __init__(self):
        super().__init__(0, 2, 60.0)

    def _alltoall(self, t, splits, recv_splits):
        return t.clone()

    def _allreduce(self, ts, op):
        raise NotImplementedError

    def _allgather(self, t):
        raise NotImplementedError

    def _broadcast(self, t, root):
        raise NotImplementedError

    def _barrier(self):
        pass
