"""The exported artifact's directory: its manifest, its files' hashes, written whole or not at all.

Layout (FORMAT_VERSION 1):
- `artifact.json`: format, format_version, the model (name, dims, pooling, precision), each
  table's file (rows, width, dtype: the tensor dtype; bfloat16 is stored as its raw 2 bytes,
  numpy having no bfloat16), the dense program's file, the checkpoint it came from (path, step,
  world size), the training config, and every file's bytes and sha256;
- `dense.pt2`: the dense model as a torch.export program: (dense [B, F] float32, pooled [B, T, d]
  float32) -> logits [B];
- `tables/table_TT.npy`: table t's rows, row-major, in the order of its ids (row i = id i): plain
  .npy files, so `numpy.load(path, mmap_mode="r")` maps them without reading them.

Why a directory written beside its place and renamed: a reader (a predictor, a copy to a server)
must never find half an artifact, and an export that fails leaves nothing a later command would
trust (the temporary directory is removed).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

FORMAT = "hybrid-trainer-artifact"
FORMAT_VERSION = 1
MANIFEST = "artifact.json"
DENSE = "dense.pt2"
HASH_PIECE = 8 << 20  # bytes hashed at a time


class ServingError(ValueError):
    """Bad input to export or predict (a run without a checkpoint, a damaged checkpoint or
    artifact, another format version, bad rows, an output that exists): one `error:` line, exit 2."""


def table_file(t: int) -> str:
    return os.path.join("tables", f"table_{t:02d}.npy")


def file_hash(path: str) -> dict[str, Any]:
    """{"bytes", "sha256"} of a file, read in pieces."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_PIECE):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


@contextmanager
def writing(out: str) -> Iterator[str]:
    """A temporary directory beside `out` (same file system) that becomes `out` when the block
    ends without an exception; else it is removed. `out` must not exist."""
    out = os.path.abspath(out)
    if os.path.lexists(out):
        raise ServingError(f"{out} exists: give a new directory for the artifact (nothing was written)")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ServingError(f"{parent} is not a directory: the artifact's parent must exist (nothing was written)")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        os.makedirs(os.path.join(tmp, "tables"))
        yield tmp
        _fsync_tree(tmp)
        os.rename(tmp, out)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(tmp: str, manifest: dict[str, Any]) -> None:
    """The manifest, with every file of the directory hashed into it (the last file written)."""
    files = {}
    for root, _, names in os.walk(tmp):
        for name in sorted(names):
            path = os.path.join(root, name)
            files[os.path.relpath(path, tmp)] = file_hash(path)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": files}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


def read_manifest(directory: str, verify: bool = True) -> dict[str, Any]:
    """The artifact's manifest, its format checked; verify: every file's size and sha256 too
    (ServingError naming the first that differs)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise ServingError(f"{directory} is not a directory (an artifact is what `export` wrote)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise ServingError(f"{path} cannot be read ({exc}): not an artifact of `export`, or a damaged one") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ServingError(f"{path} is not an artifact manifest (format {manifest.get('format')!r} "
                           f"if any, expected {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ServingError(f"{directory}: artifact format_version {manifest.get('format_version')}, this version "
                           f"of the trainer reads {FORMAT_VERSION}: export the run again with it")
    if verify:
        for name, want in manifest.get("files", {}).items():
            where = os.path.join(directory, name)
            try:
                got = file_hash(where)
            except OSError as exc:
                raise ServingError(f"artifact file {where} cannot be read: {exc}") from exc
            if got != want:
                raise ServingError(f"artifact file {where} fails its checksum ({got['bytes']} bytes, the manifest "
                                   f"says {want['bytes']}): the artifact is damaged; export it again")
    return manifest


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for where, _, names in os.walk(root):
        for name in names:
            _fsync(os.path.join(where, name))
        _fsync(where)
