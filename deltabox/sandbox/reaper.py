"""Reaping orphans of sandbox processes.

A command's parent is dbx-enter, which lives outside the sandbox's pid namespace. When both
die (a rollback kills everything), the kernel hands the command's zombie to the nearest child
subreaper ancestor, or to the host's pid 1, which may never reap it; its pid then stays taken,
and restoring a process with that pid (clone3 set_tid) fails. So deltaboxd is a child
subreaper and reaps those zombies itself: only processes of sandbox pid namespaces (its own
helpers are awaited by trio) and only ones nobody traces.
"""

from __future__ import annotations

import ctypes
import glob
import os

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def _children() -> set[int]:
    out: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            out.update(int(p) for p in open(path).read().split())
        except OSError:
            continue
    return out


def _reapable(pid: int) -> bool:
    state = tracer = None
    depth = 0
    try:
        for line in open(f"/proc/{pid}/status"):
            key, _, value = line.partition(":")
            if key == "State":
                state = value.split()[0]
            elif key == "TracerPid":
                tracer = int(value)
            elif key == "NSpid":
                depth = len(value.split())
    except OSError:
        return False
    return state == "Z" and tracer == 0 and depth >= 2


def reap_orphans() -> int:
    """Reap adopted zombies of sandbox processes; returns how many."""
    n = 0
    for pid in _children():
        if _reapable(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
                n += 1
            except ChildProcessError:
                pass
    return n
