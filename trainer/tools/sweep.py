"""Reading a Hydra sweep back: one point per job's summary.json, for plots and for the README.

Why a module (scripts/plot_sweep.py is a thin CLI over it): the staleness sweep is how users choose a
bound, so "the smallest bound whose eval AUC stays within tol of BSP, and the bytes it saves" must be
computed the same way in the plot, in tests and in the README's figures.

A point's x is a config value read from summary["config"] by a dotted path (default
consistency.pull_bound; -1, unbounded, is placed after the largest finite bound). Embedding bytes
are the sparse side's wire traffic per training sample (ids + versions + rows + grads), i.e.
summary["embedding_bytes_per_sample"].

Which jobs a sweep has comes from the sweep itself, not from the summaries found: Hydra's
multirun.yaml holds the sweep's overrides, expanded into jobs here by Hydra's own sweeper, and each
job's directory holds its overrides in .hydra/overrides.yaml. A job without a summary.json (it
failed, or the sweep was stopped) is therefore named, with its error from the sweep's summary.json
(trainer/run/multirun.py) when it has one, and the report says which jobs it used.

The command (`hybrid-trainer-plot-sweep`, scripts/plot_sweep.py in a checkout):

    hybrid-trainer -m cache=lru consistency.pull_bound=0,1,4,16,64 hydra.sweep.dir=multirun/s
    hybrid-trainer-plot-sweep multirun/s --baseline runs/nocache/summary.json --out sweep.png

reads the summary.json of every job of the given sweeps, writes the PNG and prints one JSON line:
the points, the cheapest bound (fewest embedding bytes) whose eval AUC is within --auc-tol of the
bound-0 (BSP) run, and its byte saving against --baseline (a cache=none run) when given. A sweep
with jobs that have no summary.json (failed, or never run) is refused, naming them, unless
--allow-missing: then the plot and the choice use the jobs there are, and the JSON line lists the
missing ones (`missing`). The plot needs the `plot` extra (matplotlib): pip install
'hybrid-trainer[plot]'; without it the command stops with one `error:` line saying so.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from ..base.comm import EMBEDDING_KINDS
from ..run.multirun import as_typed
from .cli import MissingExtra, require_extra



@dataclass
class Point:
    """One sweep job."""

    path: str  # the job's summary.json
    x: float  # the swept value (math.inf for an unbounded bound)
    series: str  # label of the job's series ("" when not split)
    eval_auc: float
    embedding_bytes_per_sample: float
    world_size: int


def embedding_bytes_per_sample(summary: dict[str, Any]) -> float:
    """Sparse-side bytes per training sample of a summary (the dense allreduce and metrics excluded)."""
    by_kind = summary["bytes_per_sample_by_kind"]
    return float(sum(by_kind.get(k, 0.0) for k in EMBEDDING_KINDS))


def config_value(summary: dict[str, Any], dotted: str) -> Any:
    """summary["config"] at a dotted path; KeyError naming the path when it is absent."""
    node: Any = summary["config"]
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"{dotted!r} is not in the run's config")
        node = node[part]
    return node


@dataclass
class Job:
    """One job of a Hydra sweep."""

    sweep: str  # the sweep directory
    num: int
    overrides: list[str]
    summary: Optional[str]  # its summary.json, None when there is none
    error: Optional[str] = None  # why it failed (the sweep's summary.json), when known

    def describe(self) -> str:
        why = f": {self.error}" if self.error else ""
        return f"job {self.num} of {self.sweep} ({' '.join(self.overrides)}){why}"


def sweep_jobs(sweep_dir: str) -> Optional[list[Job]]:
    """Every job of the Hydra sweep in sweep_dir, found or not; None when sweep_dir has no
    multirun.yaml (not a sweep directory). A job's directory is the one whose .hydra/hydra.yaml
    has its number (rank 0's: every rank writes there)."""
    from omegaconf import OmegaConf

    path = os.path.join(sweep_dir, "multirun.yaml")
    if not os.path.isfile(path):
        return None
    task = OmegaConf.to_container(OmegaConf.load(path).hydra.overrides.task, resolve=False)
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([str(o) for o in task])
    expanded = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    dirs: dict[int, str] = {}  # job number -> its directory
    for found in glob.glob(os.path.join(sweep_dir, "**", ".hydra", "hydra.yaml"), recursive=True):
        try:
            num = OmegaConf.select(OmegaConf.load(found), "hydra.job.num")
        except Exception:  # noqa: BLE001 - an unreadable job record is a job not found
            continue
        if isinstance(num, int):
            dirs.setdefault(num, os.path.dirname(os.path.dirname(found)))
    errors = {}
    try:
        with open(os.path.join(sweep_dir, "summary.json")) as f:
            errors = {j["num"]: j.get("error") for j in json.load(f).get("jobs", [])}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    jobs = []
    for num, overrides in enumerate(expanded):
        summary = os.path.join(dirs[num], "summary.json") if num in dirs else None
        summary = summary if summary and os.path.isfile(summary) else None
        jobs.append(Job(sweep_dir, num, as_typed(overrides), summary, None if summary else errors.get(num)))
    return jobs


def find_jobs(roots: list[str]) -> tuple[list[str], list[Job]]:
    """(the job summaries to plot, the jobs that have none) of the given sweep directories (or
    summary.json files). A directory that is not a Hydra sweep gives every run summary.json under
    it (not a sweep's own summary.json)."""
    found: list[str] = []
    missing: list[Job] = []
    for root in roots:
        if os.path.isfile(root):
            found.append(root)
            continue
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: no such sweep directory")
        jobs = sweep_jobs(root)
        if jobs is None:
            found += [p for p in glob.glob(os.path.join(root, "**", "summary.json"), recursive=True)
                      if _is_run_summary(p)]
            continue
        found += [j.summary for j in jobs if j.summary]
        missing += [j for j in jobs if not j.summary]
    if not found:
        raise FileNotFoundError(f"no job summary.json under {roots}: did the sweep run?")
    return sorted(set(found)), missing


def _is_run_summary(path: str) -> bool:
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(s, dict) and "config" in s and "eval_auc" in s


def load_points(paths: list[str], x_key: str, series_key: Optional[str] = None) -> list[Point]:
    """Points sorted by (series, x); an unbounded (-1) bound becomes math.inf."""
    points = []
    for path in paths:
        with open(path) as f:
            s = json.load(f)
        x = float(config_value(s, x_key))
        x = math.inf if x_key.endswith("_bound") and x < 0 else x
        series = "" if series_key is None else f"{series_key}={config_value(s, series_key)}"
        points.append(Point(path, x, series, float(s["eval_auc"]), embedding_bytes_per_sample(s),
                            int(s["world_size"])))
    return sorted(points, key=lambda p: (p.series, p.x))


def cheapest_good_bound(points: list[Point], tol: float = 0.002) -> Optional[Point]:
    """The point with the fewest embedding bytes among those whose eval AUC is within tol of the
    bound-0 (BSP) run (ties: the smaller bound); None without a bound-0 point."""
    bsp = [p for p in points if p.x == 0]
    if not bsp:
        return None
    ok = [p for p in points if p.eval_auc >= bsp[0].eval_auc - tol]
    return min(ok, key=lambda p: (p.embedding_bytes_per_sample, p.x))


def report(points: list[Point], baseline: Optional[dict[str, Any]], tol: float) -> dict[str, Any]:
    """The sweep as one JSON-able dict: points, the chosen bound and its saving vs the baseline."""
    best = cheapest_good_bound(points, tol)
    out: dict[str, Any] = {
        "points": [{"x": _jsonable(p.x), "series": p.series, "eval_auc": p.eval_auc,
                    "embedding_bytes_per_sample": p.embedding_bytes_per_sample,
                    "world_size": p.world_size, "summary": p.path} for p in points],
        "auc_tolerance": tol,
        "chosen": None if best is None else {"x": _jsonable(best.x), "eval_auc": best.eval_auc,
                                             "embedding_bytes_per_sample": best.embedding_bytes_per_sample},
    }
    if baseline is not None:
        base = embedding_bytes_per_sample(baseline)
        out["baseline"] = {"eval_auc": baseline["eval_auc"], "embedding_bytes_per_sample": base}
        if best is not None and base > 0:
            out["chosen"]["bytes_reduction_vs_baseline"] = 1.0 - best.embedding_bytes_per_sample / base
    return out


def _jsonable(x: float) -> Any:
    return -1 if math.isinf(x) else (int(x) if float(x).is_integer() else x)


def plot(points: list[Point], baseline: Optional[dict[str, Any]], x_key: str, out_png: str,
         title: str = "", tol: float = 0.002) -> None:
    """Two panels against the swept value: eval AUC (with the BSP - tol line), and embedding
    bytes per sample (the chosen bound starred). Needs the `plot` extra (matplotlib)."""
    require_extra("plot", "plotting a sweep")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [p.x for p in points if not math.isinf(p.x)]
    inf_at = (max(finite) * 4 if finite and max(finite) > 0 else 1.0)  # where "unbounded" is drawn
    fig, (ax_auc, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for series in sorted({p.series for p in points}):
        pts = [p for p in points if p.series == series]
        xs = [inf_at if math.isinf(p.x) else p.x for p in pts]
        label = series or None
        ax_auc.plot(xs, [p.eval_auc for p in pts], "o-", label=label)
        ax_b.plot(xs, [p.embedding_bytes_per_sample for p in pts], "o-", label=label)
    if baseline is not None:
        for ax, v, name in ((ax_auc, baseline["eval_auc"], "no cache"),
                            (ax_b, embedding_bytes_per_sample(baseline), "no cache")):
            ax.axhline(v, color="gray", ls="--", lw=1, label=name)
    bsp = [p for p in points if p.x == 0]
    if bsp:
        ax_auc.axhline(bsp[0].eval_auc - tol, color="red", ls=":", lw=1, label=f"BSP - {tol:g}")
    best = cheapest_good_bound(points, tol)
    if best is not None:
        bx = inf_at if math.isinf(best.x) else best.x
        ax_b.plot([bx], [best.embedding_bytes_per_sample], "r*", ms=14, label="cheapest bound within AUC tol")
    ticks = sorted(set(finite)) + ([inf_at] if any(math.isinf(p.x) for p in points) else [])
    for ax, ylabel in ((ax_auc, "eval AUC"), (ax_b, "embedding bytes / sample")):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(ticks)
        ax.set_xticklabels(["inf" if t == inf_at and any(math.isinf(p.x) for p in points) else f"{t:g}"
                            for t in ticks])
        ax.set_xlabel(x_key)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_b.set_ylim(bottom=0)
    ax_auc.ticklabel_format(axis="y", useOffset=False)
    fig.suptitle(title or f"staleness sweep (W={points[0].world_size})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`hybrid-trainer-plot-sweep` / scripts/plot_sweep.py: see the module doc's end."""
    ap = argparse.ArgumentParser(description="Plot a staleness sweep: eval AUC and embedding bytes per sample "
                                             "against the bound.\n\nThe command " + __doc__.split("The command ", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", nargs="+", help="sweep directories (or summary.json files)")
    ap.add_argument("--out", default="sweep.png", help="PNG to write (default: sweep.png)")
    ap.add_argument("--x", default="consistency.pull_bound", help="swept config key (dotted)")
    ap.add_argument("--series", default=None, help="config key splitting the points into lines, "
                                                   "e.g. cache.policy")
    ap.add_argument("--baseline", default=None, help="summary.json of a cache=none run")
    ap.add_argument("--auc-tol", type=float, default=0.002, help="AUC tolerance against bound 0")
    ap.add_argument("--title", default="")
    ap.add_argument("--allow-missing", action="store_true",
                    help="plot and choose from the jobs that have a summary when others have none")
    a = ap.parse_args(argv)
    try:
        require_extra("plot", "plotting a sweep")
        found, missing = find_jobs(a.sweep)
        points = load_points(found, a.x, a.series)
        baseline = json.load(open(a.baseline)) if a.baseline else None
    except (OSError, KeyError, ValueError, MissingExtra) as e:  # a missing or malformed summary, a key it lacks; no matplotlib
        print(f"error: {e}", file=sys.stderr)
        return 2
    for job in missing:
        print(f"[plot_sweep] no summary.json: {job.describe()}", file=sys.stderr)
    if missing and not a.allow_missing:
        print(f"error: the sweep is incomplete: {len(missing)} of {len(missing) + len(found)} jobs have no "
              f"summary.json ({'; '.join(j.describe() for j in missing)}); rerun them, or pass "
              f"--allow-missing to plot the {len(found)} there are", file=sys.stderr)
        return 2
    plot(points, baseline, a.x, a.out, a.title, a.auc_tol)
    extra = {"missing": [{"sweep": j.sweep, "num": j.num, "overrides": j.overrides, "error": j.error}
                         for j in missing]} if missing else {}
    print(json.dumps({"png": a.out, **report(points, baseline, a.auc_tol), **extra}))
    return 0

