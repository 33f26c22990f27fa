"""Named files whose open file description several descriptors share.

`cmd > log 2>&1` gives fd 1 and fd 2 one open file description; a shell's redirection is
inherited by the commands it starts; a server's workers write to the log their master
opened. Such descriptors write at one offset: each write lands after the last, whichever
descriptor made it. A restore that reopened each descriptor on its own (fork_template.c
reopen_file) would give each an offset of its own, and writes through one would overwrite
those through the other (seen: a program alternating stdout and stderr lines into
`log 2>&1` lost every other line after a rollback). Reads share the offset the same way.

So at the checkpoint the sandbox's descriptors of named regular files are grouped by open
file description (kcmp KCMP_FILE), and a restore opens each description that several hold
once, in the restored tree, with its flags and offset, and gives it to every descriptor
that held it (engine._PipePlan.file_fds), as the fork or dup that made them did. Its file
locks then come back on the one description too (a /dev/shm file's is opened from the
file made again: cr/shm_files.py). A shared description of a file on another mount of
its own (/proc, /sys: reopened by path when held alone, but not in the tree the daemon
opens from) is refused by name. Not preserved: the description's credentials (the
daemon's, as for any object a restore makes for the processes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..fs.files import open_in_root
from . import native
from .capture import ProcessRecord, Refusal, in_dev_shm, on_snapshotted_root

# The flags of a description that its reopen keeps: access mode and status flags. Those
# that act only at open (O_CREAT, O_TRUNC, ...) and the descriptor's O_CLOEXEC are not.
_KEEP = (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_DSYNC | os.O_SYNC | os.O_DIRECT |
         os.O_NOATIME | os.O_LARGEFILE | os.O_PATH)


@dataclass
class SharedFile:
    """One open file description of a named file held by two or more descriptors."""
    path: str                     # inside the sandbox
    flags: int                    # its open(2) flags (fdinfo), less what only acts at open
    pos: int                      # its offset at the checkpoint
    holders: list[tuple[int, int]] = field(default_factory=list)   # (host pid, fd)


def capture(records: list[ProcessRecord]) -> tuple[list[SharedFile], list[Refusal]]:
    """The descriptions of named files that more than one descriptor holds, and the
    refusals of those that cannot be opened again (on a mount of their own)."""
    by_path: dict[str, list[list[tuple[ProcessRecord, native.FdInfo]]]] = {}
    for rec in records:
        for f in rec.fds:
            if f.kind != "file" or f.deleted:
                continue
            groups = by_path.setdefault(f.path, [])
            for g in groups:
                first, f0 = g[0]
                if native.same_file(first.pid, f0.fd, rec.pid, f.fd):
                    g.append((rec, f))
                    break
            else:
                groups.append([(rec, f)])
    shared: list[SharedFile] = []
    refused: list[Refusal] = []
    for path, groups in by_path.items():
        for g in groups:
            if len(g) < 2:
                continue
            first, f0 = g[0]
            if not in_dev_shm(path) and not on_snapshotted_root(first.pid, path):
                others = ", ".join(f"pid {r.nspid} fd {f.fd}" for r, f in g[1:])
                refused.append(Refusal(first.nspid, first.cmd, (
                    f"fd {f0.fd}: {path} is open through one file description it shares "
                    f"with {others}, on a mount of its own (/proc, /sys), where a restore "
                    "cannot open it once for all of them: not restored")))
                continue
            shared.append(SharedFile(path, f0.flags & _KEEP, f0.pos,
                                     [(r.pid, f.fd) for r, f in g]))
    return shared, refused


def open_again(root: int, s: SharedFile) -> int:
    """Our descriptor of a new description of s's file in the tree at `root`, with its
    flags and offset."""
    return _at_pos(open_in_root(root, s.path, s.flags | os.O_CLOEXEC), s)


def reopen(made: int, s: SharedFile) -> int:
    """The same for a file we made again ourselves (`made`, our fd of a /dev/shm file:
    shm_files.py), through its magic link."""
    return _at_pos(os.open(f"/proc/self/fd/{made}", (s.flags & ~os.O_PATH) | os.O_CLOEXEC),
                   s)


def _at_pos(fd: int, s: SharedFile) -> int:
    """fd moved to the description's offset (closed if that fails)."""
    try:
        if not s.flags & os.O_PATH:
            os.lseek(fd, s.pos, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def holders_of(shared: list[SharedFile], pid: int) -> dict[int, int]:
    """pid's descriptors among the shared descriptions: fd -> index in `shared`."""
    return {fd: i for i, s in enumerate(shared) for p, fd in s.holders if p == pid}
