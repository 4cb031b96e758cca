"""The seed systems on prepared Criteo, and a Criteo checkpoint at another W.

The training rows of a prepared directory have one order at every W (trainer/workload/data/order.py): a
rank's batch of step k is its slice of global batch k, and any rank reads any row by its key. So
placement=fae (its profile and hot batches), placement=sca and schedule=herald run on data=criteo
and equal the single process at BSP, W = 2 and 3 (real gloo processes), with the memmap reader
and with DALI; and a checkpoint written at W = 2 resumes at W = 1 and W = 3 (fixed tables, and
dynamic ones whose ids move to their new owners) and ends as the uninterrupted run.
"""
from __future__ import annotations

import pytest

import trainer.run.checkpoint as ckpt
from helpers import assert_same_eval, run_single, run_world
from parity_helpers import assert_same_run


def _base(prepared: str, loader: str = "memmap") -> list[str]:
    return ["data=criteo", f"data.dir={prepared}", f"data.loader={loader}", "data.global_batch_size=96",
            "data.epochs=0", "train.steps=20", "train.recipe=none", "data.eval_batch_size=100",
            "train.threads=1", "train.progress=off", "train.tensorboard=false"]


SYSTEMS = {
    "fae": ["placement=fae", "placement.profile_fraction=0.5", "placement.window_batches=4"],  # hot and cold steps
    "sca": ["placement=sca", "placement.budget_bytes=65536", "cache=lru", "cache.capacity_fraction=0.05"],
    "herald": ["schedule=herald", "cache=lru", "cache.capacity_fraction=0.05"],
}


@pytest.mark.dist
@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_system_on_criteo_equals_the_single_process(prepared, system):
    overrides = _base(prepared) + SYSTEMS[system]
    ref = run_single(overrides)
    for world in (2, 3):
        results = run_world(world, overrides)
        for res in results:
            assert_same_run(ref, res)
            assert_same_eval(ref, res)
        s = results[0].summary
        assert s["world_size"] == world and s["bytes"]["rows"] > 0
    if system == "fae":  # the profile found hot rows, and hot batches ran
        assert ref.summary["placement"]["hot_rows"] > 0 and ref.summary["placement"]["hot_steps"] > 0


@pytest.mark.dist
def test_herald_with_dali_equals_the_memmap_run(prepared):
    """DALI serves the rank's own batches of a plain run; with a global view every rank reads rows
    by key: the run equals the memmap one either way."""
    ref = run_single(_base(prepared) + SYSTEMS["herald"])
    for res in run_world(2, _base(prepared, "dali") + SYSTEMS["herald"]):
        assert_same_run(ref, res)
    plain = run_single(_base(prepared))
    for res in run_world(2, _base(prepared, "dali")):
        assert_same_run(plain, res)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
def test_criteo_checkpoint_resumes_at_another_world_size(prepared, tmp_path, kind):
    """Saved at step 10 of 20 by W = 2, resumed by W = 3 and by one process: every loss, parameter
    and row as the uninterrupted single process (dynamic tables: pools that never evict, the ids
    moved to their owners under the new W)."""
    extra = [] if kind == "fixed" else ["embedding.kind=dynamic", "embedding.capacity=1200"]
    overrides = _base(prepared) + extra + ["optim=adagrad"]
    ref = run_single(overrides + [f"checkpoint.dir={tmp_path / 'ref'}"])
    root = tmp_path / "w2"
    run_world(2, overrides + ["checkpoint.every=10", f"checkpoint.dir={root}"], return_state=False)
    step10 = ckpt.step_dir(str(root), 10)
    for world in (3, 1):
        again = overrides + [f"checkpoint.resume={step10}", f"checkpoint.dir={tmp_path / f'again{world}'}"]
        got = run_world(world, again) if world > 1 else [run_single(again)]
        for res in got:
            assert res.summary["start_step"] == 10
            assert res.losses[10:] == pytest.approx(ref.losses[10:], rel=1e-5, abs=1e-6)
        assert_same_eval(ref, got[0])
