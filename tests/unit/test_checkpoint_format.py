"""The checkpoint's shard format (trainer/run/checkpoint/shard_io.py): rows, versions and optimizer state
reach their new owners at any W; a save and a load hold one piece of the shard at a time, never the
whole of it; a reader at W' = 2^m W reads 1 / 2^m of one shard, at a divisor of W the shards it takes
over, at the same W its own; a damaged block is found by the reader that reads it; checkpoints of
format 1 (one pickled file per shard) still load.

The row order within a table segment (q by its bit-reversed binary form) is checked against a plain
sort for many segment sizes."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import trainer.run.checkpoint as ckpt
from trainer.run.checkpoint import row_order, shard_io
from trainer.run.checkpoint.manifest import write_file
from trainer.sparse.embedding import RowSharding, ShardStore

ROWS = [97, 1001, 13, 250, 2]
DIM = 4


def _stores(world: int, optimizer: str, dtype: torch.dtype = torch.float32) -> list[ShardStore]:
    out = [ShardStore(RowSharding(ROWS, world, r), DIM, 0, None, optimizer, 0.1, 1e-10, torch.device("cpu"), 0.1)
           for r in range(world)]
    for s in out:
        s.weight = s.weight.to(dtype)
    return out


def _randomise(stores: list[ShardStore]) -> None:
    for s in stores:  # every row its own weight, version and state
        s.weight.uniform_()
        s.version.random_(0, 1000)
        for v in s.optimizer.state_tensors().values():
            v.uniform_()


def _by_key(stores: list[ShardStore]) -> dict[str, torch.Tensor]:
    """Every real row of the stores, ordered by (table, id): weight, version, optimizer state."""
    parts: dict[str, list[torch.Tensor]] = {}
    keys = []
    for s in stores:
        sh = s.sharding
        gids = sh.local_gids()
        real = torch.nonzero(sh.valid(gids)).flatten()
        table, ids = sh.decode(gids[real])
        keys.append(torch.tensor([0] + ROWS).cumsum(0)[table] + ids)
        for name, t in [("weight", s.weight), ("version", s.version), *s.optimizer.state_tensors().items()]:
            parts.setdefault(name, []).append(t.index_select(0, real))
    order = torch.argsort(torch.cat(keys))
    return {k: torch.cat(v)[order] for k, v in parts.items()}


def _save(stores: list[ShardStore], root) -> tuple[str, dict]:
    """What a save writes of the shards (no trainer file): the directories and their manifest part."""
    world = len(stores)
    shards = {shard_io.shard_dir(r, world): shard_io.write_shard(str(root / shard_io.shard_dir(r, world)), s)
              for r, s in enumerate(stores)}
    return str(root), {"world_size": world, "table_rows": ROWS, "shards": shards}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 100, 1023, 1024, 1025])
def test_the_row_order_is_q_sorted_by_its_reversed_bits(n):
    bits = row_order.order_bits(n)
    rev = [int(row_order.bit_reverse(np.array([q]), bits)[0]) if bits else 0 for q in range(n)]
    want = np.array(sorted(range(n), key=lambda q: rev[q]))
    assert (row_order.q_in_order(n, 0, n) == want).all()
    for start, count in ((1, 3), (n // 2, n), (n - 1, 5)):
        assert (row_order.q_in_order(n, start, count) == want[start:start + count]).all()
    for m in range(0, 12):
        for c in range(min(1 << m, 20)):
            lo, hi = row_order.q_range(n, m, c)
            assert sorted(want[lo:hi].tolist()) == [q for q in range(n) if q % (1 << m) == c % (1 << m)]


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (2, 1), (1, 3), (1, 4), (2, 4), (4, 2), (4, 1), (3, 3)])
def test_rows_versions_and_state_reach_their_new_owners(tmp_path, old, new, optimizer):
    torch.manual_seed(old * 10 + new)
    before = _stores(old, optimizer)
    _randomise(before)
    path, manifest = _save(before, tmp_path)
    after = _stores(new, optimizer)
    read = []
    for s in after:
        counter = {"bytes_read": 0}
        assert shard_io.read_shards(path, manifest, s, counter) == int(s.sharding.valid(s.sharding.local_gids()).sum())
        read.append(counter["bytes_read"])
    want, got = _by_key(before), _by_key(after)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    model = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs if f.endswith(".bin"))
    if new % old == 0 or old % new == 0:  # 2^m W or a divisor: every byte read once by one reader
        assert sum(read) <= model + new * len(ROWS) * 3 * 2 * shard_io.BLOCK  # block ends of each range


def test_half_precision_rows_round_trip(tmp_path):
    before = _stores(2, "rowwise_adagrad", torch.bfloat16)
    _randomise(before)
    path, manifest = _save(before, tmp_path)
    assert manifest["shards"][shard_io.shard_dir(0, 2)]["fields"]["weight"]["dtype"] == "<u2"
    after = _stores(1, "rowwise_adagrad", torch.bfloat16)
    shard_io.read_shards(path, manifest, after[0], {"bytes_read": 0})
    assert torch.equal(_by_key(before)["weight"], _by_key(after)["weight"])


def test_a_reader_at_twice_the_world_reads_half_a_shard(tmp_path, monkeypatch):
    """A table big enough that the blocks at range ends do not count: W = 2 saved, read at 4."""
    monkeypatch.setattr(shard_io, "BLOCK", 4096)
    monkeypatch.setitem(globals(), "ROWS", [200_000, 3_001])
    before = _stores(2, "adagrad")
    _randomise(before)
    path, manifest = _save(before, tmp_path)
    shard = sum(v["bytes"] for v in manifest["shards"][shard_io.shard_dir(0, 2)]["fields"].values())
    for s in _stores(4, "adagrad"):
        counter = {"bytes_read": 0}
        shard_io.read_shards(path, manifest, s, counter)
        assert counter["bytes_read"] <= 0.51 * shard + 2 * 4 * 4096, (counter, shard)  # ~1/2 of one shard


def test_save_and_load_hold_one_piece_never_the_shard(tmp_path, monkeypatch):
    """A shard many times larger than the piece: no write and no read is ever handed more than a
    piece (+ the blocks at its ends): the save does not materialise the shard, nor does the load."""
    monkeypatch.setattr(shard_io, "PIECE_BYTES", 2048)
    monkeypatch.setattr(shard_io, "BLOCK", 512)
    largest = {"write": 0, "read": 0}
    real_write, real_read = shard_io._HashedWriter.write, shard_io.VerifiedFile.read

    def write(self, data):
        largest["write"] = max(largest["write"], len(data))
        return real_write(self, data)

    def read(self, lo, hi):
        largest["read"] = max(largest["read"], hi - lo)
        return real_read(self, lo, hi)

    monkeypatch.setattr(shard_io._HashedWriter, "write", write)
    monkeypatch.setattr(shard_io.VerifiedFile, "read", read)
    before = _stores(1, "adagrad")
    _randomise(before)
    path, manifest = _save(before, tmp_path)
    shard = sum(v["bytes"] for v in manifest["shards"][shard_io.shard_dir(0, 1)]["fields"].values())
    assert shard > 20 * 2048 and 0 < largest["write"] <= 2048
    after = _stores(1, "adagrad")
    shard_io.read_shards(path, manifest, after[0], {"bytes_read": 0})
    assert 0 < largest["read"] <= 2048
    assert torch.equal(_by_key(before)["weight"], _by_key(after)["weight"])


def test_a_damaged_block_is_found_by_its_reader(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_io, "BLOCK", 1024)
    before = _stores(2, "sgd")
    _randomise(before)
    path, manifest = _save(before, tmp_path)
    f = os.path.join(path, shard_io.shard_dir(1, 2), "weight.bin")
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(f, "wb").write(bytes(data))
    shard_io.read_shards(path, manifest, _stores(4, "sgd")[0], {"bytes_read": 0})  # reads shard 0 only
    with pytest.raises(ckpt.CheckpointError, match=r"weight.bin fails its checksum \(corrupt or truncated\) in bytes"):
        shard_io.read_shards(path, manifest, _stores(2, "sgd")[1], {"bytes_read": 0})
    open(f, "wb").write(bytes(data[:-10]))  # truncated: found before any row is read
    with pytest.raises(ckpt.CheckpointError, match=r"weight.bin fails its checksum \(corrupt or truncated\)"):
        shard_io.read_shards(path, manifest, _stores(1, "sgd")[0], {"bytes_read": 0})


def _v1_shard(store: ShardStore) -> dict:
    """Format 1's shard file content: the real rows keyed by (table, id), with versions and state."""
    s = store.sharding
    at = torch.nonzero(s.valid(s.local_gids())).flatten()
    table, ids = s.decode(s.local_gids()[at])
    return {"table": table, "id": ids, "weight": store.weight[at], "version": store.version[at],
            "optim": {k: v[at] for k, v in store.optimizer.state_tensors().items()}}


