"""The registry of the commands shown in the docs: how each is found (fenced bash blocks, inline
code that reads as a command), run (the overrides that only shrink it, its placeholders) and checked
(what the text beside it promises). tests/docs/test_docs_commands.py runs them; a test elsewhere that runs
a documented command takes it from here (`documented`), so it runs what the docs print."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "docs" / "*.md"))),
        "benchmarks/README.md"]
LINKS = ("scripts", "benchmarks", "dev", "conf", "trainer", "kernels", "tests", "Dockerfile",
         "pyproject.toml")
SETUP = "bash scripts/setup.sh && "

# Keys an entry may lower (Hydra overrides and tool flags: steps, rows, repeats, eval samples,
# processes per host, the sizes a benchmark sweeps); a list value may only lose members.
SHRINK_KEYS = {
    "train.steps", "data.test_samples", "data.global_batch_size", "data.train_samples", "data.epochs", "data.max_table_rows",
    "data.batch_size", "checkpoint.every", "--steps", "--repeat", "--warmup", "--sample-every",
    "--splits", "--measure-steps", "--herald-steps", "--plan-steps", "--sizes", "--budget",
    "--jobs", "--slices", "placement.plan_steps", "--batch-sizes", "--nproc_per_node", "--rows",
    "--tables", "--dim", "--batch", "--eval-samples", "--resume-worlds", "--workers", "--np",
    "--models", "--hash-rows", "--workloads", "--alphas", "--cache-shares", "--model", "--limit", "--cache", "--resume-steps",
}
# Switches an entry may add where the text beside the command does not need what they turn off.
OFF_SWITCHES = {"checkpoint.enabled=false", "train.tensorboard=false", "--quick", "train.progress=off",
                "--no-progress"}

# Rows of the sample that each file placeholder gets (train rows first; test rows from the tail).
FILE_ROWS = {"FILE.tsv": (0, 600), "TRAIN.tsv": (0, 500), "TEST.tsv": (1600, 1800),
             "train.txt": (0, 400), "day_0.gz": (0, 200), "day_1.gz": (200, 400),
             "day_23.gz": (1600, 1800)}
TRAINER_LINE = ("world_size", "steps", "samples_per_sec", "final_loss", "eval_auc", "bytes_per_sample")
SUMMARY_RE = r"(?m)^summary: (?P<path>\S+summary\.json)$"


@dataclasses.dataclass(frozen=True)
class Entry:
    """How one documented command is run and checked."""

    shrink: tuple[tuple[str, str], ...] = ()  # (old, new) text: the same key with a lower value
    add: tuple[str, ...] = ()  # appended arguments: SHRINK_KEYS with a value, or OFF_SWITCHES
    rows: tuple[tuple[str, int, int], ...] = ()  # file placeholder -> sample rows [a, b), if not FILE_ROWS'
    writes_dir: bool = False  # the command creates DIR itself (no prepared sample is linked)
    files: tuple[str, ...] = ()  # paths (relative to the scratch dir) that must exist afterwards
    json_keys: tuple[str, ...] = ()  # keys of the last JSON line of stdout
    json_values: tuple[tuple[str, object], ...] = ()  # (key, value) the last JSON line must hold
    stdout: Optional[str] = None  # a pattern stdout must match
    summary: bool = False  # the trainer's "summary: PATH" line names a file that exists
    marks: tuple[str, ...] = ()  # gpu, docker, netns
    elsewhere: Optional[str] = None  # "tests/FILE.py::TEST": that test runs it, as `documented(text)` gives it
    ci: Optional[str] = None  # "setup+run": .ci/run runs its set-up, run the rest; "setup+ci": .ci/run runs it
    cleanup: Optional[str] = None  # run after the block whatever happened (e.g. tear a cluster down)
    check: Optional[Callable[..., None]] = None  # more checks: check(scratch dir, stdout)
    in_checkout: bool = False  # run in the checkout itself (docker build: its context must be real files)
    host: Optional[int] = None  # run inside emulated host k (named host1, host2, ...), at once with the block's others
    serves: Optional[str] = None  # a server: passes once stderr or stdout matches this, then it is stopped
    timeout: int = 300


def newest_summary(cwd: Path) -> dict:
    """The summary.json a command of the block wrote last (under outputs/ or runs/)."""
    paths = sorted(cwd.glob("outputs/**/summary.json"), key=lambda p: p.stat().st_mtime)
    assert paths, f"no summary.json under {cwd / 'outputs'}"
    return json.loads(paths[-1].read_text())


def _resume_logged(cwd: Path, out: str = "") -> None:
    lines = [json.loads(x) for x in (cwd / "runs/ck/metrics.jsonl").read_text().splitlines() if x.strip()]
    assert any(r.get("event") == "resume" for r in lines), "no resume line in runs/ck/metrics.jsonl"
    s = json.loads((cwd / "runs/ck/summary.json").read_text())
    assert s["resumed_from"] and s["start_step"] > 0, (s["resumed_from"], s["start_step"])


def _sweep_jobs(n: int, sweep: str) -> Callable[[Path], None]:
    def check(cwd: Path, out: str = "") -> None:
        for k in range(n):
            assert (cwd / sweep / str(k) / "summary.json").is_file(), f"{sweep}/{k}/summary.json missing"
    return check


def _bf16_rows(cwd: Path, out: str = "") -> None:
    e = json.loads((cwd / "runs/bf16/summary.json").read_text())["embedding"]
    assert e["dtype"] == "bf16" and e["bytes_per_row"] == {"row": 32, "state": 0, "version": 8, "total": 40}, e


def _amp_summary(cwd: Path, out: str = "") -> None:
    p = json.loads((cwd / "runs/amp/summary.json").read_text())["precision"]
    assert p["dense"] == "bf16" and p["loss_scale"] is None, p


def _trained_on_the_run_device(cwd: Path, out: str = "") -> None:
    """The W = 2 runs trained where train.device=auto says (the GPUs where there are any) and
    their collectives followed: nccl with a GPU per rank, gloo on the CPU or ranks sharing a GPU."""
    import torch
    runs = [json.loads(p.read_text()) for p in cwd.glob("outputs/**/summary.json")]
    w2 = [s for s in runs if s["world_size"] == 2]
    assert w2, f"no W = 2 summary.json under {cwd / 'outputs'}"
    gpu = torch.cuda.is_available()
    for s in w2:
        assert s["device"] == ("cuda" if gpu else "cpu"), s["device"]
        assert s["transport"] == ("nccl" if gpu and torch.cuda.device_count() >= 2 else "gloo"), s["transport"]


def _scores_are_the_runs_test_auc(cwd: Path, out: str = "") -> None:
    """docs/serving.md: the scores of DIR's test rows (TEST.tsv: the same rows) have the run's test AUC."""
    import numpy as np
    from trainer.run.evaluation.metrics import auc_logloss
    scores = np.loadtxt(cwd / "scores.txt")
    labels = np.array([float(line.split("\t", 1)[0]) for line in (cwd / "TEST.tsv").read_text().splitlines()])
    s = json.loads((cwd / "runs/criteo/summary.json").read_text())
    assert scores.shape == labels.shape == (s["eval_samples"],), (scores.shape, labels.shape, s["eval_samples"])
    auc = auc_logloss(np.log(scores) - np.log1p(-scores), labels)[0]
    assert abs(auc - s["eval_auc"]) <= 1e-6, (auc, s["eval_auc"])


TRAINER = dict(json_keys=TRAINER_LINE, summary=True)
W2 = ("train.steps=4", "data.test_samples=512", "checkpoint.enabled=false")

def _vocabulary_prepared(cwd: Path, out: str = "") -> None:
    """docs/data.md: a vocabulary of the values seen >= 4 times (ids 0 empty, 1 rare, 2 + rank)."""
    meta = json.loads((cwd / "VOCAB_DIR/meta.json").read_text())
    cat = meta["categorical"]
    assert cat["kind"] == "vocab" and cat["min_count"] == 4 and meta["table_rows"] == [2 + n for n in cat["vocab_sizes"]], cat


def _dynamic_reported(cwd: Path, out: str = "") -> None:
    """docs/dynamic.md: the run reports its pool, in summary.json and in every metrics line."""
    d = json.loads((cwd / "runs/dyn/summary.json").read_text())["dynamic"]
    assert d["admissions"] > 0 and d["admissions"] - d["evictions"] == d["rows_in_use"], d
    assert d["dropped_grads"] > 0 and d["admit_after"] == 2, d  # ids seen once lose their gradient
    lines = [json.loads(x) for x in (cwd / "runs/dyn/metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in lines if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == [4, 8], [r.get("step") for r in lines]  # train.log_every=4 of 8 steps
    assert all("dynamic" in r and r["dynamic"]["rows_in_use"] > 0 for r in steps), "a step line without its dynamic block"


def _checkpoints_saved(*steps: int) -> Callable[[Path], None]:
    """docs/operations.md: the run saved a checkpoint at each of `steps` (the every-N saves and the last)."""
    def check(cwd: Path, out: str = "") -> None:
        got = sorted(p.name for p in (cwd / "runs/ck/checkpoints").iterdir() if p.name.startswith("step_"))
        assert got == [f"step_{k:08d}" for k in steps], got
    return check


def _resumed_on_two(cwd: Path, out: str = "") -> None:
    """docs/operations.md: continues from the last checkpoint (step 4 once shrunk) on 2 workers."""
    _resume_logged(cwd)
    s = json.loads((cwd / "runs/ck/summary.json").read_text())
    assert (s["start_step"], s["world_size"], s["steps"]) == (4, 2, 8), (s["start_step"], s["world_size"], s["steps"])
    assert s["resumed_from"].endswith("step_00000004"), s["resumed_from"]


def _hashed_rows(cwd: Path, out: str = "") -> None:
    """docs/data.md: hashing into 1M rows per table, the test file as the test split."""
    meta = json.loads((cwd / "DIR/meta.json").read_text())
    assert meta["categorical"]["kind"] == "hash" and meta["table_rows"] == [1_000_000] * 26, meta["table_rows"]
    assert meta["splits"]["train"]["rows"] == 400 and meta["splits"]["test"]["rows"] == 200, meta["splits"]


def _recipe_and_test_split(cwd: Path, out: str = "") -> None:
    """README: the recipe for DIR's size (tiny: < 100,000 rows), evaluated on the 200 rows of TEST.tsv."""
    s = newest_summary(cwd)
    assert s["recipe"]["name"] == "tiny" and s["eval_samples"] == 200, (s["recipe"], s["eval_samples"])


