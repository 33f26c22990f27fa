"""Deleted-but-open files and shared memory: objects no path leads to. A process's
temporary file (Python's `tempfile.TemporaryFile`, an `O_TMPFILE` file, a log unlinked
while written), a memfd, anonymous shared memory (`mmap(MAP_SHARED|MAP_ANONYMOUS)`), a
POSIX semaphore or multiprocessing's heap (a /dev/shm file mapped, then unlinked) have no
path to reopen at a restore, and a template (a fork) shares their pages with the live
process instead of keeping them as they were.

At the checkpoint (every process stopped) each object's content is copied into a memfd of
the daemon (so it costs memory, like a template's dirtied pages: at most MAX_BYTES of
written pages per object, larger ones are refused; pages never written, holes, are
neither read nor held). At a restore a new object is made once, filled from that
copy: in memory (a memfd) if the original was (shared memory, /dev/shm, a memfd), else an
unlinked file in the same directory of the restored file system (`O_TMPFILE`) with the
original's mode and owner. Each open file description comes back with its flags and
offset, shared by the descriptors (and processes) that shared it, and each shared mapping
is mapped again from it at its address, offset and protection, so processes that shared
memory share the new object. Refused: an object of a file system that is neither the
sandbox's tree nor memory (a Linux AIO context's ring: its content is no file's; a POSIX
message queue unlinked while open is posix_mq.py's), a file some descriptor holds while another
holds its path (a hard link left), a file whose directory is gone too, and a deleted file
mapped privately as well (its private pages would not follow the new file). What is not
preserved: the new object's name in /proc/PID/fd and maps (a memfd shows as
"/memfd:NAME (deleted)") and its device and inode numbers. A memfd's seals
(`F_ADD_SEALS`: a peer trusts a sealed buffer not to change) come back once it is filled;
one sealed against future writes (`F_SEAL_FUTURE_WRITE`) while mapped writable is refused
(the mapping could not be made again).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass, field

from .. import kernfs
from ..fs.files import open_in_root
from . import native
from .capture import MQUEUE_MAGIC, ProcessRecord, Refusal, SharedMapping, is_posix_queue

MAX_BYTES = 64 << 20
# statfs f_type of the file systems whose unlinked objects are copied: the sandbox's tree
# (overlay) and memory (tmpfs: /dev/shm, a memfd, anonymous shared memory)
_COPIED_FS = (0x794C7630, 0x01021994)
# and of those an object may be on instead, by what a user would know them as
_OTHER_FS = {MQUEUE_MAGIC: "a POSIX message queue (mq_open)",
             0xA10A10A1: "a Linux AIO context's ring (io_setup)",
             0x958458F6: "hugetlbfs", 0x5345434D: "memfd_secret memory"}
F_SEAL_FUTURE_WRITE = 0x0010   # <linux/fcntl.h> (Python's fcntl lacks it before 3.12)
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
class MapHolder:
    """One shared mapping of the object: the (host pid at the checkpoint) holding it, its
    range, protection and file offset."""
    pid: int
    start: int
    end: int
    prot: int
    offset: int


@dataclass
class UnlinkedFile:
    path: str                     # where it was (inside the sandbox) before its unlink
    mode: int                     # permission bits
    uid: int
    gid: int
    size: int
    descriptions: list[Description] = field(default_factory=list)
    saved: int | None = None      # our memfd holding its content at the checkpoint
    maps: list[MapHolder] = field(default_factory=list)
    memory: bool = False          # made again as a memfd, not in its directory
    seals: int = 0                # a memfd's seals (F_GET_SEALS)


# /dev/shm is the sandbox's tmpfs (native/mkroot.c): its objects come back in memory too.
_IN_MEMORY = ("/memfd:", "/dev/shm/")


@dataclass
class _Held:
    """What the stopped processes hold of one object: descriptors and mappings."""
    st: os.stat_result
    src: str                      # a /proc path that opens it
    path: str
    memory: bool                  # it lives in memory: made again as a memfd
    seals: int = 0                # a memfd's seals (_seals), read once
    fds: list[tuple[ProcessRecord, native.FdInfo]] = field(default_factory=list)
    maps: list[tuple[ProcessRecord, SharedMapping]] = field(default_factory=list)


def capture(records: list[ProcessRecord]) -> tuple[list[UnlinkedFile], list[Refusal]]:
    """The deleted-but-open files and shared memory of the sandbox's stopped processes,
    content copied."""
    held: dict[tuple[int, int], _Held] = {}

    def holding(src: str, path: str, anonymous: bool = False) -> _Held:
        st = os.stat(src)   # /proc/PID/map_files stats as the descriptor does (overlay too)
        return held.setdefault((st.st_dev, st.st_ino), _Held(
            st, src, path, anonymous or path.startswith(_IN_MEMORY)))

    for rec in records:
        for f in rec.fds:
            if f.kind == "file" and f.deleted and not is_posix_queue(rec.pid, f):
                holding(f"/proc/{rec.pid}/fd/{f.fd}", f.path).fds.append((rec, f))
        for m in rec.shared:
            if m.copyable:
                h = holding(f"/proc/{rec.pid}/map_files/{m.where}",
                            m.path.removesuffix(" (deleted)"), m.anonymous)
                h.maps.append((rec, m))
    out: list[UnlinkedFile] = []
    refused: list[Refusal] = []
    try:
        for h in held.values():
            h.seals = _seals(h.src)   # read once: checked, then kept with the copy
            why = _refusal(h)
            if why:
                rec, what = _first_holder(h)
                refused.append(Refusal(rec.nspid, rec.cmd, f"{what}: {why}"))
                continue
            out.append(_copy(h))
    except BaseException:
        close_saved(out)
        raise
    if refused:
        close_saved(out)
        out = []
    return out, refused


def _first_holder(h: _Held) -> tuple[ProcessRecord, str]:
    if h.fds:
        rec, f = h.fds[0]
        return rec, f"fd {f.fd}: deleted-but-open file {f.path}"
    rec, m = h.maps[0]
    return rec, f"shared memory {m.what} at {m.where}"


def _refusal(h: _Held) -> str | None:
    fs = kernfs.fs_type(h.src)
    if fs not in _COPIED_FS:
        return (f"{_OTHER_FS.get(fs, f'a file system of type {fs:#x}')}, not a file of the "
                "sandbox's tree or memory: not captured")
    if h.st.st_nlink:
        return "still linked under another name: not captured"
    if h.st.st_size > MAX_BYTES and (n := _data_bytes_of(h)) > MAX_BYTES:
        return f"{n} bytes written (more than {MAX_BYTES >> 20} MiB are not captured)"
    rec = (h.fds or h.maps)[0][0]
    if not h.memory and \
            not os.path.isdir(f"/proc/{rec.pid}/root{os.path.dirname(h.path)}"):
        return "its directory is gone too: not captured"
    if any((h.st.st_ino, h.path) in r.deleted_private for r, _ in h.fds):
        return "also mapped privately: not captured"
    if h.seals & F_SEAL_FUTURE_WRITE and any(m.writable for _, m in h.maps):
        return ("sealed against future writes while mapped writable: the mapping could "
                "not be made again (not captured)")
    return None


def _data_bytes_of(h: _Held) -> int:
    fd = os.open(h.src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return data_bytes(fd, h.st.st_size)
    finally:
        os.close(fd)


def _seals(src: str) -> int:
    """The seals of a memfd (0 for anything else)."""
    if not src or "memfd:" not in os.readlink(src):
        return 0
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return 0
    finally:
        os.close(fd)


def _copy(h: _Held) -> UnlinkedFile:
    src = os.open(h.src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        u = UnlinkedFile(h.path, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size,
                         memory=h.memory, seals=h.seals)
        u.saved = os.memfd_create("dbx-unlinked", os.MFD_CLOEXEC)
        copy_data(u.saved, src, st.st_size)
    finally:
        os.close(src)
    for rec, f in h.fds:
        d = next((d for d in u.descriptions
                  if native.same_file(rec.pid, f.fd, d.holders[0][0], d.holders[0][1])), None)
        if d is None:
            d = Description(f.flags, f.pos)
            u.descriptions.append(d)
        d.holders.append((rec.pid, f.fd))
    u.maps = [MapHolder(rec.pid, m.start, m.end, m.prot, m.offset) for rec, m in h.maps]
    return u


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The (start, end) ranges of fd's first `size` bytes that hold data: holes (pages of
    shared memory never written) are left out (SEEK_DATA / SEEK_HOLE; a file system
    without them reports one extent)."""
    out, pos = [], 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:   # only a hole is left
                break
            raise
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        out.append((start, end))
        pos = end
    return out


