"""Audit of a training step's tensor calls on CPU: host-born tensors, device mixing, host reads.

Why a TorchFunctionMode on CPU: with no GPU in CI, a tensor made on the host instead of on the
batch's / storage's device is invisible (everything is on the CPU anyway) until the first CUDA run
fails with a device mismatch or copies every step. What CPU can see is how each tensor was made.
The mode sees every torch call made while it is active (calls torch makes inside one of those calls
are not handed to it again) and keeps a *virtual device* for every tensor it has seen made:

- ``host``: made by a factory (arange, zeros, empty, full, tensor, ...) called without ``device=``,
  by ``torch.from_numpy``, or by ``.cpu()``: on a GPU run it would be on the CPU;
- ``dev``: made with an explicit ``device=``, or by ``.to(<device>)``: it follows the trainer's
  device (the batch after ``batch.to(device)``, the shard store, the cache, the model);
- every other op's result is ``dev`` when any tensor input is ``dev``, else ``host`` when one is.

Run the trainer's construction and a few steps under it, and it reports, for the audited step:

- ``factory``: a factory called without ``device=`` (a host-born tensor made by the step);
- ``mix``: an op whose inputs are both ``dev`` and ``host`` (0-dim host tensors, which CUDA ops
  take as scalars, excepted; ``.to`` / ``.copy_`` are copies): a device mismatch on CUDA, or a
  hidden host -> device copy where CUDA accepts it (indexing a CUDA tensor with CPU indices);
- ``host``: ``.tolist()``, ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``t.__index__``,
  ``.numpy()``, ``.cpu()``, ``torch.equal`` of a ``dev`` tensor: a device -> host copy that waits
  for the device;
- ``copy``: a ``host`` tensor moved to the device (``.to``, ``.cuda``, ``.copy_`` into a ``dev``
  tensor, ``t[i] = 5`` or ``t[i] = host_tensor`` into a ``dev`` tensor) or Python data made into a
  tensor with ``device=`` (``torch.tensor(list, device=d)``):
  a host -> device transfer made by the step. Op ``to`` / ``copy_`` / ``tensor(device=)`` is a
  blocking copy (from pageable memory CUDA waits for the stream: a host sync); ``to(non_blocking)``
  is the pinned, asynchronous copy of ``trainer/base/core/device.py``'s ``to_device``;
- ``sizes`` (when set to a list): every op's output shapes in call order, with its site; two
  steps of a step that allocates nothing by the data's values give the same list (a
  data-dependent size that needs no device read, e.g. a size read from a host batch, shows
  up here and in no other kind);
- ``shape``: ops whose output size depends on the values of a ``dev`` tensor (nonzero, unique,
  masked_select, boolean-mask indexing, repeat_interleave without output_size, bincount: its length
  is max(minlength, max + 1)): they wait for the device too on CUDA (torch.cuda.set_sync_debug_mode
  reports them, on a GPU).

Each record names the innermost frame of this repository (trainer/, kernels/) and whether torch's
own code (an optimizer, autograd) made the call. Frames of ``trainer/base/core/device.py`` (the host ->
device helpers) are skipped: a copy made through ``to_device`` is recorded at its caller. The
autograd engine runs backward functions without the caller's function mode, so our own autograd
Functions' ``backward`` (the pooled gathers) are wrapped to re-enter it while the audit is active.

``.to(device)`` of a ``host`` tensor, called by our code, returns a new tensor (as on CUDA; on the
CPU torch would return the same object): the source stays ``host``, so a host tensor moved again in
every step (instead of once, kept on the device) shows up as a ``copy`` each time.

Limits: a ``.to`` inside torch's own code (``nn.Module.to``) still returns the same object, which is
then ``dev`` for every later use; ``device=x.device`` is taken for the trainer's device even when
``x`` is a host tensor (the data source's checks of a host batch); tensors made by code the mode
does not see (autograd's ``.grad``, a checkpoint load) have no virtual device (reads of them are
recorded, mixes with them are not).
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("trainer", "kernels"))
# helpers whose caller is the site that matters (every host -> device copy goes through them)
_PASS_THROUGH = (os.path.join(ROOT, "trainer", "base", "core", "device.py"),)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_HERE = os.path.abspath(__file__)
# torch's public Python wrappers that hand a call to the mode (torch.unique, Tensor.unique, F.*):
# a frame there is the API being called, not torch code calling torch
_WRAPPERS = tuple(os.path.join(_TORCH, f) for f in (
    "overrides.py", "functional.py", "_tensor.py", "_jit_internal.py",
    os.path.join("nn", "functional.py")))

HOST, DEV = "host", "dev"

FACTORIES = {
    torch.arange: "arange", torch.zeros: "zeros", torch.ones: "ones", torch.empty: "empty",
    torch.full: "full", torch.tensor: "tensor", torch.as_tensor: "as_tensor", torch.rand: "rand",
    torch.randn: "randn", torch.randint: "randint", torch.randperm: "randperm",
    torch.linspace: "linspace", torch.eye: "eye", torch.scalar_tensor: "scalar_tensor",
    torch.empty_strided: "empty_strided",
}
HOST_READS = {
    torch.Tensor.tolist: "tolist", torch.Tensor.item: "item", torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float", torch.Tensor.__bool__: "bool", torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu", torch.equal: "equal",
    torch.Tensor.equal: "equal",
}
SHAPE_OPS = {
    torch.nonzero: "nonzero", torch.Tensor.nonzero: "nonzero", torch.unique: "unique",
    torch.Tensor.unique: "unique", torch.unique_consecutive: "unique_consecutive",
    torch.Tensor.unique_consecutive: "unique_consecutive", torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select", torch.bincount: "bincount",
    torch.Tensor.bincount: "bincount",
}
COPIES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.cuda}
MOVES = {torch.Tensor.to: "to", torch.Tensor.cuda: "cuda"}  # may move a tensor to the device


@dataclass(frozen=True)
class Record:
    """One audited call: kind ("factory" | "mix" | "host" | "shape" | "copy"), op name, where (file:function
    :line of the innermost frame in trainer/ or kernels/), and whether torch's own code made it."""

    kind: str
    op: str
    file: str
    function: str
    line: int
    by_torch: bool

    @property
    def site(self) -> tuple[str, str]:
        """(file, function): how allow-lists name a call site (line numbers move too often)."""
        return self.file, self.function

    def __str__(self) -> str:
        who = " (inside torch)" if self.by_torch else ""
        return f"{self.kind}:{self.op} at {self.file}:{self.function}:{self.line}{who}"


