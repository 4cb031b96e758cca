#!/usr/bin/env bash
# Install Horovod 0.28.1 for the torch in $PYTHON, built from the PyPI sdist with the
# upstream C++17 fix (horovod PR #3998, merged but unreleased; 0.28.1 compiles with C++14,
# which torch >= 2.1 rejects: "#error You need C++17 to compile PyTorch").
#
# Idempotent:
#   1. horovod 0.28.1 already importable in $PYTHON, built for the same torch and flavour
#      -> nothing to do.
#   2. a wheel for the same (horovod, patch, torch, python, flavour) in the cache
#      -> pip install it (seconds).
#   3. otherwise download the sdist, patch it, build a wheel (minutes), cache it, install it.
#
# Environment:
#   PYTHON                 interpreter to install into (default: python3 on PATH)
#   HOROVOD_WHEEL_CACHE    wheel cache root (default: $HOME/.cache/hybrid-trainer/wheels)
#   HOROVOD_SDIST          use this horovod-0.28.1.tar.gz instead of `pip download`
#   HOROVOD_INSTALL_GPU    auto (default) | nccl | cpu
#                          auto = NCCL when nvcc is on PATH, torch.version.cuda is set and
#                          torch.cuda.is_available(); cpu = Gloo only.
#   HOROVOD_INSTALL_FORCE  1: ignore an existing install and the cache, rebuild
#   HOROVOD_BUILD_LOG      build log path (default: <cache>/logs/build-<key>-<time>.log)
#   HOROVOD_KEEP_BUILD_DIR 1: keep the temporary build directory
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  "") ;;
  *) echo "error: $1: unknown argument (install_horovod.sh takes none: see --help)" >&2; exit 2 ;;
esac

HVD_VERSION=0.28.1
PATCH_ID=cxx17p1            # bump when the patch set below changes: invalidates cached wheels
TAG="[install_horovod]"

log() { echo "$TAG $*"; }
die() { echo "$TAG ERROR: $*" >&2; exit 1; }