def data_bytes(fd: int, size: int) -> int:
    """How many of fd's first `size` bytes are data (not holes)."""
    return sum(end - start for start, end in _extents(fd, size))


def copy_data(dst: int, src: int, size: int) -> None:
    """Copy src's first `size` bytes to dst (empty), holes left holes: a shared memory
    object of 148 MB of which 10 were ever written (PostgreSQL's shared buffers) costs 10."""
    os.ftruncate(dst, size)
    for start, end in _extents(src, size):
        os.lseek(dst, start, os.SEEK_SET)
        done = start
        while done < end:
            n = os.sendfile(dst, src, done, end - done)
            if n == 0:
                raise OSError(0, f"the file ended at {done} of {size} bytes")
            done += n


def close_saved(files: list[UnlinkedFile]) -> None:
    for u in files:
        if u.saved is not None:
            os.close(u.saved)
            u.saved = None


MAPPING = -1   # recreate()'s key of the descriptor the mappings are made from


def recreate(u: UnlinkedFile, rootfd: int) -> dict[int, int]:
    """A new object like `u`: a memfd, or an unlinked file in its directory under `rootfd`
    (a generation's root). Our descriptor for each of its descriptions, by position in
    u.descriptions, and (key MAPPING) one to map it from if it is mapped. The caller
    closes them."""
    assert u.saved is not None
    made: dict[int, int] = {}
    fd = _new_object(u, rootfd)
    try:
        os.fchown(fd, u.uid, u.gid)
        os.fchmod(fd, u.mode)
        copy_data(fd, u.saved, u.size)
        if u.seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, u.seals)
        for i, d in enumerate(u.descriptions):
            made[i] = os.open(f"/proc/self/fd/{fd}", (d.flags & ~_REOPEN_DROP) | os.O_CLOEXEC)
            os.lseek(made[i], d.pos, os.SEEK_SET)
        if u.maps:
            made[MAPPING], fd = fd, -1
    except BaseException:
        for m in made.values():
            os.close(m)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    return made


def _new_object(u: UnlinkedFile, rootfd: int) -> int:
    """An empty unlinked object where u's kind lives, read-write."""
    if u.memory:
        name = os.path.basename(u.path.removeprefix("/memfd:")) or "shared"
        return os.memfd_create(name[:200], os.MFD_CLOEXEC |
                               (os.MFD_ALLOW_SEALING if u.seals else 0))
    dirfd = open_in_root(rootfd, os.path.dirname(u.path) or "/", os.O_PATH | os.O_DIRECTORY)
    try:
        return os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, u.mode, dir_fd=dirfd)
    finally:
        os.close(dirfd)
