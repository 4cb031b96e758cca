"""Config validation: every bad value is rejected at start-up with a message naming the key."""
from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from helpers import make_cfg
from trainer.base.config import RENAMED, Config, ConfigError, get_key, local_batch_size, parse, validate_world
from trainer.run.resolve.configure import load_config

BAD = [
    ("data.batch_size=0", "data.batch_size"),
    ("data.batch_size=-4", "data.batch_size"),
    ("model.embedding_dim=0", "model.embedding_dim"),
    ("model.name=transformer", "model.name"),
    ("model.pooling=max", "model.pooling"),
    ("data.table_rows=[10,0,5]", "data.table_rows[1]"),
    ("data.table_rows=[]", "data.table_rows"),
    ("data.max_bag=0", "data.max_bag"),
    ("data.min_bag=-1", "data.min_bag"),
    ("data.zipf_alpha=-0.5", "data.zipf_alpha"),
    ("data.global_batch_size=0", "data.global_batch_size"),
    ("data.eval_batch_size=0", "data.eval_batch_size"),
    ("optim.lr=0", "optim.lr"),
    ("optim.dense=lamb", "optim.dense"),
    ("optim.sparse=adam", "optim.sparse"),
    ("comm.backend=mpi", "comm.backend"),
    ("comm.timeout_s=0", "comm.timeout_s"),
    ("comm.wire_precision=fp8", "comm.wire_precision"),
    ("train.pipeline=all", "train.pipeline"),
    ("comm.settled_rows=sometimes", "comm.settled_rows"),
    ("train.pipeline=rows", "train.pipeline"),  # rows needs a cache with pull_bound >= 1
    ("train.steps=0", "train.steps"),
    ("train.progress=maybe", "train.progress"),
    ("data.batch_size=abc", "data.batch_size"),  # type error from the schema
    # the audit: every numeric / enum key out of range (and non-finite floats) names its key
    ("model.bottom_mlp=[0]", "model.bottom_mlp"),
    ("model.top_mlp=[8,-1]", "model.top_mlp"),
    ("+model.cross_layers=-1", "model.cross_layers"),
    ("+model.cross_rank=-1", "model.cross_rank"),
    ("data.name=parquet", "data.name"),
    ("data.num_dense=0", "data.num_dense"),
    ("data.max_table_rows=-1", "data.max_table_rows"),
    ("data.zipf_alpha=inf", "data.zipf_alpha"),
    ("data.signal=-1", "data.signal"),
    ("data.signal=nan", "data.signal"),
    ("data.train_samples=-1", "data.train_samples"),
    ("data.test_samples=-1", "data.test_samples"),
    ("data.seed=-1", "data.seed"),
    ("+data.loader=arrow", "data.loader"),
    ("data.loader_threads=0", "data.loader_threads"),
    ("data.cycle_batches=-2", "data.cycle_batches"),
    ("train.cuda_graph=sometimes", "train.cuda_graph"),
    ("train.unique_capacity=-2", "train.unique_capacity"),
    ("train.capacity_margin=0", "train.capacity_margin"),
    ("embedding.lfu_half_life=-1", "embedding.lfu_half_life"),
    ("embedding.ttl_steps=-1", "embedding.ttl_steps"),
    ("+data.test_fraction=0", "data.test_fraction"),
    ("+data.test_fraction=1", "data.test_fraction"),
    ("+data.epochs=-1", "data.epochs"),
    ("+data.epochs=inf", "data.epochs"),
    ("data.out_of_range=clip", "data.out_of_range"),
    ("optim.lr=-0.1", "optim.lr"),
    ("optim.lr=nan", "optim.lr"),
    ("optim.lr=inf", "optim.lr"),
    ("optim.sparse_lr=0", "optim.sparse_lr"),
    ("optim.sparse_lr=inf", "optim.sparse_lr"),
    ("optim.eps=0", "optim.eps"),
    ("optim.eps=inf", "optim.eps"),
    ("optim.momentum=1", "optim.momentum"),
    ("optim.momentum=-0.5", "optim.momentum"),
    ("optim.initial_accumulator=-1", "optim.initial_accumulator"),
    ("optim.initial_accumulator=inf", "optim.initial_accumulator"),
    ("comm.dist_backend=mpi", "comm.dist_backend"),
    ("comm.timeout_s=-5", "comm.timeout_s"),
    ("comm.timeout_s=inf", "comm.timeout_s"),
    ("embedding.init_scale=-0.1", "embedding.init_scale"),
    ("embedding.init_scale=inf", "embedding.init_scale"),
    ("embedding.dtype=fp8", "embedding.dtype"),
    ("embedding.rounding=up", "embedding.rounding"),
    ("cache.policy=fifo", "cache.policy"),
    ("cache.capacity_fraction=1.5", "cache.capacity_fraction"),
    ("cache.capacity_fraction=-0.1", "cache.capacity_fraction"),
    ("cache.capacity_rows=-1", "cache.capacity_rows"),
    ("cache.pin_threshold=0", "cache.pin_threshold"),
    ("+cache.tables.9={capacity_rows:1}", "cache.tables.9"),
    ("+cache.tables.0={capacity_rows:-1}", "cache.tables.0.capacity_rows"),
    ("+cache.tables.1={capacity_fraction:2}", "cache.tables.1.capacity_fraction"),
    ("consistency.name=tso", "consistency.name"),
    ("consistency.pull_bound=-2", "consistency.pull_bound"),
    ("consistency.push_bound=-2", "consistency.push_bound"),
    ("+consistency.tables.x={pull_bound:1}", "consistency.tables.x"),
    ("+consistency.tables.0={pull_bound:-2}", "consistency.tables.0.pull_bound"),
    ("+consistency.tables.2={push_bound:-3}", "consistency.tables.2.push_bound"),
    ("kernels.backend=cuda", "kernels.backend"),
    ("placement.name=hot", "placement.name"),
    ("placement.budget_bytes=-1", "placement.budget_bytes"),
    ("placement.profile_fraction=0", "placement.profile_fraction"),
    ("placement.profile_fraction=1.5", "placement.profile_fraction"),
    ("placement.hot_rate=1.5", "placement.hot_rate"),
    ("placement.window_batches=0", "placement.window_batches"),
    ("placement.buckets=0", "placement.buckets"),
    ("placement.plan_steps=0", "placement.plan_steps"),
    ("schedule.name=round_robin", "schedule.name"),
    ("schedule.passes=-1", "schedule.passes"),
    ("train.steps=-3", "train.steps"),
    ("train.seed=-1", "train.seed"),
    ("train.log_every=0", "train.log_every"),
    ("train.eval_every=-1", "train.eval_every"),
    ("train.threads=-1", "train.threads"),
    ("train.device=tpu", "train.device"),
    ("train.nonfinite=retry", "train.nonfinite"),
    ("train.on_signal=pause", "train.on_signal"),
    ("train.max_skips=0", "train.max_skips"),
    ("train.precision=fp8", "train.precision"),
    ("train.early_stop.snapshot=cloud", "train.early_stop.snapshot"),
    ("train.loss_scale.init=0", "train.loss_scale.init"),
    ("train.loss_scale.growth_factor=0.5", "train.loss_scale.growth_factor"),
    ("train.loss_scale.backoff_factor=1.5", "train.loss_scale.backoff_factor"),
    ("train.loss_scale.growth_interval=0", "train.loss_scale.growth_interval"),
    ("checkpoint.every=-1", "checkpoint.every"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
    ("checkpoint.lock_lease_s=0", "checkpoint.lock_lease_s"),
    ("checkpoint.dir=' '", "checkpoint.dir"),
    ("checkpoint.resume=/no/such/step_00000005", "checkpoint.resume"),
    # validation, early stopping, regularisation, schedules, recipes
    ("model.dropout=1", "model.dropout"),
    ("model.dropout=-0.1", "model.dropout"),
    ("data.val_fraction=1", "data.val_fraction"),
    ("data.val_fraction=-0.2", "data.val_fraction"),
    ("data.val_fraction=0.2", "data.val_fraction"),  # synthetic stream (train_samples=0): nothing to carve
    ("optim.weight_decay=-1", "optim.weight_decay"),
    ("optim.weight_decay=inf", "optim.weight_decay"),
    ("optim.sparse_weight_decay=-0.1", "optim.sparse_weight_decay"),
    ("optim.sparse_weight_decay=nan", "optim.sparse_weight_decay"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("optim.decay=cosine", "optim.decay"),
    ("optim.decay_start=-2", "optim.decay_start"),
    ("optim.decay_steps=-1", "optim.decay_steps"),
    ("optim.decay_power=0", "optim.decay_power"),
    ("optim.decay_power=inf", "optim.decay_power"),
    ("train.recipe=huge", "train.recipe"),
    ("train.early_stop.patience=-1", "train.early_stop.patience"),
    ("train.early_stop.patience=2", "train.early_stop.patience"),  # no validation split: never on the test split
    ("train.early_stop.min_delta=-0.01", "train.early_stop.min_delta"),
    ("train.early_stop.min_delta=nan", "train.early_stop.min_delta"),
    ("train.calibrate=true", "train.calibrate"),
    ("data.val_slice=0", "data.val_slice"),
    ("data.min_count=-1", "data.min_count"),
    ("train.ensemble=0", "train.ensemble"),
    ("train.bag=0", "train.ensemble"),  # the deprecated name: its value is checked as train.ensemble's
    ("train.early_stop.min_evals=-1", "train.early_stop.min_evals"),
    ("train.ensemble=2", "train.ensemble"),  # the members' validation slices: a data=criteo option
    ("data.min_count=2", "data.min_count"),  # a vocabulary of the training rows is a data=criteo option  # no validation split: never fitted on the test split
    ("+data.standardize=true", "data.standardize"),  # a data=criteo option
    ("embedding.kind=sparse", "embedding.kind"),
    ("embedding.capacity=-1", "embedding.capacity"),
    ("embedding.admit_after=0", "embedding.admit_after"),
    ("embedding.capacity_bytes=-1", "embedding.capacity_bytes"),
    ("embedding.admit_counter=sketch", "embedding.admit_counter"),
    ("embedding.count_min_bytes=0", "embedding.count_min_bytes"),
    ("embedding.count_min_depth=0", "embedding.count_min_depth"),
    ("embedding.count_min_halve_steps=-1", "embedding.count_min_halve_steps"),
    ("embedding.eviction=fifo", "embedding.eviction"),
    ("embedding.store=ssd", "embedding.store"),
    ("embedding.store_cache_bytes=-1", "embedding.store_cache_bytes"),
    ("data.scramble_ids=true", "data.scramble_ids"),  # needs embedding.kind=dynamic
    ("data.drift=-1", "data.drift"),
    ("data.drift=0.1", "data.drift"),  # needs embedding.kind=dynamic
    ("data.hash_rows=-1", "data.hash_rows"),
    ("data.drift_eval_at=-1", "data.drift_eval_at"),
]
# keys with no range to check: free text (informational names, paths) and booleans
NO_RANGE = {"data.preset", "data.dir", "embedding.store_dir", "data.shuffle", "optim.name", "embedding.audit", "checkpoint.enabled",
            "placement.hot_batches", "schedule.on_demand_sync", "schedule.cache_aware",
            "train.early_stop.restore_best", "train.tensorboard", "train.memory_check",
            "checkpoint.space_check"}


@pytest.mark.parametrize("override,key", BAD, ids=[b[0] for b in BAD])
def test_bad_value_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(make_cfg([override]))
    msg = str(err.value)
    assert f"{key}=" in msg or f"full_key: {key}" in msg, msg


def test_every_key_of_the_schema_has_an_out_of_range_case():
    """The audit stays complete: a new numeric or enum knob needs a BAD case (or a NO_RANGE entry)."""
    def leaves(prefix: str, cls) -> list[str]:  # nested blocks (train.early_stop) are walked too
        out = []
        for name, t in typing.get_type_hints(cls).items():
            is_block = isinstance(t, type) and dataclasses.is_dataclass(t)
            out += leaves(f"{prefix}.{name}", t) if is_block else [f"{prefix}.{name}"]
        return out

    keys = [k for group, cls in typing.get_type_hints(Config).items() for k in leaves(group, cls)]
    assert "train.early_stop.patience" in keys and "optim.sparse_weight_decay" in keys
    covered = {k for _, k in BAD}
    missing = [k for k in keys if k not in NO_RANGE and not any(c == k or c.startswith(k + ".") or
                                                                c.startswith(k + "[") for c in covered)]
    assert not missing, f"config keys without an out-of-range test case: {missing}"


@pytest.mark.parametrize("overrides,key,reason", [
    (["data.train_samples=1", "data.val_fraction=0.5"], "data.val_fraction", "leaves no training rows"),
    (["data.train_samples=100", "data.val_fraction=0.2", "train.early_stop.patience=2", "train.eval_every=0"],
     "train.early_stop.patience", "train.eval_every > 0"),
    (["train.early_stop.patience=1"], "train.early_stop.patience", "validation split"),
    (["train.calibrate=true"], "train.calibrate", "validation split"),
])
def test_cross_field_rules_of_validation(overrides, key, reason):
    with pytest.raises(ConfigError, match=reason) as err:
        c = load_config(make_cfg(overrides))
        from trainer.workload.data import make_data
        make_data(c, 0, 1)  # the carve itself is checked where the rows are known
    assert f"{key}=" in str(err.value)


def test_recipe_keys_resolve_to_neutral_values_outside_criteo():
    """data=tiny (recipe none): every key a recipe may set is at its neutral value, so a config
    without these keys trains as before."""
    c = load_config(make_cfg(["data=tiny"]))
    assert (c.data.val_fraction, c.model.dropout, c.optim.weight_decay, c.optim.sparse_weight_decay,
            c.optim.warmup_steps, c.optim.decay, c.train.early_stop.patience) == (0.0, 0.0, 0.0, 0.0, 0, "none", 0)
    assert c.train.eval_every == 0 and (c.optim.name, c.optim.dense, c.optim.sparse, c.optim.lr) == \
        ("sgd", "sgd", "sgd", 0.1)  # optim=auto (the default) is the sgd preset outside the small recipe
    assert c.optim.sparse_lr is None and c.optim.eps == 1e-10
    assert c.model.name == "dlrm" and c.model.top_mlp == [64, 32]  # DLRM's null top MLP: the bench width
    for m in ("wdl", "dcn"):  # their null row width: 16 outside the small-data recipes
        assert load_config(make_cfg(["data=tiny", f"model={m}"])).model.embedding_dim == 16


def test_unknown_key_is_rejected_by_hydra():
    with pytest.raises(Exception, match="batchsize"):
        make_cfg(["data.batchsize=3"])


def test_more_ranks_than_rows_is_rejected():
    cfg = load_config(make_cfg(["data.table_rows=[100,2,50]"]))
    validate_world(cfg, 2)
    with pytest.raises(ConfigError, match=r"data.table_rows\[1\]=2.*3 workers"):
        validate_world(cfg, 3)


def test_global_batch_must_divide_by_world():
    cfg = load_config(make_cfg(["data.global_batch_size=64"]))
    assert local_batch_size(cfg, 4) == 16
    with pytest.raises(ConfigError, match="data.global_batch_size=64.*3"):
        validate_world(cfg, 3)


@pytest.mark.parametrize("preset", ["tiny", "criteo_like", "bench", "mlperf"])
def test_presets_are_valid(preset):
    cfg = load_config(make_cfg([f"data={preset}"]))
    assert cfg.data.preset == preset


def test_mlperf_presets_have_the_mlperf_shape():
    """data=mlperf model=dlrm_mlperf: MLPerf DLRM's 26 tables (Criteo 1TB capped at 40M), d = 128,
    bottom 13-512-256-128, top 1024-1024-512-256-1; the table rows capped by data.max_table_rows."""
    from trainer.base.config import table_rows
    cfg = load_config(make_cfg(["data=mlperf", "model=dlrm_mlperf"]))
    assert len(cfg.data.table_rows) == 26 and cfg.data.num_dense == 13
    assert max(cfg.data.table_rows) == 40_000_000 and sum(cfg.data.table_rows) == 204_184_588
    assert (cfg.model.name, cfg.model.embedding_dim) == ("dlrm", 128)
    assert (cfg.model.bottom_mlp, cfg.model.top_mlp) == ([512, 256], [1024, 1024, 512, 256])
    assert max(table_rows(cfg)) == cfg.data.max_table_rows == 200_000
    full = load_config(make_cfg(["data=mlperf", "data.max_table_rows=0"]))
    assert table_rows(full) == full.data.table_rows


def test_criteo_like_has_kaggle_cardinalities_capped():
    from trainer.base.config import table_rows
    cfg = load_config(make_cfg(["data=criteo_like", "data.max_table_rows=50000"]))
    rows = table_rows(cfg)
    assert len(rows) == 26 and cfg.data.num_dense == 13
    assert max(rows) == 50000 and rows[8] == 3  # the 3-value feature is untouched by the cap


# ---------------------------------------------------------------- the run's device and its transport
def _cuda(monkeypatch, available: bool) -> None:
    """torch.cuda.is_available as on a machine with (or without) a GPU, for config's one rule."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


def test_default_device_is_auto_in_the_yaml_and_the_schema():
    """A GPU user's first command trains on the GPU: train.device=auto by default, in
    conf/train/default.yaml and in the dataclass alike, and the default config composes with it."""
    from trainer.base.config import TrainConfig
    assert TrainConfig().device == "auto"
    c = load_config(make_cfg([]))
    assert c.train.device == "auto" and c.comm.dist_backend == "auto"


@pytest.mark.parametrize("cuda", [False, True], ids=["no-gpu", "gpu"])
def test_auto_device_is_cuda_exactly_when_a_gpu_is_visible_and_nccl_follows(monkeypatch, cuda):
    from trainer.base.config import dist_transport, run_device
    _cuda(monkeypatch, cuda)
    c = load_config(make_cfg(["comm=torch"]))  # composes and validates either way
    want = "cuda" if cuda else "cpu"
    assert run_device(c) == want
    assert dist_transport(c.comm.dist_backend, run_device(c)) == ("nccl" if cuda else "gloo")
    cpu = load_config(make_cfg(["comm=torch", "train.device=cpu"]))  # explicit cpu: gloo, GPU or not
    assert run_device(cpu) == "cpu" and dist_transport(cpu.comm.dist_backend, run_device(cpu)) == "gloo"


def test_dist_transport_rule():
    from trainer.base.config import dist_transport
    assert dist_transport("auto", "cuda") == "nccl" and dist_transport("auto", "cpu") == "gloo"
    assert dist_transport("auto", "cuda", gpus_shared=True) == "gloo"  # NCCL refuses two ranks on a GPU
    assert dist_transport("gloo", "cuda") == "gloo" and dist_transport("nccl", "cuda", True) == "nccl"


def test_nccl_on_a_cpu_run_is_refused_naming_both_keys(monkeypatch):
    _cuda(monkeypatch, True)  # even with a GPU: train.device=cpu keeps the tensors on the host
    with pytest.raises(ConfigError) as err:
        load_config(make_cfg(["comm=torch", "train.device=cpu", "comm.dist_backend=nccl"]))
    msg = str(err.value)
    assert "comm.dist_backend='nccl'" in msg and "train.device=cpu" in msg and "\n" not in msg, msg
    c = load_config(make_cfg(["comm=torch", "comm.dist_backend=nccl"]))  # auto device on the GPU: fine
    assert c.comm.dist_backend == "nccl"


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_nccl_without_a_visible_gpu_is_refused(monkeypatch, device):
    _cuda(monkeypatch, False)
    with pytest.raises(ConfigError, match=r"comm.dist_backend='nccl': needs a CUDA device, and none is visible"):
        load_config(make_cfg(["comm=torch", f"train.device={device}", "comm.dist_backend=nccl"]))


def test_the_schema_defaults_are_the_config_python_m_trainer_composes():
    """One default per key: the dataclasses' defaults are exactly what conf/config.yaml's default
    options compose to (before the recipe fills the nulls), so Config() is `python -m trainer`'s
    config and a key an option file leaves out gets the same value it would under the defaults."""
    from trainer.base.config import compose
    want, got = dataclasses.asdict(Config()), dataclasses.asdict(parse(compose([])))
    diff = {f"{g}.{k}": (want[g][k], got[g][k]) for g in want for k in want[g] if want[g][k] != got[g][k]}
    assert not diff, f"schema default vs conf/ default: {diff}"


OLD_NAMES = [("train.bag", "train.ensemble", 3), ("embedding.tables", "embedding.kind", "dynamic"),
             ("data.eval_samples", "data.test_samples", 100), ("data.eval_fraction", "data.test_fraction", 0.25)]
DATA = ["data=criteo"]  # a data option that has every key above (synthetic data has no test_fraction)


@pytest.mark.parametrize("old,new,value", OLD_NAMES, ids=[o[0] for o in OLD_NAMES])
def test_old_key_name_still_works_and_warns_once(old, new, value, capfd, monkeypatch):
    """An old key name (RENAMED), as an override or in a config tree, is read as the new key with one
    warning line on stderr (from the launcher's rank 0 only); the same value under both names is
    fine, different ones are refused naming both. The schema and conf/ hold only the new name."""
    monkeypatch.delenv("RANK", raising=False)
    capfd.readouterr()
    c = parse(make_cfg(DATA + [f"{old}={value}"]))
    assert get_key(c, new) == value
    said = f"[trainer] warning: {old} is deprecated, use {new} ({old}={value} -> {new}={value}); " \
           f"{old} will be removed in the next release"
    err = capfd.readouterr().err
    assert said in err and err.count("deprecated") == 1, err
    section, name = old.split(".")
    tree = {section: {name: value}}
    assert get_key(parse(tree), new) == value and said in capfd.readouterr().err  # a saved or hand-written tree
    assert tree == {section: {name: value}}  # the caller's tree is not changed
    assert get_key(parse(make_cfg(DATA + [f"{old}={value}", f"{new}={value}"])), new) == value
    monkeypatch.setenv("RANK", "1")  # another rank under torchrun: the same config, nothing said
    capfd.readouterr()
    assert get_key(parse(make_cfg(DATA + [f"{old}={value}"])), new) == value
    assert "deprecated" not in capfd.readouterr().err
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)}={value} and {re.escape(new)}=7: {re.escape(old)} is "
                                          rf"the old name of {re.escape(new)}: give only {re.escape(new)}$"):
        make_cfg(DATA + [f"{old}={value}", f"{new}=7"])
    assert str(get_key(parse(make_cfg(DATA + [f"{new}={value}", f"{new}=7"])), new)) in ("7", "7.0")  # the new name twice: the last wins
    assert not hasattr(get_key(c, section), name)


def test_every_renamed_key_is_tested():
    assert sorted(o[0] for o in OLD_NAMES) == sorted(RENAMED)


@pytest.mark.parametrize("override, says", [
    ("+train.nosuch=1", "train.nosuch: no such key in train (docs/config.md lists every key)"),
    ("+nosuch=1", "nosuch: no such key in the config"),
    ("model.embedding_dim=abc", "model.embedding_dim=abc: Value 'abc' of type 'str' could not be converted to Integer")])
def test_an_unknown_key_or_a_wrong_type_is_one_line_naming_the_key(override, says):
    """OmegaConf's errors (4 lines each: the key, the reference and object types) become one line
    that names the key, as every other config error."""
    with pytest.raises(ConfigError) as err:
        load_config(make_cfg([override]))
    assert str(err.value).startswith(says) and "\n" not in str(err.value), str(err.value)
