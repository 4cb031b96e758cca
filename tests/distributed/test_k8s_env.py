"""The Kubernetes manifests of deploy/k8s/ against the trainer, without Kubernetes: each pod's command
is read from its manifest and run with exactly the environment its operator gives the pod (and
nothing from our own launchers), on this host, with /runs (the volume) a temporary directory and
the config shrunk (CFG: data=tiny for data=criteo_like, STEPS steps, one thread).

- PyTorchJob, one process per pod (pytorchjob.yaml): the training-operator v1 sets, in every pod,
  MASTER_ADDR (the master pod's service; here 127.0.0.1), MASTER_PORT (the container port named
  pytorchjob-port), WORLD_SIZE (the pods x nprocPerNode, which defaults to "auto", counted as 1) and
  RANK (0 for the Master, 1 + index for a Worker), plus PET_NNODES, PET_NODE_RANK,
  PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT and PYTHONUNBUFFERED
  (pkg/controller.v1/pytorch/envvar.go, master.go; release-1.9);
- PyTorchJob with nprocPerNode (pytorchjob-torchrun.yaml): the same variables, WORLD_SIZE counting
  processes and RANK still the pod's index; torchrun takes its arguments from PET_* (nprocPerNode
  shrunk to 1 per pod here: two pods, two agents);
- MPIJob (mpijob.yaml): the launcher's command with /etc/mpi/hostfile replaced by a file in the
  operator's format (`localhost slots=2`) and the OMPI_MCA_* variables the mpi-operator (v2beta1)
  sets on the launcher;

each equal to a localhost reference of the same global batch (torchrun --standalone
--nproc_per_node 2, or horovodrun -H localhost:2 for the MPIJob): every loss, row and parameter.
And the restart contract: a pod SIGTERMed mid-run (as the kubelet does) exits 143 with a checkpoint
on the volume, every pod does, and the same commands again (restarted pods) resume and end equal to
the uninterrupted run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from docs_registry import documented
from helpers import free_port
from hvd_launch import BIN, HOROVODRUN, ROOT, require_horovod, tail, torchrun
from multihost_helpers import CFG, assert_same_model, assert_same_training

from benchmarks.bench_stop import trained_steps

pytestmark = pytest.mark.dist
K8S = Path(ROOT) / "deploy" / "k8s"
STEPS = 60
# the manifests' data recipe, replaced by CFG's (data=tiny), and their periodic saves made rarer than the run
SMALL = [a for a in CFG if not a.startswith("train.steps=")] + [f"train.steps={STEPS}", "checkpoint.every=1000"]
# our launchers' variables, and the operators': none may leak in from the environment the tests run in
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "TC_MASTER_PORT", "TRAINER_EXIT_DIR")
LAUNCH_PREFIXES = ("HOROVOD_", "OMPI_", "PMI_", "PMIX_", "PET_", "TORCHELASTIC_", "K_MPI_")
TIMEOUT = 240


# ------------------------------------------------------------------ the manifests
def manifest(name: str) -> dict:
    with open(K8S / name) as f:
        return yaml.safe_load(f)


def _container(spec: dict) -> dict:
    (c,) = spec["template"]["spec"]["containers"]
    return c


def _pod_spec(job: dict, rtype: str) -> dict:
    return job["spec"]["pytorchReplicaSpecs" if job["kind"] == "PyTorchJob" else "mpiReplicaSpecs"][rtype]


def test_the_manifests_fields():
    """Kinds and API versions the operators serve, the image, the volume at /runs holding the run and
    its checkpoints (resume=auto), the grace, GPUs, shared memory, and the restart policies."""
    pvc = _job_of_the_docs(documented("kubectl apply -f deploy/k8s/pvc.yaml"))
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod writes its shard there
    claim = pvc["metadata"]["name"]
    runs = {}
    for name, kind, api in (("pytorchjob.yaml", "PyTorchJob", "kubeflow.org/v1"),
                            ("pytorchjob-torchrun.yaml", "PyTorchJob", "kubeflow.org/v1"),
                            ("mpijob.yaml", "MPIJob", "kubeflow.org/v2beta1")):
        job = manifest(name)
        assert (job["apiVersion"], job["kind"]) == (api, kind), name
        types = ("Master", "Worker") if kind == "PyTorchJob" else ("Launcher", "Worker")
        specs = job["spec"]["pytorchReplicaSpecs" if kind == "PyTorchJob" else "mpiReplicaSpecs"]
        assert sorted(specs) == sorted(types), name
        trainers = ("Master", "Worker") if kind == "PyTorchJob" else ("Worker",)
        for rtype in types:
            spec, c = specs[rtype], _container(specs[rtype])
            assert c["image"] == "hybrid-trainer:cuda", (name, rtype)
            # ExitCode: 128-255 restarted (143 preempted, 203 a lost worker), 1-127 not (2: a bad config);
            # MPIJob v2beta1 accepts only Never and OnFailure (its backoffLimit bounds the retries)
            assert spec["restartPolicy"] == ("ExitCode" if kind == "PyTorchJob" else "OnFailure"), (name, rtype)
            if rtype not in trainers:
                continue
            pod = spec["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] >= 60, (name, rtype)
            assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"] == claim
            assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
        if kind == "PyTorchJob":
            assert specs["Master"]["template"] == specs["Worker"]["template"], name  # one pod, ranks by env
            assert specs["Master"]["replicas"] == 1
            c = _container(specs["Master"])
            assert {p["name"]: p["containerPort"] for p in c["ports"]}.get("pytorchjob-port"), name
            assert c["name"] == "pytorch"  # the operator reads the port and the exit code of this container
            command = c["command"]
            assert command[:6] == ["python", "-m", "trainer.run.job", "--lost-worker-exit", "203", "--"], name
        else:
            command = _container(specs["Launcher"])["command"]
            assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
            assert job["spec"]["sshAuthMountPath"] == "/root/.ssh"
            assert "ssh-keygen -A" in " ".join(_container(specs["Worker"])["command"])  # the image has no host keys
        opts = dict(a.split("=", 1) for a in command if "=" in a and not a.startswith("-"))
        assert opts["checkpoint.resume"] == "auto", name
        run = opts["hydra.run.dir"]
        assert run.startswith("/runs/") and opts["checkpoint.dir"] == run + "/checkpoints", name
        runs[name] = run
    assert len(set(runs.values())) == 3, runs  # one output dir per job: two jobs never share a lock
    shutdown = {e["name"]: e["value"] for e in _container(_pod_spec(manifest("pytorchjob-torchrun.yaml"),
                                                                     "Master")).get("env", [])}
    grace = _pod_spec(manifest("pytorchjob-torchrun.yaml"), "Master")["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 30 < int(shutdown["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace  # torchrun waits for the save, then the pod ends


KV_VERSION = "1.37.0"  # kubernetes-validate: the schemas of Kubernetes 1.x releases, offline (72 MB installed)


def kubernetes_validate():
    """The kubernetes_validate module: the venv's, else installed once (with its dependencies) into
    ~/.cache/hybrid-trainer/kubernetes-validate-VERSION by pip --target; kept out of the test extra
    (and so out of the image) for its size. Skips, saying why, only where pip cannot reach it."""
    try:
        import kubernetes_validate as kv
        return kv
    except ImportError:
        pass
    import importlib
    target = os.path.join(os.path.expanduser("~"), ".cache", "hybrid-trainer", f"kubernetes-validate-{KV_VERSION}")
    if not os.path.exists(os.path.join(target, ".complete")):
        shutil.rmtree(target + ".tmp", ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", target + ".tmp",
                            f"kubernetes-validate=={KV_VERSION}"], capture_output=True, text=True, timeout=600)
        if r.returncode:
            pytest.skip(f"kubernetes-validate=={KV_VERSION} could not be installed: {r.stderr.strip()[-300:]}")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(target + ".tmp", target)
        open(os.path.join(target, ".complete"), "w").close()
    sys.path.append(target)  # after the venv's own packages: only what the venv lacks comes from there
    importlib.invalidate_caches()
    import kubernetes_validate as kv
    return kv


def test_the_pod_templates_are_valid_core_v1():
    """Each pod template validates as a Kubernetes PodTemplateSpec (kubernetes-validate's offline
    schemas; the Kubeflow kinds themselves are CRDs it does not know)."""
    kv = kubernetes_validate()
    for name in ("pytorchjob.yaml", "pytorchjob-torchrun.yaml", "mpijob.yaml"):
        job = manifest(name)
        key = "pytorchReplicaSpecs" if job["kind"] == "PyTorchJob" else "mpiReplicaSpecs"
        for rtype, spec in job["spec"][key].items():
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-{rtype}".lower()},
                        "template": spec["template"]}
            kv.validate(template, "1.30.0", strict=True)
    kv.validate(manifest("pvc.yaml"), "1.30.0", strict=True)


# ------------------------------------------------------------------ the pods, emulated
def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # the image's venv first, as its ENV PATH
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # here only: the checkout is not installed
    return env


def pytorchjob_env(job: dict, rtype: str, index: int, port: int) -> dict[str, str]:
    """The variables the training-operator v1 adds to a pod of `job` (envvar.go / master.go, no
    elasticPolicy): WORLD_SIZE = pods x nprocPerNode ("auto" counts 1), RANK = the pod's index."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(s.get("replicas", 1) for s in specs.values())
    nproc = str(job["spec"].get("nprocPerNode", "auto"))
    rank = index + (1 if rtype == "Worker" else 0)
    master = f"{job['metadata']['name']}-master-0"
    env = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
           "MASTER_ADDR": master, "PET_MASTER_ADDR": master,
           "WORLD_SIZE": str(pods * (int(nproc) if nproc.isdigit() else 1)), "RANK": str(rank),
           "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(pods)}
    env["MASTER_ADDR"] = env["PET_MASTER_ADDR"] = "127.0.0.1"  # the master's service, on this host
    env.update({e["name"]: e["value"] for e in _container(specs[rtype]).get("env", [])})  # the manifest's own
    return env


