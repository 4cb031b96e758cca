"""Test helpers for Criteo-format data: the suite's own sample (1,999 made-up rows in Criteo's raw
format, dev/criteo_file.py; files derived from it go to pytest's tmp_path) prepared by the real
preprocessing code, and a worker body that trains several models in one pair of gloo processes
(saves process start-ups). Tests of real Criteo statistics take the real sample from the
`criteo_sample` fixture (tests/conftest.py) instead."""
from __future__ import annotations

import collections
import json
import os
from typing import Any

import numpy as np

from dev import criteo_file
from helpers import make_cfg
from trainer.workload.data.prepare import PrepOptions, prepare
from trainer.run.runner import run

# The real Criteo sample (1,999 rows of Criteo's Kaggle data in raw TSV), for the few tests whose
# point is real Criteo statistics (a baseline's AUC, what a model learns from real rows), through
# tests/conftest.py's criteo_sample fixture. Criteo's terms forbid copying it into the repository,
# so it is read where it lies: $CRITEO_SAMPLE, else the file beside the checkout.
CRITEO_SAMPLE_ENV = "CRITEO_SAMPLE"
_BESIDE_CHECKOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                                "criteo_sample_2k.tsv")


def real_sample_path() -> str:
    return os.environ.get(CRITEO_SAMPLE_ENV) or os.path.normpath(_BESIDE_CHECKOUT)


N_ROWS = 1999  # rows of the suite's sample (as many as the real sample has)
N_TRAIN = 1600  # first rows of the sample used for training; the rest is the test split


def sample_lines() -> list[str]:
    """The suite's sample rows, in Criteo's raw format (with their newlines)."""
    return list(criteo_file.lines(N_ROWS))


def write_sample(path: str) -> str:
    """The suite's sample as a file (what a script that reads a raw Criteo file is given)."""
    return write_lines(path, sample_lines())


def write_lines(path: str, lines: list[str]) -> str:
    with open(path, "w") as f:
        f.writelines(lines)
    return path


def prepare_sample(out: str, with_test: bool = True, source: str | None = None, **opts: Any) -> dict:
    """Prepare the sample into `out` (train = first N_TRAIN rows, test = the rest); `source`: another
    raw file of as many rows (the real Criteo sample) instead of the suite's."""
    if source is None:
        lines = sample_lines()
    else:
        with open(source) as f:
            lines = f.readlines()
    raw = os.path.join(out, "raw")
    os.makedirs(raw, exist_ok=True)
    train = write_lines(os.path.join(raw, "train.tsv"), lines[:N_TRAIN] if with_test else lines)
    test = [write_lines(os.path.join(raw, "test.tsv"), lines[N_TRAIN:])] if with_test else []
    kw = dict(hash_rows=[1000] * 26, workers=1, chunk_mb=0.05, progress=False)
    kw.update(opts)
    return prepare(PrepOptions(out=os.path.join(out, "prepared"), train=[train], test=test, **kw))


def prepared_dir(tmp_path_factory: Any, name: str) -> str:
    """A module fixture's body: the sample prepared once into a fresh temp dir; its prepared path."""
    out = tmp_path_factory.mktemp(name)
    prepare_sample(str(out))
    return str(out / "prepared")


def reference_vocab(prepared: str, n_rows: int, min_count: int) -> list[list[int]]:
    """data.min_count's vocabulary the plain way: per table, the sorted non-empty ids seen at least
    min_count times in the first n_rows training rows of a prepared directory (file order)."""
    meta = json.load(open(os.path.join(prepared, "meta.json")))
    ids = np.concatenate([np.load(os.path.join(prepared, b["file"]))[:, 14:]
                          for b in meta["splits"]["train"]["blocks"]])[:n_rows]
    out = []
    for t in range(ids.shape[1]):
        counts = collections.Counter(int(v) for v in ids[:, t])
        out.append(sorted(v for v, n in counts.items() if v != 0 and n >= min_count))
    return out


def train_models(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Child body: one rank of several `python -m trainer comm=torch <overrides>` runs in sequence."""
    out = []
    for overrides in runs:
        res = run(make_cfg(list(overrides) + ["comm=torch"]))
        out.append({"summary": res.summary, "losses": res.losses})
    return out
