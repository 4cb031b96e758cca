"""Benchmark the sparse kernels: time and GB/s per kernel and implementation, one JSON line each.

Why: issue 5's targets are stated against the device's copy bandwidth (pooled gather >= 70%, scatter
+ update >= 50%: the sparse_backward points) and against fbgemm_gpu's table-batched embedding (TBE),
so the same run measures a big-tensor clone first and reports every point as a fraction of it.

Points: kernel x implementation x d in --dims x bag size in --bags x id distribution (zipf, uniform).
Implementations: "triton" (our kernels, CUDA only), "reference" (kernels.reference, also the CPU
path), "torch" (F.embedding_bag / index_add_ directly), "fbgemm_tbe" (when fbgemm_gpu imports).

Bytes counted (the minimum a kernel must move; repeated lookups of a hot row count every time):
    pooled_gather       N*d*elem (rows) + N*idx + (B*T+1)*idx + B*T*d*4 (output)
    row_grads           B*T*d*4 (grad) + N*idx + N*d*4 (one scatter per entry)
    sparse_backward/opt B*T*d*4 (grad) + N*idx + U*d*elem*2 (rows rw) + state rw: the trainer's
                        scatter + update (the gather's row-gradient scatter into the step's [U, d]
                        workspace gradient, then row_update of the U distinct rows), counted at
                        what a fused scatter + update would have to move at least, so its
                        pct_copy_bw is the "scatter + update" figure of the issue's targets
    row_update/opt      N*d*4 (row grads) + N*idx + U*d*elem*2 (rows rw) + state rw (the owner's
                        update of ShardStore.apply: one gradient row per entry, repeats summed)
    owner_update/opt    the same bytes for what an owner receives in training: each of --pushers
                        workers pushes every distinct row of its share of the batch once
    hashmap_lookup      n*8 (ids) + n*8 (slots) + n*16 (one probed cell)

Usage: python -m benchmarks.bench_kernels [--device cuda|cpu] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels
from kernels import reference as ref

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--bags", type=int, nargs="+", default=[1, 8, 32, 64], help="entries per bag")
    p.add_argument("--dists", nargs="+", default=["zipf", "uniform"], choices=["zipf", "uniform"])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the storage (all tables)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--zipf-alpha", type=float, default=1.05)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--pushers", type=int, default=4,
                   help="owner_update points: workers pushing each distinct row of their share once")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test, CI)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines here")
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.bags, args.batch, args.tables = [16, 33], [1, 8], 32, 2
        args.rows, args.reps = 4096, 2
    return args


# ----------------------------------------------------------------------------- inputs and timing


def make_ids(n: int, rows: int, dist: str, alpha: float, gen: torch.Generator) -> Tensor:
    """n ids in [0, rows): uniform, or Zipf(alpha) ranks scattered over the rows. -> [n] int64."""
    if dist == "uniform":
        return torch.randint(0, rows, (n,), generator=gen)
    u = torch.rand(n, generator=gen, dtype=torch.float64).clamp_min(1e-12)
    if abs(alpha - 1.0) < 1e-6:
        ranks = torch.exp(u * math.log(rows))
    else:  # inverse CDF of the continuous power law on [1, rows + 1)
        top = (rows + 1) ** (1 - alpha)
        ranks = (1 + u * (top - 1)) ** (1 / (1 - alpha))
    ranks = ranks.long().clamp(1, rows) - 1
    return (ranks * 2654435761) % rows


def make_batch(args: argparse.Namespace, bag: int, dist: str) -> Tuple[Tensor, Tensor]:
    """Fixed-size bags, sample-major. -> (slots [B*T*bag], offsets [B*T+1]) on args.device."""
    gen = torch.Generator().manual_seed(bag)
    num_bags = args.batch * args.tables
    slots = make_ids(num_bags * bag, args.rows, dist, args.zipf_alpha, gen)
    offsets = torch.arange(num_bags + 1, dtype=torch.int64) * bag
    return slots.to(args.device), offsets.to(args.device)


def time_ms(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Median milliseconds of fn() after warm-up (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(device: str, reps: int, quick: bool) -> Dict[str, Any]:
    """GB/s of a big tensor clone, counting bytes read + written."""
    numel = (1 << 22) if quick or not device.startswith("cuda") else (1 << 30)
    src = torch.empty(numel, dtype=torch.uint8, device=device).fill_(1)
    ms = time_ms(lambda: src.clone(), device, reps)
    return {"kernel": "copy", "impl": "torch", "bytes": 2 * numel, "ms": ms,
            "gbps": 2 * numel / ms / 1e6}


# ----------------------------------------------------------------------------- kernels


def gather_impls(args: argparse.Namespace, storage: Tensor, slots: Tensor,
                 offsets: Tensor) -> Iterator[Tuple[str, Callable[[], Any]]]:
    """(impl, thunk) pairs for the pooled gather forward."""
    T = args.tables
    with torch.no_grad():
        if args.device.startswith("cuda") and kernels.triton_available():
            from kernels.pooled_gather import pooled_gather_forward

            slots32, offsets32 = slots.int(), offsets.int()
            yield "triton", lambda: pooled_gather_forward(storage, slots32, offsets32, "sum", None)
        yield "reference", lambda: ref.pooled_gather(storage, slots, offsets, T)
        if storage.dtype == torch.float32 or args.device.startswith("cuda"):
            yield "torch", lambda: F.embedding_bag(slots, storage, offsets, mode="sum",
                                                   include_last_offset=True)


def fbgemm_gather(args: argparse.Namespace, dim: int, bag: int,
                  slots: Tensor) -> Tuple[Optional[Callable[[], Any]], str]:
    """fbgemm_gpu TBE forward on the same ids (table-major layout), or (None, why not)."""
    if not args.device.startswith("cuda"):
        return None, "fbgemm TBE runs on CUDA only"
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"fbgemm_gpu not importable: {type(exc).__name__}"
    per_table = max(args.rows // args.tables, 1)
    specs = [(per_table, dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * args.tables
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, device=torch.device(args.device))
    ids = (slots % per_table).view(args.batch, args.tables, bag).permute(1, 0, 2).reshape(-1)
    offsets = torch.arange(args.batch * args.tables + 1, device=args.device) * bag
    with torch.no_grad():
        return (lambda: tbe(ids, offsets)), ""


def gather_bytes(storage: Tensor, slots: Tensor, offsets: Tensor, idx_bytes: int) -> int:
    n, dim = slots.numel(), storage.shape[1]
    return (n * dim * storage.element_size() + (n + offsets.numel()) * idx_bytes
            + (offsets.numel() - 1) * dim * 4)


def sparse_backward_impls(args: argparse.Namespace
                          ) -> Iterator[Tuple[str, Callable[..., Any], Callable[..., Any]]]:
    """(impl, row-gradient scatter, owner update) pairs of the trainer's sparse backward."""
    if args.device.startswith("cuda") and kernels.triton_available():
        from kernels.scatter_update import accumulate_row_grads_triton, row_update_triton

        yield "triton", accumulate_row_grads_triton, row_update_triton
    yield "reference", ref.accumulate_row_grads, ref.row_update


