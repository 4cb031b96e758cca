"""The CPU image, built and run (marker `docker`: a container engine; podman or docker).

One build per session (`scripts/build_image.sh cpu`: an mmdebstrap Debian base, a wheelhouse made on
the host, an offline build; cached, so a build with nothing changed takes seconds), then inside the
image, without a network (`--network none`):

- what is in it: torch's CPU build, Horovod with Gloo (and MPI where HOROVOD_MPI=1 built it: by default
  the cpu flavour installs the host's Gloo-only wheel rather than compile Horovod), the project; no .git, no venv from
  the host, no wheelhouse, no outputs;
- the default job (fewer steps);
- `horovodrun -np 2 -H localhost:2 --gloo` training W = 2 (the reference of the next item);
- a resume from a checkpoint the host's venv wrote into a mounted directory, equal to the host's
  uninterrupted run;
- the Dockerfile header's multi-node recipe for real: its key pair and container command, two
  containers c1 and c2 on their own internal podman network, sshd in each, `horovodrun -np 2 -H
  c1:1,c2:1 -p 12345` from c1 (Horovod's default controller: Open MPI where built, else Gloo) equal to the
  one-host run (BSP parity: every step's loss, every row, the dense model, the bytes; as
  tests/distributed/test_multihost.py), its traffic on the containers' network.

Skipped, with the reason, only where no container engine runs (`podman info` and `docker info`
fail; on Debian as root `bash scripts/install_podman.sh` installs one, as .ci/run does).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import assert_auc_close, eval_label_counts
from multihost_helpers import CFG, assert_crossed_links, assert_same_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE = "hybrid-trainer:cpu"
pytestmark = [pytest.mark.docker, pytest.mark.dist]
SSH_PORT = 12345
MPI = os.environ.get("HOROVOD_MPI", "0") == "1"  # what scripts/build_image.sh cpu builds (default: Gloo only)


def engine_or_reason() -> tuple[str | None, str]:
    """The first of podman, docker whose `info` works, else (None, why)."""
    tried = []
    for e in ("podman", "docker"):
        if shutil.which(e) is None:
            tried.append(f"no `{e}`")
            continue
        r = subprocess.run([e, "info"], capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            return e, ""
        tried.append(f"`{e} info` fails: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return None, "no container engine runs (" + "; ".join(tried) + "); as root on Debian: bash scripts/install_podman.sh"


@pytest.fixture(scope="session")
def engine() -> str:
    e, why = engine_or_reason()
    if e is None:
        pytest.skip(why)
    return e


@pytest.fixture(scope="session")
def image(engine) -> str:
    """hybrid-trainer:cpu, built once per session by scripts/build_image.sh (its caches make a
    rebuild with nothing changed take seconds)."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", "scripts/build_image.sh", "cpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=3600, env={**os.environ, "ENGINE": engine})
    assert r.returncode == 0, f"build_image.sh cpu failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert r.stdout.strip().splitlines()[-1] == IMAGE, r.stdout
    print(f"\n[image] built {IMAGE} in {time.monotonic() - t0:.0f} s: {r.stderr.strip().splitlines()[-1]}")
    return IMAGE


