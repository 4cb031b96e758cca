"""The Dockerfile's text: its pins stay in step with the project, its two flavours differ only by
build args, and it copies the project but no host files (no engine needed: the file is parsed;
tests/tools/test_image.py builds and runs the cpu flavour).

torch, triton and hydra-core must equal pyproject.toml's pins, Horovod the installer's version;
the default base image is a CUDA 12 devel image whose CUDA matches the torch wheel index; Horovod is
built by scripts/install_horovod.sh with NCCL (and MPI) by default; DALI, ssh and the project are
installed; scripts/build_image.sh's cpu build args are ARGs of the file.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


DOCKERFILE = _read("Dockerfile")
# Dockerfile instructions with their line continuations joined
INSTRUCTIONS = [re.sub(r"\\\n", " ", m) for m in
                re.findall(r"^(?!#)[A-Z]+ (?:.*\\\n)*.*$", DOCKERFILE, flags=re.M)]


def _args() -> dict[str, str]:
    out = {}
    for ins in INSTRUCTIONS:
        m = re.match(r"ARG (\w+)=(\S+)", ins)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _pyproject_pins() -> dict[str, str]:
    try:
        import tomllib
        deps = tomllib.loads(_read("pyproject.toml"))["project"]["dependencies"]
    except ModuleNotFoundError:  # python 3.10: read the dependency strings directly
        deps = re.findall(r'^\s*"([^"]+)",?\s*$', _read("pyproject.toml"), flags=re.M)
    pins = {}
    for d in deps:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*==\s*([^;\s]+)", d)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


ARGS = _args()
PINS = _pyproject_pins()


@pytest.mark.parametrize("package, arg", [("torch", "TORCH_VERSION"), ("triton", "TRITON_VERSION"),
                                          ("hydra-core", "HYDRA_CORE_VERSION"),
                                          ("nvidia-dali-cuda120", "DALI_VERSION")])
def test_pins_equal_pyproject(package, arg):
    assert package in PINS, f"pyproject.toml no longer pins {package}"
    assert ARGS.get(arg) == PINS[package], f"Dockerfile ARG {arg}={ARGS.get(arg)} but pyproject pins {package}=={PINS[package]}"


def test_horovod_version_equals_installer():
    m = re.search(r"^HVD_VERSION=(\S+)", _read("scripts", "install_horovod.sh"), flags=re.M)
    assert m and ARGS.get("HOROVOD_VERSION") == m.group(1)


def test_pinned_args_are_used():
    run = "\n".join(i for i in INSTRUCTIONS if i.startswith("RUN"))
    assert '"torch==${TORCH_VERSION}"' in run and '"triton==${TRITON_VERSION}"' in run
    assert '"hydra-core==${HYDRA_CORE_VERSION}"' in run and "nvidia-dali-cuda120==${DALI_VERSION}" in run
    assert "horovod.__version__ == '${HOROVOD_VERSION}'" in run
    used = set(re.findall(r"\$\{(\w+)\}", "\n".join(INSTRUCTIONS)))
    defined = set(ARGS) | set(re.findall(r"(\w+)=", " ".join(i for i in INSTRUCTIONS if i.startswith("ENV"))))
    assert used - defined - {"PATH"} == set(), f"undefined build variables: {used - defined}"


def test_cuda12_devel_base_matches_torch_wheel_index():
    image = ARGS["BASE_IMAGE"]
    assert [i for i in INSTRUCTIONS if i.startswith("FROM")] == ["FROM ${BASE_IMAGE}"]
    m = re.fullmatch(r"nvidia/cuda:12\.(\d+)\.\d+-(?:cudnn-)?devel-ubuntu\d+\.\d+", image)
    assert m, f"base image {image} is not a CUDA 12.x devel image (nvcc is needed to build Horovod)"
    assert ARGS["TORCH_CUDA"] == f"cu12{m.group(1)}", (image, ARGS["TORCH_CUDA"])
    assert "download.pytorch.org/whl/${TORCH_CUDA}" in DOCKERFILE


def test_horovod_built_with_nccl_mpi_and_tools_installed():
    run = "\n".join(i for i in INSTRUCTIONS if i.startswith("RUN"))
    assert ARGS["HOROVOD_GPU"] == "nccl"
    assert "HOROVOD_INSTALL_GPU=${HOROVOD_GPU}" in run and "install_horovod.sh" in run
    assert "hvd.nccl_built() == ('${HOROVOD_GPU}' == 'nccl') and hvd.gloo_built()" in run
    assert ARGS["HOROVOD_MPI"] == "1" and "hvd.mpi_built() == ('${HOROVOD_MPI}' == '1')" in run  # MPI by default
    assert 'if [ "${HOROVOD_MPI}" = 1 ]; then pkgs="$pkgs openmpi-bin libopenmpi-dev"; fi' in run
    for pkg in ("libopenmpi-dev", "openmpi-bin", "openssh-server", "openssh-client"):
        assert pkg in run, pkg
    # the dependencies and test extras from pyproject.toml, then the project itself (editable)
    assert "p['dependencies'] + p['optional-dependencies']['test']" in run and "pip install -r /tmp/requirements.txt" in run
    assert "pip install --no-deps -e ." in run and "pip install --no-deps recbole==1.2.1" in run


def test_documented_multi_node_command():
    assert "horovodrun -np 16 -H host1:8,host2:8" in DOCKERFILE
    assert "sshd -p 12345" in DOCKERFILE and "-p 12345" in DOCKERFILE


def test_dockerignore_keeps_local_envs_out():
    ignored = [x.strip() for x in _read(".dockerignore").splitlines() if x.strip() and not x.startswith("#")]
    for entry in (".venv", ".git", "outputs", "multirun", "**/__pycache__"):
        assert entry in ignored, entry
    # the RUNs mount wheelhouse/ from the context: an ignored one would be empty in the build
    assert not any(e.strip("/*").startswith("wheelhouse") for e in ignored), ignored


def _build_args(flavour: str) -> dict[str, str]:
    """The --build-arg NAME=VALUE that scripts/build_image.sh passes for a flavour."""
    script = _read("scripts", "build_image.sh")
    m = re.search(rf"^  {flavour}\)\n(.*?);;", script, flags=re.M | re.S)
    assert m, f"build_image.sh has no {flavour}) case"
    return dict(re.findall(r'--build-arg "?(\w+)=([^"\s)]+)', m.group(1)))


def test_flavours_differ_only_by_build_args():
    """One FROM, the cpu flavour's values given as build args of ARGs the file has, every ARG used."""
    cpu = _build_args("cpu")
    assert set(cpu) == {"BASE_IMAGE", "TORCH_CUDA", "HOROVOD_GPU", "WHEELHOUSE", "HOROVOD_MPI"}, cpu
    assert set(cpu) <= set(ARGS) | {"HOROVOD_BUILD_CUDA_CC_LIST"}, set(cpu) - set(ARGS)
    assert cpu["TORCH_CUDA"] == "cpu" and cpu["HOROVOD_GPU"] == "cpu" and cpu["WHEELHOUSE"] == "1"
    assert cpu["HOROVOD_MPI"] == "$MPI"  # HOROVOD_MPI=1 bash scripts/build_image.sh cpu: + Open MPI (else Gloo only)
    assert _build_args("cuda") == {}  # the defaults are the CUDA image
    text = "\n".join(INSTRUCTIONS)
    for arg in ARGS:
        assert f"${{{arg}}}" in text or f"${{{arg}:-" in text, f"ARG {arg} is never used"
    # no instruction names a flavour: what differs comes from the args
    assert not re.search(r"nvidia/cuda|cu12\d", "\n".join(i for i in INSTRUCTIONS if not i.startswith("ARG")))


