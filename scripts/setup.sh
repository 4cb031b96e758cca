#!/usr/bin/env bash
# One-shot setup on a fresh machine: a virtualenv in .venv with the project (editable) and its test
# extras, torch 2.13.0 (CPU wheel from local disk where present), triton, NVIDIA DALI (~20 s),
# recbole --no-deps (MovieLens-100K files), and Horovod 0.28.1 built
# with the C++17 fix (cached wheel; scripts/install_horovod.sh). Idempotent: a second run takes
# seconds. Set SKIP_HOROVOD=1 to skip Horovod. As root with apt-get, also openssh-server (quietly;
# never fails the setup) for the emulated multi-host runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
echo "[setup] installing the project and its test extras"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 \
  | grep -v "^WARNING: Location" || true
echo "[setup] MovieLens-100K: recbole==1.2.1 without its dependencies (only its dataset files are used)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps recbole==1.2.1 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, hydra, trainer, kernels; print('[setup] torch', torch.__version__)"
.venv/bin/python -c "import importlib.util as u, sys; from trainer.data.movielens import locate; locate(None); \
sys.exit(0 if sys.platform != 'linux' or u.find_spec('nvidia.dali') else '[setup] DALI is missing')"
if [ "${SKIP_HOROVOD:-0}" != 1 ]; then
  PYTHON=.venv/bin/python bash scripts/install_horovod.sh
fi
# sshd for the emulated multi-host runs (horovodrun over ssh between network namespaces:
# dev/netcluster.py, tests/test_multihost.py): Debian's openssh-server, only as root with
# apt-get, quietly; never fails the setup (the cluster installs it on demand too).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! [ -x /usr/sbin/sshd ]; then
  echo "[setup] installing openssh-server (sshd for the emulated multi-host tests)"
  export DEBIAN_FRONTEND=noninteractive
  { timeout 600 apt-get install -y -q --no-install-recommends openssh-server >/dev/null 2>&1 \
    || { timeout 300 apt-get update -q >/dev/null 2>&1 \
         && timeout 600 apt-get install -y -q --no-install-recommends openssh-server >/dev/null 2>&1; }; } \
    || echo "[setup] openssh-server could not be installed (the multi-host test will try again)"
fi
echo "[setup] done"
