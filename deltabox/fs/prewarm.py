"""Read a fresh clone's files into the page cache before a rollback needs them.

A btrfs snapshot shares its source's extents but not its inodes, and the page cache is per
inode: every file a sandbox wrote before a checkpoint is read from the store again after a
rollback to it, on the critical path of the agent's next command (stop 59 probes: reading
~600 such files took 69 against 57 ms p50, importing packages unpacked into the sandbox's
layer 13-27 ms more). The warm pool's ready generation is built during the agent's pause;
asking the kernel to read its layer's files ahead then (POSIX_FADV_WILLNEED: asynchronous,
no copy into this process) moves that cost off the rollback's path
(`benchmarks/after_rollback.py` measures both ways).

Only the sandbox's own layer: files of the image and of a shared base layer keep their
inodes, and so their page cache, across rollbacks. Bounded (files walked, bytes asked for)
so that a layer of a million files or of big data files costs the daemon little: what is
left over is read on demand, as without this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MAX_FILES = 4096            # regular files looked at per layer
MAX_BYTES = 64 << 20        # bytes asked for per layer
MAX_FILE_BYTES = 8 << 20    # bigger files are left to be read on demand, unless programs

# The kernel reads at most max(read_ahead_kb, max_sectors_kb) per WILLNEED advice
# (mm/readahead.c, force_page_cache_ra): 128 KiB by default. One per piece, then.
ADVICE_BYTES = 128 << 10

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOATIME


@dataclass
class Prewarmed:
    seen: int = 0           # regular files looked at
    files: int = 0          # files asked for
    bytes: int = 0          # their bytes
    skipped: int = 0        # regular files over MAX_FILE_BYTES, not programs
    errors: int = 0         # files or directories not read (gone meanwhile: a race, not a fault)
    truncated: bool = False  # a bound was reached: the walk stopped there


def prewarm(upper: str | Path, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES,
            max_file_bytes: int = MAX_FILE_BYTES) -> Prewarmed:
    """Ask the kernel to read the regular files under `upper` ahead, in walk order, until
    a bound is reached. Never raises: a file gone meanwhile is counted, not an error."""
    out = Prewarmed()
    stack = [str(upper)]
    while stack and not out.truncated:
        try:
            with os.scandir(stack.pop()) as it:
                # entry by entry: a directory of a million is never held in memory
                for e in it:
                    if not _one(e, stack, out, max_files, max_bytes, max_file_bytes):
                        out.truncated = True
                        break
        except OSError:   # the directory went (a race with the sandbox), or unreadable
            out.errors += 1
    return out


def _one(e: os.DirEntry[str], stack: list[str], out: Prewarmed, max_files: int,
         max_bytes: int, max_file_bytes: int) -> bool:
    """Push a directory, advise a regular file; False once a bound is reached."""
    try:
        if e.is_dir(follow_symlinks=False):
            stack.append(e.path)
            return True
        if not e.is_file(follow_symlinks=False):
            return True
        out.seen += 1
        size = e.stat(follow_symlinks=False).st_size
    except OSError:
        out.errors += 1
        return True
    if out.seen > max_files:
        return False
    if size > max_file_bytes and not (size <= max_bytes and _loaded_whole(e)):
        out.skipped += 1
        return True
    if out.bytes + size > max_bytes:
        return False
    if size and _advise(e.path, size):
        out.files += 1
        out.bytes += size
    elif size:
        out.errors += 1
    return True


def _loaded_whole(e: os.DirEntry[str]) -> bool:
    """A program or shared library: every process that runs it maps and reads most of it,
    whatever its size (a big data file is often read in part, if at all)."""
    name = e.name
    if name.endswith(".so") or ".so." in name:
        return True
    try:
        return bool(e.stat(follow_symlinks=False).st_mode & 0o111)
    except OSError:
        return False


def _advise(path: str, size: int) -> bool:
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return False
    try:
        for off in range(0, size, ADVICE_BYTES):
            os.posix_fadvise(fd, off, min(ADVICE_BYTES, size - off), os.POSIX_FADV_WILLNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
