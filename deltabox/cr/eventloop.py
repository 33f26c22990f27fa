"""The descriptors of an event loop: epoll instances, eventfds and unix socket pairs.

An asyncio program (uvicorn, aiohttp, any `asyncio.run`) holds an epoll instance and a
socket pair (its self-pipe); libuv and others add eventfds. A template is a fork of the
process, so it shares these objects with the live process, which goes on changing them
(registrations, counters, queued bytes): what a restore needs is read here, from the live
process while the checkpoint holds it stopped, and each restored process gets objects of
its own, made afresh with that state (engine._PipePlan.loop_fds; epoll instances inside
the child, once its other descriptors are in place: native_fork_template recreate_epoll).

Captured: an epoll instance (its watches: fd, events, data) whose every watched descriptor
is one the process holds and the restore recreates; an eventfd (counter, semaphore mode);
an unnamed connected unix socket pair with both ends in the process (queued bytes of a
stream pair, buffer sizes). Each non-blocking flag and close-on-exec flag as it was.
Refused, with the reason: such an object shared with another process (after a fork), an
epoll instance watching another epoll or a descriptor the process no longer holds, a unix
socket bound to a name or connected to a socket outside the process, descriptors in flight
(SCM_RIGHTS), a shut-down end, datagrams waiting in a datagram pair.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
from collections import defaultdict
from dataclasses import dataclass, field

from .. import kernfs
from . import native
from .capture import ProcessRecord, Refusal

MAX_QUEUED = 4 << 20                      # bytes waiting in a socket we copy, at most


@dataclass
class EventFd:
    """An eventfd of one process (held at `fds`: dups share it)."""
    fds: list[int]
    count: int
    semaphore: bool
    nonblock: bool


@dataclass
class SocketPair:
    """A connected unix socket pair, both ends in one process: `a` and `b` the fds
    holding each end; `data_a` the bytes waiting to be read at a (sent by b)."""
    type: int                             # socket.SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET
    a: list[int]
    b: list[int]
    nonblock_a: bool = False
    nonblock_b: bool = False
    data_a: bytes = b""
    data_b: bytes = b""
    bufs_a: tuple[int, int] = (0, 0)      # SO_SNDBUF, SO_RCVBUF as getsockopt reports
    bufs_b: tuple[int, int] = (0, 0)


@dataclass
class LoopState:
    """What a process's event-loop descriptors need at a restore."""
    epolls: list[native.Epoll] = field(default_factory=list)
    eventfds: list[EventFd] = field(default_factory=list)
    pairs: list[SocketPair] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.epolls or self.eventfds or self.pairs)


def is_loop_fd(f: native.FdInfo) -> bool:
    """Whether `capture` decides about this descriptor (capture.refusals leaves it)."""
    return f.kind in ("epoll", "eventfd") or (
        f.kind == "socket" and f.socket is not None and f.socket.family == "unix")


def capture(records: list[ProcessRecord]) -> list[Refusal]:
    """Fill `rec.loop` for every record holding event-loop descriptors, or say why one
    cannot be restored. Call with every process of the sandbox stopped."""
    out: list[Refusal] = []
    todo = [r for r in records if any(is_loop_fd(f) for f in r.fds)]
    if not todo:
        return out
    shared = _shared_elsewhere(records)
    diag: dict[int, _UnixDiag] | None = None
    for rec in todo:
        if any(f.kind == "socket" and is_loop_fd(f) for f in rec.fds) and diag is None:
            diag = unix_sockets(rec.pid)
        reasons: list[str] = []
        loop = LoopState()
        _eventfds(rec, shared, loop, reasons)
        _pairs(rec, shared, diag or {}, loop, reasons)
        _epolls(rec, shared, loop, reasons)
        out.extend(Refusal(rec.nspid, rec.cmd, r) for r in reasons)
        if not reasons:
            rec.loop = loop
    return out


# ---- sharing between processes ------------------------------------------------------------

def _shared_elsewhere(records: list[ProcessRecord]) -> dict[tuple[int, int], int]:
    """(pid, fd) of an event-loop descriptor -> pid of another process holding the same
    open file description (kcmp; unix sockets by inode)."""
    out: dict[tuple[int, int], int] = {}
    held = [(r.pid, f) for r in records for f in r.fds if is_loop_fd(f)]
    by_inode: dict[int, set[int]] = defaultdict(set)
    for pid, f in held:
        if f.kind == "socket":
            by_inode[f.inode].add(pid)
    for pid, f in held:
        if f.kind == "socket":
            others = by_inode[f.inode] - {pid}
            if others:
                out[(pid, f.fd)] = min(others)
            continue
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

