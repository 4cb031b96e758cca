"""A Hydra sweep (`python -m trainer -m ...`) as one job the user can check: which jobs ran, which
failed and why.

Hydra runs the jobs of a sweep one after the other in the same process (under torchrun or
horovodrun: in every rank). A job that stops on bad input or a training error (the errors
`python -m trainer` reports in one line with exit status 2) is reported here in one line naming
the job and its overrides, and the sweep goes on with the next job; the command then exits with
status 2 once every job has run, so a launcher and a script see that the sweep is incomplete.
A dead or stalled peer (CollectiveError) still ends the process at once: the other jobs could not
run without it.

Rank 0 keeps `<sweep dir>/summary.json` up to date after every job (written whole, then renamed
over the old one): every job's number, overrides, status (ok / failed), its summary.json or its
error. `scripts/plot_sweep.py` reads it to name the jobs that have no summary.
"""
from __future__ import annotations

import os
import time
from typing import Any

from ..base.core.atomic import write_json_atomic

SUMMARY = "summary.json"


class SweepLog:
    """The jobs this process ran in the current sweep, and their record on disk (rank 0)."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []
        self.sweep_dir: str | None = None

    def record(self, sweep_dir: str, num: int, overrides: list[str], rank: int,
               summary: str | None = None, error: str | None = None) -> None:
        """Job `num` ended: ok with its summary.json path, or failed with `error`. Rank 0 rewrites
        the sweep's summary.json (job 0 starts a new one: a sweep dir reused by a new sweep)."""
        if num == 0 or self.sweep_dir != sweep_dir:
            self.jobs, self.sweep_dir = [], sweep_dir
        job: dict[str, Any] = {"num": num, "overrides": as_typed(overrides),
                               "status": "failed" if error is not None else "ok"}
        if error is not None:
            job["error"] = error
        else:
            job["summary"] = summary
        self.jobs = [j for j in self.jobs if j["num"] != num] + [job]
        if rank == 0:
            self._write()

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [j for j in self.jobs if j["status"] == "failed"]

    def _write(self) -> None:
        assert self.sweep_dir is not None
        record = {"sweep_dir": os.path.abspath(self.sweep_dir), "jobs": sorted(self.jobs, key=lambda j: j["num"]),
                  "ok": len(self.jobs) - len(self.failed), "failed": len(self.failed),
                  "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path = os.path.join(self.sweep_dir, SUMMARY)
        try:
            os.makedirs(self.sweep_dir, exist_ok=True)
            write_json_atomic(path, record, indent=1)
        except OSError as exc:  # the jobs' own outputs matter more than this index of them
            print(f"[trainer] warning: cannot write the sweep summary {path}: {exc}", flush=True)

    def closing_line(self) -> str | None:
        """The sweep's last line when a job failed (None when every job ran)."""
        bad = self.failed
        if not bad:
            return None
        where = os.path.join(self.sweep_dir, SUMMARY) if self.sweep_dir else "the sweep dir"
        names = "; ".join(f"job {j['num']} ({describe(j['overrides'], self.sweep_dir)})" for j in bad)
        return f"{len(bad)} of {len(self.jobs)} sweep jobs failed: {names}; see {where}"


def as_typed(overrides: list[str]) -> list[str]:
    """A job's overrides as the user typed them: Hydra keeps an interpolation of the command line
    escaped in the job's overrides ($\\{key\\}); give it back as ${key}."""
    return [str(o).replace("\\{", "{").replace("\\}", "}") for o in overrides]


def describe(overrides: list[str], sweep_dir: str | None = None) -> str:
    """A job by the values it sweeps (all its overrides when the sweep's keys cannot be read)."""
    keys = swept_keys(sweep_dir) if sweep_dir else set()
    overrides = as_typed(overrides)
    mine = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys] or overrides
    return " ".join(mine) if mine else "no overrides"


def swept_keys(sweep_dir: str) -> set[str]:
    """The keys the sweep varies, from Hydra's multirun.yaml in sweep_dir (empty when unreadable)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        task = OmegaConf.to_container(OmegaConf.load(os.path.join(sweep_dir, "multirun.yaml")).hydra.overrides.task,
                                      resolve=False)  # as typed: an interpolation stays one
        parsed = OverridesParser.create().parse_overrides([str(o) for o in task])
        return {o.key_or_group for o in parsed if o.is_sweep_override()}
    except Exception:  # noqa: BLE001 - only a nicer name for the job; never fail over it
        return set()


SWEEP = SweepLog()  # this process's sweep (one per `python -m trainer -m` process)
