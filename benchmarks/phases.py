"""Wall-clock time per step phase, for benchmarks (`python -m benchmarks.bench_net --phases`).

    STEP_PHASES_DIR=DIR python -m benchmarks.phases OVERRIDES...    # under a launcher, per rank

runs `python -m trainer OVERRIDES...` with timers around the phases of a training step and, when
the process exits, writes this rank's milliseconds per training step to DIR/phases_rank<r>.json:
{"rank", "steps", "ms_per_step": {phase: ms}, "calls": {phase: n}, "cpu_ms_per_step", "cpu_busy"}.
The phases (methods timed):

- step: a whole training step (Trainer.train_step);
- batch: making a batch (TrainPipeline.batch; with train.pipeline the next step's, inside prefetch);
- prefetch: preparing the next step during this one (TrainPipeline.prefetch: its batch, plan,
  requests);
- lookup: the training step's embedding lookup (HybridEmbedding.lookup: replies, cache; the serial
  step's plan and requests are made just before it, in TrainPipeline.start; PaddedStep.lookup for
  train.cuda_graph=on at W > 1: its request, exchanges and pooled gather);
- backward: loss.backward();
- apply: the row pushes and the owners' update (HybridEmbedding.begin_update and the function it
  returns, one call; the pipelined step starts the dense allreduce between the two halves;
  PaddedStep.update_rows likewise);
- wait: waiting on collective handles (Handle.wait), inside the phases above and the dense
  allreduce.

The phases nest (wait inside lookup, prefetch and apply; batch inside prefetch), so they do not
add up to the step. `ms_per_step` averages every step; `ms_per_step_steady` those after the first
10 (and after the profiled ones, below): the first steps compile kernels and fill caches. Beside the wall-clock phases, `cpu_ms_per_step` is the CPU time the whole
process (its main thread, gloo's threads, the kernel work they cause) used per training step, and
`cpu_busy` that over the step's wall-clock time: 1.0 is one core busy the whole step. A rank whose
waits are for its peer shows a low `cpu_busy`; ranks that share too few cores show waits with a
high one (the time went to the other rank's threads). Evaluations and start-up are outside every
phase except wait. Wrapping the methods costs about a microsecond per call: nothing next to a step.

STEP_PROFILE_STEPS=N (with the above) also runs torch.profiler over training steps 11..10+N and adds
`profile` to the report: wall ms per profiled step, device (kernel) busy ms per step and its share
of the wall time (the union of kernel intervals: overlapping kernels count once), kernel launches,
aten ops and host-device copies per step, and the top kernels and top ops by time. On a CPU run
the device figures are absent (the ops still are).
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
    ("step", "trainer.run.runner", "Trainer", "train_step"),
    ("batch", "trainer.step.pipeline", "TrainPipeline", "batch"),
    ("prefetch", "trainer.step.pipeline", "TrainPipeline", "prefetch"),
    ("lookup", "trainer.sparse.embedding.module", "HybridEmbedding", "lookup"),
    ("apply", "trainer.sparse.embedding.module", "HybridEmbedding", "begin_update"),
    # train.cuda_graph=on at W > 1 (its own padded lookup and update, not HybridEmbedding's)
    ("lookup", "trainer.step.padded_step", "PaddedStep", "lookup"),
    ("apply", "trainer.step.padded_step", "PaddedStep", "update_rows"),
    ("wait", "trainer.base.comm.base", "Handle", "wait"),
    ("backward", "torch", "Tensor", "backward"),
)
HALVES = {"begin_update", "update_rows"}  # methods that return their second half: it is timed in the same phase
ENV = "STEP_PHASES_DIR"
PROFILE_ENV = "STEP_PROFILE_STEPS"
PROFILE_AFTER = 10  # steps before the profiled ones (warm-up: compilation, allocator, caches)


class StepProfile:
    """torch.profiler over `steps` training steps after PROFILE_AFTER, summarised (see the module
    docstring): begin() before a step, end() after one; `result` once the steps have run."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen, self.prof, self.t0, self.wall = steps, 0, None, 0.0, 0.0
        self.result: dict[str, Any] | None = None

    def _sync(self) -> None:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def begin(self) -> None:
        if self.seen == PROFILE_AFTER and self.prof is None and self.result is None:
            import torch
            import torch.profiler as tp
            acts = [tp.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(tp.ProfilerActivity.CUDA)
            self._sync()
            self.prof = tp.profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def end(self) -> None:
        self.seen += 1
        if self.prof is not None and self.seen == PROFILE_AFTER + self.steps:
            self._sync()
            self.wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.result = self._summarise(self.prof)
            self.prof = None

    def _summarise(self, prof: Any) -> dict[str, Any]:
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            trace = json.load(open(f.name))
        events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
        n = self.steps
        kernels = [e for e in events if e.get("cat") == "kernel"]
        copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        launches = [e for e in events if e.get("cat") == "cuda_runtime"
                    and ("LaunchKernel" in e.get("name", "") or "Launch" in e.get("name", ""))]

        def busy(evs: list[dict]) -> float:  # the union of [ts, ts + dur), microseconds
            total, end = 0.0, -1.0
            for e in sorted(evs, key=lambda e: e["ts"]):
                a, b = e["ts"], e["ts"] + e.get("dur", 0)
                if b > end:
                    total += b - max(a, end)
                    end = b
            return total

        def top(evs: list[dict], k: int = 12) -> list[dict[str, Any]]:
            by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
            for e in evs:
                by[e["name"][:90]][0] += e.get("dur", 0)
                by[e["name"][:90]][1] += 1
            rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:k]
            return [{"name": name, "ms_per_step": round(us / 1e3 / n, 4), "calls_per_step": round(c / n, 2)}
                    for name, (us, c) in rows]

        wall_ms = 1e3 * self.wall / n
        out: dict[str, Any] = {"steps": n, "wall_ms_per_step": round(wall_ms, 3),
                               "aten_ops_per_step": round(len(ops) / n, 1),
                               "top_ops_inclusive_cpu": top(ops)}
        if kernels or copies:
            dev_ms = busy(kernels + copies) / 1e3 / n
            out.update({"device_busy_ms_per_step": round(dev_ms, 3),
                        "device_busy": round(dev_ms / wall_ms, 3) if wall_ms > 0 else None,
                        "kernel_ms_per_step": round(sum(e.get("dur", 0) for e in kernels) / 1e3 / n, 3),
                        "kernels_per_step": round(len(kernels) / n, 1),
                        "launch_calls_per_step": round(len(launches) / n, 1),
                        "copies_per_step": round(len(copies) / n, 1),
                        "top_kernels": top(kernels + copies)})
        return out