def _eventfds(rec: ProcessRecord, shared: dict[tuple[int, int], int], loop: LoopState,
              reasons: list[str]) -> None:
    seen: dict[int, EventFd] = {}              # eventfd-id -> its record
    for f in rec.fds:
        if f.kind != "eventfd":
            continue
        if (rec.pid, f.fd) in shared:
            reasons.append(f"fd {f.fd}: eventfd shared with pid "
                           f"{shared[(rec.pid, f.fd)]}: eventfds between processes are not "
                           "captured")
            continue
        info = _fdinfo(rec.pid, f.fd)
        count, ident = _field(info, b"eventfd-count"), _field(info, b"eventfd-id")
        if count is None or ident is None:
            reasons.append(f"fd {f.fd}: eventfd without a counter in /proc fdinfo "
                           "(kernel too old)")
            continue
        ev = seen.get(int(ident))
        if ev is not None:
            ev.fds.append(f.fd)
            continue
        sem = _field(info, b"eventfd-semaphore")
        ev = seen[int(ident)] = EventFd([f.fd], int(count, 16), sem == b"1",
                                        bool(f.flags & os.O_NONBLOCK))
        loop.eventfds.append(ev)


# ---- unix socket pairs ---------------------------------------------------------------------

@dataclass(frozen=True)
class _UnixDiag:
    type: int
    state: int
    peer: int
    name: str
    rqueue: int
    shutdown: int


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_DONE, NLMSG_ERROR = 1, 0x300, 3, 2
UDIAG_SHOW_NAME, UDIAG_SHOW_PEER, UDIAG_SHOW_RQLEN = 0x1, 0x4, 0x10
UNIX_DIAG_NAME, UNIX_DIAG_PEER, UNIX_DIAG_RQLEN, UNIX_DIAG_SHUTDOWN = 0, 2, 4, 6
TCP_ESTABLISHED = 1
_NLMSG = struct.Struct("=IHHII")
_UNIX_REQ = struct.Struct("=BBHIIIII")       # family protocol pad states ino show cookie[2]
_UNIX_MSG = struct.Struct("=BBBBIII")        # family type state pad ino cookie[2]
_RTA = struct.Struct("=HH")


