"""Wall-clock time per step phase, for benchmarks (`benchmarks/bench_net.py --phases`).

    STEP_PHASES_DIR=DIR python -m benchmarks.phases OVERRIDES...    # under a launcher, per rank

runs `python -m trainer OVERRIDES...` with timers around the phases of a training step and, when
the process exits, writes this rank's milliseconds per training step to DIR/phases_rank<r>.json:
{"rank", "steps", "ms_per_step": {phase: ms}, "calls": {phase: n}, "cpu_ms_per_step", "cpu_busy"}.
The phases (methods timed):

- step: a whole training step (Trainer.train_step);
- batch: making a batch (StepPipeline.batch; with train.pipeline the next step's, inside prefetch);
- prefetch: preparing the next step during this one (StepPipeline.prefetch: its batch, plan,
  requests);
- lookup: the training step's embedding lookup (HybridEmbedding.lookup: replies, cache; the serial
  step's plan and requests are made just before it, in StepPipeline.start);
- backward: loss.backward();
- apply: the row pushes, the owners' update and (pipelined) the dense allreduce's start
  (HybridEmbedding.apply_gradients);
- wait: waiting on collective handles (Handle.wait), inside the phases above and the dense
  allreduce.

The phases nest (wait inside lookup, prefetch and apply; batch inside prefetch), so they do not
add up to the step. Beside the wall-clock phases, `cpu_ms_per_step` is the CPU time the whole
process (its main thread, gloo's threads, the kernel work they cause) used per training step, and
`cpu_busy` that over the step's wall-clock time: 1.0 is one core busy the whole step. A rank whose
waits are for its peer shows a low `cpu_busy`; ranks that share too few cores show waits with a
high one (the time went to the other rank's threads). Evaluations and start-up are outside every
phase except wait. Wrapping the methods costs about a microsecond per call: nothing next to a step.
"""
from __future__ import annotations

import atexit
import collections
import functools
import importlib
import json
import os
import runpy
import sys
import time
from typing import Any, Callable

PHASES = (  # (phase, module, class, method)
    ("step", "trainer.runner", "Trainer", "train_step"),
    ("batch", "trainer.pipeline", "StepPipeline", "batch"),
    ("prefetch", "trainer.pipeline", "StepPipeline", "prefetch"),
    ("lookup", "trainer.embedding.module", "HybridEmbedding", "lookup"),
    ("apply", "trainer.embedding.module", "HybridEmbedding", "apply_gradients"),
    ("wait", "trainer.comm.base", "Handle", "wait"),
    ("backward", "torch", "Tensor", "backward"),
)
ENV = "STEP_PHASES_DIR"


class Timers:
    """Seconds and calls per phase, accumulated by wrapped methods."""

    CPU_PHASE = "step"  # the phase whose process CPU time is counted too

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.cpu_seconds = 0.0  # process CPU time (every thread) inside CPU_PHASE

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        cpu = phase == self.CPU_PHASE

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time() if cpu else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.calls[phase] += 1
                if cpu:
                    self.cpu_seconds += time.process_time() - c0
        return timed

    def install(self) -> None:
        """Wrap every method of PHASES (once per process)."""
        for phase, module, cls, method in PHASES:
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, method, self.wrap(phase, getattr(owner, method)))

    def report(self, rank: int) -> dict[str, Any]:
        steps = self.calls.get("step", 0)
        per = max(steps, 1)
        wall = self.seconds.get(self.CPU_PHASE, 0.0)
        return {"rank": rank, "steps": steps,
                "ms_per_step": {p: round(1e3 * self.seconds.get(p, 0.0) / per, 3) for p, *_ in PHASES},
                "calls": {p: self.calls.get(p, 0) for p, *_ in PHASES},
                "cpu_ms_per_step": round(1e3 * self.cpu_seconds / per, 3),
                "cpu_busy": round(self.cpu_seconds / wall, 3) if wall > 0 else 0.0}


def read_phases(run_dir: str) -> list[dict[str, Any]]:
    """The ranks' reports of a run under this module (DIR/phases_rank<r>.json), in rank order."""
    out = []
    for name in os.listdir(run_dir):
        if name.startswith("phases_rank") and name.endswith(".json"):
            with open(os.path.join(run_dir, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda r: r["rank"])  # by rank (a name sort puts rank10 before rank2)


def run_trainer_probed(doc: str, env: str, name: str, make: Callable[[], Any]) -> None:
    """`python -m trainer ARGS` in this process with a probe (make(): an object with install()
    and report(rank)) whose report is written to $env/<name>_rank<r>.json when the process exits.
    The wrapper main of this module and of benchmarks/scale_probe.py."""
    if sys.argv[1:2] in (["-h"], ["--help"]):  # the wrapper's usage (the trainer's own: python -m trainer --help)
        print(doc)
        return
    out = os.environ.get(env)
    if not out:
        print(f"error: set {env} to the directory for {name}_rank<r>.json", file=sys.stderr)
        sys.exit(2)
    probe = make()
    probe.install()
    rank = int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")))

    def write() -> None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
            json.dump(probe.report(rank), f)

    atexit.register(write)
    sys.argv = ["trainer", *sys.argv[1:]]
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)


def main() -> None:
    run_trainer_probed(__doc__, ENV, "phases", Timers)


if __name__ == "__main__":
    main()
