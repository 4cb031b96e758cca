"""Tools around the trainer (sweeps, baselines, simulation driver, cluster emulation): not imported by training."""
