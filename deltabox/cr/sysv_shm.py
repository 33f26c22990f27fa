"""System V shared memory: the segments of the sandbox's IPC namespace (shmget), captured
with their content at a checkpoint and made again, with their ids, by every restore.

A segment belongs to the namespace, not to a process: it outlives its creator, processes
find it by its id (or its key), and a template (a fork) shares the attachment with the
live process, whose later writes it would show. PostgreSQL keeps a small one beside its
shared buffers (its interlock: the postmaster's pid, the data directory) which every
backend attaches.

At the checkpoint (every process stopped) each segment of the namespace, attached or not,
is copied into a memfd of the daemon (its pages never written are not: the copy is
sparse, and at most unlinked.MAX_BYTES of written pages per segment), with its id, key,
owner and mode. A restore, before any process is born, makes the target namespace's
segments exactly those (others removed): each with its id (through the namespace's
kernel.shm_next_id), key, owner, mode, SHM_LOCK and content; then every restored process
attaches it where the original had it, over the template's attachment (shmat SHM_REMAP,
native/fork_template.c), read-only or executable as it was. The templates detach theirs
once made (the kernel frees a segment's id only at its last detach, even once removed, so
an attached template would keep it taken, and `ipcs` would count it): a rollback, once
the processes it killed are gone, finds the id free or held by the live segment, which it
keeps if its key and size are the checkpoint's (refilled), else removes and makes anew.
Until every restored process has attached it, a segment's mode lets all attach it (a
restored process attaches it before its credentials are given back: native/ipcns.c);
then it gets its own mode (settle). A segment removed (IPC_RMID) while attached, keyless
until its last detach, comes back removed; one removed since the checkpoint comes back
whole.

Refused by the process: an attachment covering part of its segment (a partial munmap or
mprotect), one without read access, one of another IPC namespace than the sandbox's, a
huge-page segment. Not kept: the creator's ids (cuid, cgid: root's), the creator's and
last pids, the times (attach, detach, change). (A segment whose id a process the rollback
does not kill still holds, removed, is refilled and stays removed: the rollback's note
says so.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .. import kernfs
from . import native
from .capture import ProcessRecord, Refusal
from .unlinked import MAX_BYTES, copy_data, data_bytes

_TMPFS = 0x01021994          # statfs f_type of the kernel's shmem mount (a segment's file)
_HUGETLBFS = 0x958458F6
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Attachment:
    """One process's attachment of a segment: the host pid at the checkpoint, its range
    and protection (PROT_* bits)."""
    pid: int
    start: int
    end: int
    prot: int


@dataclass
class Segment:
    id: int
    key: int
    mode: int                     # shm_perm.mode: permission bits, SHM_DEST, SHM_LOCKED
    uid: int
    gid: int
    size: int
    saved: int | None = None      # our memfd holding its content at the checkpoint
    attached: list[Attachment] = field(default_factory=list)


def wanted(records: list[ProcessRecord], maybe: bool) -> bool:
    """Whether a capture looks at the namespace's segments: some process has one attached,
    or the caller says one may exist (an IPC call was seen since it last found none)."""
    return maybe or any(m.sysv for r in records for m in r.shared)


def capture(ipcns_fd: int, records: list[ProcessRecord]
            ) -> tuple[list[Segment], list[Refusal]]:
    """Every segment of the IPC namespace `ipcns_fd` (a pidfd of a process in it) with its
    content and attachments, the processes stopped; or the reasons it cannot be."""
    listed = native.shm_segments(ipcns_fd)
    out: list[Segment] = []
    try:
        by_id = {s.id: Segment(s.id, s.key, s.mode, s.uid, s.gid, s.size) for s in listed}
        refused = _attach(records, by_id)
        for s in listed:
            why = _refusal(s)
            if why:
                refused.append(_namespace_refusal(records, by_id[s.id], why))
        if refused:
            return [], refused
        for s in listed:
            seg = by_id[s.id]
            seg.saved = os.memfd_create(f"dbx-sysv-{s.id}", os.MFD_CLOEXEC)
            out.append(seg)
            copy_data(seg.saved, s.fd, s.size)
        return out, []
    except BaseException:
        close_saved(out)
        raise
    finally:
        for s in listed:
            os.close(s.fd)


def _attach(records: list[ProcessRecord], by_id: dict[int, Segment]) -> list[Refusal]:
    """Note each process's attachments in their segments; the refusals of those that
    cannot be made again."""
    refused = []
    for rec in records:
        for m in rec.shared:
            if not m.sysv:
                continue
            try:
                shmid = os.stat(f"/proc/{rec.pid}/map_files/{m.where}").st_ino   # = its id
            except OSError as e:
                refused.append(Refusal(rec.nspid, rec.cmd, f"System V shared memory at "
                                       f"{m.where}: unreadable ({e.strerror})"))
                continue
            seg = by_id.get(shmid)
            why = _attachment_refusal(m.start, m.end, m.offset, m.prot, seg)
            if why:
                refused.append(Refusal(rec.nspid, rec.cmd, f"System V shared memory segment "
                                       f"{shmid} attached at {m.where}: {why}"))
            elif seg is not None:
                seg.attached.append(Attachment(rec.pid, m.start, m.end, m.prot))
    return refused


def _attachment_refusal(start: int, end: int, offset: int, prot: int,
                        seg: Segment | None) -> str | None:
    if seg is None:
        return ("not a segment of the sandbox's IPC namespace (the process is in one of "
                "its own: `unshare --ipc`): not captured")
    whole = -(-seg.size // _PAGE) * _PAGE
    if offset or end - start != whole:
        return (f"{end - start} of its {whole} bytes mapped there (part unmapped or "
                "protected apart): an attachment is made again whole, not captured")
    if not prot & 1:
        return "not readable (mprotect): an attachment is made again readable, not captured"
    return None


def _refusal(s: native.ShmSegment) -> str | None:
    fs = kernfs.fs_type(f"/proc/self/fd/{s.fd}")
    if fs == _HUGETLBFS:
        return "in huge pages (SHM_HUGETLB): not captured"
    if fs != _TMPFS:
        return f"on a file system of type {fs:#x}: not captured"
    if s.size > MAX_BYTES and (n := data_bytes(s.fd, s.size)) > MAX_BYTES:
        return f"{n} bytes written (more than {MAX_BYTES >> 20} MiB are not captured)"
    return None


def _namespace_refusal(records: list[ProcessRecord], seg: Segment, why: str) -> Refusal:
    """By the first process attached to it, else by the sandbox (pid 0: the namespace)."""
    what = f"System V shared memory segment {seg.id} (key {seg.key & 0xFFFFFFFF:#x}): {why}"
    if seg.attached:
        rec = next(r for r in records if r.pid == seg.attached[0].pid)
        return Refusal(rec.nspid, rec.cmd, what)
    return Refusal(0, "the sandbox's IPC namespace", what)


def make(ipcns_fd: int, segments: list[Segment]) -> str:
    """Make the namespace's segments exactly `segments`, with their ids and content,
    before any process that attaches one is born; what could not be made as it was, for
    the response's note (or "")."""
    removed = native.make_shm_segments(ipcns_fd, _native(segments))
    if not removed:
        return ""
    ids = ", ".join(map(str, removed))
    return (f"System V shared memory segment {ids} was removed (IPC_RMID) since the "
            "checkpoint, and a checkpoint still holds it: it comes back attached with its "
            "content, but removed (no key: shmget finds it no more; gone once detached)")


def settle(ipcns_fd: int, segments: list[Segment]) -> None:
    """Once every restored process has attached its segments: their own modes back (make
    leaves them open to all: a process attaches before it has its credentials back), and
    those removed at the checkpoint removed again."""
    native.shm_segment_modes(ipcns_fd, _native(segments))


def _native(segments: list[Segment]) -> list[native.ShmSegment]:
    """The segments as native/ipcns.c takes them, with our copy of each one's content."""
    return [native.ShmSegment(s.id, s.key, s.mode, s.uid, s.gid, s.size,
                              fd=s.saved if s.saved is not None else -1) for s in segments]


def remaps(segments: list[Segment], pid: int) -> list[native.Remap]:
    """The attachments the process (host pid at the checkpoint) makes again."""
    return [native.Remap(a.start, a.end, a.prot, -1, shmid=s.id)
            for s in segments for a in s.attached if a.pid == pid]


def close_saved(segments: list[Segment]) -> None:
    for s in segments:
        if s.saved is not None:
            os.close(s.saved)
            s.saved = None