def update_bytes(grad: Tensor, slots: Tensor, uniq: int, storage: Tensor, optimizer: str) -> int:
    dim = storage.shape[1]
    state = {"sgd": 0, "adagrad": uniq * dim * 4 * 2, "rowwise_adagrad": uniq * 4 * 2}[optimizer]
    return grad.numel() * 4 + slots.numel() * 8 + uniq * dim * storage.element_size() * 2 + state


def row_update_impls(args: argparse.Namespace) -> Iterator[Tuple[str, Callable[..., Any]]]:
    if args.device.startswith("cuda") and kernels.triton_available():
        from kernels.scatter_update import row_update_triton

        yield "triton", row_update_triton
    yield "reference", ref.row_update


def row_grad_impls(args: argparse.Namespace) -> Iterator[Tuple[str, Callable[..., Any]]]:
    if args.device.startswith("cuda") and kernels.triton_available():
        from kernels.scatter_update import accumulate_row_grads_triton

        yield "triton", accumulate_row_grads_triton
    yield "reference", ref.accumulate_row_grads


# ----------------------------------------------------------------------------- sweeps


def point(base: Dict[str, Any], impl: str, nbytes: int, ms: float, copy_gbps: float) -> Dict:
    gbps = nbytes / ms / 1e6
    return {**base, "impl": impl, "bytes": nbytes, "ms": round(ms, 5), "gbps": round(gbps, 3),
            "pct_copy_bw": round(100 * gbps / copy_gbps, 2)}


