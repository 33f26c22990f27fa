"""The unread bytes of a pipe: copied without consuming them, kept, and put back.

A checkpoint keeps what waits in a pipe (or a named pipe, fifos.py) its processes read from
as a second pipe holding a copy (tee(2) duplicates pipe buffers without taking them from
the source); a restore tees that copy into the new pipe, so the copy serves every restore;
a process dump writes it to a file (daemon/dumps.py) and reads it back into such a pipe.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import os
import termios

_libc = ctypes.CDLL(None, use_errno=True)
SPLICE_F_NONBLOCK = 2
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
PIPE_DEFAULT_SIZE = 65536


def tee_copy(src_read: int, size: int) -> tuple[int | None, int]:
    """A new pipe of capacity `size` holding a copy of what `src_read` has unread (without
    consuming it): (its read end or None if there was nothing, bytes still missing from
    the copy: 0 unless the copy fell short)."""
    waiting = unread(src_read)
    if not waiting:
        return None, 0
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        set_size(w, size)
        n = _libc.tee(src_read, w, max(size, waiting), SPLICE_F_NONBLOCK)
        if n <= 0:
            os.close(r)
            return None, waiting
        return r, waiting - n
    finally:
        os.close(w)


def put_back(saved: int, dst_write: int, size: int) -> None:
    """The bytes a tee_copy holds, copied into the pipe `dst_write` writes to (the copy
    keeps them for the next restore)."""
    _libc.tee(saved, dst_write, max(size, PIPE_DEFAULT_SIZE), SPLICE_F_NONBLOCK)


def unread(fd: int) -> int:
    """Bytes waiting in the pipe `fd` belongs to (FIONREAD)."""
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return buf[0]


def set_size(fd: int, size: int) -> None:
    """Give a fresh pipe the capacity its original had (the kernel rounds up to pages;
    root may exceed /proc/sys/fs/pipe-max-size)."""
    if size > PIPE_DEFAULT_SIZE:
        fcntl.fcntl(fd, F_SETPIPE_SZ, size)


def size_of(fd: int) -> int:
    """The capacity of the pipe `fd` belongs to (F_GETPIPE_SZ)."""
    return fcntl.fcntl(fd, F_GETPIPE_SZ)


def peek(saved: int) -> bytes:
    """The bytes a tee_copy holds, without consuming them (for a dump's file)."""
    size = max(1 << 20, unread(saved))
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, size)
    except OSError:
        pass
    try:
        n = _libc.tee(saved, w, size, SPLICE_F_NONBLOCK)
        os.close(w)
        w = -1
        out = b""
        while n > 0 and len(out) < n:
            chunk = os.read(r, n - len(out))
            if not chunk:
                break
            out += chunk
        return out
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def refill(data: bytes) -> int:
    """A tee_copy's pipe holding `data` again (read back from a dump): its read end."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        if len(data) > PIPE_DEFAULT_SIZE:
            fcntl.fcntl(w, F_SETPIPE_SZ, len(data))
        os.write(w, data)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r
