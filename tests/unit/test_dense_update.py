"""DenseUpdate (trainer/step/dense_update.py): the dense optimizer's step as fixed device work.

On the CPU it must equal torch.optim's step bit for bit, every optimizer and option the trainer
builds (build.dense_optimizer), under a schedule that changes the rate every step, across a
checkpoint load into the optimizer, and its op trace must be the same at every step (what one
CUDA graph replays): no host read, no size or constant that follows the step. The capture itself
needs a GPU (marked gpu)."""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode

from trainer.step.dense_update import DenseUpdate

SHAPES = [(37, 13), (13,), (1031, 7), (1,), (5, 3, 2)]  # odd sizes: the kernels' vector tails

CASES: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum-wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-8),
    "adagrad-init-wd": lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-6, initial_accumulator_value=0.1,
                                                      weight_decay=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam-wd-eps": lambda ps: torch.optim.Adam(ps, lr=3e-3, eps=1e-6, weight_decay=1e-2, betas=(0.8, 0.95)),
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    out = [torch.randn(s, generator=g) * 10 ** (step % 3 - 2) for s in SHAPES]
    out[1].zero_()  # an unused parameter's zeros (the strategies pass zeros_like)
    return out


def _rate(step: int) -> float:
    """A warmup, then a decay: a different rate every step."""
    return (step + 1) / 4 if step < 3 else max(0.05, 1 - (step - 3) / 10) ** 2


def _torch_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def _set_rate(opt: torch.optim.Optimizer, base: float, step: int) -> None:
    for g in opt.param_groups:
        g["lr"] = base * _rate(step)


def _assert_same(a_params: list, b_params: list, a_opt: torch.optim.Optimizer, b_opt: torch.optim.Optimizer,
                 what: str) -> None:
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert torch.equal(a, b), f"{what}: parameter {i} differs (max {(a - b).abs().max().item():.3g})"
    sa, sb = a_opt.state_dict()["state"], b_opt.state_dict()["state"]
    assert sa.keys() == sb.keys(), what
    for k in sa:
        assert sa[k].keys() == sb[k].keys(), f"{what}: state {k}"
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name]), f"{what}: state {k}.{name} differs"


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_torch_optim_bit_for_bit(case: str):
    """12 steps at a rate that changes every step: every parameter and every state tensor equal."""
    ref_p, our_p = _params(), _params()
    ref, ours = CASES[case](ref_p), CASES[case](our_p)
    base = ref.param_groups[0]["lr"]
    update = DenseUpdate(ours, our_p, torch.device("cpu"))
    for step in range(12):
        _set_rate(ref, base, step)
        _set_rate(ours, base, step)
        _torch_step(ref, ref_p, _grads(step))
        update.step(_grads(step))
        _assert_same(ref_p, our_p, ref, ours, f"{case} step {step}")
    assert update.summary() == {"captured": False, "replays": 0, "eager_steps": 12}


def test_a_different_arithmetic_is_caught(monkeypatch: pytest.MonkeyPatch):
    """The comparison can fail: torch's capturable-style Adam arithmetic (the bias corrections folded
    into the denominator) differs from the default's in the last bits."""
    ref_p, our_p = _params(), _params()
    ref, ours = CASES["adam"](ref_p), CASES["adam"](our_p)
    update = DenseUpdate(ours, our_p, torch.device("cpu"))
    def folded(self: DenseUpdate, g: dict, p: torch.Tensor, grad: torch.Tensor, s: torch.Tensor) -> None:
        st = self.opt.state[p]
        beta1, beta2 = g["betas"]
        st["exp_avg"].lerp_(grad, 1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (st["exp_avg_sq"].sqrt() / (s[0] * -s[1])).add_(g["eps"] / -s[1])
        p.sub_(st["exp_avg"] / denom)

    monkeypatch.setattr(DenseUpdate, "_one", folded)
    for step in range(6):
        _torch_step(ref, ref_p, _grads(step))
        update.step(_grads(step))
    assert any(not torch.equal(a, b) for a, b in zip(ref_p, our_p))


@pytest.mark.parametrize("case", ["sgd-momentum-wd", "adagrad-init-wd", "adam-wd-eps"])
def test_a_checkpoint_loaded_mid_run_is_followed(case: str):
    """The optimizer's state replaced under the update (load_state_dict makes new tensors, as a
    resume does) and a fresh optimizer resumed from a state_dict: both go on equal to torch."""
    ref_p, our_p = _params(), _params()
    ref, ours = CASES[case](ref_p), CASES[case](our_p)
    update = DenseUpdate(ours, our_p, torch.device("cpu"))
    for step in range(4):
        _torch_step(ref, ref_p, _grads(step))
        update.step(_grads(step))
    saved = copy.deepcopy(ref.state_dict())
    ours.load_state_dict(saved)
    for step in range(4, 8):
        _torch_step(ref, ref_p, _grads(step))
        update.step(_grads(step))
        _assert_same(ref_p, our_p, ref, ours, f"{case} after a load, step {step}")
    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in our_p]
    resumed = CASES[case](resumed_p)
    resumed.load_state_dict(copy.deepcopy(ours.state_dict()))
    again = DenseUpdate(resumed, resumed_p, torch.device("cpu"))
    for step in range(8, 11):
        _torch_step(ref, ref_p, _grads(step))
        again.step(_grads(step))
        _assert_same(ref_p, resumed_p, ref, resumed, f"{case} resumed, step {step}")


