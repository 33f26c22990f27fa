"""Signal-driven I/O: a descriptor with O_ASYNC (fcntl F_SETFL, or ioctl FIOASYNC) makes
the kernel signal its owner (F_SETOWN, F_SETOWN_EX: a process, a thread or a process
group) when it turns readable or writable, with SIGIO or the signal F_SETSIG chose (a
real-time one carries the descriptor in its siginfo). nginx sets it on its channel socket
pairs, owned by the master; servers built on SIGIO instead of poll set it on every socket.

The owner and the signal belong to the open file description, not the descriptor, and
no /proc file shows them: they are read at the checkpoint from our own copy of the
descriptor (pidfd_getfd), while the processes are stopped. A restored descriptor is a new
description (sockets, pipes and terminals are made again, files reopened), and until
stop 69 it came back without them: no signal, silently. Now a process holding one is
restored held (like a parent waiting for its children: engine.restore) and, once every
process exists, before any runs, the owner (the restored process, thread or group) and
the signal are set on our copy of the new descriptor, then O_ASYNC is set off and on so
the file registers its owner (a file reopened with O_ASYNC in its flags has the bit but
was never registered).

An owner that is no captured process (one that has exited: the kernel keeps reporting
its number) comes back as no owner: the signal went nowhere and still does. The owner is
set by the daemon, as root, so the kernel's check that the owner may be signalled by the
one who set it (sigio_perm) always passes in a restored copy; only a process setting
another user's process as its owner could tell.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from .. import kernfs
from . import native
from .capture import ProcessRecord, Refusal

F_SETSIG, F_GETSIG = 10, 11
F_SETOWN_EX, F_GETOWN_EX = 15, 16
OWNER_TID, OWNER_PID, OWNER_PGRP = 0, 1, 2
_OWNER_EX = struct.Struct("=ii")   # struct f_owner_ex: type, pid


@dataclass(frozen=True)
class SigIO:
    """A descriptor's signal-driven I/O at the checkpoint: `signal` 0 is SIGIO.
    `process`: the host pid at the checkpoint of the captured process that the owner
    names (kind OWNER_PID), whose thread it is (OWNER_TID: `tid`, its tid in the sandbox,
    which a restored thread keeps), or that is in the owning group (OWNER_PGRP); 0: no
    owner."""
    fd: int
    signal: int
    kind: int = OWNER_PID
    process: int = 0
    tid: int = 0


def is_async(f: native.FdInfo) -> bool:
    return bool(f.flags & os.O_ASYNC)


def capture(records: list[ProcessRecord]) -> list[Refusal]:
    """Fill each record's `sigio` from its descriptors with O_ASYNC set; a descriptor
    whose owner cannot be read is refused by name."""
    by_pid = {r.pid: r for r in records}
    by_group = {r.pgid: r for r in records}
    out: list[Refusal] = []
    for rec in records:
        rec.sigio = []
        for f in rec.fds:
            if not is_async(f):
                continue
            try:
                rec.sigio.append(_read(rec, f.fd, by_pid, by_group))
            except OSError as e:
                out.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: {f.describe()}: "
                                   f"reading its O_ASYNC owner and signal: {e.strerror}"))
    return out


def _read(rec: ProcessRecord, fd: int, by_pid: dict[int, ProcessRecord],
          by_group: dict[int, ProcessRecord]) -> SigIO:
    mine = native.copy_fd(rec.pid, fd)
    try:
        sig = fcntl.fcntl(mine, F_GETSIG)
        kind, owner = _OWNER_EX.unpack(fcntl.fcntl(mine, F_GETOWN_EX, bytes(_OWNER_EX.size)))
    finally:
        os.close(mine)
    if owner == 0:
        return SigIO(fd, sig)
    if kind == OWNER_PGRP:
        member = by_group.get(owner)
        return SigIO(fd, sig, kind, member.pid if member else 0)
    if kind == OWNER_TID and owner not in by_pid:
        return _thread_owner(fd, sig, owner, by_pid)
    holder = by_pid.get(owner)
    return SigIO(fd, sig, kind, holder.pid if holder else 0)


def _thread_owner(fd: int, sig: int, tid: int, by_pid: dict[int, ProcessRecord]) -> SigIO:
    """An owner thread other than a main one: its process and its tid in the sandbox."""
    try:
        status = kernfs.read(f"/proc/{tid}/status")
    except OSError:
        return SigIO(fd, sig)   # exited
    tgid = native.proc_field(status, b"Tgid")
    nspid = native.proc_field(status, b"NSpid")
    holder = by_pid.get(int(tgid)) if tgid else None
    if holder is None or not nspid:
        return SigIO(fd, sig)
    return SigIO(fd, sig, OWNER_TID, holder.pid, int(nspid.split()[-1]))


def give(rec: ProcessRecord, host_pid: int, pid_of: Callable[[int], int]) -> None:
    """Set rec's signal-driven I/O again on its restored copy `host_pid`, held before it
    runs (`pid_of`: host pid at the checkpoint -> host pid now, of a restored process).
    Raises CRError naming the descriptor."""
    for s in rec.sigio:
        try:
            mine = native.copy_fd(host_pid, s.fd)
            try:
                _set(mine, s, pid_of)
            finally:
                os.close(mine)
        except OSError as e:
            raise native.CRError(e.errno or errno.EIO,
                                 f"pid {rec.nspid} ({rec.cmd}): fd {s.fd}: setting its "
                                 f"O_ASYNC owner and signal again: {e.strerror}") from None


def _set(fd: int, s: SigIO, pid_of: Callable[[int], int]) -> None:
    owner = _owner_now(s, pid_of)
    fcntl.fcntl(fd, F_SETSIG, s.signal)
    fcntl.fcntl(fd, F_SETOWN_EX, _OWNER_EX.pack(s.kind, owner))
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_ASYNC)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
    # A terminal made asynchronous without an owner takes one (its foreground group, or
    # the caller: us): set it again.
    fcntl.fcntl(fd, F_SETOWN_EX, _OWNER_EX.pack(s.kind, owner))


def _owner_now(s: SigIO, pid_of: Callable[[int], int]) -> int:
    """The owner's id as our pid namespace sees it in the restored sandbox (0: none)."""
    if s.process == 0:
        return 0
    pid = pid_of(s.process)
    if s.kind == OWNER_PGRP:
        return os.getpgid(pid)
    if s.kind == OWNER_TID and s.tid:
        return _thread_now(pid, s.tid)
    return pid


def _thread_now(pid: int, nstid: int) -> int:
    """The host tid of restored process pid's thread whose tid in the sandbox is nstid."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        nspid = native.proc_field(kernfs.read(f"/proc/{pid}/task/{tid}/status"), b"NSpid")
        if nspid and int(nspid.split()[-1]) == nstid:
            return int(tid)
    raise OSError(errno.ESRCH, f"no thread {nstid} in the restored process")
