"""comm=auto follows the launcher: horovod under horovodrun, torch under torchrun, local alone.

horovodrun itself is covered by tests/distributed/test_horovod.py::test_multirun_under_horovodrun (comm=auto
there, summary.json says HorovodCollectives); here: the env rules, torchrun, no launcher, and the
error for comm=horovod without horovodrun.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from hvd_launch import WORKER, env, tail, torchrun, worker_results
from trainer.base.comm import LocalCollectives, detect_backend, make_collectives
from trainer.base.config import ConfigError

LAUNCHER_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK")


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("vars_, want", [
    ({}, "local"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "local"),  # torchrun --nproc_per_node 1
    ({"RANK": "1", "WORLD_SIZE": "2"}, "torch"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovod"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}, "horovod"),  # horovodrun -np 1
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, "horovod"),  # bare mpirun
])
def test_detect_backend_from_launcher_env(clean_env, vars_, want):
    for k, v in vars_.items():
        clean_env.setenv(k, v)
    assert detect_backend() == want


def test_auto_without_launcher_is_local(clean_env):
    comm = make_collectives("auto")
    assert isinstance(comm, LocalCollectives) and comm.size == 1


def test_horovod_without_horovodrun_is_a_clear_error(clean_env):
    with pytest.raises(ConfigError, match="comm.backend=horovod needs a Horovod launcher"):
        make_collectives("horovod")


def test_cli_horovod_without_horovodrun_exits_with_message(tmp_path):
    e = env()
    proc = subprocess.run([sys.executable, "-m", "trainer", "comm=horovod", "train.steps=2",
                           f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, tail(proc)
    assert "horovodrun" in proc.stderr and "comm.backend=horovod" in proc.stderr


@pytest.mark.dist
def test_auto_under_torchrun_is_torch(tmp_path):
    proc = torchrun([WORKER, "auto", str(tmp_path)])
    res = worker_results(proc, str(tmp_path))
    for r, got in enumerate(res):
        assert got["detected"] == "torch" and got["backend"] == "TorchCollectives"
        assert got["rank"] == r and got["size"] == 2 and got["allreduce"] == 2.0


# ---------------------------------------------------------------- the transport follows the run's device
@pytest.fixture
def gpus(monkeypatch):
    """torch.cuda as on a host with n GPUs (n = 0: none); set_device calls are recorded."""
    import torch
    calls: list[int] = []

    def visible(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", calls.append)
        return calls
    return visible


@pytest.mark.parametrize("n_gpus,device,local_world,want", [
    (0, "auto", "2", "gloo"),   # no GPU: the run is on the CPU
    (2, "auto", "2", "nccl"),   # torchrun --nproc_per_node 2 on two GPUs: the README's GPU command
    (2, "cuda", "2", "nccl"),
    (2, "cpu", "2", "gloo"),    # train.device=cpu on a GPU host: gloo, not NCCL over host tensors
    (1, "auto", "2", "gloo"),   # two ranks, one GPU: NCCL cannot put both on it
])
def test_dist_backend_auto_follows_the_run_device(clean_env, gpus, n_gpus, device, local_world, want):
    from trainer.base.comm.torch_dist import pick_backend
    gpus(n_gpus)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": local_world}.items():
        clean_env.setenv(k, v)
    assert pick_backend("auto", device) == want
    assert pick_backend("gloo", device) == "gloo"  # a named transport stands


def test_dist_backend_auto_without_local_rank_is_gloo(clean_env, gpus):
    """Without LOCAL_RANK a rank cannot pick its GPU (every rank on the current one): gloo."""
    from trainer.base.comm.torch_dist import pick_backend
    gpus(8)
    clean_env.delenv("LOCAL_RANK", raising=False)
    clean_env.setenv("WORLD_SIZE", "2")
    assert pick_backend("auto", "auto") == "gloo"
    clean_env.setenv("WORLD_SIZE", "1")
    assert pick_backend("auto", "auto") == "nccl"


class _FakeHvd:
    """The horovod.torch calls HorovodCollectives.__init__ makes, for one rank built with NCCL."""
    is_initialized = staticmethod(lambda: True)
    rank = local_rank = staticmethod(lambda: 0)
    size = local_size = staticmethod(lambda: 1)
    nccl_built = staticmethod(lambda: True)
    gloo_enabled = staticmethod(lambda: True)


@pytest.mark.parametrize("device,on_gpu", [("auto", True), ("cuda", True), ("cpu", False)])
def test_horovod_on_gpu_follows_the_run_device(monkeypatch, gpus, device, on_gpu):
    """Horovod keeps tensors on the GPU (NCCL) only when the run trains there, not merely when a
    GPU is visible: train.device=cpu on a GPU host goes through Gloo and touches no GPU."""
    import trainer.base.comm.horovod as hv
    monkeypatch.setattr(hv, "hvd", _FakeHvd)
    calls = gpus(2)
    comm = hv.HorovodCollectives(30.0, device)
    assert comm.on_gpu is on_gpu and comm.transport == ("nccl" if on_gpu else "gloo")
    assert calls == ([0] if on_gpu else [])
