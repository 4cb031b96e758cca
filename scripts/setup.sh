#!/usr/bin/env bash
# One-shot setup on a fresh machine: a virtualenv in .venv with the project (editable) and its test
# extras, torch 2.13.0 (CPU wheel from local disk where present), triton, and Horovod 0.28.1 built
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
.venv/bin/python -c "import torch, hydra, trainer, kernels; print('[setup] torch', torch.__version__)"
if [ "${SKIP_HOROVOD:-0}" != 1 ]; then
  PYTHON=.venv/bin/python bash scripts/install_horovod.sh
fi
echo "[setup] done"
