"""Bad data is one clear error (exit 2, naming the file), never a traceback: damaged gzip input, an
unusable or unrelated --out, a preparation where no row survives, dense integers too long to be
one, prepared block files missing or cut short (found at start-up, or by the reader while
training, DALI and memmap). A re-run of the preparation judges "finished before" by size and
modification time, so an input edited in place is encoded again."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import N_TRAIN, sample_lines, write_lines
from failure_helpers import ROOT, _env
from helpers import make_cfg

from trainer.run.resolve.configure import load_config as to_config
from trainer.workload.data import make_data
from trainer.workload.data.blocks import memmap_reader
from trainer.workload.data.criteo import NUM_CAT, CriteoFormatError, parse_chunk
from trainer.workload.data.prepare import PrepOptions, prepare

SCRIPT = os.path.join(ROOT, "scripts", "prepare_criteo.py")


def _script():
    spec = importlib.util.spec_from_file_location("prepare_criteo_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prep(capsys, *argv: str) -> tuple[int, str]:
    """scripts/prepare_criteo.py's main(argv) in this process: (exit status, stderr)."""
    capsys.readouterr()
    code = _script().main(["--hash-rows", "100", "--chunk-mb", "0.05", "--workers", "1", "--no-progress", *argv])
    return code, capsys.readouterr().err


def _gz(path, lines: list[str]) -> str:
    with gzip.open(path, "wt") as f:
        f.writelines(lines)
    return str(path)


