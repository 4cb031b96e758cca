"""`python -m trainer`: the Hydra entry point. All logic lives in runner.run(), callable from tests.

Under a launcher every rank runs this same Hydra job; Hydra's timestamped directory may differ by a
second between ranks, so rank 0's directory is broadcast and used by all (runner.agree_out_dir), and a
non-zero rank removes the directory Hydra made for it if nobody uses it. In a sweep (-m) a job that
fails is reported in one line and the sweep goes on; the command exits 2 at the end (multirun.py).

One run per directory (outdir.py): a run holds its output dir, and writes Hydra's `.hydra/` record
there itself once it does (Hydra's hydra.output_subdir is null); rank 0 of a sweep holds a literal
hydra.sweep.dir before Hydra writes multirun.yaml there, and the other ranks' Hydra gets a private
sweep dir. Hydra's own config errors (an unknown group option or key, a malformed override) are
one `error:` line with exit 2 like every other bad input (HYDRA_FULL_ERROR=1: Hydra's report).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile

from .run.install import InstallError, check_install

try:  # before the rest of the package is imported: another distribution's `kernels` would fail there
    check_install()
except InstallError as _exc:
    print(f"error: {_exc}", file=sys.stderr)
    sys.exit(2)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from .run.checkpoint import CheckpointError
from .base.comm import CollectiveError
from .base.config import CONF_DIR, ConfigError, adopt_slurm, launcher_rank, renamed_overrides
from .base.core.errors import error_line
from .workload.data import IdRangeError
from .workload.data.criteo import CriteoFormatError
from .base.core.signals import record_exit
from .run.multirun import SWEEP, describe
from .run.outdir import RECORD_DIR, hold_sweep_dir, hydra_record, literal_sweep_dir
from .run.signals import STOP_SIGNALS
from .run.runner import TrainingError, run

_USER_ARGV: list[str] | None = None  # sys.argv as typed, while Hydra parses another one (cli)
_SWEEP_SHOWN: str | None = None  # a non-zero rank's name for rank 0's sweep dir (its own is private)


def _remove_stray_dir(mine: str, used: str | None) -> None:
    """Drop a Hydra output dir this rank got but did not use (it holds only Hydra's files)."""
    if used is None or os.path.abspath(mine) == os.path.abspath(used):
        return
    leftovers = set(os.listdir(mine)) - {".hydra"} if os.path.isdir(mine) else {"?"}
    if not leftovers:
        shutil.rmtree(mine, ignore_errors=True)


def _exit_after_failed_collective(exc: CollectiveError) -> None:
    """A peer died or stalled: report and leave at once (status 3). A normal exit would run
    Horovod's shutdown, which waits for its background thread, still stuck in the dead collective
    until Gloo's own timeout; the launcher then stops the remaining workers."""
    print(f"error: {exc}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    record_exit(3)
    os._exit(3)


def _job_failed(message: str) -> None:
    """A job stopped on bad input or a training error: one `error:` line; in a sweep the job is
    recorded and the sweep goes on with the next one (cli exits 2 at the end), alone exit 2 now."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    overrides = list(hc.overrides.task)
    print(f"error: sweep job {hc.job.num} ({describe(overrides, hc.sweep.dir)}) failed: {message}", file=sys.stderr,
          flush=True)
    SWEEP.record(_SWEEP_SHOWN or hc.sweep.dir, hc.job.num, overrides, launcher_rank(), error=message)


def _stopped(stopped: dict, hc, rank: int) -> None:
    """A stop signal ended the run (trainer/run/signals.py): in a sweep the job is recorded as failed
    and the sweep ends; the process exits with 128 + the signal's number (143 for SIGTERM)."""
    if hc.mode == RunMode.MULTIRUN:
        SWEEP.record(_SWEEP_SHOWN or hc.sweep.dir, hc.job.num, list(hc.overrides.task), rank,
                     error=f"stopped by {stopped['signal']} after step {stopped['step']} (checkpoint: "
                           f"{stopped['checkpoint']}); the sweep ends here")
    sys.exit(stopped["exit_status"])


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    if _USER_ARGV is not None:  # Hydra has parsed its argv; relaunch.py reads the user's
        sys.argv = list(_USER_ARGV)
    hc = HydraConfig.get()
    out_dir = hc.runtime.output_dir
    no_record = any(_key(str(o)) == "hydra.output_subdir" for o in hc.overrides.hydra)  # null (cli)
    try:
        result = run(cfg, out_dir=out_dir, record=None if no_record else hydra_record(cfg))
    except (ConfigError, TrainingError, CheckpointError, IdRangeError, CriteoFormatError) as exc:
        return _job_failed(str(exc))
    except OSError as exc:
        if exc.filename is None:  # not a file the user can act on: a bug, keep the traceback
            raise
        return _job_failed(f"{exc.filename}: {exc.strerror or exc}")
    except CollectiveError as exc:
        if hc.mode == RunMode.MULTIRUN:  # the sweep ends here: say which job
            SWEEP.record(_SWEEP_SHOWN or hc.sweep.dir, hc.job.num, list(hc.overrides.task), launcher_rank(),
                         error=f"a worker died or stalled: {str(exc).splitlines()[0]}")
        _exit_after_failed_collective(exc)
    used = result.summary.get("output_dir")
    _remove_stray_dir(out_dir, used)
    stopped = result.summary.get("stopped")
    if stopped is not None:  # a stop signal (runner printed where and how to go on): a sweep ends too
        _stopped(stopped, hc, result.rank)
    if hc.mode == RunMode.MULTIRUN:
        SWEEP.record(_SWEEP_SHOWN or hc.sweep.dir, hc.job.num, list(hc.overrides.task), result.rank,
                     summary=os.path.join(used or out_dir, "summary.json"))
    if hc.mode != RunMode.MULTIRUN:  # complete: a stop signal from now on changes nothing (exit 0)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
    if result.rank == 0:
        keys = ("world_size", "steps", "samples_per_sec", "final_loss", "eval_auc", "bytes_per_sample")
        line = {k: result.summary[k] for k in keys}
        members = (result.summary.get("ensemble") or {}).get("members")
        if members:  # an ensemble's steps are its members' together: say so
            line["members"] = len(members)
            line["steps_per_member"] = [m["steps"] for m in members]
        print(json.dumps(line))
        print(f"summary: {os.path.join(used or out_dir, 'summary.json')}")


def output_dir_problem(argv: list[str], cwd: str = ".") -> str | None:
    """Why Hydra could not create its output dir (hydra.run.dir, or hydra.sweep.dir with -m),
    checked before Hydra starts, which would fail with its own traceback: a path component that
    is a file, or a directory that cannot be written. None when it looks usable. Only the part
    before the first ${...} interpolation can be checked (the default: outputs/)."""
    sweep = "-m" in argv or "--multirun" in argv
    key = "hydra.sweep.dir=" if sweep else "hydra.run.dir="
    given = [a[len(key):] for a in argv if a.startswith(key)]
    value = given[-1] if given else ("multirun/${now:}" if sweep else "outputs/${now:}")
    literal = value.split("${", 1)[0]
    path = os.path.join(cwd, literal)
    if "${" in value and not literal.endswith(os.sep):
        path = os.path.dirname(path)
    path = os.path.normpath(path) if path else cwd
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    name = f"{key[:-1]}={value}"
    if not os.path.isdir(probe):
        return f"{name}: {probe} is a file, not a directory; choose another output directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is read-only" if probe == path else f"cannot be created ({probe} is read-only)"
        return f"{name}: {path} {what}; choose a writable output directory"
    return None


def record_problem(argv: list[str]) -> str | None:
    """hydra.output_subdir other than null: Hydra would write its .hydra record into the output dir
    at the job's start, before the run holds the directory; the trainer writes it (.hydra) itself."""
    given = [a for a in argv if _key(a) == "hydra.output_subdir"]
    if given and given[-1].partition("=")[2].strip().lower() != "null":
        return (f"{given[-1]}: the trainer writes the run's record into {RECORD_DIR}/ itself, once the run "
                "holds its output dir; hydra.output_subdir=null writes none")
    return None


def _key(arg: str) -> str:
    return arg.lstrip("+~").split("=", 1)[0].strip()


def cli() -> None:
    """The command (see _cli); its exit status is also noted for a job wrapper (trainer/run/job.py).
    A task of `srun` (one per rank, no launcher) first gets torchrun's variables from Slurm's
    (config.adopt_slurm): everything after reads RANK / WORLD_SIZE / LOCAL_RANK as under torchrun."""
    adopt_slurm()
    status = 1
    try:
        _cli()
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    finally:
        record_exit(status)


def _cli() -> None:
    """Refuse an unusable output dir with a clear error (exit 2), hold a sweep's dir (rank 0; the
    other ranks give Hydra a private one), then run Hydra."""
    global _SWEEP_SHOWN
    try:  # old key names (config RENAMED) read as the new ones, with a warning line each
        argv = renamed_overrides(sys.argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    problem = output_dir_problem(argv) or record_problem(argv)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    sweep_dir, private, held = literal_sweep_dir(argv), None, None
    if ("-m" in argv or "--multirun" in argv) and launcher_rank() != 0:
        private = tempfile.mkdtemp(prefix=f"trainer-sweep-rank{launcher_rank()}-")
        argv = argv + [f"hydra.sweep.dir={private}"]  # Hydra writes its multirun.yaml there, not into rank 0's
        _SWEEP_SHOWN = sweep_dir or "rank 0's hydra.sweep.dir"
    elif sweep_dir is not None:
        try:
            held = hold_sweep_dir(sweep_dir)
        except TrainingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    try:
        _run_hydra(argv)
    finally:
        if held is not None:
            held.release()
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
    failed = SWEEP.closing_line()  # a sweep whose jobs did not all run (each said why already)
    if failed is not None:
        print(f"error: {failed}", file=sys.stderr)
        sys.exit(2)


def _run_hydra(argv: list[str]) -> None:
    """main() with Hydra parsing argv (sys.argv is the user's again once the job starts: main).
    Hydra's own errors (composing the config, parsing an override) become one `error:` line and
    exit 2: Hydra raises them instead of printing them when HYDRA_FULL_ERROR=1, set here for the
    call unless the user set it (then Hydra's full report, for developers)."""
    global _USER_ARGV
    _USER_ARGV, full = list(sys.argv), os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = sys.argv[:1] + argv
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except HydraException as exc:
        if full == "1":
            raise
        print(f"error: {error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    finally:
        sys.argv, _USER_ARGV = _USER_ARGV, None
        if full is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full


if __name__ == "__main__":
    cli()
