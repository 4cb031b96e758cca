#!/usr/bin/env bash
# One-shot setup on a fresh machine: a virtualenv in .venv with the project (editable) and its test
# extras, torch 2.13.0 (CPU wheel from local disk where present), triton, NVIDIA DALI (~20 s),
# recbole --no-deps (MovieLens-100K files), and Horovod 0.28.1 built
# with the C++17 fix (cached wheel; scripts/install_horovod.sh). Idempotent: a second run takes
# seconds. Set SKIP_HOROVOD=1 to skip Horovod.
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
echo "[setup] done"
