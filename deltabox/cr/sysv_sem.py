"""System V semaphore sets: the sets of the sandbox's IPC namespace (semget), captured with
their values at a checkpoint and made again, with their ids, by every restore.

A set belongs to the namespace, not to a process (as a message queue: cr/sysv_msg.py).
Before stop 70 a full checkpoint was refused while one existed (stop 49: a rollback had kept
a value set after the checkpoint, and a fork's children had no set).

At the checkpoint (every process stopped) each set's values (GETALL) are copied into a memfd
of the daemon with its id, key, size, owner and mode. A restore, before any process is born,
makes the target namespace's sets exactly those (any other removed): each with its id
(kernel.sem_next_id), key and size, its values (SETALL), owner and mode. A process blocked
in semop at the checkpoint is restored inside that call and waits on the restored set.

Refused, naming the process: one with a semaphore undo list, while a set exists. A semop
with SEM_UNDO gives its process adjustments the kernel applies when it exits; no call reads
them back, and a restored process (a fork of its template) has none, so its exit would no
longer undo what it did: a lock it held would stay held. Whether a process has a list is
known (kcmp KCMP_SYSVSEM against the sandbox's init, which has none), not what it holds:
threads share one list, which the kernel makes at the first pthread_create
(clone CLONE_SYSVSEM), so a multi-threaded process is refused too while a set exists. Not
kept: the creator's ids, each semaphore's last pid, the times.
"""

from __future__ import annotations

import errno
import os

from . import native
from .capture import ProcessRecord, Refusal

Set = native.SemSet


def capture(ipcns_fd: int, records: list[ProcessRecord]) -> tuple[list[Set], list[Refusal]]:
    """Every set of the IPC namespace `ipcns_fd` (a pidfd of the sandbox's init) with a
    copy of its values, the processes stopped; or the reasons it cannot be."""
    sets = native.sem_sets(ipcns_fd)
    if not sets:
        return [], []
    init = _pid_of(ipcns_fd)
    refused = [Refusal(r.nspid, r.cmd, _UNDO) for r in records
               if not native.same_semaphore_undo(r.pid, init)]
    if refused:
        close_saved(sets)
        return [], refused
    return sets, []


_UNDO = ("it has a System V semaphore undo list (made by a semop with SEM_UNDO, or shared by "
         "its threads), whose adjustments the kernel applies when it exits and no call reads "
         "back: not captured while a semaphore set exists (`ipcs -s` lists them)")


def _pid_of(pidfd: int) -> int:
    """The host pid a pidfd of ours names (its fdinfo's "Pid:")."""
    with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
        return int(native.proc_field(f.read(), b"Pid") or b"-1")


def make(ipcns_fd: int, sets: list[Set]) -> None:
    """Make the namespace's sets exactly `sets`, with their ids and values, before any
    process that uses one is born."""
    try:
        native.make_sem_sets(ipcns_fd, sets)
    except native.CRError as e:
        raise native.CRError(e.errno or errno.EIO, f"making the System V semaphore sets again "
                             f"failed ({e})") from None


def close_saved(sets: list[Set]) -> None:
    for s in sets:
        if s.fd >= 0:
            os.close(s.fd)
            s.fd = -1