PYTHON=${PYTHON:-python3}
PY=$(command -v "$PYTHON" || true)
[[ -n "$PY" && -x "$PY" ]] || die "python interpreter '$PYTHON' not found (set PYTHON=...)"
[[ "$PY" == /* ]] || PY="$PWD/$PY"   # absolute, but not resolved: a venv's python is a symlink
CACHE_ROOT=${HOROVOD_WHEEL_CACHE:-$HOME/.cache/hybrid-trainer/wheels}
GPU_MODE=${HOROVOD_INSTALL_GPU:-auto}
FORCE=${HOROVOD_INSTALL_FORCE:-0}
NPROC=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
T0=$(date +%s)

log "python: $PY"

# ---------------------------------------------------------------- environment probe
probe=$("$PY" - <<'EOF'
import platform, sys
try:
    import torch
except Exception as e:  # noqa: BLE001
    print("ERR", repr(e)); sys.exit(0)
print("OK")
print(torch.__version__)
print(torch.version.cuda or "")
try:
    print(int(torch.cuda.is_available()))
except Exception:
    print(0)
print(sys.implementation.cache_tag)      # e.g. cpython-311
print(platform.machine())
EOF
) || die "cannot run $PY"
mapfile -t P <<<"$probe"
[[ "${P[0]}" == OK ]] || die "torch is not importable in $PY (${P[*]:1}); install torch first"
TORCH_VER=${P[1]}; TORCH_CUDA=${P[2]}; CUDA_AVAIL=${P[3]}; PY_TAG=${P[4]}; ARCH=${P[5]}
log "torch $TORCH_VER (cuda: ${TORCH_CUDA:-none}, gpu available: $CUDA_AVAIL), $PY_TAG, $ARCH"

case "$GPU_MODE" in
  auto)
    if command -v nvcc >/dev/null 2>&1 && [[ -n "$TORCH_CUDA" && "$CUDA_AVAIL" == 1 ]]; then
      GPU=nccl
    else
      GPU=cpu
      if command -v nvcc >/dev/null 2>&1; then
        log "nvcc found but torch has no CUDA (torch.version.cuda=${TORCH_CUDA:-None}) or no GPU is visible: CPU (Gloo) build"
      fi
    fi ;;
  nccl)
    [[ -n "$TORCH_CUDA" ]] || die "HOROVOD_INSTALL_GPU=nccl but torch $TORCH_VER is a CPU build"
    command -v nvcc >/dev/null 2>&1 || die "HOROVOD_INSTALL_GPU=nccl but nvcc is not on PATH"
    GPU=nccl ;;
  cpu) GPU=cpu ;;
  *) die "HOROVOD_INSTALL_GPU must be auto, nccl or cpu (got '$GPU_MODE')" ;;
esac
if command -v mpicxx >/dev/null 2>&1; then MPI=mpi; else MPI=nompi; fi

KEY="horovod-${HVD_VERSION}-${PATCH_ID}_torch-${TORCH_VER}_${PY_TAG}_${ARCH}_${GPU}_gloo_${MPI}"
KEY=${KEY//\//_}
WHEEL_DIR="$CACHE_ROOT/$KEY"
log "flavour: gpu=$GPU mpi=$MPI gloo=yes; cache key: $KEY"

# ---------------------------------------------------------------- helpers
# exits 0 when horovod $HVD_VERSION is installed, horovod.torch imports, it was built
# against this exact torch, and its NCCL/MPI build flags match the wanted flavour.
installed_ok() {
  WANT_NCCL=$([[ $GPU == nccl ]] && echo 1 || echo 0) \
  WANT_MPI=$([[ $MPI == mpi ]] && echo 1 || echo 0) \
  WANT_VER=$HVD_VERSION "$PY" - <<'EOF' >/dev/null 2>&1
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, horovod
assert horovod.__version__ == os.environ["WANT_VER"], horovod.__version__
import horovod.torch as hvd
meta = json.load(open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")))
assert meta.get("pytorch") == torch.__version__, meta
assert int(bool(hvd.nccl_built())) == int(os.environ["WANT_NCCL"])
assert int(bool(hvd.mpi_built())) == int(os.environ["WANT_MPI"])
assert hvd.gloo_built()
EOF
}

# verify [matched]: horovod.torch imports and horovodrun works; "matched": installed_ok has just
# passed (the install was already there), so it is not asked again
verify() {
  log "verifying: import horovod.torch"
  "$PY" -c "import horovod.torch as hvd; print('$TAG horovod', __import__('horovod').__version__, 'torch', __import__('torch').__version__, 'gloo_built', hvd.gloo_built(), 'nccl_built', hvd.nccl_built(), 'mpi_built', hvd.mpi_built())" \
    || die "import horovod.torch failed after install"
  [[ "${1:-}" == matched ]] || installed_ok || die "installed horovod does not match torch $TORCH_VER / flavour $GPU,$MPI"
  local bindir hvdrun
  bindir=$(dirname "$PY")
  hvdrun="$bindir/horovodrun"
  [[ -x "$hvdrun" ]] || hvdrun=$(command -v horovodrun || true)
  [[ -n "$hvdrun" ]] || die "horovodrun not found next to $PY nor on PATH"
  log "$hvdrun --check-build:"
  # horovodrun's shebang is $PY; run it through $PY anyway so a relocated venv still works
  "$PY" "$hvdrun" --check-build | sed "s/^/$TAG   /"
}

# drop the "Location ... is ignored" noise some pip configs produce; prefix the rest
pip_filter() { { grep -v "WARNING: Location '.*' is ignored" || true; } | sed "s/^/$TAG   pip: /"; }

pip_install_wheel() {
  local whl=$1
  log "pip install $(basename "$whl")"
  # --force-reinstall --no-deps: a same-version horovod built for another torch may be
  # installed, and forcing must not reinstall (or upgrade) torch & co.
  "$PY" -m pip install --disable-pip-version-check -q --force-reinstall --no-deps "$whl" 2>&1 \
    | pip_filter || die "pip install $whl failed"
  # then only the missing runtime deps (cloudpickle, cffi, psutil, pyyaml, packaging);
  # horovod's base requirements do not include torch.
  "$PY" -m pip install --disable-pip-version-check -q "$whl" 2>&1 \
    | pip_filter || die "pip install of horovod runtime deps failed"
  # hvd.broadcast_object / allgather_object call Tensor.numpy() (horovod/torch/functions.py
  # lines 240, 271) but horovod does not declare numpy.
  if ! "$PY" -c 'import numpy' 2>/dev/null; then
    "$PY" -m pip install --disable-pip-version-check -q numpy 2>&1 | pip_filter \
      || die "pip install numpy failed"
  fi
  local tv
  tv=$("$PY" -c 'import torch; print(torch.__version__)')
  [[ "$tv" == "$TORCH_VER" ]] || die "torch changed during install ($TORCH_VER -> $tv)"
}

finish() {
  verify "$@"
  log "done in $(( $(date +%s) - T0 ))s"
  exit 0
}

# ---------------------------------------------------------------- 1. already installed?
if [[ "$FORCE" != 1 ]] && installed_ok; then
  log "horovod $HVD_VERSION already installed for torch $TORCH_VER ($GPU, $MPI): nothing to do"
  finish matched
fi

mkdir -p "$CACHE_ROOT"
# Serialize concurrent installs of the same key (two CI jobs, two ranks...).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE_ROOT/.lock-$KEY"
  flock 9
fi

# ---------------------------------------------------------------- 2. cached wheel?
cached_wheel() { compgen -G "$WHEEL_DIR/horovod-${HVD_VERSION}-*.whl" | head -n1 || true; }
WHL=$(cached_wheel)
if [[ "$FORCE" != 1 && -n "$WHL" ]]; then
  log "cache hit: $WHL"
  pip_install_wheel "$WHL"
  finish
fi

# ---------------------------------------------------------------- 3. build
log "cache miss: building horovod $HVD_VERSION from sdist (takes minutes)"
LOG_FILE=${HOROVOD_BUILD_LOG:-$CACHE_ROOT/logs/build-$KEY-$(date +%Y%m%d-%H%M%S).log}
mkdir -p "$(dirname "$LOG_FILE")"
: >"$LOG_FILE"
log "build log: $LOG_FILE"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
cleanup() {
  if [[ "${HOROVOD_KEEP_BUILD_DIR:-0}" == 1 ]]; then log "build dir kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail_build() {
  echo "$TAG ERROR: $1; last 60 lines of $LOG_FILE:" >&2
  tail -n 60 "$LOG_FILE" >&2 || true
  echo "$TAG ERROR: full build log: $LOG_FILE" >&2
  exit 1
}

# build dependencies, installed into $PY only when missing
need=()
"$PY" -c 'import setuptools' 2>/dev/null || need+=("setuptools")
"$PY" -c 'import packaging' 2>/dev/null || need+=("packaging")
"$PY" -c 'import wheel' 2>/dev/null || need+=("wheel")
# setup.py imports horovod/__init__ -> horovod.runner, which needs these at build time too
"$PY" -c 'import yaml' 2>/dev/null || need+=("pyyaml")
"$PY" -c 'import cloudpickle' 2>/dev/null || need+=("cloudpickle")
"$PY" -c 'import psutil' 2>/dev/null || need+=("psutil")
cmake_ok() {
  local v
  v=$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
  [[ -n "$v" ]] && "$PY" -c "import sys; v=tuple(int(x) for x in '$v'.split('.')[:2]); sys.exit(0 if (3,13)<=v<(4,0) else 1)"
}
if ! cmake_ok; then
  # horovod needs >= 3.13; its bundled third_party (gloo, flatbuffers) declares
  # cmake_minimum_required < 3.5, which CMake 4 rejects, hence < 4.
  need+=("cmake>=3.13,<4")
  export PATH="$(dirname "$PY"):$PATH"      # where pip puts the cmake entry point
fi
if ((${#need[@]})); then
  log "installing build deps into $PY: ${need[*]}"
  "$PY" -m pip install --disable-pip-version-check -q "${need[@]}" >>"$LOG_FILE" 2>&1 \
    || fail_build "pip install ${need[*]} failed"
fi
cmake_ok || fail_build "no usable cmake (need 3.13 <= version < 4)"
export CMAKE_POLICY_VERSION_MINIMUM=3.5     # harmless on 3.x, lets CMake 4 through anyway

# sdist: $HOROVOD_SDIST, else cached copy, else pip download
SDIST_CACHE="$CACHE_ROOT/sdist"
SDIST=${HOROVOD_SDIST:-}
if [[ -z "$SDIST" && -f "$SDIST_CACHE/horovod-$HVD_VERSION.tar.gz" ]]; then
  SDIST="$SDIST_CACHE/horovod-$HVD_VERSION.tar.gz"
fi
if [[ -z "$SDIST" ]]; then
  log "pip download horovod==$HVD_VERSION (sdist)"
  mkdir -p "$WORK/dl"
  "$PY" -m pip download --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$WORK/dl" "horovod==$HVD_VERSION" >>"$LOG_FILE" 2>&1 || fail_build "pip download failed"
  SDIST="$WORK/dl/horovod-$HVD_VERSION.tar.gz"
  [[ -f "$SDIST" ]] || fail_build "pip download did not produce $SDIST"
  mkdir -p "$SDIST_CACHE" && cp "$SDIST" "$SDIST_CACHE/"
fi
[[ -f "$SDIST" ]] || die "sdist not found: $SDIST"
log "sdist: $SDIST"
tar -xzf "$SDIST" -C "$WORK" || fail_build "cannot unpack $SDIST"
SRC="$WORK/horovod-$HVD_VERSION"
[[ -f "$SRC/setup.py" ]] || fail_build "unexpected sdist layout (no $SRC/setup.py)"

# ---- the C++17 patch (upstream PR #3998) ----
# replace_once FILE SED_REGEX REPLACEMENT: fails loudly unless the pattern matches.
replace_once() {
  local f="$SRC/$1" re=$2 rep=$3
  [[ -f "$f" ]] || fail_build "patch: $1 missing"
  grep -Eq "$re" "$f" || fail_build "patch: pattern '$re' not found in $1 (sdist changed?)"
  sed -E -i "s/$re/$rep/" "$f"
  grep -Eq "$re" "$f" && fail_build "patch: pattern '$re' still present in $1"
  log "patched $1: /$re/ -> '$rep'"
}
replace_once CMakeLists.txt               '^set\(CMAKE_CXX_STANDARD 14\)' 'set(CMAKE_CXX_STANDARD 17)'
replace_once horovod/torch/CMakeLists.txt '^( *)set\(CMAKE_CXX_STANDARD 14\)' '\1set(CMAKE_CXX_STANDARD 17)'
# CUDA kernels (NCCL builds only) pin C++11; recent nvcc/gcc reject that, and every CUDA
# that torch >= 2.1 supports handles C++17.
replace_once horovod/common/ops/cuda/CMakeLists.txt '^set\(CMAKE_CUDA_STANDARD 11\)' 'set(CMAKE_CUDA_STANDARD 17)'
# Nothing else may still force C++14 (setup.py, cmake helpers, horovod's own CMakeLists).
left=$(cd "$SRC" && grep -rnE 'CMAKE_CXX_STANDARD 14|std=c\+\+14|cxx_std_14' \
         setup.py CMakeLists.txt cmake horovod 2>/dev/null || true)
[[ -z "$left" ]] || fail_build "patch incomplete, C++14 still forced at: $left"

# ---- build flags ----
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
unset HOROVOD_WITH_MPI HOROVOD_WITHOUT_MPI HOROVOD_GPU_OPERATIONS HOROVOD_GPU HOROVOD_WITHOUT_GLOO \
      HOROVOD_WITHOUT_PYTORCH HOROVOD_WITH_TENSORFLOW HOROVOD_WITH_MXNET
if [[ $MPI == mpi ]]; then export HOROVOD_WITH_MPI=1; else export HOROVOD_WITHOUT_MPI=1; fi
if [[ $GPU == nccl ]]; then
  export HOROVOD_GPU_OPERATIONS=NCCL
  # torch's CUDA wheels ship NCCL as the nvidia-nccl-cu* package (libnccl.so.2 only, no
  # libnccl.so): point horovod at it unless the user already told it where NCCL is.
  if [[ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}${HOROVOD_NCCL_LIB:-}" ]]; then
    nccl_dir=$("$PY" -c 'import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])' 2>/dev/null || true)
    if [[ -n "$nccl_dir" && -f "$nccl_dir/include/nccl.h" && -f "$nccl_dir/lib/libnccl.so.2" ]]; then
      mkdir -p "$WORK/nccl-lib"
      ln -s "$nccl_dir/lib/libnccl.so.2" "$WORK/nccl-lib/libnccl.so"
      export HOROVOD_NCCL_INCLUDE="$nccl_dir/include" HOROVOD_NCCL_LIB="$WORK/nccl-lib" HOROVOD_NCCL_LINK=SHARED
      log "using NCCL from torch's nvidia-nccl package: $nccl_dir"
    fi
  fi
fi
export MAKEFLAGS="-j$NPROC"
env | grep -E '^(HOROVOD_|MAKEFLAGS|CMAKE_)' | sort | sed "s/^/$TAG   env: /"

log "building wheel with $NPROC jobs (pip wheel --no-deps --no-build-isolation)"
TB=$(date +%s)
( cd "$SRC" && "$PY" -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation \
    -v -w "$WORK/wheelhouse" . ) >>"$LOG_FILE" 2>&1 &
bpid=$!
# heartbeat so CI does not look hung
while kill -0 "$bpid" 2>/dev/null; do
  sleep 30
  kill -0 "$bpid" 2>/dev/null || break
  prog=$(grep -oE '^ *\[ *[0-9]+%\]' "$LOG_FILE" | tail -n1 | tr -d ' ' || true)
  log "  ... building ($(( $(date +%s) - TB ))s) ${prog}"
done
wait "$bpid" || fail_build "wheel build failed"
BUILT=$(compgen -G "$WORK/wheelhouse/horovod-${HVD_VERSION}-*.whl" | head -n1 || true)
[[ -n "$BUILT" ]] || fail_build "no wheel produced"
log "built $(basename "$BUILT") in $(( $(date +%s) - TB ))s"

mkdir -p "$WHEEL_DIR"
rm -f "$WHEEL_DIR"/horovod-*.whl
cp "$BUILT" "$WHEEL_DIR/.$(basename "$BUILT").tmp"
mv "$WHEEL_DIR/.$(basename "$BUILT").tmp" "$WHEEL_DIR/$(basename "$BUILT")"
cat >"$WHEEL_DIR/BUILD_INFO" <<EOF
horovod=$HVD_VERSION patch=$PATCH_ID torch=$TORCH_VER torch_cuda=${TORCH_CUDA:-none}
python=$PY_TAG arch=$ARCH gpu=$GPU mpi=$MPI gloo=yes built=$(date -u +%FT%TZ) host=$(hostname)
log=$LOG_FILE
EOF
log "cached wheel: $WHEEL_DIR/$(basename "$BUILT")"

pip_install_wheel "$WHEEL_DIR/$(basename "$BUILT")"
finish
