"""dev/house_parity.py: the check that a refactor changed no behaviour (losses, tables and summary
of a fixed set of runs, hashed). Two runs of the same tree are the same; a changed table is named."""
from __future__ import annotations

import json
import subprocess
import sys

from hvd_launch import ROOT, env


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dev.house_parity", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env(), timeout=600)


def test_two_runs_of_the_same_tree_are_the_same(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (a, b):
        p = _run("--only", "dlrm", "dynamic", "--out", str(out))
        assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(x) for x in a.read_text().splitlines()]
    assert [r["run"] for r in rows] == ["dlrm", "dynamic"]
    assert all(r["n_losses"] == 25 and r["tables"] for r in rows), rows
    same = _run("--compare", str(a), str(b))
    assert same.returncode == 0 and "2 of 2 runs the same" in same.stdout, same.stdout
    # a table that changed is named, and the exit status says so
    changed = dict(rows[1])
    key = sorted(changed["tables"])[0]
    changed["tables"] = {**changed["tables"], key: "0" * 16}
    c = tmp_path / "c.jsonl"
    c.write_text("\n".join(json.dumps(r) for r in (rows[0], changed)) + "\n")
    diff = _run("--compare", str(a), str(c))
    assert diff.returncode == 1 and "dynamic: tables" in diff.stdout and key in diff.stdout, diff.stdout
    assert "1 of 2 runs the same" in diff.stdout
