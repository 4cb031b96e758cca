"""`export`: a run's checkpoint -> one artifact directory (artifact.py) that scores rows without
the trainer's runtime (no process group, no shards, no config resolution).

What it takes: the run's newest complete checkpoint (or the one named), at any W, memory or disk
store, fp32 / fp16 / bf16 rows. The checkpoint's manifest holds the resolved training config, so
the model is rebuilt from it; the dense state comes from its trainer file (checked against its
sha256), the rows from every shard (their blocks checked as they are read: tables.py).

What it writes: the dense model as a torch.export program, each table as one memory-mappable
file in the order of its ids, and a manifest (artifact.py). The ids the tables are indexed by are
the trainer's: a batch's ids after the data's own preprocessing (for data=criteo: prepared by
prepare_criteo and folded by data.min_count / data.max_table_rows as the trainer folds them).

Not yet (refused in one line): dynamic tables (their rows are found through an id map).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
from typing import Any, Optional

import torch

from ..base.config.load import parse
from ..run.checkpoint import TRAINER_FILE, CheckpointError, latest, read_manifest
from ..run.checkpoint.manifest import read_file
from ..workload.models import build_model
from .artifact import DENSE, ServingError, table_file, write_manifest, writing
from .preprocess import export_preprocessing
from .tables import ROWS_AS, WINDOW_BYTES, merge_table

ONNX, AOTI = "dense.onnx", "dense.aoti.pt2"
EXAMPLE_BATCH = 4  # the batch the program is traced with; its batch dimension is dynamic


def find_checkpoint(source: str, checkpoint: Optional[str] = None) -> str:
    """The checkpoint to export: `checkpoint` if given, `source` itself if it is one, else the
    newest complete checkpoint of the run directory `source` (its config's checkpoint.dir, else
    source/checkpoints)."""
    if checkpoint is not None:
        return checkpoint
    if os.path.exists(os.path.join(source, "manifest.json")):
        return source
    if not os.path.isdir(source):
        raise ServingError(f"{source} is not a run directory (give the run's output directory, or --checkpoint PATH)")
    members = sorted(n for n in os.listdir(source) if n.startswith("member") and n[6:].isdigit())
    if members and not os.path.isdir(os.path.join(source, "checkpoints")):
        raise ServingError(f"{source} is an ensemble of {len(members)} members (train.ensemble): export one member's "
                           f"directory ({os.path.join(source, members[0])}); an ensemble is not exported as one "
                           "artifact yet (train.ensemble=1 trains one model)")
    root = os.path.join(source, "checkpoints")
    try:
        with open(os.path.join(source, "summary.json")) as f:
            root = json.load(f).get("config", {}).get("checkpoint", {}).get("dir") or root
    except (OSError, ValueError):
        pass
    found = latest(root)
    if found is None:
        raise ServingError(f"{source} has no complete checkpoint (looked in {root}): the run saved none "
                           "(checkpoint.enabled=false, or it stopped before its first save); train it with "
                           "checkpoints, or give one with --checkpoint PATH")
    return found


def export(source: str, out: str, checkpoint: Optional[str] = None, window_bytes: int = WINDOW_BYTES,
           rows_as: str = "saved", onnx: bool = False, aoti: bool = False, say=print) -> dict[str, Any]:
    """Export the run (or checkpoint) `source` into the new directory `out`; returns the manifest.
    rows_as: the tables' rows as saved, fp16 or int8 (row-wise; tables.merge_table). onnx / aoti:
    the dense model also as ONNX (dense.onnx) / an AOTInductor package (dense.aoti.pt2). say(line):
    progress lines (stderr by the command line)."""
    if rows_as not in ROWS_AS:
        raise ServingError(f"--rows {rows_as}: one of {', '.join(ROWS_AS)}")
    _can_write_runtimes(onnx, aoti)
    ckpt = find_checkpoint(source, checkpoint)
    try:
        manifest = read_manifest(ckpt)
        if int(manifest.get("format_version", 1)) < 2:
            raise ServingError(f"checkpoint {ckpt} is of format 1 (a pickled shard): resume it once with this "
                               "trainer and save (checkpoint.resume=...), then export that checkpoint")
        c = parse(manifest["config"])
        if c.embedding.kind != "fixed":
            raise ServingError(f"checkpoint {ckpt}: embedding.kind={c.embedding.kind} tables are not exported yet "
                               "(fixed tables only in this version)")
        state = read_file(ckpt, TRAINER_FILE, manifest)
    except CheckpointError as exc:
        raise ServingError(f"{exc} (nothing was exported)") from exc
    tables = [int(n) for n in manifest["table_rows"]]
    model = build_model(c.model, c.data.num_dense, len(tables))
    model.load_state_dict(state["model"])
    model.eval()
    step = int(state["step"])
    _say_evaluated(source, step, say)
    t0 = time.monotonic()
    with writing(out) as tmp:
        program = _export_dense(model, c.data.num_dense, len(tables), c.model.embedding_dim)
        torch.export.save(program, os.path.join(tmp, DENSE))
        runtimes = _other_runtimes(program, tmp, onnx, aoti, say)
        infos = []
        for t, rows in enumerate(tables):
            try:
                infos.append({"file": table_file(t), **merge_table(ckpt, manifest, t, os.path.join(tmp, table_file(t)),
                                                                   window_bytes, rows_as)})
            except CheckpointError as exc:
                raise ServingError(f"{exc} (nothing was exported)") from exc
            say(f"[export] table {t + 1}/{len(tables)}: {rows:,} rows ({time.monotonic() - t0:.0f} s)")
        prep = export_preprocessing(c, tmp)
        body = {"model": {"name": c.model.name, "num_dense": c.data.num_dense, "num_tables": len(tables),
                          "embedding_dim": c.model.embedding_dim, "pooling": c.model.pooling,
                          "precision": c.train.precision, "dense": DENSE, **runtimes},
                "tables": infos,
                "ids": ("the trainer's ids: a batch's ids after its data's preprocessing "
                        f"(data.name={c.data.name}), one id per row of each table's file"),
                "preprocess": prep,
                "checkpoint": {"path": os.path.abspath(ckpt), "step": step, "world_size": int(manifest["world_size"])},
                "config": manifest["config"]}
        write_manifest(tmp, body)
    say(f"[export] {os.path.abspath(out)}: step {step} of {os.path.abspath(ckpt)}, {len(tables)} tables, "
        f"{sum(tables):,} rows ({time.monotonic() - t0:.0f} s)")
    return body


def _export_dense(model: torch.nn.Module, num_dense: int, num_tables: int, dim: int) -> Any:
    """The model as a torch.export program of (dense [B, F], pooled [B, T, d]) with B dynamic."""
    batch = torch.export.Dim("batch", min=1)
    example = (torch.zeros(EXAMPLE_BATCH, num_dense), torch.zeros(EXAMPLE_BATCH, num_tables, dim))
    with torch.no_grad():
        return torch.export.export(model, example, dynamic_shapes=({0: batch}, {0: batch}))


def _can_write_runtimes(onnx: bool, aoti: bool) -> None:
    """ServingError, before anything is read or written, when --onnx or --aoti cannot be done here."""
    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if onnx and missing:
        raise ServingError(f"--onnx needs the {' and '.join(missing)} package(s) (pip install onnx onnxscript); "
                           "nothing was exported")
    if aoti and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        raise ServingError("--aoti compiles the dense model with a C++ compiler, and none is on PATH (c++, g++, "
                           "clang++); nothing was exported")


def _other_runtimes(program: Any, tmp: str, onnx: bool, aoti: bool, say) -> dict[str, str]:
    """The dense program also as ONNX and as an AOTInductor package, where asked: their files."""
    files = {}
    shapes = ({0: torch.export.Dim("batch", min=1)}, {0: torch.export.Dim("batch", min=1)})
    if onnx:
        t0 = time.monotonic()
        example = tuple(torch.zeros(x.shape) for x in program.example_inputs[0])
        with contextlib.redirect_stdout(sys.stderr):  # the exporter's progress lines
            torch.onnx.export(program, example, os.path.join(tmp, ONNX), dynamo=True, dynamic_shapes=shapes)
        files["onnx"] = ONNX
        say(f"[export] the dense model as ONNX: {ONNX} ({time.monotonic() - t0:.0f} s)")
    if aoti:
        t0 = time.monotonic()
        torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(tmp, AOTI))
        files["aoti"] = AOTI
        say(f"[export] the dense model as an AOTInductor package: {AOTI} ({time.monotonic() - t0:.0f} s)")
    return files


def _say_evaluated(source: str, step: int, say) -> None:
    """When the run's summary says its test figures are of another step's model (the best
    validation model restored), say so: the artifact is the checkpoint's model."""
    try:
        with open(os.path.join(source, "summary.json")) as f:
            early = json.load(f).get("early_stop") or {}
    except (OSError, ValueError):
        return
    evaluated = early.get("evaluated_model_step")
    if evaluated is not None and evaluated != step:
        say(f"[export] note: the run's test figures are of step {evaluated}'s model (the best validation model, "
            f"restored for the test); this artifact is step {step}'s (train.early_stop.restore_best=false keeps "
            "them the same model)")


def say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
