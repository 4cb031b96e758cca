"""Moving a step's host-born inputs to the device without making the host wait for the device.

Why: on CUDA, ``t.to(device)`` of an ordinary (pageable) host tensor is a blocking copy: the host
waits for the stream, so everything queued before it (the previous step's kernels) must finish
first. A copy from page-locked ("pinned") memory with ``non_blocking=True`` is queued on the stream
like a kernel and the host goes on. Every host -> device copy a training step makes goes through
``to_device``: the batch (pipeline.py; the pipelined step prepares it one step early, so the copy
overlaps the current step), Herald's per-step id lists, the scheduler's hot slots, the split sizes a
device-side count needs. The pinned staging buffer comes from torch's caching host allocator, which
keeps it until the copy has run (it records the copy on the buffer), so the caller may drop it.

On the CPU there is nothing to copy: ``to_device`` returns the tensor itself.

``select`` is the other half of keeping the host from waiting: ``x[mask]`` must read the number of
True values back from the device before it can allocate its output; when the host knows that
number already (a count read back together with the alltoall split sizes), a fixed-size selection
needs no read at all.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

import kernels


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from the host to a CUDA device through pinned memory, asynchronously (the
    returned tensor is ready for every later op on the current stream)."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    # non_blocking only from the host: a device -> host copy must stay blocking to be readable
    return t.to(device, non_blocking=t.device.type == "cpu")


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_,
          torch.float32: np.float32, torch.float64: np.float64}


def from_host(values: Sequence[int] | np.ndarray, device: torch.device | str,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list / array of numbers as a tensor on `device` (one pinned, asynchronous copy)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(values, dtype=_NUMPY[dtype])), device)


def positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """nonzero(mask) [count] when the host already knows `count` = mask.sum(): a fixed-size
    selection (nonzero_static), so nothing is read back from the device. A wrong count would
    silently drop or pad positions, so it is checked where that costs no read (raised at once on
    the CPU, asynchronously on a GPU)."""
    if kernels.reference.CPU_SHORTCUTS and mask.device.type == "cpu":  # torch.nonzero: ~1.7x faster there
        out = torch.nonzero(mask).squeeze(1)
        if out.numel() != count:
            raise RuntimeError(f"a fixed-size selection's count is not the mask's ({count} != {out.numel()})")
        return out
    torch._assert_async(mask.sum() == count, "a fixed-size selection's count is not the mask's")
    return torch.nonzero_static(mask, size=count).squeeze(1)


def select(values: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """values[mask] when the host already knows `count` = mask.sum() (see positions)."""
    return values.index_select(0, positions(mask, count))


_RESIDENT: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> {device: its copy there}


def resident(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`, copied there once and kept for as long as `t` lives: for constants used
    with every batch (table sizes, the vocabulary, the dense features' statistics), which a
    plain `.to(device)` would copy again each time (a blocking copy from pageable memory). On
    the tensor's own device the "copy" is the tensor itself (kept with it: these constants live
    as long as their data source anyway)."""
    device = torch.device(device)
    copies = _RESIDENT.get(t)
    if copies is None:
        copies = _RESIDENT[t] = {}
    key = str(device)
    if key not in copies:
        copies[key] = to_device(t, device)
    return copies[key]
