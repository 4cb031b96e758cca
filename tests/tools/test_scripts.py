"""Every script of scripts/, benchmarks/ and dev/ (dev/recipe_study/ too): its --help, one shrunk real
run (here, or in the test named in REAL_RUNS), and for bad input one `error: ...` line with exit
status 2 instead of a traceback; what they share to start the trainer (dev/launch.py). A script of
scripts/ runs as `python scripts/NAME.py` from any directory (the installed package); one of
benchmarks/ or dev/ as a module from the repository root, `python -m benchmarks.NAME` (argv_of).

The --help and bad-input runs go through tests/script_runner.py: one process imports torch, Hydra
and numpy once and forks a child per command line, each child running the script afresh as
`python SCRIPT ARGS` / `python -m MODULE ARGS` would (the repository's modules are never imported
before the fork)."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from data_helpers import prepare_sample
from docs_registry import documented
from hvd_launch import ROOT, env, require_horovod, require_netns
from dev import launch

PY = sys.executable
RUNNER = os.path.join(ROOT, "tests", "script_runner.py")

# script -> where a shrunk real run of it is tested (file::test); "" = in this file
REAL_RUNS = {
    "scripts/baseline_lr.py": "tools/test_baseline_lr.py::test_baseline_auc_and_split_sizes_match_the_trainer",
    "scripts/build_image.sh": "tools/test_image.py::test_image_holds_the_cpu_stack_and_no_host_files",
    "scripts/check_imports.py": "docs/test_imports.py::test_cli_on_the_repository_checks_both_packages",
    "scripts/gpu_check.sh": "tools/test_gpu_check.py::test_gpu_check_runs_every_stage_in_cpu_mode",
    "scripts/install_horovod.sh": "",
    "scripts/install_podman.sh": "",
    "scripts/install_slurm.sh": "",
    "scripts/slurm/train.sbatch": "distributed/test_slurm.py::test_a_preempted_job_saves_requeues_itself_and_resumes",
    "scripts/slurm/sweep.sbatch":
        "distributed/test_slurm.py::test_an_array_job_sweeps_the_staleness_bound_and_plot_sweep_plots_it",
    "scripts/plan.py": "distributed/test_sca.py::test_plan_script_prints_json_and_rejects_bad_input",
    "scripts/plot_sweep.py": "distributed/test_horovod.py::test_staleness_sweep_under_horovodrun_and_plot",
    "scripts/prepare_criteo.py": "unit/test_criteo_prep.py::test_bad_rows_counted_with_line_numbers_and_round_trip",
    "scripts/setup.sh": "",
    "scripts/simulate_cache.py": "tools/test_simulate_cache.py::test_cli_one_json_line_and_64_workers",
    "benchmarks/bench_cache.py": "tools/test_bench_cache.py::test_prints_one_line_with_its_timings",
    "benchmarks/bench_comm.py": "",
    "benchmarks/bench_criteo_systems.py": "tools/test_bench_criteo_systems.py::test_every_part_on_the_sample_and_nothing_left_behind",
    "benchmarks/bench_slurm.py": "distributed/test_slurm.py::test_bench_slurm_puts_srun_beside_torchrun",
    "benchmarks/bench_predict.py": "distributed/test_serving.py::test_bench_predict_a_line_per_point",
    "dev/slurmcluster.py": "distributed/test_slurm.py::test_slurm_on_one_machine_as_the_docs_show_it",
    "benchmarks/bench_stop.py": "tools/test_bench_stop.py::test_every_phase_stops_with_the_preempted_status_and_its_checkpoint",
    "benchmarks/bench_data.py": "",
    "benchmarks/bench_kernels.py": "tools/test_bench_kernels.py::test_bench_kernels_quick_cpu",
    "benchmarks/bench_net.py": "tools/test_bench_net.py::test_repeat_interleaves_rounds_and_phases_time_every_rank_step_by_step",
    "benchmarks/bench_padding.py": "tools/test_bench_padding.py::test_every_policy_on_the_wire",
    "benchmarks/bench_placement.py": "",
    "benchmarks/disk_probe.py": "",
    "benchmarks/bench_store.py": "",
    "benchmarks/store_scale.py": "",
    "benchmarks/bench_scale.py": "tools/test_bench_scale.py::test_every_phase_of_a_train_and_a_resume_at_2w",
    "benchmarks/bench_train.py": "tools/test_gpu_check.py::test_gpu_check_runs_every_stage_in_cpu_mode",
    "benchmarks/scale_probe.py": "tools/test_bench_scale.py::test_every_phase_of_a_train_and_a_resume_at_2w",
    "benchmarks/phases.py": "tools/test_bench_net.py::test_repeat_interleaves_rounds_and_phases_time_every_rank_step_by_step",
    "benchmarks/soak.py": "tools/test_soak.py::test_soak_prints_one_json_line_with_sane_figures",
    "dev/criteo_file.py": "tools/test_criteo_file.py::test_the_command_writes_a_file_prepare_criteo_reads",
    "dev/gpu_parity.py": "unit/test_gpu_paths.py::test_harness_on_cpu",
    "dev/gpu_dense_probe.py": "tools/test_gpu_check.py::test_gpu_check_step_study_in_cpu_mode",
    "dev/house_parity.py": "tools/test_house_parity.py::test_two_runs_of_the_same_tree_are_the_same",
    "dev/memcg.py": "",
    "dev/netcluster.py": "",
    "dev/recipe_study/compare_splits.py": "tools/test_compare_splits.py::test_each_split_against_its_own_baseline",
    "dev/recipe_study/paired_splits.py": "tools/test_paired_splits.py::test_paired_differences_against_a_plain_computation",
    "dev/recipe_study/val_rotations.py": "tools/test_val_rotations.py::test_one_run_per_slice_against_one_baseline",
}
SHELL = [s for s in REAL_RUNS if s.endswith((".sh", ".sbatch"))]
PYTHON_SCRIPTS = [s for s in REAL_RUNS if s.endswith(".py")]
MODULES = [s for s in PYTHON_SCRIPTS if not s.startswith("scripts/")]  # benchmarks/ and dev/: run with -m


def module_of(script: str) -> str:
    """benchmarks/bench_x.py -> benchmarks.bench_x (dev/recipe_study/x.py -> dev.recipe_study.x)."""
    return script[:-len(".py")].replace("/", ".")


def argv_of(script: str) -> list[str]:
    """What follows `python` to run a Python script as its docs say: a user tool of scripts/ by its
    path, a module of benchmarks/ or dev/ with -m (from the repository root)."""
    return [script] if script.startswith("scripts/") else ["-m", module_of(script)]


def run_many(cases: list[dict], pythonpath: bool = True) -> list[dict]:
    """Each case ({"argv", "env", "timeout"}) as `python ARGV` from the repository root, through
    tests/script_runner.py; {"rc", "stdout", "stderr", "timed_out", "seconds"} each. pythonpath=False:
    nothing on PYTHONPATH (not even this checkout, which the suite puts there for its subprocesses)."""
    for c in cases:
        c.setdefault("cwd", ROOT)
    e = env()
    if not pythonpath:
        del e["PYTHONPATH"]
    proc = subprocess.run([PY, RUNNER], input=json.dumps(cases), capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=60 + sum(c.get("timeout", 120) for c in cases))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _scripts_on_disk() -> list[str]:
    """The command-line scripts of the three folders: shell scripts (Slurm's batch scripts too) and
    Python files with a __main__ block (dev/recipe_study/'s modules have none)."""
    out = []
    for folder in ("scripts", "benchmarks", "dev"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*"), recursive=True)):
            rel = os.path.relpath(path, ROOT)
            if path.endswith((".sh", ".sbatch")) or (path.endswith(".py") and 'if __name__ == "__main__"' in open(path).read()):
                out.append(rel)
    return out


def test_every_script_is_listed_and_its_real_run_exists():
    assert sorted(_scripts_on_disk()) == sorted(REAL_RUNS), "a script was added or removed: list it in REAL_RUNS"
    for script, where in REAL_RUNS.items():  # the test exists, in a file that names the script
        path, name = (where or f"tools/test_scripts.py::{_local_test(script)}").split("::")
        text = open(os.path.join(ROOT, "tests", path)).read()
        assert f"def {name}(" in text and os.path.basename(script).rsplit(".", 1)[0] in text, (script, where)


def test_user_scripts_run_the_installed_package_from_any_directory(tmp_path):
    """scripts/ are the user's tools: they import the installed package (setup.sh installs the
    checkout editable) and never edit sys.path, so they run alike from any directory; benchmarks/
    and dev/, which import each other and are never installed, are modules run from the repository
    root (the next test)."""
    user = sorted(s for s in PYTHON_SCRIPTS if s.startswith("scripts/"))
    assert [s for s in user if "sys.path" in open(os.path.join(ROOT, s)).read()] == []
    res = run_many([{"argv": [os.path.join(ROOT, s), "--help"], "cwd": str(tmp_path), "timeout": 60} for s in user])
    assert [(s, r["rc"], r["stderr"][-500:]) for s, r in zip(user, res) if r["rc"] != 0] == []
    assert all(HELP_SAYS[s] in r["stdout"] for s, r in zip(user, res))


def test_benchmarks_and_dev_run_as_modules_from_the_repository_root():
    """benchmarks/ and dev/ are never installed: no file of theirs edits sys.path (nor hands its
    workers a PYTHONPATH: they start them from the root, dev/launch.py ROOT), and each of their
    command-line modules runs as `python -m MODULE --help` from the repository root with nothing
    on PYTHONPATH (-m finds the module, the others it imports and this checkout's trainer/ in the
    working directory); an argparse usage line names that command."""
    files = sorted(os.path.relpath(p, ROOT) for top in ("benchmarks", "dev")
                   for p in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True))
    assert "dev/netcluster.py" in files and "dev/recipe_study/compare_splits.py" in files
    texts = {f: open(os.path.join(ROOT, f)).read() for f in files}
    assert [f for f, t in texts.items() if "sys.path" in t or re.search(r"PYTHONPATH['\"]?\s*[:=]", t)] == []
    res = run_many([{"argv": ["-m", module_of(s), "--help"], "timeout": 60} for s in MODULES], pythonpath=False)
    assert [(s, r["rc"], r["stderr"][-500:]) for s, r in zip(MODULES, res) if r["rc"] != 0 or r["stderr"]] == []
    assert [s for s, r in zip(MODULES, res) if HELP_SAYS[s] not in r["stdout"]] == []
    usage = {s: r["stdout"].split("\n", 1)[0] for s, r in zip(MODULES, res) if r["stdout"].startswith("usage:")}
    assert len(usage) >= 15 and [(s, u) for s, u in usage.items()
                                 if not u.startswith(f"usage: python -m {module_of(s)} ")] == []


def _local_test(script: str) -> str:
    """This file's shrunk real run of `script` (REAL_RUNS "")."""
    return {"scripts/install_horovod.sh": "test_install_horovod_has_nothing_to_do_in_this_venv",
            "scripts/install_podman.sh": "test_install_podman_ends_with_a_running_engine",
            "scripts/install_slurm.sh": "test_install_slurm_ends_with_the_daemons_and_clients",
            "scripts/setup.sh": "test_setup_check_finds_everything_in_this_venv",
            "benchmarks/bench_comm.py": "test_bench_comm_all_launches_torchrun_and_horovodrun",
            "benchmarks/bench_data.py": "test_bench_data_measures_prepare_and_both_loaders",
            "benchmarks/bench_placement.py": "test_bench_placement_simulated",
            "benchmarks/disk_probe.py": "test_disk_probe_a_line_per_point_and_the_file_deleted",
            "benchmarks/bench_store.py": "test_bench_store_a_memory_point_then_disk_points_under_a_cgroup",
            "benchmarks/store_scale.py": "test_store_scale_trains_saves_and_resumes_at_2w_under_cgroups",
            "dev/memcg.py": "test_memcg_command_line_runs_under_the_limit",
            "dev/netcluster.py": "test_netcluster_command_line_up_run_down"}[script]


# ------------------------------------------------------------------------------------------ --help
HELP_SAYS = {  # a phrase of each script's own help text (not argparse's), so the text is its own
    "scripts/baseline_lr.py": "Logistic-regression baseline",
    "scripts/check_imports.py": "Import cycles",
    "scripts/plan.py": "placement plan",
    "scripts/plot_sweep.py": "staleness sweep",
    "scripts/prepare_criteo.py": "Criteo raw TSV",
    "scripts/simulate_cache.py": "Belady",
    "benchmarks/bench_cache.py": "bookkeeping",
    "benchmarks/bench_comm.py": "Collective latency",
    "benchmarks/bench_criteo_systems.py": "seed systems on real Criteo rows",
    "benchmarks/bench_slurm.py": "under srun",
    "benchmarks/bench_predict.py": "The predictor's speed",
    "dev/slurmcluster.py": "A real Slurm on this one host",
    "benchmarks/bench_stop.py": "How long a stop request takes to end a run",
    "benchmarks/bench_data.py": "Input-pipeline benchmark",
    "benchmarks/bench_kernels.py": "sparse kernels",
    "benchmarks/bench_net.py": "Network benchmark",
    "benchmarks/bench_padding.py": "What the fixed shapes cost on the wire",
    "benchmarks/bench_placement.py": "--consistency",
    "benchmarks/bench_scale.py": "every phase of a run",
    "benchmarks/scale_probe.py": "SCALE_PROBE_DIR",
    "benchmarks/bench_train.py": "Training throughput",
    "benchmarks/phases.py": "STEP_PHASES_DIR",
    "benchmarks/soak.py": "Soak test",
    "benchmarks/disk_probe.py": "random-read limit",
    "benchmarks/bench_store.py": "The SSD tier",
    "benchmarks/store_scale.py": "at scale",
    "dev/criteo_file.py": "stand-in for",
    "dev/gpu_parity.py": "CPU reference",
    "dev/gpu_dense_probe.py": "eager against one CUDA graph",
    "dev/house_parity.py": "changed no behaviour",
    "dev/memcg.py": "memory cgroup limit",
    "dev/netcluster.py": "Emulated multi-host cluster",
    "dev/recipe_study/compare_splits.py": "logistic regression",
    "dev/recipe_study/paired_splits.py": "split by split",
    "dev/recipe_study/val_rotations.py": "validation slices",
    "scripts/gpu_check.sh": "GPU checklist",
    "scripts/install_horovod.sh": "C++17",
    "scripts/install_podman.sh": "runc",
    "scripts/install_slurm.sh": "munge",
    "scripts/slurm/train.sbatch": "requeues itself",
    "scripts/slurm/sweep.sbatch": "job array",
    "scripts/build_image.sh": "mmdebstrap",
    "scripts/setup.sh": "--check",
}


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    scripts = PYTHON_SCRIPTS
    res = run_many([{"argv": argv_of(s) + ["--help"], "timeout": 60} for s in scripts])
    out = dict(zip(scripts, res))
    for s in SHELL:
        p = subprocess.run(["bash", os.path.join(ROOT, s), "--help"], capture_output=True, text=True, timeout=30)
        out[s] = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
    return out


@pytest.mark.parametrize("script", sorted(REAL_RUNS))
def test_help(script, helps):
    r = helps[script]
    assert r["rc"] == 0 and r["stderr"] == "", r
    assert HELP_SAYS[script] in r["stdout"], r["stdout"]


# ------------------------------------------------------------------------------------ bad input
BAD_OVERRIDES = {"data.batch_size=-1": "data.batch_size=-1: must be > 0",
                 "nosuch=1": "Could not override 'nosuch'. To append to your config use +nosuch=1"}
# the scripts that take trainer overrides: their arguments before the bad override ({dir}: a
# prepared Criteo directory; {sample}: a raw Criteo-format file)
TAKES_OVERRIDES = {
    "scripts/plan.py": ["-W", "2", "data=tiny", "placement=fae"],
    "scripts/simulate_cache.py": ["-W", "2", "data=tiny", "cache=lru", "--steps", "2"],
    "scripts/baseline_lr.py": ["{dir}"],
    "benchmarks/bench_cache.py": ["--steps", "4", "--warmup", "1"],
    "benchmarks/soak.py": ["--steps", "4", "--sample-every", "2"],
    "benchmarks/bench_train.py": ["--worlds", "1", "2", "--steps", "2", "--"],
    "benchmarks/bench_net.py": ["--quick", "--links", "localhost", "--modes", "exact_serial", "--"],
    "dev/recipe_study/compare_splits.py": ["{sample}", "--splits", "1", "--models", "dlrm"],
    "dev/recipe_study/val_rotations.py": ["{dir}", "--slices", "1", "--models", "dlrm"],
}
MISSING = "/nonexistent/input"
# other bad input: (script and arguments, what the one line says; run as argv_of says)
BAD_INPUT = [
    (["scripts/prepare_criteo.py", "--train", MISSING, "--out", "{tmp}/out"], f"input file '{MISSING}' does not exist"),
    (["scripts/plot_sweep.py", MISSING], f"{MISSING}: no such sweep directory"),
    (["scripts/simulate_cache.py", "--trace", MISSING, "--batch", "8", "cache=lru"], f"No such file or directory: '{MISSING}'"),
    (["scripts/baseline_lr.py", MISSING], f"data.dir='{MISSING}'"),
    (["scripts/check_imports.py", MISSING], f"{MISSING}: not a directory"),
    (["scripts/plan.py", "-W", "0", "data=tiny", "placement=fae"], "--workers 0: must be > 0"),
    (["benchmarks/bench_data.py", "--input", MISSING, "--workers", "1"], f"--input {MISSING}: no such file"),
    (["benchmarks/bench_data.py", "--repeat", "0"], "--repeat 0: must be > 0"),
    (["benchmarks/bench_placement.py", "--data", "nosuch"], "Could not find 'data/nosuch'; Available options in 'data': bench,"),
    (["benchmarks/bench_placement.py", "--steps", "0"], "--steps 0: must be > 0"),
    (["benchmarks/bench_kernels.py", "--device", "nosuch", "--quick"], "--device nosuch: not a torch device"),
    (["benchmarks/bench_comm.py", "--sizes", "1XB"], "size '1XB'"),
    (["benchmarks/bench_comm.py", "--ops", "alltoall,gather"], "gather is not one of alltoall, allreduce"),
    (["benchmarks/bench_train.py", "--worlds", "3", "--steps", "2", "--", "data=tiny", "data.global_batch_size=64"],
     "data.global_batch_size=64: must be divisible by the world size 3"),
    (["benchmarks/bench_net.py", "--links", "fast"], "link rate 'fast'"),
    (["benchmarks/bench_scale.py", "--worlds", "3", "--", "data.global_batch_size=64"],
     "data.global_batch_size=64: must be divisible by the world size 3"),
    (["benchmarks/scale_probe.py", "data=tiny"], "set SCALE_PROBE_DIR"),
    (["benchmarks/phases.py", "data=tiny"], "set STEP_PHASES_DIR"),
    (["dev/criteo_file.py", "--rows", "0", "--out", "{tmp}/x.tsv"], "--rows 0: must be > 0"),
    (["dev/gpu_parity.py", "--device", "cpu", "--criteo", MISSING], f"data.dir='{MISSING}'"),
    (["dev/gpu_parity.py", "--device", "nosuch"], "--device nosuch"),
    (["dev/netcluster.py", "down", "--tag", "htnet0-nosuch"], "error"),
    (["dev/house_parity.py", "--only", "nosuch"], "--only nosuch: not a run of this set"),
    (["dev/house_parity.py", "--compare", MISSING, MISSING], f"--compare {MISSING}: no such file"),
    (["dev/memcg.py", "--limit", "0", "--", "true"], "--limit 0: must be > 0"),
    (["dev/memcg.py", "--limit", "2X", "--", "true"], "--limit 2X: size '2X'"),
    (["benchmarks/disk_probe.py", "--dir", MISSING], f"--dir {MISSING}: no such directory"),
    (["benchmarks/disk_probe.py", "--size", "64k"], "--size 64k: must be at least 1M"),
    (["benchmarks/bench_store.py", "--steps", "5", "--warmup", "10"], "--steps must exceed --warmup"),
    (["benchmarks/store_scale.py", "--model", "1G", "--limit", "1G", "--cache", "2G"], "must be in (0, --limit)"),
    (["benchmarks/store_scale.py", "--model", "1x", "--limit", "1G"], "1x"),
    (["benchmarks/store_scale.py", "--model", "1000T", "--limit", "2G", "--train-only", "--dir", "{tmp}"],
     "the files (the shard and its log) need"),
    (["dev/recipe_study/compare_splits.py", MISSING, "--splits", "1"], MISSING),
    (["dev/recipe_study/paired_splits.py", MISSING, MISSING], MISSING),
    (["dev/recipe_study/val_rotations.py", MISSING, "--models", "dlrm"], f"data.dir='{MISSING}'"),
]


def _bad_cases(prepared: str, tmp: str) -> list[tuple[str, list[str], str]]:
    """(test id, argv, what the error line says) of every bad-input case."""
    out = []
    for script, before in TAKES_OVERRIDES.items():
        for bad, says in BAD_OVERRIDES.items():
            args = [a.format(dir=prepared, sample=os.path.join(tmp, "raw", "train.tsv")) for a in before]
            out.append((f"{script} {bad}", [*argv_of(script), *args, bad], says))
    for argv, says in BAD_INPUT:  # the test id: the arguments before any placeholder is filled
        out.append((" ".join(argv[:3]), [*argv_of(argv[0]), *(a.format(tmp=tmp) for a in argv[1:])], says))
    # the trainer run by the phase timers: its own one-line error for a bad value (Hydra's errors,
    # such as an unknown key, are the trainer's own multi-line report: python -m trainer's)
    out.append(("phases data.batch_size=-1", ["-m", "benchmarks.phases", "data=tiny", "data.batch_size=-1",
                                              f"hydra.run.dir={tmp}/phases"], BAD_OVERRIDES["data.batch_size=-1"]))
    return out


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, tuple[list[str], str, dict]]:
    tmp = tmp_path_factory.mktemp("bad")
    prepare_sample(str(tmp))
    cases = _bad_cases(str(tmp / "prepared"), str(tmp))
    phases_env = {"STEP_PHASES_DIR": str(tmp / "phases")}
    res = run_many([{"argv": argv, "timeout": 120,
                     "env": phases_env if argv[:2] == ["-m", "benchmarks.phases"] and "hydra" in argv[-1] else {}}
                    for _, argv, _ in cases])
    return {name: (argv, says, r) for (name, argv, says), r in zip(cases, res)}


@pytest.mark.parametrize("case", [name for name, _, _ in _bad_cases("DIR", "TMP")])
def test_bad_input_is_one_error_line_and_status_2(case, bad_runs):
    argv, says, r = bad_runs[case]
    lines = r["stderr"].splitlines()
    errors = [x for x in lines if x.startswith("error: ")]
    assert r["rc"] == 2 and "Traceback" not in r["stderr"], (argv, r)
    # progress lines may come first (compare_splits prepares its split); the error is the last line
    assert len(errors) == 1 and lines[-1] == errors[0] and says in errors[0], (argv, r["stderr"])
    assert not r["stdout"].strip() or argv[:2] == ["-m", "dev.gpu_parity"], (argv, r["stdout"])


# ------------------------------------------------------------------------ shrunk real runs
def _json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]


