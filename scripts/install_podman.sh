#!/usr/bin/env bash
# Install a container engine for the image's tests (tests/tools/test_image.py) on Debian: podman with runc
# (crun fails on hosts that forbid setrlimit or use hybrid cgroups), mmdebstrap for the base image
# (no registry needed), and the engine settings that work there. As root with apt-get; idempotent.
#
#   bash scripts/install_podman.sh          # install (seconds when already there), then `podman info`
#
# /etc/containers/containers.conf is written only when it does not exist (an existing one is kept
# and reported).
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  "") ;;
  *) echo "error: $1: unknown argument (install_podman.sh takes none)" >&2; exit 2 ;;
esac
TAG="[install_podman]"
PKGS=(podman runc mmdebstrap uidmap fuse-overlayfs containernetworking-plugins)
[ "$(id -u)" = 0 ] || { echo "$TAG error: run as root (apt-get, /etc/containers)" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "$TAG error: needs apt-get (Debian/Ubuntu)" >&2; exit 1; }
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "$TAG apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
CONF=/etc/containers/containers.conf
if [ -e "$CONF" ]; then
  echo "$TAG keeping the existing $CONF"
else
  mkdir -p /etc/containers
  cat >"$CONF" <<'CONFEOF'
# written by hybrid-trainer's scripts/install_podman.sh
[containers]
default_ulimits = ["nofile=16384:16384", "nproc=16384:16384"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONFEOF
  echo "$TAG wrote $CONF"
fi
podman info --format '{{.Host.OCIRuntime.Name}} {{.Version.Version}}' | sed "s/^/$TAG podman: runtime /"
