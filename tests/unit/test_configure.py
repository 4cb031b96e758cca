"""trainer/run/resolve/configure.py: the config every entry point runs with. A file dataset reports its shape
(trainer.workload.data.resolve) and the entry point fills the config with it; data.epochs becomes
train.steps only where the world size W is known (load_config(..., world=W), or the Trainer right
after make_data); make_data itself never writes the config."""
from __future__ import annotations

import copy
import math

import pytest

from data_helpers import N_TRAIN
from helpers import make_cfg
from trainer.base.comm import LocalCollectives
from trainer.base.config import ConfigError, get_key as getattr_key, parse
from trainer.run.resolve.configure import compose_config, load_config
from trainer.workload.data import DataShape, make_data, resolve
from trainer.run.resolve.recipes import (SMALL_DATA_ROWS, TINY_DATA_ROWS, apply_data_steps, choose_recipe, evals_per_epoch,
                             recipe_of)
from trainer.run.runner import Trainer


def _criteo(d: str, *extra: str) -> list[str]:  # no validation split: every training row is trained on
    return ["data=criteo", f"data.dir={d}", "data.loader=memmap", "data.epochs=2.5", "train.steps=7",
            "data.val_fraction=0", "data.min_count=0", "comm=local", "checkpoint.enabled=false", "train.progress=off", *extra]


def test_shape_from_the_files_steps_only_with_world(prepared):
    c = load_config(make_cfg(_criteo(prepared)))
    assert c.data.table_rows == [1000] * 26 and c.data.num_dense == 13
    assert c.train.steps == 7  # W unknown: train.steps stands
    assert resolve(c) == DataShape(13, [1000] * 26, split_rows=N_TRAIN)
    for w in (1, 2):
        expect = math.ceil(2.5 * N_TRAIN / (128 * w))
        assert load_config(make_cfg(_criteo(prepared)), world=w).train.steps == expect
        assert compose_config(_criteo(prepared), w).train.steps == expect
    assert c.train.steps == 7  # resolve reads the config, never writes it


def test_make_data_leaves_the_config_alone(prepared):
    c = load_config(make_cfg(_criteo(prepared)))
    before = copy.deepcopy(c)
    data = make_data(c, 0, 2)
    assert c == before
    apply_data_steps(c, 2)  # from the shape load_config kept: the rows the data source trains on
    assert c.train.steps == math.ceil(2.5 * data.train_rows / (data.b * 2)) == math.ceil(2.5 * N_TRAIN / 256)
    assert c.data == before.data


def test_trainer_applies_the_steps_for_its_world(prepared):
    t = Trainer(load_config(make_cfg(_criteo(prepared))), LocalCollectives(), None)
    assert t.c.train.steps == math.ceil(2.5 * N_TRAIN / 128) == 32
    t = Trainer(load_config(make_cfg(_criteo(prepared, "data.epochs=0"))), LocalCollectives(), None)
    assert t.c.train.steps == 7


def test_movielens_epochs_follow_its_own_split():
    over = ["data=movielens", "data.epochs=1", "data.train_samples=5000", "train.steps=3"]
    c = load_config(make_cfg(over))
    assert c.data.num_dense == 3 and len(c.data.table_rows) == 8 and c.train.steps == 3
    assert load_config(make_cfg(over), world=2).train.steps == math.ceil(5000 / 512)
    data = make_data(c, 0, 2)
    assert data.train_rows == 5000 and c.train.steps == 3


def test_synthetic_data_keeps_train_steps_and_errors_stay_config_errors(prepared):
    c = load_config(make_cfg(["data=tiny", "+data.epochs=3", "train.steps=11"]), world=4)
    assert c.train.steps == 11 and resolve(c) is None
    with pytest.raises(ConfigError, match=r"data\.global_batch_size=100: must be divisible by the world size 3"):
        load_config(make_cfg(_criteo(prepared, "data.global_batch_size=100")), world=3)
    with pytest.raises(ConfigError, match=r"data\.dir=None"):
        load_config(make_cfg(["data=criteo"]), world=2)