def test_bench_placement_simulated():
    proc = subprocess.run([PY, "-m", "benchmarks.bench_placement", "--data", "tiny", "-W", "2",
                           "--steps", "5", "--plan-steps", "2", "--herald-steps", "3", "--fae-budget", "4096"],
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    [out] = _json_lines(proc)
    assert (out["workers"], out["steps"], out["data"], out["fae_budget_bytes"]) == (2, 5, "tiny", 4096)
    for cons in ("bsp", "ssp"):
        got = out[cons]
        c, f, s = (got[k]["bytes_per_sample"] for k in ("cache", "fae+cache", "sca"))
        assert got["cache"]["replicated_rows"] == 0 < got["fae+cache"]["replicated_rows"]
        assert got["fae+cache_vs_cache"] == pytest.approx(f / c) and got["sca_vs_fae"] == pytest.approx(s / f)
        assert s <= f  # FAE's exact configuration is one of SCA's candidates
        assert out["targets"][f"sca_no_worse_than_fae_{cons}"] is True
        assert 0 < got["cache"]["hit_rate"] < 1 and "replica" not in got["cache"]["by_kind"]
        assert sum(got["fae+cache"]["by_kind"].values()) == pytest.approx(f)
    h = out["herald"]
    assert h["steps"] == 3 and 0 < h["pulls"] <= h["naive_remote_reads"]
    assert h["pulls_vs_naive"] == pytest.approx(h["pulls"] / h["naive_remote_reads"])


@pytest.mark.dist
def test_bench_placement_measure_trains_and_sca_predicts_its_bytes():
    proc = subprocess.run([PY, "-m", "benchmarks.bench_placement", "--measure", "--data", "tiny",
                           "--consistency", "bsp", "--measure-steps", "2", "--plan-steps", "8", "--fae-budget", "4096"],
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)
    [out] = _json_lines(proc)
    assert (out["workers"], out["steps"], out["plan_steps"]) == (2, 2, 8) and "ssp" not in out
    row = out["bsp"]
    assert all(row[k]["bytes_per_sample"] > 0 for k in ("cache", "fae+cache", "sca"))
    assert row["cache"]["predicted_vs_measured"] is None  # only SCA predicts
    pvm = row["sca"]["predicted_vs_measured"]
    assert pvm["measured"] == pytest.approx(row["sca"]["bytes_per_sample"])
    assert pvm["predicted"] == pytest.approx(pvm["measured"], rel=0.05), pvm  # the replay is the run's feed
    assert row["sca_vs_fae"] == pytest.approx(row["sca"]["bytes_per_sample"] / row["fae+cache"]["bytes_per_sample"])


def test_bench_data_measures_prepare_and_both_loaders():
    proc = subprocess.run(documented(".venv/bin/python -m benchmarks.bench_data --repeat 200"),  # benchmarks/README.md's
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    prep, *loaders = _json_lines(proc)
    assert prep["bench"] == "prepare" and prep["workers"] == 1 and prep["rows"] == 2 * 1999
    from benchmarks.bench_data import sample_bytes

    assert prep["mb_per_s"] > 0 and prep["input_mb"] == pytest.approx(2 * len(sample_bytes()) / 2**20, abs=0.05)
    assert [x["loader"] for x in loaders] == ["memmap", "dali"]
    for x in loaders:
        assert x["bench"] == "loader" and (x["batch"], x["steps"]) == (256, 3) and x["samples_per_s"] > 0


@pytest.mark.dist
def test_bench_comm_all_launches_torchrun_and_horovodrun():
    require_horovod()
    proc = subprocess.run(documented(".venv/bin/python -m benchmarks.bench_comm --all"),  # benchmarks/README.md's
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)
    lines = _json_lines(proc)
    assert [(x["backend"], x["op"], x["bytes"]) for x in lines] == [
        (b, op, n) for b in ("torch-gloo", "horovod-gloo") for op in ("alltoall", "allreduce") for n in (1024, 16384)]
    for x in lines:
        assert x["world_size"] == 2 and 5 <= x["iters"] <= 200 and x["lat_us_min"] <= x["lat_us_p50"]
        # what the comm layer counts as sent: alltoall the other rank's half, allreduce the ring's 2(W-1)/W
        assert x["wire_bytes"] == (x["bytes"] // 2 if x["op"] == "alltoall" else x["bytes"]), x
        assert x["bw_MBps"] > 0


@pytest.mark.dist
@pytest.mark.netns
def test_netcluster_command_line_up_run_down():
    require_netns()
    from dev import netcluster
    nc = [PY, "-m", "dev.netcluster"]  # from the repository root (cwd=ROOT)
    up = subprocess.run([*nc, "up", "--rate", "100mbit", "--ttl", "300"], capture_output=True, text=True,
                        env=env(), cwd=ROOT, timeout=300)
    assert up.returncode == 0, up.stderr[-3000:]
    st = json.loads(up.stdout)
    tag = st["tag"]
    try:
        assert [h["addr"] for h in st["hosts"]] == [f"{netcluster.SUBNET}.1", f"{netcluster.SUBNET}.2"]
        assert st["rate_bits"] == 100_000_000
        status = subprocess.run([*nc, "status"], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
        assert tag in [json.loads(x)["tag"] for x in status.stdout.splitlines()]
        for host in (0, 1):
            r = subprocess.run([*nc, "run", "--tag", tag, "--host", str(host), "--", "ip", "-4", "-o", "addr",
                                "show", "dev", netcluster.IFACE], capture_output=True, text=True, env=env(), cwd=ROOT,
                               timeout=60)
            assert r.returncode == 0 and f"{netcluster.SUBNET}.{host + 1}/24" in r.stdout, r.stdout + r.stderr
        r = subprocess.run([*nc, "run", "--tag", tag, "--host", "2", "--", "true"], capture_output=True, text=True,
                           env=env(), cwd=ROOT, timeout=60)
        assert r.returncode == 2 and r.stderr.strip() == "error: --host 2: the cluster has hosts 0..1"
    finally:
        down = subprocess.run([*nc, "down", "--tag", tag], capture_output=True, text=True, env=env(), cwd=ROOT,
                              timeout=120)
    assert down.returncode == 0, down.stderr
    assert not [ns for ns in netcluster._namespaces() if ns.startswith(tag + "-")]


@pytest.mark.memcg
def test_memcg_command_line_runs_under_the_limit():
    """python -m dev.memcg --limit 64M -- CMD: CMD's output passes through, its exit status is the
    tool's, and one JSON line on stderr ends it; past the limit CMD is OOM-killed (137)."""
    from dev import memcg

    ok, why = memcg.availability()
    if not ok:
        pytest.skip(f"memory cgroups unavailable: {why}")
    mc = [PY, "-m", "dev.memcg", "--limit", "64M", "--"]
    r = subprocess.run([*mc, "sh", "-c", "grep memory /proc/self/cgroup; exit 3"], capture_output=True, text=True,
                       env=env(), cwd=ROOT, timeout=60)
    assert r.returncode == 3 and "/ht-memcg-" in r.stdout, r
    line = json.loads(r.stderr.strip().splitlines()[-1])
    assert (line["rc"], line["limit_bytes"], line["oom_kills"], line["timed_out"]) == (3, 64 << 20, 0, False), line
    assert 0 < line["peak_bytes"] <= 64 << 20
    big = subprocess.run([*mc, PY, "-c", "b = bytearray(256 << 20); b[::4096] = bytes(len(b[::4096]))"],
                         capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    line = json.loads(big.stderr.strip().splitlines()[-1])
    assert big.returncode == 137 and line["rc"] == -9 and line["oom_kills"] >= 1, big


def test_disk_probe_a_line_per_point_and_the_file_deleted(tmp_path):
    proc = subprocess.run([PY, "-m", "benchmarks.disk_probe", "--dir", str(tmp_path), "--size", "2M",
                           "--seconds", "0.2", "--threads", "1", "3"],
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    lines = _json_lines(proc)
    assert [(x["kind"], x["threads"]) for x in lines] == [
        ("fill", 1), ("rand_read", 1), ("rand_read", 3), ("seq_read", 1), ("rand_write", 1), ("rand_write", 3)]
    for x in lines[1:]:
        assert x["file_bytes"] == 2 << 20 and x["dir"] == str(tmp_path) and x["seconds"] >= 0.2, x
        assert x["ops"] > 0 and x["iops"] == pytest.approx(x["ops"] / x["seconds"], rel=0.02), x
        assert x["mb_s"] == pytest.approx(x["iops"] * x["block_bytes"] / 1e6, rel=0.02), x
        assert 0 < x["p50_us"] <= x["p90_us"] <= x["p99_us"], x
        assert 0 < x["cpu_s"] <= x["seconds"] * (os.cpu_count() or 1) + 0.1, x
        assert x["block_bytes"] == (1 << 20 if x["kind"] == "seq_read" else 4096)
    # O_DIRECT where the filesystem takes it (ext4, xfs; tmpfs since Linux 6.6), the refusal line otherwise
    assert all(x["direct"] for x in lines[1:]) or "O_DIRECT refused" in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_disk_probe_reads_through_io_uring_at_each_depth(tmp_path):
    """--ring-depths: the SSD tier's reader against the same file, a line per depth (or the one
    line saying io_uring is refused here)."""
    from trainer.sparse.embedding.store.tier import uring
    proc = subprocess.run([PY, "-m", "benchmarks.disk_probe", "--dir", str(tmp_path), "--size", "2M",
                           "--seconds", "0.2", "--threads", "1", "--ring-depths", "4", "64"],
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    lines = [x for x in _json_lines(proc) if x["kind"] == "ring_read"]
    ring = uring.open_ring(4)
    if ring is None:
        assert lines == [] and "io_uring is refused here" in proc.stderr, proc.stderr
        return
    ring.close()
    assert [x["queue_depth"] for x in lines] == [4, 64]
    for x in lines:
        assert x["ops"] > 0 and x["iops"] == pytest.approx(x["ops"] / x["seconds"], rel=0.02) and x["seconds"] >= 0.2, x
        assert x["block_bytes"] == 4096 and x["p50_us"] is None and 0 < x["cpu_s"], x
    bad = subprocess.run([PY, "-m", "benchmarks.disk_probe", "--dir", str(tmp_path), "--ring-depths", "0"],
                         capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "--ring-depths 0: each must be in 1..4096" in bad.stderr
    assert os.listdir(tmp_path) == []


def test_disk_probe_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch, capsys):
    import errno

    from benchmarks import disk_probe

    def refuse(path, flags):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(disk_probe, "_open_direct", refuse)
    assert disk_probe.main(["--dir", str(tmp_path), "--size", "1M", "--seconds", "0.05", "--threads", "2"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines()]
    assert [(x["kind"], x["direct"]) for x in lines] == [
        ("fill", False), ("rand_read", False), ("seq_read", False), ("rand_write", False)]
    assert err.count("O_DIRECT refused by the filesystem") == 1 and "EINVAL" in err, err
    assert all(x["ops"] > 0 for x in lines) and os.listdir(tmp_path) == []
    assert disk_probe.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0 and disk_probe.percentile([], 0.9) == 0.0


def test_setup_check_finds_everything_in_this_venv():
    """setup.sh --check, the check a real run ends with, against the venv running the tests (a real
    run would install into it)."""
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh"), "--check"], capture_output=True,
                       text=True, env={**env(), "VENV": sys.prefix}, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[setup] torch" in p.stdout and "[setup] horovod 0.28.1" in p.stdout and "check passed" in p.stdout
    missing = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh"), "--check"], capture_output=True,
                             text=True, env={**env(), "VENV": "/nonexistent/venv"}, timeout=60)
    assert missing.returncode == 1 and "error: /nonexistent/venv/bin/python does not exist" in missing.stderr


@pytest.mark.slow
def test_install_horovod_has_nothing_to_do_in_this_venv():
    """install_horovod.sh's idempotent path (every setup after the first): the installed Horovod
    matches this torch, nothing is built or installed, horovodrun --check-build runs."""
    require_horovod()
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_horovod.sh")], capture_output=True, text=True,
                       env={**env(), "PYTHON": PY}, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "already installed" in p.stdout and "nothing to do" in p.stdout and "[X] Gloo" in p.stdout
    assert "pip install" not in p.stdout and "building" not in p.stdout.lower()


# -------------------------------------------------------------- trainer command lines (launch.py)
def test_trainer_command_per_launcher():
    assert launch.trainer_command(1, ["data=tiny"], python="py") == ["py", "-m", "trainer", "data=tiny"]
    assert launch.trainer_command(2, ["data=tiny"], python="py") == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "trainer", "comm=torch",
        "data=tiny"]
    assert launch.trainer_command(2, ["data=tiny"], "horovodrun", python="/v/bin/python") == [
        "/v/bin/python", "/v/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
        "/v/bin/python", "-m", "trainer", "comm=horovod", "data=tiny"]
    # an override that chooses comm itself wins; another module takes the same arguments
    assert launch.trainer_command(2, ["comm=auto"], python="py", module="benchmarks.phases")[-3:] == [
        "-m", "benchmarks.phases", "comm=auto"]
    # multi-node torchrun: the rendezvous replaces --standalone, nproc is per node
    argv = launch.launch_command("torchrun", 1, ["py", "-m", "trainer"], ["--nnodes", "2", "--node_rank", "1"])
    assert argv == ["py", "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "1",
                    "-m", "trainer"]
    for bad in (lambda: launch.launch_command("local", 2, ["py"]), lambda: launch.launch_command("mpirun", 2, ["py"]),
                lambda: launch.launch_command("torchrun", 0, ["py"]), lambda: launch.check_trainer(0, [])):
        with pytest.raises(ValueError):
            bad()


def test_check_trainer_composes_what_the_workers_would():
    launch.check_trainer(2, ["data=tiny"], "torchrun")
    with pytest.raises(ValueError, match="must be divisible by the world size 3"):  # ConfigError
        launch.check_trainer(3, ["data=tiny", "data.global_batch_size=64"])
    with pytest.raises(ValueError, match="comm.backend='nosuch'"):
        launch.check_trainer(2, ["data=tiny", "comm.backend=nosuch"], "horovodrun")


def test_install_podman_ends_with_a_running_engine():
    """install_podman.sh (.ci/run runs it before the suite): as root on Debian it installs what is
    missing (nothing, where CI already ran it), keeps an existing containers.conf and ends with
    `podman info` naming the runtime."""
    import shutil

    if os.geteuid() != 0 or shutil.which("dpkg") is None or shutil.which("apt-get") is None:
        pytest.skip("install_podman.sh needs root, dpkg and apt-get (Debian)")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_podman.sh")], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[install_podman] podman: runtime runc" in p.stdout, p.stdout
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_podman.sh"), "nosuch"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("error: nosuch: unknown argument"), r.stderr


def test_install_slurm_ends_with_the_daemons_and_clients():
    """install_slurm.sh (.ci/run runs it before the suite, for tests/distributed/test_slurm.py): as root
    on Debian it installs what is missing (nothing, where CI already ran it; seconds), keeps an
    existing munge key, starts nothing, and names the versions; the daemons and clients are there."""
    import shutil

    if os.geteuid() != 0 or shutil.which("dpkg") is None or shutil.which("apt-get") is None:
        pytest.skip("install_slurm.sh needs root, dpkg and apt-get (Debian)")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_slurm.sh")], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^\[install_slurm\] slurm-wlm \d+\.\d+", p.stdout, re.M), p.stdout
    assert "[install_slurm] keeping the existing /etc/munge/munge.key" in p.stdout, p.stdout
    assert [c for c in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged") if shutil.which(c) is None] == []
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_slurm.sh"), "nosuch"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("error: nosuch: unknown argument"), r.stderr


def test_bench_store_a_memory_point_then_disk_points_under_a_cgroup(tmp_path):
    """A shrunk run: the memory point, then a disk point whose cache is half the shard, run under a
    memory cgroup where the machine has one; its outputs and the shard's files are gone after."""
    from dev import memcg
    argv = documented("python -m benchmarks.bench_store --rows 200000 --steps 300 --warmup 100 --headroom 600M")
    proc = subprocess.run([*argv, "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mem, disk = [json.loads(x) for x in proc.stdout.splitlines()]
    assert mem["kind"] == "memory" and disk["kind"] == "disk" and disk["cache_share"] == 0.5
    assert mem["samples_per_sec"] > 0 and 0 < disk["ratio_to_memory"] < 10 and 0 < disk["row_hit_rate"] < 1
    assert disk["cache_bytes"] == int(mem["disk_bytes"] * 0.5) and disk["rows_loaded_per_step"] > 0
    assert disk["cache_emptied"] == 0 and 0 < disk["loaded_share_of_unique"] < 1
    assert disk["cgroup"] == (memcg.hierarchy().version if memcg.availability()[0] else None)
    if disk["cgroup"]:
        assert 0 < disk["peak_bytes"] <= disk["limit_bytes"]
    assert os.listdir(tmp_path) == []



def test_store_scale_trains_saves_and_resumes_at_2w_under_cgroups(tmp_path):
    """A shrunk run: W = 1 trains and saves, W = 2 resumes from it, each rank under its memory
    cgroup; a line per phase, nothing killed, each cgroup's peak under its limit, and nothing left
    behind."""
    from dev import memcg
    ok, why = memcg.availability()
    if not ok:
        pytest.skip(f"needs a memory cgroup: {why}")
    argv = documented("python -m benchmarks.store_scale --model 20G --limit 8G --cache 6G --steps 300 --resume-steps 60")
    proc = subprocess.run([*argv, "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, resume = [json.loads(x) for x in proc.stdout.splitlines()]
    assert (train["phase"], train["world"], train["from_step"]) == ("train", 1, 0)
    assert (resume["phase"], resume["world"], resume["from_step"], resume["to_step"]) == ("resume", 2, 20, 30)
    for p in (train, resume):
        assert p["oom_kills"] == 0 and p["samples_per_sec"] > 0 and p["rank0_rows_read_per_step"] > 0
        assert p["peak_rss_bytes"] > 0 and 0 < p["cgroup_peak_bytes"] <= p["limit_bytes"]
    assert train["model_bytes"] > 3 * train["cache_bytes"] and train["checkpoint_bytes"] > 0
    assert 0 < resume["rank0_disk_bytes"] < train["rank0_disk_bytes"]  # each rank holds its half
    assert os.listdir(tmp_path) == []


def test_store_scale_train_only_trains_without_a_checkpoint(tmp_path):
    """--train-only: the W = 1 phase alone, not saved (a model too big for the disk to also hold a
    checkpoint): one line, no checkpoint written, nothing left behind."""
    from dev import memcg
    ok, why = memcg.availability()
    if not ok:
        pytest.skip(f"needs a memory cgroup: {why}")
    argv = [sys.executable, *argv_of("benchmarks/store_scale.py"), "--model", "40M", "--limit", "600M", "--cache", "16M",
            "--steps", "12", "--train-only", "--dir", str(tmp_path)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [train] = [json.loads(x) for x in proc.stdout.splitlines()]
    assert (train["phase"], train["world"], train["to_step"], train["oom_kills"]) == ("train", 1, 12, 0)
    assert train["checkpoint_bytes"] == 0 and train["rank0_rows_read_per_step"] > 0
    assert train["rank0_log_merges"] >= 0 and train["rank0_log_merge_wait_s"] >= 0
    assert os.listdir(tmp_path) == []
