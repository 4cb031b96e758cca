"""A real Slurm on this one host: munged, slurmctld and two slurmd (n1, n2: Debian's build runs
several slurmd on one host), each with its own port, every file (slurm.conf, munge key and socket,
state, spool, logs) in a private directory. Nothing global is read or changed: the clients find the
cluster through SLURM_CONF (env()). The daemons are stopped, by their pids, when the `with` block
ends (or the command below exits), whatever happened.

To try the Slurm scripts on one machine (docs/running.md, "On Slurm"), as root after
`bash scripts/install_slurm.sh`:

    .venv/bin/python -m dev.slurmcluster                  # start it, print SLURM_CONF, wait for Ctrl-C
    .venv/bin/python -m dev.slurmcluster -- sbatch ...    # or run one command against it, then stop it

(in another shell: `export SLURM_CONF=...` as printed, then sbatch / srun / squeue from the
checkout). The tests (tests/distributed/test_slurm.py) and benchmarks/bench_slurm.py use it too.
Needs root and Debian's slurmctld, slurmd, slurm-client and munge; `missing()` says why not.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
NODES = ("n1", "n2")
START_TIMEOUT_S = 30.0
# KillWait: the grace between Slurm's TERM and its KILL (a save's time); cred_expire: a requeued
# job may start again after it (Slurm's default 120 s would make each requeue wait two minutes)
KILL_WAIT_S, CRED_EXPIRE_S = 30, 5


def missing() -> Optional[str]:
    """Why a Slurm cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster on this host needs root (slurmd starts the tasks as their user)"
    absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent:
        return f"{', '.join(absent)} not installed: run `bash scripts/install_slurm.sh` as root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=trainertest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={node_ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock,cred_expire={cred_expire}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait={kill_wait}
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
NodeName={nodes[0]} NodeHostname={host} NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs=1 State=UNKNOWN
NodeName={nodes[1]} NodeHostname={host} NodeAddr=127.0.0.1 Port={node_ports[1]} CPUs=1 State=UNKNOWN
PartitionName=test Nodes={nodes[0]},{nodes[1]} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """`with SlurmCluster() as c:` a controller and two one-CPU nodes; c.run(["sbatch", ...]) runs a
    client against it; c.log() is the daemons' logs (for a failure's message)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="trainer-slurm-")
        os.chmod(self.dir, 0o755)  # munged wants its socket's directory searchable by all
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.pids: list[int] = []

    # ------------------------------------------------------------------ start / stop
    def __enter__(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        d = self.dir
        for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        self._daemon(["munged", "--force", f"--socket={d}/munge.sock", f"--key-file={key}",
                      f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed"],
                     f"{d}/munged.pid")
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(host=socket.gethostname().split(".")[0], dir=d, ctld_port=free_port(),
                                      node_ports=[free_port(), free_port()], nodes=NODES,
                                      cred_expire=CRED_EXPIRE_S, kill_wait=KILL_WAIT_S))
        self._daemon(["slurmctld", "-i", "-f", self.conf], f"{d}/slurmctld.pid")
        for n in NODES:
            self._daemon(["slurmd", "-N", n, "-f", self.conf], f"{d}/slurmd.{n}.pid")
        t0 = time.monotonic()
        while True:  # both nodes idle: the controller has heard from them
            p = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in NODES):
                return
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"the Slurm nodes are not idle after {START_TIMEOUT_S:g} s: {states}\n{self.log()}")
            time.sleep(0.2)

    def _daemon(self, argv: list[str], pidfile: str) -> None:
        """Start a daemon that forks itself; note its pid (from its pid file) to stop it by."""
        p = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}\n{self.log()}")
        t0 = time.monotonic()
        while not (os.path.isfile(pidfile) and open(pidfile).read().strip().isdigit()):
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"{argv[0]} wrote no pid file ({pidfile})\n{self.log()}")
            time.sleep(0.05)
        self.pids.append(int(open(pidfile).read().strip()))

    def close(self) -> None:
        """Cancel what still runs, stop the daemons (TERM, KILL after 10 s) and remove the directory."""
        if self.pids and shutil.which("scancel"):
            self.run(["scancel", "--full", "--signal=KILL", "--user=root"], check=False)
        for pid in reversed(self.pids):
            _stop(pid)
        self.pids = []
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ clients
    def env(self, extra: Optional[dict] = None) -> dict:
        e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        e["SLURM_CONF"] = self.conf
        e.update(extra or {})
        return e

    def run(self, argv: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        env = kw.pop("env", None) or self.env()
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}\n{self.log()}")
        return p

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs (the first of each key)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        got: dict[str, str] = {}
        for item in out.split():
            k, _, v = item.partition("=")
            got.setdefault(k, v)
        return got

    def wait(self, job_id: str, done, timeout: float = 240, what: str = "") -> dict[str, str]:
        """Poll the job until done(its fields) holds; its fields then."""
        t0 = time.monotonic()
        while True:
            info = self.job(job_id)
            if done(info):
                return info
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"job {job_id} not {what or 'done'} after {timeout:g} s: "
                                     f"{info.get('JobState')} {info.get('Reason')}\n{self.log()}")
            time.sleep(0.2)

    def log(self, lines: int = 15) -> str:
        out = []
        for name in sorted(os.listdir(os.path.join(self.dir, "log"))) if os.path.isdir(self.dir) else []:
            with open(os.path.join(self.dir, "log", name), errors="replace") as f:
                out.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out)


def _stop(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    t0 = time.monotonic()
    while time.monotonic() - t0 < grace_s:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    """Start the cluster; run `argv` (after --) against it and return its status, or wait for Ctrl-C."""
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m dev.slurmcluster", description=__doc__.split("\n\n")[0],
                                 epilog="-- COMMAND ...: run it against the cluster (SLURM_CONF set), then stop the "
                                        "cluster; its exit status is the command's")
    ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    why = missing()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a TERM stops the daemons too (the with block)
    with SlurmCluster() as c:
        print(f"export SLURM_CONF={c.conf}   # nodes {', '.join(NODES)}: sbatch / srun / squeue against it", flush=True)
        if cmd:
            return subprocess.run(cmd, env=c.env()).returncode
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
