"""Kernel dispatch (kernels/__init__.py): `kernels.backend` and TRAINER_KERNELS choose Triton or the
reference; Triton where pinned; the trainer's owner update goes through the dispatch (W = 1 and a
real two-worker run); `import kernels` works without Triton.

Shared set-up (Triton's interpreter on CPU machines, the autouse fixtures, bag and storage
factories) is in kernel_helpers.py."""
from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_helpers import (
    CUDA_COMPILED_MODE,
    HAS_TRITON,
    INTERPRETED,
    TRITON_PINNED,
    _sparse_step,
    make_bags,
    needs_interpreter,
    needs_triton,
    rand_storage,
    randn,
)
from torch import Tensor

import kernels
from kernels import reference as ref
from kernels._triton import interpret_enabled


@pytest.mark.skipif(not TRITON_PINNED, reason="triton is not a dependency on this platform")
def test_triton_is_usable_where_pinned():
    """Where triton is pinned, it must import and run (compiled on CUDA, else interpreted)."""
    assert HAS_TRITON, "triton==3.7.1 is a dependency on Linux x86_64 but is not installed"
    if not CUDA_COMPILED_MODE:
        assert interpret_enabled(), "no CUDA: the Triton tests need TRITON_INTERPRET=1"
        assert INTERPRETED, "triton was imported before TRITON_INTERPRET=1 was set (see _triton.py)"


def test_dispatch_defaults_to_reference_on_cpu():
    assert kernels.get_backend() == "auto" and not kernels.use_triton("cpu")
    assert callable(kernels.pooled_gather) and callable(kernels.row_update)
    importlib.import_module("kernels.pooled_gather")  # must not replace the public function
    assert callable(kernels.pooled_gather)
    assert isinstance(kernels.make_id_slot_map(8, "cpu"), kernels.ReferenceIdSlotMap)


def test_dispatch_backend_validation_and_env(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="backend"):
        kernels.set_backend("cuda")
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels.get_backend() == "reference"
    with kernels.use_backend("triton"):
        assert kernels.get_backend() == "triton"
    assert kernels.get_backend() == "reference"


@needs_interpreter
def test_forced_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch):
    storage = rand_storage(6, 5, torch.float32, device="cpu")
    slots, offsets = make_bags(2, 2, 3, 6, device="cpu")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    out = kernels.pooled_gather(storage, slots, offsets, 2)
    torch.testing.assert_close(out, ref.pooled_gather(storage, slots, offsets, 2))
    assert isinstance(kernels.make_id_slot_map(8, "cpu"), kernels.TritonIdSlotMap)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.pooled_gather(storage, slots, offsets, 2)


@needs_triton
def test_dispatch_routes_all_kernels(monkeypatch: pytest.MonkeyPatch):
    slots, offsets = make_bags(2, 2, 3, 6)
    grad = randn(2, 2, 4)
    outs = []
    for backend in ("triton", "reference"):
        kernels.set_backend(backend)
        storage = rand_storage(6, 4, torch.float32)
        _sparse_step(kernels.accumulate_row_grads, kernels.row_update, storage, grad, slots,
                     offsets, 2, optimizer="sgd", lr=1.0)
        outs.append((storage, kernels.accumulate_row_grads(grad, slots, offsets, 2, num_slots=6)))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])


def test_configure_applies_config_key_and_env_overrides(monkeypatch: pytest.MonkeyPatch):
    assert kernels.configure("reference", "cpu") == "reference"
    assert kernels.get_backend() == "reference"
    assert kernels.configure("auto", "cpu") == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "reference")  # the variable overrides the config key
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.configure("triton", "cpu") == "reference"
    assert kernels.get_backend() == "reference"
    with kernels.use_backend("auto"):  # set_backend / use_backend override both
        assert kernels.get_backend() == "auto"
    monkeypatch.setenv(kernels.ENV_VAR, "nope")
    with pytest.raises(kernels.BackendError, match="TRAINER_KERNELS='nope'"):
        kernels.configure("auto", "cpu")
    monkeypatch.delenv(kernels.ENV_VAR)
    with pytest.raises(kernels.BackendError, match="kernels.backend='cuda'"):
        kernels.configure("cuda", "cpu")