def unix_sockets(pid: int) -> dict[int, _UnixDiag]:
    """Every unix socket of pid's network namespace by inode (sock_diag: the only place
    the kernel tells a socket's peer)."""
    with native.netns_socket(pid, socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as s:
        req = _UNIX_REQ.pack(socket.AF_UNIX, 0, 0, 0xffffffff, 0,
                             UDIAG_SHOW_NAME | UDIAG_SHOW_PEER | UDIAG_SHOW_RQLEN,
                             0xffffffff, 0xffffffff)
        s.send(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY,
                           NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        out: dict[int, _UnixDiag] = {}
        while True:
            buf = s.recv(1 << 16)
            at = 0
            while at + _NLMSG.size <= len(buf):
                length, kind, _, _, _ = _NLMSG.unpack_from(buf, at)
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", buf, at + _NLMSG.size)[0]
                    raise OSError(code, f"sock_diag of unix sockets: {os.strerror(code)}")
                _parse_unix(buf[at + _NLMSG.size:at + length], out)
                at += (length + 3) & ~3
            if not buf:
                return out


def _parse_unix(msg: bytes, out: dict[int, _UnixDiag]) -> None:
    _fam, typ, state, _pad, ino, _c0, _c1 = _UNIX_MSG.unpack_from(msg)
    peer, name, rqueue, shutdown = 0, "", 0, 0
    at = _UNIX_MSG.size
    while at + _RTA.size <= len(msg):
        alen, atype = _RTA.unpack_from(msg, at)
        if alen < _RTA.size:
            break
        data = msg[at + _RTA.size:at + alen]
        if atype == UNIX_DIAG_PEER:
            peer = struct.unpack_from("=I", data)[0]
        elif atype == UNIX_DIAG_NAME:
            name = data.decode(errors="replace") or "?"
        elif atype == UNIX_DIAG_RQLEN:
            rqueue = struct.unpack_from("=I", data)[0]
        elif atype == UNIX_DIAG_SHUTDOWN:
            shutdown = data[0]
        at += (alen + 3) & ~3
    out[ino] = _UnixDiag(typ, state, peer, name, rqueue, shutdown)


def _pairs(rec: ProcessRecord, shared: dict[tuple[int, int], int],
           diag: dict[int, _UnixDiag], loop: LoopState, reasons: list[str]) -> None:
    socks = {f.fd: f for f in rec.fds if f.kind == "socket" and is_loop_fd(f)}
    fds_of: dict[int, list[int]] = defaultdict(list)    # inode -> fds holding it
    for f in socks.values():
        fds_of[f.inode].append(f.fd)
    done: set[int] = set()
    for ino, fds in fds_of.items():
        if ino in done:
            continue
        f = socks[fds[0]]
        why = _pair_refusal(rec, f, ino, shared, diag, fds_of)
        if why:
            reasons.append(f"fd {f.fd}: unix socket {f.describe()}: {why}")
            continue
        d = diag[ino]
        peer = d.peer
        done.update((ino, peer))
        pair = SocketPair(d.type, list(fds), list(fds_of[peer]),
                          nonblock_a=bool(f.flags & os.O_NONBLOCK),
                          nonblock_b=bool(socks[fds_of[peer][0]].flags & os.O_NONBLOCK))
        try:
            pair.data_a, pair.bufs_a = _queued(rec.pid, fds[0], d)
            pair.data_b, pair.bufs_b = _queued(rec.pid, fds_of[peer][0], diag[peer])
        except OSError as e:
            reasons.append(f"fd {f.fd}: reading the unix socket pair: {e}")
            continue
        loop.pairs.append(pair)


def _pair_refusal(rec: ProcessRecord, f: native.FdInfo, ino: int,
                  shared: dict[tuple[int, int], int], diag: dict[int, _UnixDiag],
                  fds_of: dict[int, list[int]]) -> str | None:
    d = diag.get(ino)
    if d is None:
        return "not found by sock_diag"
    if d.type not in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):
        return f"socket type {d.type} is not captured"
    if d.state != TCP_ESTABLISHED or not d.peer:
        return "not connected: only socket pairs are captured"
    if d.peer not in fds_of:
        return ("connected to a socket this process does not hold (another process, or "
                "outside the sandbox): only pairs within one process are captured")
    for end in (ino, d.peer):
        e = diag.get(end)
        if e is None:
            return "its peer was not found by sock_diag"
        if e.name:
            return f"bound to {e.name!r}: named unix sockets are not captured"
        for fd in fds_of[end]:
            if (rec.pid, fd) in shared:
                return f"shared with pid {shared[(rec.pid, fd)]}"
            if _field(_fdinfo(rec.pid, fd), b"scm_fds") not in (None, b"0"):
                return "descriptors in flight (SCM_RIGHTS) are not captured"
        if e.shutdown:
            return "an end is shut down: not captured"
        if e.rqueue and d.type != socket.SOCK_STREAM:
            return "datagrams waiting to be read are not captured"
        if e.rqueue > MAX_QUEUED:
            return f"{e.rqueue} bytes waiting (more than {MAX_QUEUED} are not captured)"
    return None


def _queued(pid: int, fd: int, d: _UnixDiag) -> tuple[bytes, tuple[int, int]]:
    """The bytes waiting to be read at this end (peeked, not consumed) and its buffer
    sizes."""
    with socket.socket(fileno=native.copy_fd(pid, fd)) as s:
        bufs = (s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        if not d.rqueue:
            return b"", bufs
        data = s.recv(d.rqueue, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    if len(data) != d.rqueue:
        raise OSError(0, f"peeked {len(data)} of the {d.rqueue} bytes waiting")
    return data, bufs


# ---- epoll ---------------------------------------------------------------------------------

_RESTORED_KINDS = ("pipe", "eventfd", "socket", "chr")


def _epolls(rec: ProcessRecord, shared: dict[tuple[int, int], int], loop: LoopState,
            reasons: list[str]) -> None:
    kinds = {f.fd: f for f in rec.fds}
    eps = [f for f in rec.fds if f.kind == "epoll"]
    for i, f in enumerate(eps):
        if (rec.pid, f.fd) in shared:
            reasons.append(f"fd {f.fd}: epoll instance shared with pid "
                           f"{shared[(rec.pid, f.fd)]}: not captured")
            continue
        if any(native.same_file(rec.pid, f.fd, rec.pid, g.fd) for g in eps[:i]):
            reasons.append(f"fd {f.fd}: a second descriptor of one epoll instance: not "
                           "captured")
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
        epolls=[dict(fd=e.fd, cloexec=e.cloexec,
                     watches=[[w.fd, w.events, w.data] for w in e.watches])
                for e in loop.epolls],
        eventfds=[dataclasses.asdict(e) for e in loop.eventfds],
        pairs=[dict(dataclasses.asdict(p), data_a=p.data_a.hex(), data_b=p.data_b.hex())
               for p in loop.pairs])


def from_json(d: dict | None) -> LoopState | None:
    if not d:
        return None
    return LoopState(
        epolls=[native.Epoll(e["fd"], e["cloexec"],
                             tuple(native.EpollWatch(*w) for w in e["watches"]))
                for e in d["epolls"]],
        eventfds=[EventFd(**e) for e in d["eventfds"]],
        pairs=[SocketPair(**dict(p, data_a=bytes.fromhex(p["data_a"]),
                                 data_b=bytes.fromhex(p["data_b"]),
                                 bufs_a=tuple(p["bufs_a"]), bufs_b=tuple(p["bufs_b"])))
               for p in d["pairs"]])
