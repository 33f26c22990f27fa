"""Process descriptors (pidfd_open, CLONE_PIDFD): a parent's handle on its child.

tokio holds one for every child it runs (so `uv run app.py` does, for the python it
started), as do Python 3.12+'s asyncio (its child watcher) and Go 1.23+'s os/exec: the
descriptor turns readable when the child exits (an event loop watches it with epoll) and
waitid(P_PIDFD) reaps the child through it. Captured when it names a child of its holder:
that child is then given back to its restored parent whatever its size (adoption.py), the
parent being restored held (stopped) until its children exist. The parent is spawned
without the descriptor, its epoll instances without watches on it; once the child exists
a pidfd of it is put at the descriptor's number with its flags, and the watches are added
back (native: dbxcr_held_install_fd), before either runs. Refused, naming the holder: a
pidfd of a process that is not its child (waitid through it would fail), of one that has
exited (no process to name again), or of one not restored with it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import native
from .capture import ProcessRecord, Refusal

PIDFD_NONBLOCK = os.O_NONBLOCK


def is_pidfd(f: native.FdInfo) -> bool:
    return f.kind == "pidfd"


@dataclass(frozen=True)
class PidFd:
    """A process's pidfd of its child: at `fd`, of the child whose host pid at the
    checkpoint was `child`."""
    fd: int
    child: int
    nonblock: bool
    cloexec: bool


def capture(records: list[ProcessRecord]) -> list[Refusal]:
    """Fill each record's `pidfds`, or say why one cannot be restored."""
    by_pid = {r.pid: r for r in records}
    out: list[Refusal] = []
    for rec in records:
        rec.pidfds = []
        for f in rec.fds:
            if not is_pidfd(f):
                continue
            pid = _target(f)
            why = _refusal(rec, by_pid.get(pid) if pid is not None else None, pid)
            if why:
                out.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: a pidfd {why}"))
                continue
            assert pid is not None
            rec.pidfds.append(PidFd(f.fd, pid, bool(f.flags & PIDFD_NONBLOCK),
                                    bool(f.flags & os.O_CLOEXEC)))
    return out


def _target(f: native.FdInfo) -> int | None:
    """The host pid a pidfd names (its fdinfo's "Pid:", as our /proc sees it, read with
    the process's descriptors); None once the process has exited (-1)."""
    pid = native.proc_field(f.fdinfo, b"Pid")
    n = int(pid) if pid else -1
    return n if n > 0 else None


def _refusal(rec: ProcessRecord, child: ProcessRecord | None, pid: int | None) -> str | None:
    if pid is None:
        return ("of a process that has exited: not captured; checkpoint once it is "
                "reaped")
    if child is None:
        return (f"of a process outside the sandbox's captured ones (host pid {pid}): not "
                "captured")
    if child.ppid != rec.pid:
        return (f"of pid {child.nspid} ({child.cmd}), not its child: only a parent's "
                "pidfd of its child is captured")
    if child.sid != rec.sid and child.sid != child.pid:
        return (f"of its child {child.nspid} ({child.cmd}), in another session it does not "
                "lead (it could not be its child again): not captured")
    return None


def children(records: Iterable[ProcessRecord]) -> set[int]:
    """The host pids of the children some captured pidfd names (adopted, whatever their
    size: adoption.adoptees' `forced`)."""
    return {p.child for r in records for p in r.pidfds}


def without_pidfd_watches(rec: ProcessRecord, epolls: list[native.Epoll]
                          ) -> list[native.Epoll]:
    """rec's epoll instances as its spawn makes them: without the watches on its pidfds
    (which do not exist yet then: added back by install)."""
    fds = {p.fd for p in rec.pidfds}
    if not fds:
        return epolls
    return [dataclasses.replace(e, watches=tuple(w for w in e.watches if w.fd not in fds))
            for e in epolls]


def install(rec: ProcessRecord, held: native.Held, pid_of: Callable[[int], int]) -> None:
    """Give the held restored rec its pidfds, each of its restored child (`pid_of`: host
    pid at the checkpoint -> host pid now), at their numbers and with their flags,
    watched by its epoll instances as they were."""
    epolls = rec.loop.epolls if rec.loop else []
    for p in rec.pidfds:
        fd = os.pidfd_open(pid_of(p.child), PIDFD_NONBLOCK if p.nonblock else 0)
        try:
            held.install_fd(fd, p.fd, p.cloexec,
                            [native.EpollWatch(e.fd, w.events, w.data)
                             for e in epolls for w in e.watches if w.fd == p.fd])
        finally:
            os.close(fd)
