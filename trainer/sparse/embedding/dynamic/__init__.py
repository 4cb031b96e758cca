"""Dynamic tables (embedding.kind=dynamic): the owner's shard of rows found by id (shard.py), the
slot pool with admission and eviction (pool.py, admission.py) and its undo within a step
(pool_journal.py)."""
