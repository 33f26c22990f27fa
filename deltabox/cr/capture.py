"""What a checkpoint records of each sandbox process, and what it refuses to capture.

Refusing is the safety net of DeltaCR: a process holding state that the restore cannot
recreate faithfully (a socket with data or an error waiting, a connection to outside the
sandbox, a device other than the harmless ones, an epoll instance shared between
processes...) makes the checkpoint fail with the pid, the command and the reason, rather
than come back subtly wrong after a rollback.
"""

from __future__ import annotations

import errno
import os
import re
import select
import socket
import struct
from dataclasses import dataclass, field
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from .. import kernfs
from ..errors import FailedPrecondition
from ..fs.files import open_in_root
from . import native, netlink, pipebuf, sockopts, tcp, udp
from .taskattrs import TaskAttrs

if TYPE_CHECKING:
    from .creds import Creds
    from .eventloop import LoopState
    from .pidfds import PidFd
    from .posix_mq import HeldQueue
    from .sigio import SigIO

# Character devices a restored process may hold (null zero full random urandom): reopened
# by path at a restore, there is nothing else to them.
HARMLESS_CHR = {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9)}
# /dev/tty (a description of the opener's controlling terminal), a pty's master and its
# slave: cr/ptys.py.
DEV_TTY = (5, 0)
PTMX = (5, 2)                       # a pty's master
PTS_MAJORS = range(136, 144)        # its slave, /dev/pts/N (UNIX98_PTY_SLAVE_MAJOR + 7)


@dataclass(frozen=True)
class Refusal:
    pid: int
    cmd: str
    reason: str
    # (host pid, fd) of an inotify instance whose events wait to be read, of a socket
    # with descriptors in flight or a datagram waiting, or of a listener (TCP or unix)
    # with connections not accepted yet: a refusal that passes once the process has read
    # or accepted them (see Unsettled, waiting)
    unread: tuple[int, int] | None = None

    def __str__(self) -> str:
        if not self.pid:   # the sandbox's, not a process's (cr/sysv_shm.py)
            return f"{self.cmd}: {self.reason}"
        return f"pid {self.pid} ({self.cmd}): {self.reason}"


