# syntax=docker/dockerfile:1
# Hybrid-parallel embedding trainer for GPU clusters: CUDA 12 + the CUDA build of torch, Horovod 0.28.1
# built with NCCL (GPU collectives) + Gloo + Open MPI (controllers), DALI, Triton, Hydra, this project.
#
# Build (no GPU needed to build; CUDA kernels are compiled by nvcc from the devel image):
#   docker build -t hybrid-trainer .
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#                --build-arg TORCH_CUDA=cu126 -t hybrid-trainer:cu126 .   # keep the two in step
#
# One node, 8 GPUs:
#   docker run --rm --gpus all --ipc host -v /data:/data hybrid-trainer \
#     horovodrun -np 8 -H localhost:8 python -m trainer comm=horovod train.device=cuda \
#       data=criteo_like hydra.run.dir=/data/runs/one-node
#
# Multi-node (2 nodes x 8 GPUs): horovodrun on host1 starts the remote ranks over ssh, so every
# container runs sshd (port 12345 here, host networking) and trusts one shared key pair:
#   # once, on the machine you launch from: a key pair for the containers
#   ssh-keygen -t ed25519 -N "" -f ~/ht-ssh/id_ed25519 && cp ~/ht-ssh/id_ed25519.pub ~/ht-ssh/authorized_keys
#   # copy ~/ht-ssh to host1 and host2, then on EVERY node (host1 and host2):
#   docker run -d --name ht --gpus all --network host --ipc host \
#     -v ~/ht-ssh:/root/.ssh-mount:ro -v /shared/runs:/runs hybrid-trainer \
#     bash -c 'install -m 700 -d /root/.ssh && install -m 600 /root/.ssh-mount/* /root/.ssh/ \
#              && /usr/sbin/sshd -p 12345 && sleep infinity'
#   # then on host1 only (rank 0 runs there; /runs must be shared storage or rank 0's disk):
#   docker exec -it ht horovodrun -np 16 -H host1:8,host2:8 -p 12345 \
#     python -m trainer comm=horovod train.device=cuda data=criteo_like hydra.run.dir=/runs/r1
#   # a staleness sweep, every job in the same 16 processes, one after the other:
#   docker exec -it ht horovodrun -np 16 -H host1:8,host2:8 -p 12345 \
#     python -m trainer -m comm=horovod train.device=cuda optim.lr=0.01,0.1 hydra.sweep.dir=/runs/sweep1
# Add --mpi to use Open MPI instead of Gloo as the controller (NCCL moves the GPU data either
# way); on hosts with several NICs pin them: --network-interface eth0, NCCL_SOCKET_IFNAME=eth0.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# Pins: tests/test_dockerfile.py keeps these equal to pyproject.toml and scripts/install_horovod.sh.
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ARG TRITON_VERSION=3.7.1
ARG HYDRA_CORE_VERSION=1.3.8
ARG HOROVOD_VERSION=0.28.1
ARG DALI_VERSION=2.4.0
# GPU archs of Horovod's CUDA kernels, e.g. "80,90"; unset = every arch this nvcc supports (slower build)
ARG HOROVOD_BUILD_CUDA_CC_LIST

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/cuda/bin:${PATH} \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    HOROVOD_WHEEL_CACHE=/opt/horovod-wheels

# Toolchain for the Horovod build (cmake 3.28 < 4, as horovod's third_party needs), Open MPI (so
# Horovod is built with MPI too), ssh for multi-node horovodrun.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv build-essential cmake git ca-certificates curl \
        openmpi-bin libopenmpi-dev openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /run/sshd \
    && printf 'Host *\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n' \
        >> /etc/ssh/ssh_config \
    && sed -i 's/^#\?PermitRootLogin .*/PermitRootLogin prohibit-password/' /etc/ssh/sshd_config \
    && python3 -m venv ${VIRTUAL_ENV} && pip install -q --upgrade pip wheel setuptools

# The CUDA build of torch (matching the image's CUDA 12.x), Triton, DALI, Hydra.
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
    && pip install "triton==${TRITON_VERSION}" "hydra-core==${HYDRA_CORE_VERSION}" \
        "nvidia-dali-cuda120==${DALI_VERSION}" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__; \
assert torch.version.cuda and torch.version.cuda.startswith('12'), torch.version.cuda"

# Horovod 0.28.1 from the sdist with the C++17 fix, NCCL + Gloo + MPI (mpicxx is present).
COPY scripts/install_horovod.sh /tmp/install_horovod.sh
RUN if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then unset HOROVOD_BUILD_CUDA_CC_LIST; fi \
    && PYTHON=${VIRTUAL_ENV}/bin/python HOROVOD_INSTALL_GPU=nccl bash /tmp/install_horovod.sh \
    && python -c "import horovod, horovod.torch as hvd; \
assert horovod.__version__ == '${HOROVOD_VERSION}', horovod.__version__; \
assert hvd.nccl_built() and hvd.gloo_built() and hvd.mpi_built(), 'horovod flavour'" \
    && rm -rf ${HOROVOD_WHEEL_CACHE} /tmp/install_horovod.sh

# The project (editable, with its test extras) and recbole's MovieLens-100K files (--no-deps: only
# the data is used), last so code changes rebuild only this layer.
WORKDIR /workspace/hybrid-trainer
COPY . .
RUN pip install -e ".[test]" \
    && pip install --no-deps recbole==1.2.1 \
    && python -c "import torch, trainer, kernels; print('torch', torch.__version__)" \
    && horovodrun --check-build

CMD ["bash"]
