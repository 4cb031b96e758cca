"""The package's own command-line tools, what a user runs: Criteo preparation (prepare_criteo.py),
the staleness sweep report (sweep.py), the cache simulator's driver (simulate.py), the
logistic-regression baseline (baseline.py) and what their scripts share (cli.py). Training never
imports them. Benchmarks, studies, the launch helpers and the cluster emulation live beside the
package, in benchmarks/ and dev/."""
