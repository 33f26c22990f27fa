"""System V message queues: the queues of the sandbox's IPC namespace (msgget), captured with
their messages at a checkpoint and made again, with their ids, by every restore.

A queue belongs to the namespace, not to a process: it outlives its creator, processes find
it by its key or keep its id, and no template holds it. Before stop 70 a full checkpoint was
refused while one existed (stop 49); a rollback removed those made since.

At the checkpoint (every process stopped) each queue's messages are copied in order into a
memfd of the daemon without being taken (msgrcv MSG_COPY, native/ipcns.c), with its id,
key, owner, mode and size limit. A restore, before any process is born, makes the target
namespace's queues exactly those (any other removed): each with its id (through the
namespace's kernel.msg_next_id), key, owner, mode and limit, its messages sent again in
their order with their types. A process blocked in msgrcv or msgsnd at the checkpoint is
restored inside that call, which it makes again on the restored queue.

Refused, naming the queue: one holding more than unlinked.MAX_BYTES of messages. Not kept:
the creator's ids (cuid, cgid: root's), the last sender's and receiver's pids, the times.
(Semaphore sets: cr/sysv_sem.py.)
"""

from __future__ import annotations

import errno
import os

from . import native
from .capture import Refusal
from .unlinked import MAX_BYTES

Queue = native.MsgQueue


def capture(ipcns_fd: int) -> tuple[list[Queue], list[Refusal]]:
    """Every queue of the IPC namespace `ipcns_fd` (a pidfd of a process in it) with a copy
    of its messages, the processes stopped; or the reasons it cannot be."""
    queues = native.msg_queues(ipcns_fd)
    refused = [Refusal(0, "the sandbox's IPC namespace",
                       f"System V message queue {q.id} (key {q.key & 0xFFFFFFFF:#x}): "
                       f"{q.bytes} bytes of messages (more than {MAX_BYTES >> 20} MiB are "
                       "not captured)")
               for q in queues if q.bytes > MAX_BYTES]
    if refused:
        close_saved(queues)
        return [], refused
    return queues, []


def make(ipcns_fd: int, queues: list[Queue]) -> None:
    """Make the namespace's queues exactly `queues`, with their ids and messages, before
    any process that uses one is born."""
    try:
        native.make_msg_queues(ipcns_fd, queues)
    except native.CRError as e:
        raise native.CRError(e.errno or errno.EIO, "making the System V message queues "
                             f"again failed ({e})") from None


def close_saved(queues: list[Queue]) -> None:
    for q in queues:
        if q.fd >= 0:
            os.close(q.fd)
            q.fd = -1
