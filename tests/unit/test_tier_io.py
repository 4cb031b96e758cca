"""The tier's sequential pieces (trainer/sparse/embedding/store/tier/records.py) against the mapping: records read,
set and filled around it, in pieces of a few record units (the piece size shrunk, so that every
range crosses many pieces and ends mid-page), equal what indexing the mapped tensors gives."""
from __future__ import annotations

import pytest
import torch

from trainer.sparse.embedding.store.tier import records as tier_io
from trainer.sparse.embedding.store.tier.disk import DiskTier
from trainer.sparse.embedding.store.tier.records import record_unit

N = 10_007  # records of 40 B (weight 5 x fp32, state fp32, version int64, touched; padded): a record unit is 5 pages
FIELDS = [("weight", (5,), torch.float32), ("state", (), torch.float32), ("version", (), torch.int64),
          ("touched", (), torch.bool)]


@pytest.fixture
def tier(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_io, "APPEND_BYTES", 2 * record_unit(40))  # pieces of two record units
    t = DiskTier(str(tmp_path), 0, 1 << 16)
    t.define(N, FIELDS, log_rows=2_100)
    yield t
    t.close()


def _arrays(tier):
    return {name: tier.alloc(name, (N,) + shape, dtype) for name, shape, dtype in FIELDS}


def _random_fill(tier, arrays, seed=0):
    g = torch.Generator().manual_seed(seed)
    arrays["weight"][:] = torch.randn(N, 5, generator=g)
    arrays["state"][:] = torch.rand(N, generator=g)
    arrays["version"][:] = torch.randint(0, 1 << 40, (N,), generator=g)
    arrays["touched"][:] = torch.rand(N, generator=g) < 0.5
    assert tier.reseal() == N  # written through the mapping: every record's sum made current
    return {k: v.clone() for k, v in arrays.items()}


def test_read_records_equals_the_mapped_records(tier):
    arrays = _arrays(tier)
    _random_fill(tier, arrays)
    assert tier.file.row_bytes == 40 and len(tier._io_buf) == 2 * record_unit(40)
    for lo, hi in [(0, N), (0, 1), (N - 1, N), (17, 18), (73, 9_950), (1_000, 1_000), (512, 1_537), (1_024, 2_048)]:
        got = tier.read_records(lo, hi)
        assert got.shape == (hi - lo, 40)
        assert torch.equal(got, tier.file.tensor[lo:hi]), (lo, hi)
        assert torch.equal(tier.view(got, "weight", arrays["weight"]), arrays["weight"][lo:hi])
    assert tier.mapped_bytes == 0


def test_write_sets_the_fields_given_and_keeps_the_others(tier):
    arrays = _arrays(tier)
    want = _random_fill(tier, arrays)
    g = torch.Generator().manual_seed(1)
    for rows in (torch.arange(N), torch.sort(torch.randperm(N, generator=g)[:1_500]).values,
                 torch.tensor([0, 1, 2, N - 1]), torch.tensor([1_234]), torch.arange(600, 9_900, 3)):
        w, v = torch.randn(rows.numel(), 5, generator=g), torch.randint(0, 99, (rows.numel(),), generator=g)
        tier.write(rows, {"weight": w, "version": v})
        want["weight"][rows], want["version"][rows] = w, v
        for name, a in arrays.items():
            assert torch.equal(a, want[name]), name
    assert tier.mapped_bytes == 0
    tier.write(torch.zeros(0, dtype=torch.int64), {"weight": torch.zeros(0, 5)})  # nothing: nothing done
    assert torch.equal(arrays["weight"], want["weight"])


def test_write_after_a_change_through_the_mapping_sees_it(tier):
    """A page changed through the mapping and still mapped: the piece's read sees the change (the
    mapping is unmapped first and the kernel writes dirty pages back before a direct read), and the
    mapped view sees the piece's write."""
    arrays = _arrays(tier)
    want = _random_fill(tier, arrays)
    arrays["state"][10:20] = 5.0
    want["state"][10:20] = 5.0
    tier.write(torch.tensor([12, 15]), {"weight": torch.ones(2, 5)})
    want["weight"][[12, 15]] = 1.0
    for name, a in arrays.items():
        assert torch.equal(a, want[name]), name


def test_fill_sets_one_field_of_a_range(tier):
    arrays = _arrays(tier)
    want = _random_fill(tier, arrays)
    tier.fill("touched", True)
    want["touched"][:] = True
    tier.fill("state", 0.25, lo=100, hi=7_345)
    want["state"][100:7_345] = 0.25
    tier.fill("state", 9.0, lo=5, hi=5)  # an empty range: nothing
    for name, a in arrays.items():
        assert torch.equal(a, want[name]), name
    log = tier.view(tier.log_file.tensor, "touched", arrays["touched"])
    log[:] = True
    tier.seal.stamp(tier.log_file.tensor)  # written through the mapping: sealed by hand
    tier.release()
    tier.fill("touched", False, log=True, lo=3, hi=1_650)
    assert not log[3:1_650].any() and log[:3].all() and log[1_650:].all()


def test_name_of_knows_the_fields_views_only(tier):
    arrays = _arrays(tier)
    for name, a in arrays.items():
        assert tier.name_of(a) == name
        assert tier.name_of(a.reshape(N, -1)) == name
    with pytest.raises(ValueError, match="not one of the file's fields"):
        tier.name_of(torch.zeros(N, 5))
    with pytest.raises(ValueError, match="not one of the file's fields"):
        tier.name_of(arrays["weight"][:, :2])
