"""Consistent checkpoints of a hybrid-parallel run, and resume on any number of workers.

The package, by concern (docs/design.md, section 8):

- manifest.py: what a checkpoint is on disk: `step_K` directories, the files, their checksums and
  the manifest written last; which checkpoints are complete and which was saved last;
- shard_io.py: a rank's shard (rows, versions, optimizer state) as raw arrays written and read in
  bounded pieces, checksummed per block;
- row_order.py: the order of the rows in a shard's files, so that a reader at another W reads only its rows;
- state.py: the rank's RNG states, and the reader of format 1's pickled shards;
- lock.py: one run at a time in a checkpoint.dir (DirLock, taken over from a dead run; the same lock
  guards output and sweep dirs, trainer/run/outdir.py);
- saver.py: writing one atomically (CheckpointWriter: every rank its shard, rank 0 the manifest and the
  rename, then rotation by save order);
- loader.py: choosing the checkpoint to resume and loading its rows under this run's W;
- manager.py: CheckpointManager, the run's one seam to all of the above (save, resume, the rescue
  of a failed save, the lock's lifetime). The Trainer talks to it and to nothing else here.

Names used across the project (and by the tests) are re-exported here.
"""
from .loader import load, resolve
from .lock import CHECKPOINT_DIR, LOCK, DirLock, Guarded, describe_holder
from .manager import Checkpointed, CheckpointManager, Rescue
from .manifest import (FORMAT_VERSION, MANIFEST, SCHEMA_KEYS, TRAINER_FILE, WORLD_BOUND_DATA, CheckpointDamaged,
                       CheckpointError, check_schema, check_stream_world, complete_checkpoints,
                       damaged_checkpoints, last_save_seq, latest, read_manifest, save_order, shard_file,
                       step_dir)
from .saver import CheckpointWriter
from .shard_io import read_shards, shard_dir, write_shard
from .state import load_shard_rows, rng_state, set_rng_state

__all__ = ["CHECKPOINT_DIR", "FORMAT_VERSION", "LOCK", "MANIFEST", "SCHEMA_KEYS", "TRAINER_FILE", "WORLD_BOUND_DATA",
           "CheckpointDamaged", "CheckpointError", "CheckpointManager", "Checkpointed", "CheckpointWriter", "DirLock",
           "Guarded", "Rescue", "check_schema", "check_stream_world", "complete_checkpoints",
           "damaged_checkpoints", "describe_holder", "last_save_seq", "latest", "load", "load_shard_rows",
           "read_manifest", "read_shards", "resolve", "rng_state", "save_order", "set_rng_state", "shard_dir",
           "shard_file", "step_dir", "write_shard"]
