"""Criteo preprocessing on the suite's Criteo-format sample (outputs in tmp_path): bad-row
counts and line numbers, --strict, round trip against a plain per-line parser, both encodings,
resume per file, gzip input, and the trainer's errors for a missing or unprepared data.dir."""
from __future__ import annotations

import collections
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_helpers import N_TRAIN, prepare_sample, sample_lines, write_lines
from helpers import make_cfg
from trainer.base.config import ConfigError
from trainer.run.resolve.configure import load_config
from trainer.workload.data.criteo import NUM_CAT, from_block, parse_chunk, parse_line
from trainer.workload.data.prepare import PrepOptions, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "prepare_criteo.py")
M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """Plain-Python splitmix64, independent of the numpy implementation under test."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def hash_id(value: int | None, t: int, rows: int) -> int:
    return 0 if value is None else 1 + splitmix64(value ^ splitmix64(t + 1)) % (rows - 1)


def _with_bad_rows(lines: list[str]) -> tuple[list[str], dict[int, str]]:
    """A copy of the sample with malformed rows inserted; {1-based line: reason kind}."""
    def field(line: str, i: int, value: str) -> str:
        f = line.rstrip("\n").split("\t")
        f[i] = value
        return "\t".join(f) + "\n"

    bad = {3: ("field_count", lines[0].rsplit("\t", 1)[0] + "\n"),  # 39 fields
           10: ("label", field(lines[1], 0, "2")),
           57: ("dense", field(lines[2], 3, "1.5")),
           58: ("dense", field(lines[2], 13, "abc")),
           400: ("categorical", field(lines[3], 20, "zz12")),
           401: ("categorical", field(lines[3], 39, "0123456789abcdef0")),  # 17 hex digits
           1200: ("field_count", "\n"),
           1900: ("label", field(lines[4], 0, ""))}
    out = list(lines)
    for line_no in sorted(bad):
        out.insert(line_no - 1, bad[line_no][1])
    return out, {k: v[0] for k, v in bad.items()}


def _decode(directory: str, meta: dict, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = [from_block(np.load(os.path.join(directory, b["file"]))) for b in meta["splits"][split]["blocks"]]
    return tuple(np.concatenate([b[i] for b in blocks]) for i in range(3))


def test_bad_rows_counted_with_line_numbers_and_round_trip(tmp_path):
    """CLI with 2 workers and small chunks: bad rows skipped, counted by reason, their exact line
    numbers in meta.json and on screen; decoded rows equal the directly parsed good rows."""
    lines, bad = _with_bad_rows(sample_lines())
    lines[-1] = lines[-1].rstrip("\n")  # last line without newline
    src = write_lines(str(tmp_path / "bad.tsv"), lines)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--train", src, "--out", str(out), "--workers", "2",
                           "--chunk-mb", "0.03", "--hash-rows", "5000", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert len(meta["splits"]["train"]["blocks"]) > 4  # several chunks, so line numbers cross chunks
    assert meta["bad_rows"]["total"] == len(bad)
    assert meta["bad_rows"]["by_reason"] == dict(collections.Counter(bad.values()))
    assert [(b["line"], b["reason"].split(":")[0]) for b in meta["bad_rows"]["first"]] == sorted(bad.items())
    for line_no in bad:
        assert f"bad.tsv:{line_no}:" in proc.stderr + proc.stdout
    assert f"bad rows skipped: {len(bad)}" in proc.stdout
    good = [ln for i, ln in enumerate(lines, 1) if i not in bad]
    assert meta["splits"]["train"]["rows"] == len(good) == 1999
    labels, dense, ids = _decode(str(out), meta, "train")
    for i in range(0, len(good), 37):
        label, x, cats = parse_line(good[i])
        assert labels[i] == label and np.array_equal(dense[i], np.float32(x)), i
        assert ids[i].tolist() == [hash_id(v, t, 5000) for t, v in enumerate(cats)], i


def test_strict_fails_at_first_bad_row_with_line_number(tmp_path):
    lines, bad = _with_bad_rows(sample_lines())
    src = write_lines(str(tmp_path / "bad.tsv"), lines)
    proc = subprocess.run([sys.executable, SCRIPT, "--train", src, "--out", str(tmp_path / "o"), "--strict",
                           "--workers", "2", "--chunk-mb", "0.03", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"bad.tsv:{min(bad)}: bad row: field_count" in proc.stderr, proc.stderr
    assert not (tmp_path / "o" / "meta.json").exists()


def test_vectorised_parser_matches_plain_parser_on_every_row():
    lines = sample_lines()
    p = parse_chunk("".join(lines).encode())
    assert p.num_lines == len(lines) and p.bad_lines.size == 0
    for i, line in enumerate(lines):
        label, dense, cats = parse_line(line)
        assert p.labels[i] == label and np.array_equal(p.dense[i], np.float32(dense))
        assert [None if e else int(v) for v, e in zip(p.cats[i], p.empty[i])] == cats


def test_vocabulary_mode_min_count(tmp_path):
    """ids: 0 empty, 1 for values seen < min_count times in train, 2 + rank in the sorted vocabulary;
    the test split uses the training vocabulary."""
    meta = prepare_sample(str(tmp_path), hash_rows=None, min_count=3)
    lines = sample_lines()
    rows = [parse_line(ln)[2] for ln in lines]
    counts = [collections.Counter(r[t] for r in rows[:N_TRAIN] if r[t] is not None) for t in range(NUM_CAT)]
    vocab = [sorted(v for v, c in counts[t].items() if c >= 3) for t in range(NUM_CAT)]
    assert meta["table_rows"] == [2 + len(v) for v in vocab]
    index = [{v: 2 + i for i, v in enumerate(vocab[t])} for t in range(NUM_CAT)]
    want = np.array([[0 if v is None else index[t].get(v, 1) for t, v in enumerate(r)] for r in rows])
    d = str(tmp_path / "prepared")
    assert np.array_equal(_decode(d, meta, "train")[2], want[:N_TRAIN])
    assert np.array_equal(_decode(d, meta, "test")[2], want[N_TRAIN:])


def test_resume_skips_finished_files_and_gzip_input(tmp_path):
    lines = sample_lines()
    a = write_lines(str(tmp_path / "day_0"), lines[:1000])
    b = str(tmp_path / "day_1.gz")
    with gzip.open(b, "wt") as f:
        f.writelines(lines[1000:])
    opt = PrepOptions(out=str(tmp_path / "o"), train=[a, b], hash_rows=[100] * NUM_CAT, chunk_mb=0.05,
                      progress=False)
    first = prepare(opt)
    assert first["splits"]["train"]["rows"] == len(lines)
    marker = tmp_path / "o" / "progress" / "train-000.json"
    stamp = marker.stat().st_mtime_ns
    (tmp_path / "o" / "progress" / "train-001.json").unlink()  # as if interrupted during day_1
    again = prepare(opt)
    assert marker.stat().st_mtime_ns == stamp  # day_0 not redone
    assert again["splits"] == first["splits"]
    ids = _decode(str(tmp_path / "o"), again, "train")[2]
    assert ids[-1].tolist() == [hash_id(v, t, 100) for t, v in enumerate(parse_line(lines[-1])[2])]
    with pytest.raises(Exception, match="other options"):
        prepare(PrepOptions(out=opt.out, train=[a, b], hash_rows=[99] * NUM_CAT, progress=False))


def test_trainer_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.dir=None"):
        load_config(make_cfg(["data=criteo"]))
    with pytest.raises(ConfigError, match=r"data\.dir=.*meta\.json is missing"):
        load_config(make_cfg(["data=criteo", f"data.dir={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"data\.dir=.*not a directory"):
        load_config(make_cfg(["data=criteo", f"data.dir={tmp_path / 'nope'}"]))
    prepare_sample(str(tmp_path))
    d = tmp_path / "prepared"
    c = load_config(make_cfg(["data=criteo", f"data.dir={d}", "data.min_count=0"]))  # the tables as stored
    assert c.data.table_rows == [1000] * NUM_CAT and c.data.num_dense == 13
    with pytest.raises(ConfigError, match=r"data\.table_rows=\[5, 5\]"):
        load_config(make_cfg(["data=criteo", f"data.dir={d}", "data.table_rows=[5,5]"]))
    with pytest.raises(ConfigError, match=r"data\.loader='x'"):
        load_config(make_cfg(["data=criteo", f"data.dir={d}", "data.loader=x"]))
    with pytest.raises(ConfigError, match=r"data\.dir=.*lacks ml-100k\.inter"):
        load_config(make_cfg(["data=movielens", f"data.dir={tmp_path}"]))
