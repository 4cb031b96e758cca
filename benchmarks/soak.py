"""Soak test: many training steps in one process; memory growth and throughput drift, one JSON line.

Why: a leak of a few KB per step (a growing list, a cache that never evicts, tensors kept alive by a
counter) is invisible in a 300-step run and fatal in a week-long one; so is a step that slowly
gets slower. This trains the trainer's own step (runner.Trainer.train_step, W = 1, local backend,
no checkpoints, no eval) for --steps steps and samples, every --sample-every steps, the process's
resident memory (VmRSS) and the samples/s of the window since the last sample.

Reported (one JSON line on stdout):
- rss_slope_mib_per_1k_steps: slope of a least-squares line through the RSS samples after the
  warm-up (--warmup steps: allocator pools, caches and optimizer state fill up first);
- throughput_drift: mean samples/s of the last quarter of the post-warm-up windows divided by the
  first quarter's (1.0 = no drift; < 1 = slower at the end);
- rss_mib_{start,end,max}, samples_per_sec_{first,last}_quarter, wall_s, final_loss, and `series`:
  [step, rss MiB, samples/s] of every sample.

    python -m benchmarks.soak [--steps 3000] [--sample-every 50] [--warmup 500] [overrides ...]
    python -m benchmarks.soak --steps 5000 data=criteo_like cache=lru consistency=ssp
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from trainer.tools.cli import bad_input, input_errors


def rss_mib() -> float:
    """Resident set size of this process now (not the peak), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    p.add_argument("--sample-every", type=int, default=50, help="steps between RSS/throughput samples")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the fits (default: min(500, steps // 5))")
    p.add_argument("overrides", nargs="*", help="trainer config overrides (default preset: data=tiny)")
    a = p.parse_intermixed_args(argv)
    if a.steps <= 0 or a.sample_every <= 0:
        p.error("--steps and --sample-every must be > 0")
    a.warmup = min(500, a.steps // 5) if a.warmup is None else a.warmup
    if not 0 <= a.warmup < a.steps:
        p.error("--warmup must be in [0, steps)")
    return a


def config(steps: int, overrides: list[str]):
    """The validated Config of the soak's run (bad overrides raise: trainer.tools.cli.input_errors)."""
    from trainer.run.resolve.configure import compose_config

    return compose_config(["comm=local", "train.progress=off", "checkpoint.enabled=false", *overrides,
                           f"train.steps={steps}"])


def soak(cfg, steps: int, sample_every: int) -> tuple[list[tuple[int, float, float]], float, list]:
    """Train `steps` steps of cfg; return ([(steps done, rss MiB, samples/s of the window)], wall
    seconds, losses)."""
    from trainer.base.comm import LocalCollectives
    from trainer.run.runner import Trainer

    trainer = Trainer(cfg, LocalCollectives(cfg.comm.timeout_s), None)
    series = [(0, rss_mib(), float("nan"))]
    t0 = window = time.perf_counter()
    for step in range(steps):
        trainer.losses.append(trainer.train_step(step))  # as Trainer.fit keeps them
        done = step + 1
        if done % sample_every == 0 or done == steps:
            now = time.perf_counter()
            n = done - series[-1][0]
            series.append((done, rss_mib(), n * trainer.global_batch / max(now - window, 1e-9)))
            window = now
    return series, time.perf_counter() - t0, trainer.losses


def report(series: list[tuple[int, float, float]], warmup: int, wall: float, losses: list[float],
           overrides: list[str]) -> dict:
    after = [s for s in series[1:] if s[0] > warmup]
    x = np.array([s[0] for s in after], dtype=np.float64)
    rss = np.array([s[1] for s in after])
    sps = np.array([s[2] for s in after])
    slope = float(np.polyfit(x, rss, 1)[0] * 1000) if len(after) >= 2 else None
    q = max(1, len(after) // 4)
    first, last = float(sps[:q].mean()), float(sps[-q:].mean())
    finite = [v for v in losses if np.isfinite(v)]
    return {"soak": "train", "world_size": 1, "steps": series[-1][0], "warmup_steps": warmup,
            "samples": len(after), "overrides": overrides,
            "rss_mib_start": round(series[0][1], 1), "rss_mib_after_warmup": round(float(rss[0]), 1),
            "rss_mib_end": round(series[-1][1], 1), "rss_mib_max": round(max(s[1] for s in series), 1),
            "rss_slope_mib_per_1k_steps": None if slope is None else round(slope, 3),
            "samples_per_sec_first_quarter": round(first, 1), "samples_per_sec_last_quarter": round(last, 1),
            "throughput_drift": round(last / first, 3),
            "wall_s": round(wall, 1), "final_loss": float(np.mean(finite[-10:])) if finite else None,
            "series": [[s[0], round(s[1], 2), None if np.isnan(s[2]) else round(s[2], 1)] for s in series]}


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    samples = [min(s, a.steps) for s in range(a.sample_every, a.steps + a.sample_every, a.sample_every)]
    if len([s for s in samples if s > a.warmup]) < 2:  # the steps soak() samples at, after the warm-up
        print(f"error: too few samples after the warm-up: --steps {a.steps}, --sample-every "
              f"{a.sample_every}, --warmup {a.warmup}", file=sys.stderr)
        return 2
    try:
        cfg = config(a.steps, a.overrides)
    except input_errors() as exc:
        return bad_input(exc)
    series, wall, losses = soak(cfg, a.steps, a.sample_every)
    print(json.dumps(report(series, a.warmup, wall, losses, a.overrides)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