def pod_command(container: dict, runs: str) -> list[str]:
    """The container's command, its volume at `runs`, shrunk: data=tiny (CFG) for its data recipe."""
    cmd = [a.replace("=/runs/", f"={runs}/") for a in container["command"] if not a.startswith("data=")]
    return cmd + SMALL


class Pods:
    """The pods of a PyTorchJob started as processes on this host, each with its operator's env."""

    def __init__(self, job: dict, runs: str, cwd: str, nproc: str | None = None) -> None:
        if nproc is not None:
            job = {**job, "spec": {**job["spec"], "nprocPerNode": nproc}}
        port = free_port()
        self.procs = []
        for rtype, spec in job["spec"]["pytorchReplicaSpecs"].items():
            for index in range(spec.get("replicas", 1)):
                env = {**_base_env(), **pytorchjob_env(job, rtype, index, port)}
                cmd = pod_command(_container(spec), runs)
                self.procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True))

    def wait(self) -> list[tuple[int, str]]:
        out = []
        for p in self.procs:
            try:
                log = p.communicate(timeout=TIMEOUT)[0]
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise AssertionError(f"a pod runs past {TIMEOUT} s:\n{p.communicate()[0][-3000:]}")
            out.append((p.returncode, log))
        return out


def _ok(results: list[tuple[int, str]]) -> None:
    for rc, log in results:
        assert rc == 0, f"rc={rc}\n{log[-4000:]}"
        assert log.strip().splitlines()[-1].startswith("[job] complete (exit 0;"), log[-2000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("ref") / "out")
    ref = torchrun(["-m", "trainer", "comm=torch", f"hydra.run.dir={out}", *SMALL], timeout=TIMEOUT)
    assert ref.returncode == 0, tail(ref)
    return out