class Timers:
    """Seconds and calls per phase, accumulated by wrapped methods."""

    CPU_PHASE = "step"  # the phase whose process CPU time is counted too

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.cpu_seconds = 0.0  # process CPU time (every thread) inside CPU_PHASE
        self.at_steady: tuple[dict[str, float], int] | None = None  # (seconds, steps) when steady began
        steps = int(os.environ.get(PROFILE_ENV, "0") or 0)
        self.profile = StepProfile(steps) if steps > 0 else None

    def wrap(self, phase: str, fn: Callable[..., Any], halves: bool = False) -> Callable[..., Any]:
        cpu = phase == self.CPU_PHASE

        def second(rest: Callable[[], Any]) -> Callable[[], Any]:  # timed, not counted as a call
            def timed_rest() -> Any:
                t0 = time.perf_counter()
                try:
                    return rest()
                finally:
                    self.seconds[phase] += time.perf_counter() - t0
            return timed_rest

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if cpu and self.profile is not None:
                self.profile.begin()
            t0, c0 = time.perf_counter(), time.process_time() if cpu else 0.0
            try:
                out = fn(*args, **kwargs)
                return second(out) if halves else out
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.calls[phase] += 1
                if cpu:
                    self.cpu_seconds += time.process_time() - c0
                    if self.profile is not None:
                        self.profile.end()
                    if self.calls[phase] == self.steady_from():  # warm-up (and profiled steps) done
                        self.at_steady = (dict(self.seconds), self.calls[phase])
        return timed

    def steady_from(self) -> int:
        """Steps before the steady ones: the first PROFILE_AFTER (compilation, autotuning, the
        allocator's first blocks) and the profiled ones (slowed by the profiler)."""
        return PROFILE_AFTER + (self.profile.steps if self.profile is not None else 0)

    def install(self) -> None:
        """Wrap every method of PHASES (once per process)."""
        for phase, module, cls, method in PHASES:
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, method, self.wrap(phase, getattr(owner, method), method in HALVES))

    def report(self, rank: int) -> dict[str, Any]:
        steps = self.calls.get("step", 0)
        per = max(steps, 1)
        wall = self.seconds.get(self.CPU_PHASE, 0.0)
        return {"rank": rank, "steps": steps,
                "ms_per_step": {p: round(1e3 * self.seconds.get(p, 0.0) / per, 3) for p, *_ in PHASES},
                "calls": {p: self.calls.get(p, 0) for p, *_ in PHASES},
                "cpu_ms_per_step": round(1e3 * self.cpu_seconds / per, 3),
                "cpu_busy": round(self.cpu_seconds / wall, 3) if wall > 0 else 0.0,
                **({"ms_per_step_steady": self._steady(steps)} if self.at_steady and steps > self.at_steady[1] else {}),
                **({"profile": self.profile.result} if self.profile is not None and self.profile.result else {})}


    def _steady(self, steps: int) -> dict[str, float]:
        """ms per step by phase over the steps after steady_from()."""
        then, done = self.at_steady
        n = steps - done
        return {p: round(1e3 * (self.seconds.get(p, 0.0) - then.get(p, 0.0)) / n, 3) for p, *_ in PHASES}


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
