#!/usr/bin/env python
"""Every training path (models, optimizers, caches x consistency, FAE, SCA, Herald, pipelined steps,
skip mode, wire precision, checkpoint resume; W = 1 and W = 2 through gloo) on a CUDA device
against the CPU reference run, one JSON line per path (trainer/tools/gpu_parity.py):

    python scripts/gpu_parity.py [--only NAME ...] [--jobs 4] [--steps 120] [--out FILE] [--criteo DIR]

--criteo DIR (a prepared Criteo directory) adds data=criteo with the DALI pipeline on the device
against the memmap reader on the CPU.

Exit status 0 when every path equals its CPU reference within tolerance, 1 otherwise, 2 without a
CUDA device.
"""
import sys

from trainer.tools.gpu_parity import main

if __name__ == "__main__":
    sys.exit(main())