def run(engine: str, args: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([engine, *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, (f"{engine} {' '.join(args)} exited {r.returncode}\n--- stdout ---\n"
                                   f"{r.stdout[-3000:]}\n--- stderr ---\n{r.stderr[-5000:]}")
    return r


def in_image(engine: str, image: str, cmd: list[str], volumes: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """`ENGINE run --rm --network none [-v HOST:DIR] IMAGE CMD`."""
    vols = [a for h, c in (volumes or {}).items() for a in ("-v", f"{h}:{c}")]
    return run(engine, ["run", "--rm", "--network", "none", *vols, image, *cmd], timeout=timeout)


def last_json(stdout: str) -> dict:
    lines = [x for x in re.sub(r"(?m)^\[\d+(?:,\d+)?\]<stdout>:", "", stdout).splitlines() if x.startswith("{")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------
def test_image_holds_the_cpu_stack_and_no_host_files(engine, image):
    r = in_image(engine, image, ["bash", "-c", r"""
python - <<'EOF'
import json, horovod, horovod.torch as hvd, torch, trainer, nvidia.dali
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "horovod": horovod.__version__,
                  "gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built()), "nccl": bool(hvd.nccl_built()),
                  "trainer": trainer.__file__}))
EOF
cd /workspace/hybrid-trainer && ls -A && ls -A /wheelhouse 2>/dev/null | head -1; cat /opt/venv/pip.conf 2>/dev/null; true"""])
    info = last_json(r.stdout.split("\n", 1)[0] + "\n")
    assert info["torch"] == "2.13.0+cpu" and info["cuda"] is None, info
    assert info["horovod"] == "0.28.1" and info["gloo"] and info["mpi"] == MPI and not info["nccl"], info
    assert info["trainer"] == "/workspace/hybrid-trainer/trainer/__init__.py", info
    listing = r.stdout.split("\n")[1:]
    for entry in ("trainer", "kernels", "conf", "pyproject.toml", "scripts", "tests"):
        assert entry in listing, (entry, listing)
    for entry in (".git", ".venv", "wheelhouse", "outputs", "multirun", ".ci", "[global]"):
        assert entry not in listing, (entry, listing)
    assert not any(x.endswith(".whl") for x in listing), listing


def test_default_job_without_network(engine, image, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    r = in_image(engine, image, ["python", "-m", "trainer", "train.steps=30", "hydra.run.dir=/runs/default"],
                 volumes={str(runs): "/runs"})
    rec = last_json(r.stdout)
    assert rec["world_size"] == 1 and rec["steps"] == 30 and 0.5 < rec["eval_auc"] <= 1, rec
    assert "summary: /runs/default/summary.json" in r.stdout
    summary = json.loads((runs / "default" / "summary.json").read_text())
    assert summary["final_loss"] == pytest.approx(rec["final_loss"])


def _host_trainer(args: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _final_shard_arrays(run_dir) -> dict[str, np.ndarray]:
    root = os.path.join(run_dir, "checkpoints")
    ck = os.path.join(root, sorted(d for d in os.listdir(root) if d.startswith("step_") and ".tmp" not in d)[-1])
    with open(os.path.join(ck, "manifest.json")) as f:
        shards = json.load(f)["shards"]
    return {f"{s}/{f}": np.fromfile(os.path.join(ck, s, f"{f}.bin"), dtype=m["dtype"])
            for s, info in shards.items() for f, m in info["fields"].items()}


def test_resume_inside_from_a_checkpoint_written_outside(engine, image, tmp_path):
    """The host's venv trains 6 steps into a directory; the image, with that directory mounted
    elsewhere (/runs), continues to 12: the same model as the host's 12 uninterrupted steps."""
    cfg = [a for a in CFG if not a.startswith("train.steps=")]
    full, part = tmp_path / "full", tmp_path / "part"
    _host_trainer(["train.steps=12", f"hydra.run.dir={full}", *cfg])
    _host_trainer(["train.steps=6", f"hydra.run.dir={part}", *cfg])
    in_image(engine, image, ["python", "-m", "trainer", "train.steps=12", "checkpoint.resume=auto",
                             "hydra.run.dir=/runs/part", *cfg], volumes={str(part): "/runs/part"})
    s_full = json.loads((full / "summary.json").read_text())
    s_part = json.loads((part / "summary.json").read_text())
    assert s_part["start_step"] == 6 and s_part["resumed_from"].startswith("/runs/part/checkpoints/step_"), s_part
    assert s_part["steps"] == 12 and s_part["final_loss"] == pytest.approx(s_full["final_loss"], rel=1e-6)
    # another build of torch may sum in another order: the AUC within one (positive, negative) pair
    assert_auc_close(s_part["eval_auc"], s_full["eval_auc"], *eval_label_counts(cfg), pairs=1)
    assert s_part["eval_logloss"] == pytest.approx(s_full["eval_logloss"], rel=1e-6)
    a, b = _final_shard_arrays(full), _final_shard_arrays(part)
    assert a.keys() == b.keys() and len(a) >= 3, a.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=0, err_msg=k)


# ---------------------------------------------------------------------------------------------
# The Dockerfile header's multi-node recipe: two containers, one job


def _header_recipe() -> tuple[str, str]:
    """(the key-pair command, the container's bash -c script) as the Dockerfile's header shows them."""
    lines = []
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    header = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    keygen = re.search(r"^\s*(mkdir -p ~/ht-ssh && ssh-keygen .*)$", header, flags=re.M)
    script = re.search(r"docker run -d --name ht .*? bash -c '([^']*)'", header)
    assert keygen and script, "the Dockerfile header no longer shows the key pair and the container command"
    return keygen.group(1), script.group(1)


@pytest.fixture(scope="module")
def two_containers(engine, image, tmp_path_factory):
    """c1 and c2 on an internal network (no route out), each running the header's container command
    with the header's key pair mounted, and one /runs directory shared by both (a checkpoint is
    written by every rank)."""
    keygen, script = _header_recipe()
    tmp = tmp_path_factory.mktemp("two_containers")
    (tmp / "runs").mkdir()
    in_image(engine, image, ["bash", "-c", keygen.replace("~/ht-ssh", "/keys/ht-ssh")], volumes={str(tmp): "/keys"})
    tag = f"ht-test-{os.getpid()}"
    octet = 100 + os.getpid() % 100
    subnet, ips = f"10.89.{octet}.0/24", {"c1": f"10.89.{octet}.11", "c2": f"10.89.{octet}.12"}
    hosts = [a for name, ip in ips.items() for a in ("--add-host", f"{name}:{ip}")]
    names = []
    try:
        run(engine, ["network", "create", "--internal", "--subnet", subnet, tag])
        for name, ip in ips.items():
            run(engine, ["run", "-d", "--name", f"{tag}-{name}", "--hostname", name, "--network", tag, "--ip", ip,
                         *hosts, "-v", f"{tmp / 'ht-ssh'}:/root/.ssh-mount:ro", "-v", f"{tmp / 'runs'}:/runs",
                         image, "bash", "-c", script])
            names.append(f"{tag}-{name}")
        deadline = time.monotonic() + 60
        while True:  # both sshds answer, with the shared key, from c1
            r = run(engine, ["exec", names[0], "bash", "-c",
                             f"ssh -p {SSH_PORT} c1 true && ssh -p {SSH_PORT} c2 hostname"], check=False, timeout=60)
            if r.returncode == 0 and r.stdout.strip() == "c2":
                break
            assert time.monotonic() < deadline, f"sshd in the containers does not answer: {r.stderr[-2000:]}"
            time.sleep(1)
        yield {"engine": engine, "names": names, "runs": tmp / "runs"}
    finally:
        for n in names:
            subprocess.run([engine, "rm", "-f", "-t", "0", n], capture_output=True, timeout=120)
        subprocess.run([engine, "network", "rm", "-f", tag], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def one_host_run(engine, image, two_containers):
    """The reference: horovodrun -np 2 -H localhost:2 in one container without a network (with Gloo,
    the faster controller on one host: a W = 2 step's sums are the same under either)."""
    runs = two_containers["runs"]
    r = in_image(engine, image, ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "python", "-m", "trainer",
                                 "comm=horovod", "hydra.run.dir=/runs/local", *CFG], volumes={str(runs): "/runs"})
    rec = last_json(r.stdout)
    assert rec["world_size"] == 2 and rec["steps"] == 12, rec
    return runs / "local"


def test_horovodrun_localhost_two_workers(one_host_run):
    s = json.loads((one_host_run / "summary.json").read_text())
    assert s["world_size"] == 2 and s["backend"] == "HorovodCollectives" and s["bytes"]["rows"] > 0, s


def _tx_bytes(c: dict) -> list[dict]:
    """What each container's eth0 has sent so far."""
    return [{"tx_bytes": int(run(c["engine"], ["exec", n, "cat", "/sys/class/net/eth0/statistics/tx_bytes"]).stdout)}
            for n in c["names"]]


def test_two_containers_one_job_equals_one_host(two_containers, one_host_run):
    """horovodrun's default controller: Open MPI where the image has it (HOROVOD_MPI=1; its
    `[rank,0]<stdout>:` tags say so), else Gloo, started over ssh in the other container."""
    c = two_containers
    out = "net"
    before = _tx_bytes(c)
    r = run(c["engine"], ["exec", c["names"][0], "horovodrun", "-np", "2", "-H", "c1:1,c2:1", "-p", str(SSH_PORT),
                          "python", "-m", "trainer", "comm=horovod", f"hydra.run.dir=/runs/{out}", *CFG],
            timeout=600)
    after = _tx_bytes(c)
    if MPI:
        assert re.search(r"(?m)^\[1,0\]<stdout>:\{", r.stdout), r.stdout[-2000:]  # mpirun's tags: the MPI controller
    rec = last_json(r.stdout)
    assert rec["world_size"] == 2, rec
    summary = assert_same_training(str(one_host_run), str(c["runs"] / out))
    assert_crossed_links(before, after, summary)  # the ranks talked across the containers' network
