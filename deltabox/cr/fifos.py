"""Named pipes (FIFOs) the sandbox's processes hold open.

`mkfifo` in a script, GNU make's jobserver (`--jobserver-style=fifo`, make 4.4's default),
a test harness's control pipe: processes that opened one path share one pipe, its unread
bytes in the kernel. The node itself is a file of the sandbox's tree, so the restored tree
has it, but opening it there makes a new, empty pipe, and an open blocks until the other
side opens too.

So at the checkpoint each named pipe's descriptors are grouped by open file description
(kcmp KCMP_FILE: an open's own, or one shared by fork and dup), its unread bytes copied
(pipebuf.tee_copy, from a description that reads) and its capacity noted. A restore opens
the node in the restored tree once read-write and non-blocking (which on Linux neither
blocks nor needs the other side), puts the bytes back and the capacity, opens every
description again through that descriptor's magic link (the same node, so the same pipe;
with a reader and a writer present no open blocks) with its access mode and O_NONBLOCK,
and lets the read-write one go (engine._PipePlan.file_fds). Each restored sandbox gets its
own pipe (its own tree's node).

Refused by name: bytes waiting in a named pipe no description reads (nothing could copy
them without becoming a reader), one pipe reached through two names (hard links: its
bytes would come back twice), a named pipe deleted while open (capture.refusals: no path to
open it by) or on a mount of its own (capture.refusals). Not preserved: which process
opened a description (the daemon's credentials, as for every object a restore makes), and
a process still blocked inside its open of the pipe restarts that open in the restored
tree, as it would have waited on the original.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field

from ..fs.files import open_in_root
from . import native, pipebuf
from .capture import ProcessRecord, Refusal

# The flags of a description that its reopen keeps (a pipe's status flags; O_DIRECT is
# refused by capture.refusals).
_KEEP = os.O_ACCMODE | os.O_NONBLOCK | os.O_PATH


@dataclass
class FifoDescription:
    """One open file description of a named pipe, and the descriptors that hold it."""
    flags: int                                  # access mode, O_NONBLOCK, O_PATH
    holders: list[tuple[int, int]] = field(default_factory=list)   # (host pid, fd)

    @property
    def reads(self) -> bool:
        return not self.flags & os.O_PATH and self.flags & os.O_ACCMODE != os.O_WRONLY


@dataclass
class Fifo:
    """A named pipe as the checkpoint found it."""
    path: str                                   # inside the sandbox
    size: int = pipebuf.PIPE_DEFAULT_SIZE       # capacity (F_GETPIPE_SZ)
    descriptions: list[FifoDescription] = field(default_factory=list)
    saved: int | None = None                    # a tee_copy of its unread bytes, if any


def capture(records: list[ProcessRecord]) -> tuple[list[Fifo], list[Refusal]]:
    """The named pipes the processes hold, their unread bytes copied; the refusals of
    those that cannot come back whole. On a refusal, nothing is kept open."""
    fifos: list[Fifo] = []
    refused: list[Refusal] = []
    by_node: dict[tuple[int, int], tuple[Fifo, list[tuple[ProcessRecord, int]]]] = {}
    for rec in records:
        for f in rec.fds:
            if f.kind != "fifo":
                continue
            try:
                st = os.stat(f"/proc/{rec.pid}/fd/{f.fd}")
            except OSError:
                continue   # gone with its process: the capture's others notice
            node = (st.st_dev, st.st_ino)
            if node not in by_node:
                by_node[node] = (Fifo(f.path), [])
            fifo, firsts = by_node[node]
            if fifo.path != f.path:
                refused.append(Refusal(rec.nspid, rec.cmd, (
                    f"fd {f.fd}: the named pipe {f.path} is also open as {fifo.path} (hard "
                    "links of one pipe): not captured")))
                continue
            _add(fifo, firsts, rec, f)
    try:
        for fifo, firsts in by_node.values():
            fifos.append(fifo)
            why = _save_unread(fifo, firsts)
            if why:
                refused.append(why)
    except BaseException:
        close_saved(fifos)
        raise
    if refused:
        close_saved(fifos)
        return [], refused
    return fifos, refused


def _add(fifo: Fifo, firsts: list[tuple[ProcessRecord, int]], rec: ProcessRecord,
         f: native.FdInfo) -> None:
    """f joins the description it shares (kcmp), or makes one of its own."""
    for i, (rec0, fd0) in enumerate(firsts):
        if native.same_file(rec0.pid, fd0, rec.pid, f.fd):
            fifo.descriptions[i].holders.append((rec.pid, f.fd))
            return
    fifo.descriptions.append(FifoDescription(f.flags & _KEEP, [(rec.pid, f.fd)]))
    firsts.append((rec, f.fd))


def _save_unread(fifo: Fifo, firsts: list[tuple[ProcessRecord, int]]) -> Refusal | None:
    """Copy the pipe's unread bytes from a description that reads it, and note its
    capacity; refuse bytes nobody reads, and a copy that falls short."""
    live = [(d, rec, fd) for d, (rec, fd) in zip(fifo.descriptions, firsts)
            if not d.flags & os.O_PATH]
    if not live:
        return None   # O_PATH only: no pipe behind them
    d, rec, fd = next(((d, r, n) for d, r, n in live if d.reads), live[0])
    ours = native.copy_fd(rec.pid, fd)
    try:
        fifo.size = pipebuf.size_of(ours)
        if not d.reads:
            waiting = pipebuf.unread(ours)
            return None if not waiting else Refusal(rec.nspid, rec.cmd, (
                f"fd {fd}: {waiting} bytes wait in the named pipe {fifo.path}, which no "
                "process of the sandbox has open for reading: they would not come back; "
                "checkpoint once they are read"))
        fifo.saved, missing = pipebuf.tee_copy(ours, fifo.size)
        if missing:
            return Refusal(rec.nspid, rec.cmd, (
                f"fd {fd}: {missing} bytes of the named pipe {fifo.path}'s unread data "
                "could not be copied"))
        return None
    finally:
        os.close(ours)


def make(fifo: Fifo, root: int) -> list[int]:
    """Our descriptors of fifo's descriptions made again on its node in the tree at
    `root` (one pipe, holding the checkpoint's unread bytes), in fifo.descriptions'
    order."""
    hold = open_in_root(root, fifo.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    out: list[int] = []
    try:
        if not stat.S_ISFIFO(os.fstat(hold).st_mode):
            raise OSError(errno.ENXIO, "not a named pipe in the restored tree")
        pipebuf.set_size(hold, fifo.size)
        if fifo.saved is not None:
            pipebuf.put_back(fifo.saved, hold, fifo.size)
        for d in fifo.descriptions:
            out.append(os.open(f"/proc/self/fd/{hold}", d.flags | os.O_CLOEXEC))
    except BaseException:
        for fd in out:
            os.close(fd)
        raise
    finally:
        os.close(hold)
    return out


def holders_of(fifos: list[Fifo], pid: int) -> dict[int, tuple[int, int]]:
    """pid's descriptors of named pipes: fd -> (index in `fifos`, index of its
    description)."""
    return {fd: (i, j) for i, f in enumerate(fifos) for j, d in enumerate(f.descriptions)
            for p, fd in d.holders if p == pid}


def close_saved(fifos: list[Fifo]) -> None:
    for f in fifos:
        if f.saved is not None:
            os.close(f.saved)
            f.saved = None