class Unsettled(FailedPrecondition):
    """Refused only for a passing state: events, descriptors in flight, datagrams or
    connections that wait to be read or accepted (`queues`: (host pid, fd) of each inotify
    instance or socket), or a process caught inside vfork() at its stop (no queues). The
    caller may let the processes run until that has passed, and capture again."""

    def __init__(self, message: str, queues: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__(message)
        self.queues = queues


@dataclass
class ProcessRecord:
    """One process at the checkpoint instant (pids as the sandbox sees them)."""

    pid: int                  # host pid of the original at checkpoint time
    nspid: int                # its pid inside the sandbox
    ppid: int                 # ppid, pgid and sid as the host sees them (/proc/pid/stat)
    pgid: int
    sid: int
    cmd: str
    cwd: str                  # inside the sandbox
    threads: int
    tracer_pid: int = 0
    cap_eff: int = -1         # effective capabilities (-1: unknown)
    uid: int = 0              # real uid as the host sees it
    fds: list[native.FdInfo] = field(default_factory=list)
    rss_kb: int = 0
    mappings: int = 0
    shared: list[SharedMapping] = field(default_factory=list)  # cr/unlinked.py copies them
    # read-only shared mappings of files in the sandbox's writable layer, which the live
    # sandbox may rewrite in place: mapped again from the restored tree (in_writable_layer)
    mapped_ro: list[SharedMapping] = field(default_factory=list)
    # (inode, path) of deleted files it maps privately (cr/unlinked.py refuses holding one)
    deleted_private: frozenset[tuple[int, str]] = frozenset()
    # private mappings of files in the sandbox's writable layer or its /dev/shm, which the
    # live sandbox may write in place: mapped again at a restore if their file changed
    # (private_maps.py)
    mapped_private: list[SharedMapping] = field(default_factory=list)
    listens: list[native.ListenSocket] = field(default_factory=list)
    loop: LoopState | None = None   # epoll, eventfds, socket pairs (eventloop.capture)
    # its POSIX timers (timer_create) that cannot be made again, named with why: refused
    timers: list[str] = field(default_factory=list)
    # its interval and POSIX timers (Template.itimers, .ptimers: kept with the record for a
    # restore from disk)
    itimers: list[int] = field(default_factory=lambda: [0] * 12)
    ptimers: list[list[int]] = field(default_factory=list)
    # it sat in a job-control stop (Template.group_stop: kept for a restore from disk)
    stopped: bool = False
    # its parent-death signal (PR_SET_PDEATHSIG; 0: none) and child-subreaper flag, which
    # fork drops (Template.parent_death: kept for a restore from disk)
    pdeathsig: int = 0
    subreaper: bool = False
    seccomp_filters: int = 0  # seccomp filters it runs under (adoption.py: its parent's?)
    tty_nr: int = 0           # its controlling terminal (/proc/pid/stat; cr/ptys.py)
    tpgid: int = -1           # that terminal's foreground process group (host pid)
    # the memory it locked (mlock, mlockall's MCL_CURRENT), locked again at every restore;
    # mlockall's MCL_FUTURE (which /proc does not show) is not kept
    mlocks: list[native.MemoryLock] = field(default_factory=list)
    # nice, priorities, rlimits, ...: read from its template when first needed, for a
    # restore from an image, and kept in its dump (taskattrs.py); None until then
    task: TaskAttrs | None = None
    # its pidfds of its children (pidfds.capture): given back once the children exist
    pidfds: list[PidFd] = field(default_factory=list)
    # its descriptors' signal-driven I/O (O_ASYNC, owner, signal: sigio.capture): given
    # back once every process exists
    sigio: list[SigIO] = field(default_factory=list)
    # its children that had exited, not yet waited for: (nspid, wait status, name)
    zombies: list[tuple[int, int, str]] = field(default_factory=list)
    # its descriptors of POSIX message queues (posix_mq.held): opened on the queues the
    # restore makes
    mqueues: list[HeldQueue] = field(default_factory=list)
    # its credentials, if it runs without the capabilities to restore itself (creds.py):
    # given back last at every restore; None: root's, as a fork keeps them
    creds: Creds | None = None
    # why its credentials could not be read ("" if they were, or are not needed)
    creds_unread: str = ""

    @property
    def running_timer(self) -> str | None:
        """Its timer that was armed at the checkpoint and runs down in wall time (an alarm,
        a POSIX timer), named; None if none. A later checkpoint's time left differs even
        if the process never ran."""
        if any(self.itimers[2:4]):   # ITIMER_REAL's time left (s, us)
            return "an alarm (ITIMER_REAL)"
        armed = [t[0] for t in self.ptimers if any(t[7:9])]   # time left (s, ns)
        return f"a POSIX timer (timer {armed[0]})" if armed else None

    def summary(self) -> dict:
        return dict(pid=self.nspid, ppid=self.ppid, pgid=self.pgid, sid=self.sid,
                    cmd=self.cmd, cwd=self.cwd, threads=self.threads, rss_kb=self.rss_kb,
                    mappings=self.mappings,
                    fds=[dict(fd=f.fd, kind=f.kind, path=f.path, flags=f.flags, pos=f.pos)
                         for f in self.fds])


def same_session(child: ProcessRecord, parent: ProcessRecord) -> bool:
    """Born in its parent's session, a child can stay there or lead one of its own (what
    a restore that gives it back to its parent can do: adoption.py)."""
    return child.sid == parent.sid or child.sid == child.pid


def cmdline(pid: int) -> str:
    try:
        raw = kernfs.read(f"/proc/{pid}/cmdline")
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"


@dataclass(frozen=True)
class SharedMapping:
    """A MAP_SHARED mapping a restore must map again: a template is a fork, which shares
    such memory with the live process instead of keeping it as it was, so the restore
    would see what the process wrote since. cr/unlinked.py copies the object at the
    checkpoint when it has no name left to be found by (anonymous shared memory, a memfd,
    a deleted /dev/shm file: POSIX semaphores, multiprocessing's heap)."""
    start: int
    end: int
    prot: int          # PROT_* bits of its permissions
    offset: int        # file offset of start
    path: str          # as /proc/PID/maps shows it ("/dev/zero (deleted)": anonymous)

    @property
    def where(self) -> str:
        return f"{self.start:x}-{self.end:x}"

    @property
    def what(self) -> str:
        """What backs it, as a user knows it."""
        return "[anonymous]" if self.anonymous else self.path

    @property
    def anonymous(self) -> bool:
        return self.path in ("", "/dev/zero (deleted)") or self.path.startswith("[anon_shmem:")

    @property
    def sysv(self) -> bool:
        return self.path.startswith("/SYSV")

    @property
    def copyable(self) -> bool:
        """Only its mappings and descriptors hold the object (nothing else can reach it)."""
        return not self.sysv and (self.anonymous or self.path.endswith(" (deleted)"))

    @property
    def named_file(self) -> bool:
        """A file of the sandbox's tree by its name: a restore maps it again from the
        restored tree (engine._PipePlan.remaps), where the checkpoint's snapshot has the
        content the mapping had."""
        return not self.sysv and not self.copyable

    @property
    def writable(self) -> bool:
        return bool(self.prot & 2)


# A shared mapping in /proc/PID/maps: "START-END r??s OFFSET DEV INODE [PATH]".
_SHARED = re.compile(rb"([0-9a-f]+)-([0-9a-f]+) ([r-])([w-])([x-])s ([0-9a-f]+) \S+ \S+ *(.*)")
# A private mapping of a deleted file: its inode and name. (The device maps shows is the
# file's beneath an overlay, not the overlay's, which a descriptor's stat gives.)
_PRIVATE_DELETED = re.compile(rb"\S+ \S{3}p \S+ \S+ (\d+) +(.*) \(deleted\)")


def _mappings(pid: int) -> tuple[int, list[SharedMapping], frozenset[tuple[int, str]],
                                 list[bytes]]:
    """How many mappings; the shared ones a restore cannot leave to the template:
    writable ones, any of an object with no name (a deleted file's read-only view would
    still show the original's later writes), and read-only views of named files (glibc's
    gconv-modules.cache; record() keeps those apart: only a file of the writable layer
    can change under them); the deleted files mapped privately; and the lines of the
    private mappings of named files (private_in_writable_layer keeps some). The patterns
    only see the lines that may match: run over the whole map (re.M), the second took
    ~27 us a line (4.6 ms for a python's 172 lines)."""
    try:
        maps = kernfs.read(f"/proc/{pid}/maps")
    except OSError:
        return 0, [], frozenset(), []
    lines = maps.splitlines()
    out = []
    private = set()
    private_files = []
    for line in lines:
        perms = line.split(b" ", 2)[1:2]
        if perms and perms[0].endswith(b"s"):
            if (m := _SHARED.fullmatch(line)) is not None:
                prot = (m[3] == b"r") * 1 | (m[4] == b"w") * 2 | (m[5] == b"x") * 4
                sm = SharedMapping(int(m[1], 16), int(m[2], 16), prot, int(m[6], 16),
                                   m[7].decode(errors="replace"))
                out.append(sm)
        elif line.endswith(b" (deleted)"):
            if (m := _PRIVATE_DELETED.fullmatch(line)) is not None:
                private.add((int(m[1]), m[2].decode(errors="replace")))
        elif b" /" in line:
            private_files.append(line)
    return len(lines), out, frozenset(private), private_files


Head = tuple[str, int, list[SharedMapping], frozenset[tuple[int, str]], list[bytes]]


def record_head(pid: int) -> Head:
    """(command line, number of mappings, shared mappings to map again, deleted files
    mapped privately): what reading needs the process's mmap lock (a fork of the process
    holds it throughout)."""
    return (cmdline(pid), *_mappings(pid))


def record(pid: int, st: native.ProcStatus, head: Head | None = None,
           alive: Collection[int] = ()) -> ProcessRecord:
    """Read one stopped or frozen process from /proc (its status, and maybe its
    record_head, already read; its private mappings of files are kept by
    private_in_writable_layer). `alive`: processes known not to be zombies (read already)."""
    cmd, mappings, maps, deleted_private, _ = head if head is not None else record_head(pid)
    shared = [m for m in maps if m.writable or m.copyable or m.sysv]
    read_only = [m for m in maps if not (m.writable or m.copyable or m.sysv)]
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = "/"
    nspid = st.nspid[-1] if st.nspid else pid
    from . import creds as creds_   # (creds.py reads this module's records)
    creds, unread = None, ""
    if creds_.unprivileged(st.cap_eff):
        try:
            creds = creds_.read(pid)
        except (OSError, ValueError) as e:
            unread = str(e)
    return ProcessRecord(pid=pid, nspid=nspid, ppid=st.ppid, pgid=st.pgid, sid=st.sid,
                         cmd=cmd, cwd=cwd, threads=st.threads,
                         tracer_pid=st.tracer_pid, cap_eff=st.cap_eff, uid=st.uid,
                         fds=native.fds(pid), rss_kb=st.rss_kb, mappings=mappings,
                         shared=shared, mapped_ro=read_only,
                         deleted_private=deleted_private, timers=posix_timers(pid),
                         tty_nr=st.tty_nr, tpgid=st.tpgid, seccomp_filters=st.seccomp_filters,
                         mlocks=locked_ranges(pid) if st.locked_kb else [],
                         zombies=zombie_children(pid, alive), creds=creds,
                         creds_unread=unread)


def zombie_children(pid: int, alive: Collection[int] = ()) -> list[tuple[int, int, str]]:
    """(pid in its namespace, wait status, name) of each child of pid that has exited and not
    been waited for yet (a zombie): made again at a restore (Held.zombie), so the parent's
    wait finds it. From /proc/PID/task/*/children and each other child's stat (state, and
    its exit_code field: the status a wait gives). No cgroup lists a zombie."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            kids = kernfs.read(f"/proc/{pid}/task/{tid}/children").split()
        except OSError:
            continue
        for kid in kids:
            if int(kid) in alive:
                continue
            try:
                stat = kernfs.read(f"/proc/{int(kid)}/stat")
                fields = stat[stat.rindex(b")") + 2:].split()
                if fields[0] != b"Z":
                    continue
                status = native.proc_status(int(kid))
            except (OSError, ValueError, IndexError):
                continue
            comm = stat[stat.index(b"(") + 1:stat.rindex(b")")].decode(errors="surrogateescape")
            out.append((status.nspid[-1] if status.nspid else int(kid), int(fields[-1]), comm))
    return out


def locked_ranges(pid: int) -> list[native.MemoryLock]:
    """pid's locked memory: the mappings /proc/PID/smaps flags "lo" (VM_LOCKED), with "lf"
    (VM_LOCKONFAULT) if locked on fault only. Read only for a process whose status shows
    locked memory (VmLck): smaps walks every page table."""
    out: list[native.MemoryLock] = []
    start = end = 0
    try:
        raw = kernfs.read(f"/proc/{pid}/smaps")
    except OSError:
        return out
    for line in raw.splitlines():
        if line.startswith(b"VmFlags:"):
            flags = line.split()[1:]
            if b"lo" in flags:
                out.append(native.MemoryLock(start, end, b"lf" in flags))
        elif b"-" in line[:40] and not line[:1].isupper():   # a mapping's first line
            lo, _, hi = line.split(None, 1)[0].partition(b"-")
            start, end = int(lo, 16), int(hi, 16)
    return out


def posix_timers(pid: int) -> list[str]:
    """pid's POSIX timers that a restored process cannot get back (native/timers.c makes
    the others again, one aimed at a thread aimed at the same thread), each named with
    why, e.g. "timer 1 (clock 1, signal 10) signals thread 812, which has exited". From
    /proc/PID/timers ("ID: 0", "signal: 14/<sigev_value>", "notify: signal/pid.5" or
    ".../tid.N", "ClockID: 0" per timer; host pids)."""
    try:
        raw = kernfs.read(f"/proc/{pid}/timers")
    except OSError:
        return []
    timers: list[dict[bytes, bytes]] = []
    for line in raw.splitlines():
        key, _, value = line.partition(b": ")
        if key == b"ID":
            timers.append({})
        if timers:
            timers[-1][key] = value.strip()
    if not timers:
        return []
    most = native.ptimers_supported()
    if not most:
        return [f"{_timer_name(t)}: this kernel cannot give a restored timer its id "
                "(prctl PR_TIMER_CREATE_RESTORE_IDS)" for t in timers]
    if len(timers) > most:
        return [f"{len(timers)} timers: at most {most} are captured"]
    out = []
    for t in timers:
        how, _, whom = t.get(b"notify", b"").partition(b"/")
        clock = int(t.get(b"ClockID", b"0"))
        if how not in (b"signal", b"none", b"thread") or not (
                whom.startswith((b"pid.", b"tid.")) and whom[4:].isdigit()):
            out.append(f"{_timer_name(t)} notifies as {t.get(b'notify', b'?').decode()}, "
                       "not understood")
        elif whom.startswith(b"tid.") and not os.path.exists(
                f"/proc/{pid}/task/{int(whom[4:])}"):
            out.append(f"{_timer_name(t)} signals thread {int(whom[4:])}, which has exited")
        elif clock < 0 and ~(clock >> 3) != 0:
            out.append(f"{_timer_name(t)} runs on the CPU clock of pid {~(clock >> 3)}")
    return out


def _timer_name(t: dict[bytes, bytes]) -> str:
    return (f"timer {t.get(b'ID', b'?').decode()} (clock {t.get(b'ClockID', b'?').decode()}, "
            f"signal {t.get(b'signal', b'?').split(b'/')[0].decode()})")


def status_refused(st: native.ProcStatus, tracer_ok: set[int]) -> bool:
    """Whether its status alone refuses the process (threads, another tracer, missing
    capabilities): what must be known before it is seized and forked into a template."""
    return bool(_status_reasons(st, tracer_ok))


def _status_reasons(st: native.ProcStatus | ProcessRecord, tracer_ok: set[int]) -> list[str]:
    """The reasons in a process's status (both types carry its fields under one name)."""
    out = []
    if st.threads > native.MAX_THREADS:
        out.append(f"{st.threads} threads: at most {native.MAX_THREADS} are captured")
    if st.tracer_pid and st.tracer_pid not in tracer_ok:
        out.append(f"traced by pid {st.tracer_pid}")
    return out


