"""The SSD tier (embedding.store=disk) at scale: a model several times a memory cgroup's limit trains
at W = 1 and saves, then resumes at W = 2 (each rank in a cgroup of the same limit) and trains on;
one JSON line per phase.

Workload: data=bench (26 tables, one-hot, 2,048 samples a step, Zipf alpha 1.1), d = 16, row-wise
Adagrad, one torch thread, the tables sized so that the shard files hold `--model` bytes (a row's
record: 80 B). Each rank runs in a memory cgroup (dev/memcg.py) of `--limit` bytes, which charges
the page cache too, so the files cannot stay in RAM; its row cache is `--cache` bytes. Each line:
the phase (`train`: W = 1 from nothing, its end saved; `resume`: W = 2 from that checkpoint, not
saved again), its wall time and the parts of it the trainer timed (`setup_s`: the shard's files
set up, its initial rows written; `save_s`; `load_s`; each as the trainer says it for work of 10 s
or more, else null), the steady rate (samples/s over the logged windows after the first fifth of the
phase's steps), the peak RSS of its processes (getrusage of each rank: what the process itself
held mapped, torch's libraries included, the page cache not) and the cgroup's peak (the page cache
counted; pages of files another cgroup read first, such as torch's libraries, are not), OOM kills, the
shard files' and the checkpoint's bytes, rank 0's rows read a step, its wait on the reads, and its
write-back log's merges and the time the steps waited on them. The machine needs ~3.5x the model on disk (checked
first): at the resume's peak, the files (the shard and its log), the checkpoint and the load's
scratch; a model twice this machine's RAM needs 7x the RAM. `--train-only`: the W = 1 phase alone,
not saved (checkpoint.enabled=false), its files alone on disk (~1.5x the model: the shard and its
log), for a model too big for the disk to also hold a checkpoint and a load's scratch.

    python -m benchmarks.store_scale --model 20G --limit 8G [--cache 6G] [--steps 300]
        [--resume-steps 60 | --train-only] [--dir DIR] [-- overrides]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import threading

import torch

from benchmarks.bench_store import steady
from dev import memcg
from dev.launch import ROOT
from trainer.sparse.embedding.store.tier.disk import record_layout
from trainer.sparse.embedding.store.tiered import record_fields
from trainer.tools.cli import bad_input

TABLES = 26
COMMON = ["data=bench", "model.embedding_dim=16", "optim.sparse=rowwise_adagrad", "train.threads=1",
          "train.log_every=10", "train.progress=off", "data.test_samples=4096"]
# runs the trainer, then writes its peak RSS (getrusage of the children: this wrapper's own is not
# counted) to argv[1]
WRAP = ("import json, resource, subprocess, sys\n"
        "rc = subprocess.run(sys.argv[2:]).returncode\n"
        "json.dump({'maxrss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}, open(sys.argv[1], 'w'))\n"
        "sys.exit(rc)\n")


def record_bytes() -> int:
    return record_layout(record_fields(16, torch.float32, "rowwise_adagrad"))[1]


# the trainer's lines for long work (trainer/base/core/progress.py: said when it took >= 10 s)
TIMED = {"setup_s": r"shard, [\d,]+ rows .* set up in (\d+) s", "save_s": r"of shards saved in (\d+) s",
         "load_s": r"loaded its rows in (\d+) s"}


def timed(stderrs: list[str]) -> dict[str, int | None]:
    """{setup_s, save_s, load_s}: the longest each rank said it took (None: none said, under 10 s)."""
    out = {}
    for key, pattern in TIMED.items():
        took = [int(m) for err in stderrs for m in re.findall(pattern, err)]
        out[key] = max(took) if took else None
    return out


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def phase(name: str, world: int, steps: int, args: argparse.Namespace, rows: int, out: str, extra: list[str]) -> dict:
    """One phase: `world` ranks, each in its own cgroup of --limit, to step `steps`."""
    over = [*COMMON, f"data.table_rows=[{','.join([str(rows)] * TABLES)}]", f"train.steps={steps}",
            "embedding.store=disk", f"embedding.store_dir={os.path.join(args.dir, 'store')}",
            f"embedding.store_cache_bytes={args.cache}", f"hydra.run.dir={out}",
            *extra, *args.overrides]
    port, results = _free_port(), [None] * world

    def rank(r: int) -> None:
        rss = os.path.join(args.dir, f"rss-{r}.json")
        comm = ["comm=torch"] if world > 1 else []
        env = dict(os.environ)  # the trainer found from the root (cwd), as every worker here
        if world > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with memcg.MemoryCgroup(args.limit) as cg:
            res = cg.run([sys.executable, "-c", WRAP, rss, sys.executable, "-m", "trainer", *comm, *over],
                         timeout=args.timeout, cwd=ROOT, env=env)
            maxrss = None  # the wrapper wrote none: it was killed
            if os.path.exists(rss):
                with open(rss) as f:
                    maxrss = json.load(f)["maxrss"]
                os.remove(rss)
            results[r] = (res, cg.peak_bytes(), cg.oom_kills(), maxrss)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, got in enumerate(results):
        if got is None or got[0].returncode != 0 or got[3] is None:
            why = f"exit {got[0].returncode}, {got[2]} OOM kills: {got[0].stderr[-3000:]}" if got else "no result"
            raise RuntimeError(f"the {name} phase failed on rank {r}: {why}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    first = summary.get("start_step", 0)
    rate, _ = steady(out, first + (steps - first) // 5)
    store = summary["store"]
    return {"phase": name, "world": world, "model_bytes": rows * TABLES * record_bytes(), "rows": rows * TABLES,
            "limit_bytes": args.limit, "cache_bytes": args.cache, "from_step": first, "to_step": steps,
            "wall_s": round(max(g[0].wall_s for g in results), 1), **timed([g[0].stderr for g in results]),
            "samples_per_sec": rate,
            "peak_rss_bytes": max(g[3] for g in results), "cgroup_peak_bytes": max(g[1] for g in results),
            "rss_over_cache_bytes": max(g[3] for g in results) - args.cache, "oom_kills": sum(g[2] for g in results),
            "reader": store.get("reader"), "rank0_disk_bytes": store["disk_bytes"],
            "rank0_rows_read_per_step": store["rows_read_per_step"], "rank0_wait_s": store["wait_s"],
            "rank0_log_merges": store["log_merges"], "rank0_log_merge_wait_s": store["log_merge_wait_s"],
            "checkpoint_bytes": du(os.path.join(out, "checkpoints"))}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.store_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the shard files' bytes at W = 1 (e.g. 20G)")
    ap.add_argument("--limit", required=True, help="each rank's memory cgroup (e.g. 8G)")
    ap.add_argument("--cache", default=None, help="each rank's row cache (default: the limit less 1.5G)")
    ap.add_argument("--steps", type=int, default=300, help="the W = 1 phase's steps")
    ap.add_argument("--resume-steps", type=int, default=60, help="the W = 2 phase's steps")
    ap.add_argument("--train-only", action="store_true",
                    help="the W = 1 phase alone, not saved: the files alone on disk (~1.5x the model)")
    ap.add_argument("--dir", default=None, help="the files, the checkpoint and the outputs (default: the temp dir)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per phase")
    ap.add_argument("overrides", nargs="*", help="trainer overrides after --")
    args = ap.parse_args(argv)
    try:
        model, args.limit = memcg.parse_size(args.model), memcg.parse_size(args.limit)
        args.cache = memcg.parse_size(args.cache) if args.cache else args.limit - (3 << 29)
    except ValueError as e:
        return bad_input(str(e))
    if args.cache <= 0 or args.cache >= args.limit or args.steps < 5 or args.resume_steps < 5:
        return bad_input(f"--cache ({args.cache} B) must be in (0, --limit), --steps and --resume-steps >= 5")
    args.dir = args.dir or tempfile.gettempdir()
    os.makedirs(args.dir, exist_ok=True)
    rows = max(1, model // (TABLES * record_bytes()))
    free = shutil.disk_usage(args.dir).free
    # the resume's peak: the files (the shard and its log, up to half of it), a checkpoint, and the
    # load's bucket scratch (checkpoint/buckets.py), each about the shard's bytes; --train-only: the files
    need = int((1.5 if args.train_only else 3.5) * rows * TABLES * record_bytes()) + (1 << 30)
    if need > free:
        what = "the files (the shard and its log)" if args.train_only else "the files, a checkpoint and a load's scratch"
        return bad_input(f"--model {args.model}: {what} need ~{need / 1e9:.1f} GB, {args.dir} has {free / 1e9:.1f} GB free")
    ok, why = memcg.availability()
    if not ok:
        return bad_input(f"needs a memory cgroup (root, cgroup v1 or v2): {why}")
    out = tempfile.mkdtemp(prefix="store-scale-", dir=args.dir)
    try:
        print(json.dumps(phase("train", 1, args.steps, args, rows, out,
                               ["checkpoint.enabled=false"] if args.train_only else [])), flush=True)  # saved at its end
        if args.train_only:
            return 0
        # resumed from it; no save (a second checkpoint would need the model's bytes again on disk)
        print(json.dumps(phase("resume", 2, args.steps + args.resume_steps, args, rows, out,
                               ["checkpoint.resume=auto", "checkpoint.enabled=false"])),
              flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(os.path.join(args.dir, "store"), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
