"""train.tensorboard: the event file holds the same numbers as metrics.jsonl and summary.json."""
from __future__ import annotations

import glob
import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import make_cfg, spawn
from trainer.run.runner import run

BASE = ["data=tiny", "train.steps=12", "train.log_every=4", "train.eval_every=6", "train.progress=off",
        "checkpoint.enabled=false"]


def _events(out: str) -> EventAccumulator:
    files = glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(files[0], size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _lines(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_event_file_matches_metrics_and_summary(tmp_path):
    out = str(tmp_path / "run")
    res = run(make_cfg(BASE + ["comm=local"]), out_dir=out)
    acc = _events(out)
    steps = [r for r in _lines(out) if "event" not in r]
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == [r["step"] for r in steps] == [4, 8, 12]
    for r in steps:
        assert loss[r["step"]] == pytest.approx(r["loss"], rel=1e-6)
        for kind, n in r["bytes"].items():
            assert {e.step: e.value for e in acc.Scalars(f"bytes/{kind}")}[r["step"]] == pytest.approx(n)
    assert [e.step for e in acc.Scalars("train/samples_per_sec")] == [4, 8, 12]
    auc = {e.step: e.value for e in acc.Scalars("eval/auc")}
    assert sorted(auc) == [6, 12]
    assert auc[12] == pytest.approx(res.summary["eval_auc"], rel=1e-6)
    ll = {e.step: e.value for e in acc.Scalars("eval/logloss")}
    assert ll[12] == pytest.approx(res.summary["eval_logloss"], rel=1e-6)


def test_tensorboard_off_writes_no_event_file(tmp_path):
    out = str(tmp_path / "run")
    run(make_cfg(BASE + ["comm=local", "train.tensorboard=false"]), out_dir=out)
    assert os.path.exists(os.path.join(out, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(out, "tensorboard"))


def _cached_worker(rank: int, world: int, out: str) -> dict:
    return run(make_cfg(BASE + ["comm=torch", "cache=lru", "consistency=ssp"]), out_dir=out).summary


@pytest.mark.dist
def test_cache_hit_rate_and_staleness_histogram(tmp_path):
    out = str(tmp_path / "run")
    summary = spawn(2, _cached_worker, out)[0]
    acc = _events(out)
    last = [r for r in _lines(out) if "event" not in r][-1]
    hit = {e.step: e.value for e in acc.Scalars("cache/hit_rate")}
    assert sorted(hit) == [4, 8, 12]
    assert hit[12] == pytest.approx(last["cache"]["hit_rate"], rel=1e-6)
    assert 0 < hit[12] <= 1
    hist = acc.Histograms("cache/staleness")
    assert [h.step for h in hist] == [4, 8, 12]
    want = sum(last["cache"]["staleness"]["hist"].values())
    assert hist[-1].histogram_value.num == want > 0
    assert hist[-1].histogram_value.max == last["cache"]["staleness"]["max"]
    assert summary["cache"]["staleness"]["max"] >= 1  # ssp: some reads were stale


@pytest.mark.parametrize("hist", [{"0": 5}, {"3": 1}, {">=64": 2}, {"0": 100, "1": 7, "5": 3, ">=64": 1},
                                  {"2": 4, "63": 9}])
def test_staleness_histogram_from_counts_equals_one_value_per_read(hist):
    """The histogram built from the bin counts (O(bins)) is the proto add_histogram builds from one
    value per read (O(reads so far): it grew with every step of a long run)."""
    import numpy as np
    from torch.utils.tensorboard.summary import make_histogram
    from trainer.sparse.embedding.cache.consistency import HIST_BINS
    from trainer.run.report.tensorboard import _bin_value, staleness_histogram
    values = np.repeat([_bin_value(k) for k in hist], [hist[k] for k in hist])
    want = make_histogram(values, bins=np.arange(HIST_BINS + 1) - 0.5)
    got = staleness_histogram(hist)
    assert (got["min"], got["max"], got["num"], got["sum"], got["sum_squares"]) == (
        want.min, want.max, want.num, want.sum, want.sum_squares)
    assert got["bucket_limits"] == list(want.bucket_limit) and got["bucket_counts"] == list(want.bucket)
