"""The cache simulator's engine (imports only trainer/sparse/embedding): engine.py replays id traces through
the trainer's own remote-row protocols for W simulated workers; belady.py is Belady's MIN (the OPT
hit rate)."""
from .belady import belady_hits, next_use, opt_hits_by_table
from .engine import (OWNERS, ROW_ELEM, Audit, CacheSimulator, InProcessHetWire, InProcessRowWire, Owners,
                     SimSpec, Trace, bound_value, run_simulation)

__all__ = ["OWNERS", "ROW_ELEM", "Audit", "CacheSimulator", "InProcessHetWire", "InProcessRowWire", "Owners",
           "SimSpec", "Trace", "belady_hits", "bound_value", "next_use", "opt_hits_by_table", "run_simulation"]
