"""Network benchmark (issue 15): the bench workload at W = 2 over two emulated hosts, per link and mode.

Workload (data=bench): 26 tables x 100,000 rows, d = 16, 13 dense features, 2048 samples per rank,
Zipf 1.1, DLRM, one torch thread per rank, a fixed number of steps (default 60), one evaluation at
the end on a small eval split (excluded from samples/s). Links:
- `localhost`: no emulation, `torchrun --standalone --nproc_per_node 2` over 127.0.0.1;
- a rate (`1gbit`, `200mbit`, any tc rate): two network namespaces on a bridge, each host link
  shaped to that rate in both directions (dev/netcluster.py), `torchrun --nnodes 2`
  with one rank per host (static rendezvous on host 0). `--delay-ms` adds netem delay per link
  end where the kernel has netem.
Modes (each adds to the one it builds on):
- exact_serial: cache=none train.pipeline=off (the exact exchange, the serial step; always run: the
  baseline)
- exact_pipelined: + train.pipeline=ids
- cache_ssp: cache=lfu consistency=ssp (pull and push bound 4), serial step
- cache_ssp_pipelined: cache_ssp + train.pipeline=rows
- wire_fp16: cache_ssp_pipelined + comm.wire_precision=fp16
- exact_wire_fp16: exact_pipelined + comm.wire_precision=fp16 (no cache: every row read fresh, the
  rows and row gradients as fp16 on the wire)
A mode whose config key the trainer does not have yet prints {"error": "config key missing"}
and is not run. Every other run's config (with the overrides after `--`) is composed and checked
before the first run starts: a bad override or value is one `error: ...` line, exit status 2.

One JSON line per (link, mode) on stdout: samples/s (global, from summary.json), bytes/sample by
kind (as the trainer counts them), eval AUC, and speedup_vs_exact_serial (samples/s over the
exact_serial run of the same link in this invocation); on emulated links also the bytes the
hosts' interfaces really sent per trained sample. Progress goes to stderr.

`--repeat N` runs every mode of a link N times in N rounds, each round every mode once and its
order rotated by one (so no mode always runs first or right after the same neighbour); a run's
speedup is over the exact_serial run of its own round (`"round": r`). After a link's rounds, one
line per mode with `"summary": true`: the median samples/s and the median, min and max of the
per-round speedups. On a shared machine a single run's ratio moves by +-0.1; the median of
interleaved rounds is the figure to report.

`--phases` runs the workers under benchmarks/phases.py and adds `phases` to each line: per rank,
the milliseconds per training step spent in the step, making batches, preparing the next step,
the lookup, backward, the pushes and update, and waiting on collectives (the phases nest; see
that module), and the process CPU time per step with the share of one core it kept busy
(`cpu_ms_per_step`, `cpu_busy`: whether a rank's waits left its core idle).

    python -m benchmarks.bench_net                                   # localhost, 1gbit, 200mbit; all modes
    python -m benchmarks.bench_net --links localhost 500mbit --modes exact_serial cache_ssp --steps 100
    python -m benchmarks.bench_net --quick --links localhost 200mbit --modes exact_serial cache_ssp
    python -m benchmarks.bench_net --links localhost --repeat 5 --steps 120   # 5 interleaved rounds, medians
    python -m benchmarks.bench_net --links 1gbit --modes cache_ssp --steps 200 --phases   # where a step goes
    python -m benchmarks.bench_net -- model.embedding_dim=32         # extra trainer overrides after --
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks.phases import ENV as PHASES_ENV, read_phases
from dev import netcluster
from dev.netcluster import NetCluster, NetClusterError
from trainer.tools.cli import bad_input, input_errors
from dev.launch import ROOT, check_trainer, trainer_command  # ROOT: the runs' working directory

CACHE_SSP = ["cache=lfu", "consistency=ssp", "consistency.pull_bound=4", "consistency.push_bound=4"]
MODES = {
    "exact_serial": ["cache=none", "train.pipeline=off"],
    "exact_pipelined": ["cache=none", "train.pipeline=ids"],
    "cache_ssp": CACHE_SSP + ["train.pipeline=off"],
    "cache_ssp_pipelined": CACHE_SSP + ["train.pipeline=rows"],
    "wire_fp16": CACHE_SSP + ["train.pipeline=rows", "comm.wire_precision=fp16"],
    "exact_wire_fp16": ["cache=none", "train.pipeline=ids", "comm.wire_precision=fp16"],
}
BASELINE = "exact_serial"
DEFAULT_LINKS = ["localhost", "1gbit", "200mbit"]
WORKLOAD = ["data=bench", "model.embedding_dim=16", "train.threads=1", "train.progress=off",
            "checkpoint.enabled=false", "train.eval_every=0"]
FULL = {"steps": 60, "eval_samples": 8192}
QUICK = {"steps": 4, "eval_samples": 1024, "batch_size": 256, "max_table_rows": 10_000}


def log(msg: str) -> None:
    print(f"[bench_net] {msg}", file=sys.stderr, flush=True)


def trainer_args(mode: str, steps: int, out_dir: str | None, quick: bool, extra: list[str]) -> list[str]:
    """The trainer overrides of a run of `mode` (with no out_dir: without hydra.run.dir)."""
    size = QUICK if quick else FULL
    args = ["comm=torch", *WORKLOAD, f"train.steps={steps}", f"train.log_every={steps}",
            f"data.test_samples={size['eval_samples']}", f"data.eval_batch_size={min(4096, size['eval_samples'])}"]
    if quick:  # smaller batches and tables (start-up dominates a 4-step run)
        args += [f"data.batch_size={QUICK['batch_size']}", f"data.max_table_rows={QUICK['max_table_rows']}"]
    return args + MODES[mode] + list(extra) + ([f"hydra.run.dir={out_dir}"] if out_dir else [])


_ABSENT = object()


def missing_keys(overrides: list[str]) -> list[str]:
    """The dotted keys of `overrides` (key=value) that the composed config does not have (group
    selections such as cache=lfu are composed first, so keys they bring count as present)."""
    from omegaconf import OmegaConf

    from trainer.base.config import compose
    dotted = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "." in o.split("=", 1)[0]]
    groups = [o for o in overrides if "." not in o.split("=", 1)[0]]
    cfg = compose(groups)
    return [k for k in dotted if OmegaConf.select(cfg, k, default=_ABSENT) is _ABSENT]


def summarize(link: str, mode: str, run_dir: str, wall_s: float, tx_bytes: int | None,
              cluster: NetCluster | None) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    kinds = s["bytes_per_sample_by_kind"]
    out = {"bench": "net", "link": link,
           "link_bits_per_s": cluster.rate_bits if cluster else None,
           "delay_ms": (cluster.delay_ms if cluster and cluster.delay_applied else 0.0),
           "mode": mode, "overrides": MODES[mode], "world_size": s["world_size"], "steps": s["steps"],
           "global_batch_size": s["global_batch_size"], "samples_per_sec": round(s["samples_per_sec"], 1),
           "speedup_vs_exact_serial": None,
           "bytes_per_sample": round(s["bytes_per_sample"], 2),
           "bytes_per_sample_by_kind": {k: round(v, 2) for k, v in kinds.items()},
           "embedding_bytes_per_sample": round(s.get("embedding_bytes_per_sample",
                                                     sum(kinds.get(k, 0.0) for k in ("ids", "versions", "rows", "grads"))), 2),
           "eval_auc": s["eval_auc"], "final_loss": s["final_loss"], "wall_s": round(wall_s, 1)}
    if tx_bytes is not None:  # what the hosts' veth0 really sent (training, eval, rendezvous, headers)
        out["link_tx_bytes_per_sample"] = round(tx_bytes / (s["steps"] * s["global_batch_size"]), 2)
    if "cache" in s and isinstance(s["cache"], dict) and "hit_rate" in s["cache"]:
        out["cache_hit_rate"] = s["cache"]["hit_rate"]
    return out


def round_order(modes: list[str], r: int) -> list[str]:
    """Round r's (0-based) order of the modes: rotated left by r."""
    k = r % len(modes) if modes else 0
    return modes[k:] + modes[:k]


