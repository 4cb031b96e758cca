"""Scheduling: which samples form each global batch (FAE hot/cold batches) and which worker trains
which sample (Herald's location-aware partition), plus when updated rows are synchronised (Herald's
on-demand sync). Everything here is computed identically on every rank from the global view of the
data, so no decision ever travels on the wire.
"""
from .feed import Feed, HotColdOrder, StreamOrder

__all__ = ["Feed", "HotColdOrder", "StreamOrder"]