def refusals(rec: ProcessRecord, tracer_ok: set[int]) -> list[Refusal]:
    """Everything about this process that a restore could not recreate faithfully."""
    out: list[Refusal] = []

    def refuse(reason: str) -> None:
        out.append(Refusal(rec.nspid, rec.cmd, reason))

    table: list[tuple[int, str, str]] | None = None

    def table_() -> list[tuple[int, str, str]]:   # mountinfo read once, if at all
        nonlocal table
        table = mounts(rec.pid) if table is None else table
        return table

    for reason in _status_reasons(rec, tracer_ok):
        refuse(reason)
    if rec.creds_unread:
        refuse(f"runs without CAP_SYS_ADMIN and its credentials could not be read: "
               f"{rec.creds_unread}")
    from . import creds as creds_
    why = creds_.refusal(rec)
    if why:
        refuse(why)
    for nspid, status, _ in rec.zombies:
        if status & 0x80:   # WCOREDUMP: made again, it would dump a core of its parent
            refuse(f"child {nspid} died of signal {status & 0x7f} with a core dump and has "
                   "not been waited for: not restored; checkpoint once it has been")
    for timer in rec.timers:
        # fork(2) does not pass them on; a restored process would never get the signal
        # (`timeout 60 CMD` restored so would wait for CMD forever).
        refuse(f"POSIX timer {timer}: not restored; checkpoint once it has fired or been "
               "deleted")
    for m in rec.shared:
        if m.named_file and not in_dev_shm(m.path) and mount_of(table_(), m.path)[0] != "/":
            refuse(f"writable shared mapping of the file {m.path} at {m.where}: it is on "
                   "a mount of its own (/dev, /proc), which a checkpoint does "
                   "not snapshot")
    for f in rec.fds:
        reason = _fd_refusal(f)
        if reason:
            refuse(f"fd {f.fd}: {reason}")
        elif (f.kind == "file" and not f.deleted and not in_dev_shm(f.path)) or \
                f.kind == "fifo":
            found = mount_by_id(table_(), f.mnt_id)
            if found is None and is_posix_queue(rec.pid, f):
                continue   # made again by the restore, and opened (posix_mq.py)
            if found is None:
                # Its path names a file of the sandbox's tree that it is not: a POSIX
                # message queue (mq_open) shows as "/NAME" but lives in the IPC
                # namespace's own file system; reopened by path it would be another file.
                refuse(f"fd {f.fd}: {f.path} is on a file system the process's mount table "
                       "does not show (a POSIX message queue, or a mount since detached): "
                       "not captured")
                continue
            point, fstype = found
            if point != "/" and (f.kind == "fifo" or fstype not in _REMADE):
                # /dev is a tmpfs made afresh for each generation (a mount made in the
                # sandbox is not made again either): reopened by path, the file would be
                # missing, or another one. (/dev/shm's files are copied: shm_files.py;
                # a named pipe is made again in the restored tree: fifos.py.)
                refuse(f"fd {f.fd}: {f.path} is on a mount of its own ({point}, "
                       f"{fstype or 'unknown type'}) that a checkpoint does not snapshot: "
                       "not restored")
    return out


