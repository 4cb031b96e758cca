"""Writing a checkpoint: every rank its shard, rank 0 the rest, atomically, then rotation.

A shard is written in bounded pieces, hashed as it is written (shard_io.py): a save needs one piece
of memory beyond the model, whatever its size.

Why it is atomic: everything is written into `step_K.tmp-<run id>-<token>`; once every rank's file
is written (an allgather of their checksums), rank 0 writes the manifest (sha256 of every file)
last and renames the directory to `step_K`. A directory named step_K is therefore complete, a crash
mid-save leaves the earlier checkpoints untouched, and rotation deletes old ones only afterwards.
A save that fails removes its own `.tmp-` directory, so a full disk does not fill up with them.
checkpoint.dir must be one filesystem visible to every rank.

What only rank 0 can do (take the directory's lock, create the work directory, write the manifest
and rename) it does inside Collectives.root_decides, so every rank returns or raises together.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from typing import Any


from ...base.comm import CollectiveError, Collectives
from ...base.core.progress import fmt_bytes, say_if_slow
from ...sparse.embedding.store.shard import ShardStore
from .lock import LEASE_S, DirLock, lock_in_rounds
from .manifest import (FORMAT_VERSION, TRAINER_FILE, WORK_DIR, CheckpointDamaged, CheckpointError,
                       complete_checkpoints, damage_of, damage_seen, damaged_checkpoints, fsync_dir, last_save_seq,
                       read_manifest, step_dir, write_file, write_manifest)
from .pool_io import write_pool_shard
from .shard_io import files_damage, shard_dir, write_shard


class CheckpointWriter:
    """Writes step_K checkpoints under root (collective) and rotates them (keep_last; 0 = all).

    Created at start-up: rank 0 takes root's lock (DirLock) and every rank gets the outcome, so a
    directory in use by another run stops every rank before any training. close() releases it."""

    def __init__(self, comm: Collectives, root: str, keep_last: int, lease_s: float = LEASE_S) -> None:
        self.comm, self.root, self.keep_last, self.lease_s = comm, root, keep_last, lease_s
        self._seq = 0  # save_seq of this run's last save
        self._warned: set[str] = set()  # damaged checkpoints rotation has warned about
        # rank 0: the newest save of this object that is complete on disk, known as soon as it is
        # renamed into place: a peer lost in the save's closing broadcast leaves it resumable, and
        # the failure message must name it (CheckpointManager.save)
        self.completed: str | None = None
        self.lock: DirLock | None = None
        self.run_id, notes = lock_in_rounds(
            comm, lambda: DirLock(self.root, uuid.uuid4().hex[:12], lease_s=self.lease_s), self._held, CheckpointError)
        for note in notes if comm.rank == 0 else []:
            print(f"[trainer] warning: {note}", file=sys.stderr)

    def _held(self, lock: DirLock) -> tuple[str, list[str]]:
        """Rank 0, root's lock taken: (run id, warnings for the user)."""
        self.lock = lock
        return lock.run_id, lock.notes

    def close(self) -> None:
        """Release the directory (rank 0); the run's checkpoints stay."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def save(self, step: int, store: ShardStore, trainer_state: dict[str, Any] | None,
             schema: dict[str, Any]) -> str:
        """Write checkpoint `step`: every rank its shard, rank 0 also trainer_state and, last, the
        manifest (schema + checksums); then rename. The caller flushed the caches. Collective.
        On failure anywhere the partial `.tmp-` directory is removed before every rank raises; a
        peer lost mid-save (CollectiveError) leaves rank 0 removing it too, before it reports."""
        try:
            return self._save(step, store, trainer_state, schema)
        except CollectiveError:
            self._discard_own()  # a lost peer never finishes this save: its directory goes
            raise

    def _save(self, step: int, store: ShardStore, trainer_state: dict[str, Any] | None,
              schema: dict[str, Any]) -> str:
        tmp = self._tmp_dir(step)
        t0 = time.monotonic()
        try:
            mine = self.comm.all_succeed(f"checkpoint save of step {step} into {self.root}",
                                         lambda: self._write_shard(tmp, store), CheckpointError)
        except CheckpointError:
            self._discard(tmp)  # every rank has passed the allgather: nobody writes into tmp now
            raise
        shards = self.comm.allgather_object(mine)

        def finish() -> None:  # rank 0
            self._finish(tmp, step, trainer_state, schema, shards)
            self.completed = step_dir(self.root, step)
            total = sum(f["bytes"] for shard in shards for f in shard.get("fields", {}).values())
            say_if_slow(t0, lambda took: f"checkpoint of step {step}: {fmt_bytes(total)} of shards saved in "
                                         f"{took:.0f} s ({self.completed})")
        self.comm.root_decides(finish, CheckpointError)
        return step_dir(self.root, step)

    def _discard(self, tmp: str) -> None:
        """Rank 0 removes this run's partial save."""
        if self.comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _tmp_dir(self, step: int) -> str:
        """Rank 0 creates step_K.tmp-<run id>-<token>; every rank gets its name (or rank 0's error)."""
        def make() -> str:  # rank 0
            tmp = f"{step_dir(self.root, step)}.tmp-{self.run_id}-{uuid.uuid4().hex[:8]}"
            try:
                os.makedirs(tmp)
            except OSError as exc:
                raise CheckpointError(f"checkpoint save of step {step}: cannot create {tmp}: {exc}") from exc
            return tmp
        return self.comm.root_decides(make, CheckpointError)

    def _write_shard(self, tmp: str, store: ShardStore) -> dict[str, Any]:
        """Write this rank's shard into tmp (shard_io.write_shard); its manifest entry."""
        write = write_pool_shard if store.dynamic else write_shard  # dynamic tables: pool_io.py
        with store.raw(write=False):
            return write(os.path.join(tmp, shard_dir(self.comm.rank, self.comm.size)), store)

    def _finish(self, tmp: str, step: int, trainer_state: dict[str, Any] | None,
                schema: dict[str, Any], shards: list[dict[str, Any]]) -> None:
        """Rank 0: trainer file, manifest last, rename, rotate. Raises CheckpointError (after
        removing the partial save)."""
        try:
            files = {TRAINER_FILE: write_file(os.path.join(tmp, TRAINER_FILE), trainer_state)}
            seq = max(self._seq, last_save_seq(self.root)) + 1
            final = step_dir(self.root, step)
            write_manifest(tmp, {"format_version": FORMAT_VERSION, "step": step,
                                  "world_size": self.comm.size, "save_seq": seq, "run_id": self.run_id,
                                  "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "data_order_world": None,  # every data source's order is W-invariant now
                                  "damaged_seen": damage_seen(self.root, final), **schema, "files": files,
                                  "shards": {shard_dir(r, self.comm.size): s for r, s in enumerate(shards)}})
            self._publish(tmp, final)
            self._seq = seq
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which all raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint save of step {step} into {tmp} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        try:
            self.rotate()
        except OSError as exc:  # the new checkpoint is complete; old ones stay for now
            print(f"[trainer] warning: checkpoint rotation in {self.root} failed: {exc}", file=sys.stderr)

    def _publish(self, tmp: str, final: str) -> None:
        """Rename tmp to final. An existing final from an older branch of the job is replaced; a
        damaged one (no readable manifest, or a file failing its checksum: an error may have named
        it for the user to inspect) is never replaced nor deleted: it moves aside to
        `<final>.damaged-<time>`, said in one line."""
        old = None
        why = self._damage(final) if os.path.exists(final) else None
        if why is not None:
            aside = f"{final}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
            os.replace(final, aside)
            print(f"[trainer] warning: {final} was damaged ({why}); moved aside to {aside}, kept for you to "
                  f"inspect or delete, and this save takes its name", file=sys.stderr)
        if os.path.exists(final):
            old = self._old_name(final)
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old is not None:  # put the replaced checkpoint back
                os.replace(old, final)
            raise
        fsync_dir(os.path.dirname(final))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _damage(path: str) -> str | None:
        """What is wrong with the checkpoint at path: its manifest (damage_of), else its files
        checked against it (shard_io.files_damage: read whole, in pieces); None: it is intact."""
        why = damage_of(path)
        if why is not None:
            return why
        try:
            return files_damage(path, read_manifest(path))
        except CheckpointError as exc:  # another format version: not ours to judge, replaced as before
            return None if not isinstance(exc, CheckpointDamaged) else str(exc)

    def _old_name(self, path: str) -> str:
        """This run's work name for a checkpoint on its way out (WORK_DIR's `.old-` form)."""
        return f"{path}.old-{self.run_id}-{uuid.uuid4().hex[:8]}"

    def _remove(self, path: str) -> None:
        """Delete a complete checkpoint: first renamed to this run's `.old-` name (atomic), then
        removed. A run killed while deleting (rmtree takes the manifest out before the rest)
        leaves a work directory that its next run clears (lock take-over), never a step_K
        without a manifest, which resume=auto would have to stop at."""
        doomed = self._old_name(path)
        try:
            os.replace(path, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def rotate(self) -> None:
        """Delete complete checkpoints beyond keep_last, the least recently saved first (save_seq,
        not the step: a branch resumed from an older step keeps its own saves), and this run's
        own leftovers; other runs' work directories are never touched. A damaged checkpoint (no
        readable manifest, so no known save order) is never deleted: one warning names it."""
        for path, why in damaged_checkpoints(self.root):
            if path not in self._warned:
                self._warned.add(path)
                print(f"[trainer] warning: checkpoint rotation leaves {path} alone: {why}, so its place in "
                      "the save order is unknown (inspect or delete it)", file=sys.stderr)
        found = complete_checkpoints(self.root)
        drop = found[:-self.keep_last] if self.keep_last > 0 else []
        for _, path in drop:
            self._remove(path)
        self._discard_own()

    def _discard_own(self) -> None:
        """Rank 0 removes this run's unfinished saves (its `.tmp-` / `.old-` directories)."""
        if self.comm.rank != 0:
            return
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            m = WORK_DIR.match(name)
            if m and m.group("run") == self.run_id:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