def test_wheelhouse_is_mounted_never_copied():
    """Every RUN that runs pip sees wheelhouse/ as a build-time mount (no layer keeps the wheels);
    WHEELHOUSE=1 makes pip use only it, and the last RUN takes that setting away again."""
    runs = [i for i in INSTRUCTIONS if i.startswith("RUN")]
    for r in runs:
        if re.search(r"\bpip install\b|install_horovod\.sh", r):
            assert r.startswith("RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse "), r[:120]
    assert not any(i.startswith(("COPY", "ADD")) and "wheelhouse" in i for i in INSTRUCTIONS)
    assert "no-index = true" in runs[0] and "find-links = /wheelhouse" in runs[0]
    assert "rm -f ${VIRTUAL_ENV}/pip.conf" in runs[-1]


def test_every_tracked_top_level_entry_is_copied_or_left_out_on_purpose():
    """The project is copied by name (not `COPY . .`, which would take wheelhouse/ too): a new
    top-level directory must be added to the list or to the ones the image does without."""
    left_out = {".ci", ".gitignore", ".dockerignore", "Dockerfile", "wheelhouse"}
    copied = set()
    for i in INSTRUCTIONS:
        if i.startswith("COPY ") and "--from" not in i:
            copied |= {p.rstrip("/") for p in i.split()[1:-1]}
    assert "." not in copied, "COPY . would put wheelhouse/ into the image"
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    top = {p.split("/")[0] for p in tracked.splitlines()}
    assert top - copied - left_out == set(), f"neither copied into the image nor left out: {top - copied - left_out}"


def test_build_script_usage():
    """build_image.sh takes cpu or cuda: anything else is a usage error (exit 2) before any work."""
    for args in ([], ["gpu"]):
        r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_image.sh"), *args],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "usage: build_image.sh cpu|cuda" in r.stderr, (args, r.returncode, r.stderr)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_image.sh"), "--help"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "hybrid-trainer:cpu" in r.stdout and "mmdebstrap" in r.stdout, r.stdout


def test_build_script_reads_the_dockerfiles_apt_packages():
    """The cpu base is made with the packages of the Dockerfile's first RUN (so that RUN skips apt)."""
    first = next(i for i in INSTRUCTIONS if i.startswith("RUN"))
    m = re.match(r'RUN pkgs="([^"]+)"', first)
    assert m, first[:80]
    pkgs = m.group(1).split()
    assert {"python3-venv", "openssh-server", "build-essential", "cmake"} <= set(pkgs)  # Open MPI's: by HOROVOD_MPI
    assert "if ! dpkg -s $pkgs" in first
    script = _read("scripts", "build_image.sh")
    assert "RUN pkgs=" in script and '--include="$(IFS=,; echo "${APT[*]}")"' in script
