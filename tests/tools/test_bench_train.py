"""benchmarks/bench_train.py's point options without running a trainer: --kinds makes one point
per table kind (side by side at every W), --repeats runs the points in rounds; bad values are one
error line (exit 2) before anything runs."""
from __future__ import annotations

import json

import pytest

from benchmarks import bench_train


def test_kinds_and_repeats_make_interleaved_points(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(bench_train, "check", lambda *a, **k: None)
    monkeypatch.setattr(bench_train, "bench", lambda w, steps, extra, backend, workload, point, prof:
                        ran.append((w, tuple(point))) or {"world_size": w, "point": point})
    assert bench_train.main(["--worlds", "1", "2", "--kinds", "fixed", "dynamic", "--repeats", "2",
                             "--", "embedding.capacity=100"]) == 0
    one_round = [(1, ("embedding.kind=fixed",)), (1, ("embedding.kind=dynamic",)),
                 (2, ("embedding.kind=fixed",)), (2, ("embedding.kind=dynamic",))]
    assert ran == one_round * 2
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["repeat"] for x in lines] == [0] * 4 + [1] * 4


def test_bad_points_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_train, "check", lambda *a, **k: pytest.fail("checked configs of a bad command line"))
    assert bench_train.main(["--repeats", "0"]) == 2
    assert "--repeats takes R >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        bench_train.main(["--kinds", "sparse"])
    assert err.value.code == 2
