"""The socket options a restored socket gets again: those of a table that the original
has away from a fresh socket's value (a UDP socket's, udp.py; a netlink socket's,
netlink.py; a TCP listener's, capture.listen_socket; a unix socket's, eventloop.py; a TCP
connection's, tcp.py); and its socket filter.

Most are ints; a few are structs (SO_RCVTIMEO and SO_SNDTIMEO's struct timeval, the
timeouts of a blocking call; SO_LINGER's struct linger), read and set again as bytes.
Before stop 67 only ints of the listener and UDP tables came back: a restored socket's
timeouts, receive low-water mark and linger were lost on every kind, and a unix socket's
SO_PASSCRED, SO_PASSPIDFD and SO_PEEK_OFF, silently.

Compared with a fresh socket of the same kind made in the process's own network namespace
(its sysctls give some defaults, IP_TTL's for one), so an option the program never set is
never set on the copy: setting some to their reported value is not a no-op (TCP_MAXSEG
reports 536 unset, and 536 set clamps every connection). The copy gets them before its
bind (native recreate_listen, listeners.open_ahead). Options are by number (uapi
headers), as Python names only some of them.

Buffer sizes a program set (SO_RCVBUF, SO_SNDBUF: a statsd server's big receive buffer; on
a listener, its connections' buffers and no autotuning) read back doubled; they are set
again at half the value read, which doubles back to exactly it, and locks the size as the
original's is locked. The kernel caps what is set at net.core.rmem_max / wmem_max (the
FORCE variants need CAP_NET_ADMIN, which sandbox processes lack): a size above the cap
now (set by a process that had it, or before the cap was lowered) is refused.

A socket filter (SO_ATTACH_FILTER: a classic BPF program, what libpcap and libudev's
device monitor attach) decides what the socket receives: SO_GET_FILTER reads it back as
attached, and the copy gets it before anything else (native attach_filter). An eBPF
program (SO_ATTACH_BPF) cannot be read back and is refused. Not seen, and so not made
again: a reuseport group's program (SO_ATTACH_REUSEPORT_CBPF / _EBPF), which no call
reads.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct

from .. import kernfs
from . import native

_SOL, _IP, _IPV6, _TCP = (socket.SOL_SOCKET, socket.IPPROTO_IP, socket.IPPROTO_IPV6,
                          socket.IPPROTO_TCP)
_UDP_CORK = 1
_SO_ATTACH_FILTER = _SO_GET_FILTER = 26
_SO_PASSCRED, _SO_LOCK_FILTER = 16, 44
_libc = ctypes.CDLL(None, use_errno=True)
# set again at half the value read, within the cap of this sysctl
_BUFFERS = {(_SOL, 7): "wmem_max", (_SOL, 8): "rmem_max"}   # SO_SNDBUF, SO_RCVBUF

# A table's entry: (level, name) of an int option, (level, name, size) of a struct one.
Entry = tuple[int, int] | tuple[int, int, int]
# Every kind: SO_PRIORITY SO_TIMESTAMP(NS)_OLD SO_TIMESTAMP(NS)_NEW SO_RXQ_OVFL
# SO_RCVLOWAT, SO_LOCK_FILTER (set after the filter is attached), SO_RCVTIMEO_OLD and
# SO_SNDTIMEO_OLD (struct timeval), SO_LINGER (struct linger)
_ANY: list[Entry] = [(_SOL, n) for n in (12, 29, 35, 63, 64, 40, 18, _SO_LOCK_FILTER)] + [
    (_SOL, 20, 16), (_SOL, 21, 16), (_SOL, 13, 8)]
# and, but on a TCP connection (its sizes grow by themselves; one set locks it), the buffer
# sizes
_SOCKET: list[Entry] = _ANY + list(_BUFFERS)
# An IP socket's: SO_DONTROUTE, SO_BINDTODEVICE (an interface name, set before the bind)
_INET: list[Entry] = [(_SOL, 5), (_SOL, 25, 16)]
# IP_TOS IP_TTL IP_MTU_DISCOVER IP_FREEBIND
_IP_BOTH = [(_IP, n) for n in (1, 2, 10, 15)]
# IPV6_UNICAST_HOPS IPV6_MTU_DISCOVER IPV6_TCLASS
_IPV6_BOTH = [(_IPV6, n) for n in (16, 23, 67)]

# A UDP socket's that change what its process sees: where it may send (SO_BROADCAST), what
# recvmsg returns beside the data (IP_PKTINFO, IP_RECVERR, IP_RECVTTL, IP_RECVTOS,
# IP_RECVORIGDSTADDR; IPV6_RECVERR, IPV6_RECVPKTINFO, IPV6_RECVHOPLIMIT, IPV6_RECVTCLASS),
# how its datagrams leave (SO_NO_CHECK, UDP_CORK, the multicast interface, TTL and loop),
# which multicast it gets (IP_MULTICAST_ALL, IPV6_MULTICAST_ALL; its groups: udp.py).
# IP_MULTICAST_IF reads as the interface's address, which sets it again; one chosen by
# index alone (struct ip_mreqn) reads as 0: the copy sends by the sandbox's multicast
# route, through loopback as the original (native/init.c).
_UDP = _SOCKET + _INET + [(_SOL, 6), (_SOL, 11), (socket.IPPROTO_UDP, _UDP_CORK)]
UDP = {
    socket.AF_INET: _UDP + _IP_BOTH + [(_IP, n) for n in (8, 11, 12, 13, 20, 32, 33, 34, 49)],
    socket.AF_INET6: _UDP + _IPV6_BOTH + [(_IPV6, n) for n in (17, 18, 19, 25, 29, 49, 51,
                                                                66)],
}

# A netlink socket's: SO_PASSCRED (a device monitor checks that a message comes from root),
# and at SOL_NETLINK: NETLINK_PKTINFO, NETLINK_BROADCAST_ERROR, NETLINK_NO_ENOBUFS,
# NETLINK_CAP_ACK, NETLINK_EXT_ACK, NETLINK_GET_STRICT_CHK. (NETLINK_LISTEN_ALL_NSID
# cannot be read; it needs CAP_NET_BROADCAST, which sandbox processes lack.)
SOL_NETLINK = 270
NETLINK = {socket.AF_NETLINK: _SOCKET + [(_SOL, _SO_PASSCRED)] +
           [(SOL_NETLINK, n) for n in (3, 4, 5, 10, 11, 12)]}

# A unix socket's (its buffer sizes are made again apart, eventloop.py): SO_PASSCRED and
# SO_PASSSEC (its reads get the sender's credentials, its security label), SO_PASSPIDFD
# (a pidfd of the sender), SO_PEEK_OFF (where a MSG_PEEK read starts).
_SO_PASSSEC, _SO_PEEK_OFF, _SO_PASSPIDFD = 34, 42, 76
PASSING = {(_SOL, _SO_PASSCRED), (_SOL, _SO_PASSSEC), (_SOL, _SO_PASSPIDFD)}
UNIX = {socket.AF_UNIX: _ANY + sorted(PASSING) + [(_SOL, _SO_PEEK_OFF)]}

# A TCP socket's congestion control (TCP_CONGESTION: its algorithm's name, up to 16 bytes;
# a listener's connections inherit a chosen one). Until stop 69 a restored one had the
# namespace's default, silently.
_CONGESTION: Entry = (_TCP, 13, 16)
# A TCP connection's beside those tcp.py reads itself (no delay, keepalive): SO_OOBINLINE,
# TCP_CORK, TCP_LINGER2, TCP_THIN_LINEAR_TIMEOUTS, TCP_USER_TIMEOUT, TCP_NOTSENT_LOWAT,
# TCP_INQ (recvmsg tells the bytes left), its congestion control, and the IP ones: type of
# service, TTL, path MTU discovery, IP_RECVERR (IPv6: hops, path MTU discovery,
# IPV6_RECVERR, traffic class).
# Not TCP_QUICKACK (it reads the connection's passing ack mode, not a setting) nor
# TCP_WINDOW_CLAMP (the stack sets it too: it reads other than a fresh socket's unset).
_CONN = _ANY + _INET + [(_SOL, 10)] + [(_TCP, n) for n in (3, 8, 16, 18, 25, 36)] + [
    _CONGESTION]
TCP_CONNECTION = {socket.AF_INET: _CONN + [(_IP, n) for n in (1, 2, 10, 11)],
                  socket.AF_INET6: _CONN + [(_IPV6, n) for n in (16, 23, 25, 67)]}

# A TCP listener's, most of them inherited by the connections it accepts: SO_KEEPALIVE,
# SO_OOBINLINE, TCP_NODELAY, TCP_MAXSEG, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT, TCP_DEFER_ACCEPT,
# TCP_QUICKACK, TCP_USER_TIMEOUT, TCP_FASTOPEN (its queue), TCP_NOTSENT_LOWAT, its
# congestion control.
_LISTENER = _SOCKET + _INET + [(_SOL, 9), (_SOL, 10)] + [
    (_TCP, n) for n in (1, 2, 4, 5, 6, 9, 12, 18, 23, 25)] + [_CONGESTION]
LISTENER = {
    socket.AF_INET: _LISTENER + _IP_BOTH,
    socket.AF_INET6: _LISTENER + _IPV6_BOTH,
}


def remade(pid: int, f: native.FdInfo, s: socket.socket,
           table: dict[int, list[Entry]], **where: object) -> native.ListenSocket:
    """What it takes to make pid's socket at f (our copy s) again: its kind, flags, the
    options a bind depends on, those of `table` it set; `where`: its address, backlog,
    peer."""
    typ = int(s.type)
    if f.flags & os.O_NONBLOCK:
        typ |= socket.SOCK_NONBLOCK
    if f.flags & os.O_CLOEXEC:
        typ |= socket.SOCK_CLOEXEC
    return native.ListenSocket(
        fd=f.fd, family=int(s.family), type=typ,
        protocol=s.getsockopt(_SOL, socket.SO_PROTOCOL),
        reuseaddr=bool(s.getsockopt(_SOL, socket.SO_REUSEADDR)),
        reuseport=bool(s.getsockopt(_SOL, socket.SO_REUSEPORT)),
        v6only=s.family == socket.AF_INET6 and bool(s.getsockopt(_IPV6, socket.IPV6_V6ONLY)),
        ino=f.inode, options=differing(pid, s, table), filter=socket_filter(s),
        **where)  # type: ignore[arg-type]


def socket_filter(s: socket.socket) -> bytes:
    """s's classic socket filter as attached (struct sock_filter[]), b"" if none; refuses
    (CRError) one that cannot be attached again."""
    n = ctypes.c_uint(0)   # a length of 0 asks for the number of instructions
    if _libc.getsockopt(s.fileno(), _SOL, _SO_GET_FILTER, None, ctypes.byref(n)) < 0:
        e = ctypes.get_errno()
        if e == errno.EACCES:
            raise native.CRError(e, "an eBPF socket filter (SO_ATTACH_BPF): it cannot be "
                                 "read back, so it is not made again")
        raise native.CRError(e, f"reading its socket filter: {os.strerror(e)}")
    count = n.value
    if not count:
        return b""
    if count > native.FILTER_MAX:
        raise native.CRError(errno.E2BIG, f"a socket filter of {count} instructions (at "
                             f"most {native.FILTER_MAX} are made again)")
    buf = ctypes.create_string_buffer(8 * count)
    if _libc.getsockopt(s.fileno(), _SOL, _SO_GET_FILTER, buf, ctypes.byref(n)) < 0:
        e = ctypes.get_errno()   # replaced meanwhile by a longer one: EINVAL
        raise native.CRError(e, f"reading its socket filter: {os.strerror(e)}")
    return buf.raw[:8 * n.value]


def attach_filter(s: socket.socket, prog: bytes) -> None:
    """Attach the classic filter prog (socket_filter's bytes) to s: the kernel copies it."""
    buf = ctypes.create_string_buffer(prog, len(prog))
    s.setsockopt(_SOL, _SO_ATTACH_FILTER,
                 struct.pack("=H6xQ", len(prog) // 8, ctypes.addressof(buf)))


def sockaddr(family: int, name: tuple) -> bytes:
    """The raw struct sockaddr_in/_in6 for a getsockname() tuple (listeners.address's
    inverse)."""
    if family == socket.AF_INET:
        host, port = name
        return struct.pack("=H", family) + struct.pack("!H", port) + \
            socket.inet_pton(family, host) + bytes(8)
    host, port, flow, scope = name
    return struct.pack("=H", family) + struct.pack("!HI", port, flow) + \
        socket.inet_pton(family, host.split("%")[0]) + struct.pack("=I", scope)


Option = tuple[int, int, int | bytes]


def differing(pid: int | None, s: socket.socket, table: dict[int, list[Entry]]
              ) -> tuple[Option, ...]:
    """(level, name, value) of each option of table[s.family] whose value on s differs
    from a fresh socket's of s's type, made in pid's network namespace (some defaults
    are its sysctls: IP_TTL's, buffer sizes), or here if pid is None (a table whose
    defaults are the same everywhere, or which a namespace's could only set to what it
    has anyway: UNIX, TCP_CONNECTION; read once per kind, not per socket)."""
    entries = table.get(s.family, [])
    defaults = (_local_defaults(s.family, s.type & 0xf, entries) if pid is None else
                _fresh_defaults(native.netns_socket(pid, s.family, s.type & 0xf, 0), entries))
    out = []
    for (level, name, *size), default in zip(entries, defaults):
        if default is None:
            continue
        try:
            value = s.getsockopt(level, name, *size)
        except OSError:
            continue
        if value != default:
            cap = _BUFFERS.get((level, name))
            if cap:
                value //= 2
                _within(cap, value)
            out.append((level, name, value))
    if len(out) > native.SOCKOPTS:
        raise native.CRError(22, f"{len(out)} socket options set (at most "
                             f"{native.SOCKOPTS} are made again)")
    return tuple(out)


def _fresh_defaults(fresh: socket.socket, entries: list[Entry]) -> list[int | bytes | None]:
    """Each entry's value on the fresh socket (closed after), None where it has none."""
    with fresh:
        out: list[int | bytes | None] = []
        for level, name, *size in entries:
            try:
                out.append(fresh.getsockopt(level, name, *size))
            except OSError:
                out.append(None)
    return out


_LOCAL: dict[tuple[int, int, tuple[Entry, ...]], list[int | bytes | None]] = {}


def _local_defaults(family: int, type_: int, entries: list[Entry]
                    ) -> list[int | bytes | None]:
    """_fresh_defaults of a socket made here, once per kind (a checkpoint reads every
    unix end and TCP connection end against them)."""
    key = (family, type_, tuple(entries))
    if key not in _LOCAL:
        _LOCAL[key] = _fresh_defaults(socket.socket(family, type_), entries)
    return _LOCAL[key]


def set_all(s: socket.socket, options: tuple[Option, ...]) -> None:
    """Set differing's options on a socket made again (ours)."""
    for level, name, value in options:
        s.setsockopt(level, name, value)


def to_json(options: tuple[Option, ...]) -> list:
    """options as JSON (a struct's bytes as hex), for a dump."""
    return [[lv, nm, v.hex() if isinstance(v, bytes) else v] for lv, nm, v in options]


def from_json(raw: list) -> tuple[Option, ...]:
    return tuple((lv, nm, bytes.fromhex(v) if isinstance(v, str) else v) for lv, nm, v in raw)


def _within(sysctl: str, size: int) -> None:
    """Refuse a buffer size a process could not set again (the kernel would cap it)."""
    cap = int(kernfs.read(f"/proc/sys/net/core/{sysctl}"))
    if size > cap:
        kind = "receive" if sysctl == "rmem_max" else "send"
        raise native.CRError(22, f"its {kind} buffer of {size} bytes is above "
                             f"net.core.{sysctl} ({cap}): not made again")
