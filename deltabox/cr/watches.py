"""inotify instances: a file watcher's watches, found again by path in the restored files.

A dev server with hot reload (vite, webpack, `uvicorn --reload`, `node --watch`), a test
watcher or `tail -F` holds an inotify instance: a set of watches (watch descriptor, event
mask, the inode watched) and a queue of events it has not read yet. A template shares the
instance with the live process, whose watches go on changing, and a watch is on an inode
of the live file system, not of the restored one: each restored process gets an instance
of its own, with the same watches on the same files of the file system it is restored into
(one instance for the processes that shared one).

What the kernel tells of a watch (/proc/PID/fdinfo) is its descriptor, mask, inode number
and a file handle, not a path. The sandbox's file system is an overlay whose handles only
identify (they cannot be opened); they carry the handle of the file in the layer beneath,
which that layer's file system can open (`open_by_handle_at`): its path there, under the
layer's directory, is the file's path in the sandbox. Every path found so is checked by
asking the overlay for that path's handle (`name_to_handle_at(AT_HANDLE_FID)`): the same
bytes as the watch's, or the process is refused.

At a restore the watches are added again in descriptor order; a watch gets the next free
descriptor number after the last one given (the kernel allocates them cyclically), so a
number is reached by adding and removing a watch until it comes (the removals' IN_IGNORED
events are read away before the process runs). Refused, with the reason: events waiting
to be read (they cannot be copied without being taken from the live process; the daemon
lets the processes run briefly to read them, and retries, before it gives up), a watch on
a file outside the sandbox's file system or one with no path left (deleted). Not
preserved: the number the next new watch gets (the kernel's cursor is not shown; it is
one above the highest restored watch), and the watches of fanotify (still refused).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import struct
import termios
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..fs.files import open_in_root
from . import native

IN_DONT_FOLLOW = 0x02000000
AT_HANDLE_FID = 0x200                    # Linux 6.5: a handle that only identifies
MAX_HANDLE_SZ = 128
OVL_FILEID = 0xF8                        # overlayfs' handle: struct ovl_fh
OVL_FH_FLAG_PATH_UPPER = 4
_OVL_FB = struct.Struct("=3xBBBBB16s")   # padding, version, magic 0xfb, len, flags, type, uuid
_WATCH = re.compile(rb"^inotify wd:([0-9a-f]+) ino:([0-9a-f]+) sdev:([0-9a-f]+) "
                    rb"mask:([0-9a-f]+) ignored_mask:[0-9a-f]+"
                    rb"(?: fhandle-bytes:[0-9a-f]+ fhandle-type:([0-9a-f]+) "
                    rb"f_handle:([0-9a-f]+))?", re.M)


@dataclass
class Watch:
    wd: int
    mask: int          # events and IN_ONESHOT / IN_EXCL_UNLINK, as inotify_add_watch takes it
    path: str          # inside the sandbox


@dataclass
class Inotify:
    """An inotify instance as one process holds it (at `fds`); `key` names it across the
    processes that share it (a restore makes one for all of them)."""
    key: str
    fds: list[int]
    watches: list[Watch] = field(default_factory=list)
    nonblock: bool = False


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ)]


_libc = ctypes.CDLL(None, use_errno=True)


def _oserror(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def name_to_handle(path: str, dirfd: int = -100) -> tuple[int, bytes]:
    """The identifying handle (type, bytes) of `path` (relative: to dirfd; its last
    component not followed)."""
    fh, mount_id = _FileHandle(MAX_HANDLE_SZ, 0), ctypes.c_int()
    if _libc.name_to_handle_at(dirfd, os.fsencode(path), ctypes.byref(fh),
                               ctypes.byref(mount_id), AT_HANDLE_FID) < 0:
        raise _oserror(f"name_to_handle_at {path}")
    return fh.handle_type, bytes(fh.f_handle[:fh.handle_bytes])


def _path_by_handle(mount_fd: int, typ: int, handle: bytes) -> str | None:
    """Where the file `handle` names is, as the daemon sees it (None: not on mount_fd's
    file system, or gone)."""
    fh = _FileHandle(len(handle), typ)
    ctypes.memmove(fh.f_handle, handle, len(handle))
    fd = _libc.open_by_handle_at(mount_fd, ctypes.byref(fh), os.O_PATH | os.O_CLOEXEC)
    if fd < 0:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


class Paths:
    """Paths found for watched inodes by earlier checkpoints (a watcher's watches stay for
    its life), by inode number: the handle of a file of the upper layer changes with each
    rollback (a new btrfs subvolume), its inode number does not (a snapshot keeps them),
    and forks share the layers' history. A path found here is checked like one decoded,
    so a guess that is wrong (a file moved, another sandbox's inode of that number) costs
    a decode, never a wrong path. Bounded: emptied when full."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self.known: dict[int, str] = {}

    def get(self, ino: int) -> str | None:
        return self.known.get(ino)

    def put(self, ino: int, path: str) -> None:
        if len(self.known) >= self.limit:
            self.known.clear()
        self.known[ino] = path


class Layers:
    """The sandbox's overlay layers as the daemon sees them (upper first), each opened
    once per checkpoint to decode the handles beneath the overlay's (not O_PATH:
    open_by_handle_at takes no O_PATH descriptor for its file system); `paths`: those
    found before."""

    def __init__(self, dirs: Sequence[str], paths: Paths | None = None) -> None:
        self.dirs = [os.path.realpath(d) for d in dirs]
        self.fds: list[int] = []
        self.paths = paths if paths is not None else Paths()

    def __enter__(self) -> Layers:
        try:
            for d in self.dirs:
                self.fds.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def candidates(self, typ: int, handle: bytes) -> list[str]:
        """Paths in the sandbox that the overlay handle may name: the file beneath (upper
        layer, or one of the lower ones) found by its own handle, its layer's directory
        cut off."""
        if typ != OVL_FILEID or len(handle) < _OVL_FB.size:
            return []
        _ver, magic, length, flags, inner_type, _uuid = _OVL_FB.unpack_from(handle)
        inner = handle[_OVL_FB.size:3 + length]
        if magic != 0xFB or not inner:
            return []
        tries = self.fds[:1] if flags & OVL_FH_FLAG_PATH_UPPER else self.fds[1:]
        out = []
        for fd in tries:
            where = _path_by_handle(fd, inner_type, inner)
            if where is not None and (inside := self._inside(where)) is not None:
                out.append(inside)
        return out

    def _inside(self, where: str) -> str | None:
        """`where` (a daemon path) as a path in the sandbox: under the layer directory
        that contains it most closely."""
        best = None
        for d in self.dirs:
            if where == d or where.startswith(d.rstrip("/") + "/"):
                if best is None or len(d) > len(best):
                    best = d
        if best is None:
            return None
        return "/" + where[len(best):].lstrip("/")


def queued(fd: int) -> int:
    """Bytes of events waiting in the inotify instance at our fd (FIONREAD)."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little")


def unread(pid: int, fd: int) -> int:
    """Bytes of events waiting in the instance pid holds at fd."""
    ours = native.copy_fd(pid, fd)
    try:
        return queued(ours)
    finally:
        os.close(ours)


def read(key: str, pid: int, info: bytes, f: native.FdInfo, layers: Layers) -> Inotify | str:
    """The instance pid holds at fd f (its /proc fdinfo `info`), each watch's path found
    and checked, or why it cannot be restored."""
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return f"opening its root: {e}"
    try:
        return _read(key, root, info, f, layers)
    finally:
        os.close(root)


def _read(key: str, root: int, info: bytes, f: native.FdInfo, layers: Layers) -> Inotify | str:
    dev = os.fstat(root).st_dev
    out = Inotify(key, [], nonblock=bool(f.flags & os.O_NONBLOCK))
    for m in _WATCH.finditer(info):
        wd, ino, kdev, mask = (int(x, 16) for x in m.group(1, 2, 3, 4))
        what = f"watch {wd} (inode {ino})"
        # The kernel's own dev_t (minor in the low 20 bits), not stat's encoding.
        sdev = os.makedev(kdev >> 20, kdev & 0xFFFFF)
        if sdev != dev:
            return (f"inotify {what} is on a file system other than the sandbox's (device "
                    f"{os.major(sdev)}:{os.minor(sdev)}): not captured")
        if m[5] is None:
            return f"inotify {what}: the kernel gave no file handle for it: not captured"
        typ, handle = int(m[5], 16), bytes.fromhex(m[6].decode())
        path = _checked_path(root, ino, typ, handle, layers)
        if path is None:
            return (f"inotify {what}: its file was not found by path (deleted, or not on "
                    "the sandbox's layers): not captured")
        out.watches.append(Watch(wd, mask, path))
    out.watches.sort(key=lambda w: w.wd)
    return out


def _checked_path(root: int, ino: int, typ: int, handle: bytes, layers: Layers
                  ) -> str | None:
    """The one path in the sandbox whose file (inode `ino`) the overlay identifies by
    `handle`."""
    known = layers.paths.get(ino)
    if known is not None and _names(root, known, typ, handle):
        return known
    for path in layers.candidates(typ, handle):
        if _names(root, path, typ, handle):
            layers.paths.put(ino, path)
            return path
    return None


def _names(root: int, path: str, typ: int, handle: bytes) -> bool:
    """Whether `path` (from the directory `root`: a path found has no symlink and no
    "..") is the file the overlay identifies by `handle`."""
    try:
        return name_to_handle(path.lstrip("/") or ".", root) == (typ, handle)
    except OSError:
        return False


def _add_watch(ifd: int, rootfd: int, w: Watch) -> int:
    """Watch w's file in the file system at rootfd (resolved as the sandbox would)."""
    target = open_in_root(rootfd, w.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        wd = _libc.inotify_add_watch(ifd, f"/proc/self/fd/{target}".encode(), w.mask)
    finally:
        os.close(target)
    if wd < 0:
        raise _oserror(f"inotify_add_watch {w.path}")
    return int(wd)


def new_inotify(ino: Inotify, rootfd: int) -> int:
    """An inotify instance with ino's watches, each at its descriptor number, on the files
    of the tree at rootfd; no event waiting. Ours, close-on-exec."""
    ifd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if ifd < 0:
        raise _oserror("inotify_init1")
    try:
        for w in ino.watches:
            while (wd := _add_watch(ifd, rootfd, w)) != w.wd:
                if wd > w.wd:
                    raise OSError(0, f"inotify watch {w.wd} ({w.path}): the kernel gave "
                                  f"number {wd}")
                if _libc.inotify_rm_watch(ifd, wd) < 0:
                    raise _oserror(f"inotify_rm_watch {wd}")
        _drain(ifd)
        os.set_blocking(ifd, not ino.nonblock)
    except BaseException:
        os.close(ifd)
        raise
    return int(ifd)


def _drain(ifd: int) -> None:
    """Read away the events the watches' making queued (IN_IGNORED of the removed ones)."""
    while True:
        try:
            if not os.read(ifd, 1 << 16):
                return
        except BlockingIOError:
            return
