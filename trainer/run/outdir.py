"""One run per output directory, one sweep per sweep directory.

Why: two runs given one hydra.run.dir used to both run there: metrics.jsonl interleaved their
steps, summary.json kept the run that ended last, and Hydra had rewritten `.hydra/` with the second
run's config before anything could refuse it. So the output directory is taken like a
checkpoint.dir, with the same lock (checkpoint/lock.py's DirLock: `lock.json` with run id, pid,
host, start time and command; a dead holder's lock taken over with a warning, a holder on another
host refused), before anything is written into it:

- a run (runner.run, claim_out_dir): rank 0 creates the directory, writes a probe file, takes the
  lock and only then writes the run's record `.hydra/config.yaml`, `hydra.yaml` and
  `overrides.yaml` (conf/config.yaml sets hydra.output_subdir to null, so Hydra itself writes
  nothing there; hydra_record gives the same content Hydra would). Every rank gets the outcome
  (root_decides), before the data and the sparse side are built. The lock is released when the
  run ends, also on errors; a checkpoint.dir inside the output dir has its own lock.json.
- a sweep (`-m`, __main__.cli): Hydra writes `multirun.yaml` into hydra.sweep.dir before any job
  starts, so a literal sweep dir is held by rank 0 (hold_sweep_dir) before Hydra starts, for as
  long as the process runs. The other ranks give Hydra a private sweep dir instead (they write into
  rank 0's directories, which runner.agree_out_dir hands them). A timestamped default sweep dir is
  new: its jobs' own locks suffice.
"""
from __future__ import annotations

import copy
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from ..base.core.errors import TrainingError, phase
from .checkpoint.lock import LEASE_S, DirLock, Guarded, lock_in_rounds
from ..base.comm import Collectives

__all__ = ["OUTPUT_DIR", "RECORD_DIR", "SWEEP_DIR", "HeldDir", "claim_out_dir", "hold_sweep_dir", "hydra_record",
           "literal_sweep_dir", "probe_dir"]

OUTPUT_DIR = Guarded("output dir", "would mix their metrics.jsonl, summary.json and .hydra records",
                     "give this run its own hydra.run.dir (in a sweep: hydra.sweep.dir)", TrainingError)
SWEEP_DIR = Guarded("hydra.sweep.dir", "would rewrite each other's multirun.yaml and jobs",
                    "give this sweep its own hydra.sweep.dir", TrainingError)
RECORD_DIR = ".hydra"  # the run's config as Hydra composed it (hydra_record), written once the dir is held


@dataclass
class HeldDir:
    """The output dir every rank agreed on; on rank 0 also its lock (release() at the run's end)."""

    path: Optional[str]
    lock: Optional[DirLock] = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def claim_out_dir(comm: Collectives, out_dir: Optional[str], record: Optional[dict[str, str]] = None,
                  lease_s: float = LEASE_S) -> HeldDir:
    """Rank 0 makes out_dir usable (probe_dir), takes its lock and writes `record` (relative path ->
    text) into it; every rank gets rank 0's directory, or the TrainingError saying why it cannot be
    used (unwritable, or in use by another run: named with its pid, host and command). The
    warning for a dead holder's lock taken over is printed by rank 0. Collective."""
    held = HeldDir(None)

    def make() -> Optional[DirLock]:
        path = probe_dir(out_dir)
        return None if path is None else DirLock(path, uuid.uuid4().hex[:12], OUTPUT_DIR, lease_s)

    def then(lock: Optional[DirLock]) -> Optional[str]:
        if lock is None:
            return None
        _say(lock)
        path = lock.root
        try:
            for name, text in (record or {}).items():
                _write(os.path.join(path, name), text)
        except OSError as exc:
            lock.release()
            raise TrainingError(f"output dir {path}: {exc.filename or path} cannot be written "
                                f"({exc.strerror or exc}); choose another hydra.run.dir") from exc
        held.lock = lock
        return path

    with phase(comm, "other"):
        held.path = lock_in_rounds(comm, make, then, TrainingError)
    return held


def probe_dir(path: Optional[str]) -> Optional[str]:
    """path, once it is created and a probe file written there; TrainingError saying why it
    cannot be used. None: no output dir."""
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise TrainingError(f"output dir {path} cannot be created ({exc.strerror or exc}); "
                            "choose another hydra.run.dir") from exc
    probe = os.path.join(path, f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb") as f:
            f.write(b"probe\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise TrainingError(f"output dir {path} is not writable ({exc.strerror or exc}): metrics.jsonl and "
                            "summary.json could not be written there; choose another hydra.run.dir") from exc
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return path


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def hydra_record(task_cfg: Any) -> dict[str, str]:
    """The files Hydra writes into `<output dir>/.hydra/` at a job's start (config.yaml: the task
    config; hydra.yaml: Hydra's own, with this job's number and output dir; overrides.yaml: the
    task overrides), as OmegaConf YAML like Hydra's; hydra.yaml says where they are (output_subdir).
    Call inside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, read_write

    hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)  # {"hydra": ...}, as Hydra saves it
    with read_write(hydra_cfg.hydra):
        hydra_cfg.hydra.output_subdir = RECORD_DIR
    files = {"config.yaml": task_cfg, "hydra.yaml": hydra_cfg, "overrides.yaml": HydraConfig.get().overrides.task}
    return {os.path.join(RECORD_DIR, name): OmegaConf.to_yaml(cfg) for name, cfg in files.items()}


def literal_sweep_dir(argv: list[str]) -> Optional[str]:
    """The sweep dir a `-m` command line gives literally (hydra.sweep.dir=PATH without ${...}, read
    as Hydra reads it: quotes removed), absolute; None when it is not a sweep, or its dir is the
    timestamped default, interpolated, or not a plain value (Hydra reports a bad one)."""
    if "-m" not in argv and "--multirun" not in argv:
        return None
    given = [a for a in argv if a.startswith("hydra.sweep.dir=")]
    if not given:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        value = OverridesParser.create().parse_overrides(given[-1:])[0].value()
    except HydraException:
        return None
    if not isinstance(value, str) or not value or "${" in value:
        return None
    return os.path.abspath(value)


def hold_sweep_dir(path: str) -> DirLock:
    """Rank 0 of a sweep: take path's lock (held until release() or the process ends), before
    Hydra writes multirun.yaml there; TrainingError naming the holder when another sweep uses it."""
    return _take(path, SWEEP_DIR)


def _take(path: str, guards: Guarded, lease_s: float = LEASE_S) -> DirLock:
    """path's lock, for a new run id (a lease of lease_s seconds: checkpoint.lock_lease_s for a
    run's output dir); a dead holder's lock taken over is said on stderr."""
    lock = DirLock(path, uuid.uuid4().hex[:12], guards, lease_s)
    lock.acquire()
    _say(lock)
    return lock


def _say(lock: DirLock) -> None:
    """A dead holder's lock taken over, said on stderr."""
    for note in lock.notes:
        print(f"[trainer] warning: {note}", file=sys.stderr)
