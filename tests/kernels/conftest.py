"""The kernel tests' fixtures: every test here runs on one intra-op thread and starts (and ends) on
the kernels' backend "auto". kernel_helpers is imported first: it sets TRITON_INTERPRET before
anything loads triton, where there is no CUDA device."""
from __future__ import annotations

import kernel_helpers  # noqa: F401 - TRITON_INTERPRET before triton loads
import pytest
import torch

import kernels


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and OpenMP spinning on a busy 2-core
    machine made index_add_ 100x slower; restore the thread count for the other modules."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch: pytest.MonkeyPatch):
    """Every test starts on backend "auto" (no force, no variable, configured "auto") and leaves
    it there."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.set_backend(None)
    kernels.configure("auto", "cpu")
    yield
    kernels.set_backend(None)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.configure("auto", "cpu")