def _where() -> tuple[str, str, int, bool]:
    """(file relative to the repo, function, line) of the innermost repo frame, and whether torch's
    own code (an optimizer, autograd, ...; not an API wrapper) lies between it and the call."""
    frame = sys._getframe(2)
    by_torch = False
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_OURS) and path not in _PASS_THROUGH:
            return os.path.relpath(path, ROOT), frame.f_code.co_name, frame.f_lineno, by_torch
        if path != _HERE and path.startswith(_TORCH) and not path.startswith(_WRAPPERS):
            by_torch = True
        frame = frame.f_back
    return "<outside>", "<outside>", 0, by_torch


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in x (nested lists, tuples, dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _bool_index(args: tuple) -> bool:
    """t[mask] / t[mask] = v with a bool tensor (or a tuple holding one): output size = mask.sum()."""
    if len(args) < 2:
        return False
    idx = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)


def _non_blocking(args: tuple, kwargs: dict) -> bool:
    """Whether a Tensor.to / .cuda / .copy_ call asks for an asynchronous copy."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return any(a is True for a in args[1:])  # positional: to(device, dtype, True), copy_(src, True)


def _our_functions() -> list[type]:
    """Every torch.autograd.Function subclass defined in trainer/ or kernels/ (loaded so far)."""
    out, todo = [], list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in ("trainer", "kernels"):
            out.append(cls)
    return out


class StepAudit(TorchFunctionMode):
    """Keeps every tensor's virtual device while active; records only while ``recording``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Record] = []
        self.recording = False
        self.sizes: Optional[list[tuple[str, str, tuple]]] = None  # a list: every op's output sizes
        self.label: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._patched: list[tuple[Any, str, Any]] = []

    # ---- activation ------------------------------------------------------------------------
    def __enter__(self) -> "StepAudit":
        for cls in _our_functions():
            original = cls.__dict__["backward"]
            self._patched.append((cls, "backward", original))
            setattr(cls, "backward", staticmethod(self._audited(original.__func__)))
        from_numpy = torch.from_numpy

        def labelled_from_numpy(array: Any) -> torch.Tensor:
            out = from_numpy(array)
            self.label[out] = HOST
            return out

        self._patched.append((torch, "from_numpy", from_numpy))
        torch.from_numpy = labelled_from_numpy
        import kernels.reference  # audit the path a GPU takes: no CPU-only shortcuts
        self._patched.append((kernels.reference, "CPU_SHORTCUTS", kernels.reference.CPU_SHORTCUTS))
        kernels.reference.CPU_SHORTCUTS = False
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def _audited(self, backward: Callable) -> Callable:
        def run(ctx: Any, *grads: Any) -> Any:
            from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode
            if any(m is self for m in _get_current_function_mode_stack()):
                return backward(ctx, *grads)  # a torch that keeps the mode in backward
            _push_mode(self)
            try:
                return backward(ctx, *grads)
            finally:
                _pop_mode()
        return run

    # ---- the hook --------------------------------------------------------------------------
    def _add(self, kind: str, op: str) -> None:
        if self.recording:
            file, function, line, by_torch = _where()
            self.records.append(Record(kind, op, file, function, line, by_torch))

    def _of(self, t: torch.Tensor) -> Optional[str]:
        return self.label.get(t)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        labels = [(t, self._of(t)) for t in inputs]
        has_dev = any(lab == DEV for _, lab in labels)
        big_host = any(lab == HOST and t.dim() > 0 for t, lab in labels)
        source = self._of(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        if func in FACTORIES and kwargs.get("device") is None:
            self._add("factory", FACTORIES[func])
        elif func in HOST_READS:
            if any(lab != HOST for _, lab in labels):
                self._add("host", HOST_READS[func])
        elif func in SHAPE_OPS or (func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
                                   and _bool_index(args)) or (
                func is torch.repeat_interleave and "output_size" not in kwargs
                and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            if has_dev:
                op = SHAPE_OPS.get(func, "bool_index" if func is not torch.repeat_interleave
                                   else "repeat_interleave")
                self._add("shape", op)
        if has_dev and big_host and func not in COPIES:
            self._add("mix", getattr(func, "__name__", str(func)))
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and args and not isinstance(args[0], torch.Tensor):
            self._add("copy", "tensor(device=)")  # Python data: built on the host, then copied
        elif func is torch.Tensor.copy_ and len(args) > 1 and source == DEV \
                and isinstance(args[1], torch.Tensor) and self._of(args[1]) == HOST:
            self._add("copy", "copy_(non_blocking)" if _non_blocking(args, kwargs) else "copy_")
        elif func is torch.Tensor.__setitem__ and source == DEV and len(args) > 2 and (
                isinstance(args[2], (bool, int, float)) or (isinstance(args[2], torch.Tensor)
                                                            and self._of(args[2]) == HOST)):
            # t[i] = 5 on a CUDA tensor: torch makes the value a host tensor and copies it (a
            # blocking copy, seen by set_sync_debug_mode on the H200); t[i].fill_(5) launches a fill
            self._add("copy", "setitem(host value)")
        out = func(*args, **kwargs)
        label = self._result_label(func, args, kwargs, has_dev, labels)
        if func in MOVES and label == DEV and source == HOST:
            self._add("copy", MOVES[func] + ("(non_blocking)" if _non_blocking(args, kwargs) else ""))
            if out is args[0] and not _where()[3]:
                # on CUDA the move makes a new tensor and the host one stays on the host: do the
                # same here, so a later `.to` of the host tensor is seen as the copy it is there
                out = out.clone()
        if label is not None:
            for t in _tensors(out):
                self.label[t] = label
        if self.recording and self.sizes is not None:
            shapes = tuple(tuple(t.shape) for t in _tensors(out))
            if shapes:
                file, function, line, _ = _where()
                self.sizes.append((getattr(func, "__name__", str(func)), f"{file}:{function}:{line}", shapes))
        return out

    def _result_label(self, func: Callable, args: tuple, kwargs: dict, has_dev: bool,
                      labels: list) -> Optional[str]:
        if func in FACTORIES:
            return HOST if kwargs.get("device") is None else DEV
        if func is torch.Tensor.cpu:
            return HOST
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            if func is torch.Tensor.cuda or kwargs.get("device") is not None:
                return DEV
            for a in args[1:]:
                if isinstance(a, (torch.device, str)):
                    return DEV
                if isinstance(a, torch.Tensor):
                    return self._of(a)
        if has_dev:
            return DEV
        return HOST if any(lab == HOST for _, lab in labels) else None

    # ---- results ---------------------------------------------------------------------------
    def of(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.kind == kind]


def table(records: Iterable[Record]) -> str:
    """Per (kind, op, file, function, line, by_torch): the number of calls, one line each."""
    counts = Counter(records)
    return "\n".join(f"{n:4d} x {r}" for r, n in sorted(counts.items(), key=lambda kv: str(kv[0])))


def outside(records: Iterable[Record], allowed: dict[tuple[str, str], str]) -> list[Record]:
    """Records whose (file, function) site is not in `allowed` (site -> why it is allowed)."""
    return [r for r in records if r.site not in allowed]