def _job_of_the_docs(argv: list[str]) -> dict:
    """The manifest that `kubectl apply -f FILE` (documented(): as the docs print it) submits."""
    assert argv[:3] == ["kubectl", "apply", "-f"] and len(argv) == 4, argv
    return manifest(os.path.relpath(os.path.join(ROOT, argv[3]), K8S))


def test_pytorchjob_pods_train_as_torchrun(reference, tmp_path):
    """One process per pod: the Master and the Worker, with only the operator's variables (and the
    manifest's own), train what torchrun --standalone --nproc_per_node 2 trains."""
    job = _job_of_the_docs(documented("kubectl apply -f deploy/k8s/pytorchjob.yaml"))
    runs = tmp_path / "runs"
    _ok(Pods(job, str(runs), str(tmp_path)).wait())
    out = pod_command(_container(_pod_spec(job, "Master")), str(runs))
    run_dir = next(a.split("=", 1)[1] for a in out if a.startswith("hydra.run.dir="))
    summary = assert_same_training(reference, run_dir, STEPS)
    assert summary["backend"] == "TorchCollectives"


def test_pytorchjob_with_nproc_per_node_runs_torchrun_from_pet_variables(reference, tmp_path):
    """nprocPerNode: torchrun in each pod takes --nnodes, --node_rank, --nproc_per_node and the master
    from PET_*; two pods of one process each (nprocPerNode 8 shrunk to 1) equal the reference."""
    job = _job_of_the_docs(documented("kubectl apply -f deploy/k8s/pytorchjob-torchrun.yaml"))
    assert job["spec"]["nprocPerNode"] == "8"
    runs = tmp_path / "runs"
    _ok(Pods(job, str(runs), str(tmp_path), nproc="1").wait())
    out = pod_command(_container(_pod_spec(job, "Master")), str(runs))
    run_dir = next(a.split("=", 1)[1] for a in out if a.startswith("hydra.run.dir="))
    assert_same_training(reference, run_dir, STEPS)


