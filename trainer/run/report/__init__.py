"""What a run tells its user: metrics.jsonl lines, TensorBoard scalars, the progress bar and
summary.json. Counters live where they are counted (the collectives' byte counter, the cache's
CacheStats, the owners' staleness log); this package sums them over ranks, formats them and writes
every file a run reports in:

- reporter.py: Reporter (one rank's lines, the summary; collective) and the `dynamic` block;
- tensorboard.py: the TensorBoard event files;
- writers.py: metrics.jsonl (JsonlWriter), summary.json (write_summary), the log cut back after a
  resume (keep_records_until); whole files through trainer/base/core/atomic.py, the package's one
  atomic writer (a sweep's summary.json and Criteo preparation's files use it too).
"""
from .reporter import Reporter, dynamic_summary
from .tensorboard import TensorBoardWriter, staleness_histogram
from .writers import JsonlWriter, keep_records_until, write_summary

__all__ = ["JsonlWriter", "Reporter", "TensorBoardWriter", "dynamic_summary", "keep_records_until",
           "staleness_histogram", "write_summary"]
