# syntax=docker/dockerfile:1
# Hybrid-parallel embedding trainer, two flavours of one file (the differences are build args only):
#   cuda (default): CUDA 12 devel + the CUDA build of torch, Horovod 0.28.1 built with NCCL (GPU
#                   collectives) + Gloo + Open MPI (controllers), DALI, Triton, Hydra, this project;
#   cpu:            a Debian bookworm base + the CPU build of torch, Horovod with Gloo + Open MPI.
#
# Build (no GPU needed; scripts/build_image.sh cpu|cuda does this with podman or docker):
#   docker build -t hybrid-trainer:cuda .
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#                --build-arg TORCH_CUDA=cu126 -t hybrid-trainer:cu126 .   # keep the two in step
#   docker build --build-arg BASE_IMAGE=debian:bookworm --build-arg TORCH_CUDA=cpu \
#                --build-arg HOROVOD_GPU=cpu -t hybrid-trainer:cpu .
# Offline (air-gapped; what build_image.sh cpu does): put every wheel into wheelhouse/ (and
# horovod-0.28.1.tar.gz, or a prebuilt Horovod wheel under wheelhouse/horovod/<cache key>/, the
# layout of scripts/install_horovod.sh's cache) and add --build-arg WHEELHOUSE=1 --network none:
# pip then installs with --no-index --find-links, and a base that already has the apt packages
# below needs no apt-get either.
#
# One node, 8 GPUs:
#   docker run --rm --gpus all --ipc host -v /data:/data hybrid-trainer:cuda \
#     horovodrun -np 8 -H localhost:8 python -m trainer comm=horovod \
#       data=criteo_like hydra.run.dir=/data/runs/one-node
#
# Multi-node (2 nodes x 8 GPUs): horovodrun on host1 starts the remote ranks over ssh, so every
# container runs sshd (port 12345 here, host networking) and trusts one shared key pair; ssh
# refuses a key directory that other users can write to, and the key files must belong to root
# inside the container (install copies them with the right owner and modes); the image has no
# host keys (every container would share them): ssh-keygen -A makes each container's own:
#   # once, on the machine you launch from: a key pair for the containers
#   mkdir -p ~/ht-ssh && ssh-keygen -q -t ed25519 -N "" -f ~/ht-ssh/id_ed25519 \
#     && cp ~/ht-ssh/id_ed25519.pub ~/ht-ssh/authorized_keys
#   # copy ~/ht-ssh to host1 and host2, then on EVERY node (host1 and host2):
#   docker run -d --name ht --gpus all --network host --ipc host \
#     -v ~/ht-ssh:/root/.ssh-mount:ro -v /shared/runs:/runs hybrid-trainer:cuda \
#     bash -c 'install -m 700 -d /root/.ssh && install -m 600 /root/.ssh-mount/* /root/.ssh/ \
#              && ssh-keygen -A && /usr/sbin/sshd -p 12345 && exec sleep infinity'
#   # then on host1 only (rank 0 runs there; /runs must be storage both nodes share, since every
#   # rank writes its shard of a checkpoint there):
#   docker exec ht horovodrun -np 16 -H host1:8,host2:8 -p 12345 \
#     python -m trainer comm=horovod data=criteo_like hydra.run.dir=/runs/r1
#   # a staleness sweep, every job in the same 16 processes, one after the other:
#   docker exec ht horovodrun -np 16 -H host1:8,host2:8 -p 12345 \
#     python -m trainer -m comm=horovod optim.lr=0.01,0.1 hydra.sweep.dir=/runs/sweep1
# No -it on the exec: it fails without a terminal (from a script, a scheduler). host1 and host2 are
# names that every container resolves to the nodes (with --network host: the hosts' own names).
# Horovod is built with MPI here, so horovodrun's default controller is Open MPI; --gloo picks
# Gloo (NCCL moves the GPU data either way). Commands that sshd starts (the remote side of
# horovodrun, or your own ssh) do not see the image's ENV: /etc/environment gives them its PATH
# (the venv first) and Open MPI's permission to run as root. On hosts with several NICs pin them:
# --network-interface eth0, NCCL_SOCKET_IFNAME=eth0.
# tests/tools/test_image.py runs this recipe for the cpu flavour: two containers on one podman network.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${BASE_IMAGE}

# Pins: tests/tools/test_dockerfile.py keeps these equal to pyproject.toml and scripts/install_horovod.sh.
ARG TORCH_VERSION=2.13.0
# torch's wheel index under download.pytorch.org/whl/: cu128 matches the default CUDA base; cpu
ARG TORCH_CUDA=cu128
ARG TRITON_VERSION=3.7.1
ARG HYDRA_CORE_VERSION=1.3.8
ARG HOROVOD_VERSION=0.28.1
ARG DALI_VERSION=2.4.0
# Horovod's GPU operations: nccl (CUDA flavour) or cpu (Gloo + MPI only)
ARG HOROVOD_GPU=nccl
# GPU archs of Horovod's CUDA kernels, e.g. "80,90"; unset = every arch this nvcc supports (slower build)
ARG HOROVOD_BUILD_CUDA_CC_LIST
# 1: pip installs only from wheelhouse/ (--no-index --find-links), no package index needed
ARG WHEELHOUSE=0
# 1: Horovod with Open MPI besides Gloo (the CUDA flavour's default); 0: Gloo only, the same build as
# scripts/setup.sh's on a host, so the cpu flavour installs the host's cached wheel instead of
# compiling Horovod in the image (26 min on two cores)
ARG HOROVOD_MPI=1

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    HOROVOD_WHEEL_CACHE=/opt/horovod-wheels

