"""A task that srun started, one per rank, takes torchrun's variables from Slurm's (config.adopt_slurm,
called first by `python -m trainer`); a launcher's own variables win, the batch shell and a one-task
step are left alone. The real srun: tests/distributed/test_slurm.py."""
from __future__ import annotations

import pytest

from trainer.base.comm import detect_backend
from trainer.base.config import adopt_slurm, launcher_rank
from trainer.base.config.load import _first_host, _tasks_here

STEP = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456"}


def test_an_srun_task_gets_the_torch_variables():
    env = dict(STEP)
    got = adopt_slurm(env)
    assert got == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(15000 + 123456 % 10000)}
    assert {k: env[k] for k in got} == got
    requeued = {**STEP, "SLURM_RESTART_COUNT": "1"}  # a requeued run: another port than the run before it
    assert adopt_slurm(requeued)["MASTER_PORT"] == str(15000 + (123456 + 997) % 10000) != got["MASTER_PORT"]


def test_the_batch_scripts_master_and_a_launchers_variables_win(monkeypatch):
    env = {**STEP, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"}
    assert adopt_slurm(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert env["MASTER_ADDR"] == "10.0.0.5" and env["MASTER_PORT"] == "23456"
    for launcher in ({"RANK": "0", "WORLD_SIZE": "8"}, {"HOROVOD_RANK": "2"}, {"OMPI_COMM_WORLD_RANK": "1"},
                     {"PMI_RANK": "0"}):  # torchrun / horovodrun / mpirun inside the allocation
        env = {**STEP, **launcher}
        assert adopt_slurm(env) == {} and env == {**STEP, **launcher}
    env = {**STEP, "PMI_RANK": "3", "PMI_SIZE": "4"}  # srun --mpi=pmi2: its own PMI, the same rank
    assert adopt_slurm(env)["RANK"] == "3"
    monkeypatch.setattr("os.environ", env)
    assert detect_backend() == "torch" and launcher_rank() == 3


def test_the_batch_shell_and_a_single_task_are_left_alone(monkeypatch):
    batch = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}  # the batch script: no step
    assert adopt_slurm(batch) == {} and "RANK" not in batch
    one = {**STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    assert adopt_slurm(one) == {} and "RANK" not in one
    monkeypatch.setattr("os.environ", one)
    assert detect_backend() == "local" and launcher_rank() == 0
    monkeypatch.setattr("os.environ", {"SLURM_PROCID": "1"})
    assert launcher_rank() == 1  # warnings once: srun's rank before any process group


@pytest.mark.parametrize("nodelist, first", [("n1", "n1"), ("n[1-2]", "n1"), ("gpu[07-09,12],cpu3", "gpu07"),
                                             ("a,b[1-3]", "a"), ("rack1-n[003-004]-ib", "rack1-n003-ib")])
def test_the_first_host_of_a_host_list(nodelist, first):
    assert _first_host(nodelist) == first


def test_the_tasks_on_a_node():
    assert [_tasks_here("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    assert _tasks_here("4", 0) == 4


def test_threads_follow_the_cpus_a_rank_may_use(monkeypatch):
    """train.threads=0: a Slurm task's own CPUs (SLURM_CPUS_PER_TASK), else this process's
    affinity capped by a Slurm step's CPUs on the node, divided among the host's ranks; never 0.
    (Two one-CPU Slurm nodes on one host gave each task both cores: twice the threads the cores
    hold, 10-15x slower than torchrun.)"""
    import os
    from helpers import make_cfg
    from trainer.base.config import auto_threads
    from trainer.run.resolve.configure import load_config
    c = load_config(make_cfg([]))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert auto_threads(c, {}) == 8 and auto_threads(c, {"LOCAL_WORLD_SIZE": "2"}) == 4
    assert auto_threads(c, {"SLURM_STEP_ID": "0", "SLURM_CPUS_ON_NODE": "1", "LOCAL_WORLD_SIZE": "1"}) == 1
    assert auto_threads(c, {"SLURM_STEP_ID": "0", "SLURM_CPUS_ON_NODE": "4", "LOCAL_WORLD_SIZE": "2"}) == 2
    assert auto_threads(c, {"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "3", "LOCAL_WORLD_SIZE": "2"}) == 3
    assert auto_threads(c, {"SLURM_CPUS_ON_NODE": "1"}) == 8  # the batch shell: not a step's share
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # taskset / a cpuset of one core
    assert auto_threads(c, {"LOCAL_WORLD_SIZE": "4"}) == 1
    assert auto_threads(load_config(make_cfg(["train.threads=5"])), {}) == 5
