"""embedding.store=disk's files: the shard's records on disk (disk.py: DiskTier), how they are read
and written (records.py, readahead.py, uring.py) and the write-back log (log.py, writelog.py)."""
