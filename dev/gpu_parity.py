"""Every training path on a CUDA device against the CPU reference run (issue 16, item 1 and 2).

Why: the kernels' own tests check each Triton kernel in isolation; a training run on a GPU also
moves the batch, the plans, the caches, the replicas, Herald's lent rows, the pipelined step's
prepared work and the checkpoints between host and device. Each path here is run twice from the
command line, exactly as a user would: once with ``train.device=cuda`` (``kernels.backend=auto``:
the compiled Triton kernels) and once with ``train.device=cpu kernels.backend=reference``, and the
two ``summary.json`` files are compared.

What "equal" means: the two runs sum in different orders (Triton's blocked sums, cuBLAS, atomics),
so bit equality is impossible; at BSP the difference stays at float rounding, which over a few
hundred steps grows to ~1e-6 relative in the loss. ``TOL`` is an order of magnitude above what the
first GPU run measured. Byte counters and the cache's hit/miss counts are exact integers: a wrong
plan on the device shows there first, so they must be equal.

W = 2 on one GPU goes through gloo (``comm.dist_backend=gloo``): NCCL cannot put two ranks on one
device, and gloo stages every collective through host memory, so this exercises the protocol's
device path (not its speed).

    python -m dev.gpu_parity [--only NAME ...] [--jobs 6] [--steps 120] [--criteo DIR]

With --criteo DIR (prepared by scripts/prepare_criteo.py) it also trains data=criteo with the DALI
pipeline on the device against the memmap reader on the CPU (issue 16, item 3); where DALI is not
installed the device run reads with the memmap reader too, and the line's overrides say so.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dev.launch import ROOT, run_trainer, trainer_command

BASE = ["train.progress=off", "train.threads=2", "train.tensorboard=false"]
CUDA = ["train.device=cuda", "kernels.backend=auto"]
CPU = ["train.device=cpu", "kernels.backend=reference"]
W2 = ["comm.dist_backend=gloo"]  # W = 2 runs under torchrun: comm=torch

# name -> (world size, overrides). W = 1 covers the models, optimizers and single-process modes;
# the remote rows (exchange, caches, replicas, Herald, pipelined steps) need W = 2.
PATHS: dict[str, tuple[int, list[str]]] = {
    "dlrm": (1, ["model=dlrm"]),
    "wdl": (1, ["model=wdl"]),
    "deepfm": (1, ["model=deepfm"]),
    "dcn": (1, ["model=dcn"]),
    "sgd": (1, ["optim=sgd"]),
    "adam": (1, ["optim=adam"]),
    "skip": (1, ["train.nonfinite=skip"]),
    "resume": (1, []),  # checkpoint.every = steps / 2, + a cuda run resumed from that checkpoint
    "w2-exact": (2, ["optim=adagrad", "train.pipeline=off"]),  # the serial step
    "w2-lru-bsp": (2, ["cache=lru", "consistency=bsp"]),
    "w2-lfu-ssp": (2, ["cache=lfu", "consistency=ssp"]),
    "w2-pinned-asp": (2, ["cache=lfu_pinned", "consistency=asp"]),
    "w2-fae": (2, ["placement=fae", "placement.hot_batches=true"]),
    "w2-sca": (2, ["placement=sca"]),
    "w2-herald": (2, ["schedule=herald", "cache=lru"]),
    "w2-pipeline-ids": (2, ["train.pipeline=ids", "cache=lru"]),
    "w2-settled-rows": (2, ["train.pipeline=ids", "comm.settled_rows=always", "optim=adagrad"]),
    "w2-pipeline-rows": (2, ["train.pipeline=rows", "cache=lfu", "consistency=ssp"]),
    "w2-het-skip-adam": (2, ["cache=lru", "consistency=ssp", "placement=fae", "optim=adam",
                             "train.nonfinite=skip"]),
    "w2-fp16-wire": (2, ["comm.wire_precision=fp16", "cache=lfu", "consistency=ssp"]),
    # train.cuda_graph=on at W = 2: the alltoalls padded to fixed blocks (trainer/step/padded_step.py)
    "w2-padded": (2, ["train.cuda_graph=on", "optim=adagrad"]),
    # the seed systems in fixed shapes (trainer/sparse/embedding/fixed/): replicated rows at W = 2
    # and in the whole step's graph at W = 1; half rows rounded stochastically from a device salt;
    # blocks too small for some batches (those steps trained again in exact sizes)
    "w2-padded-fae": (2, ["train.cuda_graph=on", "placement=fae", "placement.hot_batches=true"]),
    "w2-padded-sca": (2, ["train.cuda_graph=on", "placement=sca", "optim=adagrad"]),
    "w2-padded-tight": (2, ["train.cuda_graph=on", "optim=adagrad", "train.unique_capacity=64"]),
    "whole-fae": (1, ["train.cuda_graph=on", "placement=fae"]),
    # the HET cache in fixed shapes (fixed/het.py, cache/masked.py): on the GPU its id map is the
    # Triton hash table (its masked inserts and erases select: a read each), the victims' top-k
    "w2-padded-lru-ssp": (2, ["train.cuda_graph=on", "cache=lru", "consistency=ssp", "optim=adagrad"]),
    "w2-padded-pinned-tight": (2, ["train.cuda_graph=on", "cache=lfu_pinned", "consistency=asp",
                                   "cache.capacity_fraction=0.05", "train.unique_capacity=64"]),
    # the reply and push blocks following the traffic, a margin below 1: rows and pushes past them
    # (the cache's journal undoes those steps, which are trained again)
    "w2-padded-het-follow": (2, ["train.cuda_graph=on", "cache=lru", "consistency=ssp", "optim=adagrad",
                                 "train.unique_capacity=100000", "train.capacity_margin=0.75"]),
    # Herald in fixed shapes: its sync sized by the host's plan, the rows into the request's blocks;
    # tight blocks: some ranks' lookups made in exact sizes (never a step trained twice)
    "w2-padded-herald": (2, ["train.cuda_graph=on", "schedule=herald", "cache=lru", "optim=adagrad"]),
    "w2-padded-herald-tight": (2, ["train.cuda_graph=on", "schedule=herald", "cache=lru", "optim=adagrad",
                                   "train.unique_capacity=64"]),
    "whole-fp16-stochastic": (1, ["train.cuda_graph=on", "embedding.dtype=fp16", "embedding.rounding=stochastic",
                                  "optim=adagrad"]),
    # dynamic tables: the pool's map is the Triton hash table on CUDA; small pools evict (LFU with
    # decay, admission after 2 sightings, expiry), the HET cache at a bound, FAE's pinned hot rows
    "dynamic": (1, ["embedding.kind=dynamic", "embedding.capacity=30", "embedding.admit_after=2",
                    "embedding.eviction=lfu", "embedding.lfu_half_life=8", "embedding.ttl_steps=40",
                    "data.scramble_ids=true", "optim=adagrad"]),
    "w2-dynamic": (2, ["embedding.kind=dynamic", "embedding.capacity=20", "embedding.admit_after=2",
                       "data.scramble_ids=true", "cache=lru", "consistency=ssp", "placement=fae"]),
    # admission counted by a count-min sketch (int16 scatter-max, halving) on the device
    "dynamic-count-min": (1, ["embedding.kind=dynamic", "embedding.capacity=30", "embedding.admit_after=2",
                              "embedding.admit_counter=count_min", "embedding.count_min_bytes=16384",
                              "embedding.count_min_halve_steps=6", "data.scramble_ids=true", "optim=adagrad"]),
}
# with --criteo DIR (a prepared Criteo directory): the DALI pipeline on the device (the batches
# made on the GPU) against the memmap reader on the CPU, the default recipe with one model
CRITEO = "criteo-dali"
BOUNDED = ("ssp", "asp", "pipeline=rows")
# relative final loss, absolute eval AUC (BSP | bounded staleness: the read order may differ)
TOL = {"bsp": (1e-4, 1e-4), "bounded": (1e-3, 2e-3)}
EXACT_KEYS = ("bytes_total", "steps", "skipped_steps", "eval_samples")


def train(world: int, overrides: list[str], out: str) -> dict[str, Any]:
    return run_trainer(trainer_command(world, [*BASE, *overrides, *(W2 if world > 1 else []),
                                               f"hydra.run.dir={out}"]), out, cwd=ROOT)


def device_loader() -> str:
    """The criteo path's loader on the device: DALI where it is installed; else the memmap reader
    (said in the path's JSON line), so the recipe still runs on the device without DALI."""
    from trainer.workload.data.dali import require_dali
    try:
        require_dali()
    except ImportError:
        return "memmap"
    return "dali"


def _cache_counts(s: dict[str, Any]) -> dict[str, Any]:
    c = s.get("cache") or {}
    return {k: v for k, v in c.items() if isinstance(v, int)} if isinstance(c, dict) else {}


def _best_steps(s: dict[str, Any]) -> list:
    """The restored best step of each ensemble member (or of the one run); [] without validation.
    Summaries written before the rename hold the members under "bag"."""
    members = (s.get("ensemble") or s.get("bag") or {}).get("members") or [s]
    return [m.get("best_step") for m in members if m.get("best_step") is not None]


def _counter_diffs(cpu: dict[str, Any], dev: dict[str, Any], cache: bool) -> dict[str, list]:
    """The exact counters (EXACT_KEYS, and the cache's integer counts where `cache`) that differ:
    name -> [cpu value, device value]."""
    pairs = {k: (cpu.get(k), dev.get(k)) for k in EXACT_KEYS}
    if cache:
        a, b = _cache_counts(cpu), _cache_counts(dev)
        pairs.update({f"cache.{k}": (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))})
    return {k: list(v) for k, v in pairs.items() if v[0] != v[1]}


