#!/usr/bin/env bash
# One-shot setup on a fresh machine: a virtualenv in .venv with the project (editable) and its test
# extras, torch 2.13.0 (CPU wheel from local disk where present), triton, NVIDIA DALI (~20 s),
# recbole --no-deps (MovieLens-100K files), and Horovod 0.28.1 built
# with the C++17 fix (cached wheel; scripts/install_horovod.sh). Idempotent: a second run takes
# seconds. Set SKIP_HOROVOD=1 to skip Horovod. As root with apt-get, also openssh-server (quietly;
# never fails the setup) for the emulated multi-host runs.
#
#   bash scripts/setup.sh            # install (or bring up to date), then check
#   bash scripts/setup.sh --check    # install nothing: check that the venv has everything (exit 1 if not)
#
# VENV=DIR uses that virtualenv instead of .venv (created there when missing); PYTHON is the
# interpreter that creates it (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=0
case "${1:-}" in
  -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  --check) CHECK=1 ;;
  "") ;;
  *) echo "error: $1: unknown argument (setup.sh [--check | --help])" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
VPY="$VENV/bin/python"

# what a finished setup has: the project imports with the venv's packages, DALI (Linux), the
# MovieLens files, Horovod (unless SKIP_HOROVOD=1); sshd is reported, never required
check() {
  [ -x "$VPY" ] || { echo "error: $VPY does not exist: run bash scripts/setup.sh" >&2; return 1; }
  SKIP_HOROVOD=${SKIP_HOROVOD:-0} "$VPY" - <<'PYEOF'
import importlib.util, os, sys
import torch, hydra, trainer, kernels  # noqa: F401,E401
from trainer.workload.data.movielens import locate
print("[setup] torch", torch.__version__)
locate(None)  # the MovieLens-100K files recbole brings
if sys.platform == "linux" and not importlib.util.find_spec("nvidia.dali"):
    sys.exit("[setup] DALI is missing")
if os.environ["SKIP_HOROVOD"] != "1":
    try:
        import horovod
        import horovod.torch as hvd
    except ImportError as exc:
        sys.exit(f"[setup] Horovod is missing ({exc}): bash scripts/install_horovod.sh")
    print("[setup] horovod", horovod.__version__, "gloo", hvd.gloo_built())
PYEOF
  if [ -x /usr/sbin/sshd ]; then echo "[setup] sshd: /usr/sbin/sshd"; else
    echo "[setup] sshd: not installed (the emulated multi-host runs install it on demand)"; fi
}

if [ "$CHECK" = 1 ]; then
  check
  echo "[setup] check passed"
  exit 0
fi
if [ ! -x "$VPY" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
echo "[setup] installing the project and its test extras"
"$VPY" -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 \
  | grep -v "^WARNING: Location" || true
echo "[setup] MovieLens-100K: recbole==1.2.1 without its dependencies (only its dataset files are used)"
"$VPY" -m pip install -q --disable-pip-version-check --no-deps recbole==1.2.1 2>&1 \
  | grep -v "^WARNING: Location" || true
if [ "${SKIP_HOROVOD:-0}" != 1 ]; then
  PYTHON="$VPY" bash scripts/install_horovod.sh
fi
# sshd for the emulated multi-host runs (horovodrun over ssh between network namespaces:
# dev/netcluster.py, tests/distributed/test_multihost.py): Debian's openssh-server, only as root with
# apt-get, quietly; never fails the setup (the cluster installs it on demand too).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! [ -x /usr/sbin/sshd ]; then
  echo "[setup] installing openssh-server (sshd for the emulated multi-host tests)"
  export DEBIAN_FRONTEND=noninteractive
  { timeout 600 apt-get install -y -q --no-install-recommends openssh-server >/dev/null 2>&1 \
    || { timeout 300 apt-get update -q >/dev/null 2>&1 \
         && timeout 600 apt-get install -y -q --no-install-recommends openssh-server >/dev/null 2>&1; }; } \
    || echo "[setup] openssh-server could not be installed (the multi-host test will try again)"
fi
check
echo "[setup] done"
