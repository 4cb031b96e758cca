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
. "$(dirname "$0")/lib/apt.bash"
apt_prelude install_slurm "apt-get, /etc/munge" "$@"
apt_missing --no-install-recommends -- slurmctld slurmd slurm-client munge
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
