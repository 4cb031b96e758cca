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
. "$(dirname "$0")/lib/apt.bash"
apt_prelude install_podman "apt-get, /etc/containers" "$@"
apt_missing podman runc mmdebstrap uidmap fuse-overlayfs containernetworking-plugins
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