def _one_line_per_model(cwd: Path, out: str = "") -> None:
    """docs/recipe.md: LR and the four default commands on one pair, one JSON line each."""
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    runs = [r.get("baseline") or r.get("model") for r in lines if "split" in r]
    assert runs == ["lr", "dlrm", "wdl", "deepfm", "dcn"], lines


def _placement_measured(cwd: Path, out: str = "") -> None:
    """docs/placement.md: SCA's plan trained; summary.json's placement holds predicted vs measured bytes."""
    p = newest_summary(cwd)["placement"]
    pvm = p["predicted_vs_measured"]
    assert p["name"] == "sca" and pvm["predicted"] > 0 and pvm["measured"] > 0, p


def _raw_ids(cwd: Path, out: str = "") -> None:
    """docs/dynamic.md: --raw-ids keeps the values' 32 bits (no hashing, no vocabulary)."""
    meta = json.loads((cwd / "RAW_DIR/meta.json").read_text())
    assert meta["categorical"]["kind"] == "raw", meta["categorical"]


def _dynamic_on_raw_ids(cwd: Path, out: str = "") -> None:
    d = newest_summary(cwd)["dynamic"]
    assert d["admissions"] > 0 and d["rows_in_use"] > 0, d


def _both_worlds(cwd: Path, out: str = "") -> None:
    """benchmarks/README.md: the bench workload at W = 1 and W = 2."""
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert sorted(r["world_size"] for r in lines) == [1, 2], lines


