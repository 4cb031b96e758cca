"""The best-model snapshot's rows (trainer/base/core/snapshot_rows.py): in memory or in a file, bit for bit
the same, one window of rows at a time whatever the shard's size; and a whole run with the
snapshot on disk restores the very model the in-memory snapshot restores."""
from __future__ import annotations

import os

import pytest
import torch

from helpers import run_single
from parity_helpers import ES, same_model
from trainer.base.core import snapshot_rows
from trainer.base.core.snapshot_rows import SnapshotRows, in_memory


def _run(kept: SnapshotRows, weight: torch.Tensor, rounds: int, seed: int) -> torch.Tensor:
    """Random writes and snapshots; returns what a restore of every held row gives back."""
    g = torch.Generator().manual_seed(seed)
    expect = torch.zeros_like(weight)
    for _ in range(rounds):
        touched = torch.rand(weight.shape[0], generator=g) < 0.3
        if _ % 2:
            touched[5:40] = True  # a dense stretch: whole windows at once
        weight[touched] = torch.randn(int(touched.sum()), weight.shape[1], generator=g).to(weight.dtype)
        kept.put(weight, touched)
        expect[touched] = weight[touched]
    out = torch.zeros_like(weight)
    for a, b in kept.windows():
        rows = torch.nonzero(kept.held[a:b]).squeeze(1) + a
        if rows.numel():
            out[rows] = kept.values(rows)
    assert torch.equal(out.view(torch.uint8), expect.view(torch.uint8))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_disk_and_memory_keep_the_same_bits_one_window_at_a_time(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(snapshot_rows, "PIECE_BYTES", 7 * 8 * torch.tensor([], dtype=dtype).element_size())
    weight = torch.zeros(100, 8, dtype=dtype)
    mem = SnapshotRows(weight, memory=True)
    disk = SnapshotRows(weight, memory=False, directory=str(tmp_path))
    assert disk.window == 7 and len(list(disk.windows())) == 15
    sizes = []
    span, write = SnapshotRows._on_span, SnapshotRows._write
    monkeypatch.setattr(SnapshotRows, "_on_span", lambda s, lo, hi, w, fn: sizes.append(hi - lo) or span(s, lo, hi, w, fn))
    monkeypatch.setattr(SnapshotRows, "_write", lambda s, a, b, t, v: sizes.append(b - a) or write(s, a, b, t, v))
    a = _run(mem, weight.clone(), 4, seed=1)
    b = _run(disk, weight.clone(), 4, seed=1)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(mem.held, disk.held) and 0 < disk.held_rows < 100
    assert sizes and max(sizes) <= 7  # never more than a window of rows read or written
    assert disk._mem is None  # nothing of the shard's size in memory
    assert os.listdir(tmp_path) == []  # the file has no name: nothing left behind, however the run ends
    disk.close()
    mem.close()


def test_auto_keeps_small_shards_in_memory_and_big_ones_on_disk():
    limit = snapshot_rows.MEMORY_MAX_BYTES
    assert in_memory("auto", limit // 64, 64) and not in_memory("auto", limit // 64 + 1, 64)
    assert in_memory("memory", 10**9, 64) and not in_memory("disk", 1, 64)
    with pytest.raises(ValueError, match="one of auto, memory, disk"):
        in_memory("ram", 1, 64)


def test_a_run_with_the_snapshot_on_disk_restores_the_same_model():
    mem = run_single(ES + ["train.early_stop.snapshot=memory"])
    disk = run_single(ES + ["train.early_stop.snapshot=disk"])
    assert disk.summary["early_stop"]["restored"] and disk.summary["best_step"] < disk.summary["steps"]
    assert disk.summary["early_stop"]["snapshot_rows"] == mem.summary["early_stop"]["snapshot_rows"] > 0
    same_model(mem.state, disk.state, rtol=0, atol=0)
    assert disk.summary["test_auc"] == mem.summary["test_auc"]


def _peak_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def test_counting_the_held_rows_copies_nothing_of_the_shards_size(tmp_path):
    # a bool tensor's sum() counts through an int64 copy of it (8 B a row: 400 MB here)
    rows = 50_000_000
    kept = SnapshotRows(torch.empty(rows, 1, dtype=torch.float16), memory=False, directory=str(tmp_path))
    kept.held[::3] = True
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak back to the current RSS
    before = _peak_kb()
    assert kept.held_rows == -(-rows // 3)
    assert _peak_kb() - before < 20 << 10  # < 20 MB (the flags themselves are 50 MB)
    kept.close()
