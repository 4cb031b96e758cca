"""The store's record checksums (trainer/sparse/embedding/store/tier/seal.py): a record changed
behind the run's back (bytes written over rows.bin or log.bin) is reported as a damaged file,
naming it and the record, by every path that reads records from the disk (reads ahead through
io_uring or the threads, a merge's log records, a checkpoint's pieces, an update through the
mapping, a fill), never sealed over; records the run itself writes (pieces, appends, updates
through the mapping, direct write phases) always pass. End to end: random bytes over a running
rank's rows.bin stop it with exit 2, one line naming the file and the checkpoint to continue
from, and that command continues the run."""
from __future__ import annotations

import glob
import os
import re
import subprocess

import numpy as np
import pytest
import torch
from failure_helpers import _env, _popen, _wait_for

from trainer.sparse.embedding.optim import Rounding
from trainer.sparse.embedding.sharding import RowSharding
from trainer.sparse.embedding.store.tier import disk as tier_module
from trainer.sparse.embedding.store.tier import uring
from trainer.sparse.embedding.store.tier.disk import DiskTier
from trainer.sparse.embedding.store.tier.seal import Seal, StoreCorrupt
from trainer.sparse.embedding.store.tiered import TieredStore

FIELDS = [("weight", (5,), torch.float32), ("version", (), torch.int64), ("touched", (), torch.bool)]
N = 20_000


def test_the_sum_catches_any_changed_word_and_passes_zeros():
    seal = Seal(40, 36)
    g = torch.Generator().manual_seed(0)
    records = torch.randint(0, 256, (64, 40), dtype=torch.uint8, generator=g)
    seal.stamp(records)
    assert seal.bad(records).numel() == 0 and seal.bad(torch.zeros(3, 40, dtype=torch.uint8)).numel() == 0
    for byte in range(36):  # any byte but the sum's own, changed by any amount: caught
        for delta in (1, 128, 255):
            r = records.clone()
            r[5, byte] += delta
            assert seal.bad(r).tolist() == [5], (byte, delta)
    swapped = records.clone()
    swapped[7, 0:4], swapped[7, 4:8] = records[7, 4:8], records[7, 0:4]
    assert seal.bad(swapped).tolist() == ([7] if not torch.equal(records[7, 0:4], records[7, 4:8]) else [])
    noise = torch.randint(0, 256, (10_000, 40), dtype=torch.uint8, generator=g)
    assert seal.bad(noise).numel() == 10_000  # random bytes: none passes (2^-32 each)
    words = noise.view(torch.int32).to(torch.int64)  # the int32 arithmetic wraps as the int64 reference does
    want = (words * seal.weights.to(torch.int64)).sum(1) % (1 << 32)
    assert torch.equal(seal.sums(noise).to(torch.int64) % (1 << 32), want)
    with pytest.raises(ValueError, match="whole 4-byte words"):
        Seal(42, 36)


@pytest.fixture(params=["ring", "threads"])
def tier(request, tmp_path, monkeypatch):
    if request.param == "threads":
        monkeypatch.setattr(tier_module, "open_ring", lambda *a: None)
    elif uring.open_ring() is None:
        pytest.skip("io_uring is refused here (the kernel, seccomp or kernel.io_uring_disabled): the threads read")
    t = DiskTier(str(tmp_path), 0, 1 << 16)
    t.define(N, FIELDS, log_rows=3_000)
    rows = torch.arange(0, N, 3)
    t.write(rows, {"weight": torch.randn(rows.numel(), 5), "version": rows})
    t.fill("touched", True, log=True, lo=0, hi=100)
    yield t
    t.close()