REGISTRY: dict[str, Entry] = {
    # README: the two commands at the top (what .ci/run runs)
    "bash scripts/setup.sh && .venv/bin/python -m trainer":
        Entry(ci="setup+run", add=("train.steps=4", "data.test_samples=512"), **TRAINER),
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q": Entry(ci="setup+ci"),
    # docs/running.md: On Slurm (a real Slurm on this host: tests/slurm_helpers.py)
    "sbatch scripts/slurm/train.sbatch hydra.run.dir=runs/slurm":
        Entry(elsewhere="tests/distributed/test_slurm.py::test_a_preempted_job_saves_requeues_itself_and_resumes",
              add=("train.steps=200", "data.test_samples=512", "train.progress=off")),
    "scancel --signal=TERM JOBID":
        Entry(elsewhere="tests/distributed/test_slurm.py::test_a_preempted_job_saves_requeues_itself_and_resumes"),
    "srun --nodes=2 --ntasks-per-node=1 .venv/bin/python -m trainer comm=torch hydra.run.dir=runs/srun":
        Entry(elsewhere="tests/distributed/test_slurm.py::test_srun_one_task_per_rank_equals_torchrun",
              add=("train.steps=12", "data.test_samples=512", "train.progress=off")),
    ".venv/bin/python -m dev.slurmcluster -- srun --nodes=2 --ntasks-per-node=1 --export=ALL,MASTER_ADDR=127.0.0.1 "
    ".venv/bin/python -m trainer comm=torch train.steps=20 hydra.run.dir=runs/srun-local":
        Entry(elsewhere="tests/distributed/test_slurm.py::test_slurm_on_one_machine_as_the_docs_show_it",
              add=("data.test_samples=512", "train.progress=off")),
    "sbatch --array=0-1 scripts/slurm/sweep.sbatch consistency.pull_bound=0,4 cache=lfu hydra.sweep.dir=multirun/stale-slurm":
        Entry(elsewhere="tests/distributed/test_slurm.py::test_an_array_job_sweeps_the_staleness_bound_and_plot_sweep_plots_it",
              add=("train.steps=12", "data.test_samples=512", "train.progress=off")),
    ".venv/bin/python scripts/plot_sweep.py multirun/stale-slurm --out stale-slurm.png":
        Entry(elsewhere="tests/distributed/test_slurm.py::test_an_array_job_sweeps_the_staleness_bound_and_plot_sweep_plots_it"),
    # README: Running
    ".venv/bin/python -m trainer model=dcn optim=adam train.steps=600 hydra.run.dir=runs/dcn":
        Entry(shrink=(("train.steps=600", "train.steps=4"),), add=("data.test_samples=512",),
              files=("runs/dcn/summary.json",), json_values=(("world_size", 1), ("steps", 4)), **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch": Entry(add=W2, json_values=(("world_size", 2),), **TRAINER),
    ".venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m trainer comm=horovod hydra.run.dir=runs/hvd":
        Entry(add=W2, files=("runs/hvd/summary.json",), json_values=(("world_size", 2),), **TRAINER),
    # README: Real data
    ".venv/bin/python scripts/prepare_criteo.py --train TRAIN.tsv --test TEST.tsv --out DIR":
        Entry(writes_dir=True, files=("DIR/meta.json",)),
    ".venv/bin/python -m trainer data=criteo data.dir=DIR":
        Entry(add=("data.epochs=1",), check=_recipe_and_test_split, **TRAINER),
    # docs/serving.md: train, export, predict the test rows (their AUC: the run's test AUC)
    ".venv/bin/python -m trainer data=criteo data.dir=DIR train.ensemble=1 train.early_stop.restore_best=false hydra.run.dir=runs/criteo":
        Entry(add=("data.epochs=1",), files=("runs/criteo/summary.json",), **TRAINER),
    ".venv/bin/python -m trainer.serving export runs/criteo --out my-model": Entry(files=("my-model/artifact.json",)),
    ".venv/bin/python -m trainer.serving predict my-model --input TEST.tsv --out scores.txt":
        Entry(rows=(("TEST.tsv", 1600, 1999),), files=("scores.txt",), check=_scores_are_the_runs_test_auc),
    ".venv/bin/python scripts/baseline_lr.py DIR": Entry(json_keys=("eval_auc", "eval_logloss", "C")),
    # docs/running.md: both lines at once, each in its emulated host (named host1, host2)
    # docs/running.md's elastic recipe: one line on every node (a lost node killed, then back)
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .venv/bin/torchrun --nnodes 1:2 --nproc_per_node 8 --max-restarts 100 --rdzv-backend c10d --rdzv-endpoint host1:29400 --rdzv-id run1 --rdzv-conf last_call_timeout=10 -m trainer comm=torch data.global_batch_size=16384 checkpoint.every=500 checkpoint.resume=auto hydra.run.dir=DIR/run1":
        Entry(shrink=(("--nproc_per_node 8", "--nproc_per_node 1"), ("data.global_batch_size=16384", "data.global_batch_size=64"),
                           ("checkpoint.every=500", "checkpoint.every=20")),
                   elsewhere="tests/distributed/test_elastic.py::test_a_lost_node_restarts_the_job_at_w1_and_its_return_at_w2"),
    ".venv/bin/torchrun --nnodes 2 --node_rank 0 --master_addr host1 --master_port 29500 --nproc_per_node 8 -m trainer comm=torch":
        Entry(host=0, marks=("netns",), shrink=(("--nproc_per_node 8", "--nproc_per_node 1"),), add=W2,
              json_values=(("world_size", 2),), **TRAINER),
    ".venv/bin/torchrun --nnodes 2 --node_rank 1 --master_addr host1 --master_port 29500 --nproc_per_node 8 -m trainer comm=torch":
        Entry(host=1, marks=("netns",), shrink=(("--nproc_per_node 8", "--nproc_per_node 1"),), add=W2),
    "docker build -t hybrid-trainer .": Entry(marks=("docker",), in_checkout=True, timeout=3600),
    # docs/running.md, On Kubernetes: no cluster here; each test takes the manifest `kubectl apply -f` names
    # and runs its pods' commands with the environment the operator gives them
    "kubectl apply -f deploy/k8s/pvc.yaml": Entry(elsewhere="tests/distributed/test_k8s_env.py::test_the_manifests_fields"),
    "kubectl apply -f deploy/k8s/pytorchjob.yaml":
        Entry(elsewhere="tests/distributed/test_k8s_env.py::test_pytorchjob_pods_train_as_torchrun"),
    "kubectl apply -f deploy/k8s/pytorchjob-torchrun.yaml":
        Entry(elsewhere="tests/distributed/test_k8s_env.py::test_pytorchjob_with_nproc_per_node_runs_torchrun_from_pet_variables"),
    "kubectl apply -f deploy/k8s/mpijob.yaml":
        Entry(elsewhere="tests/distributed/test_k8s_env.py::test_mpijob_launcher_runs_horovodrun_on_the_operators_hostfile"),
    # README (In a container) and docs/running.md: the cpu image (cached: a build with nothing
    # changed takes seconds; tests/tools/test_image.py builds it first in a full run)
    "bash scripts/build_image.sh cpu": Entry(marks=("docker",), in_checkout=True, timeout=3600,
                                             stdout=r"(?m)^hybrid-trainer:cpu$"),
    "podman run --rm --network none hybrid-trainer:cpu python -m trainer train.steps=100":
        Entry(marks=("docker",), shrink=(("train.steps=100", "train.steps=4"),), add=("data.test_samples=512",),
              json_keys=TRAINER_LINE, timeout=600),
    "mkdir -p runs && podman run --rm --network none -v $PWD/runs:/runs hybrid-trainer:cpu horovodrun -np 2 -H localhost:2 --gloo python -m trainer comm=horovod hydra.run.dir=/runs/img":
        Entry(marks=("docker",), add=W2, files=("runs/img/summary.json",), json_keys=TRAINER_LINE, timeout=600),
    "docker run --rm --gpus all --ipc host hybrid-trainer horovodrun -np 8 -H localhost:8 python -m trainer comm=horovod":
        Entry(marks=("docker", "gpu"), add=("train.steps=4",), json_keys=TRAINER_LINE, timeout=900),
    ".venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m trainer -m optim.lr=0.01,0.1 hydra.sweep.dir=multirun/lr":
        Entry(add=W2, check=_sweep_jobs(2, "multirun/lr")),
    # docs/operations.md
    ".venv/bin/python -m trainer train.steps=100 checkpoint.every=50 hydra.run.dir=runs/ck":
        Entry(shrink=(("train.steps=100", "train.steps=4"), ("checkpoint.every=50", "checkpoint.every=2")),
              add=("data.test_samples=512",), check=_checkpoints_saved(2, 4), **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch train.steps=300 checkpoint.resume=auto hydra.run.dir=runs/ck":
        Entry(shrink=(("train.steps=300", "train.steps=8"),), add=("data.test_samples=512",),
              check=_resumed_on_two, **TRAINER),
    # docs/data.md
    ".venv/bin/python scripts/prepare_criteo.py --train day_0.gz day_1.gz --test day_23.gz --out DIR":
        Entry(writes_dir=True, check=_hashed_rows),
    ".venv/bin/python scripts/prepare_criteo.py --train train.txt --out VOCAB_DIR --min-count 4":
        Entry(files=("VOCAB_DIR/meta.json",), check=_vocabulary_prepared),
    ".venv/bin/python -m trainer data=movielens optim=adam optim.sparse_lr=0.2 train.steps=600":
        # "eval AUC about 0.77" needs the 600 steps (~30 s alone, minutes on a busy machine): not
        # checked here; tests/unit/test_real_data.py trains MovieLens.
        Entry(shrink=(("train.steps=600", "train.steps=20"),), **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch data=criteo data.dir=DIR":
        # the README's and gpu.md's GPU command: runs on the CPU too; on a GPU machine it must train there
        Entry(add=("data.epochs=1", "data.test_samples=256"), check=_trained_on_the_run_device, **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch data=criteo data.dir=DIR model=dcn":
        Entry(add=("data.epochs=1", "data.test_samples=256"), json_values=(("world_size", 2),), **TRAINER),
    ".venv/bin/python scripts/baseline_lr.py DIR --compare model=dcn":
        Entry(add=("data.epochs=1",), json_keys=("lr_eval_auc", "trainer_eval_auc", "trainer_minus_lr_auc")),
    # docs/recipe.md
    ".venv/bin/python -m dev.recipe_study.compare_splits TRAIN.tsv --test TEST.tsv":
        Entry(add=("data.epochs=1",), check=_one_line_per_model, timeout=600),
    ".venv/bin/python -m dev.recipe_study.compare_splits FILE.tsv --splits 16 --models dlrm > base.jsonl":
        Entry(shrink=(("--splits 16", "--splits 2"),), add=("data.epochs=1",), files=("base.jsonl",), timeout=600),
    ".venv/bin/python -m dev.recipe_study.compare_splits FILE.tsv --splits 16 --models dlrm optim.lr=0.0005 > new.jsonl":
        Entry(shrink=(("--splits 16", "--splits 2"),), add=("data.epochs=1",), files=("new.jsonl",), timeout=600),
    ".venv/bin/python -m dev.recipe_study.paired_splits base.jsonl new.jsonl": Entry(json_keys=("model",)),
    # docs/cache.md
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer -m comm=torch data=criteo_like optim=adam cache=lfu "
    "consistency.pull_bound=0,1,4,16 'consistency.push_bound=${consistency.pull_bound}' hydra.sweep.dir=multirun/stale":
        Entry(add=W2 + ("data.max_table_rows=10000",), check=_sweep_jobs(4, "multirun/stale"), timeout=600),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch data=criteo_like optim=adam hydra.run.dir=runs/nocache":
        Entry(add=W2 + ("data.max_table_rows=10000",), files=("runs/nocache/summary.json",), **TRAINER),
    ".venv/bin/python scripts/plot_sweep.py multirun/stale --baseline runs/nocache/summary.json --out stale.png":
        Entry(files=("stale.png",), json_keys=("png", "points", "chosen")),
    ".venv/bin/python scripts/simulate_cache.py --workers 2 --steps 400 data=criteo_like cache=lfu consistency.pull_bound=16 consistency.push_bound=16":
        Entry(shrink=(("--steps 400", "--steps 4"),), add=("data.max_table_rows=10000",),
              json_keys=("hit_rate", "bytes_per_sample")),
    # docs/dynamic.md
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch embedding.kind=dynamic embedding.capacity=300 "
    "embedding.admit_after=2 data.scramble_ids=true checkpoint.enabled=false train.steps=40 train.log_every=4 "
    "hydra.run.dir=runs/dyn":
        Entry(shrink=(("train.steps=40", "train.steps=8"),), add=("data.test_samples=512",),
              check=_dynamic_reported, **TRAINER),
    ".venv/bin/python scripts/prepare_criteo.py --train TRAIN.tsv --test TEST.tsv --out RAW_DIR --raw-ids":
        Entry(files=("RAW_DIR/meta.json",), check=_raw_ids),
    ".venv/bin/python -m trainer data=criteo data.dir=RAW_DIR embedding.kind=dynamic embedding.capacity=100000 "
    "data.min_count=0 train.ensemble=1":
        Entry(add=("data.epochs=1", "data.test_samples=128"), check=_dynamic_on_raw_ids, **TRAINER),
    # docs/placement.md
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch data=criteo_like cache=lru placement=sca":
        Entry(add=W2 + ("data.max_table_rows=10000", "placement.plan_steps=2"), check=_placement_measured, **TRAINER),
    ".venv/bin/python scripts/plan.py --workers 8 data=criteo_like cache=lru placement=sca":
        Entry(add=("data.max_table_rows=10000", "placement.plan_steps=2"), json_keys=("name", "hot_rows")),
    # docs/cluster.md (root networking)
    ".venv/bin/python -m dev.netcluster up --hosts 2 --rate 200mbit --ssh --ttl 600": Entry(marks=("netns",)),
    ".venv/bin/python -m dev.netcluster torchrun -- -m trainer comm=torch data=bench train.steps=50":
        Entry(marks=("netns",), shrink=(("train.steps=50", "train.steps=4"),),
              add=("data.test_samples=512", "checkpoint.enabled=false"), json_keys=TRAINER_LINE),
    '.venv/bin/python -m dev.netcluster horovodrun -- "$PWD/.venv/bin/python" -m trainer comm=horovod data=bench train.steps=50':
        Entry(marks=("netns",), shrink=(("train.steps=50", "train.steps=4"),),
              add=("data.test_samples=512", "checkpoint.enabled=false"), json_keys=TRAINER_LINE),
    ".venv/bin/python -m dev.netcluster down":
        Entry(marks=("netns",), cleanup=".venv/bin/python -m dev.netcluster down"),
    # docs/gpu.md
    'PYTHON="$PWD/.venv/bin/python" bash scripts/gpu_check.sh OUT':
        Entry(marks=("gpu",), files=("OUT/check.log",), timeout=1800),
    'PART=step PYTHON="$PWD/.venv/bin/python" bash scripts/gpu_check.sh OUT':
        Entry(marks=("gpu",), files=("OUT/check.log", "OUT/step.jsonl"), timeout=1800),
    ".venv/bin/python -m dev.gpu_parity --jobs 8 --out gpu_parity.jsonl":
        Entry(marks=("gpu",), files=("gpu_parity.jsonl",), timeout=1800),
    ".venv/bin/python -m pytest -q -m gpu tests/unit/test_step_device.py tests/kernels/test_kernel_*.py":
        Entry(marks=("gpu",), timeout=900),
    # docs/config.md
    ".venv/bin/python -m trainer data=criteo_like train.precision=bf16 hydra.run.dir=runs/amp":
        Entry(add=("train.steps=4", "data.test_samples=512", "data.max_table_rows=10000"),
              files=("runs/amp/summary.json",), check=_amp_summary, **TRAINER),
    ".venv/bin/python -m trainer data=criteo_like embedding.dtype=bf16 hydra.run.dir=runs/bf16":
        Entry(add=("train.steps=4", "data.test_samples=512", "data.max_table_rows=10000"),
              files=("runs/bf16/summary.json",), check=_bf16_rows, **TRAINER),
    # docs/development.md
    ".venv/bin/python scripts/check_imports.py": Entry(stdout=r"no import cycle"),
    # benchmarks/README.md
    ".venv/bin/python -m benchmarks.bench_train --steps 60":
        Entry(shrink=(("--steps 60", "--steps 2"),), json_keys=("samples_per_sec",), check=_both_worlds),
    ".venv/bin/python -m benchmarks.bench_train --workload mlperf --worlds 1 --steps 30 --batch-sizes 2048 "
    "--precisions fp32 bf16 -- data.max_table_rows=200000":
        Entry(shrink=(("--steps 30", "--steps 2"), ("--batch-sizes 2048", "--batch-sizes 64"),
                      ("data.max_table_rows=200000", "data.max_table_rows=2000")),
              add=("data.test_samples=512",), json_keys=("samples_per_sec", "ms_per_step", "precision"),
              stdout=r'(?m)^\{.*"workload": "mlperf".*"precision": "fp32".*\n\{.*"workload": "mlperf".*"precision": "bf16"'),
    ".venv/bin/python -m benchmarks.bench_cache":
        Entry(add=("--steps", "6", "--warmup", "2"), json_keys=("read_ms", "write_ms")),
    ".venv/bin/python -m benchmarks.bench_comm --all":
        Entry(elsewhere="tests/tools/test_scripts.py::test_bench_comm_all_launches_torchrun_and_horovodrun",
              add=("--sizes", "1KiB,16KiB", "--budget", "64KiB")),
    ".venv/bin/python -m benchmarks.bench_data --repeat 200":
        Entry(elsewhere="tests/tools/test_scripts.py::test_bench_data_measures_prepare_and_both_loaders",
              shrink=(("--repeat 200", "--repeat 2"),), add=("--workers", "1", "--steps", "3", "--batch", "256")),
    ".venv/bin/python -m benchmarks.bench_placement":
        Entry(add=("--steps", "2", "--herald-steps", "2")),
    ".venv/bin/python -m benchmarks.soak":
        Entry(add=("--steps", "40", "--sample-every", "10", "--warmup", "10"),
              json_keys=("rss_slope_mib_per_1k_steps", "throughput_drift")),
    ".venv/bin/python -m benchmarks.bench_scale --rows 2000000 --worlds 1 2":
        Entry(elsewhere="tests/tools/test_bench_scale.py::test_every_phase_of_a_train_and_a_resume_at_2w",
              shrink=(("--rows 2000000", "--rows 4000"),),
              add=("--tables", "2", "--dim", "8", "--resume-worlds", "2", "--steps", "2", "--batch", "64",
                   "--eval-samples", "256")),
    ".venv/bin/python -m benchmarks.bench_kernels --dims 16 64 128 --bags 8 32":
        Entry(marks=("gpu",), json_keys=("kernel", "impl", "gbps"), timeout=900),
    ".venv/bin/python -m benchmarks.bench_train --worlds 1 --steps 60 -- train.device=cuda":
        Entry(marks=("gpu",), shrink=(("--steps 60", "--steps 4"),), json_keys=("samples_per_sec",), timeout=900),
    ".venv/bin/python -m benchmarks.bench_train --workload mlperf --worlds 1 --steps 30 --batch-sizes 2048 16384 "
    "65536 --precisions fp32 bf16 -- train.device=cuda":
        Entry(marks=("gpu",), shrink=(("--steps 30", "--steps 4"),), json_keys=("samples_per_sec", "ms_per_step"),
              timeout=900),
    ".venv/bin/python -m benchmarks.bench_net --links 200mbit --repeat 3 --steps 120":
        Entry(elsewhere="tests/tools/test_bench_net.py::test_readme_command_on_a_shaped_link",
              shrink=(("--repeat 3", "--repeat 1"), ("--steps 120", "--steps 4")), add=("--quick",)),
}


# ---------------------------------------------------------------------------------------------
# Parsing the docs


@dataclasses.dataclass(frozen=True)
class Command:
    file: str
    line: int  # 1-based line of the command's first line
    text: str  # joined, comment stripped
    comment: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment): `#` outside quotes, at the start or after whitespace, begins a comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def parse_blocks(rel: str) -> list[list[Command]]:
    """The bash blocks of one file, each a list of its commands."""
    blocks: list[list[Command]] = []
    fence: Optional[str] = None  # the info string of the open fence, if any
    pending: list[str] = []
    start = 0
    for n, raw in enumerate((ROOT / rel).read_text().splitlines(), 1):
        stripped = raw.strip()
        if fence is None:
            m = re.match(r"^```\s*(\S*)", stripped)
            if m:
                fence = m.group(1)
                if fence == "bash":
                    blocks.append([])
            continue
        if stripped.startswith("```"):
            assert not pending, f"{rel}:{start}: a continued line runs into the end of its block"
            fence = None
            continue
        if fence != "bash":
            continue
        if not pending:
            start = n
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1].strip())
            continue
        pending.append(stripped)
        text, comment = split_comment(" ".join(p for p in pending if p))
        pending = []
        if text.strip():
            blocks[-1].append(Command(rel, start, text.strip(), comment))
    assert fence is None, f"{rel}: a fenced block is never closed"
    return [b for b in blocks if b]


def all_blocks() -> list[list[Command]]:
    return [b for rel in DOCS if (ROOT / rel).is_file() for b in parse_blocks(rel)]


def all_commands() -> list[Command]:
    return [c for b in all_blocks() for c in b]


# Inline code that reads as a command: a program a user would type with its arguments (after any
# VAR=value settings), or a script of ours (a path ending in .py or .sh) with arguments that are
# options, key=value overrides or the docs' placeholders (`cache.py TICK_BITS` names a symbol in a
# file and is not a command). A span may wrap onto the next line. Each must be one of the block
# commands, or the start of one (a user finds it run as written there), or an abbreviation (`...`, a
# <placeholder>, [optional] parts, a|b alternatives), or have an entry in INLINE (run like a block
# command, or by the test it names), or be one of INLINE_NOT_RUN, each with why it is not run:
# nothing a user copies from a sentence goes untested.
PROGRAMS = r"python3?|torchrun|horovodrun|bash|docker|podman|pytest|pip|tensorboard|srun|sbatch|hybrid-trainer[\w-]*"
ENV_SETTINGS = r"(?:[A-Z_][A-Z0-9_]*=\S+\s+)*"
INLINE_PROGRAM = re.compile(rf"^{ENV_SETTINGS}(?:\.venv/bin/)?(?:{PROGRAMS})\s+\S")
INLINE_SCRIPT = re.compile(rf"^{ENV_SETTINGS}(?:(?:\.venv/bin/)?python3?\s+)?[\w./-]+\.(?:py|sh)\s+(?P<args>.+)$")
PLACEHOLDERS = ("DIR", "OUT", "FILE.tsv", "TRAIN.tsv", "TEST.tsv", "host1", "host2")


def reads_as_command(span: str) -> bool:
    text = " ".join(span.split())
    if INLINE_PROGRAM.match(text):
        return True
    m = INLINE_SCRIPT.match(text)
    return bool(m) and any(a.startswith("-") or "=" in a or a in PLACEHOLDERS or re.search(r"/|\.[a-z]+$", a)
                           for a in m.group("args").split())


def abbreviated(text: str) -> bool:
    """A shortened form: `...`, a <placeholder>, an [optional] part, a|b alternatives, a count
    named by one capital letter (`--nproc_per_node N`)."""
    return "..." in text or bool(re.search(r"<\w+>|\[[^\]]+\]|\w\|\w|(?:^|\s)[A-Z](?:\s|$)", text))


INLINE_NOT_RUN = {
    "python -m trainer.run.job --": "the job wrapper's name before a launcher's command "
                                    "(tests/distributed/test_job_status.py runs it under torchrun and horovodrun)",
    "python -m trainer.run.job --lost-worker-exit 203 --": "the start of deploy/k8s/'s pod commands "
                                                          "(tests/distributed/test_k8s_env.py runs them from the manifests)",
    "docker info": "the check that a container engine is there (the docker marker's own test)",
    "podman info": "the check that a container engine is there (the docker marker's own test)",
    "podman import": "names a step of scripts/build_image.sh (tests/tools/test_image.py builds the image)",
    "pip wheel": "names a step of scripts/build_image.sh (tests/tools/test_image.py builds the image)",
    "pip install --no-deps -e .": "a step of the Dockerfile (tests/tools/test_image.py builds the image)",
    'python -c "import torch; print(torch.cuda.get_device_name(), torch.version.cuda)"':
        "prints the GPU's name: gpu.md's first step on a lent machine",
    "pytest -m gpu -n 8 tests/unit/test_gpu_paths.py": "a GPU machine's parallel form of tests/unit/test_gpu_paths.py",
    "pytest -m gpu tests/unit/test_gpu_paths.py -k criteo": "runs only with a GPU (the gpu marker)",
    "pytest -m gpu tests/unit/test_dali_loader.py": "runs only with a GPU (the gpu marker)",
    "pytest -q -m gpu tests/unit/test_step_device.py": "runs only with a GPU (the gpu marker)",
    "pytest -q -s tests/unit/test_step_device.py": "the CPU audit: part of the suite CI runs",
    "pytest -q -s tests/unit/test_step_device.py -k het": "the CPU audit of the cache's step: part of the suite CI runs",
    "torchrun --standalone": "the launcher's option, named in a sentence",
    "torchrun --nproc_per_node 2": "the launcher's option, named in a sentence",
    "horovodrun --gloo": "the launcher's option, named in a sentence",
    ".venv/bin/python -m pytest -q": "the suite itself (what .ci/run runs)",
    ".venv/bin/python -m pytest -q tests/docs/test_docs_commands.py": "this test",
}


def _normal(text: str) -> str:
    """A command as a user would type it anywhere: no leading VAR=value settings, no .venv/bin/
    prefix, no `python` before a script, a script by its file name, one space between words."""
    text = re.sub(rf"^{ENV_SETTINGS}", "", " ".join(text.split()))
    text = re.sub(r"(^|\s)\.venv/bin/", r"\1", text)
    text = re.sub(r"^python3?\s+(?=[\w./-]+\.(?:py|sh)\b)", "", text)
    return re.sub(r"^[\w./-]*/(?=[\w-]+\.(?:py|sh)\b)", "", text)


def inline_commands(rel: str) -> list[tuple[int, str]]:
    """(line, text) of the inline code spans of a file, outside fenced blocks, that read as commands
    (a span may wrap onto the next line: its text is joined)."""
    kept, fenced = [], False
    for line in (ROOT / rel).read_text().splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            kept.append("")
            continue
        kept.append("" if fenced else line)
    text = "\n".join(kept)
    out = []
    for m in re.finditer(r"`([^`]+)`", text):
        span = m.group(1)
        if "\n\n" in span or not span.strip():
            continue
        if reads_as_command(span):
            out.append((text.count("\n", 0, m.start()) + 1, " ".join(span.split())))
    return out




# Inline commands that run: like a block command of their own (in a scratch directory), or by the
# test they name (`elsewhere`), which takes the command line from `documented`.
INLINE: dict[str, Entry] = {
    # README's performance table: the SSD tier's benchmark
    "python -m benchmarks.bench_store --rows 200000 --steps 300 --warmup 100 --headroom 600M":
        Entry(elsewhere="tests/tools/test_scripts.py::test_bench_store_a_memory_point_then_disk_points_under_a_cgroup",
              shrink=(("--rows 200000", "--rows 3000"), ("--steps 300", "--steps 14"), ("--warmup 100", "--warmup 4")),
              add=("--alphas", "1.1", "--cache-shares", "0.5")),
    # benchmarks/README.md: the SSD tier at scale
    "python -m benchmarks.store_scale --model 20G --limit 8G --cache 6G --steps 300 --resume-steps 60":
        Entry(elsewhere="tests/tools/test_scripts.py::test_store_scale_trains_saves_and_resumes_at_2w_under_cgroups",
              shrink=(("--model 20G", "--model 80M"), ("--limit 8G", "--limit 700M"), ("--cache 6G", "--cache 16M"),
                      ("--steps 300", "--steps 20"), ("--resume-steps 60", "--resume-steps 10"))),
    # README: as a package (tests/tools/test_install.py: a copy of the checkout, a fresh environment)
    "pip wheel --no-deps .": Entry(elsewhere="tests/tools/test_install.py::installed"),
    "pip install .": Entry(elsewhere="tests/tools/test_install.py::installed"),
    "hybrid-trainer model=dcn": Entry(elsewhere="tests/tools/test_install.py::test_the_wheel_trains_from_any_directory",
                                      add=("train.steps=3", "data.test_samples=256", "train.progress=off")),
    "hybrid-trainer-prepare-criteo --train TRAIN.tsv --test TEST.tsv --out DIR":
        Entry(elsewhere="tests/tools/test_install.py::test_the_installed_commands_prepare_and_train_criteo",
              add=("--hash-rows", "1000", "--workers", "1", "--no-progress")),
    "hybrid-trainer-plot-sweep --help":
        Entry(elsewhere="tests/tools/test_install.py::test_the_installed_commands_prepare_and_train_criteo"),
    # docs/outputs.md: TensorBoard serves the run's events
    "tensorboard --logdir OUT": Entry(serves=r"TensorBoard \S+ at http://\S+:\d+/", timeout=120),
    # docs/recipe.md
    "python -m dev.recipe_study.val_rotations DIR": Entry(add=("--slices", "1", "--models", "dlrm", "data.epochs=1"), json_keys=("model",),
                                  timeout=600),
    # README's performance table: the fixed shapes' wire
    "python -m benchmarks.bench_padding --workloads bench mlperf":
        Entry(elsewhere="tests/tools/test_bench_padding.py::test_every_policy_on_the_wire",
              shrink=(("--workloads bench mlperf", "--workloads bench"),),
              add=("--steps", "22", "--batch", "64", "--rows", "3000"), timeout=900),
    # benchmarks/README.md and docs/gpu.md
    "python -m benchmarks.bench_kernels --quick": Entry(json_keys=("kernel", "impl", "gbps")),
    "python -m benchmarks.bench_kernels --dims 128 --bags 1 8": Entry(marks=("gpu",), json_keys=("kernel", "impl", "gbps"), timeout=900),
    "python -m benchmarks.bench_train --workload mlperf --profile-steps 5":
        Entry(marks=("gpu",), json_keys=("samples_per_sec", "ms_per_step"), timeout=1800),
}


# ---------------------------------------------------------------------------------------------
# The command line a documented command runs as


def entry(text: str) -> Entry:
    """The entry of a documented command (a block command or an inline one)."""
    return REGISTRY[text] if text in REGISTRY else INLINE[text]


def script_path(name: str) -> str:
    """The repository path of a user tool a sentence names by its file name alone (`plan.py ...`): a
    script of scripts/ (benchmarks/ and dev/ hold modules, shown as `python -m benchmarks.NAME`)."""
    found = sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "scripts" / name)))
    assert len(found) == 1, f"{name}: {len(found)} scripts of that name in scripts/ ({found})"
    return found[0]


