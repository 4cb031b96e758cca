"""Mixed precision of the dense model (train.precision): autocast, and fp16's loss scaler.

What changes type, and what does not:
- `fp32` (the default): nothing; the step is the fp32 step, bit for bit (no autocast, no scaling).
- `tf32`: fp32 everywhere, but on CUDA the matrix products (and cuDNN) may run on TF32 tensor
  cores (10-bit mantissa inputs, fp32 accumulation: torch.backends.cuda.matmul.allow_tf32), as
  NVIDIA's DLRM does at "TF32"; set for the whole process. On a CPU it is the fp32 step, bit for bit.
- `bf16` / `fp16`: the dense model's forward (and so its backward) runs under torch.autocast on the
  trainer's device: matrix products in the half type, the rest as autocast decides. The parameters
  (master weights), their gradients, the dense optimizer and its state stay fp32, and so do the
  loss (computed from the logits cast to fp32) and the dense allreduce. The embedding side is
  not touched: the pooled rows reach the model as fp32 and their gradient comes back as fp32;
  how the owners store rows is `embedding.dtype`'s business (docs/config.md, "Row precision").
  Evaluations run the model under the same autocast.
- `fp16` also scales the loss before backward, so small gradients do not flush to zero in fp16
  (bf16 has fp32's exponent range and needs no scaling). LossScaler is torch.amp.GradScaler's rule
  (the same update op, torch._amp_update_scale_, and the same unscale op): the gradients are
  multiplied by 1 / scale in place, a step whose scaled gradients hold an inf or a NaN is skipped
  and the scale multiplied by backoff_factor, and after growth_interval steps in a row without one
  it is multiplied by growth_factor. Unlike GradScaler, the gradients it checks are the dense
  parameters' AND the rows' (the step's workspace gradient, before any of it is pushed), and the
  decision is collective: the overflow counts of every rank are summed in one allreduce before any
  row or dense update, so every rank skips the same steps and keeps the same scale (see
  DensePrecision.agree). A skipped step changes nothing anywhere (HybridEmbedding.discard: the
  same rollback as train.nonfinite=skip); its loss is recorded as it was (finite) and counted in
  summary.json's `precision.overflow_skips`, never as a non-finite loss.
- train.nonfinite still owns non-finite LOSSES: a NaN / inf global loss stops the run (stop) or
  drops the batch (skip) as in fp32, before the scaler looks at the gradients, and does not move
  the scale (a forward that overflows is not cured by a smaller loss scale).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, ContextManager, Optional

import torch

from ..base.comm import Collectives
from ..base.config import Config, LossScaleConfig
from ..base.core.signals import SIGNALS

__all__ = ["AUTOCAST_DTYPES", "DensePrecision", "LossScaler"]

AUTOCAST_DTYPES = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # train.precision -> autocast dtype


class LossScaler:
    """torch.amp.GradScaler's loss scale, driven by an overflow decision the caller makes (here
    collectively). State: the scale and the count of steps since the last overflow or growth, both
    host tensors updated by GradScaler's own op; state_dict() goes into checkpoints."""

    def __init__(self, c: LossScaleConfig) -> None:
        self.growth_factor, self.backoff_factor = float(c.growth_factor), float(c.backoff_factor)
        self.growth_interval = int(c.growth_interval)
        self._scale = torch.full((1,), float(c.init), dtype=torch.float32)
        self._growth_tracker = torch.zeros((1,), dtype=torch.int32)
        self._found = torch.zeros((1,), dtype=torch.float32)  # the decision, as update's op takes it

    @property
    def scale(self) -> float:
        return float(self._scale[0])

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Multiply every gradient by 1 / scale in place; returns [1] float32 on their device: 1
        when one of them holds an inf or a NaN (GradScaler.unscale_'s op; no host read)."""
        device = grads[0].device
        found = torch.zeros((1,), dtype=torch.float32, device=device)
        inv = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=device)  # GradScaler: double reciprocal, then float
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        return found

    def update(self, overflow: bool) -> None:
        """After a step: back off (overflow: the step was skipped) or count towards growth."""
        self._found.fill_(1.0 if overflow else 0.0)
        torch._amp_update_scale_(self._scale, self._growth_tracker, self._found, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": int(self._growth_tracker[0])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))


class DensePrecision:
    """train.precision of one rank's dense model: the autocast context of its forward, the loss's
    backward (scaled under fp16) and fp16's collective overflow decision (see the module docstring)."""

    def __init__(self, c: Config, device: torch.device) -> None:
        self.name = c.train.precision
        self.dtype = AUTOCAST_DTYPES[self.name]
        self.device = device
        self.scaler = LossScaler(c.train.loss_scale) if self.name == "fp16" else None
        if self.name == "tf32" and device.type == "cuda":  # fp32 tensors, TF32 tensor-core products
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.overflow_at: list[int] = []  # steps the scaler skipped (this process's; a resume keeps the count)
        self.overflow_skips = 0

    def autocast(self, cache: bool = True) -> ContextManager[Any]:
        """The context of the dense model's forward (fp32: none at all). cache=False: without
        autocast's cache of cast weights (a CUDA graph's capture needs it off; the same values)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=cache)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), on the scaled loss under fp16 (every gradient is then scale times too
        large until agree() unscales it)."""
        (loss if self.scaler is None else loss * self.scaler.scale).backward()

    def agree(self, comm: Collectives, grads: list[torch.Tensor], row_grad: Optional[torch.Tensor],
              carry: Optional[torch.Tensor], step: int) -> tuple[Optional[float], bool]:
        """fp16, after backward and before any update: unscale the dense gradients and the rows'
        (row_grad: the step's workspace gradient) in place, and sum every rank's overflow flag in
        one allreduce, with `carry` (the step's loss reduction, SignalWatch.carry; None when
        train.nonfinite=skip reduced it already) in the same message. Returns (the global loss, or
        None without carry; whether any rank overflowed: then every rank skips the step). The
        scale is updated here, alike on every rank. Collective."""
        assert self.scaler is not None, "agree() is fp16's"
        found = self.scaler.unscale_(grads + ([row_grad] if row_grad is not None else []))
        world = comm.size
        if carry is None:
            reduced = comm.allreduce(found, op="sum", kind="dense")
            value, flags = None, reduced.tolist()
        else:
            values = SIGNALS.take_values(comm.allreduce(torch.cat([carry, found]), op="sum", kind="dense"), world)
            value, flags = values[0], values[1:]
        if value is not None and not math.isfinite(value):
            return value, False  # a non-finite loss: train.nonfinite's, the scale stays
        overflow = flags[0] > 0
        self.scaler.update(overflow)
        if overflow:
            self.overflow_skips += 1
            if len(self.overflow_at) < 100:
                self.overflow_at.append(step)
        return value, overflow

    def summary(self) -> dict[str, Any]:
        """summary.json's `precision`."""
        return {"dense": self.name, "loss_scale": self.scaler.scale if self.scaler is not None else None,
                "overflow_skips": self.overflow_skips, "overflow_at": list(self.overflow_at)}

    def state_dict(self) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps (fp16: the scaler and the skips so far; else None)."""
        if self.scaler is None:
            return None
        return {"scaler": self.scaler.state_dict(), "overflow_skips": self.overflow_skips,
                "overflow_at": list(self.overflow_at)}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """A checkpoint's state_dict(); None (saved by a run of another precision): a fresh scaler."""
        if self.scaler is None or state is None:
            return
        self.scaler.load_state_dict(state["scaler"])
        self.overflow_skips, self.overflow_at = int(state["overflow_skips"]), list(state["overflow_at"])