def test_small_criteo_set_takes_the_tiny_recipe(prepared):
    """1,600 training rows < TINY_DATA_ROWS: several epochs, a validation split, evaluations once
    per epoch (at the W of the run) and early stopping, an ensemble of 5 (the small recipe's values and
    the ensemble); what the user set is kept and reported."""
    base = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap"]
    c = load_config(make_cfg(base))
    r = recipe_of(c)
    assert r.name == "tiny" and "1,600 training rows" in r.why and c.train.ensemble == 5
    assert (c.data.epochs, c.data.val_fraction, c.train.early_stop.patience, c.data.standardize) == (30.0, 0.2, 3, True)
    assert (c.optim.name, c.optim.dense, c.optim.sparse, c.optim.lr, c.optim.sparse_lr) == \
        ("adam", "adam", "rowwise_adagrad", 0.001, 0.05)  # optim=auto (the default) under the small recipe
    assert r.describe(c)["overridden"] == {} and "recipe tiny" in r.line(c)
    # DLRM's top MLP (its preset leaves it null) is the wider one on small data, the preset's
    # [64, 32] elsewhere; a width on the command line wins and is reported as set by you
    assert c.model.top_mlp == [256, 128] and r.describe(c)["values"]["model.top_mlp"] == [256, 128]
    load_config(make_cfg(base)).model.top_mlp.append(1)  # each config's own list: the recipe's is untouched
    assert load_config(make_cfg(base)).model.top_mlp == [256, 128]
    narrow = load_config(make_cfg(base + ["model.top_mlp=[64,32]"]))
    assert narrow.model.top_mlp == [64, 32] and recipe_of(narrow).describe(narrow)["overridden"] == {
        "model.top_mlp": [64, 32]}
    wdl = load_config(make_cfg(base + ["model=wdl"]))  # the other models' presets set theirs
    assert wdl.model.top_mlp == [256, 128] and "model.top_mlp" not in recipe_of(wdl).describe(wdl)["values"]
    # WDL's and DCN's row width (their presets leave it null): 32 on small data, 16 elsewhere;
    # DLRM's and DeepFM's presets set 16 themselves
    for m in ("wdl", "dcn"):
        mc = load_config(make_cfg(base + [f"model={m}"]))
        assert mc.model.embedding_dim == 32 and recipe_of(mc).describe(mc)["values"]["model.embedding_dim"] == 32
        assert load_config(make_cfg(base + [f"model={m}", "train.recipe=large"])).model.embedding_dim == 16
        own = load_config(make_cfg(base + [f"model={m}", "model.embedding_dim=8"]))
        assert own.model.embedding_dim == 8 and recipe_of(own).describe(own)["overridden"] == {"model.embedding_dim": 8}
    assert c.model.embedding_dim == 16 and "model.embedding_dim" not in r.describe(c)["values"]
    small = load_config(make_cfg(base + ["train.recipe=small"]))  # the same but one model
    assert recipe_of(small).name == "small" and small.train.ensemble == 1
    assert [(k, v) for k, v in recipe_of(small).describe(small)["values"].items() if getattr_key(c, k) != v] == [
        ("train.ensemble", 1)]
    for w in (1, 2):
        cw = load_config(make_cfg(base), world=w)
        assert cw.train.eval_every == math.ceil(1280 / (128 * w))  # one epoch of the 1,280 trained rows
        assert cw.train.steps == math.ceil(30 * 1280 / (128 * w))
    mine = load_config(make_cfg(base + ["data.epochs=2", "data.val_fraction=0.1", "train.eval_every=5"]), world=1)
    d = recipe_of(mine).describe(mine)
    assert d["name"] == "tiny" and d["overridden"] == {"data.epochs": 2.0, "data.val_fraction": 0.1}
    assert mine.train.eval_every == 5 and mine.train.steps == math.ceil(2 * 1440 / 128)
    large = load_config(make_cfg(base + ["train.recipe=large"]), world=1)
    assert recipe_of(large).name == "large" and large.train.steps == math.ceil(N_TRAIN / 128)
    assert (large.data.val_fraction, large.train.early_stop.patience, large.train.eval_every) == (0.0, 0, 0)
    assert (large.optim.name, large.optim.lr, large.optim.sparse_lr, large.data.standardize) == ("sgd", 0.1, None, False)
    assert large.model.top_mlp == [64, 32]
    no_val = load_config(make_cfg(base + ["data.val_fraction=0"]), world=1)  # no validation: no early stop
    assert (no_val.train.early_stop.patience, no_val.train.eval_every, no_val.data.epochs) == (0, 0, 30.0)
    sgd = load_config(make_cfg(base + ["optim=sgd"]))  # a chosen preset is kept whole: its null sparse_lr = lr
    assert (sgd.optim.dense, sgd.optim.sparse_lr, sgd.data.val_fraction) == ("sgd", None, 0.2)


