"""The backbone: W gloo workers reproduce the single-process reference (docs/design.md, section 1
"What correct means").

Same seed, same global batch (data.global_batch_size fixes it for every W), loss = mean over the
global batch. Every loss and every parameter, dense and every embedding row, and every logit of the
final evaluation must agree within 1e-5 relative (1e-6 absolute), for table sizes that do not
divide by W and multi-hot (and empty) bags. The eval AUC is a rank statistic: a last-bit difference
of one logit can order one (positive, negative) pair otherwise, so it is compared in such pairs,
as many as the logits' tolerance lets turn (helpers.assert_same_eval), never to a relative 1e-5.
"""
from __future__ import annotations

import pytest

from helpers import assert_same_eval, run_single, run_world
from parity_helpers import BASE, assert_same_run

CASES = {
    "w2-sgd-sum": (2, ["optim=sgd"]),
    "w3-sgd-sum-emptybags": (3, ["optim=sgd", "data.min_bag=0", "data.max_bag=4"]),
    "w2-adagrad-mean": (2, ["optim=adagrad", "model.pooling=mean"]),
    "w3-adagrad": (3, ["optim=adagrad"]),
    "w3-adam-rowwise": (3, ["optim=adam"]),
    "w2-sgd-cycled": (2, ["optim=sgd", "data.cycle_batches=5"]),  # repeated batches, made once
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_single_process(case):
    world, extra = CASES[case]
    overrides = BASE + extra
    ref = run_single(overrides)
    results = run_world(world, overrides)
    for r, res in enumerate(results):
        assert res.rank == r
        assert_same_run(ref, res)
    # rows really moved between workers (otherwise the test proves nothing about the exchange)
    summary = results[0].summary
    assert summary["world_size"] == world
    assert summary["bytes"]["rows"] > 0 and summary["bytes"]["grads"] > 0
    assert summary["embedding"]["remote_per_step"] > 0
    # eval is exact over the whole split, so it matches the reference too: every row's logit within
    # the parity tolerance, the AUC (a rank statistic) within the pairs those logits may order otherwise
    assert summary["eval_samples"] == ref.summary["eval_samples"] == 480
    for res in results:
        assert_same_eval(ref, res)
    assert summary["eval_logloss"] == pytest.approx(ref.summary["eval_logloss"], rel=1e-5)
