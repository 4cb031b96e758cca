"""The data's preprocessing in the artifact, so raw rows are scored as the trainer read its rows.

For data=criteo the trainer's ids and dense values came through: prepare_criteo's parsing (the
dense transform log(1 + max(x, 0)); the categorical encoding: hashing, the prepared vocabulary or
raw 32-bit values; meta.json and vocab.npz of data.dir), then the trainer's own steps
(trainer/workload/data/blocks.py to_batch): the id guard (data.out_of_range), the training rows'
vocabulary (data.min_count), the fold into the model's table rows (data.max_table_rows), and the
dense standardization (data.standardize: the training rows' mean and std). The export saves each
part (the prepared files copied, the trainer's statistics computed from data.dir as the run did)
into `preprocess/`, and RawRows applies them with the very functions the trainer uses.

Other data (synthetic, movielens): no raw row format; the artifact takes the trainer's ids.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..base.config import Config
from ..workload.data.batch import Batch
from ..workload.data.blocks import dense_stats, split_segments, split_validation, to_batch
from ..workload.data.chunks import iter_chunks
from ..workload.data.criteo import (META, CriteoFormatError, Encoder, parse_chunk, raw_ids, read_meta)
from ..workload.data.ids import IdGuard
from ..workload.data.vocab import Vocab, build_vocab
from .artifact import ServingError

PREP = "preprocess"
STATE = os.path.join(PREP, "trainer.pt")
CHUNK_BYTES = 4 << 20


def export_preprocessing(c: Config, tmp: str) -> Optional[dict[str, Any]]:
    """Write `preprocess/` for the run's data into the artifact being written at tmp; its
    manifest entry (None: the data has no raw row format)."""
    d = c.data
    if d.name != "criteo":
        return None
    try:
        meta = read_meta(d.dir)
    except CriteoFormatError as exc:
        raise ServingError(f"the run's data.dir is needed to export its preprocessing: {exc}") from exc
    os.makedirs(os.path.join(tmp, PREP), exist_ok=True)
    shutil.copyfile(os.path.join(d.dir, META), os.path.join(tmp, PREP, META))
    kind = meta["categorical"]["kind"]
    if kind == "vocab":
        shutil.copyfile(os.path.join(d.dir, "vocab.npz"), os.path.join(tmp, PREP, "vocab.npz"))
    train, _ = split_segments(meta, d.dir, d)
    train, _ = split_validation(train, d)
    num_dense = int(meta["num_dense"])
    norm = dense_stats(train, num_dense) if d.standardize else None
    vocab = build_vocab(train, num_dense, [int(n) for n in meta["table_rows"]], d.min_count) if d.min_count else None
    torch.save({"norm": None if norm is None else [norm[0], norm[1]],
                "vocab": None if vocab is None else asdict(vocab), "out_of_range": d.out_of_range}, os.path.join(tmp, STATE))
    return {"rows": "criteo TSV: label, 13 integers, 26 hex fields (the label is read and ignored)",
            "categorical": kind, "standardize": bool(d.standardize), "min_count": d.min_count or 0,
            "out_of_range": d.out_of_range}


class RawRows:
    """Criteo TSV text -> the trainer's batches, by the artifact's preprocessing."""

    def __init__(self, directory: str, table_rows: list[int]) -> None:
        meta = read_meta(os.path.join(directory, PREP))
        state = torch.load(os.path.join(directory, STATE), weights_only=True)
        rule = meta["categorical"]
        if rule["kind"] == "hash":
            self.encoder = Encoder.hashing(rule["hash_rows"])
        elif rule["kind"] == "raw":
            self.encoder = Encoder.raw()
        else:
            with np.load(os.path.join(directory, PREP, "vocab.npz")) as z:
                self.encoder = Encoder.from_vocab([z[f"t{t}"] for t in range(len(z.files))], int(rule["min_count"]))
        self.num_dense = int(meta["num_dense"])
        self.guard = IdGuard([int(n) for n in meta["table_rows"]], state["out_of_range"], "the rows to score")
        self.norm = tuple(state["norm"]) if state["norm"] is not None else None
        self.vocab = Vocab(**state["vocab"]) if state["vocab"] is not None else None
        self.raw = raw_ids(meta)
        self.rows = torch.tensor(table_rows, dtype=torch.int64)

    def batches(self, path: str) -> Iterator[Batch]:
        """The rows of a TSV file (.gz too), in order, a chunk of lines at a time; a bad row is a
        ServingError naming its line and what is wrong with it."""
        line = 0
        try:
            for buf, _ in iter_chunks(path, CHUNK_BYTES):
                parsed = parse_chunk(buf)
                if parsed.bad_lines.size:
                    at = line + int(parsed.bad_lines[0]) + 1
                    raise ServingError(f"{path}: line {at}: {parsed.bad_reasons[0]} ({parsed.bad_lines.size} bad "
                                       f"row(s) in lines {line + 1}..{line + parsed.num_lines}); nothing was scored")
                line += parsed.num_lines
                ids = self.encoder.encode(parsed.cats, parsed.empty)
                cols = (torch.from_numpy(parsed.labels.astype(np.float32)), torch.from_numpy(parsed.dense),
                        torch.from_numpy(ids.astype(np.int64)))
                yield to_batch(cols, self.num_dense, self.rows, self.guard, f"{path} near line {line}", self.norm,
                               self.vocab, self.raw)
        except CriteoFormatError as exc:
            raise ServingError(str(exc)) from exc
