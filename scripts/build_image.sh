#!/usr/bin/env bash
# Build the trainer's image from the Dockerfile with podman or docker (the first whose `info` works;
# ENGINE=podman|docker picks one): hybrid-trainer:cpu or hybrid-trainer:cuda.
#
#   bash scripts/build_image.sh cpu      # Debian bookworm + CPU torch + Horovod (Gloo; HOROVOD_MPI=1: + MPI), offline
#   bash scripts/build_image.sh cuda     # CUDA 12.8 devel + CUDA torch + Horovod (NCCL + Gloo + MPI)
#   bash scripts/build_image.sh cuda --build-arg HOROVOD_BUILD_CUDA_CC_LIST=90   # more build args
#
# cpu needs no registry and no index inside the build (it runs with --network none):
#   1. the base: `mmdebstrap --variant=minbase bookworm` with the Dockerfile's apt packages, imported
#      as localhost/hybrid-trainer-base:bookworm-<hash>; its tar is cached;
#   2. the wheelhouse: every wheel the image installs, made on this host with its pip (which must
#      be Python 3.11, bookworm's), torch pinned to the +cpu build, and Horovod's sdist; cached.
#      pip finds torch's +cpu wheel where its configuration says (a local --find-links, or
#      TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu); it never takes PyPI's CUDA torch;
#   3. `build --build-arg WHEELHOUSE=1` with the wheels in wheelhouse/ (hard links): pip installs
#      with --no-index --find-links; the Horovod wheel the image builds is copied back into the
#      wheelhouse, so a build on an empty engine store installs it instead of compiling.
# cuda pulls nvidia/cuda from Docker Hub and the wheels from their indexes (a registry is needed).
# Caches: $HT_CACHE (default ~/.cache/hybrid-trainer)/image/{base,wheelhouse}. Each part is remade
# only when what it is made from changes (the package list, pyproject.toml, the pins); the engine's
# layer cache does the rest. Prints the image's size and the build's time at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG="[build_image]"
log() { echo "$TAG $*" >&2; }
die() { echo "$TAG error: $*" >&2; exit 1; }
case "${1:-}" in
  -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  cpu|cuda) FLAVOUR=$1; shift ;;
  *) echo "usage: build_image.sh cpu|cuda [extra build args]" >&2; exit 2 ;;
esac
T0=$(date +%s)

# ---------------------------------------------------------------- the engine
pick_engine() {
  local e
  for e in ${ENGINE:-podman docker}; do
    if command -v "$e" >/dev/null 2>&1 && timeout 60 "$e" info >/dev/null 2>&1; then echo "$e"; return 0; fi
  done
  return 1
}
ENG=$(pick_engine) || die "no container engine runs (tried: ${ENGINE:-podman docker}; 'podman info' / 'docker info' fail); on Debian as root: bash scripts/install_podman.sh"
log "engine: $ENG ($("$ENG" --version))"

