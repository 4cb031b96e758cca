"""Remote-row protocols: one declared interface (base.RemoteRows), one file per implementation."""
from .base import CACHE_COUNTERS, Audit, CacheStats, RemoteRows, StalenessStats
from .on_demand import HeraldRemote
from .het import HetRemote, HetWire, VersionWire, het_wire_bytes, serve_check
from .lent import LentRows
from .plain import PlainRemote

__all__ = ["CACHE_COUNTERS", "Audit", "CacheStats", "HeraldRemote", "HetRemote", "HetWire", "LentRows",
           "PlainRemote", "RemoteRows", "StalenessStats", "VersionWire", "het_wire_bytes", "serve_check"]
