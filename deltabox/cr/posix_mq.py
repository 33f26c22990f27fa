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

Refused, naming the queue: one a process is registered for the notification of (mq_notify:
taking and sending back its messages would fire it, and the registration is the process's
kernel state), one holding more than unlinked.MAX_BYTES of messages; a descriptor of a
queue unlinked while open is refused by unlinked.py. Not kept: the times, and a
description shared by two descriptors (each gets its own: only O_NONBLOCK lives there).
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


@dataclass(frozen=True)
class HeldQueue:
    """A process's descriptor `fd` of the queue /`name`, with its open flags."""
    fd: int
    name: str
    flags: int


def held(records: list[ProcessRecord]) -> None:
    """Fill each record's `mqueues` from its descriptors."""
    for rec in records:
        rec.mqueues = [HeldQueue(f.fd, f.path[1:], f.flags) for f in rec.fds
                       if is_posix_queue(rec.pid, f)]


def capture(ipcns_fd: int, records: list[ProcessRecord]) -> tuple[list[Queue], list[Refusal]]:
    """Every queue of the IPC namespace `ipcns_fd` (a pidfd of a process in it) with a copy
    of its messages, the processes stopped; or the reasons it cannot be."""
    queues = native.posix_queues(ipcns_fd)
    by_pid = {r.pid: r for r in records}
    refused = []
    for q in queues:
        if q.notify_pid:
            rec = by_pid.get(q.notify_pid)
            refused.append(Refusal(
                rec.nspid if rec else 0, rec.cmd if rec else "the sandbox's IPC namespace",
                f"POSIX message queue /{q.name}: " + ("it" if rec else "a process") +
                " is registered for its notification (mq_notify), which is not captured; "
                "checkpoint once the notification has fired or been cancelled "
                "(mq_notify(q, NULL))"))
        elif q.bytes > MAX_BYTES:
            refused.append(Refusal(0, "the sandbox's IPC namespace",
                                   f"POSIX message queue /{q.name}: {q.bytes} bytes of "
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


def make(ipcns_fd: int, queues: list[Queue]) -> None:
    """Make the namespace's queues exactly `queues`, with their messages, before any
    process that holds or opens one is born."""
    try:
        native.make_posix_queues(ipcns_fd, queues)
    except native.CRError as e:
        raise native.CRError(e.errno or errno.EIO, "making the POSIX message queues "
                             f"again failed ({e})") from None


def open_held(ipcns_fd: int, rec: ProcessRecord) -> dict[int, int]:
    """Descriptors of the made queues for rec's, by its fd numbers (the caller's to
    close)."""
    fds = native.open_posix_queues(ipcns_fd, [(h.name, h.flags) for h in rec.mqueues])
    return {h.fd: fd for h, fd in zip(rec.mqueues, fds)}


def close_saved(queues: list[Queue]) -> None:
    for q in queues:
        if q.fd >= 0:
            os.close(q.fd)
            q.fd = -1
