"""Pseudo-terminals made in the sandbox: pexpect's and SWE-ReX's shell, a tmux server and
its panes, `script`, a test harness driving a REPL.

A pty is a pair made by opening the sandbox's /dev/ptmx: the master (the driver's end)
and the slave /dev/pts/N (the program's end, usually its controlling terminal). Reopened
by path at a restore, the master would be a new, unrelated pty and /dev/pts/N would not
exist in the restored generation's own devpts. So the checkpoint notes each pty whose
master a process of the sandbox holds, or the daemon for a session on a pty
(sandbox/session.py; that master description is noted as the session's, and a restore
gives the daemon its new one): its index, its settings (termios2; the master's
side is always the kernel's raw one), the window size, packet mode and exclusive mode,
its open file descriptions (grouped by kcmp), the bytes waiting in it and the session
leader whose controlling terminal it is. A restore opens the generation's ptmx until it
gets the same index (devpts gives the lowest free one), unlocks it, sets it up, gives
the master's description its flags and opens each of the slave's descriptions through
the master (TIOCGPTPEER: no path); the leader takes it back as its controlling terminal
once it leads its session again (fork_template.c take_terminal). Every restored sandbox
gets its own pair, in its own devpts.

Bytes waiting in it are copied: the output its program wrote that the master's holder
has not read yet (pexpect reads only when it expects), and input typed that its program
has not read, in canonical mode (ICANON: a program reading lines) whole lines and the
line being typed too (_take_lines). Reading them takes them out of the live pty, so the
capture writes them back at once, unprocessed (the slave's OPOST off for output; its
input processing and echo off for input: both were done when they first went through),
the sandbox frozen; a restore puts them in the new pair the same way.

Refused by name (FAILED_PRECONDITION, or Unsettled for output its reader will take):
- output waiting in packet mode (its reads carry a header) or while the terminal is
  stopped by ^S (Unsettled: the checkpoint lets the reader take it and tries again);
  more than 4000 bytes of input;
- a controlling terminal whose session has a process that is not the child of another
  process of the session, or that maps memory shared with another process (it could not
  be born in the restored session: see _session); whose foreground group has no
  captured leader; whose leader holds no descriptor of it;
- a slave whose master no process of the sandbox (nor the daemon) holds, a pty of
  another devpts, a locked one (unlockpt not called), another line discipline than N_TTY.
Not kept: a terminal stopped by ^S (flow control: its output resumes); in canonical
mode, a literal-next (^V) typed as the last character (the next one it would quote).
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import struct
import termios
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import native
from .capture import DEV_TTY, PTMX, PTS_MAJORS, ProcessRecord, Refusal

TCGETS2, TCSETS2 = 0x802C542A, 0x402C542B   # struct termios2: 44 bytes on x86_64
TERMIOS2_SIZE = 44
TIOCGPTN, TIOCSPTLCK = 0x80045430, 0x40045431
TIOCGPKT, TIOCPKT = 0x80045438, 0x5420
TIOCGEXCL = 0x80045440
TIOCGPTPEER = 0x5441
TIOCGDEV = 0x80045432               # the device of the terminal behind a descriptor
N_TTY = 0
PTMX_PATH = "/dev/pts/ptmx"         # the sandbox's devpts: mkroot.c mounts it ptmxmode=0666
MAX_SKIPS = 256                     # indices opened and dropped to reach one (devpts)
_KEEP = os.O_ACCMODE | os.O_NONBLOCK
# Input processing a copy of waiting input is typed again without: only flow control stays
# (clearing IXON would restart a terminal stopped by ^S).
_FLOW = termios.IXON | termios.IXOFF | termios.IXANY
_ECHOING = termios.ECHO | termios.ECHONL | termios.ISIG | termios.IEXTEN
MAX_INPUT = 4000    # below N_TTY's 4096-byte buffer: a copy put back fits in one go


@dataclass
class PtyEnd:
    """One open file description of a pty's end, and the descriptors that hold it."""
    master: bool
    flags: int                                          # access mode, O_NONBLOCK
    holders: list[tuple[int, int]] = field(default_factory=list)   # (host pid, fd)
    owner: str = ""     # "session:<name>": the daemon's master of a session's terminal


