#!/usr/bin/env bash
# Install Slurm for the Slurm tests (tests/distributed/test_slurm.py) on Debian: Debian's slurm-wlm
# daemons and client (slurmctld, slurmd, slurm-client) with munge for their authentication. As root
# with apt-get; idempotent. The test writes its own slurm.conf, munge key, state and logs in a temp dir
# and starts (and stops) its own daemons: nothing is configured or started here.
#
#   bash scripts/install_slurm.sh          # install (seconds when already there), then the versions
#
# The package's munge key (/etc/munge/munge.key) is made only when it does not exist (an existing one is
# kept and reported); no service is started or enabled.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  "") ;;
  *) echo "error: $1: unknown argument (install_slurm.sh takes none)" >&2; exit 2 ;;
esac
TAG="[install_slurm]"
PKGS=(slurmctld slurmd slurm-client munge)
[ "$(id -u)" = 0 ] || { echo "$TAG error: run as root (apt-get, /etc/munge)" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "$TAG error: needs apt-get (Debian/Ubuntu)" >&2; exit 1; }
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "$TAG apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
fi
KEY=/etc/munge/munge.key
if [ -e "$KEY" ]; then
  echo "$TAG keeping the existing $KEY"
else
  mkdir -p /etc/munge
  (umask 077 && dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none)
  chown munge:munge "$KEY" 2>/dev/null || true
  echo "$TAG wrote $KEY"
fi
echo "$TAG $(slurmctld -V) (slurmctld, slurmd, sbatch, srun, scontrol); $(munged -V 2>&1 | head -1)"