def _flip_labels(path: str) -> None:
    """Flip every label in place: same size, other content."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        starts = [0] + [i + 1 for i, c in enumerate(data[:-1]) if c == 10]
        for i in starts:
            data[i] = ord("1") if data[i] == ord("0") else ord("0")
        f.seek(0)
        f.write(bytes(data))


def _damaged(prepared: str, tmp_path, how: str) -> tuple[str, str]:
    """A copy of the prepared dir with one training block removed or cut short: (dir, file)."""
    d = str(tmp_path / "p")
    shutil.copytree(prepared, d)
    meta = json.load(open(os.path.join(d, "meta.json")))
    block = os.path.join(d, meta["splits"]["train"]["blocks"][1]["file"])
    if how == "missing":
        os.remove(block)
    else:
        with open(block, "r+b") as f:
            f.truncate(os.path.getsize(block) - 400)
    return d, block


@pytest.mark.parametrize("damage,needle", [
    ("truncated", "is truncated (the compressed stream ends early)"),
    ("corrupt", "holds corrupt gzip data"),
    ("plain", "is not gzip data (plain text named .gz?"),
])
def test_damaged_gzip_input_is_a_clear_error(tmp_path, capsys, damage, needle):
    lines = sample_lines()
    path = tmp_path / "day_0.gz"
    if damage == "plain":
        write_lines(str(path), lines)
    else:
        data = bytearray(open(_gz(path, lines * 3), "rb").read())
        if damage == "truncated":
            data = data[: len(data) // 2]
        else:
            for i in range(len(data) // 3, len(data) // 3 + 64):
                data[i] ^= 0x5A
        path.write_bytes(bytes(data))
    code, err = _prep(capsys, "--train", str(path), "--out", str(tmp_path / "o"))
    last = err.strip().splitlines()[-1]  # (garbage decoded before the damage shows as bad rows)
    assert code == 2 and last.startswith(f"error: {path} {needle}"), err[-2000:]
    assert not (tmp_path / "o" / "meta.json").exists()
    if damage == "truncated":  # the blocks before the damage stay for the re-run
        assert os.listdir(tmp_path / "o" / "train")


def test_script_exit_status_and_no_traceback(tmp_path):
    """The real command line: a truncated .gz exits 2 with one error line."""
    path = tmp_path / "t.gz"
    path.write_bytes(open(_gz(tmp_path / "x.gz", sample_lines()), "rb").read()[:2000])
    proc = subprocess.run([sys.executable, SCRIPT, "--train", str(path), "--out", str(tmp_path / "o"),
                           "--no-progress"], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: {path} is truncated")


def test_out_that_is_a_file_or_read_only_is_a_clear_error(tmp_path, capsys, read_only_path):
    train = write_lines(str(tmp_path / "train.tsv"), sample_lines()[:100])
    (tmp_path / "file").write_text("x")
    code, err = _prep(capsys, "--train", train, "--out", str(tmp_path / "file"))
    assert code == 2 and err == f"error: --out {tmp_path / 'file'} exists and is not a directory\n", err
    for out in (read_only_path / "new", read_only_path / "inside"):
        code, err = _prep(capsys, "--train", train, "--out", str(out))
        assert code == 2 and err.startswith(f"error: --out {out} is not writable: ") \
            and "Read-only file system" in err, err


def test_out_into_an_unrelated_non_empty_dir_is_refused(tmp_path, capsys):
    """A directory that is not a prepared dir keeps its files; a prepared dir of the same inputs
    is reused (resume) and one of other options is refused."""
    train = write_lines(str(tmp_path / "train.tsv"), sample_lines()[:300])
    out = tmp_path / "mine"
    (out / "train").mkdir(parents=True)
    (out / "meta.json").write_text("precious")
    (out / "train" / "b000-00000.npy").write_text("precious too")
    code, err = _prep(capsys, "--train", train, "--out", str(out))
    assert code == 2 and "is not empty (meta.json, train) and is not a directory prepared by this script" in err
    assert (out / "meta.json").read_text() == "precious"
    assert (out / "train" / "b000-00000.npy").read_text() == "precious too"
    fresh = tmp_path / "fresh"
    assert _prep(capsys, "--train", train, "--out", str(fresh))[0] == 0
    code, err = _prep(capsys, "--train", train, "--out", str(fresh))
    assert code == 0 and "finished in an earlier run" in err
    code, err = _prep(capsys, "--train", train, "--out", str(fresh), "--chunk-mb", "0.1")
    assert code == 2 and "was prepared with other options or training files" in err


def test_no_surviving_row_is_an_error(tmp_path, capsys):
    bad = ["1\t2\t3\n"] * 5 + ["x" + line for line in sample_lines()[:5]]
    train = write_lines(str(tmp_path / "train.tsv"), bad)
    code, err = _prep(capsys, "--train", train, "--out", str(tmp_path / "o"))
    err = err.strip().splitlines()[-1]  # after the bad-row notes
    assert code == 2, err
    assert err.startswith("error: no row of the train files") and "10 bad rows (field_count: 5, label: 5)" in err
    assert f"{train}:1: field_count" in err and "meta.json was not written" in err
    assert not (tmp_path / "o" / "meta.json").exists()
    empty = write_lines(str(tmp_path / "empty.tsv"), [])
    code, err = _prep(capsys, "--train", empty, "--out", str(tmp_path / "o2"))
    assert code == 2 and "the files are empty" in err


def test_failed_preparation_leaves_the_out_dir_as_it_was(tmp_path, capsys):
    """An empty input or one where every row is bad leaves no layout behind: a new --out (and the
    parents it needed) is removed, an empty one stays empty, so the same --out takes other inputs
    afterwards; a failure after blocks were written keeps them for the re-run (resume)."""
    empty = write_lines(str(tmp_path / "empty.tsv"), [])
    bad = write_lines(str(tmp_path / "bad.tsv"), ["1\t2\t3\n"] * 5)
    good = write_lines(str(tmp_path / "good.tsv"), sample_lines()[:200])
    (tmp_path / "made").mkdir()
    for out in (tmp_path / "new" / "deeper", tmp_path / "made"):
        for train in (empty, bad):
            code, err = _prep(capsys, "--train", train, "--out", str(out))
            assert code == 2 and err.strip().splitlines()[-1].startswith("error: no row of the train files"), err
            assert not (tmp_path / "new").exists() if out.name == "deeper" else os.listdir(out) == []
        assert _prep(capsys, "--train", good, "--out", str(out))[0] == 0
    with pytest.raises(CriteoFormatError, match="no row of the train files"):  # vocabulary: counted first
        prepare(PrepOptions(out=str(tmp_path / "vocab"), train=[bad], min_count=1, progress=False))
    assert not (tmp_path / "vocab").exists()
    code, err = _prep(capsys, "--train", good, "--test", bad, "--out", str(tmp_path / "half"))
    assert code == 2 and "no row of the test files" in err and os.listdir(tmp_path / "half" / "train")
    code, err = _prep(capsys, "--train", good, "--test", good, "--out", str(tmp_path / "half"))
    assert code == 0 and "finished in an earlier run" in err


@pytest.mark.parametrize("suffix", [".tsv", ".gz"])
def test_utf8_byte_order_mark_is_skipped(tmp_path, suffix):
    """A file that starts with a UTF-8 BOM (plain or inside the .gz) keeps its first row: the same
    blocks as the file without it."""
    lines = sample_lines()[:50]
    plain = write_lines(str(tmp_path / "plain.tsv"), lines)
    path = tmp_path / f"bom{suffix}"
    data = b"\xef\xbb\xbf" + "".join(lines).encode()
    path.write_bytes(gzip.compress(data) if suffix == ".gz" else data)
    metas = [prepare(PrepOptions(out=str(tmp_path / name), train=[f], hash_rows=[100] * NUM_CAT, progress=False))
             for name, f in (("a", plain), ("b", str(path)))]
    assert metas[1]["splits"]["train"]["rows"] == 50 and metas[1]["bad_rows"]["total"] == 0
    blocks = [np.load(str(tmp_path / name / m["splits"]["train"]["blocks"][0]["file"]))
              for name, m in zip("ab", metas)]
    assert np.array_equal(blocks[0], blocks[1])


def test_directory_given_as_an_input_is_named_as_one(tmp_path, capsys):
    train = write_lines(str(tmp_path / "train.tsv"), sample_lines()[:100])
    for args, option in ((["--train", str(tmp_path)], "--train"), (["--train", train, "--test", str(tmp_path)], "--test")):
        code, err = _prep(capsys, *args, "--out", str(tmp_path / "o"))
        assert code == 2 and err == f"error: {option} {str(tmp_path)!r} is a directory, not a file: name the files " \
            f"in it (e.g. {option} {tmp_path / 'day_0.gz'} ...)\n", err
    code, err = _prep(capsys, "--train", str(tmp_path / "nope.tsv"), "--out", str(tmp_path / "o"))
    assert code == 2 and err == f"error: --train input file {str(tmp_path / 'nope.tsv')!r} does not exist\n"
    assert not (tmp_path / "o").exists()


def test_input_edited_in_place_with_the_same_size_is_redone(tmp_path):
    """Hashing: a training or test file whose labels were flipped in place (same size) is encoded
    again, so meta.json counts the new positives; a vocabulary run refuses (its vocabulary was
    counted on the old content)."""
    lines = sample_lines()
    train = write_lines(str(tmp_path / "train.tsv"), lines[:N_TRAIN])
    test = write_lines(str(tmp_path / "test.tsv"), lines[N_TRAIN:])
    opt = PrepOptions(out=str(tmp_path / "o"), train=[train], test=[test], hash_rows=[100] * NUM_CAT,
                      chunk_mb=0.05, progress=False)
    first = prepare(opt)
    size = os.path.getsize(train)
    _flip_labels(train)
    _flip_labels(test)
    assert os.path.getsize(train) == size
    again = prepare(opt)
    for split in ("train", "test"):
        m1, m2 = first["splits"][split], again["splits"][split]
        assert m2["rows"] == m1["rows"] and m2["positives"] == m1["rows"] - m1["positives"], split
    blocks = np.concatenate([np.load(os.path.join(opt.out, b["file"])) for b in again["splits"]["train"]["blocks"]])
    assert int(blocks[:, 0].sum()) == again["splits"]["train"]["positives"]

    vocab = PrepOptions(out=str(tmp_path / "v"), train=[train], min_count=2, chunk_mb=0.05, progress=False)
    prepare(vocab)
    _flip_labels(train)
    with pytest.raises(CriteoFormatError, match="other options or training files"):
        prepare(vocab)


def test_dense_integers_of_19_digits_are_reported_as_out_of_range():
    f = sample_lines()[0].rstrip("\n").split("\t")
    rows = []
    for i, v in ((3, "1234567890123456789"), (5, "-99999999999999999999999"), (2, "12345678901234567x9")):
        g = list(f)
        g[i] = v
        rows.append("\t".join(g) + "\n")
    p = parse_chunk("".join(rows + [sample_lines()[0]]).encode())
    assert p.bad_reasons == ["dense: field I3 is an integer of more than 18 digits (out of range)",
                             "dense: field I5 is an integer of more than 18 digits (out of range)",
                             "dense: field I2 is not an integer"]
    assert p.labels.size == 1
    g = list(f)
    g[1] = "999999999999999999"  # 18 digits: still an integer
    assert parse_chunk(("\t".join(g) + "\n").encode()).labels.size == 1


@pytest.mark.parametrize("loader", ["dali", "memmap"])
@pytest.mark.parametrize("how,needle", [("missing", "is missing"), ("truncated", "is truncated")])
def test_damaged_block_file_is_named_at_start(prepared, tmp_path, loader, how, needle):
    d, block = _damaged(prepared, tmp_path, how)
    over = ["data=criteo", f"data.dir={d}", f"data.loader={loader}", "data.batch_size=64"]
    with pytest.raises(CriteoFormatError, match=f"block file {block} {needle}"):  # the config's vocabulary
        to_config(make_cfg(over))
    cfg = to_config(make_cfg(over + ["data.min_count=0"]))  # no vocabulary: the data source finds it
    with pytest.raises(CriteoFormatError, match=f"block file {block} {needle}"):
        make_data(cfg, 0, 1)
    if how == "truncated":  # re-running prepare repairs it, as the message says
        meta = json.load(open(os.path.join(d, "meta.json")))
        prepare(PrepOptions(**{**meta["options"], "out": d, "progress": False}))
        make_data(to_config(make_cfg(over)), 0, 1)


@pytest.mark.parametrize("loader", ["dali", "memmap"])
def test_block_damaged_while_training_names_the_file(prepared, tmp_path, loader):
    """After start-up checks passed: the reader's own failure names the file."""
    d, block = _damaged(prepared, tmp_path, "truncated")
    meta = json.load(open(os.path.join(d, "meta.json")))
    files = [os.path.join(d, b["file"]) for b in meta["splits"]["train"]["blocks"]]
    if loader == "dali":
        from trainer.workload.data.dali import dali_reader
        reader = dali_reader(13)
    else:
        reader = memmap_reader(13)
    with pytest.raises(CriteoFormatError, match=f"{block}"):
        for _ in zip(range(len(files)), reader(files, 0, 1)):
            pass


def test_cli_on_a_truncated_block_exits_2(prepared, tmp_path):
    d, block = _damaged(prepared, tmp_path, "truncated")
    proc = subprocess.run([sys.executable, "-m", "trainer", "data=criteo", f"data.dir={d}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: data.dir={d!r}: block file {block} is truncated" in proc.stderr
