"""DenseUpdate: the dense optimizer's step as work of fixed shapes that reads nothing back, replayed
from a CUDA graph (train.cuda_graph=dense and on).

Why: the graphs of dense_step.py, whole_step.py and padded_step.py end at the dense gradients; the
optimizer's step after the dense allreduce was torch.optim's, op by op: on a GPU about a dozen
launches per parameter tensor for Adam's single-tensor form (a dozen per group for its foreach
form), each a few microseconds of launch for microseconds of work at DLRM's sizes. torch's own
capturable Adam (capturable=True) keeps its step count on the device and so computes the bias
corrections in float32 there, with other arithmetic than its default; torch's Adagrad and SGD have
no capturable form, and a tensor rate in them is read back (.item()) each step.

How: the rate and the bias corrections are functions of the step number and of the rate the
schedule (lr.py) set, both known to the host; so the host computes, before every step, exactly the
numbers torch.optim's default single-tensor step computes in Python (double precision: Adam's
lr / (1 - beta1^t) and sqrt(1 - beta2^t), Adagrad's lr / (1 + (t - 1) lr_decay), SGD's lr), and copies
them as float32 (the type torch.optim's kernels cast them to) into a small buffer on the device
(a fill_ per number: queued like a kernel, nothing waits). The update reads them from there: every other constant
(betas, eps, weight decay, momentum) is fixed by the config and part of the captured arithmetic.
So one graph serves a warmup and a decay, and a resumed run.

Equal results: the update repeats torch.optim's single-tensor ops with the per-step scalars as
0-d tensors in place of Python numbers, in the same order; on a CPU it equals torch.optim.SGD /
Adagrad / Adam (as build.dense_optimizer makes them: coupled weight decay, no amsgrad, no
nesterov) bit for bit (tests/unit/test_dense_update.py), and so train.cuda_graph=dense and on equal
off. The replacements, checked there: addcdiv_(a, b, value=-s) is add_(mul(a, -s).div_(b)) (the
kernel's (s * a) / b + p), add_(g, alpha=-s) is addcmul_(g, -s) (one fused multiply-add in both).

State: torch.optim's own (the same tensors in opt.state, its step counters advanced as it advances
them), so checkpoints, resume and the optimizer's state_dict are unchanged. A state replaced under
it (a checkpoint loaded into the optimizer) is noticed before the next step and the graph captured
again over the new tensors.

Why a graph of its own, not inside the step's: between the step's graph and this one lie the dense
allreduce (gloo and Horovod cannot be captured) and the host's decisions that drop a step
(train.nonfinite=skip, fp16's overflow); a step dropped never reaches this graph, so nothing in it
needs a mask. Two replays a step instead of one.

On CUDA: the first two steps run eagerly on a side stream (torch.cuda.graphs' warm-up; SGD's
momentum buffers are made there, as torch makes them, from the first gradient); the third is
captured over static gradient buffers and replayed, and every step after copies its gradients into
them (one foreach copy) and replays. The extra memory: one copy of the dense gradients. A list of
gradients of other shapes runs eagerly. On a CPU there is no graph: the same function runs eagerly.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["DenseUpdate"]

_WARMUP = 2  # eager steps before the capture (as dense_step.py's)


def _kind(opt: torch.optim.Optimizer) -> str:
    """'sgd' / 'adagrad' / 'adam', after checking the options this update repeats exactly."""
    unsupported = {"maximize": True, "differentiable": True, "fused": True, "capturable": True}
    kinds = {torch.optim.SGD: "sgd", torch.optim.Adagrad: "adagrad", torch.optim.Adam: "adam"}
    kind = kinds.get(type(opt))
    if kind is None:
        raise ValueError(f"DenseUpdate repeats torch.optim.SGD, Adagrad and Adam; got {type(opt).__name__}")
    for g in opt.param_groups:
        bad = [k for k, v in unsupported.items() if g.get(k) == v]
        bad += [k for k in ("amsgrad", "nesterov", "decoupled_weight_decay") if g.get(k)]
        if kind == "sgd" and g.get("dampening", 0) != 0:
            bad.append("dampening")
        if any(isinstance(v, torch.Tensor) for v in g.values() if not isinstance(v, list)):
            bad.append("tensor hyperparameters")
        if bad:
            raise ValueError(f"DenseUpdate: {kind} with {', '.join(bad)} is not repeated")
    return kind


class DenseUpdate:
    """The dense optimizer's step, `step(grads)`, as fixed device work (see the module docstring)."""

    def __init__(self, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.opt, self.kind = opt, _kind(opt)
        self.params = params
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        if {id(p) for p in params} != owned:
            raise ValueError("DenseUpdate: `params` must be the optimizer's parameters")
        self.capture = device.type == "cuda"
        self.groups = [[i for i, p in enumerate(params) if any(p is q for q in g["params"])] for g in opt.param_groups]
        width = {"sgd": 1, "adagrad": 1, "adam": 2}[self.kind]
        self.scalars = torch.zeros(len(self.groups), width, dtype=torch.float32, device=device)
        self.t = 0  # the step count of torch's state (one for all parameters: every one steps every time)
        self._bound: list[torch.Tensor] = []  # the state tensors the step reads (a graph holds their addresses)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_grads: list[torch.Tensor] = []
        self.replays = 0  # steps replayed from the graph (summary.json)
        self.eager_steps = 0  # steps run eagerly (the warm-up, a CPU, gradients of other shapes)
        self._since_bind = 0  # steps since the state was (re)bound: the warm-up counts from there

    # ---- torch.optim's state, in its layout -----------------------------------------------------
    def _state(self) -> list[torch.Tensor]:
        """Each parameter's state tensors (made as torch.optim makes them, where it makes them
        lazily); the step count read once from them when they change."""
        out: list[torch.Tensor] = []
        for p in self.params:
            st = self.opt.state[p] if self.kind != "sgd" else self.opt.state.get(p, {})  # SGD: none until momentum's
            if self.kind == "adam" and not st:  # torch.optim.Adam._init_group's
                st["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                          else torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.kind == "adam":
                out += [st["exp_avg"], st["exp_avg_sq"]]
            elif self.kind == "adagrad":
                out.append(st["sum"])
            elif st.get("momentum_buffer") is not None:
                out.append(st["momentum_buffer"])
        return out

    def _bind(self) -> None:
        """(Re)read the state: a graph over other tensors is dropped, the warm-up begins again."""
        state = self._state()
        same = len(state) == len(self._bound) and all(a is b for a, b in zip(state, self._bound))
        if same:
            return
        self._bound, self.graph, self._since_bind = state, None, 0
        if self.kind != "sgd":
            steps = {float(self.opt.state[p]["step"]) for p in self.params}
            if len(steps) != 1:
                raise ValueError(f"DenseUpdate: the parameters' step counts differ ({sorted(steps)})")
            self.t = int(steps.pop())

    # ---- one step --------------------------------------------------------------------------------
    def step(self, grads: list[torch.Tensor]) -> None:
        """Apply `grads` (in `params`' order, reduced over the ranks) as torch.optim's step would."""
        self._bind()
        self._advance()
        shapes_ok = self.graph is None or all(g.shape == s.shape for g, s in zip(grads, self.static_grads))
        if not self.capture or not shapes_ok or self._since_bind < _WARMUP or self._first_momentum():
            self._eager(grads)
            return
        if self.graph is None:
            self._capture(grads)
        torch._foreach_copy_(self.static_grads, grads)
        self.graph.replay()
        self.replays += 1
        self._since_bind += 1

    def _advance(self) -> None:
        """The step count advanced (torch's counters too) and this step's scalars on the device."""
        self.t += 1
        if self.kind != "sgd":
            for p in self.params:
                self.opt.state[p]["step"] += 1
        t = float(self.t)
        for g, row in zip(self.opt.param_groups, self.scalars):  # torch.optim's arithmetic, in Python doubles
            lr = g["lr"]
            if self.kind == "adam":
                beta1, beta2 = g["betas"]
                values = [(1 - beta2 ** t) ** 0.5, -(lr / (1 - beta1 ** t))]
            elif self.kind == "adagrad":
                values = [-(lr / (1 + (t - 1) * g["lr_decay"]))]
            else:
                values = [-lr]
            for k, v in enumerate(values):  # a fill per number: queued like a kernel, nothing waits
                row[k].fill_(v)

    def _first_momentum(self) -> bool:
        return self.kind == "sgd" and any(g["momentum"] != 0 and self.opt.state.get(self.params[i], {}).get(
            "momentum_buffer") is None for g, idx in zip(self.opt.param_groups, self.groups) for i in idx)

    def _eager(self, grads: list[torch.Tensor]) -> None:
        self.eager_steps += 1
        self._since_bind += 1
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.update(grads)
            torch.cuda.current_stream().wait_stream(side)
        else:
            self.update(grads)
        self._bound = self._state()  # SGD's first step made its momentum buffers

    def _capture(self, grads: list[torch.Tensor]) -> None:
        self.static_grads = [g.detach().clone() for g in grads]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.update(self.static_grads)

    # ---- the arithmetic ----------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, grads: list[torch.Tensor]) -> None:
        """One step of every parameter from `grads` and the device scalars (torch.optim's
        single-tensor step, op for op; see the module docstring)."""
        for gi, (g, idx) in enumerate(zip(self.opt.param_groups, self.groups)):
            s = self.scalars[gi]
            for i in idx:
                self._one(g, self.params[i], grads[i], s)

    def _one(self, g: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, s: torch.Tensor) -> None:
        st = self.opt.state[p] if self.kind != "sgd" or g["momentum"] != 0 else {}
        wd = g["weight_decay"]
        if wd != 0:
            grad = grad.add(p, alpha=wd)
        if self.kind == "adam":
            beta1, beta2 = g["betas"]
            st["exp_avg"].lerp_(grad, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (st["exp_avg_sq"].sqrt() / s[0]).add_(g["eps"])
            p.add_(torch.mul(st["exp_avg"], s[1]).div_(denom))
        elif self.kind == "adagrad":
            st["sum"].addcmul_(grad, grad, value=1)
            std = st["sum"].sqrt().add_(g["eps"])
            p.add_(torch.mul(grad, s[0]).div_(std))
        else:
            if g["momentum"] != 0:
                buf = st.get("momentum_buffer")
                if buf is None:  # torch.optim.SGD's first step: the buffer is the gradient
                    buf = st["momentum_buffer"] = grad.detach().clone()
                else:
                    buf.mul_(g["momentum"]).add_(grad, alpha=1 - g["dampening"])
                grad = buf
            p.addcmul_(grad, s[0])

    def summary(self) -> dict[str, Any]:
        """summary.json's cuda_graph.optimizer."""
        return {"captured": self.graph is not None, "replays": self.replays, "eager_steps": self.eager_steps}
