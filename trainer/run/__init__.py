"""Tier 4, a run around its steps: the parts made from a config (build.py), the Trainer's start-up,
loop and end (runner.py), the values derived before a run starts (resolve/: the recipe, the final
config, the memory plan), checkpoints (checkpoint/), the evaluation (evaluation/), the reports
(report/), and the run's life: its output directory, stops and signals, the relaunch line, the
job wrapper, sweeps and the install check (outdir.py, signals.py, relaunch.py, job.py,
multirun.py, install.py)."""