class _Trace(TorchFunctionMode):
    """Every torch call: its name, its non-tensor arguments and its tensors' shapes and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}

        def show(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return ("T", tuple(x.shape), x.dtype)
            if isinstance(x, (list, tuple)):
                return tuple(show(y) for y in x)
            return x if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__

        self.calls.append((getattr(func, "__name__", str(func)), show(args), show(sorted(kwargs.items()))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_update_is_the_same_calls_at_every_step(case: str):
    """What a CUDA graph replays: update() (the captured function) makes the same calls with the
    same constants and sizes at two steps of different rates and step counts, and reads nothing
    back (no .item(), .tolist(), bool() of a tensor: they would show as calls here)."""
    params = _params()
    opt = CASES[case](params)
    base = opt.param_groups[0]["lr"]
    update = DenseUpdate(opt, params, torch.device("cpu"))
    traces = []
    for step in range(5):
        _set_rate(opt, base, step)
        update._bind()
        update._advance()
        if step < 2:  # SGD's first step makes its buffers (eager on CUDA too)
            update.update(_grads(step))
            continue
        grads = _grads(step)
        with _Trace() as trace:
            update.update(grads)
        traces.append(trace.calls)
    assert traces[0] == traces[1] == traces[2]
    names = {c[0] for c in traces[0]}
    assert not names & {"item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy"}, names


def test_refuses_what_it_does_not_repeat():
    ps = _params()
    with pytest.raises(ValueError, match="amsgrad"):
        DenseUpdate(torch.optim.Adam(ps, amsgrad=True), ps, torch.device("cpu"))
    with pytest.raises(ValueError, match="nesterov"):
        DenseUpdate(torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), ps, torch.device("cpu"))
    with pytest.raises(ValueError, match="RMSprop"):
        DenseUpdate(torch.optim.RMSprop(ps), ps, torch.device("cpu"))
    with pytest.raises(ValueError, match="parameters"):
        DenseUpdate(torch.optim.SGD(ps, lr=0.1), ps[:2], torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(CASES))
def test_captured_update_equals_eager_on_cuda(case: str):
    """On CUDA: two eager steps, then one graph replayed under a changing rate, across a load of
    the optimizer's state (captured again): equal to the same update run eagerly on the device
    (the CPU's bit-equality to torch.optim is the test above), and nothing read back per step."""
    dev = torch.device("cuda")
    a_p = [torch.nn.Parameter(p.detach().to(dev)) for p in _params()]
    b_p = [torch.nn.Parameter(p.detach().to(dev)) for p in _params()]
    a, b = CASES[case](a_p), CASES[case](b_p)
    base = a.param_groups[0]["lr"]
    graphed = DenseUpdate(a, a_p, dev)
    eager = DenseUpdate(b, b_p, torch.device("cpu"))  # the same function, never captured
    eager.scalars = eager.scalars.to(dev)
    for step in range(10):
        if step == 6:
            a.load_state_dict(copy.deepcopy(a.state_dict()))
        _set_rate(a, base, step)
        _set_rate(b, base, step)
        grads = [g.to(dev) for g in _grads(step)]
        torch.cuda.set_sync_debug_mode("error" if step >= 3 else "default")
        try:
            graphed.step(grads)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager.step([g.clone() for g in grads])
        _assert_same(a_p, b_p, a, b, f"{case} cuda step {step}")
    assert graphed.graph is not None and graphed.replays >= 5, graphed.summary()
