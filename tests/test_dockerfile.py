"""The GPU image's pins stay in step with the project (no Docker engine here: the file is parsed).

torch, triton and hydra-core must equal pyproject.toml's pins, Horovod the installer's version;
the base image is a CUDA 12 devel image whose CUDA matches the torch wheel index; Horovod is built
by scripts/install_horovod.sh with NCCL (and MPI); DALI, ssh and the project are installed.
"""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    image = ARGS["CUDA_IMAGE"]
    assert any(i.startswith("FROM ${CUDA_IMAGE}") for i in INSTRUCTIONS)
    m = re.fullmatch(r"nvidia/cuda:12\.(\d+)\.\d+-(?:cudnn-)?devel-ubuntu\d+\.\d+", image)
    assert m, f"base image {image} is not a CUDA 12.x devel image (nvcc is needed to build Horovod)"
    assert ARGS["TORCH_CUDA"] == f"cu12{m.group(1)}", (image, ARGS["TORCH_CUDA"])
    assert "download.pytorch.org/whl/${TORCH_CUDA}" in DOCKERFILE


def test_horovod_built_with_nccl_mpi_and_tools_installed():
    run = "\n".join(i for i in INSTRUCTIONS if i.startswith("RUN"))
    assert "HOROVOD_INSTALL_GPU=nccl" in run and "install_horovod.sh" in run
    assert "hvd.nccl_built() and hvd.gloo_built() and hvd.mpi_built()" in run
    for pkg in ("libopenmpi-dev", "openmpi-bin", "openssh-server", "openssh-client"):
        assert pkg in run, pkg
    assert 'pip install -e ".[test]"' in run


def test_documented_multi_node_command():
    assert "horovodrun -np 16 -H host1:8,host2:8" in DOCKERFILE
    assert "sshd -p 12345" in DOCKERFILE and "-p 12345" in DOCKERFILE


def test_dockerignore_keeps_local_envs_out():
    ignored = _read(".dockerignore").split()
    for entry in (".venv", ".git", "outputs", "multirun"):
        assert entry in ignored, entry