# Toolchain for the Horovod build (cmake 3.x < 4, as horovod's third_party needs), Open MPI (so
# Horovod is built with MPI too), ssh for multi-node horovodrun. A base that has them all (the cpu
# flavour's, made by mmdebstrap) skips apt-get. sshd's sessions get the image's PATH and Open MPI's
# root permission from /etc/environment.
RUN pkgs="python3 python3-dev python3-venv build-essential cmake git ca-certificates curl \
          openssh-client openssh-server" \
    && if [ "${HOROVOD_MPI}" = 1 ]; then pkgs="$pkgs openmpi-bin libopenmpi-dev"; fi \
    && if ! dpkg -s $pkgs >/dev/null 2>&1; then \
         apt-get update && apt-get install -y --no-install-recommends $pkgs \
         && rm -rf /var/lib/apt/lists/*; fi \
    && mkdir -p /run/sshd \
    && printf 'Host *\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n' \
        >> /etc/ssh/ssh_config \
    && sed -i 's/^#\?PermitRootLogin .*/PermitRootLogin prohibit-password/' /etc/ssh/sshd_config \
    && rm -f /etc/ssh/ssh_host_*_key* \
    && printf 'PATH=%s\nOMPI_ALLOW_RUN_AS_ROOT=1\nOMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1\n' "${PATH}" > /etc/environment \
    && python3 -m venv ${VIRTUAL_ENV} \
    && if [ "${WHEELHOUSE}" = 1 ]; then \
         printf '[global]\nno-index = true\nfind-links = /wheelhouse\n' > ${VIRTUAL_ENV}/pip.conf; fi

# torch (the CUDA or CPU build, by TORCH_CUDA), Triton, DALI, Hydra.
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    pip install -q --upgrade pip wheel setuptools \
    && pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
    && pip install "triton==${TRITON_VERSION}" "hydra-core==${HYDRA_CORE_VERSION}" \
        "nvidia-dali-cuda120==${DALI_VERSION}" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__; \
cuda = '${TORCH_CUDA}' != 'cpu'; \
assert (torch.version.cuda or '').startswith('12') if cuda else torch.version.cuda is None, torch.version.cuda"

# Horovod 0.28.1 from the sdist with the C++17 fix, Gloo + MPI (mpicxx is present) and NCCL in the
# CUDA flavour; a wheel for the same key in wheelhouse/horovod/ is installed instead of building.
# The wheel stays in /opt/horovod-wheels (18 MB) for scripts/build_image.sh to cache.
COPY scripts/install_horovod.sh /tmp/install_horovod.sh
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then unset HOROVOD_BUILD_CUDA_CC_LIST; fi \
    && mkdir -p ${HOROVOD_WHEEL_CACHE} \
    && if [ -d /wheelhouse/horovod ]; then cp -r /wheelhouse/horovod/. ${HOROVOD_WHEEL_CACHE}/; fi \
    && if [ -f /wheelhouse/horovod-${HOROVOD_VERSION}.tar.gz ]; then \
         export HOROVOD_SDIST=/wheelhouse/horovod-${HOROVOD_VERSION}.tar.gz; fi \
    && PYTHON=${VIRTUAL_ENV}/bin/python HOROVOD_INSTALL_GPU=${HOROVOD_GPU} bash /tmp/install_horovod.sh \
    && python -c "import horovod, horovod.torch as hvd; \
assert horovod.__version__ == '${HOROVOD_VERSION}', horovod.__version__; \
assert hvd.nccl_built() == ('${HOROVOD_GPU}' == 'nccl') and hvd.gloo_built() \
    and hvd.mpi_built() == ('${HOROVOD_MPI}' == '1'), 'horovod flavour'" \
    && rm -rf ${HOROVOD_WHEEL_CACHE}/logs ${HOROVOD_WHEEL_CACHE}/sdist ${HOROVOD_WHEEL_CACHE}/.lock-* /tmp/install_horovod.sh

# The project (editable) with its dependencies and test extras (tests/ and scripts/gpu_check.sh run
# in the image) and recbole's MovieLens-100K files (--no-deps: only the data is used). The
# dependencies first, read from pyproject.toml alone, so that a code change reinstalls only the
# project. Listed, not `COPY . .`: wheelhouse/ and the rest stay out (tests/tools/test_dockerfile.py
# checks the list against the repository).
WORKDIR /workspace/hybrid-trainer
COPY pyproject.toml ./
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['test']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps recbole==1.2.1 \
    && rm /tmp/requirements.txt
COPY README.md ./
COPY conf/ conf/
COPY kernels/ kernels/
COPY trainer/ trainer/
COPY scripts/ scripts/
COPY benchmarks/ benchmarks/
COPY dev/ dev/
COPY docs/ docs/
COPY deploy/ deploy/
COPY tests/ tests/
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    pip install --no-deps -e . \
    && rm -f ${VIRTUAL_ENV}/pip.conf \
    && python -c "import torch, trainer, kernels; print('torch', torch.__version__)" \
    && horovodrun --check-build

CMD ["bash"]