def _damage(path: str, record: int, rec: int, nbytes: int = 7) -> None:
    """Random bytes over part of a record, written as another process would (pwrite: the page cache)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, os.urandom(nbytes), record * rec + 3)
    finally:
        os.close(fd)


def _read(tier, rows, log=False):
    futures = tier.prefetch(torch.tensor(rows), log=log)
    tier.ready()
    return torch.cat([f.result() for f in futures])


def test_reads_of_the_files_check_every_record(tier):
    rec = tier.file.row_bytes
    good = _read(tier, [0, 1, 2, 3, 9_999, N - 1])
    assert good.shape == (6, rec) and torch.equal(good, tier.file.tensor[[0, 1, 2, 3, 9_999, N - 1]])
    assert _read(tier, [5, 50], log=True).shape == (2, rec)
    assert tier.read_records(0, N).shape == (N, rec)  # a checkpoint's pieces
    _damage(tier.file.path, 9_999, rec)
    _damage(tier.log_file.path, 50, rec)
    for call in (lambda: _read(tier, [4, 9_999, 12]), lambda: tier.read_records(9_000, 11_000),
                 lambda: tier.check_rows(torch.tensor([9_999])), lambda: tier.fill("touched", False)):
        with pytest.raises(StoreCorrupt, match=r"rows\.bin: record 9999 fails its checksum") as exc:
            call()
        assert exc.value.path == os.path.abspath(tier.file.path)
    with pytest.raises(StoreCorrupt, match=r"log\.bin: record 50 fails its checksum"):
        _read(tier, [49, 50], log=True)
    assert _read(tier, [9_998, 10_000]).shape == (2, rec)  # the neighbours are sound


def test_what_the_run_writes_passes_and_a_reseal_follows_a_write_through_the_mapping(tier):
    rec = tier.file.row_bytes
    weight = tier.alloc("weight", (N, 5), torch.float32)
    weight[100:200] = 4.0  # a direct write phase: through the mapping
    with pytest.raises(StoreCorrupt, match="record 100 .and 99 more"):
        tier.read_records(0, 1_000)
    assert tier.reseal() == 100 and tier.reseal() == 0  # only what changed; a second sweep finds nothing
    tier.fill("weight", 2.0, lo=7, hi=9_000)
    tier.write(torch.tensor([3, 77, 19_999]), {"version": torch.tensor([1, 2, 3])})
    weight[12_000:12_010] = -1.0
    tier.reseal_rows(torch.arange(12_000, 12_010))
    assert tier.read_records(0, N).shape == (N, rec)
    assert _read(tier, [3, 8, 100, 12_005, 19_999]).shape == (5, rec)


def test_a_store_whose_file_is_damaged_refuses_to_train_on_it(tmp_path):
    """TieredStore: a row loaded into the buffer, a row the file serves directly (more rows than
    the buffer holds) and a direct phase all find the damage; before it, the same calls pass."""
    sh = RowSharding([4_000, 1_000], 1, 0)
    tier = DiskTier(str(tmp_path), 0, 1 << 16)
    store = TieredStore(sh, 8, 3, None, "adagrad", 0.05, 1e-8, torch.device("cpu"), 0.1, 0.01, torch.float32,
                        Rounding("nearest", 0), tier=tier, buffer_bytes=40_000)
    try:
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            ids = torch.randint(0, 5_000, (600,), generator=g)
            store.local_rows(ids)
            store.apply(ids, torch.randn(600, 8, generator=g))
        with store.raw(write=True):
            store.weight[10:20] = 1.5  # written through the mapping, resealed before the next read
        store.local_rows(torch.arange(0, 5_000, 7))
        with store.raw(write=False):
            pass
        rec = tier.file.row_bytes
        _damage(tier.file.path, 4_321, rec, nbytes=rec - 8)
        store.local_rows(torch.arange(0, 100))  # not that row: trains on
        with pytest.raises(StoreCorrupt, match=r"rows\.bin: record 4321 fails its checksum"):
            store.local_rows(torch.arange(4_300, 4_400))
    finally:
        tier.close()


def test_random_bytes_over_a_running_ranks_rows_stop_it_naming_the_file_and_the_checkpoint(tmp_path):
    """The issue's probe: random bytes over the running rank's rows.bin. Before, the loss went nan
    ("lower optim.lr?"); now exit 2 and one line naming rows.bin, the record, and the newest
    checkpoint with the command that continues from it, which then runs to the end."""
    store = tmp_path / "store"
    store.mkdir()
    run = _popen(tmp_path, "data=bench", "data.max_table_rows=20000", "optim=adagrad", "embedding.store=disk",
                 f"embedding.store_dir={store}", "embedding.store_cache_bytes=3000000", "checkpoint.every=10",
                 "train.steps=4000", "train.log_every=1000", "train.progress=off", f"hydra.run.dir={tmp_path}/out")
    try:
        _wait_for(run, lambda: glob.glob(str(tmp_path / "out" / "checkpoints" / "step_*" / "manifest.json")),
                  "a first checkpoint", 300)
        rows_bin = glob.glob(str(store / "ht-store-rank0-*" / "rows.bin"))[0]
        size = os.path.getsize(rows_bin)
        rng = np.random.default_rng(0)
        fd = os.open(rows_bin, os.O_WRONLY)
        try:  # a few KiB of noise every ~64 KiB of the file: the next rows read meet it
            for off in range(0, size - 4096, 65_536):
                os.pwrite(fd, rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), off)
        finally:
            os.close(fd)
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 2, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(line) == 1, err[-3000:]
    assert re.search(r"rows\.bin: record \d+ .*fails its checksum", line[0]) and "nan" not in line[0], line[0]
    m = re.search(r"The newest complete checkpoint of this run is (\S+); to continue from it, run: (.+)$", line[0])
    assert m and os.path.isdir(m.group(1)), line[0]
    saved = int(re.search(r"step_(\d+)", m.group(1)).group(1))
    assert "train.steps=4000" in m.group(2), m.group(2)
    command = m.group(2).replace("train.steps=4000", f"train.steps={saved + 10}")
    done = subprocess.run(command, shell=True, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_file_system_that_cannot_reserve_is_said_once(tmp_path, monkeypatch, capsys):
    """Where fallocate is refused the files stay sparse and a full disk would stop the run at a
    later write: the start says so, once, naming the store_dir."""
    from trainer.sparse.embedding.store.tier import records
    monkeypatch.setattr(records, "_reserve", lambda *a: False)
    t = DiskTier(str(tmp_path), 3, 1 << 16)
    try:
        t.define(1_000, FIELDS, log_rows=100)
    finally:
        t.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not reserve blocks" in err[0] and str(tmp_path) in err[0] and "rank 3" in err[0], err