@dataclass
class Pty:
    """A pseudo-terminal as the checkpoint found it."""
    index: int                  # /dev/pts/N
    termios: bytes              # struct termios2 (the slave's: the master's own are the
                                # kernel's raw ones, which no call reads or sets)
    winsize: bytes              # struct winsize
    packet: bool = False        # TIOCPKT on the master
    exclusive: bool = False     # TIOCEXCL on the slave
    descriptions: list[PtyEnd] = field(default_factory=list)
    # the session leader whose controlling terminal it is (host pid at the checkpoint),
    # and its fd of the slave, by which it takes it back; the session's other processes
    # (host pids: born of restored parents in it, adoption.py); its foreground process
    # group (its id in the sandbox) if not the leader's (0)
    leader: int = 0
    leader_fd: int = -1
    members: list[int] = field(default_factory=list)
    foreground: int = 0
    output: bytes = b""         # written by its program, not read by the master's holder
    input: bytes = b""          # typed at the master, not read by its program (to type
                                # again: ptys._take_lines)
    input_seen: int = 0         # what FIONREAD counts of it once typed

    @property
    def path(self) -> str:
        return f"/dev/pts/{self.index}"

    def to_json(self) -> dict:
        return dict(index=self.index, termios=self.termios.hex(), winsize=self.winsize.hex(),
                    packet=self.packet, exclusive=self.exclusive, leader=self.leader,
                    leader_fd=self.leader_fd, output=self.output.hex(),
                    input=self.input.hex(), input_seen=self.input_seen,
                    members=self.members, foreground=self.foreground,
                    descriptions=[dict(master=d.master, flags=d.flags, owner=d.owner,
                                       holders=[list(h) for h in d.holders])
                                  for d in self.descriptions])

    @classmethod
    def from_json(cls, d: dict) -> Pty:
        return cls(int(d["index"]), bytes.fromhex(d["termios"]), bytes.fromhex(d["winsize"]),
                   bool(d["packet"]), bool(d["exclusive"]),
                   [PtyEnd(bool(x["master"]), int(x["flags"]),
                           [(int(p), int(fd)) for p, fd in x["holders"]],
                           str(x.get("owner", "")))
                    for x in d["descriptions"]],
                   leader=int(d["leader"]), leader_fd=int(d["leader_fd"]),
                   members=[int(p) for p in d["members"]], foreground=int(d["foreground"]),
                   output=bytes.fromhex(d["output"]), input=bytes.fromhex(d["input"]),
                   input_seen=int(d["input_seen"]))


def is_pty(f: native.FdInfo) -> bool:
    """A descriptor of a pty's master (/dev/ptmx) or slave (/dev/pts/N)."""
    return f.kind == "chr" and f.rdev is not None and (
        f.rdev == PTMX or f.rdev[0] in PTS_MAJORS)


def _slave_index(major: int, minor: int) -> int:
    return (major - PTS_MAJORS.start) * 256 + minor


def _int(fd: int, req: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, req, b"\0" * 4))[0]


def capture(records: list[ProcessRecord], daemon_masters: Mapping[str, int] | None = None
            ) -> tuple[list[Pty], list[Refusal]]:
    """The ptys the processes hold, with whose controlling terminal each is; the
    refusals of those that cannot come back whole. `daemon_masters`: the masters the
    daemon holds of its sessions' terminals (name -> our fd), noted as owned by them."""
    if not any(is_pty(f) for r in records for f in r.fds) and \
            not any(r.tty_nr for r in records):
        return [], []
    refused: list[Refusal] = []
    ends: dict[int, list[tuple[PtyEnd, ProcessRecord, int]]] = {}   # index -> ends
    devpts = _devpts(records)
    for rec in records:
        for f in rec.fds:
            if not is_pty(f):
                continue
            try:
                index, why = _end_index(rec, f, devpts)
            except OSError:
                continue   # gone with its process: the capture's others notice
            if why is None:
                why = _add(ends.setdefault(index, []), rec, f)
            if why:
                refused.append(Refusal(rec.nspid, rec.cmd, f"fd {f.fd}: {why}"))
    for name, fd in (daemon_masters or {}).items():
        group = ends.get(_int(fd, TIOCGPTN))
        if group is not None:   # (none: no process of the sandbox holds its slave now)
            group.append((PtyEnd(True, 0, owner=f"session:{name}"), None, fd))
    ptys: list[Pty] = []
    for index, group in sorted(ends.items()):
        pty, why = _read(index, group)
        if why is not None:
            refused.append(why)
        if pty is not None:
            ptys.append(pty)
    refused += _controlling(records, {p.index: p for p in ptys})
    refused += _dev_tty(records, {p.index for p in ptys})
    return ([], refused) if refused else (ptys, refused)


