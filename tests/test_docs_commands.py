"""Every command shown in the docs runs as written and does what the text beside it says.

Which commands (the rule, also in docs/development.md, "The commands in the docs are tested"):
README.md, docs/*.md and benchmarks/README.md (not the dated reports under benchmarks/reports/,
which record what was run at the time). A command is a line of a fenced block whose info string is
`bash`; a line ending in a backslash continues on the next one; `#` outside quotes (at the start
or after a blank) begins a comment; blank and comment-only lines are skipped. Indented blocks and
fences of another kind (```text) are never run; inline code that reads as a command must be a block
command (or its start), an abbreviation, or listed in INLINE_NOT_RUN with why.

How: REGISTRY maps each command (its exact text, joined, comment stripped) to an Entry: the
overrides that only shrink it (`shrink`: old -> new text, each a key whose value goes down; `add`:
arguments appended, from SHRINK_KEYS or OFF_SWITCHES), the text substitutions of placeholders
(`subs`), and the checks of what the text beside it promises (`files` it writes, the keys of the
JSON line it prints, a pattern of its stdout). Placeholders: `DIR` is a sample of
../shared/data/criteo_sample_2k.tsv prepared once per session (linked into the scratch dir) unless
the entry says the command writes it; `FILE.tsv`, `TRAIN.tsv`, `TEST.tsv`, `train.txt`, `day_*.gz`
are cut from the sample into the scratch dir under their own names; `OUT` is a new directory.

Every block runs in one scratch directory that links the checkout's scripts/, benchmarks/, dev/,
conf/, trainer/, kernels/, tests/ and the virtual environment as .venv, so its relative paths work
as written and nothing is written into the checkout; a block's commands run in order (a later one
may read what an earlier one wrote). Markers: `gpu` (a CUDA device), `docker` (a container
engine), `netns` (root and `ip netns`: runs in this project's CI) on the blocks whose commands need
them, each skipped with its reason where that is missing; an entry with `skip` (real host names)
is listed and skipped with its reason. A command without an entry fails, naming file:line; an
entry whose command is no longer in the docs fails too. The README's two set-up commands are
checked against .ci/run (which runs them) rather than run again; the first one's training part
is run.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "docs" / "*.md"))),
        "benchmarks/README.md"]
SAMPLE = ROOT.parent / "shared" / "data" / "criteo_sample_2k.tsv"
LINKS = ("scripts", "benchmarks", "dev", "conf", "trainer", "kernels", "tests", "Dockerfile",
         "pyproject.toml")
SETUP = "bash scripts/setup.sh && "

# Keys an entry may lower (Hydra overrides and tool flags: steps, rows, repeats, eval samples).
SHRINK_KEYS = {
    "train.steps", "data.eval_samples", "data.train_samples", "data.epochs", "data.max_table_rows",
    "data.batch_size", "checkpoint.every", "--steps", "--repeat", "--warmup", "--sample-every",
    "--splits", "--measure-steps", "--herald-steps", "--plan-steps", "--sizes", "--budget",
    "--jobs", "--slices", "placement.plan_steps", "--batch-sizes",
}
# Switches an entry may add where the text beside the command does not need what they turn off.
OFF_SWITCHES = {"checkpoint.enabled=false", "train.tensorboard=false", "--quick"}

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
    subs: tuple[tuple[str, str], ...] = ()  # placeholder word -> its replacement in the text
    rows: tuple[tuple[str, int, int], ...] = ()  # file placeholder -> sample rows [a, b), if not FILE_ROWS'
    writes_dir: bool = False  # the command creates DIR itself (no prepared sample is linked)
    files: tuple[str, ...] = ()  # paths (relative to the scratch dir) that must exist afterwards
    json_keys: tuple[str, ...] = ()  # keys of the last JSON line of stdout
    stdout: Optional[str] = None  # a pattern stdout must match
    summary: bool = False  # the trainer's "summary: PATH" line names a file that exists
    marks: tuple[str, ...] = ()  # gpu, docker, netns
    skip: Optional[str] = None  # listed, never run here, with this reason
    elsewhere: Optional[str] = None  # "tests/FILE.py::TEST (how it shrinks the command)": that test runs it
    ci: Optional[str] = None  # "setup+run": .ci/run runs its set-up, run the rest; "setup+ci": .ci/run runs it
    cleanup: Optional[str] = None  # run after the block whatever happened (e.g. tear a cluster down)
    check: Optional[Callable[[Path], None]] = None  # more checks on the scratch dir
    in_checkout: bool = False  # run in the checkout itself (docker build: its context must be real files)
    timeout: int = 300


def _resume_logged(cwd: Path) -> None:
    lines = [json.loads(x) for x in (cwd / "runs/ck/metrics.jsonl").read_text().splitlines() if x.strip()]
    assert any(r.get("event") == "resume" for r in lines), "no resume line in runs/ck/metrics.jsonl"
    s = json.loads((cwd / "runs/ck/summary.json").read_text())
    assert s["resumed_from"] and s["start_step"] > 0, (s["resumed_from"], s["start_step"])


def _sweep_jobs(n: int, sweep: str) -> Callable[[Path], None]:
    def check(cwd: Path) -> None:
        for k in range(n):
            assert (cwd / sweep / str(k) / "summary.json").is_file(), f"{sweep}/{k}/summary.json missing"
    return check


def _bf16_rows(cwd: Path) -> None:
    e = json.loads((cwd / "runs/bf16/summary.json").read_text())["embedding"]
    assert e["dtype"] == "bf16" and e["bytes_per_row"] == {"row": 32, "state": 0, "version": 8, "total": 40}, e


def _amp_summary(cwd: Path) -> None:
    p = json.loads((cwd / "runs/amp/summary.json").read_text())["precision"]
    assert p["dense"] == "bf16" and p["loss_scale"] is None, p


def _trained_on_the_run_device(cwd: Path) -> None:
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


TRAINER = dict(json_keys=TRAINER_LINE, summary=True)
W2 = ("train.steps=4", "data.eval_samples=512", "checkpoint.enabled=false")

def _dynamic_reported(cwd: Path) -> None:
    """docs/dynamic.md: the run reports its pool, in summary.json and in every metrics line."""
    d = json.loads((cwd / "runs/dyn/summary.json").read_text())["dynamic"]
    assert d["admissions"] > 0 and d["admissions"] - d["evictions"] == d["rows_in_use"], d
    assert d["dropped_grads"] > 0 and d["admit_after"] == 2, d  # ids seen once lose their gradient
    lines = [json.loads(x) for x in (cwd / "runs/dyn/metrics.jsonl").read_text().splitlines() if x.strip()]
    assert any("dynamic" in r for r in lines), "no dynamic block in metrics.jsonl"


REGISTRY: dict[str, Entry] = {
    # README: the two commands at the top (what .ci/run runs)
    "bash scripts/setup.sh && .venv/bin/python -m trainer":
        Entry(ci="setup+run", add=("train.steps=4", "data.eval_samples=512"), **TRAINER),
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q": Entry(ci="setup+ci"),
    # README: Running
    ".venv/bin/python -m trainer model=dcn optim=adam train.steps=600 hydra.run.dir=runs/dcn":
        Entry(shrink=(("train.steps=600", "train.steps=4"),), add=("data.eval_samples=512",),
              files=("runs/dcn/summary.json",), **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch": Entry(add=W2, **TRAINER),
    ".venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m trainer comm=horovod hydra.run.dir=runs/hvd":
        Entry(add=W2, files=("runs/hvd/summary.json",), **TRAINER),
    # README: Real data
    ".venv/bin/python scripts/prepare_criteo.py --train TRAIN.tsv --test TEST.tsv --out DIR":
        Entry(writes_dir=True, files=("DIR/meta.json",)),
    ".venv/bin/python -m trainer data=criteo data.dir=DIR": Entry(add=("data.epochs=1",), **TRAINER),
    ".venv/bin/python scripts/baseline_lr.py DIR": Entry(json_keys=("eval_auc", "eval_logloss", "C")),
    # docs/running.md
    ".venv/bin/torchrun --nnodes 2 --nproc_per_node 8 --rdzv_endpoint host1:29500 -m trainer comm=torch":
        Entry(marks=("gpu",), skip="needs two hosts with 8 GPUs each (host1, host2): a real cluster; "
                                   "its one-machine form is docs/cluster.md's, run under netns"),
    "docker build -t hybrid-trainer .": Entry(marks=("docker",), in_checkout=True, timeout=3600),
    # README (In a container) and docs/running.md: the cpu image (cached: a build with nothing
    # changed takes seconds; tests/test_image.py builds it first in a full run)
    "bash scripts/build_image.sh cpu": Entry(marks=("docker",), in_checkout=True, timeout=3600,
                                             stdout=r"(?m)^hybrid-trainer:cpu$"),
    "podman run --rm --network none hybrid-trainer:cpu python -m trainer train.steps=100":
        Entry(marks=("docker",), shrink=(("train.steps=100", "train.steps=4"),), add=("data.eval_samples=512",),
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
              add=("data.eval_samples=512",), files=("runs/ck/checkpoints",), **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch train.steps=300 checkpoint.resume=auto hydra.run.dir=runs/ck":
        Entry(shrink=(("train.steps=300", "train.steps=8"),), add=("data.eval_samples=512",),
              check=_resume_logged, **TRAINER),
    # docs/data.md
    ".venv/bin/python scripts/prepare_criteo.py --train day_0.gz day_1.gz --test day_23.gz --out DIR":
        Entry(writes_dir=True, files=("DIR/meta.json",)),
    ".venv/bin/python scripts/prepare_criteo.py --train train.txt --out DIR --min-count 4":
        Entry(writes_dir=True, subs=(("DIR", "VOCAB"),), files=("VOCAB/meta.json",)),
    ".venv/bin/python -m trainer data=movielens optim=adam optim.sparse_lr=0.2 train.steps=600":
        # "eval AUC about 0.77" needs the 600 steps (~30 s alone, minutes on a busy machine): not
        # checked here; tests/test_real_data.py trains MovieLens.
        Entry(shrink=(("train.steps=600", "train.steps=20"),), **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch data=criteo data.dir=DIR":
        # the README's and gpu.md's GPU command: runs on the CPU too; on a GPU machine it must train there
        Entry(add=("data.epochs=1", "data.eval_samples=256"), check=_trained_on_the_run_device, **TRAINER),
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch data=criteo data.dir=DIR model=dcn":
        Entry(add=("data.epochs=1", "data.eval_samples=256"), **TRAINER),
    ".venv/bin/python scripts/baseline_lr.py DIR --compare model=dcn":
        Entry(add=("data.epochs=1",), json_keys=("lr_eval_auc", "trainer_eval_auc", "trainer_minus_lr_auc")),
    # docs/recipe.md
    ".venv/bin/python dev/recipe_study/compare_splits.py TRAIN.tsv --test TEST.tsv":
        Entry(add=("data.epochs=1",), json_keys=("model",), timeout=600),
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
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch embedding.tables=dynamic embedding.capacity=300 "
    "embedding.admit_after=2 data.scramble_ids=true checkpoint.enabled=false train.steps=40 train.log_every=4 "
    "hydra.run.dir=runs/dyn":
        Entry(shrink=(("train.steps=40", "train.steps=8"),), add=("data.eval_samples=512",),
              check=_dynamic_reported, **TRAINER),
    # docs/placement.md
    ".venv/bin/torchrun --nproc_per_node 2 -m trainer comm=torch data=criteo_like cache=lru placement=sca":
        Entry(add=W2 + ("data.max_table_rows=10000", "placement.plan_steps=2"), **TRAINER),
    ".venv/bin/python scripts/plan.py --workers 8 data=criteo_like cache=lru placement=sca":
        Entry(add=("data.max_table_rows=10000", "placement.plan_steps=2"), json_keys=("name", "hot_rows")),
    # docs/cluster.md (root networking)
    ".venv/bin/python dev/netcluster.py up --hosts 2 --rate 200mbit --ssh --ttl 600": Entry(marks=("netns",)),
    ".venv/bin/python dev/netcluster.py torchrun -- -m trainer comm=torch data=bench train.steps=50":
        Entry(marks=("netns",), shrink=(("train.steps=50", "train.steps=4"),),
              add=("data.eval_samples=512", "checkpoint.enabled=false"), json_keys=TRAINER_LINE),
    '.venv/bin/python dev/netcluster.py horovodrun -- "$PWD/.venv/bin/python" -m trainer comm=horovod data=bench train.steps=50':
        Entry(marks=("netns",), shrink=(("train.steps=50", "train.steps=4"),),
              add=("data.eval_samples=512", "checkpoint.enabled=false"), json_keys=TRAINER_LINE),
    ".venv/bin/python dev/netcluster.py down":
        Entry(marks=("netns",), cleanup=".venv/bin/python dev/netcluster.py down"),
    # docs/gpu.md
    'PYTHON="$PWD/.venv/bin/python" bash scripts/gpu_check.sh OUT':
        Entry(marks=("gpu",), files=("OUT/check.log",), timeout=1800),
    'PART=step PYTHON="$PWD/.venv/bin/python" bash scripts/gpu_check.sh OUT':
        Entry(marks=("gpu",), files=("OUT/check.log", "OUT/step.jsonl"), timeout=1800),
    ".venv/bin/python dev/gpu_parity.py --jobs 8 --out gpu_parity.jsonl":
        Entry(marks=("gpu",), files=("gpu_parity.jsonl",), timeout=1800),
    ".venv/bin/python -m pytest -q -m gpu tests/test_step_device.py tests/test_kernel_*.py":
        Entry(marks=("gpu",), timeout=900),
    # docs/config.md
    ".venv/bin/python -m trainer data=criteo_like train.precision=bf16 hydra.run.dir=runs/amp":
        Entry(add=("train.steps=4", "data.eval_samples=512", "data.max_table_rows=10000"),
              files=("runs/amp/summary.json",), check=_amp_summary, **TRAINER),
    ".venv/bin/python -m trainer data=criteo_like embedding.dtype=bf16 hydra.run.dir=runs/bf16":
        Entry(add=("train.steps=4", "data.eval_samples=512", "data.max_table_rows=10000"),
              files=("runs/bf16/summary.json",), check=_bf16_rows, **TRAINER),
    # docs/development.md
    ".venv/bin/python scripts/check_imports.py": Entry(stdout=r"no import cycle"),
    # benchmarks/README.md
    ".venv/bin/python benchmarks/bench_train.py --steps 60":
        Entry(shrink=(("--steps 60", "--steps 2"),), json_keys=("samples_per_sec",)),
    ".venv/bin/python benchmarks/bench_train.py --workload mlperf --worlds 1 --steps 30 --batch-sizes 2048 "
    "--precisions fp32 bf16 -- data.max_table_rows=200000":
        Entry(shrink=(("--steps 30", "--steps 2"), ("--batch-sizes 2048", "--batch-sizes 64"),
                      ("data.max_table_rows=200000", "data.max_table_rows=2000")),
              add=("data.eval_samples=512",), json_keys=("samples_per_sec", "ms_per_step", "precision"),
              stdout=r'(?m)^\{.*"workload": "mlperf".*"precision": "fp32".*\n\{.*"workload": "mlperf".*"precision": "bf16"'),
    ".venv/bin/python benchmarks/bench_cache.py":
        Entry(add=("--steps", "6", "--warmup", "2"), json_keys=("read_ms", "write_ms")),
    ".venv/bin/python benchmarks/bench_comm.py --all":
        Entry(elsewhere="tests/test_scripts.py::test_bench_comm_all_launches_torchrun_and_horovodrun "
                        "(--np 2 --sizes 1KiB,16KiB --budget 64KiB)"),
    ".venv/bin/python benchmarks/bench_data.py --repeat 200":
        Entry(elsewhere="tests/test_scripts.py::test_bench_data_measures_prepare_and_both_loaders "
                        "(--repeat 2 --workers 1 --steps 3 --batch 256)"),
    ".venv/bin/python benchmarks/bench_placement.py":
        Entry(add=("--steps", "2", "--herald-steps", "2")),
    ".venv/bin/python benchmarks/soak.py":
        Entry(add=("--steps", "40", "--sample-every", "10", "--warmup", "10"),
              json_keys=("rss_slope_mib_per_1k_steps", "throughput_drift")),
    ".venv/bin/python benchmarks/bench_scale.py --rows 2000000 --worlds 1 2":
        Entry(elsewhere="tests/test_bench_scale.py::test_every_phase_of_a_train_and_a_resume_at_2w "
                        "(--rows 4000 --tables 2 --worlds 1 --resume-worlds 1 2 --steps 2)"),
    ".venv/bin/python benchmarks/bench_kernels.py --dims 16 64 128 --bags 8 32":
        Entry(marks=("gpu",), json_keys=("kernel", "impl", "gbps"), timeout=900),
    ".venv/bin/python benchmarks/bench_train.py --worlds 1 --steps 60 -- train.device=cuda":
        Entry(marks=("gpu",), shrink=(("--steps 60", "--steps 4"),), json_keys=("samples_per_sec",), timeout=900),
    ".venv/bin/python benchmarks/bench_train.py --workload mlperf --worlds 1 --steps 30 --batch-sizes 2048 16384 "
    "65536 --precisions fp32 bf16 -- train.device=cuda":
        Entry(marks=("gpu",), shrink=(("--steps 30", "--steps 4"),), json_keys=("samples_per_sec", "ms_per_step"),
              timeout=900),
    ".venv/bin/python benchmarks/bench_net.py --links 200mbit --repeat 3 --steps 120":
        Entry(elsewhere="tests/test_bench_net.py::test_readme_command_on_a_shaped_link (--repeat 1 --steps 4 --quick)"),
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


# Inline code that reads as a command (it starts with a program a user would type) must be one of
# the block commands above, or a part of one (a user finds it run as written there), or an
# abbreviation (`...`, a <placeholder>, [optional] parts), or one of these, each with why it is not
# run: nothing a user copies from a sentence goes untested.
INLINE_PROGRAM = re.compile(r"^(?:\.venv/bin/)?(?:python3?|torchrun|horovodrun|bash|docker|pytest)\s+\S")  # with arguments
INLINE_NOT_RUN = {
    "docker info": "the check that a container engine is there (the docker marker's own test)",
    'python -c "import torch; print(torch.cuda.get_device_name(), torch.version.cuda)"':
        "prints the GPU's name: gpu.md's first step on a lent machine",
    "pytest -m gpu -n 8 tests/test_gpu_paths.py": "a GPU machine's parallel form of tests/test_gpu_paths.py",
    "pytest -m gpu tests/test_gpu_paths.py -k criteo": "runs only with a GPU (the gpu marker)",
    "pytest -m gpu tests/test_dali_loader.py": "runs only with a GPU (the gpu marker)",
    "pytest -q -m gpu tests/test_step_device.py": "runs only with a GPU (the gpu marker)",
    "pytest -q -s tests/test_step_device.py": "the CPU audit: part of the suite CI runs",
    "pytest -q -s tests/test_step_device.py -k het": "the CPU audit of the cache's step: part of the suite CI runs",
    "torchrun --standalone": "the launcher's option, named in a sentence",
    "torchrun --nnodes N --node_rank k": "the form of what dev/netcluster.py runs on each emulated host",
    "torchrun --nproc_per_node 2": "the launcher's option, named in a sentence",
    "horovodrun --gloo": "the launcher's option, named in a sentence",
    ".venv/bin/python -m pytest -q": "the suite itself (what .ci/run runs)",
    ".venv/bin/python -m pytest -q tests/test_docs_commands.py": "this test",
    'bash scripts/setup.sh && .venv/bin/python -m pytest -q -m "not gpu" -p no:cacheprovider -n 2 --dist=loadgroup':
        "what .ci/run runs",
}


def _normal(text: str) -> str:
    """A command as a user would type it anywhere: no leading VAR=value settings, no .venv/bin/
    prefix, one space between words."""
    text = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", text.strip())
    return re.sub(r"\s+", " ", re.sub(r"(^|\s)\.venv/bin/", r"\1", text)).strip()


def inline_commands(rel: str) -> list[tuple[int, str]]:
    """(line, text) of the inline code spans of a file, outside fenced blocks, that read as commands."""
    out, fenced = [], False
    for n, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(n, span) for span in re.findall(r"`([^`]+)`", line) if INLINE_PROGRAM.match(span.strip())]
    return out


def test_every_inline_command_is_run_as_a_block_command():
    blocks = [_normal(c.text) for c in all_commands()]
    loose = []
    for rel in DOCS:
        for n, span in inline_commands(rel):
            text = span.strip()
            if text in INLINE_NOT_RUN or "..." in text or re.search(r"<\w+>|\[\w+\]", text):
                continue
            if not any(b == _normal(text) or b.startswith(_normal(text) + " ") for b in blocks):
                loose.append(f"{rel}:{n}: `{text}`")
    assert not loose, ("commands shown inline that no bash block runs (put them in a block, with a "
                       "REGISTRY entry; or abbreviate them with `...`):\n" + "\n".join(loose))


# ---------------------------------------------------------------------------------------------
# Checks on the registry itself


def _key_value(arg: str) -> tuple[str, str]:
    if arg.startswith("--"):
        key, _, value = arg.partition(" ")
        return key, value
    key, _, value = arg.partition("=")
    return key, value


def _lower(old: str, new: str) -> bool:
    """new is the same kind of value as old, and no larger (lists: a subset)."""
    if "," in old or "," in new:
        return set(new.split(",")) <= set(old.split(","))
    try:
        return float(new) <= float(old)
    except ValueError:
        return False


def test_every_documented_command_has_an_entry():
    missing = [f"{c.where}: {c.text}" for c in all_commands() if c.text not in REGISTRY]
    assert not missing, ("commands in the docs without an entry in tests/test_docs_commands.py REGISTRY "
                         "(add one: how to run and check it):\n" + "\n".join(missing))


def test_every_entry_is_still_in_the_docs():
    shown = {c.text for c in all_commands()}
    stale = [t for t in REGISTRY if t not in shown]
    assert not stale, "REGISTRY entries whose command is no longer in the docs:\n" + "\n".join(stale)


def test_entries_only_shrink_their_commands():
    problems = []
    for text, e in REGISTRY.items():
        for old, new in e.shrink:
            (ko, vo), (kn, vn) = _key_value(old), _key_value(new)
            if old not in text:
                problems.append(f"{text}: shrinks {old!r}, which it does not contain")
            elif ko != kn or ko not in SHRINK_KEYS or not _lower(vo, vn):
                problems.append(f"{text}: {old!r} -> {new!r} is not a shrink of a SHRINK_KEYS value")
        args = list(e.add)
        i = 0
        while i < len(args):
            a = args[i]
            if a in OFF_SWITCHES:
                i += 1
                continue
            if a.startswith("--"):
                key, value, i = a, args[i + 1] if i + 1 < len(args) else "", i + 2
            else:
                (key, value), i = _key_value(a), i + 1
            if key not in SHRINK_KEYS:
                problems.append(f"{text}: adds {a!r}, not one of SHRINK_KEYS / OFF_SWITCHES")
            for m in re.finditer(rf"(?:^|\s){re.escape(key)}[= ](\S+)", text):
                if not _lower(m.group(1), value):
                    problems.append(f"{text}: adds {key} {value}, above the command's own {m.group(1)}")
        for mark in e.marks:
            if mark not in ("gpu", "docker", "netns"):
                problems.append(f"{text}: unknown marker {mark}")
    assert not problems, "\n".join(problems)


def _ci_command() -> list[str]:
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [x for x in lines if x.startswith("bash scripts/setup.sh")]
    assert len(runs) == 1, f".ci/run should run one `bash scripts/setup.sh && ...` line, has {runs}"
    return shlex.split(runs[0])


def _without_pytest_flags(argv: list[str]) -> list[str]:
    """argv with every pytest option after `pytest` dropped except -q (-m/-p/-k take a value)."""
    if "pytest" not in argv:
        return argv
    at = argv.index("pytest") + 1
    out, i = argv[:at], at
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "-p", "-k", "-n", "--durations"):
            i += 2
        elif a.startswith("-") and a != "-q":
            i += 1
        else:
            out.append(a)
            i += 1
    return out


def test_ci_runs_the_readme_setup_and_test_commands():
    """The README's first two commands: .ci/run runs the same set-up, then the same test command
    (pytest's flags aside); the first command's own part after the set-up runs in its block."""
    ci = _ci_command()
    top = [c for c in parse_blocks("README.md")[0]]
    assert [REGISTRY[c.text].ci for c in top] == ["setup+run", "setup+ci"], \
        f"README.md:{top[0].line}: the first block must be the set-up + train and set-up + test commands"
    for c in top:
        assert c.text.startswith(SETUP), f"{c.where}: does not start with `{SETUP}`"
    assert ci[:3] == shlex.split(SETUP), f".ci/run does not start with {SETUP!r}: {ci}"
    tests = top[1].text
    assert _without_pytest_flags(ci) == _without_pytest_flags(shlex.split(tests)), \
        f"{top[1].where}: `{tests}` is not what .ci/run runs (`{' '.join(ci)}`), pytest flags aside"


# ---------------------------------------------------------------------------------------------
# Running the blocks


def _lines(a: int, b: int) -> list[str]:
    with open(SAMPLE) as f:
        return f.readlines()[a:b]


@pytest.fixture(scope="session")
def prepared_sample(tmp_path_factory) -> Path:
    """DIR: the sample prepared once (train = first 1,600 rows, test = the rest; 1,000 rows per
    table, so a run sets up in a second)."""
    if not SAMPLE.is_file():
        pytest.skip(f"the shared Criteo sample is not there: {SAMPLE}")
    from data_helpers import prepare_sample

    out = tmp_path_factory.mktemp("docs_sample")
    prepare_sample(str(out))
    return out / "prepared"


def _materialize(word: str, cwd: Path, rows: dict[str, tuple[int, int]]) -> None:
    a, b = rows.get(word, FILE_ROWS[word])
    data = "".join(_lines(a, b))
    if word.endswith(".gz"):
        with gzip.open(cwd / word, "wt") as f:
            f.write(data)
    else:
        (cwd / word).write_text(data)


def _scratch(tmp_path: Path) -> Path:
    cwd = tmp_path / "work"
    cwd.mkdir()
    for name in LINKS:
        os.symlink(ROOT / name, cwd / name)
    os.symlink(sys.prefix, cwd / ".venv")
    if (ROOT.parent / "shared").is_dir():  # ../shared beside the checkout, as tools expect it
        os.symlink(ROOT.parent / "shared", tmp_path / "shared")
    return cwd


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + env.get("PATH", "")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _has_netns() -> Optional[str]:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        return "needs `ip netns`"
    return None


def _engine_fails(name: str) -> Optional[str]:
    """Why the container engine `name` (podman or docker) does not run here, or None."""
    if shutil.which(name) is None:
        return f"no `{name}`"
    if subprocess.run([name, "info"], capture_output=True, timeout=120).returncode:
        return f"`{name} info` fails"
    return None


def _has_docker() -> Optional[str]:
    """A container engine runs: podman or docker (scripts/build_image.sh uses either); a command
    that names one needs that one (checked per command)."""
    whys = [_engine_fails(e) for e in ("podman", "docker")]
    return None if None in whys else f"needs a running container engine ({'; '.join(whys)})"


def _has_gpu() -> Optional[str]:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device"


NEEDS = {"gpu": _has_gpu, "docker": _has_docker, "netns": _has_netns}


def _command_line(c: Command, e: Entry) -> str:
    text = c.text[len(SETUP):] if e.ci == "setup+run" else c.text
    for old, new in e.shrink:
        text = text.replace(old, new)
    for word, new in e.subs:
        text = re.sub(rf"\b{re.escape(word)}\b", new, text)
    if e.add:
        text += " " + " ".join(shlex.quote(a) for a in e.add)
    return text


def _last_json(stdout: str) -> Optional[dict[str, Any]]:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _run_one(c: Command, e: Entry, cwd: Path, sample: Callable[[], Path]) -> Optional[str]:
    """Run one command; None when it did what its text says, else what went wrong."""
    line = _command_line(c, e)
    rows = {w: (a, b) for w, a, b in e.rows}
    for word in FILE_ROWS:
        if re.search(rf"(?<![\w/.]){re.escape(word)}\b", line) and not (cwd / word).exists():
            _materialize(word, cwd, rows)
    if re.search(r"\bDIR\b", line) and not e.writes_dir and not (cwd / "DIR").exists():
        os.symlink(sample(), cwd / "DIR")
    if re.search(r"\bOUT\b", line):
        (cwd / "OUT").mkdir(exist_ok=True)
    proc = subprocess.Popen(["bash", "-c", line], cwd=ROOT if e.in_checkout else cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=e.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's workers too
        out, err = proc.communicate()
        return (f"{c.where}: `{c.text}` did not finish within {e.timeout} s (ran: {line})\n"
                f"--- stderr (end) ---\n{err[-3000:]}")
    out = re.sub(r"(?m)^\[\d+(?:,\d+)?\]<stdout>:", "", out)  # horovodrun prefixes each rank's lines ([1,0]: under MPI)
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    tail = f"\n--- stdout (end) ---\n{p.stdout[-2000:]}\n--- stderr (end) ---\n{p.stderr[-4000:]}"
    if p.returncode != 0:
        return f"{c.where}: `{c.text}` exited {p.returncode} (ran: {line}){tail}"
    problems = []
    for f in e.files:
        if not (cwd / f).exists():
            problems.append(f"{f} was not written")
    if e.json_keys:
        rec = _last_json(p.stdout)
        if rec is None:
            problems.append("no JSON line on stdout")
        else:
            lost = [k for k in e.json_keys if k not in rec]
            if lost:
                problems.append(f"its JSON line has no {lost} (keys: {sorted(rec)})")
    if e.stdout and not re.search(e.stdout, p.stdout):
        problems.append(f"stdout does not match {e.stdout!r}")
    if e.summary:
        m = re.search(SUMMARY_RE, p.stdout)
        path = None if m is None else Path(m.group("path"))
        if path is None or not (path if path.is_absolute() else cwd / path).is_file():
            problems.append("no `summary: PATH` line naming a summary.json that exists")
    if e.check is not None and not problems:
        try:
            e.check(cwd)
        except AssertionError as exc:
            problems.append(str(exc))
    if problems:
        return (f"{c.where}: `{c.text}` does not do what the text says: {'; '.join(problems)} "
                f"(ran: {line}){tail}")
    return None


def _block_params() -> list[Any]:
    params = []
    for block in all_blocks():
        entries = [REGISTRY.get(c.text) for c in block]
        marks = sorted({m for e in entries if e is not None for m in e.marks})
        params.append(pytest.param(block, id=block[0].where, marks=[getattr(pytest.mark, m) for m in marks]))
    return params


def _check_elsewhere(c: Command, elsewhere: str) -> None:
    """An entry run by another test: that test function exists and runs the command's script."""
    node = elsewhere.split()[0]
    path, _, name = node.partition("::")
    source = (Path(ROOT) / path).read_text()
    assert f"def {name}(" in source, f"{c.where}: {node} does not exist"
    script = next(w for w in c.text.split() if w.endswith((".py", ".sh")))
    body = source[source.index(f"def {name}("):]
    end = body.find("\ndef ", 1)
    body = body if end < 0 else body[:end]  # the test function's own text
    assert os.path.basename(script)[:-3] in body, f"{c.where}: {node} does not run {script}"  # name, no .py


@pytest.mark.parametrize("block", _block_params())
def test_documented_commands_run(block: list[Command], tmp_path: Path, request) -> None:
    """One fenced bash block: its commands in order, in one scratch directory."""
    entries = [REGISTRY.get(c.text) for c in block]
    missing = [c.where for c, e in zip(block, entries) if e is None]
    assert not missing, f"no REGISTRY entry for the command(s) at {missing}"
    reasons = [f"{c.where}: {e.skip}" for c, e in zip(block, entries) if e.skip]
    for c, e in zip(block, entries):  # run by the named test instead: it must exist and name the script
        if e.elsewhere:
            _check_elsewhere(c, e.elsewhere)
    runnable = [(c, e) for c, e in zip(block, entries) if not e.skip and not e.elsewhere and e.ci != "setup+ci"]
    if not runnable and not reasons and any(e.elsewhere for e in entries):
        return  # every command of the block is run by its test elsewhere
    if not runnable:
        pytest.skip("; ".join(reasons) or "checked against .ci/run, not run here")
    for mark in sorted({m for _, e in runnable for m in e.marks}):
        why = NEEDS[mark]()
        if why:
            pytest.skip(f"{block[0].where}: {why}")
    for c, e in runnable:  # `docker ...` needs docker itself, `podman ...` podman
        engine = c.text.split()[0]
        why = _engine_fails(engine) if "docker" in e.marks and engine in ("docker", "podman") else None
        if why:
            pytest.skip(f"{c.where}: needs a running `{engine}` ({why})")
    cwd = _scratch(tmp_path)
    sample = lambda: request.getfixturevalue("prepared_sample")  # noqa: E731 - only when DIR is used
    cleanups = [e.cleanup for _, e in runnable if e.cleanup]
    failures = []
    try:
        for c, e in runnable:  # all of them: a later command may fail for its own reason too
            t0 = time.perf_counter()
            failures.append(_run_one(c, e, cwd, sample))
            print(f"{c.where}: {time.perf_counter() - t0:.1f} s{' (failed)' if failures[-1] else ''}")
    finally:
        for cmd in cleanups:
            subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, timeout=300)
    failures = [f for f in failures if f]
    if failures:
        pytest.fail(f"{len(failures)} of {len(runnable)} commands failed:\n\n" + "\n\n".join(failures))
    if reasons:
        pytest.skip("ran the others; not run here: " + "; ".join(reasons))
