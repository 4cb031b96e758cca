"""The batch type every data source yields and every model/embedding consumes.

Sparse features are stored sample-major: bag j = (sample j // T, table j % T), its ids are
values[offsets[j]:offsets[j + 1]]. This is the order the pooled-gather kernel reads and it makes
the pooled output [B, T, d] a plain reshape.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...base.core.device import to_device


@dataclass
class Batch:
    dense: torch.Tensor  # [B, F] float32 dense features
    values: torch.Tensor  # [N] int64 per-table row ids, bags in sample-major order
    lengths: torch.Tensor  # [B, T] int64 ids per bag
    labels: torch.Tensor  # [B] float32 click labels in {0, 1}
    # table_index(), made once per batch (the id guard and the lookup plan both need it)
    _tables: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # ids per bag when the source knows every bag holds exactly that many (None: read the lengths)
    bag_length: int | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_tables(self) -> int:
        return int(self.lengths.shape[1])

    # Both helpers run in every step's lookup: they make their tensors on the batch's own device
    # (a host tensor here would move to the GPU, or fail against the device lengths, every step)
    # and read nothing back from it (the output size of the repeat is values.numel(), known here).

    def offsets(self) -> torch.Tensor:
        """[B*T + 1] int64 bag offsets into values, on the batch's device."""
        flat = self.lengths.reshape(-1)
        out = torch.zeros(flat.numel() + 1, dtype=torch.int64, device=flat.device)
        torch.cumsum(flat, 0, out=out[1:])
        return out

    def uniform_bag_length(self) -> int | None:
        """n when every bag holds exactly n ids (one-hot data: 1), else None. Reads the lengths
        (one pass, on the host for a host batch)."""
        if self.lengths.numel() == 0:
            return None
        if self.bag_length is not None:
            return self.bag_length
        lo, hi = torch.aminmax(self.lengths)
        n = int(lo)
        return n if n == int(hi) and n * self.lengths.numel() == self.values.numel() else None

    def table_index(self) -> torch.Tensor:
        """[N] int64 table of every value, on the batch's device."""
        if self._tables is None:
            t = torch.arange(self.num_tables, dtype=torch.int64, device=self.lengths.device)
            self._tables = torch.repeat_interleave(t.repeat(self.lengths.shape[0]), self.lengths.reshape(-1),
                                                   output_size=self.values.numel())
        return self._tables

    def to(self, device: torch.device) -> "Batch":
        """The batch on `device`: from the host through pinned memory, asynchronously
        (trainer/base/core/device.py), so the host does not wait for the device's queued work."""
        return Batch(to_device(self.dense, device), to_device(self.values, device),
                     to_device(self.lengths, device), to_device(self.labels, device),
                     None if self._tables is None else to_device(self._tables, device), self.bag_length)
