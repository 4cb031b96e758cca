"""benchmarks/bench_kernels.py runs on CPU (reference implementations only) and prints valid JSON lines.

Why: the benchmark only gets real numbers on a GPU, but it must not rot where CI runs.
"""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_kernels_quick_cpu(tmp_path: Path):
    bench = _load_bench()
    out_file = tmp_path / "bench.jsonl"
    args = bench.parse_args(["--device", "cpu", "--quick", "--threads", "1", "--out", str(out_file)])
    buf = io.StringIO()
    threads = torch.get_num_threads()
    try:
        bench.run(args, buf)
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert lines == [json.loads(line) for line in out_file.read_text().splitlines()]
    assert lines[0]["kernel"] == "copy" and lines[0]["gbps"] > 0
    kinds = {(r["kernel"], r["impl"]) for r in lines}
    for kernel in ("pooled_gather", "row_grads", "sparse_backward_sgd", "sparse_backward_adagrad",
                   "sparse_backward_rowwise_adagrad", "row_update_sgd", "row_update_adagrad",
                   "row_update_rowwise_adagrad", "owner_update_sgd", "owner_update_adagrad",
                   "owner_update_rowwise_adagrad", "hashmap_lookup"):
        assert (kernel, "reference") in kinds
    assert all(r["pushers"] == 4 for r in lines if r["kernel"].startswith("owner_update"))
    timed = [r for r in lines[1:] if "skipped" not in r]
    assert all(r["ms"] > 0 and r["gbps"] >= 0 and "pct_copy_bw" in r for r in timed)
    assert {r["d"] for r in timed if "d" in r} == {16, 33}
    assert {r["dist"] for r in timed if "dist" in r} == {"zipf", "uniform"}


def test_zipf_ids_are_skewed_and_in_range():
    bench = _load_bench()
    gen = torch.Generator().manual_seed(0)
    ids = bench.make_ids(20_000, 1000, "zipf", 1.05, gen)
    assert int(ids.min()) >= 0 and int(ids.max()) < 1000
    counts = torch.bincount(ids, minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 0.2 * ids.numel()  # hot rows take a large share
    uni = torch.bincount(bench.make_ids(20_000, 1000, "uniform", 1.05, gen), minlength=1000)
    assert uni.sort(descending=True).values[:10].sum() < 0.05 * 20_000