@needs_triton
def test_configure_forced_triton_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """Forcing triton without CUDA fails at start-up with a message naming the key and the fix."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(kernels.BackendError, match=r"kernels.backend='triton'.*TRITON_INTERPRET=1"):
        kernels.configure("triton", "cpu")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(kernels.BackendError, match=r"TRAINER_KERNELS \(overrides kernels.backend\)"):
        kernels.configure("reference", "cpu")
    monkeypatch.delenv(kernels.ENV_VAR)
    assert kernels.configure("triton", "cuda") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.configure("triton", "cpu") == "triton"


def test_config_key_validation(monkeypatch: pytest.MonkeyPatch):
    from helpers import make_cfg

    from trainer.base.config import ConfigError
    from trainer.run.resolve.configure import load_config

    base = ["data=tiny", "train.device=cpu"]
    assert load_config(make_cfg(base)).kernels.backend == "auto"
    assert load_config(make_cfg(base + ["kernels.backend=reference"])).kernels.backend == "reference"
    with pytest.raises(ConfigError, match="kernels.backend='gpu': must be one of auto, triton, reference"):
        load_config(make_cfg(base + ["kernels.backend=gpu"]))
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(ConfigError, match="TRAINER_KERNELS='fast'"):
        load_config(make_cfg(base))
    monkeypatch.setenv(kernels.ENV_VAR, "reference")  # the override wins over a forced triton
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    load_config(make_cfg(base + ["kernels.backend=triton"]))


@needs_triton
def test_config_forced_triton_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch):
    from helpers import make_cfg

    from trainer.base.config import ConfigError
    from trainer.run.resolve.configure import load_config

    forced = ["data=tiny", "train.device=cpu", "kernels.backend=triton"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"kernels.backend='triton'.*cpu.*TRITON_INTERPRET=1"):
        load_config(make_cfg(forced))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_config(make_cfg(forced)).kernels.backend == "triton"


TINY_RUN = ["data=tiny", "train.steps=3", "data.batch_size=16", "data.test_samples=32",
            "data.eval_batch_size=32", "train.threads=1", "train.progress=off", "data.min_bag=0"]


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list:
    """Wrap owner.name so that every call is recorded; returns the list of calls."""
    calls: list = []
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        calls.append(kw.get("unique"))
        return inner(*args, **kw)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@needs_interpreter
@pytest.mark.parametrize("optim", ["adagrad", "adam"])  # adam: dense adam, rows rowwise_adagrad
def test_trainer_owner_update_goes_through_the_dispatch(monkeypatch: pytest.MonkeyPatch, optim):
    """A 3-step W=1 run with TRAINER_KERNELS=triton (interpreted) and one on the reference: the
    owner updates of ShardStore.apply are the dispatch's row_update, once per step, and both
    backends train the same losses, dense parameters and tables within 1e-5."""
    from helpers import run_single

    triton_calls = _count_calls(monkeypatch, kernels._scatter_update_module, "row_update_triton")
    ref_calls = _count_calls(monkeypatch, kernels.reference, "row_update")
    overrides = TINY_RUN + [f"optim={optim}"]
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    got = run_single(overrides)
    assert len(triton_calls) == 3 and not ref_calls
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    want = run_single(overrides)
    assert len(ref_calls) == 3 and len(triton_calls) == 3
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses),
                               rtol=1e-5, atol=1e-6)
    for name, value in want.state["dense"].items():
        torch.testing.assert_close(got.state["dense"][name], value, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.state["tables"], want.state["tables"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(want.state["tables"], _initial_tables()))


@needs_interpreter
def test_config_key_kernels_backend_selects_the_owner_update(monkeypatch: pytest.MonkeyPatch):
    """kernels.backend=triton (no variable set) reaches the trainer via kernels.configure."""
    from helpers import run_single

    triton_calls = _count_calls(monkeypatch, kernels._scatter_update_module, "row_update_triton")
    ref_calls = _count_calls(monkeypatch, kernels.reference, "row_update")
    run_single(TINY_RUN + ["kernels.backend=triton"])
    assert len(triton_calls) == 3 and not ref_calls
    run_single(TINY_RUN + ["kernels.backend=reference"])
    assert len(ref_calls) == 3 and len(triton_calls) == 3


@needs_interpreter
@pytest.mark.dist
def test_triton_backend_parity_two_workers(monkeypatch: pytest.MonkeyPatch):
    """W=2 gloo workers on the Triton backend (interpreted; the variables reach the spawned ranks)
    equal the single-process reference run: owners sum the pushes of both workers for one row."""
    from helpers import run_single, run_world

    overrides = TINY_RUN + ["optim=adagrad", "data.global_batch_size=32"]
    want = run_single(overrides)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    got = run_world(2, overrides)
    for res in got:
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(want.losses),
                                   rtol=1e-5, atol=1e-6)
        for a, b in zip(res.state["tables"], want.state["tables"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[0].summary["bytes"]["grads"] > 0


def _initial_tables() -> list[Tensor]:
    from helpers import make_cfg

    from trainer.base.config import table_rows
    from trainer.run.resolve.configure import load_config
    from trainer.sparse.embedding import init_rows

    c = load_config(make_cfg(TINY_RUN))
    return [init_rows(c.train.seed, table_rows(c), c.model.embedding_dim, torch.full((n,), t),
                      torch.arange(n), c.embedding.init_scale) for t, n in enumerate(table_rows(c))]


def test_import_without_triton():
    """`import kernels` and the reference path work when triton cannot be imported."""
    code = textwrap.dedent("""
        import sys, torch
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import kernels
        assert not kernels.triton_available()
        s = torch.randn(4, 3)
        out = kernels.pooled_gather(s, torch.tensor([0, 3]), torch.tensor([0, 1, 2]), 1)
        assert out.shape == (2, 1, 3)
        kernels.set_backend("triton")
        try:
            kernels.pooled_gather(s, torch.tensor([0, 3]), torch.tensor([0, 1, 2]), 1)
        except RuntimeError as e:
            assert "not installed" in str(e)
        else:
            raise AssertionError("forced triton without triton must fail")
        print("ok")
    """)
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
