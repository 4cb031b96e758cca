"""embedding.store=disk's files: the shard's records on disk (disk.py: DiskTier), one file of
records and its whole-page I/O (records.py: RecordFile), the reads ahead's copies (readahead.py),
io_uring (uring.py) and the write-back log (writelog.py: WriteLog)."""