MQUEUE_MAGIC = 0x19800202   # statfs f_type of an mqueue file system


def is_posix_queue(pid: int, f: native.FdInfo) -> bool:
    """Whether descriptor f of process pid is a POSIX message queue's (mq_open): a file
    named "/NAME" on no mount of the process (the namespace's own mqueue file system),
    unlinked since or not."""
    if f.kind != "file" or not f.path.startswith("/") or "/" in f.path[1:]:
        return False
    try:
        return kernfs.fs_type(f"/proc/{pid}/fd/{f.fd}") == MQUEUE_MAGIC
    except OSError:
        return False


def shared_lock_refusals(records: list[ProcessRecord]) -> list[Refusal]:
    """A flock or OFD lock belongs to an open file description. A regular file's
    description shared by two descriptors (dup, or a fork's parent and child: both show
    the lock) comes back shared, and locked once (cr/shared_files.py, cr/unlinked.py); a
    directory's is reopened for each descriptor, and would come back as two descriptions,
    each claiming the lock (and one's unlock no longer the other's). Refused, naming
    both."""
    held = [(rec, f) for rec in records for f in rec.fds if f.kind != "file"
            and any((lk := native.FileLock.parse(f.fd, t)) is not None
                    and lk.kind != native.LOCK_POSIX for t in f.locks)]
    out = []
    for i, (rec, f) in enumerate(held):
        for rec2, f2 in held[i + 1:]:
            if f2.path == f.path and native.same_file(rec.pid, f.fd, rec2.pid, f2.fd):
                out.append(Refusal(rec.nspid, rec.cmd, (
                    f"fd {f.fd}: its file lock on {f.path} ({', '.join(f.locks)}) is on an "
                    f"open file description it shares with pid {rec2.nspid} fd {f2.fd}: "
                    "not restored (a restore gives each descriptor its own); checkpoint "
                    "once the lock is released")))
    return out


