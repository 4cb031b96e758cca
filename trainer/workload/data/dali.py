"""NVIDIA DALI reader of prepared Criteo blocks: the trainer's default loader for data=criteo.

Why DALI: it reads and decodes in its own threads with a prefetch queue, so the next block is ready
while the current step trains, and the same pipeline runs on GPU on a cluster. Each prepared block
(int32 [n, 1 + F + T], trainer/workload/data/criteo.py) is one DALI sample; fn.readers.numpy shards the block
list by rank with shard_id/num_shards (stick_to_shard: a rank loops over its own blocks), and the
pipeline splits a block into labels (cast to float), dense (reinterpreted float32 bits) and ids
(cast to int64). Row selection, the seeded row shuffle and batching are shared with the memmap
reference reader (trainer/workload/data/blocks.py).

device_id=None gives a CPU-only pipeline (machines without a GPU); with a device id the columns are
produced on that GPU and handed to torch by DLPack without a host copy.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from .blocks import BlockReader, Columns, shard_range
from .criteo import CriteoFormatError, check_block

READER = "blocks"


def _pipeline(files: list[str], shard_id: int, num_shards: int, num_dense: int, threads: int,
              device_id: Optional[int]):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=threads, device_id=device_id, prefetch_queue_depth=2)
    def blocks():
        raw = fn.readers.numpy(files=files, shard_id=shard_id, num_shards=num_shards,
                               stick_to_shard=True, random_shuffle=False, pad_last_batch=False,
                               name=READER)
        if device_id is not None:
            raw = raw.gpu()
        labels = fn.cast(raw[:, 0], dtype=types.FLOAT)
        dense = fn.reinterpret(raw[:, 1:1 + num_dense], dtype=types.FLOAT)
        ids = fn.cast(raw[:, 1 + num_dense:], dtype=types.INT64)
        return labels, dense, ids

    pipe = blocks()
    pipe.build()
    return pipe


def _to_torch(out) -> torch.Tensor:
    """The single sample of a DALI output as an owned torch tensor (DALI reuses its buffers)."""
    return torch.from_dlpack(out[0]).clone()


def require_dali() -> None:
    """Fail at start-up, not at the first batch, when DALI is not installed."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as exc:
        raise ImportError("data.loader=dali needs NVIDIA DALI (pip install nvidia-dali-cuda120==2.4.0, "
                          "Linux x86_64; scripts/setup.sh installs it), or use data.loader=memmap") from exc


def dali_reader(num_dense: int, threads: int = 1, device_id: Optional[int] = None) -> BlockReader:
    """A BlockReader backed by a DALI pipeline: (files, shard_id, num_shards) -> endless blocks."""
    require_dali()

    def read(files: list[str], shard_id: int, num_shards: int) -> Iterator[Columns]:
        lo, hi = shard_range(len(files), shard_id, num_shards)
        try:
            pipe = _pipeline(files, shard_id, num_shards, num_dense, threads, device_id)
        except RuntimeError as exc:
            raise CriteoFormatError(_failed(files[lo:hi], exc)) from exc
        while True:
            try:
                labels, dense, ids = pipe.run()
            except RuntimeError as exc:  # a block removed or cut short while training
                raise CriteoFormatError(_failed(files[lo:hi], exc)) from exc
            yield _to_torch(labels), _to_torch(dense), _to_torch(ids)
    return read


def _failed(files: list[str], exc: BaseException) -> str:
    """DALI's error names the file somewhere in a long C++ trace: keep its first line, and the
    shard's files that are now missing or damaged."""
    bad = [f"{f} {why}" for f in files if (why := check_block(f, 0)) is not None]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"DALI cannot read this rank's block files ({'; '.join(bad) or ', '.join(files[:3])}): "
            f"{first}")
