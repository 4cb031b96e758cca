"""HET's per-worker cache of remote rows (rows.py: RowCache), its undo within a step (journal.py),
the consistency model's rules (consistency.py) and the id -> slot map it shares with Herald's lent
rows (slotmap.py)."""