def command_line(text: str, e: Entry) -> str:
    """What runs for the documented command `text`: its set-up left out where .ci/run runs it, its
    shrinks applied, its additions appended, and a script named by its file name alone (in an inline
    command) run from where it is with the virtual environment's python."""
    if e.ci == "setup+run":
        text = text[len(SETUP):]
    for old, new in e.shrink:
        text = text.replace(old, new)
    if e.add:
        text += " " + " ".join(shlex.quote(a) for a in e.add)
    m = re.match(rf"^({ENV_SETTINGS})(?:python3?\s+)?([\w-]+\.(?:py|sh))(?=\s|$)", text)
    if m:
        run = "bash" if m.group(2).endswith(".sh") else ".venv/bin/python"
        text = f"{m.group(1)}{run} {script_path(m.group(2))}{text[m.end():]}"
    return text


def documented(text: str, bin_dir: Optional[str] = None) -> list[str]:
    """The argv of the documented command `text` as its entry runs it, for the test its entry names
    (`elsewhere`): that test runs what the docs print, shrunk only as the registry allows. Programs
    of a virtual environment (`.venv/bin/X`, `pip`, `python`, `hybrid-trainer...`) are taken from
    `bin_dir` (default: this environment's); a shell's redirections and `&&` are not allowed here."""
    line = command_line(text, entry(text))
    assert not re.search(r"[|&;<>]", line), f"{text}: run it in a block, not through documented()"
    settings = re.match(ENV_SETTINGS, line).group(0)  # `NAME=VALUE ... prog`: run as `env NAME=VALUE ... prog`
    argv = shlex.split(line[len(settings):])
    prog = re.sub(r"^\.venv/bin/", "", argv[0])
    if argv[0].startswith(".venv/bin/") or (re.fullmatch(PROGRAMS, prog) and prog not in ("bash", "docker", "podman", "srun", "sbatch")):
        argv[0] = os.path.join(bin_dir or os.path.join(sys.prefix, "bin"), prog)
    return ["env", *shlex.split(settings), *argv] if settings else argv