def test_mpijob_launcher_runs_horovodrun_on_the_operators_hostfile(tmp_path):
    """The launcher's command with the operator's hostfile (`HOST slots=N`, here one host of two
    slots) and its OMPI_MCA_* variables equals horovodrun -H localhost:2."""
    require_horovod()
    job = _job_of_the_docs(documented("kubectl apply -f deploy/k8s/mpijob.yaml"))
    launcher = _container(_pod_spec(job, "Launcher"))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    runs = tmp_path / "runs"
    cmd = pod_command(launcher, str(runs))
    assert cmd[cmd.index("--hostfile") + 1] == "/etc/mpi/hostfile"
    cmd[cmd.index("--hostfile") + 1] = str(hostfile)
    cmd[cmd.index("-np") + 1] = "2"  # Worker replicas x slotsPerWorker, shrunk
    slots = str(job["spec"]["slotsPerWorker"])
    env = {**_base_env(), "K_MPI_JOB_ROLE": "launcher", "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
           "OMPI_MCA_orte_default_hostfile": str(hostfile), "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
           "OMPI_MCA_orte_set_default_slots": slots, "NVIDIA_VISIBLE_DEVICES": "", "NVIDIA_DRIVER_CAPABILITIES": ""}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, tail(res)
    ref_dir = str(tmp_path / "ref")
    ref = subprocess.run([sys.executable, HOROVODRUN, "-np", "2", "-H", "localhost:2", sys.executable, "-m",
                          "trainer", "comm=horovod", f"hydra.run.dir={ref_dir}", *SMALL], cwd=tmp_path,
                         env=_base_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert ref.returncode == 0, tail(ref)
    run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("hydra.run.dir="))
    assert assert_same_training(ref_dir, run_dir, STEPS)["backend"] == "HorovodCollectives"


def test_a_preempted_pod_exits_143_and_the_restarted_pods_resume(reference, tmp_path):
    """The kubelet SIGTERMs the Master pod's first process (the job wrapper) mid-run: every rank
    stops after one step and saves it on the volume, both pods exit 143 (ExitCode: restarted); the
    same commands again (the restarted pods) resume from it and end equal to the uninterrupted run."""
    job = manifest("pytorchjob.yaml")
    runs = tmp_path / "runs"
    pods = Pods(job, str(runs), str(tmp_path))
    run_dir = next(a.split("=", 1)[1] for a in pod_command(_container(_pod_spec(job, "Master")), str(runs))
                   if a.startswith("hydra.run.dir="))
    t0 = time.monotonic()
    while trained_steps(run_dir) < 3:
        assert all(p.poll() is None for p in pods.procs) and time.monotonic() - t0 < TIMEOUT, "no steps"
        time.sleep(0.02)
    pods.procs[0].send_signal(signal.SIGTERM)
    stopped = pods.wait()
    for rc, log in stopped:
        assert rc == 143, f"rc={rc}\n{log[-4000:]}"
        assert "[job] preempted (exit 143;" in log.strip().splitlines()[-1], log[-2000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        k = json.load(f)["stopped"]["step"]
    assert 3 <= k < STEPS
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == [f"step_{k:08d}"]
    again = Pods(job, str(runs), str(tmp_path)).wait()
    _ok(again)
    assert f"resuming from {os.path.join(run_dir, 'checkpoints', f'step_{k:08d}')}" in again[0][1]
    assert_same_model(reference, run_dir, STEPS)


def test_a_bad_config_fails_the_job_instead_of_restarting(tmp_path):
    """Exit 2 (a bad config, the same in a restarted pod) stays below 128: ExitCode fails the job."""
    job = manifest("pytorchjob.yaml")
    spec = _pod_spec(job, "Master")
    bad = {**spec, "template": {"spec": {"containers": [{**_container(spec), "command": _container(spec)["command"]
                                                          + ["data.batch_size=-1"]}]}}}
    job = {**job, "spec": {"pytorchReplicaSpecs": {"Master": bad}}}
    (rc, log), = Pods(job, str(tmp_path / "runs"), str(tmp_path)).wait()
    assert rc == 2 and "error: data.batch_size=-1: must be > 0" in log, log[-2000:]
