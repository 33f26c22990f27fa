"""Reads and writes of kernel pseudo-files (/proc, cgroupfs) on hot paths.

A checkpoint or rollback reads a few such files per process and polls cgroup state; through
Python's text I/O (`Path.read_text`, `open()`) each costs 2-3x a plain `os.open` + `os.read`
(about 125 vs 47 us for a cgroup.procs here), so these go through plain fds and bytes.
"""

from __future__ import annotations

import ctypes
import os


def read(path: str | os.PathLike[str]) -> bytes:
    """A pseudo-file's whole content."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def process_group(pid: int) -> int | None:
    """The id of pid's process group, as our pid namespace numbers it (None: gone)."""
    try:
        stat = read(f"/proc/{pid}/stat")
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[2])


def write(path: str | os.PathLike[str], value: bytes) -> None:
    """Write `value` in one write(2): cgroupfs takes a control value per write."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


class _StatFs(ctypes.Structure):   # struct statfs: f_type first, the rest unread
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


_libc = ctypes.CDLL(None, use_errno=True)


def fs_type(path: str | os.PathLike[str]) -> int:
    """The magic number of the file system `path` is on (statfs f_type, e.g. 0x01021994
    for tmpfs), following a /proc magic link (/proc/PID/fd/N) to the object itself."""
    buf = _StatFs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fspath(path))
    return buf.f_type & 0xFFFFFFFF
