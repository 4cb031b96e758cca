"""The SSD tier (embedding.store=disk, docs/store.md) against the rows in memory: one JSON line per point.

Workload: data=bench (26 tables, one-hot, 2,048 samples per step, Zipf alpha 1.1) at `--rows` rows
per table, d = 16, row-wise Adagrad (`--optimizer`), one process, one torch thread, no checkpoint.
Per `--alphas` (1.1: the bench preset's skew; 0: uniform ids, the worst case) the points are:
- `memory`: the rows in RAM, no limit;
- `disk` at each `--cache-shares` (the RAM cache as a share of the shard's bytes), run under a
  memory cgroup (dev/memcg.py) of the cache plus `--headroom` (the process's own memory: torch,
  the dense model, the batches), so the page cache cannot keep the files: the rows really come from
  the disk. Without a memory cgroup (not root) the disk points run without it and say so
  (`"cgroup": null`): the page cache then holds the files and the points measure the tier's own
  costs only.
Each line: the steady rate (samples/s over the steps after `--warmup`, from metrics.jsonl), its
ratio to the memory point's, the unique rows a step reads, and the store block of summary.json:
the row cache's hit rate, the rows it loads and writes back per step (loads as a share of the
step's unique rows), the pages mapped per step, bytes read and written per step, the pages read
from the disk per step (bytes read / page) as a share of the step's unique rows, read latency
percentiles, the wait per step, the training thread's own page faults per step; the cgroup's peak. The points run one after another (never two at once).

    python -m benchmarks.bench_store [--rows 1000000] [--steps 300] [--warmup 100]
        [--alphas 1.1 0] [--cache-shares 0.25 0.5] [--headroom 1.5G] [--cgroup on|off] [--dir DIR]
        [-- overrides]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from dev import memcg
from dev.launch import ROOT, run_trainer, trainer_command
from trainer.tools.cli import bad_input

COMMON = ["data=bench", "model.embedding_dim=16", "train.threads=1", "train.log_every=10", "train.progress=off",
          "checkpoint.enabled=false", "data.test_samples=4096"]


def workload(rows: int, alpha: float, steps: int, optimizer: str, extra: list[str]) -> list[str]:
    return [*COMMON, f"data.table_rows=[{','.join([str(rows)] * 26)}]", f"data.zipf_alpha={alpha}",
            f"train.steps={steps}", f"optim.sparse={optimizer}", *extra]


def steady(out: str, warmup: int) -> tuple[float | None, float | None]:
    """(samples/s over the logged windows after `warmup` steps, mean unique ids per step there)."""
    rates, uniq = [], []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and r["step"] > warmup:
                rates.append(r["samples_per_sec"])
                uniq.append(r.get("rank0_unique", 0))
    if not rates:
        return None, None
    return len(rates) / sum(1.0 / x for x in rates), sum(uniq) / len(uniq)  # harmonic: equal steps per window


def point(kind: str, alpha: float, share: float | None, args: argparse.Namespace, base: dict | None) -> dict:
    out = tempfile.mkdtemp(prefix="bench-store-", dir=args.dir)
    over = workload(args.rows, alpha, args.steps, args.optimizer, args.overrides) + [f"hydra.run.dir={out}"]
    limit, peak, cgroup = None, None, None
    if kind == "disk":
        disk = base["disk_bytes"]
        cache = int(disk * share)
        over += ["embedding.store=disk", f"embedding.store_dir={args.dir}", f"embedding.store_cache_bytes={cache}"]
    argv = trainer_command(1, over)
    if kind == "disk" and args.cgroup == "on" and memcg.availability()[0]:
        limit = cache + memcg.parse_size(args.headroom)
        with memcg.MemoryCgroup(limit) as cg:
            r = cg.run(argv, timeout=args.timeout, cwd=ROOT)
            peak, cgroup = cg.peak_bytes(), cg.version
        if r.returncode != 0:
            raise RuntimeError(f"the disk point failed (exit {r.returncode}, cgroup {limit} B): "
                               f"{' '.join(argv)}\n{r.stderr[-3000:]}")
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
    else:
        summary = run_trainer(argv, out, cwd=ROOT)
    rate, uniq = steady(out, args.warmup)
    shutil.rmtree(out, ignore_errors=True)  # the run's outputs: what matters is in the line
    plan = summary["memory_plan"]
    row_bytes = plan["bytes_per_row"]
    line = {"kind": kind, "alpha": alpha, "cache_share": share, "rows_per_table": args.rows,
            "optimizer": args.optimizer, "steps": args.steps, "warmup": args.warmup,
            "samples_per_sec": rate, "unique_rows_per_step": uniq,
            "shard_bytes": plan["local_rows"] * row_bytes, "row_bytes": row_bytes,
            "cgroup": cgroup, "limit_bytes": limit, "peak_bytes": peak}
    store = summary.get("store", {})
    if kind == "disk":
        steps = max(store.get("steps", 0), 1)
        read_pages = store["bytes_read"] / steps / store["chunk_bytes"]  # the tier reads pages
        line.update(reader=store.get("reader"), ratio_to_memory=(rate / base["samples_per_sec"]) if rate and base["samples_per_sec"] else None,
                    cache_bytes=store["cache_bytes"], cache_slots=store["cache_slots"],
                    row_hit_rate=store["row_hit_rate"], rows_loaded_per_step=store["rows_read_per_step"],
                    rows_written_back_per_step=store["rows_written_per_step"],
                    rows_from_log_per_step=store["rows_read_from_log_per_step"], log_rows=store["log_rows"],
                    rows_copied_ahead_per_step=store["rows_copied_ahead_per_step"],
                    log_merges=store["log_merges"], log_merges_beside=store.get("log_merges_beside"),
                    log_merge_wait_s=store.get("log_merge_wait_s"),
                    loaded_share_of_unique=(store["rows_read_per_step"] / uniq) if uniq else None,
                    rows_bypassed=store["rows_bypassed"], cache_emptied=store["cache_emptied"],
                    page_hit_rate=store["hit_rate"], pages_mapped_per_step=store["chunks_read_per_step"],
                    bytes_read_per_step=store["bytes_read"] / steps, bytes_written_per_step=store["bytes_written"] / steps,
                    pages_read_per_step=read_pages, read_share_of_unique=(read_pages / uniq) if uniq else None,
                    read_latency=store["read_latency"], wait_ms_per_step=1e3 * store["wait_s"] / steps,
                    sync_faults_per_step=store["sync_faults"] / steps)
    else:
        line["disk_bytes"] = plan["local_rows"] * row_bytes
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_store", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per table (26 tables)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100, help="steps left out of the steady rate")
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.1, 0.0], help="Zipf skews (0: uniform)")
    ap.add_argument("--cache-shares", type=float, nargs="+", default=[0.25, 0.5], metavar="S")
    ap.add_argument("--headroom", default="1.5G", help="the cgroup's memory beside the cache")
    ap.add_argument("--cgroup", choices=["on", "off"], default="on",
                    help="off: the disk points without a memory cgroup (the page cache may hold the files: "
                         "the tier's own costs)")
    ap.add_argument("--optimizer", default="rowwise_adagrad", choices=["sgd", "adagrad", "rowwise_adagrad"])
    ap.add_argument("--dir", default=None, help="where the shard files and outputs go (default: the temp dir)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("overrides", nargs="*", help="trainer overrides after --")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup or args.rows < 1 or any(not 0 < s <= 1 for s in args.cache_shares):
        return bad_input("--steps must exceed --warmup, --rows be >= 1 and each --cache-shares in (0, 1]")
    args.dir = args.dir or tempfile.gettempdir()
    os.makedirs(args.dir, exist_ok=True)
    if args.cgroup == "on" and not memcg.availability()[0]:
        print(f"[bench_store] no memory cgroup ({memcg.availability()[1]}): the disk points run without a limit",
              file=sys.stderr)
    for alpha in args.alphas:
        base = point("memory", alpha, None, args, None)
        print(json.dumps(base), flush=True)
        for share in args.cache_shares:
            print(json.dumps(point("disk", alpha, share, args, base)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
