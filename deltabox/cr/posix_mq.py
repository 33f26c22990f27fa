"""POSIX message queues (mq_open): the queues of the sandbox's IPC namespace, captured with
their messages at a checkpoint and made again, with their names, by every restore; and the
queue descriptors processes hold, opened again on the made queues.

A queue belongs to the namespace, not to a process: it outlives its creator, and processes
find it by its name. Before stop 71 a full checkpoint was refused while one existed, and a
process holding one was refused.

At the checkpoint (every process stopped: none waits in a queue) each queue's messages are
taken into a memfd of the daemon in the order a receiver gets them and sent back at once
(native/ipcns.c: no call reads a message and leaves it queued), with its name, sizes
(mq_maxmsg, mq_msgsize), owner and mode. A restore, before any process is born, makes the
target namespace's queues exactly those (any other unlinked), each filled again; a process
that held a queue descriptor gets one on the made queue at the same number, with its
access mode, O_NONBLOCK and close-on-exec: installed by its spawn, or, for a process born
from a carrier (spawned ahead, before the rollback made the queues), given to its carrier
just before the birth (engine.DeltaCR._queues_to_carriers).

A queue unlinked while processes hold it (a private queue: mq_open, then mq_unlink) has
no name: it is captured through a holder's /proc/PID/fd, made again under a name of ours
(UNLINKED + its inode number), its holders' descriptors opened on it before any process
is born, then unlinked again.

Refused, naming the queue: one a process is registered for the notification of (mq_notify:
taking and sending back its messages would fire it, and the registration is the process's
kernel state), one holding more than unlinked.MAX_BYTES of messages. Not kept: the times,
and a description shared by two descriptors (each gets its own: only O_NONBLOCK lives
there).
A made queue is charged to the daemon's user (root) within the daemon's RLIMIT_MSGQUEUE.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from . import native
from .capture import ProcessRecord, Refusal, is_posix_queue
from .unlinked import MAX_BYTES

Queue = native.PosixQueue
UNLINKED = "dbx-unlinked-"   # the name a queue unlinked while held is made again under


@dataclass(frozen=True)
class HeldQueue:
    """A process's descriptor `fd` of the queue /`name`, with its open flags."""
    fd: int
    name: str
    flags: int


def held(records: list[ProcessRecord]) -> None:
    """Fill each record's `mqueues` from its descriptors."""
    for rec in records:
        rec.mqueues = [HeldQueue(f.fd, _name(rec.pid, f), f.flags) for f in rec.fds
                       if is_posix_queue(rec.pid, f)]


def _name(pid: int, f: native.FdInfo) -> str:
    """The queue's name, or for one unlinked, the name it is made again under."""
    if not f.deleted:
        return f.path[1:]
    return f"{UNLINKED}{os.stat(f'/proc/{pid}/fd/{f.fd}').st_ino}"


def _capture_unlinked(records: list[ProcessRecord], named: set[str]) -> list[Queue]:
    """The queues the processes hold that have no name, each copied once through one
    holder's descriptor."""
    out: list[Queue] = []
    try:
        for rec in records:
            for h in rec.mqueues:
                if not h.name.startswith(UNLINKED) or h.name in named:
                    continue
                fd = os.open(f"/proc/{rec.pid}/fd/{h.fd}", os.O_RDWR | os.O_NONBLOCK |
                             os.O_CLOEXEC)
                try:
                    out.append(native.capture_posix_queue(fd, h.name))
                finally:
                    os.close(fd)
                named.add(h.name)
    except BaseException:
        close_saved(out)
        raise
    return out


def capture(ipcns_fd: int, records: list[ProcessRecord]) -> tuple[list[Queue], list[Refusal]]:
    """Every queue of the IPC namespace `ipcns_fd` (a pidfd of a process in it) with a copy
    of its messages, the processes stopped; or the reasons it cannot be."""
    queues = native.posix_queues(ipcns_fd)
    try:
        queues += _capture_unlinked(records, {q.name for q in queues})
    except BaseException:
        close_saved(queues)
        raise
    by_pid = {r.pid: r for r in records}
    refused = []
    for q in queues:
        if q.notify_pid:
            rec = by_pid.get(q.notify_pid)
            refused.append(Refusal(
                rec.nspid if rec else 0, rec.cmd if rec else "the sandbox's IPC namespace",
                f"{_what(q.name)}: " + ("it" if rec else "a process") +
                " is registered for its notification (mq_notify), which is not captured; "
                "checkpoint once the notification has fired or been cancelled "
                "(mq_notify(q, NULL))"))
        elif q.bytes > MAX_BYTES:
            refused.append(Refusal(0, "the sandbox's IPC namespace",
                                   f"{_what(q.name)}: {q.bytes} bytes of "
                                   f"messages (more than {MAX_BYTES >> 20} MiB are not "
                                   "captured)"))
    names = {q.name for q in queues}
    for rec in records:
        for h in rec.mqueues:
            if h.name not in names:   # another namespace's: never the sandbox's own
                refused.append(Refusal(rec.nspid, rec.cmd, f"fd {h.fd}: POSIX message queue "
                                       f"/{h.name} is not one of the sandbox's IPC "
                                       "namespace: not captured"))
    if refused:
        close_saved(queues)
        return [], refused
    return queues, []


def _what(name: str) -> str:
    """The queue as a refusal names it."""
    if name.startswith(UNLINKED):
        return "a POSIX message queue unlinked while open"
    return f"POSIX message queue /{name}"


def make(ipcns_fd: int, queues: list[Queue]) -> None:
    """Make the namespace's queues exactly `queues`, with their messages, before any
    process that holds or opens one is born."""
    try:
        native.make_posix_queues(ipcns_fd, queues)
    except native.CRError as e:
        raise native.CRError(e.errno or errno.EIO, "making the POSIX message queues "
                             f"again failed ({e})") from None


def open_held(ipcns_fd: int, records: list[ProcessRecord],
              queues: list[Queue]) -> dict[tuple[int, int], int]:
    """Descriptors of the made queues for every process's, by (record pid, its fd) (the
    caller's to close); then the queues made only for their holders (unlinked at the
    checkpoint) are unlinked again."""
    held = [(rec.pid, h) for rec in records for h in rec.mqueues]
    fds = native.open_posix_queues(ipcns_fd, [(h.name, h.flags) for _, h in held])
    out = {(pid, h.fd): fd for (pid, h), fd in zip(held, fds)}
    try:
        native.unlink_posix_queues(ipcns_fd, [q.name for q in queues
                                              if q.name.startswith(UNLINKED)])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return out


def close_saved(queues: list[Queue]) -> None:
    for q in queues:
        if q.fd >= 0:
            os.close(q.fd)
            q.fd = -1
