"""The seed systems on real Criteo rows: Herald, FAE and SCA, simulated and trained (issue 56, item 4).

    python -m benchmarks.bench_criteo_systems --input train.tsv                 # first 1,600 rows train, the rest test
    python -m benchmarks.bench_criteo_systems --input train.txt --train-rows 0 --hash-rows 1000000   # a whole file
    python -m benchmarks.bench_criteo_systems --prepared DIR --parts herald-sim  # an already prepared directory

A raw Criteo TSV (--input: label, 13 integers, 26 hex values per line; .gz too) is prepared into a
temporary directory (its first --train-rows rows as the training file and the rest as the test
file, or with --train-rows 0 the whole file as training data, the trainer holding out a tail),
with a vocabulary of values seen --min-count times (default 1) or hashed into --hash-rows rows per
table; everything derived from it stays in that directory, removed at the end. One JSON line per
point on stdout, progress on stderr. Parts (--parts, default all):

- data:        what the rows can resolve: training rows, ids read per epoch, distinct ids, ids read
               once, the reads of the 1% most read ids, steps per epoch at the global batch.
- herald-sim:  Herald in the simulator (trainer/tools/simulate.py simulate_schedule: the trainer's
               own feed, partition and on-demand sync planner) at each --worlds W, each
               --capacities fraction (cache.capacity_fraction: the LRU of lent rows per worker, as
               a fraction of every table) and each --epochs count: pulls / pushes against the
               naive schedule (random partition, every remote read pulled and its gradient
               pushed), beside the random partition with on-demand sync (schedule=random) and
               Herald's partition without lending (cache=none: no lent rows).
- herald-train: W = 2 gloo processes under torchrun, --train-steps steps, schedule=herald at each
               --train-capacities fraction, against a plain run (no cache, no placement): the run's
               summary.json placement.schedule counters against the simulator's for the same
               config, the rows / gradient bytes the run sent, and the plain run's measured pulls
               (its rows bytes / row bytes: the naive count).
- fae:         placement=fae trained at W = 2 for each --fae-budgets fraction of all rows (the
               budget in bytes: that many rows x bytes per row): hot rows, the hot share of every
               id read of the run's stream (counted here over the whole stream; the plan's own
               profile_read_coverage is its profiled sample), hot samples / hot steps, and
               embedding bytes per sample against the plain run, trained (W = 2) and replayed by the
               simulator at each --worlds W.
- sca:         placement=sca trained at W = 2 with cache=lru (--sca-cache) and a budget of FAE's
               5% rows plus the cache's slots (so FAE + that cache is one of its candidates), for
               each --sca-plan-steps (0: the whole run, replayed exactly): predicted against
               measured embedding bytes per sample, beside the cache alone.

Trainer overrides after `--` go to every run and simulation (e.g. -- model.embedding_dim=32).
Bad input (no such file, a global batch W does not divide, a count <= 0) is one `error: ...` line,
exit status 2.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("data", "herald-sim", "herald-train", "fae", "sca")
HERALD_KEYS = ("pulls", "pushes", "lend_pulls", "grad_pushes", "writebacks", "local_reads", "naive_remote_reads",
               "pulls_vs_naive", "pushes_vs_naive", "capacity_rows")
EMBEDDING_KINDS = ("ids", "versions", "rows", "grads", "replica")


def log(msg: str) -> None:
    print(f"[bench_criteo_systems] {msg}", file=sys.stderr, flush=True)


def emit(line: dict) -> None:
    print(json.dumps({"bench": "criteo_systems", **line}), flush=True)


def _r(x: Any, nd: int = 4) -> Any:
    return round(x, nd) if isinstance(x, float) else x


# ------------------------------------------------------------------------------------- preparing
def _open_text(path: str):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def prepare_input(a: argparse.Namespace, tmp: str) -> tuple[str, dict]:
    """The prepared directory (a.prepared, or a.input prepared under tmp) and what it holds."""
    if a.prepared:
        with open(os.path.join(a.prepared, "meta.json")) as f:
            meta = json.load(f)
        return a.prepared, {"source": "prepared", "prepared_dir_given": True, **_meta_facts(meta)}
    from trainer.workload.data.criteo import NUM_CAT
    from trainer.workload.data.prepare import PrepOptions, prepare

    raw = os.path.join(tmp, "raw")
    os.makedirs(raw)
    train, test = [a.input], []
    if a.train_rows > 0:  # the first rows train, the rest test (files of this run's temp dir only)
        train, test = [os.path.join(raw, "train.tsv")], [os.path.join(raw, "test.tsv")]
        n = 0
        with _open_text(a.input) as src, open(train[0], "w") as tr, open(test[0], "w") as te:
            for line in src:
                (tr if n < a.train_rows else te).write(line)
                n += 1
        if n <= a.train_rows:  # nothing left for a test file: the trainer holds out a tail
            os.remove(test[0])
            test = []
    hash_rows = [a.hash_rows] * NUM_CAT if a.hash_rows else None
    log(f"preparing {a.input} into {tmp} ({'hash ' + str(a.hash_rows) if hash_rows else f'min-count {a.min_count}'})")
    t0 = time.perf_counter()
    meta = prepare(PrepOptions(out=os.path.join(tmp, "prepared"), train=train, test=test, hash_rows=hash_rows,
                               min_count=None if hash_rows else a.min_count, workers=a.prep_workers,
                               progress=False))
    return os.path.join(tmp, "prepared"), {"source": "raw", "prepare_s": round(time.perf_counter() - t0, 2),
                                           **_meta_facts(meta)}


def _meta_facts(meta: dict) -> dict:
    cat = meta.get("categorical", {})
    return {"split_rows": {k: v["rows"] for k, v in meta["splits"].items()},
            "vocab": ({"kind": "hash", "hash_rows": cat.get("hash_rows", [None])[0]} if cat.get("kind") == "hash"
                      else {"kind": cat.get("kind"), "min_count": cat.get("min_count")}),
            "table_rows_total": int(sum(meta["table_rows"])), "tables": len(meta["table_rows"])}


# ------------------------------------------------------------------------------------ the configs
def base_overrides(prepared: str, a: argparse.Namespace, steps: int) -> list[str]:
    return ["data=criteo", f"data.dir={prepared}", "data.loader=memmap", f"data.global_batch_size={a.batch}",
            "train.recipe=none", "data.epochs=0", f"train.steps={steps}", *a.overrides]


def compose(overrides: list[str], world: int | None = None):
    from trainer.run.resolve.configure import compose_config
    return compose_config(overrides, world)


def row_bytes_of(cfg) -> int:
    """Bytes of one row on the wire (a pulled row, a pushed gradient)."""
    from trainer.sparse.placement.plan import ROW_ELEM
    return cfg.model.embedding_dim * ROW_ELEM[cfg.embedding.dtype]


def stream_chunks(cfg, world: int, samples: int, chunk: int = 1 << 15):
    """[n, T] flat ids of the first `samples` positions of the run's training stream, chunk by
    chunk (Criteo's fields are one-hot: one id per table and sample)."""
    from trainer.workload.data import id_rows, make_data
    from trainer.sparse.embedding.sharding import flat_ids

    data, rows = make_data(cfg, 0, world), id_rows(cfg)
    for lo in range(0, samples, chunk):
        values, lengths = data.sample_ids(data.stream_keys(np.arange(lo, min(samples, lo + chunk), dtype=np.int64)))
        if not (lengths == 1).all():
            raise ValueError("a bag of other than one id: Criteo's fields are one-hot")
        yield flat_ids(values, lengths, rows).reshape(lengths.shape)


def train_rows(cfg) -> int:
    from trainer.workload.data import make_data
    return int(make_data(cfg, 0, 1).train_rows)


# ------------------------------------------------------------------------------------------ parts
def part_data(prepared: str, a: argparse.Namespace, facts: dict) -> int:
    from trainer.workload.data import id_rows

    cfg = compose(base_overrides(prepared, a, 1))
    n = train_rows(cfg)
    counts = np.zeros(sum(id_rows(cfg)), np.int64)
    for flat in stream_chunks(cfg, 1, n):  # one epoch: every training row once
        counts += np.bincount(flat.reshape(-1), minlength=counts.size)
    reads = int(counts.sum())
    counts = counts[counts > 0]
    top = np.sort(counts)[::-1]
    k = max(1, round(0.01 * top.size))
    once = counts == 1
    emit({"part": "data", **facts, "train_rows": n, "global_batch": a.batch, "steps_per_epoch": n / a.batch,
          "reads_per_epoch": reads, "distinct_ids": int(counts.size),
          "reads_per_distinct_id": _r(reads / max(counts.size, 1)),
          "ids_read_once": int(once.sum()), "ids_read_once_share_of_ids": _r(float(once.mean())),
          "ids_read_once_share_of_reads": _r(float(once.sum() / max(reads, 1))),
          "top1pct_ids": k, "top1pct_share_of_reads": _r(float(top[:k].sum() / max(reads, 1)))})
    return n


def _schedule(overrides: list[str], world: int, steps: int) -> dict:
    from trainer.tools.simulate import simulate_schedule
    return simulate_schedule(compose(overrides), world, steps, None)


def part_herald_sim(prepared: str, a: argparse.Namespace, n: int) -> None:
    for seed in a.seeds:
        for world in a.worlds:
            for epochs in a.epochs:
                steps = max(1, int(epochs * n // a.batch))
                base = base_overrides(prepared, a, steps) + [f"data.seed={seed}"]
                t0 = time.perf_counter()
                alone = _schedule(base + ["schedule=herald", "cache=none"], world, steps)  # partition, no lending
                for cap in a.capacities:
                    cache = ["cache=lru", f"cache.capacity_fraction={cap}"]
                    h = _schedule(base + ["schedule=herald", *cache], world, steps)
                    r = _schedule(base + ["schedule=random", *cache], world, steps)
                    naive = h["naive_remote_reads"]
                    emit({"part": "herald_sim", "workers": world, "seed": seed, "epochs": epochs, "steps": steps,
                          "epochs_covered": _r(steps * a.batch / n), "global_batch": a.batch,
                          "capacity_fraction": cap, "capacity_rows": h["capacity_rows"],
                          "naive_remote_reads": naive,
                          "pulls_vs_naive": _r(h["pulls_vs_naive"]), "pushes_vs_naive": _r(h["pushes_vs_naive"]),
                          "herald": {k: _r(h[k]) for k in HERALD_KEYS},
                          # rows read by 2+ workers in a step (pulled, their gradient pushed) against naive
                          "shared_pulls_vs_naive": _r((h["pulls"] - h["lend_pulls"]) / naive if naive else None),
                          "random_partition_on_demand_sync": {"pulls_vs_naive": _r(r["pulls_vs_naive"]),
                                                              "pushes_vs_naive": _r(r["pushes_vs_naive"])},
                          "herald_partition_no_lending": {"pulls_vs_naive": _r(alone["pulls_vs_naive"]),
                                                          "pushes_vs_naive": _r(alone["pushes_vs_naive"])},
                          "targets": {"pulls_le_0.52": h["pulls_vs_naive"] <= 0.52,
                                      "pushes_le_0.42": h["pushes_vs_naive"] <= 0.42}})
                log(f"herald-sim seed={seed} W={world} epochs={epochs} ({steps} steps): "
                    f"{time.perf_counter() - t0:.1f}s")


def _train(overrides: list[str], out: str, world: int = 2) -> dict:
    from dev.launch import run_trainer, trainer_command
    return run_trainer(trainer_command(world, ["train.progress=off", "train.tensorboard=false", "train.threads=1",
                                               f"hydra.run.dir={out}", *overrides], "torchrun"), out, cwd=ROOT)


def _embedding_bytes(s: dict) -> dict:
    return {k: s["bytes"].get(k, 0) for k in EMBEDDING_KINDS}


class Plain:
    """The plain W = 2 run (no cache, no placement, random partition), trained once, shared."""

    def __init__(self, prepared: str, a: argparse.Namespace, tmp: str) -> None:
        self.prepared, self.a, self.tmp = prepared, a, tmp
        self._summary: dict | None = None

    @property
    def summary(self) -> dict:
        if self._summary is None:
            log("train plain (W=2, no cache, no placement) ...")
            self._summary = _train(base_overrides(self.prepared, self.a, self.a.train_steps),
                                   os.path.join(self.tmp, "run-plain"))
        return self._summary


def part_herald_train(prepared: str, a: argparse.Namespace, tmp: str, plain: Plain) -> None:
    base = base_overrides(prepared, a, a.train_steps)
    rb = row_bytes_of(compose(base))
    p = plain.summary
    for cap in a.train_capacities:
        extra = ["schedule=herald", "cache=lru", f"cache.capacity_fraction={cap}"]
        log(f"train herald (W=2, capacity {cap}) ...")
        s = _train(base + extra, os.path.join(tmp, f"run-herald-{cap}"))
        trained = {k: _r(s["placement"]["schedule"][k]) for k in HERALD_KEYS}
        sim = _schedule(base + extra, 2, a.train_steps)
        simulated = {k: _r(sim[k]) for k in HERALD_KEYS}
        differ = {k: [trained[k], simulated[k]] for k in HERALD_KEYS if trained[k] != simulated[k]}
        emb = _embedding_bytes(s)
        emit({"part": "herald_train", "workers": 2, "steps": a.train_steps, "global_batch": a.batch,
              "capacity_fraction": cap, "trained": trained, "simulated": simulated,
              "counters_equal": not differ, "differences": differ,
              "row_bytes": rb, "bytes": emb,
              "pulls_from_rows_bytes": emb["rows"] / rb, "pushes_from_grads_bytes": emb["grads"] / rb,
              "plain_measured_pulls": p["bytes"]["rows"] / rb, "plain_measured_pushes": p["bytes"]["grads"] / rb,
              "naive_equals_plain_measured": p["bytes"]["rows"] / rb == trained["naive_remote_reads"],
              "embedding_bytes_per_sample": {"herald": _r(s["embedding_bytes_per_sample"]),
                                             "plain": _r(p["embedding_bytes_per_sample"])},
              "herald_vs_plain_bytes": _r(s["embedding_bytes_per_sample"] / p["embedding_bytes_per_sample"]),
              "final_loss": {"herald": s["final_loss"], "plain": p["final_loss"]},
              "eval_auc": {"herald": s["eval_auc"], "plain": p["eval_auc"]}})


def _sim_bytes(overrides: list[str], world: int, steps: int) -> float:
    """Embedding bytes per global sample of `steps` steps replayed by the simulator (the trainer's
    own feed, plan and byte formulas: trainer/tools/simulate.py)."""
    from trainer.tools import simulate as sim
    trace, spec, _ = sim.build(overrides, world, "sharded", log=None)
    return sim.simulate(trace, spec, steps)["bytes_per_sample"]


def part_fae(prepared: str, a: argparse.Namespace, tmp: str, plain: Plain) -> None:
    from trainer.workload.data import make_data
    from trainer.sparse.placement import plan_run
    from trainer.sparse.placement.plan import ROW_ELEM, row_bytes

    base = base_overrides(prepared, a, a.train_steps)
    cfg0 = compose(base, 2)
    rows_total = int(sum(cfg0.data.table_rows))
    per_row = row_bytes(cfg0.model.embedding_dim, cfg0.optim.sparse, ROW_ELEM[cfg0.embedding.dtype])
    p = plain.summary
    worlds = sorted(set(a.worlds) | {2})
    plain_sim = {w: _sim_bytes(base, w, a.train_steps) for w in worlds}
    for frac in a.fae_budgets:
        budget = max(per_row, round(frac * rows_total) * per_row)
        extra = ["placement=fae", f"placement.budget_bytes={budget}"]
        log(f"train fae (W=2, budget {frac} of the rows: {budget} B) ...")
        s = _train(base + extra, os.path.join(tmp, f"run-fae-{frac}"))
        cfg = compose(base + extra, 2)
        plan = plan_run(cfg, make_data(cfg, 0, 2), 2)  # what rank 0 of the run planned (the same profile)
        reads = hot_reads = hot_samples = samples = 0
        for flat in stream_chunks(cfg, 2, a.train_steps * a.batch):  # the run's whole stream
            hot = np.isin(flat, plan.hot)
            reads, hot_reads = reads + hot.size, hot_reads + int(hot.sum())
            samples, hot_samples = samples + hot.shape[0], hot_samples + int(hot.all(axis=1).sum())
        pl = s["placement"]
        simulated = {}
        for w in worlds:
            f = _sim_bytes(base + extra, w, a.train_steps)
            simulated[str(w)] = {"fae": _r(f), "plain": _r(plain_sim[w]), "fae_vs_plain": _r(f / plain_sim[w])}
        emit({"part": "fae", "workers": 2, "steps": a.train_steps, "global_batch": a.batch,
              "budget_fraction_of_rows": frac, "budget_bytes": budget, "bytes_per_row": per_row,
              "rows_total": rows_total, "hot_rows": pl["hot_rows"], "hot_rows_replanned": int(plan.hot.size),
              "hot_share_of_reads": _r(hot_reads / max(reads, 1)),
              "profile_read_coverage": _r(pl.get("profile_read_coverage")), "profile": pl.get("profile"),
              "all_hot_sample_share": _r(hot_samples / max(samples, 1)),
              "hot_sample_fraction": _r(pl.get("hot_sample_fraction")), "hot_steps": pl.get("hot_steps"),
              "hot_step_fraction": _r(pl.get("hot_step_fraction")),
              "alltoalls_in_hot_steps": pl.get("alltoalls_in_hot_steps"),
              "embedding_bytes_per_sample": {"fae": _r(s["embedding_bytes_per_sample"]),
                                             "plain": _r(p["embedding_bytes_per_sample"])},
              "fae_vs_plain_bytes": _r(s["embedding_bytes_per_sample"] / p["embedding_bytes_per_sample"]),
              "by_kind_per_sample": {k: _r(v / s["samples"]) for k, v in _embedding_bytes(s).items()},
              # the same steps replayed at each W (at W = 2 the trained run's bytes, to the byte)
              "simulated_bytes_per_sample": simulated,
              "final_loss": {"fae": s["final_loss"], "plain": p["final_loss"]}})


def part_sca(prepared: str, a: argparse.Namespace, tmp: str) -> None:
    from trainer.base.config import cache_capacities
    from trainer.sparse.placement.plan import ROW_ELEM, row_bytes
    from trainer.sparse.placement.sca import slot_bytes

    cache = ["cache=lru", f"cache.capacity_fraction={a.sca_cache}"]
    base = base_overrides(prepared, a, a.train_steps) + cache
    cfg = compose(base, 2)
    per_row = row_bytes(cfg.model.embedding_dim, cfg.optim.sparse, ROW_ELEM[cfg.embedding.dtype])
    cache_bytes = sum(cache_capacities(cfg)) * slot_bytes(cfg.model.embedding_dim)
    budget = round(0.05 * sum(cfg.data.table_rows)) * per_row + cache_bytes
    log("train cache alone (W=2) ...")
    alone = _train(base, os.path.join(tmp, "run-cache"))
    for plan_steps in a.sca_plan_steps:
        ps = plan_steps or a.train_steps
        extra = ["placement=sca", f"placement.budget_bytes={budget}", f"placement.plan_steps={ps}"]
        log(f"train sca (W=2, plan_steps {ps}) ...")
        s = _train(base + extra, os.path.join(tmp, f"run-sca-{ps}"))
        pl = s["placement"]
        pvm = pl["predicted_vs_measured"]
        emit({"part": "sca", "workers": 2, "steps": a.train_steps, "global_batch": a.batch, "plan_steps": ps,
              "budget_bytes": budget, "cache_capacity_fraction": a.sca_cache, "chosen": pl.get("chosen"),
              "hot_rows": pl["hot_rows"],
              "candidates": [{k: _r(c.get(k)) for k in ("name", "hot_rows", "cache_rows", "predicted_bytes_per_sample")}
                             for c in pl.get("candidates", [])],
              "predicted_bytes_per_sample": _r(pvm["predicted"]), "measured_bytes_per_sample": _r(pvm["measured"]),
              "error": _r(pvm["error"]),
              "predicted_by_kind": {k: _r(v) for k, v in pl.get("predicted_bytes_per_sample", {}).items()},
              "measured_by_kind": {k: _r(v) for k, v in pl.get("measured_bytes_per_sample", {}).items()},
              "cache_alone_bytes_per_sample": _r(alone["embedding_bytes_per_sample"]),
              "sca_vs_cache_alone": _r(s["embedding_bytes_per_sample"] / alone["embedding_bytes_per_sample"]),
              "final_loss": {"sca": s["final_loss"], "cache_alone": alone["final_loss"]}})


# ------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_criteo_systems", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a raw Criteo TSV (.gz too), prepared into a temporary directory")
    src.add_argument("--prepared", help="a directory scripts/prepare_criteo.py wrote (used as it is)")
    p.add_argument("--train-rows", type=int, default=1600,
                   help="--input: its first N rows train and the rest test (0: the whole file trains; default 1600)")
    enc = p.add_mutually_exclusive_group()
    enc.add_argument("--min-count", type=int, default=1, help="vocabulary of values seen >= K times (default 1)")
    enc.add_argument("--hash-rows", type=int, default=None, help="hash every table into N rows instead")
    p.add_argument("--prep-workers", type=int, default=1, help="processes preparing the input (default 1)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--batch", type=int, default=128, help="global batch (default 128)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="herald-sim: simulated workers")
    p.add_argument("--capacities", type=float, nargs="+", default=[0.01, 0.1, 1.0],
                   help="herald-sim: cache.capacity_fraction of the lent rows' LRU")
    p.add_argument("--epochs", type=float, nargs="+", default=[1, 3, 10, 30],
                   help="herald-sim: passes over the training rows (steps = epochs x rows / batch)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234], help="herald-sim: data.seed (the order)")
    p.add_argument("--train-steps", type=int, default=36, help="trained parts: steps at W = 2 (default 36)")
    p.add_argument("--train-capacities", type=float, nargs="+", default=[0.1, 1.0],
                   help="herald-train: cache.capacity_fraction")
    p.add_argument("--fae-budgets", type=float, nargs="+", default=[0.01, 0.05, 0.25],
                   help="fae: replicated rows as a fraction of all rows")
    p.add_argument("--sca-cache", type=float, default=0.05, help="sca: cache.capacity_fraction (cache=lru)")
    p.add_argument("--sca-plan-steps", type=int, nargs="+", default=[8, 0],
                   help="sca: placement.plan_steps (0: the whole run)")
    p.add_argument("--tmp", default=None, help="where the temporary directory goes (default: the system's)")
    p.add_argument("overrides", nargs="*", help="trainer overrides for every run (after --)")
    return p.parse_args(argv)


def check(a: argparse.Namespace) -> None:
    """Bad input raises ValueError / OSError before anything runs."""
    if a.input is not None and not os.path.isfile(a.input):
        raise ValueError(f"--input {a.input}: no such file")
    if a.prepared is not None and not os.path.isfile(os.path.join(a.prepared, "meta.json")):
        raise ValueError(f"--prepared {a.prepared}: no meta.json there (not a prepared directory)")
    for name in ("batch", "train_steps", "prep_workers"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be > 0")
    if a.train_rows < 0 or (a.hash_rows is not None and a.hash_rows < 2) or a.min_count < 1:
        raise ValueError("--train-rows must be >= 0, --hash-rows >= 2, --min-count >= 1")
    for name in ("worlds", "epochs", "seeds", "capacities", "train_capacities", "fae_budgets"):
        if name != "seeds" and any(x <= 0 for x in getattr(a, name)):
            raise ValueError(f"--{name.replace('_', '-')}: every value must be > 0")
    for w in a.worlds + [2]:
        if a.batch % w:
            raise ValueError(f"--batch {a.batch}: must be divisible by every world size ({w})")
    if any(x < 0 for x in a.sca_plan_steps):
        raise ValueError("--sca-plan-steps: every value must be >= 0")
    compose(["data=tiny", *a.overrides])  # the overrides themselves: a bad key or value raises here


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from trainer.tools.cli import bad_input, input_errors
    try:
        check(a)
    except input_errors() as exc:
        return bad_input(exc)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="criteo-systems-", dir=a.tmp)
    try:
        try:
            prepared, facts = prepare_input(a, tmp)
            n = part_data(prepared, a, facts) if "data" in a.parts else train_rows(
                compose(base_overrides(prepared, a, 1)))
        except input_errors() as exc:
            return bad_input(exc)
        plain = Plain(prepared, a, tmp)
        if "herald-sim" in a.parts:
            part_herald_sim(prepared, a, n)
        if "herald-train" in a.parts:
            part_herald_train(prepared, a, tmp, plain)
        if "fae" in a.parts:
            part_fae(prepared, a, tmp, plain)
        if "sca" in a.parts:
            part_sca(prepared, a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the prepared rows are the input's: none of it stays
    log(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