def summary_line(link: str, mode: str, runs: list[dict]) -> dict:
    """A link's mode over its rounds: medians of samples/s and of the per-round speedups."""
    ok = [x for x in runs if "error" not in x]
    out = {"bench": "net", "link": link, "mode": mode, "summary": True, "rounds": len(runs), "ok_rounds": len(ok)}
    sps = [x["samples_per_sec"] for x in ok]
    ups = [x["speedup_vs_exact_serial"] for x in ok if x.get("speedup_vs_exact_serial") is not None]
    if sps:
        out["samples_per_sec_median"] = round(statistics.median(sps), 1)
    if ups:
        out.update(speedup_median=round(statistics.median(ups), 3), speedup_min=min(ups), speedup_max=max(ups),
                   speedups=ups)
    return out


def run_one(link: str, mode: str, steps: int, quick: bool, extra: list[str], tmp: str,
            cluster: NetCluster | None, timeout: float, phases: bool = False) -> dict:
    run_dir = os.path.join(tmp, f"{link}-{mode}")
    if os.path.isdir(run_dir):  # an earlier round's run: start empty
        shutil.rmtree(run_dir)
    module = "benchmarks.phases" if phases else "trainer"
    args = trainer_args(mode, steps, run_dir, quick, extra)
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if phases:
        env[PHASES_ENV] = run_dir
    t0 = time.perf_counter()
    if cluster is None:
        cmd = trainer_command(2, args, "torchrun", module=module)
        results = netcluster.run_local([cmd], timeout, env=netcluster.launcher_env() | env, cwd=ROOT)
        tx = None
    else:
        before = cluster.link_stats()
        results = cluster.torchrun(["-m", module, *args], timeout=timeout, env=cluster.env(env), cwd=ROOT)
        after = cluster.link_stats()
        tx = sum(a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before))
    wall = time.perf_counter() - t0
    failed = [r for r in results if not r.ok]
    if failed or not os.path.exists(os.path.join(run_dir, "summary.json")):
        r = failed[0] if failed else results[0]
        return {"bench": "net", "link": link, "mode": mode, "error": "run failed",
                "returncode": r.returncode, "timed_out": r.timed_out, "stderr_tail": r.stderr[-1500:]}
    out = summarize(link, mode, run_dir, wall, tx, cluster)
    if phases:
        out["phases"] = read_phases(run_dir)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_net",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", nargs="+", default=DEFAULT_LINKS,
                    help="localhost and/or tc rates (1gbit, 200mbit, ...); default: %(default)s")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="default: all (exact_serial always runs: it is the baseline)")
    ap.add_argument("--steps", type=int, default=None, help=f"default {FULL['steps']} ({QUICK['steps']} with --quick)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="netem delay per link end (where available)")
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny version: {QUICK['steps']} steps of {QUICK['batch_size']} samples per rank, "
                         f"tables capped at {QUICK['max_table_rows']:,} rows, small eval")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default %(default)s)")
    ap.add_argument("--phases", action="store_true",
                    help="time the step's phases in every rank (benchmarks/phases.py): `phases` in each line")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds per link, modes interleaved, + one median line per mode (default 1)")
    a = ap.parse_args(argv)
    steps = a.steps or (QUICK if a.quick else FULL)["steps"]
    if steps < 1 or a.timeout <= 0 or a.delay_ms < 0 or a.repeat < 1:
        print("error: --steps, --timeout and --repeat must be > 0, --delay-ms >= 0", file=sys.stderr)
        return 2
    try:
        rates = {link: netcluster.parse_rate(link) for link in a.links}
    except NetClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for link, bits in rates.items():
        if bits is None and link != "localhost":
            print(f"error: link {link!r}: use `localhost` for the unshaped run, or a rate such as 1gbit",
                  file=sys.stderr)
            return 2
    modes = [BASELINE] + [m for m in MODES if m in a.modes and m != BASELINE]
    shaped = [link for link, bits in rates.items() if bits is not None]
    if shaped:
        ok, why = netcluster.availability()
        if not ok:
            print(f"error: emulated links ({', '.join(shaped)}) need root and `ip netns`: {why}", file=sys.stderr)
            return 2
    try:  # the modes this tree has keys for; every run's config, before any starts
        missing = {m: missing_keys(MODES[m]) for m in modes}
        for m in modes:
            if not missing[m]:
                check_trainer(2, trainer_args(m, steps, None, a.quick, extra), "torchrun")
    except input_errors() as exc:
        return bad_input(exc)
    total = len(a.links) * sum(1 for m in modes if not missing[m]) * a.repeat
    done, failures = 0, 0
    t_start = time.perf_counter()
    # one emulated cluster for every shaped link (re-shaped per link), torn down on any exit
    with tempfile.TemporaryDirectory(prefix="bench_net-") as tmp, \
            (NetCluster(hosts=2) if shaped else contextlib.nullcontext()) as cluster:
        for link in a.links:
            on = None
            if rates[link] is not None:
                cluster.shape(rates[link], a.delay_ms)
                on = cluster
            for mode in modes:
                if missing[mode]:
                    log(f"{link} {mode}: skipped, config key missing: {', '.join(missing[mode])}")
                    print(json.dumps({"bench": "net", "link": link, "mode": mode, "error": "config key missing",
                                      "missing": missing[mode]}), flush=True)
            runnable = [m for m in modes if not missing[m]]
            runs: dict[str, list[dict]] = {m: [] for m in runnable}
            for r in range(a.repeat):
                lines = {}
                for mode in round_order(runnable, r):
                    done += 1
                    log(f"{link} {mode}: running ({done}/{total}, {steps} steps, "
                        f"{time.perf_counter() - t_start:.0f}s so far)")
                    line = run_one(link, mode, steps, a.quick, extra, tmp, on, a.timeout, a.phases)
                    if a.repeat > 1:
                        line["round"] = r + 1
                    if "error" in line:
                        failures += 1
                        log(f"{link} {mode}: FAILED (rc {line['returncode']}): {line['stderr_tail'][-300:]}")
                    else:
                        log(f"{link} {mode}: {line['samples_per_sec']:,.0f} samples/s, "
                            f"{line['bytes_per_sample']} B/sample ({line['wall_s']}s)")
                    lines[mode] = line
                base = lines.get(BASELINE, {}).get("samples_per_sec")
                for mode in runnable:  # the speedups of this round, over this round's baseline
                    line = lines[mode]
                    if "error" not in line and base:
                        line["speedup_vs_exact_serial"] = round(line["samples_per_sec"] / base, 3)
                    runs[mode].append(line)
                    print(json.dumps(line), flush=True)
                log(f"{link}{f' round {r + 1}/{a.repeat}' if a.repeat > 1 else ''}: x" + ", x".join(
                    f"{lines[m].get('speedup_vs_exact_serial')} {m}" for m in runnable) + " vs exact serial")
            if a.repeat > 1:
                for mode in runnable:
                    line = summary_line(link, mode, runs[mode])
                    log(f"{link} {mode}: median {line.get('samples_per_sec_median', 0):,.0f} samples/s, "
                        f"x{line.get('speedup_median')} ({line.get('speedup_min')}-{line.get('speedup_max')}) "
                        f"over {line['ok_rounds']} rounds")
                    print(json.dumps(line), flush=True)
    log(f"done in {time.perf_counter() - t_start:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