def bench_point(args: argparse.Namespace, dim: int, bag: int, dist: str,
                copy_gbps: float) -> Iterator[Dict[str, Any]]:
    """All kernels and implementations at one (d, bag, dist)."""
    dtype = DTYPES[args.dtype]
    storage = torch.randn(args.rows, dim, device=args.device).to(dtype)
    slots, offsets = make_batch(args, bag, dist)
    base = {"device": args.device, "dtype": args.dtype, "d": dim, "bag": bag, "dist": dist,
            "batch": args.batch, "tables": args.tables, "rows": args.rows}
    nbytes = gather_bytes(storage, slots, offsets, 8)
    for impl, fn in gather_impls(args, storage, slots, offsets):
        yield point({**base, "kernel": "pooled_gather"}, impl, nbytes,
                    time_ms(fn, args.device, args.reps), copy_gbps)
    fb, why = fbgemm_gather(args, dim, bag, slots)
    if fb is not None:
        yield point({**base, "kernel": "pooled_gather"}, "fbgemm_tbe", nbytes,
                    time_ms(fb, args.device, args.reps), copy_gbps)
    else:
        yield {**base, "kernel": "pooled_gather", "impl": "fbgemm_tbe", "skipped": why}
    grad = torch.randn(args.batch, args.tables, dim, device=args.device)
    yield from bench_row_grads(args, base, grad, slots, offsets, copy_gbps)
    yield from bench_sparse_backward(args, base, storage, grad, slots, offsets, copy_gbps)
    yield from bench_row_updates(args, base, storage, slots.long(), copy_gbps, "row_update")
    # what an owner receives in the trainer: every worker pushes each distinct row of its share of
    # the batch once, so a row comes at most --pushers times (the Zipf entries above repeat a hot
    # row tens of thousands of times, which no training step sends)
    pushes = torch.cat([torch.unique(share) for share in slots.long().chunk(args.pushers)])
    yield from bench_row_updates(args, {**base, "pushers": args.pushers}, storage, pushes,
                                 copy_gbps, "owner_update")


def bench_row_grads(args, base, grad, slots, offsets, copy_gbps) -> Iterator[Dict[str, Any]]:
    nbytes = grad.numel() * 4 + slots.numel() * (8 + grad.shape[-1] * 4)
    for impl, fn in row_grad_impls(args):
        run = lambda: fn(grad, slots, offsets, args.tables, "sum", None, args.rows)  # noqa: E731
        yield point({**base, "kernel": "row_grads"}, impl, nbytes,
                    time_ms(run, args.device, args.reps), copy_gbps)


def bench_sparse_backward(args, base, storage, grad, slots, offsets,
                          copy_gbps) -> Iterator[Dict[str, Any]]:
    """The trainer's scatter + update at W = 1: the lookup has already deduplicated the ids
    (untimed, as in HybridEmbedding.lookup); the backward scatters every bag's gradient into the
    [U, d] workspace gradient, and the owner updates the U distinct storage rows once each."""
    uniq_rows, inverse = torch.unique(slots, return_inverse=True)
    uniq = int(uniq_rows.numel())
    states = {"sgd": None, "adagrad": torch.zeros(storage.shape, device=args.device),
              "rowwise_adagrad": torch.zeros(storage.shape[0], device=args.device)}
    for optimizer, state in states.items():
        nbytes = update_bytes(grad, slots, uniq, storage, optimizer)
        for impl, scatter, update in sparse_backward_impls(args):
            def run() -> None:
                ws_grad = scatter(grad, inverse, offsets, args.tables, "sum", None, uniq)
                update(storage, uniq_rows, ws_grad, optimizer=optimizer, lr=1e-6, state=state,
                       unique=True)
            yield point({**base, "kernel": f"sparse_backward_{optimizer}", "unique": uniq}, impl,
                        nbytes, time_ms(run, args.device, args.reps), copy_gbps)