def compare(name: str, steps: int, tmp: str, device: str = "cuda",
            criteo: str | None = None) -> dict[str, Any]:
    """Train path `name` on `device` (the Triton kernels on CUDA) and on the CPU reference; the
    JSON line of their differences. `device="cpu"` checks the harness itself on a CPU machine.
    Path CRITEO needs `criteo`, a prepared directory (scripts/prepare_criteo.py)."""
    dev = CUDA if device == "cuda" else [f"train.device={device}", "kernels.backend=auto"]
    cpu_side: list[str] = []
    if name == CRITEO:
        if criteo is None:
            raise ValueError(f"path {CRITEO} needs a prepared Criteo directory (--criteo DIR)")
        world, overrides = 1, ["data=criteo", f"data.dir={criteo}", "train.ensemble=1"]
        ov = list(overrides)  # the recipe's epochs and early stop, not train.steps
        dev, cpu_side = dev + [f"data.loader={device_loader()}"], ["data.loader=memmap"]
    else:
        world, overrides = PATHS[name]
        ov = [f"train.steps={steps}", *overrides]
    if name == "resume":
        ov.append(f"checkpoint.every={steps // 2}")
    cpu = train(world, ov + CPU + cpu_side, os.path.join(tmp, name, "cpu"))
    gpu = train(world, ov + dev, os.path.join(tmp, name, "cuda"))
    runs = {"cuda": gpu}
    if name == "resume":  # the cuda run resumed from its own half-way checkpoint
        ck = os.path.join(tmp, name, "cuda", "checkpoints", f"step_{steps // 2:08d}")
        runs["cuda_resumed"] = train(world, ov + dev + [f"checkpoint.resume={ck}"],
                                     os.path.join(tmp, name, "cuda_resumed"))
    kind = "bounded" if any(b in " ".join(overrides) for b in BOUNDED) else "bsp"
    loss_tol, auc_tol = TOL[kind]
    if name == CRITEO:
        overrides = overrides + [dev[-1]]  # which loader fed the device run
    line: dict[str, Any] = {"path": name, "world": world, "overrides": overrides, "steps": steps,
                            "consistency": kind, "cpu_final_loss": cpu["final_loss"],
                            "cpu_eval_auc": cpu["eval_auc"], "cpu_wall_s": round(cpu["wall_s"], 1)}
    ok = True
    for label, s in runs.items():
        rel = abs(s["final_loss"] - cpu["final_loss"]) / max(abs(cpu["final_loss"]), 1e-12)
        dauc = abs(s["eval_auc"] - cpu["eval_auc"])
        diffs = _counter_diffs(cpu, s, cache=kind == "bsp")
        good = rel <= loss_tol and dauc <= auc_tol and not diffs
        ok = ok and good
        line.update({f"{label}_final_loss": s["final_loss"], f"{label}_eval_auc": s["eval_auc"],
                     f"{label}_loss_rel_diff": rel, f"{label}_auc_diff": dauc,
                     f"{label}_counters_equal": not diffs,
                     f"{label}_wall_s": round(s["wall_s"], 1)})
        if diffs:  # which counters, CPU value first
            line[f"{label}_counter_diffs"] = diffs
        best = [_best_steps(cpu), _best_steps(s)]
        if any(best):  # early stopping: where each run stopped
            line[f"{label}_best_steps"] = best
    line["ok"] = ok
    return line


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m dev.gpu_parity", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(PATHS) + [CRITEO], default=sorted(PATHS))
    p.add_argument("--criteo", default=None, metavar="DIR",
                   help=f"a prepared Criteo directory: adds path {CRITEO} (DALI on the device "
                        "against the memmap reader on the CPU)")
    p.add_argument("--jobs", type=int, default=4, help="paths run at once")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--device", default="cuda", help="cpu: check the harness on a CPU machine")
    a = p.parse_args(argv)
    names = list(a.only) + ([CRITEO] if a.criteo and CRITEO not in a.only else [])
    if CRITEO in names and not a.criteo:
        p.error(f"path {CRITEO} needs --criteo DIR")
    import torch
    from trainer.tools.cli import bad_input, input_errors
    from dev.launch import check_trainer
    try:
        try:
            kind = torch.device(a.device).type
        except RuntimeError as exc:
            raise ValueError(f"--device {a.device}: {exc}") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {a.device}: no CUDA device here (torch.cuda.is_available() is False)")
        if a.criteo:  # the directory must be one prepare_criteo.py wrote (its meta.json is read here)
            check_trainer(1, ["data=criteo", f"data.dir={a.criteo}", "data.loader=memmap"])
    except input_errors() as exc:
        return bad_input(exc)
    header = {"device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
              "torch": torch.__version__,
              "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(header), flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:
        futures = {n: pool.submit(compare, n, a.steps, tmp, a.device, a.criteo) for n in names}
        for n, fut in futures.items():
            try:
                line = fut.result()
            except Exception as e:  # noqa: BLE001 - reported per path, the others go on
                line = {"path": n, "ok": False, "error": str(e)[-3000:]}
            failed += not line["ok"]
            text = json.dumps(line)
            print(text, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(text + "\n")
    print(f"gpu_parity: {len(names) - failed} of {len(names)} paths equal", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
