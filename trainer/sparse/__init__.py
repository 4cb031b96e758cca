"""Tier 2, the sparse side: the embedding tables and how their rows are stored, cached, moved and
updated (embedding/), where hot rows live (placement/: FAE, SCA's cost model), the order of the
steps and the partition of rows (schedule/: Herald), the cache simulator's engine (sim/), and
Sparse (side.py), one rank's sparse side as a value the tiers above are handed."""
