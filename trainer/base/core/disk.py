"""A directory's free space, as one rank may count on it: the start-up checks of a disk too small
(embedding.store=disk's files, trainer/run/build.py; checkpoint.dir, trainer/run/checkpoint/manager.py)."""
from __future__ import annotations

import os

__all__ = ["free_share"]


def free_share(path: str, local_size: int | None) -> int:
    """Bytes free to an unprivileged writer on the file system of `path` (or of its nearest
    existing parent, when it is not made yet), divided among the `local_size` ranks of this host
    that write there too."""
    where = os.path.abspath(path)
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize // max(local_size or 1, 1)
