"""Reads and writes of kernel pseudo-files (/proc, cgroupfs) on hot paths.

A checkpoint or rollback reads a few such files per process and polls cgroup state; through
Python's text I/O (`Path.read_text`, `open()`) each costs 2-3x a plain `os.open` + `os.read`
(about 125 vs 47 us for a cgroup.procs here), so these go through plain fds and bytes.
"""

from __future__ import annotations

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


def write(path: str | os.PathLike[str], value: bytes) -> None:
    """Write `value` in one write(2): cgroupfs takes a control value per write."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)