def test_format_1_checkpoints_still_load(tmp_path):
    """A checkpoint of the previous format (pickled shards, every rank reads every shard) resumes."""
    before = _stores(2, "adagrad")
    _randomise(before)
    root = tmp_path / "step_00000003"
    root.mkdir()
    files = {}
    for r, s in enumerate(before):
        files[ckpt.shard_file(r, 2)] = write_file(str(root / ckpt.shard_file(r, 2)), _v1_shard(s))
    files[ckpt.TRAINER_FILE] = write_file(str(root / ckpt.TRAINER_FILE), {"step": 3})
    (root / ckpt.MANIFEST).write_text(json.dumps({
        "format_version": 1, "step": 3, "world_size": 2, "table_rows": ROWS, "dim": DIM, "model": "dlrm",
        "optim_sparse": "adagrad", "optim_dense": "adam", "files": files}))
    after = _stores(3, "adagrad")
    schema = {"table_rows": ROWS, "dim": DIM, "model": "dlrm", "optim_sparse": "adagrad", "optim_dense": "adam"}
    from trainer.base.comm import LocalCollectives
    for s in after:
        assert ckpt.load(LocalCollectives(10), str(root), s, schema)["step"] == 3
    want, got = _by_key(before), _by_key(after)
    for k in want:
        assert torch.equal(want[k], got[k]), k
