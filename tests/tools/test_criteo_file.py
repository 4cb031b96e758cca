"""dev/criteo_file.py: the suite's made-up Criteo-format rows. Criteo's raw format exactly (every
row parses, with the empty fields, negative integers and 8-digit hex values Criteo's files have),
the same rows each time (a pure function of count and seed; a shorter file is a prefix),
a label a model can learn, and a command that writes a file prepare_criteo reads."""
from __future__ import annotations

import collections
import gzip
import json
import os
import subprocess
import sys

import numpy as np

from dev import criteo_file
from trainer.workload.data.criteo import NUM_CAT, NUM_DENSE, parse_chunk, parse_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rows_are_criteos_format_and_parse_without_a_bad_row():
    lines = criteo_file.lines(1999)
    assert len(lines) == 1999 and all(x.endswith("\n") and x.count("\t") == NUM_DENSE + NUM_CAT for x in lines)
    p = parse_chunk("".join(lines).encode())
    assert p.num_lines == 1999 and p.bad_lines.size == 0
    fields = [x.rstrip("\n").split("\t") for x in lines]
    cats = [f[1 + NUM_DENSE:] for f in fields]
    assert all(len(v) == 8 and v == v.lower() for row in cats for v in row if v)  # 8 hex digits, as Criteo's
    empty = np.array([[v == "" for v in f[1:]] for f in fields]).mean(axis=0)
    assert empty[0] > 0.3 and empty[1] == 0 and empty[NUM_DENSE + 21] > 0.7  # mostly empty fields, like I1, C22
    assert any(f[2].startswith("-") for f in fields)  # I2 holds small negative counts
    distinct = [len({r[t] for r in cats if r[t]}) for t in range(NUM_CAT)]
    assert min(distinct) <= 3 and max(distinct) > 1000  # vocabularies from a few values to one per row
    top = collections.Counter(r[0] for r in cats).most_common(1)[0][1]
    assert top > 100  # skewed: a frequent value takes many rows


def test_the_same_rows_each_time_and_a_prefix_for_fewer():
    a = criteo_file.lines(300)
    assert a == criteo_file.lines(1999)[:300] and a != criteo_file.lines(300, seed=1)
    criteo_file.lines.cache_clear()
    assert criteo_file.lines(300) == a  # computed again, not a cached copy
    label, dense, cats = parse_line(a[0])
    assert (label, len(dense), len(cats)) == (int(a[0][0]), NUM_DENSE, NUM_CAT)


def test_the_label_can_be_learned():
    """About a fifth positive; a plain one-feature-at-a-time check finds fields that move the rate
    (logistic regression reaches ~0.77 AUC: tests/tools/test_baseline_lr.py)."""
    labels, dense, cats = criteo_file.columns(20000)
    assert 0.15 < labels.mean() < 0.25
    x = np.log1p(np.maximum(dense[0].filled(0), 0))
    assert np.corrcoef(x, labels)[0, 1] > 0.03  # I1 raises the click rate (0.06 on these rows)
    rates = collections.defaultdict(list)
    for v, y in zip(cats[8].filled(0), labels):  # C9: 3 values, each its own rate
        rates[int(v)].append(y)
    means = sorted(np.mean(v) for v in rates.values())
    assert len(means) == 3 and means[-1] - means[0] > 0.1


def test_the_command_writes_a_file_prepare_criteo_reads(tmp_path):
    out = tmp_path / "day_0.gz"
    proc = subprocess.run([sys.executable, "-m", "dev.criteo_file", "--rows", "500", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(out), proc.stderr
    with gzip.open(out, "rt") as f:
        assert f.readlines() == list(criteo_file.lines(500))
    prep = subprocess.run([sys.executable, f"{ROOT}/scripts/prepare_criteo.py", "--train", str(out), "--out",
                           str(tmp_path / "p"), "--hash-rows", "100", "--workers", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["splits"]["train"]["rows"] == 500 and meta["bad_rows"]["total"] == 0
