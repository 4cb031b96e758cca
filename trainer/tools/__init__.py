"""The package's own command-line tools: the cache simulator's driver (simulate.py), the staleness
sweep report (sweep.py), the logistic-regression baseline (baseline.py), the trainer's command lines
under each launcher (launch.py) and what their scripts share (cli.py). Training never imports them.
Benchmarks, studies and the cluster emulation live beside the package, in benchmarks/ and dev/."""