def _devpts(records: list[ProcessRecord]) -> int:
    """The device of the sandbox's own devpts (-1 if it cannot be seen)."""
    for rec in records:
        try:
            return os.stat(f"/proc/{rec.pid}/root/dev/pts").st_dev
        except OSError:
            continue
    return -1


def _end_index(rec: ProcessRecord, f: native.FdInfo, devpts: int) -> tuple[int, str | None]:
    """(index, None) of the pty behind a descriptor, or (-1, why it is refused)."""
    if f.rdev != PTMX:
        st = os.stat(f"/proc/{rec.pid}/fd/{f.fd}")
        if st.st_dev != devpts:
            return -1, (f"{f.path}: a pseudo-terminal of another devpts than the sandbox's "
                        "is not captured")
        return _slave_index(os.major(st.st_rdev), os.minor(st.st_rdev)), None
    ours = native.copy_fd(rec.pid, f.fd)
    try:
        index = _int(ours, TIOCGPTN)
        try:
            peer = fcntl.ioctl(ours, TIOCGPTPEER, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK
                               | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            return -1, (f"the master of /dev/pts/{index}, whose slave is still locked "
                        "(unlockpt not called): not captured")
        try:
            if os.fstat(peer).st_dev != devpts:
                return -1, ("the master of a pseudo-terminal of another devpts than the "
                            "sandbox's is not captured")
        finally:
            os.close(peer)
        return index, None
    finally:
        os.close(ours)


# An end's description, its first holder's record (None: the daemon's own fd) and fd.
_Group = list[tuple[PtyEnd, ProcessRecord | None, int]]


def _add(group: _Group, rec: ProcessRecord,
         f: native.FdInfo) -> str | None:
    """f joins the description it shares (kcmp), or makes one of its own; why it is
    refused, if it is."""
    master = f.rdev == PTMX
    for end, rec0, fd0 in group:
        if rec0 is not None and end.master == master and \
                native.same_file(rec0.pid, fd0, rec.pid, f.fd):
            end.holders.append((rec.pid, f.fd))
            return None
    group.append((PtyEnd(master, f.flags & _KEEP, [(rec.pid, f.fd)]), rec, f.fd))
    if not master and _sticky(rec.pid, f.fd):
        return (f"{f.path} was opened from its master with O_CLOEXEC (TIOCGPTPEER keeps it "
                "in the description, so which of its descriptors close on exec cannot be "
                "told): not captured")
    return None


def _sticky(pid: int, fd: int) -> bool:
    """Whether the description behind pid's fd carries O_CLOEXEC in its own flags, as
    TIOCGPTPEER leaves it (an open(2) drops it): /proc/PID/fdinfo's flags then show it for
    every descriptor of it, close-on-exec or not. Seen on a dup of ours that is not
    close-on-exec."""
    ours = native.copy_fd(pid, fd)
    try:
        # F_DUPFD: not close-on-exec (os.dup's is), so its fdinfo shows only the
        # description's flags
        dup = fcntl.fcntl(ours, fcntl.F_DUPFD, 0)
        try:
            flags = _fdinfo_flags(dup)
        finally:
            os.close(dup)
    finally:
        os.close(ours)
    return bool(flags & os.O_CLOEXEC)


def _fdinfo_flags(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"flags:"):
                return int(line.split()[1], 8)
    return 0


def _read(index: int, group: _Group) -> tuple[Pty | None, Refusal | None]:
    """The pty's state, read through our copy of its master's description (None if no
    process holds that), and why it is refused, if it is."""
    masters = [(e, rec, fd) for e, rec, fd in group if e.master]
    _, rec, fd = next(x for x in group if x[1] is not None)   # whom a refusal names
    if not masters:
        return None, Refusal(rec.nspid, rec.cmd, (
            f"fd {fd}: /dev/pts/{index}, whose master no process of the sandbox holds: "
            "not captured"))
    _, holder, master_fd = masters[0]
    ours = native.copy_fd(holder.pid, master_fd) if holder is not None else os.dup(master_fd)
    try:
        peer = fcntl.ioctl(ours, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK
                           | os.O_CLOEXEC)
        try:
            pty = Pty(index, fcntl.ioctl(peer, TCGETS2, bytes(TERMIOS2_SIZE)),
                      fcntl.ioctl(peer, termios.TIOCGWINSZ, bytes(8)),
                      bool(_int(ours, TIOCGPKT)), bool(_int(peer, TIOCGEXCL)),
                      [e for e, _, _ in group])
            if _int(peer, termios.TIOCGETD) != N_TTY:   # before any byte is moved
                why = Refusal(rec.nspid, rec.cmd, (
                    f"fd {fd}: /dev/pts/{index} has another line discipline than N_TTY: "
                    "not captured"))
            else:
                why = _queues(pty, ours, peer, group)
        finally:
            os.close(peer)
    finally:
        os.close(ours)
    return pty, why


def _queues(pty: Pty, master: int, slave: int, group: _Group) -> Refusal | None:
    """Copy the bytes waiting in the pty, output for its master's reader and input for
    its program, into pty.output and pty.input, and give them back to the live pty (the
    sandbox is frozen: nobody sees them go and come back); or why they cannot be (or may
    wait unseen)."""
    _, rec0, fd0 = group[0]   # a process's (the daemon's ends come last)
    assert rec0 is not None
    if out := _pending(master):
        if pty.packet or not _writable(slave):
            # Not copied (packet mode's headers, a slave stopped by ^S): its reader may
            # take them (engine._refusal: Unsettled).
            readers = [(rec, fd) for e, rec, fd in group if e.master and rec is not None
                       and e.flags & os.O_ACCMODE != os.O_WRONLY]
            rec, fd = readers[0] if readers else (rec0, fd0)
            return Refusal(rec.nspid, rec.cmd, (
                f"fd {fd}: {out} bytes of output wait in {pty.path}'s master, "
                "not read yet"), unread=(rec.pid, fd) if readers else None)
        pty.output = _drain(master)
        if not _give_output(slave, master, pty.termios, pty.output):
            return Refusal(rec0.nspid, rec0.cmd, (
                f"fd {fd0}: the {len(pty.output)} bytes of output waiting in {pty.path} "
                "could not be copied"))
    waiting = _pending(slave)   # in canonical mode, whole lines only (see _take_lines)
    canonical = bool(_lflag(pty.termios) & termios.ICANON)
    if waiting > MAX_INPUT or (waiting or canonical) and not _writable(master):
        # (No room to type it again: the slave's input is throttled, or the master stopped.)
        return Refusal(rec0.nspid, rec0.cmd, (
            f"fd {fd0}: {waiting or 'some'} bytes of input wait in {pty.path}, not read by "
            "its program yet: not captured; checkpoint once it has read them"))
    if canonical:
        pty.input, pty.input_seen = _take_lines(slave, pty.termios)
    elif _pending(slave):
        pty.input = _drain(slave)
        pty.input_seen = len(pty.input)
    if pty.input and not _give_input(master, slave, pty.termios, pty.input,
                                     pty.input_seen):
        return Refusal(rec0.nspid, rec0.cmd, (
            f"fd {fd0}: the {len(pty.input)} bytes of input waiting in {pty.path} could not "
            "be copied"))
    return None


def _take_lines(slave: int, settings: bytes) -> tuple[bytes, int]:
    """Take the input waiting in a pty in canonical mode: (what typing it again gives
    back, how much of it FIONREAD counts then). FIONREAD counts whole lines only, each
    read gives one; the line being typed (no newline yet) shows only once the slave is
    out of canonical mode, which also clears the line discipline's line marks: so the
    whole lines are read first, then the rest with ICANON off, then ICANON goes back on
    over an empty buffer, which changes nothing (n_tty_set_termios). Typed again (with
    _give_input): a line ended by EOF gets its EOF character back (read drops it), and an
    editing character taken literally gets the literal-next character (IEXTEN) first."""
    cc = settings[17:36]
    ends = {b"\n", bytes([cc[termios.VEOL]]), bytes([cc[termios.VEOL2]])} - {b"\0"}
    editing = {cc[i] for i in (termios.VERASE, termios.VKILL, termios.VEOF, termios.VEOL,
                               termios.VEOL2, termios.VWERASE, termios.VREPRINT,
                               termios.VLNEXT)} - {0} | {ord("\n")}
    lnext = bytes([cc[termios.VLNEXT]])

    def literal(data: bytes) -> bytes:
        return b"".join(lnext + bytes([c]) if c in editing else bytes([c]) for c in data)
    typed, seen = b"", 0
    while _pending(slave):
        line = os.read(slave, 4096)   # one whole line
        seen += len(line)
        if line[-1:] in ends:
            typed += literal(line[:-1]) + line[-1:]
        else:   # ended by EOF, which the read dropped
            typed += literal(line) + bytes([cc[termios.VEOF]])
    off = bytearray(settings)
    struct.pack_into("I", off, 12, _lflag(settings) & ~termios.ICANON)
    fcntl.ioctl(slave, TCSETS2, bytes(off))
    try:
        typed += literal(_drain(slave))
    finally:
        fcntl.ioctl(slave, TCSETS2, settings)
    return typed, seen


def _lflag(t: bytes) -> int:
    return struct.unpack_from("I", t, 12)[0]


def _pending(fd: int) -> int:
    """Bytes its reader would get now. poll() first runs the pty's buffer work into the
    line discipline (n_tty_poll, when nothing is available yet), so that what was written
    just before the freeze counts."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    p.poll(0)
    return _int(fd, termios.FIONREAD)


def _writable(fd: int) -> bool:
    """Room to write (pty_write_room: none while the other side is stopped by ^S)."""
    p = select.poll()
    p.register(fd, select.POLLOUT)
    return bool(p.poll(0))


def _drain(fd: int) -> bytes:
    data = b""
    while n := _pending(fd):
        data += os.read(fd, n)
    return data


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            return False
    return True


def _settled(fd: int, want: int) -> bool:
    """Whether the bytes written reach the line discipline at fd (the pty's buffer work
    runs asynchronously) within ~0.2 s, exactly `want` of them. In canonical mode FIONREAD
    shows a line as soon as its newline is in, and the poll() of _pending runs the buffer
    work only while nothing shows: the rest of the chunk (a line being typed after it) is
    given 1 ms more, which the work needs a few microseconds of."""
    for _ in range(200):
        got = _pending(fd)
        if got >= want:
            time.sleep(0.001)
            return got == want == _pending(fd)
        time.sleep(0.001)
    return False


def _with(slave: int, settings: bytes, temporary: bytes, write: Callable[[], bool],
          reader: int, want: int) -> bool:
    """Write under temporary settings of the slave, wait for the bytes to be in, put the
    settings back (no ICANON or EXTPROC change: the line discipline keeps its buffer)."""
    fcntl.ioctl(slave, TCSETS2, temporary)
    try:
        return write() and _settled(reader, want)
    finally:
        fcntl.ioctl(slave, TCSETS2, settings)


def _give_output(slave: int, master: int, settings: bytes, data: bytes) -> bool:
    """Output written again by the slave, unprocessed (OPOST off: it was processed when it
    was first written), lands in the master's reader's queue as it was."""
    o = bytearray(settings)
    struct.pack_into("I", o, 4, struct.unpack_from("I", o, 4)[0] & ~termios.OPOST)
    return _with(slave, settings, bytes(o), lambda: _write_all(slave, data), master,
                 len(data))


def _give_input(master: int, slave: int, settings: bytes, data: bytes, seen: int) -> bool:
    """Input typed again at the master, unprocessed (no translation, signal characters,
    echo: done when it was first typed; in canonical mode only line editing, which
    _take_lines escaped), lands in the program's queue as it was; `seen`: what FIONREAD
    then counts."""
    i = bytearray(settings)
    struct.pack_into("I", i, 0, struct.unpack_from("I", i, 0)[0] & _FLOW)
    lflag = _lflag(settings)
    struct.pack_into("I", i, 12, lflag & ~(_ECHOING if not lflag & termios.ICANON
                                           else _ECHOING & ~termios.IEXTEN))
    return _with(slave, settings, bytes(i), lambda: _write_all(master, data), slave, seen)


def _controlling(records: list[ProcessRecord], ptys: dict[int, Pty]) -> list[Refusal]:
    """Note each pty's session (its leader, the leader's fd of it, its other processes,
    its foreground group); refuse controlling terminals that cannot be given back (see
    the module's doc)."""
    by_pid = {r.pid: r for r in records}
    out = []
    for rec in records:
        if not rec.tty_nr:
            continue
        major, minor = os.major(rec.tty_nr), os.minor(rec.tty_nr)
        if major not in PTS_MAJORS:
            out.append(Refusal(rec.nspid, rec.cmd, (
                f"its controlling terminal is the device {major}:{minor}, not a "
                "pseudo-terminal of the sandbox: not captured")))
            continue
        index = _slave_index(major, minor)
        pty = ptys.get(index)
        why = None
        if pty is None:
            why = "whose master no process of the sandbox holds"
        elif rec.pid != rec.sid:
            if rec.sid not in by_pid:
                why = "whose session's leader is not a process of the sandbox"
            # else its leader's session check covers it
        else:
            why = _session(rec, records, by_pid, pty)
        if why:
            out.append(Refusal(rec.nspid, rec.cmd, (
                f"its controlling terminal /dev/pts/{index}, {why}: not captured")))
    return out


def _session(leader: ProcessRecord, records: list[ProcessRecord],
             by_pid: dict[int, ProcessRecord], pty: Pty) -> str | None:
    """Note the terminal's session in `pty`, or say why it cannot come back. The leader
    leads its session again at a restore (engine.lone_leaders) and takes the terminal
    back; no call joins an existing session, so every other process of the session is
    born in it from a restored parent of the session (adoption.py: each is a child of
    one, copied in from its template), after the leader took its terminal (which they
    inherit)."""
    fds = [fd for e in pty.descriptions if not e.master
           for pid, fd in e.holders if pid == leader.pid]
    if not fds:
        return "of which it holds no descriptor"
    members = [r for r in records if r.sid == leader.sid and r.pid != leader.pid]
    for m in members:
        parent = by_pid.get(m.ppid)
        if parent is None or parent.sid != leader.sid:
            return (f"whose session's process {m.nspid} ({m.cmd}) is not the child of a "
                    "process of the session (so it could not be born in the restored "
                    "session)")
        if m.shared:
            return (f"whose session's process {m.nspid} ({m.cmd}) maps memory shared with "
                    "another process (so it could not be born in the restored session)")
    foreground = 0
    if leader.tpgid != leader.pgid:
        group = by_pid.get(leader.tpgid)
        if group is None or group.sid != leader.sid:
            return (f"whose foreground process group ({leader.tpgid} as the host sees it) "
                    "has no leader in its session")
        foreground = group.nspid
    pty.leader, pty.leader_fd = leader.pid, min(fds)
    pty.members = [m.pid for m in members]
    pty.foreground = foreground
    return None


def _dev_tty(records: list[ProcessRecord], captured: set[int]) -> list[Refusal]:
    """/dev/tty held open (less, vim, a password prompt): reopened by a restored process
    once it has its terminal back (fork_template.c), so it must be its controlling
    terminal's, a pty of the checkpoint."""
    out = []
    for rec in records:
        for f in rec.fds:
            if f.kind != "chr" or f.rdev != DEV_TTY:
                continue
            try:
                ours = native.copy_fd(rec.pid, f.fd)
            except OSError:
                continue   # gone with its process: the capture's others notice
            try:
                dev = _int(ours, TIOCGDEV) & 0xFFFFFFFF
            except OSError:
                dev = 0   # hung up: no terminal behind it any more
            finally:
                os.close(ours)
            if not rec.tty_nr or dev != rec.tty_nr or \
                    _slave_index(os.major(dev), os.minor(dev)) not in captured:
                out.append(Refusal(rec.nspid, rec.cmd, (
                    f"fd {f.fd}: /dev/tty opened for a terminal that is not its controlling "
                    "pseudo-terminal of the sandbox now: not captured")))
    return out


def holds_dev_tty(rec: ProcessRecord) -> bool:
    """Whether it holds /dev/tty open (reopened after its terminal is back)."""
    return any(f.kind == "chr" and f.rdev == DEV_TTY for f in rec.fds)


def terminal_sessions(records: list[ProcessRecord]) -> set[int]:
    """The sessions (ids, host pids) whose leader has a pty as its controlling terminal."""
    return {r.sid for r in records if r.pid == r.sid and r.tty_nr
            and os.major(r.tty_nr) in PTS_MAJORS}


def make(pty: Pty, mntns_fd: int) -> list[int]:
    """Our descriptors of pty's descriptions made again in the devpts of the mount
    namespace `mntns_fd` (a new pair at the same index), in pty.descriptions' order."""
    master = _open_index(mntns_fd, pty.index)
    out: list[int] = []
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        peer = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK
                           | os.O_CLOEXEC)
        try:
            # The bytes that waited, each way, as the capture gave them back to the live
            # pty.
            if pty.input and not _give_input(master, peer, pty.termios, pty.input,
                                             pty.input_seen) or \
                    pty.output and not _give_output(peer, master, pty.termios, pty.output):
                raise OSError(errno.EIO, "its waiting bytes could not be put back")
            fcntl.ioctl(peer, TCSETS2, pty.termios)
            fcntl.ioctl(master, termios.TIOCSWINSZ, pty.winsize)
            if pty.packet:
                fcntl.ioctl(master, TIOCPKT, struct.pack("i", 1))
            for d in pty.descriptions:
                if d.master:
                    fd = os.dup(master)
                    fcntl.fcntl(fd, fcntl.F_SETFL, d.flags & os.O_NONBLOCK)
                else:
                    # Not O_CLOEXEC: TIOCGPTPEER keeps it in the description's flags, where
                    # /proc/PID/fdinfo shows it for every descriptor of it (_sticky), so
                    # the next checkpoint would take them all for close-on-exec ones.
                    fd = fcntl.ioctl(master, TIOCGPTPEER, d.flags | os.O_NOCTTY)
                os.set_inheritable(fd, False)
                out.append(fd)
            if pty.exclusive:
                fcntl.ioctl(peer, termios.TIOCEXCL)
        finally:
            os.close(peer)
    except BaseException:
        for fd in out:
            os.close(fd)
        raise
    finally:
        os.close(master)
    return out


