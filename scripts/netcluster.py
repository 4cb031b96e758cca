#!/usr/bin/env python
"""Emulated multi-host cluster from the shell (trainer/tools/netcluster.py; needs root).

    python scripts/netcluster.py up --hosts 2 --rate 1gbit --ssh [--delay-ms 1] [--ttl 3600]
    python scripts/netcluster.py run --host 1 -- ip -br addr
    python scripts/netcluster.py torchrun -- -m trainer comm=torch data=bench hydra.run.dir=runs/net
    python scripts/netcluster.py horovodrun -- "$PWD/.venv/bin/python" -m trainer comm=horovod
    python scripts/netcluster.py shape --rate 200mbit
    python scripts/netcluster.py status
    python scripts/netcluster.py down
    python scripts/netcluster.py cleanup-stale      # leftovers of runs whose owner died

`up` starts a holder process that owns the cluster until `down` or --ttl seconds; the other commands
find the live cluster (--tag picks one when there are several). Commands run with the caller's
environment plus Gloo pinned to the hosts' veth0; every command has a --timeout (default 600 s).
"""
from __future__ import annotations

import sys

from trainer.tools.netcluster import main

if __name__ == "__main__":
    sys.exit(main())
