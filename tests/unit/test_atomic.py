"""trainer/base/core/atomic.py, the package's one way to replace a file: whole or not at all (a failure
leaves the old file and no temporary one), JSON with numpy numbers; and no other module of the
package renames a file over another (checkpoint/saver.py renames directories: its own protocol)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from trainer.base.core.atomic import replacing, write_json_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_json_is_written_whole_with_numpy_numbers(tmp_path):
    path = str(tmp_path / "a.json")
    write_json_atomic(path, {"n": np.int64(3), "x": np.float32(0.5), "l": [1]}, indent=1)
    text = open(path).read()
    assert json.loads(text) == {"n": 3, "x": 0.5, "l": [1]} and text.endswith("}\n")
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_failure_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_json_atomic(str(path), {"x": object()})  # not JSON: fails halfway through the dump
    with pytest.raises(OSError):
        with replacing(str(path), "wb") as f:
            f.write(b"new, half")
            raise OSError(28, "No space left on device (injected)")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.json"]
    with replacing(str(path), "wb", fsync=True) as f:
        np.save(f, np.arange(3))
    assert np.load(path).tolist() == [0, 1, 2] and os.listdir(tmp_path) == ["a.json"]


def test_no_other_module_replaces_a_file_itself():
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "trainer")):
        for name in files:
            rel = os.path.relpath(os.path.join(d, name), ROOT)
            if name.endswith(".py") and rel not in ("trainer/base/core/atomic.py", "trainer/run/checkpoint/saver.py"):
                text = open(os.path.join(d, name)).read()
                found += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}" for m in re.finditer(r"os\.replace\(", text)]
    assert found == [], f"write through trainer/base/core/atomic.py instead: {found}"
