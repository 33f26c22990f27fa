"""Deleted-but-open files: a process's temporary file (Python's `tempfile.TemporaryFile`,
an `O_TMPFILE` file, a log unlinked while written) has no path to reopen at a restore.

At the checkpoint (every process stopped) its content is copied into a memfd of the daemon
(so it costs memory, like a template's dirtied pages: at most MAX_BYTES per file, larger
ones are refused). At a restore a new unlinked file is made in the same directory of the
restored file system (`O_TMPFILE`), filled from that copy, with the original's mode and
owner, and each open file description of it comes back with its flags and offset, shared
by the descriptors (and processes) that shared it. A file some descriptor holds while
another holds its path is a different case (a hard link left): refused, as are a file
whose directory is gone too, and one mapped into memory (its pages belong to the file).
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from dataclasses import dataclass, field

from ..fs.files import open_in_root
from . import native
from .capture import ProcessRecord, Refusal

MAX_BYTES = 64 << 20
# Flags of the original's open that would fail or mean something else on our reopen of
# the new file through /proc/self/fd: O_TMPFILE (it includes O_DIRECTORY) stays in the
# flags of a file opened with it, and O_NOFOLLOW refuses the magic link (tempfile sets it).
_REOPEN_DROP = (os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_NOCTTY | os.O_CLOEXEC |
                os.O_TMPFILE | os.O_NOFOLLOW)


@dataclass
class Description:
    """One open file description of an unlinked file: its open(2) flags and offset, and
    the (host pid at the checkpoint, fd) holding it."""
    flags: int
    pos: int
    holders: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class UnlinkedFile:
    path: str                     # where it was (inside the sandbox) before its unlink
    mode: int                     # permission bits
    uid: int
    gid: int
    size: int
    descriptions: list[Description] = field(default_factory=list)
    saved: int | None = None      # our memfd holding its content at the checkpoint


def capture(records: list[ProcessRecord]) -> tuple[list[UnlinkedFile], list[Refusal]]:
    """The deleted-but-open files of the sandbox's stopped processes, content copied."""
    by_inode: dict[tuple[int, int], list[tuple[ProcessRecord, native.FdInfo]]] = \
        defaultdict(list)
    stats: dict[tuple[int, int], os.stat_result] = {}
    for rec in records:
        for f in rec.fds:
            if f.kind == "file" and f.deleted:
                st = os.stat(f"/proc/{rec.pid}/fd/{f.fd}")
                stats[(st.st_dev, st.st_ino)] = st
                by_inode[(st.st_dev, st.st_ino)].append((rec, f))
    out: list[UnlinkedFile] = []
    refused: list[Refusal] = []
    try:
        for key, held in by_inode.items():
            rec, f = held[0]
            why = _refusal(rec, f, stats[key])
            if why:
                refused.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: deleted-but-open "
                                       f"file {f.path}: {why}"))
                continue
            out.append(_copy(held))
    except BaseException:
        close_saved(out)
        raise
    if refused:
        close_saved(out)
        out = []
    return out, refused


def _refusal(rec: ProcessRecord, f: native.FdInfo, st: os.stat_result) -> str | None:
    if st.st_nlink:
        return "still linked under another name: not captured"
    if st.st_size > MAX_BYTES:
        return f"{st.st_size} bytes (more than {MAX_BYTES >> 20} MiB are not captured)"
    if not os.path.isdir(f"/proc/{rec.pid}/root{os.path.dirname(f.path)}"):
        return "its directory is gone too: not captured"
    if _mapped(rec.pid, st):
        return "mapped into memory: not captured"
    return None


def _mapped(pid: int, st: os.stat_result) -> bool:
    """Whether pid maps this inode (/proc/pid/maps: dev major:minor, inode)."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any(len(p) > 4 and p[3] == dev and p[4] == str(st.st_ino)
                       for p in (line.split() for line in maps))
    except OSError:
        return False


def _copy(held: list[tuple[ProcessRecord, native.FdInfo]]) -> UnlinkedFile:
    rec, f = held[0]
    src = os.open(f"/proc/{rec.pid}/fd/{f.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        u = UnlinkedFile(f.path, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size)
        u.saved = os.memfd_create("dbx-unlinked", os.MFD_CLOEXEC)
        _fill(u.saved, src, st.st_size)
    finally:
        os.close(src)
    for rec, f in held:
        d = next((d for d in u.descriptions
                  if native.same_file(rec.pid, f.fd, d.holders[0][0], d.holders[0][1])), None)
        if d is None:
            d = Description(f.flags, f.pos)
            u.descriptions.append(d)
        d.holders.append((rec.pid, f.fd))
    return u


def _fill(dst: int, src: int, size: int) -> None:
    """Copy `size` bytes from the start of src to dst (in the kernel)."""
    done = 0
    while done < size:
        n = os.sendfile(dst, src, done, size - done)
        if n == 0:
            raise OSError(0, f"the file ended at {done} of {size} bytes")
        done += n


def close_saved(files: list[UnlinkedFile]) -> None:
    for u in files:
        if u.saved is not None:
            os.close(u.saved)
            u.saved = None


def recreate(u: UnlinkedFile, rootfd: int) -> dict[int, int]:
    """A new unlinked file like `u` in its directory under `rootfd` (a generation's root):
    our descriptor for each of its descriptions, by position in u.descriptions. The
    caller closes them."""
    assert u.saved is not None
    dirfd = open_in_root(rootfd, os.path.dirname(u.path) or "/", os.O_PATH | os.O_DIRECTORY)
    made: dict[int, int] = {}
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, u.mode, dir_fd=dirfd)
        try:
            os.fchown(fd, u.uid, u.gid)
            os.fchmod(fd, u.mode)
            _fill(fd, u.saved, u.size)
            for i, d in enumerate(u.descriptions):
                made[i] = os.open(f"/proc/self/fd/{fd}",
                                  (d.flags & ~_REOPEN_DROP) | os.O_CLOEXEC)
                os.lseek(made[i], d.pos, os.SEEK_SET)
        finally:
            os.close(fd)
    except BaseException:
        for m in made.values():
            os.close(m)
        raise
    finally:
        os.close(dirfd)
    return made
