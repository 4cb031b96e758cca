"""Export and predict (trainer/serving/): a trained run's checkpoint, at any W, becomes one artifact
whose Predictor scores the test split as the trainer's evaluation did: the run's test AUC within
1e-6, and at W = 1 every logit equal to the evaluation's (in-process run, return_state); fp16 /
bf16 rows, the disk store and multi-hot bags (sum and mean pooling) too. Bad input: one line,
exit 2, nothing written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import make_cfg
from hvd_launch import ROOT, env, tail, torchrun

from trainer.base.config.load import parse
from trainer.run.evaluation.metrics import auc_logloss
from trainer.run.runner import run
from trainer.serving.__main__ import export_main, predict_main
from trainer.serving.artifact import MANIFEST, ServingError, read_manifest
from trainer.serving.export import export
from trainer.serving.predictor import Predictor
from trainer.workload.data import make_data

BASE = ["data=tiny", "train.steps=24", "data.global_batch_size=48", "data.test_samples=240", "data.eval_batch_size=48",
        "train.threads=1", "train.progress=off", "checkpoint.every=0"]


def _scores(artifact: str, summary: dict) -> tuple[np.ndarray, np.ndarray]:
    """(logits, labels) of the run's test split by the artifact's Predictor, batch by batch."""
    p = Predictor(artifact)
    c = parse(p.manifest["config"])
    data = make_data(c, 0, 1)
    logits, labels = [], []
    for b in data.eval_batches("test"):
        logits.append(p.logits(b.dense, b.values, b.lengths))
        labels.append(b.labels)
    return torch.cat(logits).numpy(), torch.cat(labels).numpy()


@pytest.mark.parametrize("model, extra", [("dlrm", []), ("wdl", ["embedding.dtype=fp16"]),
                                          ("deepfm", ["data.max_bag=3", "model.pooling=mean"]),
                                          ("dcn", ["embedding.dtype=bf16", "data.max_bag=2"])])
def test_w1_every_logit_equals_the_evaluation(tmp_path, model, extra):
    out = str(tmp_path / "run")
    got = run(make_cfg([*BASE, f"model={model}", *extra, f"hydra.run.dir={out}"]), out_dir=out, return_state=True)
    art = str(tmp_path / "art")
    export(out, art, say=lambda line: None)
    logits, labels = _scores(art, got.summary)
    want = got.state["eval_rows"]  # the trainer's (logit, label) of the test split, in order
    assert logits.shape[0] == want.shape[0] == got.summary["eval_samples"]
    assert np.abs(logits - want[:, 0]).max() <= 1e-6 and np.array_equal(labels, want[:, 1])
    assert abs(auc_logloss(logits, labels)[0] - got.summary["eval_auc"]) <= 1e-6
    m = read_manifest(art)
    assert m["model"]["name"] == model and m["checkpoint"]["step"] == 24 and m["checkpoint"]["world_size"] == 1
    assert [t["rows"] for t in m["tables"]] == got.summary["config"]["data"]["table_rows"]


@pytest.mark.dist
@pytest.mark.parametrize("world, extra", [(2, ["model=dlrm", "embedding.store=disk", "optim=adagrad"]),
                                          (3, ["model=dcn", "embedding.dtype=fp16", "cache=lru", "consistency=ssp"])])
def test_a_torchrun_run_at_w_exports_its_test_auc(tmp_path, world, extra):
    out = str(tmp_path / "run")
    proc = torchrun(["-m", "trainer", "comm=torch", *BASE, *extra, f"hydra.run.dir={out}"], np_=world)
    assert proc.returncode == 0, tail(proc)
    summary = json.load(open(os.path.join(out, "summary.json")))
    art = str(tmp_path / "art")
    assert export_main([out, "--out", art, "--window-mb", "1"]) == 0
    logits, labels = _scores(art, summary)
    assert logits.shape[0] == summary["eval_samples"]
    assert abs(auc_logloss(logits, labels)[0] - summary["eval_auc"]) <= 1e-6
    assert read_manifest(art)["checkpoint"]["world_size"] == world


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = str(tmp_path / "run")
    run(make_cfg([*BASE, "checkpoint.enabled=false", f"hydra.run.dir={out}"]), out_dir=out)
    capsys.readouterr()
    assert export_main([out, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no complete checkpoint" in err[0] and not os.path.exists(tmp_path / "a")
    out2 = str(tmp_path / "run2")
    run(make_cfg([*BASE, f"hydra.run.dir={out2}"]), out_dir=out2)
    art = str(tmp_path / "art")
    assert export_main([out2, "--out", art]) == 0
    capsys.readouterr()
    capsys.readouterr()
    assert export_main([out2, "--out", art]) == 2  # an output that exists
    assert "exists" in capsys.readouterr().err
    # a damaged checkpoint: nothing exported, nothing left behind
    ckpt = sorted(os.listdir(os.path.join(out2, "checkpoints")))[-1]
    shard = os.path.join(out2, "checkpoints", ckpt, "shard_00000-of-00001", "weight.bin")
    with open(shard, "r+b") as f:
        f.seek(10)
        f.write(b"\x7f\x7f\x7f")
    assert export_main([out2, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fails its checksum" in err[0] and not os.path.exists(tmp_path / "b")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".b.tmp")]
    # an artifact of another format version, a damaged artifact
    m = json.load(open(os.path.join(art, MANIFEST)))
    with open(os.path.join(art, MANIFEST), "w") as f:
        json.dump({**m, "format_version": 99}, f)
    with pytest.raises(ServingError, match="format_version 99"):
        Predictor(art)
    with open(os.path.join(art, MANIFEST), "w") as f:
        json.dump(m, f)
    with open(os.path.join(art, "tables", "table_01.npy"), "r+b") as f:
        f.seek(200)
        f.write(b"\x01")
    with pytest.raises(ServingError, match="table_01.npy fails its checksum"):
        Predictor(art)
    # synthetic data has no raw rows to predict
    rows = tmp_path / "rows.tsv"
    rows.write_text("1\t2\n")
    assert predict_main([art, "--input", str(rows), "--out", str(tmp_path / "s"), "--no-verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no raw row format" in err[0] and not os.path.exists(tmp_path / "s")


def test_the_commands_run_as_documented(tmp_path):
    """`python -m trainer.serving export|predict` (the installed hybrid-trainer-export / -predict)."""
    out = str(tmp_path / "run")
    run(make_cfg([*BASE, f"hydra.run.dir={out}"]), out_dir=out)
    got = subprocess.run([sys.executable, "-m", "trainer.serving", "export", out, "--out", str(tmp_path / "art")],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert "[export]" in got.stderr and os.path.exists(tmp_path / "art" / MANIFEST)
    bad = subprocess.run([sys.executable, "-m", "trainer.serving"], cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize("prep, extra", [({}, ["data.min_count=1", "data.standardize=true", "data.max_table_rows=300"]),
                                         ({"hash_rows": None, "min_count": 2}, ["data.standardize=false"])])
def test_raw_criteo_rows_score_as_the_run_evaluated_them(tmp_path, capsys, prep, extra):
    """Raw TSV rows (the suite's Criteo-format sample: prepared by prepare_criteo, hashed or by its
    vocabulary; then the trainer's min_count vocabulary, standardization and fold), scored by
    `predict` from the file: the AUC of the scores is the run's test AUC."""
    from data_helpers import prepare_sample
    from trainer.workload.data.criteo import parse_chunk
    prepare_sample(str(tmp_path), **prep)
    out = str(tmp_path / "run")
    got = run(make_cfg(["data=criteo", f"data.dir={tmp_path / 'prepared'}", "train.steps=30", "data.global_batch_size=64",
                        "train.threads=1", "train.progress=off", "data.loader=memmap", "train.ensemble=1", *extra, f"hydra.run.dir={out}"]),
              out_dir=out)
    art = str(tmp_path / "art")
    assert export_main([out, "--out", art]) == 0, capsys.readouterr().err
    test = str(tmp_path / "raw" / "test.tsv")
    assert predict_main([art, "--input", test, "--out", str(tmp_path / "scores")]) == 0
    scores = np.loadtxt(tmp_path / "scores")
    labels = parse_chunk(open(test, "rb").read()).labels
    assert scores.shape == labels.shape == (got.summary["eval_samples"],)
    logits = np.log(scores) - np.log1p(-scores)
    assert abs(auc_logloss(logits, labels.astype(np.float32))[0] - got.summary["eval_auc"]) <= 1e-6
    # a bad row: one line naming it, no scores file
    lines = open(test).readlines()
    lines[7] = "1\tx" + lines[7][2:]
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines))
    assert predict_main([art, "--input", str(bad), "--out", str(tmp_path / "s2")]) == 2
    assert not os.path.exists(tmp_path / "s2")


def test_the_docs_plain_reader_scores_as_the_predictor(tmp_path):
    """docs/serving.md's "Without this package" lines, run exactly as written (bf16 rows too)."""
    text = open(os.path.join(ROOT, "docs", "serving.md")).read()
    block = text.split("## Without this package", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    out = str(tmp_path / "run")
    run(make_cfg([*BASE, "embedding.dtype=bf16", f"hydra.run.dir={out}"]), out_dir=out)
    art = str(tmp_path / "art")
    export(out, art, say=lambda line: None)
    space: dict = {}
    exec(compile(block, "docs/serving.md", "exec"), space)
    p = Predictor(art)
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(37, p.num_dense, generator=g)
    ids = torch.stack([torch.randint(0, int(n), (37,), generator=g) for n in p.rows], 1)
    plain = space["logits"](*space["load"](art), dense.numpy(), ids.numpy())
    assert torch.equal(plain, p.logits(dense, ids))