def test_recipe_evaluates_up_to_four_times_per_epoch_on_longer_epochs(prepared):
    """The recipe's cadence: k = ceil(epoch rows / 1,280) evaluations per epoch (1 to 4), and its
    patience and min_evals (3 and 10 epochs) k times as many evaluations; a cadence or a count the
    user gives is kept as given. 1,440 training rows (a 10% validation split): k = 2."""
    assert [evals_per_epoch(n) for n in (0, 1, 1280, 1281, 2560, 2561, 4001, 10 ** 6)] == [1, 1, 1, 2, 2, 3, 4, 4]
    base = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap", "data.val_fraction=0.1"]
    for w in (1, 2):
        c = load_config(make_cfg(base), world=w)
        assert c.train.eval_every == math.ceil(math.ceil(1440 / (128 * w)) / 2)  # 6 and 3 steps
        assert (c.train.early_stop.patience, c.train.early_stop.min_evals) == (6, 20)
        assert recipe_of(c).describe(c)["overridden"] == {"data.val_fraction": 0.1}  # 6 and 20 are the recipe's
        assert "train.early_stop.patience=6, train.early_stop.min_evals=20" in recipe_of(c).line(c)
    own = load_config(make_cfg(base + ["train.eval_every=4"]), world=1)  # the user's cadence: counts as given
    assert (own.train.eval_every, own.train.early_stop.patience, own.train.early_stop.min_evals) == (4, 3, 10)
    assert recipe_of(own).describe(own)["overridden"] == {"data.val_fraction": 0.1}
    mine = load_config(make_cfg(base + ["train.early_stop.patience=4"]), world=1)  # the user's count: as given
    assert (mine.train.eval_every, mine.train.early_stop.patience, mine.train.early_stop.min_evals) == (6, 4, 20)
    assert recipe_of(mine).describe(mine)["overridden"] == {"data.val_fraction": 0.1, "train.early_stop.patience": 4}
    one = load_config(make_cfg(base[:-1]), world=1)  # 1,280 rows (20%): once per epoch, as before
    assert (one.train.eval_every, one.train.early_stop.patience, one.train.early_stop.min_evals) == (10, 3, 10)
    member = load_config(copy.deepcopy(load_config(make_cfg(base))), world=1)  # a resolved config (an ensemble member's)
    assert (member.train.early_stop.patience, member.train.early_stop.min_evals) == (6, 20)  # not scaled twice


def test_size_rule_large_data_keeps_one_epoch():
    c = parse(make_cfg(["data=criteo"]))
    at = lambda rows: choose_recipe(c, DataShape(13, [10] * 26, split_rows=rows))  # noqa: E731
    assert at(TINY_DATA_ROWS - 1).name == "tiny" and at(TINY_DATA_ROWS).name == "small"
    assert "99,999 training rows < 100,000" in at(TINY_DATA_ROWS - 1).why
    assert at(SMALL_DATA_ROWS - 1).name == "small" and at(SMALL_DATA_ROWS).name == "large"
    assert "1,000,000 training rows" in at(SMALL_DATA_ROWS).why
    assert choose_recipe(parse(make_cfg(["data=tiny"])), None).name == "none"
    assert choose_recipe(parse(make_cfg(["data=tiny", "train.recipe=small"])), None).name == "small"


def test_an_explicit_train_steps_wins_over_the_recipes_epochs(prepared, capsys):
    """data=criteo's recipe trains data.epochs (30 on the sample); train.steps given while
    data.epochs is left to the recipe wins (the recipe's epochs are not applied), and the recipe's
    line says so; left out, the steps are the epochs' and the line says from what."""
    base = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap", "train.ensemble=1"]
    given = load_config(make_cfg(base + ["train.steps=10"]), world=2)
    assert given.train.steps == 10 and given.data.epochs == 0
    line = recipe_of(given).line(given, 2)
    assert "set by you: train.ensemble, train.steps." in line and "data.epochs=0" in line, line
    derived = load_config(make_cfg(base), world=2)
    assert derived.data.epochs == 30 and derived.train.steps == math.ceil(30 * derived_rows(derived) / 256)
    line = recipe_of(derived).line(derived, 2)
    assert f"train.steps={derived.train.steps} (data.epochs=30 x {derived_rows(derived):,} training rows / 256 a step)" \
        in line, line
    assert load_config(make_cfg(base + ["data.epochs=1", "train.steps=10"]), world=2).train.steps == \
        math.ceil(derived_rows(derived) / 256)  # both given: data.epochs decides (the line shows its steps)


def derived_rows(c) -> int:
    from trainer.workload.data import epoch_rows, shape_of
    return epoch_rows(c, shape_of(c))


def test_the_recipes_optimizers_are_the_conf_optim_presets_they_name():
    """The optimizer presets are stated once, in conf/optim/*.yaml: a recipe's optim.* values are
    those of the preset its optim.name names (none and large: optim=sgd, small and tiny: optim=adam;
    a preset's null sparse_lr (= lr) is a recipe that leaves optim.sparse_lr unset)."""
    import os

    import yaml

    from trainer.base.config import CONF_DIR
    from trainer.run.resolve.recipes import RECIPE_VALUES
    for recipe, values in RECIPE_VALUES.items():
        with open(os.path.join(CONF_DIR, "optim", f"{values['optim.name']}.yaml")) as f:
            preset = yaml.safe_load(f)
        own = {k: values.get(f"optim.{k}") for k in ("name", "dense", "sparse", "lr", "sparse_lr", "eps")}
        assert own == {k: preset[k] for k in own}, recipe