def new_pair(mntns_fd: int, rows: int, cols: int) -> tuple[int, int]:
    """A new pty in the devpts of the mount namespace `mntns_fd`, for a session of the
    daemon: (its master, the slave to give its shell). The slave is opened without
    O_CLOEXEC, which TIOCGPTPEER would keep in its description (_sticky)."""
    master = native.mntns_open(mntns_fd, PTMX_PATH, os.O_RDWR | os.O_NOCTTY)
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        return master, fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY)
    except BaseException:
        os.close(master)
        raise


def owned_master(terminals: list[Pty], made: list[list[int]], owner: str) -> int | None:
    """Of the ptys a restore made (`made`: their descriptions, ptys.make), the descriptor
    of the master `owner` held at the checkpoint (a session of the daemon), if any."""
    for p, fds in zip(terminals, made):
        for d, fd in zip(p.descriptions, fds):
            if d.owner == owner:
                return fd
    return None


def _open_index(mntns_fd: int, index: int) -> int:
    """A new pty's master at `index` in that namespace's devpts: each open takes the
    lowest free index, so those below it (free in a fresh devpts, or taken by the ptys
    made before) are opened and dropped."""
    skipped: list[int] = []
    try:
        for _ in range(MAX_SKIPS + 1):
            fd = native.mntns_open(mntns_fd, PTMX_PATH, os.O_RDWR | os.O_NOCTTY)
            got = _int(fd, TIOCGPTN)
            if got == index:
                return fd
            skipped.append(fd)
            if got > index:
                break
        raise OSError(errno.EEXIST, f"/dev/pts/{index} is taken in the restored devpts")
    finally:
        for fd in skipped:
            os.close(fd)


def holders_of(ptys: list[Pty], pid: int) -> dict[int, tuple[int, int]]:
    """pid's descriptors of ptys: fd -> (index in `ptys`, index of its description)."""
    return {fd: (i, j) for i, p in enumerate(ptys) for j, d in enumerate(p.descriptions)
            for h, fd in d.holders if h == pid}


def controlling_fd(ptys: list[Pty], pid: int) -> int:
    """The fd by which pid's process takes its controlling terminal back, or -1."""
    return next((p.leader_fd for p in ptys if p.leader == pid), -1)
