"""Peak memory and I/O per phase of a training run, per rank (for benchmarks/bench_scale.py).

    SCALE_PROBE_DIR=DIR python -m benchmarks.scale_probe OVERRIDES...    # under a launcher, per rank

runs `python -m trainer OVERRIDES...` with probes around the phases of a run and, when the process
exits, writes DIR/scale_rank<r>.json: per phase the calls, the wall-clock seconds, the peak
resident memory while the phase ran (bytes: Linux's VmHWM, reset through /proc/self/clear_refs when
the phase starts), the resident memory when it started, and the bytes the process read and wrote
in it (/proc/self/io: `rchar` / `wchar`, what passed through read and write calls, page cache or
not; `read_bytes` / `write_bytes`, what reached the storage). Also `steady_rss` (VmRSS right after
the last training step: the run's working set), `share_bytes` (the rank's share of the model: its
rows, their versions and sparse optimizer state, as allocated) and `rows` (its storage rows).

Phases (methods probed): init (Trainer.__init__, the whole set-up), store_init (ShardStore.__init__:
the rows' allocation and initialisation, inside init), resume (CheckpointManager.resume, inside
init), train (Trainer.train_step: every step), eval (Evaluator.predict: evaluations and the
calibration's forward passes), save (CheckpointManager.save), snapshot (BestSnapshot.take) and
restore (BestSnapshot.restore). A phase inside another (store_init, resume) has its own peak, and
the outer phase's peak is the highest of its own and its inner phases'. Probing costs a few
system calls per call of a phase.
"""
from __future__ import annotations

import importlib
import re
import time
from typing import Any, Callable

from benchmarks.phases import run_trainer_probed

PHASES = (  # (phase, module, class, method)
    ("init", "trainer.run.runner", "Trainer", "__init__"),
    ("store_init", "trainer.sparse.embedding.store.shard", "ShardStore", "__init__"),
    ("resume", "trainer.run.checkpoint.manager", "CheckpointManager", "resume"),
    ("train", "trainer.run.runner", "Trainer", "train_step"),
    ("eval", "trainer.run.evaluation.evaluator", "Evaluator", "predict"),
    ("save", "trainer.run.checkpoint.manager", "CheckpointManager", "save"),
    ("snapshot", "trainer.run.evaluation.best", "BestSnapshot", "take"),
    ("restore", "trainer.run.evaluation.best", "BestSnapshot", "restore"),
)
ENV = "SCALE_PROBE_DIR"
IO_KEYS = ("rchar", "wchar", "read_bytes", "write_bytes")


def status_kb(field: str) -> int:
    """A /proc/self/status field in kB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)", f.read(), flags=re.M)
    return int(m.group(1)) if m else 0


def reset_peak() -> None:
    """Set VmHWM back to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        pairs = (line.split(":") for line in f if ":" in line)
        got = {k.strip(): int(v) for k, v in pairs}
    return {k: got.get(k, 0) for k in IO_KEYS}


class Probe:
    """Per phase: calls, seconds, peak RSS, RSS at the first start, I/O bytes (see the module doc)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, Any]] = {}
        self.stack: list[list[int]] = []  # per open phase: [its running peak in kB]
        self.steady_rss = 0
        self.share_bytes = 0
        self.rows = 0

    def _record(self, name: str) -> dict[str, Any]:
        return self.phases.setdefault(name, {"calls": 0, "seconds": 0.0, "peak_rss": 0, "rss_at_start": None,
                                             **{k: 0 for k in IO_KEYS}})

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def probed(*args: Any, **kwargs: Any) -> Any:
            if self.stack:  # the phase around this one: keep its peak so far
                self.stack[-1][0] = max(self.stack[-1][0], status_kb("VmHWM"))
            rec = self._record(name)
            if rec["rss_at_start"] is None:
                rec["rss_at_start"] = status_kb("VmRSS") * 1024
            reset_peak()
            io0, t0 = io_counters(), time.perf_counter()
            self.stack.append([0])
            try:
                return fn(*args, **kwargs)
            finally:
                peak = max(self.stack.pop()[0], status_kb("VmHWM"))
                io1 = io_counters()
                rec["calls"] += 1
                rec["seconds"] += time.perf_counter() - t0
                rec["peak_rss"] = max(rec["peak_rss"], peak * 1024)
                for k in IO_KEYS:
                    rec[k] += io1[k] - io0[k]
                if self.stack:  # the outer phase's peak includes this one's
                    self.stack[-1][0] = max(self.stack[-1][0], peak)
                reset_peak()
                if name == "train":
                    self.steady_rss = status_kb("VmRSS") * 1024
                if name == "store_init" and args:
                    self._share(args[0])
        return probed

    def _share(self, store: Any) -> None:
        """The rank's share of the model as its ShardStore allocated it."""
        state = store.optimizer.state_tensors()
        self.share_bytes = (store.weight.numel() * store.weight.element_size()
                            + store.version.numel() * store.version.element_size()
                            + sum(v.numel() * v.element_size() for v in state.values()))
        self.rows = int(store.weight.shape[0])

    def install(self) -> None:
        for name, module, cls, method in PHASES:
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, method, self.wrap(name, getattr(owner, method)))

    def report(self, rank: int) -> dict[str, Any]:
        return {"rank": rank, "phases": self.phases, "steady_rss": self.steady_rss,
                "share_bytes": self.share_bytes, "rows": self.rows}


def main() -> None:
    run_trainer_probed(__doc__, ENV, "scale", Probe)


if __name__ == "__main__":
    main()
