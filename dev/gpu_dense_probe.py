"""The dense side of a training step alone, eager against one CUDA graph: the ceiling a capturable
step (issue: a GPU step that is not launch-bound) can reach, measured before building it.

    python -m dev.gpu_dense_probe [--batch-sizes 2048 16384 65536] [--precisions fp32 bf16]
        [--model dlrm_mlperf] [--iters 30] [--device cuda]

For each point: the trainer's model (conf/model/<model>.yaml, built by trainer.workload.models) on random
dense features and random pooled rows [B, 26, d] that take a gradient (what the embedding side
hands the model), forward under the trainer's autocast, BCE loss, backward, SGD step. `eager`:
the step as PyTorch dispatches it; `graph`: the same step captured once in a torch.cuda.CUDAGraph
and replayed (static inputs; what train.cuda_graph would do for the dense part). One JSON line per
point and mode: ms per step, samples/s, dense TFLOP/s (forward + backward: 3x the forward's
multiply-adds x 2). On a CPU (--device cpu) only eager runs: the plumbing, not a figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from trainer.base.config import compose
from trainer.run.resolve.configure import load_config
from trainer.workload.models import build_model
from trainer.step.precision import AUTOCAST_DTYPES


def forward_macs(model: torch.nn.Module, tables: int, d: int) -> int:
    """Multiply-adds of one sample's forward: every Linear, plus the pairwise dot products."""
    macs = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return macs + (tables + 1) * (tables + 1) * d


def run_point(model_name: str, batch: int, precision: str, iters: int, device: str) -> list[dict]:
    c = load_config(compose(["data=mlperf", f"model={model_name}"]))
    tables, d, dense_f = len(c.data.table_rows), c.model.embedding_dim, c.data.num_dense
    torch.manual_seed(0)
    model = build_model(c.model, dense_f, tables).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dt = AUTOCAST_DTYPES[precision]
    dense = torch.randn(batch, dense_f, device=device)
    pooled = torch.randn(batch, tables, d, device=device, requires_grad=True)
    labels = (torch.rand(batch, device=device) < 0.25).float()
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        pooled.grad = None if pooled.grad is None else pooled.grad.zero_()
        with torch.autocast(device_type=device, dtype=dt, enabled=dt is not None):
            logits = model(dense, pooled)
        loss = loss_fn(logits.float().reshape(-1), labels)
        loss.backward()
        opt.step()
        return loss.detach()

    flops = 6 * forward_macs(model, tables, d) * batch
    out = []

    def timed(fn, mode: str) -> None:
        for _ in range(3):
            fn()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        ms = 1e3 * (time.perf_counter() - t0) / iters
        out.append({"probe": "dense_step", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "model": model_name, "batch": batch, "precision": precision, "mode": mode,
                    "ms_per_step": round(ms, 3), "samples_per_sec": round(batch / ms * 1e3, 1),
                    "tflops": round(flops / ms / 1e9, 1)})

    timed(step, "eager")
    if device == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        timed(g.replay, "graph")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.gpu_dense_probe",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[2048, 16384, 65536])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=sorted(AUTOCAST_DTYPES))
    ap.add_argument("--model", default="dlrm_mlperf")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    for b in a.batch_sizes:
        for p in a.precisions:
            for line in run_point(a.model, b, p, a.iters, a.device):
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
