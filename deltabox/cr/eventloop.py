"""The descriptors of an event loop: epoll instances, eventfds, timerfds, signalfds,
inotify instances (cr/watches.py) and unix socket pairs.

An asyncio program (uvicorn, aiohttp, any `asyncio.run`) holds an epoll instance and a
socket pair (its self-pipe); libuv and others add eventfds; C event loops (systemd's
sd-event, libevent's timerfd backend) timerfds and signalfds. A template is a fork of the
process, so it shares these objects with the live process, which goes on changing them
(registrations, counters, queued bytes): what a restore needs is read here, from the live
process while the checkpoint holds it stopped, and each restored process gets objects of
its own, made afresh with that state (engine._PipePlan.loop_fds; epoll instances inside
the child, once its other descriptors are in place: native/fork_template.c: recreate_epoll).

Captured: an epoll instance (its watches: fd, events, data) whose every watched descriptor
is one the process holds and the restore recreates; an inotify instance (cr/watches.py);
an eventfd (counter, semaphore mode);
a timerfd (clock, time left and interval, expirations not yet read, absolute and
cancel-on-set flags: armed again when the restored processes are let run, so the time
left runs from the restore, as for a stopped process); a signalfd (its signal mask; it
reads the signals of whichever process reads it, as the original did); an unnamed
connected unix socket pair (queued bytes of a stream pair, buffer sizes); an unnamed unix
socket with no other end (LoneSocket: its peer closed, as every JVM's NIO holds one, with
its waiting bytes and pending error; or never connected). An eventfd, a
timerfd, a signalfd, an inotify instance or a pair may be shared by several processes (a parent and the worker
it forked, a `multiprocessing.Pipe`): the restore makes one object for all of them. Each
non-blocking
flag and close-on-exec flag as it was. A unix socket listening on a name comes back bound
to it, and the connections it accepted as pairs (unix_listeners.py). Refused, with the
reason: an epoll instance shared with another process, or watching another epoll instance
or a descriptor the process no longer holds; a unix socket bound to a name (other than a
listener and the connections it accepted) or connected to a socket no process of the
sandbox holds (or to a listener that has not accepted it yet); descriptors in flight
(SCM_RIGHTS), a shut-down end, datagrams waiting in a datagram pair.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import os
import select
import socket
import struct
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .. import kernfs
from . import native, sockdiag, sockopts, tcp, unix_listeners, watches
from .capture import ProcessRecord, Refusal, is_loop_fd

T = TypeVar("T", "LoneSocket", unix_listeners.UnixListener)
MAX_QUEUED = 4 << 20                      # bytes waiting in a socket we copy, at most


@dataclass
class EventFd:
    """An eventfd as one process holds it (at `fds`: dups share it); `key` names it
    across the processes that share it (a restore makes one for all of them)."""
    key: str
    fds: list[int]
    count: int
    semaphore: bool
    nonblock: bool


@dataclass
class TimerFd:
    """A timerfd as one process holds it (`key`: as for EventFd). Times in nanoseconds:
    `value` left until the next expiration (0: disarmed), `interval` between them."""
    key: str
    fds: list[int]
    clockid: int
    ticks: int                            # expirations not read yet
    value: int
    interval: int
    abstime: bool                         # armed with TFD_TIMER_ABSTIME
    cancel_on_set: bool
    nonblock: bool


@dataclass
class SignalFd:
    """A signalfd as one process holds it (`key`: as for EventFd)."""
    key: str
    fds: list[int]
    mask: int                             # bit signo - 1
    nonblock: bool


@dataclass
class SocketPair:
    """A connected unix socket pair as one process holds it: `a` and `b` its fds on each
    end (either may be empty: the other end is another process's); `key` names the pair
    across processes; `data_a` the bytes waiting to be read at a (sent by b)."""
    key: str
    type: int                             # socket.SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET
    a: list[int]
    b: list[int]
    nonblock_a: bool = False
    nonblock_b: bool = False
    data_a: bytes = b""
    data_b: bytes = b""
    bufs_a: tuple[int, int] = (0, 0)      # SO_SNDBUF, SO_RCVBUF as getsockopt reports
    bufs_b: tuple[int, int] = (0, 0)
    opts_a: tuple[sockopts.Option, ...] = ()   # its other options (sockopts.UNIX)
    opts_b: tuple[sockopts.Option, ...] = ()
    # each end's shutdown bits as sock_diag reports them (RCV_SHUTDOWN 1, SEND_SHUTDOWN
    # 2; a stream or seqpacket end's shutdown sets its peer's other bit too)
    shut_a: int = 0
    shut_b: int = 0
    # an end's abstract name, the bytes after its NUL in hex ("": none): given by bind, or
    # by the kernel to an end passing credentials at its first send (an "autobind": five
    # hex digits); bound again once the killed original has let it go (engine.py)
    name_a: str = ""
    name_b: str = ""


@dataclass
class LoneSocket:
    """A unix socket with no other end in the sandbox: one whose peer was closed
    (`widowed`: a read returns the bytes `data` still waiting, then the pending error if
    `reset`, then end of file; a write fails with EPIPE) or one never connected. Every
    JVM holds one (its NIO "pre-close" descriptor: one end of a socket pair whose other
    end it closed at start). `key` names it across the processes that share it.

    A datagram socket may have a name (a log or metrics server bound to a path or an
    abstract name, whose clients send to it), bound again (`name`, `abstract`: as
    unix_listeners.diag_name gives them; `owner`: its socket file's mode, uid, gid), and
    may be connected one way to such a named socket the sandbox holds (a client: `to_key`
    that socket's key, `to` and `to_abstract` its name), connected again once that one is
    bound. Since stop 69; before, every named one was refused."""
    key: str
    type: int
    widowed: bool
    fds: list[int] = field(default_factory=list)
    nonblock: bool = False
    data: bytes = b""
    reset: bool = False                   # the peer left unread bytes: ECONNRESET pending
    bufs: tuple[int, int] = (0, 0)
    opts: tuple[sockopts.Option, ...] = ()
    name: str = ""
    abstract: bool = False
    owner: tuple[int, int, int] = (0, 0, 0)
    to_key: str = ""
    to: str = ""
    to_abstract: bool = False


@dataclass
class LoopState:
    """What a process's event-loop descriptors need at a restore."""
    epolls: list[native.Epoll] = field(default_factory=list)
    eventfds: list[EventFd] = field(default_factory=list)
    pairs: list[SocketPair] = field(default_factory=list)
    lone: list[LoneSocket] = field(default_factory=list)
    timerfds: list[TimerFd] = field(default_factory=list)
    signalfds: list[SignalFd] = field(default_factory=list)
    inotifies: list[watches.Inotify] = field(default_factory=list)
    tcp: list[tcp.TcpConn] = field(default_factory=list)
    unix_listeners: list[unix_listeners.UnixListener] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.epolls or self.eventfds or self.pairs or self.lone or self.timerfds or
                    self.signalfds or self.inotifies or self.tcp or self.unix_listeners)


def capture(records: list[ProcessRecord], layers: Sequence[str] = (),
            paths: watches.Paths | None = None) -> list[Refusal]:
    """Fill `rec.loop` for every record holding event-loop descriptors, or say why one
    cannot be restored. Call with every process of the sandbox stopped. `layers`: the
    directories of the sandbox's overlay layers, upper first (an inotify watch's file is
    found through them, or among `paths` found before: cr/watches.py)."""
    out: list[Refusal] = []
    todo = [r for r in records if any(is_loop_fd(f) for f in r.fds)]
    if not todo:
        return out
    shared = _shared_elsewhere(records)
    socks = [(r, f) for r in todo for f in r.fds
             if f.kind == "socket" and is_loop_fd(f) and not tcp.is_connection(f)]
    pairs = _Pairs(socks, unix_sockets(todo[0].pid) if socks else {})
    conns = _Connections(todo)
    evs = _EventFds(todo)
    with watches.Layers(layers if _any_kind(todo, "inotify") else (), paths) as opened:
        anons = _Anonymous(todo, opened)
    for rec in todo:  # read: the records kept with the checkpoint need not hold it
        rec.fds = [dataclasses.replace(f, fdinfo=b"") if f.fdinfo else f for f in rec.fds]
    out.extend(anons.unread())
    if out:  # transient (the daemon lets them be read, then retries): say nothing else
        return out
    for rec in todo:
        reasons: list[str] = []
        loop = LoopState()
        evs.add(rec, loop, reasons)
        anons.add(rec, loop, reasons)
        pairs.add(rec, loop, reasons)
        conns.add(rec, loop, reasons)
        _epolls(rec, shared, loop, reasons)
        out.extend(Refusal(rec.nspid, rec.cmd, r, unread=getattr(r, "queue", None))
                   for r in reasons)
        if not reasons:
            rec.loop = loop
    return out


def _any_kind(records: list[ProcessRecord], kind: str) -> bool:
    return any(f.kind == kind for r in records for f in r.fds)


# ---- sharing between processes ------------------------------------------------------------

def _shared_elsewhere(records: list[ProcessRecord]) -> dict[tuple[int, int], int]:
    """(pid, fd) of an epoll instance -> pid of another process holding the same open
    file description (kcmp)."""
    out: dict[tuple[int, int], int] = {}
    held = [(r.pid, f) for r in records for f in r.fds if f.kind == "epoll"]
    for pid, f in held:
        for pid2, f2 in held:
            if pid2 != pid and f2.kind == f.kind and native.same_file(pid, f.fd, pid2, f2.fd):
                out[(pid, f.fd)] = pid2
                break
    return out


def _fdinfo(pid: int, fd: int) -> bytes:
    return kernfs.read(f"/proc/{pid}/fdinfo/{fd}")


def _field(info: bytes, name: bytes) -> bytes | None:
    for line in info.splitlines():
        key, _, value = line.partition(b":")
        if key == name:
            return value.strip()
    return None


# ---- eventfd -------------------------------------------------------------------------------

_Object = EventFd | TimerFd | SignalFd | watches.Inotify


class _Descriptions:
    """Descriptors of some kinds, each open file description's state read once (from its
    first holder) under a key that names it across the processes sharing it; add() gives
    a process its own copy of each, holding its fds."""

    kinds: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.key: dict[tuple[int, int], str] = {}        # (pid, fd) -> key
        self.state: dict[str, _Object | str] = {}  # or why not

    def add(self, rec: ProcessRecord, loop: LoopState, reasons: list[str]) -> None:
        mine: dict[str, _Object] = {}
        for f in rec.fds:
            if f.kind not in self.kinds:
                continue
            key = self.key[(rec.pid, f.fd)]
            st = self.state[key]
            if isinstance(st, str):
                reasons.append(f"fd {f.fd}: {st}")
                continue
            if key not in mine:
                obj = mine[key] = dataclasses.replace(st, fds=[])
                if isinstance(obj, EventFd):
                    loop.eventfds.append(obj)
                elif isinstance(obj, TimerFd):
                    loop.timerfds.append(obj)
                elif isinstance(obj, SignalFd):
                    loop.signalfds.append(obj)
                else:
                    loop.inotifies.append(obj)
            mine[key].fds.append(f.fd)


class _EventFds(_Descriptions):
    """The sandbox's eventfds by their kernel id (`eventfd-id` in fdinfo)."""

    kinds = ("eventfd",)

    def __init__(self, records: list[ProcessRecord]) -> None:
        super().__init__()
        for rec in records:
            for f in rec.fds:
                if f.kind == "eventfd":
                    self._read(rec.pid, f)

    def _read(self, pid: int, f: native.FdInfo) -> None:
        info = _fdinfo(pid, f.fd)
        count, ident = _field(info, b"eventfd-count"), _field(info, b"eventfd-id")
        if count is None or ident is None:
            self.key[(pid, f.fd)] = "eventfd:?"
            self.state["eventfd:?"] = ("an eventfd without a counter in /proc fdinfo "
                                       "(kernel too old)")
            return
        key = self.key[(pid, f.fd)] = f"eventfd:{int(ident)}"
        sem = _field(info, b"eventfd-semaphore")
        self.state.setdefault(key, EventFd(key, [], int(count, 16), sem == b"1",
                                           bool(f.flags & os.O_NONBLOCK)))


# ---- timerfd, signalfd and inotify ------------------------------------------------------------------

TFD_TIMER_ABSTIME, TFD_TIMER_CANCEL_ON_SET = 1, 2
TFD_IOC_SET_TICKS = 0x40085400            # _IOW('T', 0, u64): CONFIG_CHECKPOINT_RESTORE
_CLOCKS = {0, 1, 7, 8, 9}                 # REALTIME MONOTONIC BOOTTIME and the two ALARMs


class _Anonymous(_Descriptions):
    """The sandbox's timerfds, signalfds and inotify instances: fdinfo names no object,
    so holders are matched with kcmp against each description's first holder."""

    kinds = ("timerfd", "signalfd", "inotify")

    def __init__(self, records: list[ProcessRecord], layers: watches.Layers) -> None:
        super().__init__()
        self.layers = layers
        self.firsts: list[tuple[int, native.FdInfo, str]] = []   # (pid, fd, key)
        self.cmds = {r.pid: (r.nspid, r.cmd) for r in records}
        for rec in records:
            for f in rec.fds:
                if f.kind in self.kinds:
                    self.key[(rec.pid, f.fd)] = self._key(rec.pid, f)

    def unread(self) -> list[Refusal]:
        """inotify instances with events not read yet: a copy would take them from the
        live process (the Refusal names the queue: the caller may let it be read)."""
        out = []
        for pid, f, _key in self.firsts:
            if f.kind != "inotify":
                continue
            try:
                n = watches.unread(pid, f.fd)
            except OSError:
                continue  # gone: the capture fails on the process itself
            if n:
                out.append(Refusal(*self.cmds[pid], f"fd {f.fd}: inotify instance has {n} "
                                   "bytes of events it has not read yet", unread=(pid, f.fd)))
        return out

    def _key(self, pid: int, f: native.FdInfo) -> str:
        for pid0, f0, key in self.firsts:
            if f0.kind == f.kind and native.same_file(pid, f.fd, pid0, f0.fd):
                return key
        key = f"{f.kind}:{pid}:{f.fd}"
        self.firsts.append((pid, f, key))
        try:
            info = f.fdinfo or _fdinfo(pid, f.fd)
            self.state[key] = (_timerfd(key, info, f) if f.kind == "timerfd" else
                               _signalfd(key, info, f) if f.kind == "signalfd" else
                               watches.read(key, pid, info, f, self.layers))
        except (OSError, ValueError) as e:
            self.state[key] = f"reading its /proc fdinfo: {e}"
        if isinstance(self.state[key], str) and f.kind != "inotify":
            self.state[key] = f"{f.kind}: {self.state[key]}"
        return key


def _pair_ns(raw: bytes | None) -> int:
    """fdinfo's "(sec, nsec)" in nanoseconds."""
    if raw is None:
        raise ValueError("a time is missing")
    sec, nsec = raw.strip(b"()").split(b",")
    return int(sec) * 1_000_000_000 + int(nsec)


def _timerfd(key: str, info: bytes, f: native.FdInfo) -> TimerFd | str:
    clock, ticks, flags = (_field(info, b"clockid"), _field(info, b"ticks"),
                           _field(info, b"settime flags"))
    if clock is None or ticks is None or flags is None:
        return "no clock, ticks or flags in /proc fdinfo"
    if int(clock) not in _CLOCKS:
        return f"clock {int(clock)} is not captured"
    fl = int(flags, 8)
    return TimerFd(key, [], int(clock), int(ticks), _pair_ns(_field(info, b"it_value")),
                   _pair_ns(_field(info, b"it_interval")), bool(fl & TFD_TIMER_ABSTIME),
                   bool(fl & TFD_TIMER_CANCEL_ON_SET), bool(f.flags & os.O_NONBLOCK))


def _signalfd(key: str, info: bytes, f: native.FdInfo) -> SignalFd | str:
    mask = _field(info, b"sigmask")
    if mask is None:
        return "no signal mask in /proc fdinfo"
    return SignalFd(key, [], int(mask, 16), bool(f.flags & os.O_NONBLOCK))


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval_sec", ctypes.c_long), ("interval_nsec", ctypes.c_long),
                ("value_sec", ctypes.c_long), ("value_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)


def _check(r: int, what: str) -> int:
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return r


def new_timerfd(t: TimerFd) -> int:
    """A timerfd like t, not armed yet (arm_timerfd): ours, close-on-exec."""
    return _check(_libc.timerfd_create(t.clockid, os.O_CLOEXEC |
                                       (os.O_NONBLOCK if t.nonblock else 0)),
                  f"timerfd_create(clock {t.clockid})")


def arm_timerfd(fd: int, t: TimerFd) -> None:
    """Arm fd with t's time left and interval (from now), then give it t's unread
    expirations (setting the time clears them). A periodic timer that expired and was
    not read since shows no time left (the kernel moves it on only when it is read):
    its next expiration is taken to be one interval away."""
    value = t.value or t.interval
    if value:
        flags = 0
        if t.abstime:
            value += time.clock_gettime_ns(t.clockid)
            flags = TFD_TIMER_ABSTIME | (TFD_TIMER_CANCEL_ON_SET if t.cancel_on_set else 0)
        spec = _ITimerSpec(t.interval // 10**9, t.interval % 10**9, value // 10**9,
                           value % 10**9)
        _check(_libc.timerfd_settime(fd, flags, ctypes.byref(spec), None), "timerfd_settime")
    if t.ticks:
        fcntl.ioctl(fd, TFD_IOC_SET_TICKS, struct.pack("=Q", t.ticks))


def watches_signalfd(loop: LoopState | None) -> bool:
    """Whether an epoll instance of the loop watches a signalfd: epoll waits for it on
    the signal wait queue of the task that registered the watch, so the restored process
    itself must register it (engine: no carrier)."""
    if not loop or not loop.signalfds:
        return False
    sig = {fd for x in loop.signalfds for fd in x.fds}
    return any(w.fd in sig for e in loop.epolls for w in e.watches)


def new_signalfd(s: SignalFd) -> int:
    """A signalfd like s: ours, close-on-exec."""
    mask = (ctypes.c_uint64 * 16)(s.mask)   # a sigset_t
    return _check(_libc.signalfd(-1, mask, os.O_CLOEXEC | (os.O_NONBLOCK if s.nonblock else 0)),
                  "signalfd")


# ---- unix socket pairs ---------------------------------------------------------------------

@dataclass(frozen=True)
class _UnixDiag:
    type: int
    state: int
    peer: int
    name: str
    rqueue: int          # a listener's: connections waiting to be accepted
    shutdown: int
    raw_name: bytes = b""
    wqueue: int = 0      # a listener's: its backlog


UDIAG_SHOW_NAME, UDIAG_SHOW_PEER, UDIAG_SHOW_RQLEN = 0x1, 0x4, 0x10
UNIX_DIAG_NAME, UNIX_DIAG_PEER, UNIX_DIAG_RQLEN, UNIX_DIAG_SHUTDOWN = 0, 2, 4, 6
TCP_ESTABLISHED = 1
_UNIX_REQ = struct.Struct("=BBHIIIII")       # family protocol pad states ino show cookie[2]
_UNIX_MSG = struct.Struct("=BBBBIII")        # family type state pad ino cookie[2]
_RTA = struct.Struct("=HH")


def unix_sockets(pid: int) -> dict[int, _UnixDiag]:
    """Every unix socket of pid's network namespace by inode (sock_diag: the only place
    the kernel tells a socket's peer)."""
    with sockdiag.open_in(pid) as s:
        req = _UNIX_REQ.pack(socket.AF_UNIX, 0, 0, 0xffffffff, 0,
                             UDIAG_SHOW_NAME | UDIAG_SHOW_PEER | UDIAG_SHOW_RQLEN,
                             0xffffffff, 0xffffffff)
        sockdiag.send(s, sockdiag.SOCK_DIAG_BY_FAMILY, sockdiag.NLM_F_DUMP, req)
        out: dict[int, _UnixDiag] = {}
        for msg in sockdiag.replies(s, "unix sockets"):
            _parse_unix(msg, out)
        return out


def _parse_unix(msg: bytes, out: dict[int, _UnixDiag]) -> None:
    _fam, typ, state, _pad, ino, _c0, _c1 = _UNIX_MSG.unpack_from(msg)
    peer, name, rqueue, shutdown, raw, wqueue = 0, "", 0, 0, b"", 0
    at = _UNIX_MSG.size
    while at + _RTA.size <= len(msg):
        alen, atype = _RTA.unpack_from(msg, at)
        if alen < _RTA.size:
            break
        data = msg[at + _RTA.size:at + alen]
        if atype == UNIX_DIAG_PEER:
            peer = struct.unpack_from("=I", data)[0]
        elif atype == UNIX_DIAG_NAME:
            raw = bytes(data)
            # As a message shows it: a path without the NUL the kernel keeps after it
            # ('/workspace/log.sock\x00' before), an abstract name after an "@".
            name = ("@" + raw[1:].decode(errors="backslashreplace") if raw[:1] == b"\0"
                    else raw.rstrip(b"\0").decode(errors="replace")) or "?"
        elif atype == UNIX_DIAG_RQLEN:
            rqueue, wqueue = struct.unpack_from("=II", data)
        elif atype == UNIX_DIAG_SHUTDOWN:
            shutdown = data[0]
        at += (alen + 3) & ~3
    out[ino] = _UnixDiag(typ, state, peer, name, rqueue, shutdown, raw, wqueue)


@dataclass
class _PairState:
    type: int
    nonblock: tuple[bool, bool]
    data: tuple[bytes, bytes]
    bufs: tuple[tuple[int, int], tuple[int, int]]
    opts: tuple[tuple[sockopts.Option, ...], tuple[sockopts.Option, ...]]
    shut: tuple[int, int]
    names: tuple[str, str]


class _Pairs:
    """The sandbox's unix socket pairs: each read once (from one holder of each end)."""

    def __init__(self, socks: list[tuple[ProcessRecord, native.FdInfo]],
                 diag: dict[int, _UnixDiag]) -> None:
        self.diag = diag
        self.holders: dict[int, list[tuple[ProcessRecord, native.FdInfo]]] = defaultdict(list)
        for rec, f in socks:
            self.holders[f.inode].append((rec, f))
        self.state: dict[int, _PairState | str] = {}    # lower inode of the pair -> ...
        # Named listeners the sandbox holds (made again: unix_listeners.py), by inode, and
        # their names: the connections they accepted show their name, and come back.
        self.listeners: dict[int, unix_listeners.UnixListener | str] = {}
        self.lones: dict[int, LoneSocket | str] = {}       # inode -> ...
        self.listening = {d.raw_name for ino, d in diag.items()
                          if d.state == unix_listeners.TCP_LISTEN and d.raw_name
                          and ino in self.holders}
        # Listeners with connections waiting to be accepted: (host pid, fd) of a holder.
        self.pending = [(hs[0][0].pid, hs[0][1].fd) for ino, hs in self.holders.items()
                        if (d := diag.get(ino)) is not None
                        and d.state == unix_listeners.TCP_LISTEN and d.rqueue]

    def _pair(self, ino: int) -> tuple[int, _PairState | str]:
        """The pair's key (its lower inode) and its state, or why it is refused."""
        d = self.diag.get(ino)
        key = min(ino, d.peer) if d is not None and d.peer else ino
        if key not in self.state:
            self.state[key] = self._read(ino, d)
        return key, self.state[key]

    def _read(self, ino: int, d: _UnixDiag | None) -> _PairState | str:
        why = _pair_refusal(ino, self.diag, self.holders, self.listening)
        if why:
            return why
        assert d is not None
        a, b = sorted((ino, d.peer))
        ends = []
        try:
            for end in (a, b):
                rec, f = self.holders[end][0]
                ends.append(_queued(rec.pid, f.fd, self.diag[end]))
        except (OSError, native.CRError) as e:
            return f"reading the socket pair: {e}"
        for data, _bufs, _nonblock, opts in ends:
            why = _credentials_lost(data, opts)
            if why:
                return why
        return _PairState(d.type, (ends[0][2], ends[1][2]), (ends[0][0], ends[1][0]),
                          (ends[0][1], ends[1][1]), (ends[0][3], ends[1][3]),
                          (self.diag[a].shutdown, self.diag[b].shutdown),
                          (_own_name(self.diag[a], self.listening),
                           _own_name(self.diag[b], self.listening)))

    def _listener(self, rec: ProcessRecord, f: native.FdInfo
                  ) -> unix_listeners.UnixListener | str:
        """The named listener at f, read once whoever holds it."""
        if f.inode not in self.listeners:
            d = self.diag[f.inode]
            u = unix_listeners.capture(rec.pid, f.inode, d.type, d.raw_name, d.rqueue,
                                       d.wqueue, bool(f.flags & os.O_NONBLOCK))
            if isinstance(u, str) and d.rqueue and d.type != socket.SOCK_DGRAM:
                u = Passing(u, (rec.pid, f.fd))  # its server accepts them (type: checked)
            self.listeners[f.inode] = u
        return self.listeners[f.inode]

    def _one_way(self, ino: int, d: _UnixDiag) -> bool:
        """Whether the socket at ino is a datagram socket connected to another that is not
        connected back (a client of a named one)."""
        if d.type != socket.SOCK_DGRAM or d.state != TCP_ESTABLISHED or not d.peer:
            return False
        e = self.diag.get(d.peer)
        return e is None or e.peer != ino

    def _to_refusal(self, d: _UnixDiag) -> str | None:
        """Why a one-way datagram connection's target is not made again, if it is not."""
        e = self.diag.get(d.peer)
        if e is None or d.peer not in self.holders:
            return ("connected to a datagram socket no process of the sandbox holds: not "
                    "captured")
        if e.peer or not e.raw_name:
            return ("connected to a datagram socket that has no name or is connected "
                    "elsewhere itself: not captured")
        return None

    @staticmethod
    def _named_refusal(rec: ProcessRecord, f: native.FdInfo, d: _UnixDiag) -> str | None:
        """A named datagram socket that shows connected with no peer is a server its
        clients connected to (their connect() marks it so), or one whose own peer was
        closed since, which is not made again: told apart by its peer (getpeername)."""
        if d.state != TCP_ESTABLISHED or d.peer:
            return None
        try:
            with socket.socket(fileno=native.copy_fd(rec.pid, f.fd)) as s:
                s.getpeername()
        except OSError as e:
            return None if e.errno == errno.ENOTCONN else f"reading the socket: {e}"
        return ("the datagram socket it was connected to was closed: a named one whose "
                "peer is gone is not captured")

    def _lone(self, rec: ProcessRecord, f: native.FdInfo, d: _UnixDiag) -> LoneSocket | str:
        """The lone socket at f, read once whoever holds it."""
        if f.inode not in self.lones:
            one_way = self._one_way(f.inode, d)
            why = (_lone_refusal(d, self.listening, one_way) or
                   (self._to_refusal(d) if one_way else None) or
                   _in_flight(self.holders[f.inode]))
            if why == NOT_ACCEPTED and self.pending:   # likely: passes once accepted
                why = Passing(why, self.pending[0])
            if not why and d.type == socket.SOCK_DGRAM and d.raw_name:
                why = self._named_refusal(rec, f, d)
            if not why and d.type == socket.SOCK_DGRAM and d.rqueue:
                # (a named one's: its senders' datagrams, which it reads as they come)
                why = Passing("datagrams waiting to be read are not captured",
                              (rec.pid, f.fd))
            if why:
                self.lones[f.inode] = why
            else:
                try:
                    lone = _read_lone(rec.pid, f.fd, f.inode, d,
                                      self.diag[d.peer] if one_way else None)
                except (OSError, native.CRError) as e:
                    self.lones[f.inode] = f"reading the socket: {e}"
                else:
                    self.lones[f.inode] = _credentials_lost(lone.data, lone.opts) or lone
        return self.lones[f.inode]

    def add(self, rec: ProcessRecord, loop: LoopState, reasons: list[str]) -> None:
        mine: dict[int, SocketPair] = {}
        alone: dict[int, LoneSocket] = {}
        heard: dict[int, unix_listeners.UnixListener] = {}
        for f in rec.fds:
            if f.kind != "socket" or not is_loop_fd(f) or tcp.is_connection(f):
                continue
            d = self.diag.get(f.inode)
            if d is not None and d.state == unix_listeners.TCP_LISTEN and d.raw_name:
                u = self._listener(rec, f)
                if isinstance(u, str):
                    reasons.append(_as(u, f"fd {f.fd}: {u}"))
                else:
                    _held_at(f, u, heard, loop.unix_listeners)
                continue
            if d is not None and (_is_lone(d) or self._one_way(f.inode, d)):
                lone = self._lone(rec, f, d)
                if isinstance(lone, str):
                    reasons.append(_as(lone, f"fd {f.fd}: unix socket {f.describe()}: {lone}"))
                else:
                    _held_at(f, lone, alone, loop.lone)
                continue
            key, st = self._pair(f.inode)
            if isinstance(st, str):
                reasons.append(_as(st, f"fd {f.fd}: unix socket {f.describe()}: {st}"))
                continue
            if key not in mine:
                mine[key] = SocketPair(f"unix:{key}", st.type, [], [], *st.nonblock,
                                       *st.data, *st.bufs, *st.opts, *st.shut,
                                       *st.names)
                loop.pairs.append(mine[key])
            (mine[key].a if f.inode == key else mine[key].b).append(f.fd)


def _held_at(f: native.FdInfo, obj: T, seen: dict[int, T], out: list[T]) -> None:
    """One process's fd f of the socket `obj` describes: added to its copy for this
    process (made at the first of its fds, appended to `out`)."""
    if f.inode in seen:
        seen[f.inode].fds.append(f.fd)
    else:
        seen[f.inode] = dataclasses.replace(obj, fds=[f.fd])
        out.append(seen[f.inode])


def _pair_refusal(ino: int, diag: dict[int, _UnixDiag],
                  holders: dict[int, list[tuple[ProcessRecord, native.FdInfo]]],
                  listening: Collection[bytes] = ()) -> str | None:
    d = diag.get(ino)
    if d is None:
        return "not found by sock_diag"
    if d.type not in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
        return f"socket type {d.type} is not captured"
    if d.state != TCP_ESTABLISHED or not d.peer:
        return "not connected: only socket pairs are captured"
    if d.peer not in holders:
        return ("connected to a socket no process of the sandbox holds: only pairs within "
                "the sandbox are captured")
    for end in (ino, d.peer):
        e = diag.get(end)
        if e is None:
            return "its peer was not found by sock_diag"
        if e.name and e.raw_name not in listening and e.raw_name[:1] != b"\0":
            # (accepted by a listener of ours: its connection, named as it; an abstract
            # name: bound again)
            return (f"bound to the path {e.name!r}: a socket pair's end named in the file "
                    "system is not captured")
        why = _in_flight(holders[end])
        if why:
            return why
        if e.rqueue and d.type != socket.SOCK_STREAM:
            return "datagrams waiting to be read are not captured"
        if e.rqueue > MAX_QUEUED:
            return f"{e.rqueue} bytes waiting (more than {MAX_QUEUED} are not captured)"
    return None


def _own_name(d: _UnixDiag, listening: Collection[bytes]) -> str:
    """A pair end's own abstract name in hex, "" for none or for the name of the listener
    that accepted it (a connection shows its listener's)."""
    if d.raw_name[:1] != b"\0" or d.raw_name in listening:
        return ""
    return d.raw_name[1:].hex()


class Passing(str):
    """A refusal's reason that passes once a process has read what waits in a queue (a
    socket's: descriptors in flight), with the (host pid, fd) of that queue: the capture
    lets the processes run until it is empty and tries again (Refusal.unread)."""
    queue: tuple[int, int]

    def __new__(cls, text: str, queue: tuple[int, int]) -> Passing:
        out = super().__new__(cls, text)
        out.queue = queue
        return out


def _as(why: str, text: str) -> str:
    """text, a Passing one if why is."""
    return Passing(text, why.queue) if isinstance(why, Passing) else text


def _in_flight(holders: list[tuple[ProcessRecord, native.FdInfo]]) -> str | None:
    """Why descriptors waiting in the socket's queue refuse it (a Passing reason: a
    program passing descriptors, Chromium's Mojo, reads them at once), or None."""
    for rec, f in holders:
        if _field(_fdinfo(rec.pid, f.fd), b"scm_fds") not in (None, b"0"):
            return Passing("descriptors in flight (SCM_RIGHTS) are not captured",
                           (rec.pid, f.fd))
    return None


TCP_CLOSE = 7
SHUTDOWN_MASK = 3


def _is_lone(d: _UnixDiag) -> bool:
    """A unix socket with no live peer: connected once, its peer since closed (the kernel
    keeps it "established" with a peer no socket inode names), or never connected."""
    return (d.state == TCP_ESTABLISHED and not d.peer) or d.state == TCP_CLOSE


NOT_ACCEPTED = ("connected to a socket not accepted yet (or shut down): not captured; "
                "checkpoint once the connection is accepted")


def _lone_refusal(d: _UnixDiag, listening: Collection[bytes], one_way: bool = False
                  ) -> str | None:
    if d.type not in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
        return f"socket type {d.type} is not captured"
    if (d.name and d.raw_name not in listening   # else: accepted by a listener of ours
            and d.type != socket.SOCK_DGRAM):
        return (f"bound to {d.name!r}: a named unix socket that is neither listening nor "
                "a datagram socket is not captured")
    if d.state == TCP_CLOSE or one_way:
        return "it was shut down: not captured" if d.shutdown else None
    # Closing a stream or seqpacket socket shuts its peer down both ways (unix_release_sock);
    # a datagram peer's close leaves the survivor as it was.
    if d.type == socket.SOCK_DGRAM and d.shutdown:
        return "its peer was closed and it was shut down: not captured"
    if d.type != socket.SOCK_DGRAM and d.shutdown != SHUTDOWN_MASK:
        # Also the look of a connection its listener has not accepted yet.
        return NOT_ACCEPTED
    if d.rqueue and d.type == socket.SOCK_SEQPACKET:   # (a datagram socket's: _Pairs._lone)
        return "datagrams waiting to be read are not captured"
    if d.rqueue > MAX_QUEUED:
        return f"{d.rqueue} bytes waiting (more than {MAX_QUEUED} are not captured)"
    return None


def _read_lone(pid: int, fd: int, ino: int, d: _UnixDiag, to: _UnixDiag | None = None
               ) -> LoneSocket:
    """The lone socket's state: what _queued reads, and whether an error is pending (a
    stream peer closed with bytes it had not read makes the kernel report ECONNRESET to
    the survivor once its own bytes are read; poll shows it as POLLERR without taking it,
    where SO_ERROR would clear it); its name; `to`: the named datagram socket it is
    connected to (one way)."""
    # (a named datagram socket shown connected with no peer is its clients' server)
    widowed = d.state == TCP_ESTABLISHED and to is None and not (
        d.type == socket.SOCK_DGRAM and d.raw_name)
    with socket.socket(fileno=native.copy_fd(pid, fd)) as s:
        data, bufs, nonblock, opts = _read_end(s, d)
        p = select.poll()
        p.register(s.fileno(), 0)
        reset = widowed and any(ev & select.POLLERR for _, ev in p.poll(0))
    x = LoneSocket(f"unix:{ino}", d.type, widowed, [], nonblock, data, reset, bufs, opts)
    if d.raw_name:
        x.name, x.abstract = unix_listeners.diag_name(d.raw_name)
        if not x.abstract:
            owner = unix_listeners.socket_file(pid, x.name)
            if isinstance(owner, str):
                raise native.CRError(errno.ENOENT, f"bound to {x.name!r}: {owner}")
            x.owner = owner
    if to is not None:
        x.to_key = f"unix:{d.peer}"
        x.to, x.to_abstract = unix_listeners.diag_name(to.raw_name)
    return x


_End = tuple[bytes, tuple[int, int], bool, tuple[sockopts.Option, ...]]


def _queued(pid: int, fd: int, d: _UnixDiag) -> _End:
    """_read_end of another process's socket."""
    with socket.socket(fileno=native.copy_fd(pid, fd)) as s:
        return _read_end(s, d)


def _read_end(s: socket.socket, d: _UnixDiag) -> _End:
    """The bytes waiting to be read at this end (peeked, not consumed), its buffer sizes,
    whether it is non-blocking (a status flag of the one open file description every
    holder of this end shares) and its other options. A peek never moves SO_PEEK_OFF: with
    it set, a MSG_PEEK read starts at the offset and moves it on, so it is read first and
    put back (nothing else reads this socket while its processes are stopped)."""
    bufs = (s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    nonblock = bool(fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)
    opts = sockopts.differing(None, s, sockopts.UNIX)
    if not d.rqueue:
        return b"", bufs, nonblock, opts
    peek_off = s.getsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF)
    if peek_off >= 0:
        s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, -1)
    try:
        data = s.recv(d.rqueue, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    finally:
        if peek_off >= 0:
            s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, peek_off)
    if len(data) != d.rqueue:
        raise OSError(0, f"peeked {len(data)} of the {d.rqueue} bytes waiting")
    return data, bufs, nonblock, opts


_SO_PEEK_OFF = 42


def _credentials_lost(data: bytes, opts: tuple[sockopts.Option, ...]) -> str | None:
    """Why bytes waiting at an end that gets its senders' credentials cannot be made again
    (they are sent again by the daemon, whose credentials they would carry), or None."""
    if data and any((lv, nm) in sockopts.PASSING and v for lv, nm, v in opts):
        return ("bytes wait at an end that gets their senders' credentials (SO_PASSCRED, "
                "SO_PASSPIDFD or SO_PASSSEC): whose they were is not captured; checkpoint "
                "once they are read")
    return None


# ---- TCP connections -----------------------------------------------------------------------

class _Connections:
    """The sandbox's TCP connections: each end read once (from its first holder), each
    connection keyed by its ends' socket inodes."""

    def __init__(self, records: list[ProcessRecord]) -> None:
        self.holders: dict[int, tuple[ProcessRecord, native.FdInfo]] = {}  # inode -> first
        self.by_addr: dict[tuple[str, str], int] = {}    # (local, remote) -> inode
        for rec in records:
            for f in rec.fds:
                if tcp.is_connection(f) and f.inode not in self.holders:
                    assert f.socket is not None
                    self.holders[f.inode] = (rec, f)
                    self.by_addr[(f.socket.local, f.socket.remote)] = f.inode
        self.ends: dict[int, tcp.End | str] = {}
        self.state: dict[int, tuple[str, int, int] | str] = {}  # inode -> (key, a, b) or why

    def _end(self, ino: int) -> tcp.End | str:
        if ino not in self.ends:
            rec, f = self.holders[ino]
            try:
                self.ends[ino] = tcp.read_end(rec.pid, f.fd)
            except OSError as e:
                self.ends[ino] = f"reading the connection: {e}"
        return self.ends[ino]

    def _conn(self, f: native.FdInfo) -> tuple[str, int, int] | str:
        """The connection's key and its two ends' inodes (lower first; an orphan peer's,
        made from this end's state, under minus this end's inode), or why not."""
        if f.inode in self.state:
            return self.state[f.inode]
        assert f.socket is not None
        peer = self.by_addr.get((f.socket.remote, f.socket.local))
        why: tuple[str, int, int] | str
        if peer is None:
            why = self._orphan(f)
        else:
            a, b = sorted((f.inode, peer))
            ea, eb = self._end(a), self._end(b)
            if isinstance(ea, str) or isinstance(eb, str):
                why = ea if isinstance(ea, str) else str(eb)
            else:
                why = tcp.pair_refusal(ea, eb) or (f"tcp:{a}:{b}", a, b)
        self.state[f.inode] = why
        return why

    def _orphan(self, f: native.FdInfo) -> tuple[str, int, int] | str:
        """f's connection when no process holds its other end: one half-closed by a
        peer on the loopback that has closed since (tcp.orphan_peer)."""
        assert f.socket is not None
        outside = (f"connected to {f.socket.remote}, which no process of the sandbox holds: "
                   "only connections within the sandbox are captured")
        if f.socket.state != "close-wait":
            return outside
        end = self._end(f.inode)
        if isinstance(end, str):
            return end
        if not tcp.is_loopback(end.remote[0]):
            return outside
        peer = tcp.orphan_peer(end)
        if isinstance(peer, str):
            return peer
        self.ends[-f.inode] = peer
        return (f"tcp:{f.inode}:orphan", f.inode, -f.inode)

    def add(self, rec: ProcessRecord, loop: LoopState, reasons: list[str]) -> None:
        mine: dict[str, tcp.TcpConn] = {}
        for f in rec.fds:
            if not tcp.is_connection(f):
                continue
            st = self._conn(f)
            if isinstance(st, str):
                reasons.append(f"fd {f.fd}: TCP {f.describe()}: {st}")
                continue
            key, a, b = st
            if key not in mine:
                ea, eb = self.ends[a], self.ends[b]
                assert not isinstance(ea, str) and not isinstance(eb, str)
                family = socket.AF_INET if f.socket and f.socket.family == "inet" \
                    else socket.AF_INET6
                mine[key] = tcp.TcpConn(key, family, ends=[ea, eb], orphan=b < 0)
                loop.tcp.append(mine[key])
            (mine[key].a if f.inode == a else mine[key].b).append(f.fd)


# ---- epoll ---------------------------------------------------------------------------------

_RESTORED_KINDS = ("pipe", "fifo", "eventfd", "timerfd", "signalfd", "inotify", "socket", "chr",
                   "pidfd")


def _epolls(rec: ProcessRecord, shared: dict[tuple[int, int], int], loop: LoopState,
            reasons: list[str]) -> None:
    kinds = {f.fd: f for f in rec.fds}
    eps = [f for f in rec.fds if f.kind == "epoll"]
    for i, f in enumerate(eps):
        if (rec.pid, f.fd) in shared:
            reasons.append(f"fd {f.fd}: epoll instance shared with pid "
                           f"{shared[(rec.pid, f.fd)]}: not captured")
            continue
        first = next((g for g in eps[:i] if native.same_file(rec.pid, f.fd, rec.pid, g.fd)),
                     None)
        if first is not None:   # another descriptor of it (dup): dup'd again
            loop.epolls.append(native.Epoll(f.fd, bool(f.flags & os.O_CLOEXEC),
                                            dup_of=first.fd))
            continue
        watches, why = _watches(rec.pid, f.fd, kinds)
        if why:
            reasons.append(f"fd {f.fd}: epoll instance: {why}")
            continue
        loop.epolls.append(native.Epoll(f.fd, bool(f.flags & os.O_CLOEXEC), tuple(watches)))


def _watches(pid: int, efd: int, fds: dict[int, native.FdInfo]
             ) -> tuple[list[native.EpollWatch], str | None]:
    """An epoll instance's watches from fdinfo ("tfd: N events: X data: Y ..."), each
    checked to be the file the process holds at that fd (kcmp KCMP_EPOLL_TFD)."""
    out = []
    for line in _fdinfo(pid, efd).splitlines():
        if not line.startswith(b"tfd:"):
            continue
        parts = line.split()
        tfd, events, data = int(parts[1]), int(parts[3], 16), int(parts[5], 16)
        target = fds.get(tfd)
        if target is None or not native.epoll_watches_file(pid, efd, tfd):
            return [], (f"it watches fd {tfd}, which the process no longer holds (the "
                        "file lives on elsewhere): not captured")
        if target.kind == "epoll":
            return [], f"it watches another epoll instance (fd {tfd}): not captured"
        if target.kind not in _RESTORED_KINDS:
            return [], f"it watches fd {tfd} ({target.describe()}): not captured"
        out.append(native.EpollWatch(tfd, events, data))
    return out, None


# ---- in a process dump (daemon/dumps.py: state.json) -------------------------------------

def to_json(loop: LoopState | None) -> dict | None:
    if not loop:
        return None
    return dict(
        epolls=[dict(fd=e.fd, cloexec=e.cloexec, dup_of=e.dup_of,
                     watches=[[w.fd, w.events, w.data] for w in e.watches])
                for e in loop.epolls],
        eventfds=[dataclasses.asdict(e) for e in loop.eventfds],
        pairs=[dict(dataclasses.asdict(p), data_a=p.data_a.hex(), data_b=p.data_b.hex(),
                    opts_a=sockopts.to_json(p.opts_a), opts_b=sockopts.to_json(p.opts_b))
               for p in loop.pairs],
        lone=[dict(dataclasses.asdict(x), data=x.data.hex(), opts=sockopts.to_json(x.opts))
              for x in loop.lone],
        timerfds=[dataclasses.asdict(t) for t in loop.timerfds],
        signalfds=[dataclasses.asdict(x) for x in loop.signalfds],
        inotifies=[dataclasses.asdict(x) for x in loop.inotifies],
        tcp=[dict(key=c.key, family=c.family, a=c.a, b=c.b, orphan=c.orphan,
                  ends=[dict(dataclasses.asdict(e), send_data=e.send_data.hex(),
                             recv_data=e.recv_data.hex(), window=e.window.hex(),
                             opts=sockopts.to_json(e.opts))
                        for e in c.ends])
             for c in loop.tcp],
        unix_listeners=[dataclasses.asdict(u) for u in loop.unix_listeners])


def from_json(d: dict | None) -> LoopState | None:
    if not d:
        return None
    return LoopState(
        epolls=[native.Epoll(e["fd"], e["cloexec"],
                             tuple(native.EpollWatch(*w) for w in e["watches"]),
                             e.get("dup_of", -1))
                for e in d["epolls"]],
        eventfds=[EventFd(**e) for e in d["eventfds"]],
        # (options: since stop 67)
        pairs=[SocketPair(**dict(p, data_a=bytes.fromhex(p["data_a"]),
                                 data_b=bytes.fromhex(p["data_b"]),
                                 bufs_a=tuple(p["bufs_a"]), bufs_b=tuple(p["bufs_b"]),
                                 opts_a=sockopts.from_json(p.get("opts_a", [])),
                                 opts_b=sockopts.from_json(p.get("opts_b", []))))
               for p in d["pairs"]],
        lone=[LoneSocket(**dict(x, data=bytes.fromhex(x["data"]), bufs=tuple(x["bufs"]),
                                opts=sockopts.from_json(x.get("opts", [])),
                                owner=tuple(x.get("owner", (0, 0, 0)))))
              for x in d.get("lone", [])],
        timerfds=[TimerFd(**t) for t in d.get("timerfds", [])],
        signalfds=[SignalFd(**x) for x in d.get("signalfds", [])],
        inotifies=[watches.Inotify(**dict(x, watches=[watches.Watch(**w) for w in x["watches"]]))
                   for x in d.get("inotifies", [])],
        tcp=[tcp.TcpConn(c["key"], c["family"], c["a"], c["b"],
                         [tcp.End(**dict(e, send_data=bytes.fromhex(e["send_data"]),
                                         recv_data=bytes.fromhex(e["recv_data"]),
                                         window=bytes.fromhex(e["window"]),
                                         opts=sockopts.from_json(e.get("opts", []))))
                          for e in c["ends"]], c.get("orphan", False))
             for c in d.get("tcp", [])],
        unix_listeners=[unix_listeners.UnixListener(**u) for u in d.get("unix_listeners", [])])