# the Dockerfile's apt packages, read from its first RUN (one list, two users)
APT_PKGS=$(tr '\n' ' ' <Dockerfile | sed -n 's/.*RUN pkgs="\([^"]*\)".*/\1/p' | tr -d '\\' | tr -s ' ')
read -r -a APT <<<"$APT_PKGS"
((${#APT[@]} > 5)) || die "cannot read the apt packages from the Dockerfile's first RUN (got: '$APT_PKGS')"
# cpu: Horovod with Gloo only unless HOROVOD_MPI=1 (then Open MPI too, compiled in the image: the
# host's wheel is Gloo-only); the base gets Open MPI's packages only then
MPI=${HOROVOD_MPI:-0}
[[ $MPI == 0 || $MPI == 1 ]] || die "HOROVOD_MPI must be 0 or 1, not '$MPI'"
if [[ $FLAVOUR == cpu && $MPI == 1 ]]; then APT+=(openmpi-bin libopenmpi-dev); fi
arg() { sed -n "s/^ARG $1=\(.*\)$/\1/p" Dockerfile | head -n1; }
TORCH_VERSION=$(arg TORCH_VERSION); HOROVOD_VERSION=$(arg HOROVOD_VERSION)
CACHE=${HT_CACHE:-$HOME/.cache/hybrid-trainer}
STAGE=wheelhouse   # the build context's wheel directory (git keeps only its README)

hash_of() { sha256sum | cut -c1-12; }

# ---------------------------------------------------------------- cpu: base image
make_base() {
  local suite=bookworm key tar ref
  key=$(printf '%s\n' "$suite" minbase "${APT[@]}" | hash_of)
  ref=localhost/hybrid-trainer-base:$suite-$key
  BASE=$ref
  if "$ENG" image inspect "$ref" >/dev/null 2>&1; then log "base: $ref (in the engine)"; return; fi
  tar=$CACHE/image/base/$suite-$key.tar
  if [ ! -s "$tar" ]; then
    command -v mmdebstrap >/dev/null || die "mmdebstrap is missing (apt-get install mmdebstrap; or bash scripts/install_podman.sh)"
    mkdir -p "$(dirname "$tar")"
    log "base: mmdebstrap --variant=minbase $suite + ${APT[*]} (about a minute)"
    local t=$(date +%s)
    mmdebstrap --quiet --variant=minbase --format=tar --include="$(IFS=,; echo "${APT[*]}")" \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
      "$suite" "$tar.tmp" || die "mmdebstrap failed"
    mv "$tar.tmp" "$tar"
    log "base: $tar ($(du -h "$tar" | cut -f1), $(( $(date +%s) - t )) s)"
  fi
  "$ENG" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' "$tar" "$ref" >/dev/null || die "$ENG import $tar failed"
  log "base: imported $ref"
}

# ---------------------------------------------------------------- cpu: wheelhouse
HPY=${PYTHON:-python3}
requirements() {
  # pyproject's dependencies and test extras, what the Dockerfile installs besides, Horovod's
  # runtime and build dependencies; torch is pinned to its CPU build by the constraint
  "$HPY" - "$TORCH_VERSION" <<'EOF'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(p["dependencies"]) + list(p["optional-dependencies"]["test"])
reqs += ["pip", "setuptools", "wheel", "packaging", "pyyaml", "cloudpickle", "psutil", "cffi", "numpy"]
print("\n".join(reqs))
EOF
}
# pip's "Location ... is ignored" noise (local index configs) left out
pip_filter() { { grep -v "^WARNING: Location '.*' is ignored" || true; } >&2; }
make_wheelhouse() {
  "$HPY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "the wheelhouse is made with this host's pip for the image's Python 3.11 (bookworm's): $HPY is $("$HPY" --version 2>&1); set PYTHON=python3.11"
  local key wh t
  key=$( { requirements; echo "torch==$TORCH_VERSION+cpu recbole==1.2.1 horovod==$HOROVOD_VERSION"; } | hash_of)
  wh=$CACHE/image/wheelhouse/cpu-$key
  WH=$wh
  if [ -f "$wh/COMPLETE" ]; then log "wheelhouse: $wh ($(ls "$wh" | grep -c '\.whl$') wheels)"; return; fi
  log "wheelhouse: pip wheel on this host into $wh (minutes the first time)"
  t=$(date +%s)
  rm -rf "$wh.tmp" && mkdir -p "$wh.tmp"
  requirements >"$wh.tmp/requirements.txt"
  # the constraint keeps pip from ever choosing a CUDA torch (several GB): only the +cpu build fits
  echo "torch==$TORCH_VERSION+cpu" >"$wh.tmp/constraints.txt"
  "$HPY" -m pip wheel -q --disable-pip-version-check -w "$wh.tmp" -c "$wh.tmp/constraints.txt" \
    -r "$wh.tmp/requirements.txt" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} 2>&1 \
    | pip_filter || die "pip wheel failed (see above)"
  "$HPY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wh.tmp" recbole==1.2.1 2>&1 \
    | pip_filter || die "pip wheel recbole failed"
  ls "$wh.tmp" | grep -q "^torch-$TORCH_VERSION+cpu-" || die "the wheelhouse has no torch $TORCH_VERSION+cpu wheel"
  local sdist=$CACHE/wheels/sdist/horovod-$HOROVOD_VERSION.tar.gz
  if [ -f "$sdist" ]; then cp "$sdist" "$wh.tmp/"; else
    "$HPY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$wh.tmp" \
      "horovod==$HOROVOD_VERSION" || die "pip download horovod failed"
  fi
  date -u +%FT%TZ >"$wh.tmp/COMPLETE"
  rm -rf "$wh" && mv "$wh.tmp" "$wh"
  log "wheelhouse: $(ls "$wh" | grep -c '\.whl$') wheels, $(du -sh "$wh" | cut -f1), $(( $(date +%s) - t )) s"
}

# wheelhouse/ in the context: hard links to the cache (a copy across filesystems), with the Horovod
# wheels scripts/install_horovod.sh cached on this host (the image installs one whose key, the
# same script's, matches: Gloo-only on CPU, as setup.sh builds it)
stage_wheelhouse() {
  find "$STAGE" -mindepth 1 ! -name README.md -exec rm -rf {} +
  [ -n "${1:-}" ] || return 0
  cp -al "$1"/. "$STAGE"/ 2>/dev/null || cp -a "$1"/. "$STAGE"/
  rm -f "$STAGE/COMPLETE" "$STAGE/requirements.txt" "$STAGE/constraints.txt"
  local d
  for d in "$CACHE"/wheels/horovod-*/; do
    [ -d "$d" ] && ls "$d"*.whl >/dev/null 2>&1 || continue
    d=${d%/}
    [ -d "$STAGE/horovod/${d##*/}" ] && continue
    mkdir -p "$STAGE/horovod"
    cp -a "$d" "$STAGE/horovod/" && log "wheelhouse: the host's Horovod wheel ${d##*/}"
  done
}

# ---------------------------------------------------------------- build
BUILD_ARGS=()
case $FLAVOUR in
  cpu)
    make_base
    make_wheelhouse
    stage_wheelhouse "$WH"
    BUILD_ARGS=(--network none --build-arg "BASE_IMAGE=$BASE" --build-arg TORCH_CUDA=cpu
                --build-arg HOROVOD_GPU=cpu --build-arg WHEELHOUSE=1 --build-arg "HOROVOD_MPI=$MPI") ;;
  cuda)
    stage_wheelhouse "" ;;
esac
IMAGE=hybrid-trainer:$FLAVOUR
log "$ENG build -t $IMAGE ${BUILD_ARGS[*]} $*"
TB=$(date +%s)
OLD_ID=$("$ENG" image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null || true)
status=0
"$ENG" build -t "$IMAGE" "${BUILD_ARGS[@]}" "$@" . || status=$?
stage_wheelhouse ""
[ "$status" = 0 ] || die "$ENG build failed (exit $status)"
TBUILD=$(( $(date +%s) - TB ))

# the Horovod wheel the image built, into the wheelhouse: the next build on an empty engine store
# installs it instead of compiling (the engine's layer cache does not see this: it changes nothing)
if [ "$FLAVOUR" = cpu ]; then
  cid=$("$ENG" create "$IMAGE" true)
  keys=$("$ENG" run --rm --network none "$IMAGE" bash -c 'cd /opt/horovod-wheels && ls -d horovod-*/ 2>/dev/null' || true)
  for k in $keys; do
    k=${k%/}
    if [ ! -d "$WH/horovod/$k" ]; then
      mkdir -p "$WH/horovod"
      "$ENG" cp "$cid:/opt/horovod-wheels/$k" "$WH/horovod/$k.tmp" && mv "$WH/horovod/$k.tmp" "$WH/horovod/$k"
      log "cached the image's Horovod wheel: $WH/horovod/$k"
    fi
  done
  "$ENG" rm "$cid" >/dev/null
fi
# the image this build replaced (untagged now; its layers that the new one shares stay)
NEW_ID=$("$ENG" image inspect "$IMAGE" --format '{{.Id}}')
if [ -n "$OLD_ID" ] && [ "$OLD_ID" != "$NEW_ID" ]; then
  "$ENG" rmi "$OLD_ID" >/dev/null 2>&1 && log "removed the image it replaced (${OLD_ID:0:12})" || true
fi
SIZE=$("$ENG" image inspect "$IMAGE" --format '{{.Size}}')
log "built $IMAGE: $(( SIZE / 1000000 )) MB, build $TBUILD s, in all $(( $(date +%s) - T0 )) s"
echo "$IMAGE"
