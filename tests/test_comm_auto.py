"""comm=auto follows the launcher: horovod under horovodrun, torch under torchrun, local alone.

horovodrun itself is covered by tests/test_horovod.py::test_multirun_under_horovodrun (comm=auto
there, summary.json says HorovodCollectives); here: the env rules, torchrun, no launcher, and the
error for comm=horovod without horovodrun.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from hvd_launch import WORKER, env, tail, torchrun, worker_results
from trainer.comm import LocalCollectives, detect_backend, make_collectives
from trainer.config import ConfigError

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
