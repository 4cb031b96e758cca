"""The Slurm tests' cluster (dev/slurmcluster.py: a controller and two one-CPU nodes on this host),
skipped with the reason where it cannot run."""
from __future__ import annotations

import pytest

from dev.slurmcluster import CRED_EXPIRE_S, SlurmCluster, missing

__all__ = ["CRED_EXPIRE_S", "SlurmCluster", "require_slurm"]


def require_slurm() -> None:
    why = missing()
    if why is not None:
        pytest.skip(why)