def in_writable_layer(records: list[ProcessRecord], layers: Sequence[str]) -> None:
    """Keep in each record's mapped_ro only the files present in the sandbox's writable
    layer (`layers[0]`, upper first; if unknown, those of its root file system): a file
    of a lower layer is copied up before any write, so the pages a template maps of it
    never change."""
    if not any(r.mapped_ro for r in records):
        return
    if not layers:
        for rec in records:
            rec.mapped_ro = [m for m in rec.mapped_ro
                             if in_dev_shm(m.path) or on_snapshotted_root(rec.pid, m.path)]
        return
    upper = os.open(layers[0], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    present: dict[str, bool] = {}   # one look per file: bash and python both map gconv's
    try:
        for rec in records:
            for m in rec.mapped_ro:
                if m.path not in present:   # /dev/shm's are copied (shm_files.py)
                    present[m.path] = in_dev_shm(m.path) or _present(upper, m.path)
            rec.mapped_ro = [m for m in rec.mapped_ro if present[m.path]]
    finally:
        os.close(upper)


def private_in_writable_layer(records: list[ProcessRecord], heads: dict[int, Head],
                              layers: Sequence[str],
                              known: dict[tuple[str, str, int], bool],
                              scope: str = "") -> None:
    """Set each record's mapped_private: its private mappings (from its head's maps
    lines) of files of the sandbox's writable layer (`layers[0]`; if unknown, of every
    named file) and of its /dev/shm, which the live sandbox may write in place
    (private_maps.py). A mapping is of the upper layer's file when that layer has a file
    at its path with its inode (/proc/PID/maps names the overlay's device for every
    layer, so the device cannot tell): a mapping of a lower file copied up since keeps
    the lower one, which never changes. A mapping's file never changes layer, so the
    answer is kept in `known` (the caller's, by `scope` (the sandbox), path and inode,
    across generations: a restored process, with a new host pid and the new overlay's
    device in its maps, maps its checkpoint's files, and a snapshot keeps inode numbers):
    a look per file the first time, ~10 us each (~0.2 ms for a shell and a python)."""
    upper_dir = layers[0] if layers else ""
    upper = -1
    inode_of: dict[str, int | None] = {}   # path -> the upper layer's inode there
    try:
        for rec in records:
            head = heads.get(rec.pid)
            if head is None or not head[4]:
                continue
            keep = []
            for line in head[4]:
                i = line.find(b" /")
                fields = line[:i].split()
                path = line[i + 1:].decode(errors="replace")
                ours = True
                if upper_dir and not in_dev_shm(path):
                    key = (scope, path, int(fields[4]))
                    found = known.get(key)
                    if found is None:
                        if upper < 0:
                            upper = os.open(upper_dir, os.O_PATH | os.O_DIRECTORY |
                                            os.O_CLOEXEC)
                        if path not in inode_of:
                            inode_of[path] = _upper_inode(upper, path)
                        found = known[key] = inode_of[path] == key[2]
                    ours = found
                if ours:
                    keep.append((fields, path))
            rec.mapped_private = [_private_mapping(f, path) for f, path in keep]
    finally:
        if upper >= 0:
            os.close(upper)


def _upper_inode(upper: int, path: str) -> int | None:
    try:
        fd = open_in_root(upper, path, os.O_PATH | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _private_mapping(fields: list[bytes], path: str) -> SharedMapping:
    """A private mapping from the fields of its maps line before the path ("START-END
    PERMS OFFSET DEV INODE")."""
    start, end = fields[0].split(b"-")
    perms = fields[1]
    prot = (perms[0:1] == b"r") * 1 | (perms[1:2] == b"w") * 2 | (perms[2:3] == b"x") * 4
    return SharedMapping(int(start, 16), int(end, 16), prot, int(fields[2], 16), path)


def _present(root: int, path: str) -> bool:
    try:
        os.close(open_in_root(root, path, os.O_PATH | os.O_NOFOLLOW))
        return True
    except OSError:
        return False


def in_dev_shm(path: str) -> bool:
    """A file of the sandbox's /dev/shm (POSIX shared memory, named semaphores): a tmpfs
    made afresh for each generation, whose held files a checkpoint copies (shm_files.py)."""
    name = path[len("/dev/shm/"):]
    return (path.startswith("/dev/shm/") and bool(name) and "/" not in name
            and not path.endswith(" (deleted)"))   # unlinked.py's


def on_snapshotted_root(pid: int, path: str) -> bool:
    """Whether `path` (as pid sees it) lies on its root file system, the sandbox's tree a
    checkpoint snapshots, and not on a mount of its own (/dev and /dev/shm are tmpfs made
    afresh for each generation; /proc): the longest mount point of /proc/PID/mountinfo
    above it is "/"."""
    return mount_of(mounts(pid), path)[0] == "/"


def mounts(pid: int) -> list[tuple[int, str, str]]:
    """pid's mounts: id, mount point and file system type (/proc/PID/mountinfo); [] if
    gone."""
    try:
        info = kernfs.read(f"/proc/{pid}/mountinfo")
    except OSError:
        return []
    out = []
    for line in info.splitlines():
        # id parent dev root POINT options [optional...] - TYPE source super-options
        fields = line.split(b" ")
        try:
            fstype = fields[fields.index(b"-", 6) + 1]
        except (ValueError, IndexError):
            continue
        out.append((int(fields[0]), fields[4].decode(errors="replace"),
                    fstype.decode(errors="replace")))
    return out


def mount_of(table: list[tuple[int, str, str]], path: str) -> tuple[str, str]:
    """The mount (point, type) of `table` that holds `path`: the longest point above it;
    ("", "") if none."""
    best = ("", "")
    for _, point, fstype in table:
        under = path == point or path.startswith(point.rstrip("/") + "/")
        if under and len(point) > len(best[0]):
            best = (point, fstype)
    return best


def mount_by_id(table: list[tuple[int, str, str]], mnt_id: int) -> tuple[str, str] | None:
    """The mount (point, type) of `table` with this id; None if the table has none."""
    return next(((point, fstype) for i, point, fstype in table if i == mnt_id), None)


# File systems a restored generation mounts afresh with the same files: a file there is
# reopened by path like one of the snapshotted root.
_REMADE = ("proc", "sysfs")


def is_loop_fd(f: native.FdInfo) -> bool:
    """An event loop's descriptor (epoll, eventfd, timerfd, signalfd, inotify, unix
    socket, TCP connection): eventloop.capture decides about it, not the refusals here."""
    return f.kind in ("epoll", "eventfd", "timerfd", "signalfd", "inotify") or (
        f.kind == "socket" and f.socket is not None and f.socket.family == "unix") or (
        tcp.is_connection(f))


def _fd_refusal(f: native.FdInfo) -> str | None:
    other = [lock for lock in f.locks if native.FileLock.parse(f.fd, lock) is None]
    if other:
        # A restored process takes its flock, POSIX and OFD locks again (fork_template.c
        # take_locks); a lease or delegation it would not have.
        return (f"holds {', '.join(other)} on {f.path}: leases and delegations are not "
                "captured; checkpoint once it is released")
    if f.kind == "socket" and f.socket is not None and f.socket.filtered:
        # made again by eventloop.py and tcp.py without one (made_again's keep theirs)
        return (f"socket {f.describe()}: has a socket filter (SO_ATTACH_FILTER or "
                "SO_ATTACH_BPF): not made again on a unix socket or TCP connection")
    if is_loop_fd(f) or f.kind == "pidfd":   # eventloop.capture, pidfds.capture
        return None
    if f.kind in ("dir", "chr") and f.target.endswith(" (deleted)"):
        # Reopened by path at a restore (a deleted file's content is copied: unlinked.py),
        # which is gone: the restore would fail and the processes restart.
        return f"{f.target}: a deleted directory or device held open: no path to reopen it by"
    if f.kind in ("file", "dir", "pipe"):
        if f.kind == "pipe" and f.flags & os.O_DIRECT:
            return "a packet-mode pipe (O_DIRECT): its message boundaries are not captured"
        return None
    if f.kind == "chr":
        if f.rdev in HARMLESS_CHR:
            return None
        if f.rdev in (DEV_TTY, PTMX) or f.rdev and f.rdev[0] in PTS_MAJORS:
            return None   # cr/ptys.py
        return f"device {f.path} ({f.rdev[0]}:{f.rdev[1]}) is not one of " \
               "null/zero/full/random/urandom" if f.rdev else f"device {f.path}"
    if f.kind == "socket":
        if made_again(f):
            return None
        return (f"socket {f.describe()}: only listening TCP sockets, TCP connections "
                "(established or half-closed), UDP sockets, netlink sockets and unix "
                "sockets within the sandbox are captured")
    if f.kind == "fifo":
        if f.target.endswith(" (deleted)"):
            return (f"named pipe {f.target}: deleted while open: no path to open it again "
                    "by")
        if f.flags & os.O_DIRECT:
            return (f"named pipe {f.path} in packet mode (O_DIRECT): its message "
                    "boundaries are not captured")
        return None   # fifos.py
    return f"{f.path}: this kind of descriptor is not captured"


def made_again(f: native.FdInfo) -> bool:
    """A socket a spawn makes afresh (rec.listens): a TCP listener, a UDP or netlink
    socket."""
    return is_tcp_listener(f) or udp.is_udp(f) or netlink.is_netlink(f)


def is_tcp_listener(f: native.FdInfo) -> bool:
    k = f.socket
    return k is not None and k.family in ("inet", "inet6") and k.type == "tcp" and k.listening


_TCP_INFO_BACKLOG = struct.Struct("=8x4xIIIII")  # after rto: ato snd_mss rcv_mss unacked sacked


def listen_socket(pid: int, f: native.FdInfo) -> tuple[native.ListenSocket, int]:
    """What it takes to create this listening socket afresh (its options: sockopts.py),
    and how many connections wait in its accept queue (TCP_INFO on a listener reports both
    queue and backlog)."""
    with socket.socket(fileno=native.copy_fd(pid, f.fd)) as s:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        _ato, _smss, _rmss, queued, backlog = _TCP_INFO_BACKLOG.unpack_from(info)
        ls = sockopts.remade(pid, f, s, sockopts.LISTENER,
                             addr=sockopts.sockaddr(s.family, s.getsockname()),
                             backlog=max(1, backlog))
    return ls, queued


def waiting(fd: int) -> int:
    """Whether something still waits in the queue at our fd of a passing refusal
    (Refusal.unread): bytes (FIONREAD: an inotify instance's events, a socket's), or a
    listener's connections not accepted yet (FIONREAD refuses a listener, which polls
    readable while one waits)."""
    try:
        return pipebuf.unread(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    p = select.poll()
    p.register(fd, select.POLLIN)
    return len(p.poll(0))


def add_listeners(rec: ProcessRecord) -> list[Refusal]:
    """Fill rec.listens with its TCP listeners, UDP and netlink sockets; refuse a
    listener with connections waiting to be accepted or a UDP socket with a datagram
    waiting (passing refusals: Refusal.unread), a UDP or netlink socket with an error
    (a netlink one: a message) waiting (the restored copy could not have them)."""
    out = []
    joined = None     # the namespace's multicast groups: read at its first UDP socket
    busy = None       # its netlink sockets with a dump going on: read at its first one
    for f in rec.fds:
        if f.kind != "socket" or not made_again(f):
            continue
        try:
            if netlink.is_netlink(f):
                if busy is None:
                    busy = netlink.dumping(rec.pid)
                ls, why = netlink.capture(rec.pid, f, busy)
            elif udp.is_udp(f):
                if joined is None:
                    joined = udp.joined_in_namespace(rec.pid)
                ls, why = udp.capture(rec.pid, f, joined)
                if why == udp.DATAGRAM_WAITS:   # passing: its process reads it (Unsettled)
                    out.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: {f.describe()}: "
                                       f"{why}", unread=(rec.pid, f.fd)))
                    why = None
            else:
                ls, queued = listen_socket(rec.pid, f)
                if queued:   # passing: the capture lets its server accept them (Unsettled)
                    out.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: {f.describe()}: "
                                       f"{queued} connection(s) wait to be accepted: "
                                       "checkpoint once its server has accepted them",
                                       unread=(rec.pid, f.fd)))
                why = None
        except native.CRError as e:   # what cannot be made again (sockopts.py)
            out.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: {f.describe()}: {e.strerror}"))
            continue
        except OSError as e:
            out.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: reading the socket: {e}"))
            continue
        if why:
            out.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: {f.describe()}: {why}"))
        if ls is not None:
            rec.listens.append(ls)
    return out
