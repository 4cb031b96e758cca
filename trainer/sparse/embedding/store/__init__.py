"""The owner's shard of fixed tables: in memory (shard.py: ShardStore), or on disk with a row buffer
in RAM in front (tiered.py: TieredStore over tier/'s DiskTier). Both answer the same calls of the
module and the exchange (read rows, apply the owner's update, save and load)."""
