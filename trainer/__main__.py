"""`python -m trainer`: the Hydra entry point. All logic lives in runner.run(), callable from tests.

Under a launcher every rank runs this same Hydra job; Hydra's timestamped directory may differ by a
second between ranks, so rank 0's directory is broadcast and used by all (runner.Trainer), and a
non-zero rank removes the directory Hydra made for it if nobody uses it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .checkpoint import CheckpointError
from .comm import CollectiveError
from .config import CONF_DIR, ConfigError
from .data import IdRangeError
from .runner import TrainingError, run


def _remove_stray_dir(mine: str, used: str | None) -> None:
    """Drop a Hydra output dir this rank got but did not use (it holds only Hydra's files)."""
    if used is None or os.path.abspath(mine) == os.path.abspath(used):
        return
    leftovers = set(os.listdir(mine)) - {".hydra"} if os.path.isdir(mine) else {"?"}
    if not leftovers:
        shutil.rmtree(mine, ignore_errors=True)


def _remove_stray_sweep_dir(sweep_dir: str, used: str | None) -> None:
    """Multirun: drop this rank's own sweep dir (only Hydra's multirun.yaml) if rank 0's is used."""
    if used is None or os.path.abspath(used).startswith(os.path.abspath(sweep_dir) + os.sep):
        return
    if os.path.isdir(sweep_dir) and not set(os.listdir(sweep_dir)) - {"multirun.yaml"}:
        shutil.rmtree(sweep_dir, ignore_errors=True)


def _exit_after_failed_collective(exc: CollectiveError) -> None:
    """A peer died or stalled: report and leave at once (status 3). A normal exit would run
    Horovod's shutdown, which waits for its background thread, still stuck in the dead collective
    until Gloo's own timeout; the launcher then stops the remaining workers."""
    print(f"error: {exc}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    out_dir = HydraConfig.get().runtime.output_dir
    try:
        result = run(cfg, out_dir=out_dir)
    except (ConfigError, TrainingError, CheckpointError, IdRangeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except CollectiveError as exc:
        _exit_after_failed_collective(exc)
    used = result.summary.get("output_dir")
    _remove_stray_dir(out_dir, used)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        _remove_stray_sweep_dir(HydraConfig.get().sweep.dir, used)
    if result.rank == 0:
        keys = ("world_size", "steps", "samples_per_sec", "final_loss", "eval_auc", "bytes_per_sample")
        print(json.dumps({k: result.summary[k] for k in keys}))
        print(f"summary: {os.path.join(used or out_dir, 'summary.json')}")


if __name__ == "__main__":
    main()