def bench_row_updates(args, base, storage, rows, copy_gbps, kernel) -> Iterator[Dict[str, Any]]:
    """The owner's update of N row gradients [N] `rows` (repeated rows summed first), as
    `{kernel}_{optimizer}` points."""
    grads = torch.randn(rows.numel(), storage.shape[1], device=args.device)
    uniq = int(torch.unique(rows).numel())
    states = {"sgd": None, "adagrad": torch.zeros(storage.shape, device=args.device),
              "rowwise_adagrad": torch.zeros(storage.shape[0], device=args.device)}
    for optimizer, state in states.items():
        nbytes = update_bytes(grads, rows, uniq, storage, optimizer)
        for impl, fn in row_update_impls(args):
            run = lambda: fn(storage, rows, grads, optimizer=optimizer, lr=1e-6,  # noqa: E731
                             state=state)
            yield point({**base, "kernel": f"{kernel}_{optimizer}", "unique": uniq}, impl,
                        nbytes, time_ms(run, args.device, args.reps), copy_gbps)
        if optimizer == "sgd":  # the unfused torch baseline: one index_add_ per entry
            run = lambda: storage.index_add_(0, rows, grads, alpha=-1e-6)  # noqa: E731
            yield point({**base, "kernel": f"{kernel}_sgd", "unique": uniq}, "torch", nbytes,
                        time_ms(run, args.device, args.reps), copy_gbps)


def bench_hashmap(args: argparse.Namespace, copy_gbps: float) -> Iterator[Dict[str, Any]]:
    """Lookup of a batch of ids (half hits) in a map holding args.rows ids."""
    n = args.batch * args.tables * 8
    gen = torch.Generator().manual_seed(0)
    keys = torch.randperm(4 * args.rows, generator=gen)[: args.rows].to(args.device)
    probe = torch.cat([keys[: n // 2], keys[: n - n // 2] + 4 * args.rows])
    impls = [("reference", kernels.ReferenceIdSlotMap(args.rows, args.device))]
    if args.device.startswith("cuda") and kernels.triton_available():
        impls.insert(0, ("triton", kernels.TritonIdSlotMap(args.rows, args.device)))
    for impl, table in impls:
        table.insert(keys, torch.arange(keys.numel(), device=args.device))
        ms = time_ms(lambda: table.lookup(probe), args.device, args.reps)
        yield point({"kernel": "hashmap_lookup", "device": args.device, "n": n,
                     "size": args.rows}, impl, n * 32, ms, copy_gbps)


def run(args: argparse.Namespace, out: TextIO) -> List[Dict[str, Any]]:
    """Run the sweep, writing one JSON line per point to out; returns the points."""
    records: List[Dict[str, Any]] = []

    def emit(rec: Dict[str, Any]) -> None:
        records.append(rec)
        line = json.dumps(rec)
        print(line, file=out, flush=True)
        if args.out is not None:
            with args.out.open("a") as fh:
                fh.write(line + "\n")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    copy = copy_bandwidth(args.device, args.reps, args.quick)
    if args.device.startswith("cuda"):
        copy["gpu"] = torch.cuda.get_device_name(args.device)
    emit(copy)
    for dim in args.dims:
        for bag in args.bags:
            for dist in args.dists:
                for rec in bench_point(args, dim, bag, dist, copy["gbps"]):
                    emit(rec)
    for rec in bench_hashmap(args, copy["gbps"]):
        emit(rec)
    return records


def check(args: argparse.Namespace) -> None:
    """The options, before anything runs: ValueError naming the bad one."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device here (torch.cuda.is_available() is False)")
    sizes = {"--dims": min(args.dims), "--bags": min(args.bags), "--batch": args.batch,
             "--tables": args.tables, "--rows": args.rows, "--reps": args.reps, "--pushers": args.pushers}
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} {value}: must be > 0")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        check(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run(args, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
