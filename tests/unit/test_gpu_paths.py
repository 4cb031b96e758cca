"""Each training path on a CUDA device equals its CPU reference run
(dev/gpu_parity.py: the same command with train.device=cuda and the compiled Triton
kernels, and with train.device=cpu kernels.backend=reference; loss, AUC, byte and cache counters).

The ``gpu`` tests need a CUDA device (CI has none; `pytest -m gpu` on a GPU machine runs them).
The one CPU test runs the harness itself with the "device" run on the CPU too, so a broken harness
shows in CI and not first on a lent GPU."""
from __future__ import annotations

import pytest
import torch

from data_helpers import prepared_dir
from dev import gpu_parity


@pytest.fixture(scope="module")
def criteo(tmp_path_factory) -> str:
    """The suite's Criteo-format sample, prepared (1,600 training / 399 test rows)."""
    return prepared_dir(tmp_path_factory, "gpu_paths")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (docs/gpu.md, item 2)")
@pytest.mark.parametrize("name", sorted(gpu_parity.PATHS))
def test_path_on_cuda_equals_cpu_reference(name, tmp_path):
    line = gpu_parity.compare(name, 120, str(tmp_path))
    assert line["ok"], line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (docs/gpu.md, item 4)")
def test_criteo_dali_on_cuda_equals_memmap_on_cpu(tmp_path, criteo):
    line = gpu_parity.compare(gpu_parity.CRITEO, 0, str(tmp_path), criteo=criteo)
    assert line["ok"], line


@pytest.mark.dist
@pytest.mark.parametrize("name", ["resume", gpu_parity.CRITEO])
def test_harness_on_cpu(name, tmp_path, request):
    """The harness's two runs are the same CPU run here (criteo: DALI's CPU pipeline against the
    memmap reader): identical losses, counters equal. (A W = 2 path, w2-lfu-ssp, runs in
    test_gpu_check.py: scripts/gpu_check.sh's CPU mode.)"""
    criteo = request.getfixturevalue("criteo") if name == gpu_parity.CRITEO else None
    line = gpu_parity.compare(name, 20, str(tmp_path), device="cpu", criteo=criteo)
    assert line["ok"] and line["cuda_loss_rel_diff"] == 0.0, line
    if name == "resume":
        assert line["cuda_resumed_loss_rel_diff"] == 0.0, line
