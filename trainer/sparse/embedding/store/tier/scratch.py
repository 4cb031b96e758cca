"""The disk store's scratch folders (embedding.store_dir): one per rank and run, named by its owner,
and the folders of dead runs found and removed at the next start.

Why: a store=disk run keeps its shard in `ht-store-rank<r>-*/` (rows.bin, log.bin: GBs), removed
when the run ends; a run killed hard (SIGKILL, the OOM killer, a node's power) cannot remove it,
and nothing else would: each killed run left its GBs for good. So each folder holds `owner.json`,
its process's identity (trainer/base/core/procs.py: host, boot id, PID namespace, pid, start time:
the directory lock's), refreshed every lease / 4 seconds by a daemon thread while the run lives,
and every store=disk start on that store_dir first removes the folders whose owner is dead (before
it counts the free space: their room is the new run's), with one line: on this host and namespace, the process named is not running (or this host has booted
since); elsewhere (another container on a shared volume), its owner.json has not been refreshed for
longer than its lease. A folder without owner.json older than a lease (a run killed between making
it and writing the file, or made by an older version) is dead too. A folder is renamed before it is
removed, so of two ranks reaping at once one removes it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid

from .....base.core.atomic import replacing
from .....base.core.holder import age, keep_fresh, read_holder
from .....base.core.procs import alive, identity

PREFIX = "ht-store-rank"
OWNER = "owner.json"
LEASE_S = 60.0  # a folder whose owner cannot be checked from here and has not refreshed it for this long is dead


class ScratchDir:
    """One rank's scratch folder under `base`, made at once (its dead neighbours are reaped by the
    start, before it counts the free space: trainer/run/build.py make_tier); close() stops the
    refresher and removes it."""

    def __init__(self, base: str, rank: int, lease_s: float = LEASE_S) -> None:
        os.makedirs(base, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{rank}-", dir=base)
        owner = os.path.join(self.path, OWNER)
        with replacing(owner) as f:
            json.dump({**identity(), "lease_s": float(lease_s)}, f)
        self._stop = keep_fresh(owner, lease_s / 4)

    def close(self) -> None:
        self._stop.set()
        shutil.rmtree(self.path, ignore_errors=True)


def reap(base: str) -> tuple[list[str], int]:
    """Remove the scratch folders under `base` whose owner is dead (module docstring); (their
    names, the bytes they held on the disk). Says so in one line when it removed any."""
    names, freed = [], 0
    try:
        entries = os.listdir(base)
    except OSError:
        return names, freed
    for name in sorted(entries):
        path = os.path.join(base, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path) or not _dead(path):
            continue
        doomed = os.path.join(base, f".ht-store-reaping-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(path, doomed)  # of two ranks reaping at once, one wins
        except OSError:
            continue
        freed += _disk_bytes(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        names.append(name)
    if names:
        print(f"[trainer] embedding.store_dir {base}: removed {len(names)} store folder(s) of runs that are gone "
              f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}), {freed / 1e9:.2f} GB freed",
              file=sys.stderr, flush=True)
    return names, freed


def _dead(path: str) -> bool:
    owner_file = os.path.join(path, OWNER)
    owner = read_holder(owner_file)
    if owner is None:  # being made right now, or killed before it was written (or an older version's)
        return (age(path) or 0.0) > LEASE_S
    live = alive(owner)
    if live is not None:
        return not live
    return (age(owner_file) or 0.0) > float(owner.get("lease_s", LEASE_S))


def _disk_bytes(path: str) -> int:
    """Bytes a folder's files take on the disk (sparse files: their written blocks)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total
