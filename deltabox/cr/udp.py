"""UDP sockets of a sandbox process: what it takes to make one again (its address, its peer,
the options that change what its process sees, the multicast groups it joined), and what
cannot be captured.

A UDP socket carries no connection: a copy bound to the same address, connected to the same
peer, with the same options (sockopts.py) and in the same multicast groups, is the same
socket to its process, once nothing waits in it.
The sandbox's network namespace has loopback only (native/init.c), so its addresses are
loopback or wildcard ones, free again in a rollback once the killed processes are gone and
free in a fork's own namespace. It is made like a listener (listeners.py, native
recreate_listen): bound, connected, never listening.

Refused, naming the socket: one made in another network namespace than its process's
(handed in from outside), a datagram waiting to be read (a restored socket could not have
it; a passing state since stop 73: the checkpoint lets the process read it, as a file
watcher's events, and captures again, up to 4 times), an error waiting to be read (an ICMP
port-unreachable's ECONNREFUSED, an error queue: the next call would not see it), a
datagram being built (UDP_CORK or MSG_MORE: its bytes are in the kernel), a buffer size
above what a process may set now (sockopts.py), a multicast membership filtered by source
(only any-source joins are made again).

Multicast groups: no call lists a socket's memberships, but /proc/PID/net/igmp and igmp6
list every group joined on each interface of the namespace, and MCAST_MSFILTER asked of a
socket for one of them answers (its filter) only if that socket is a member. The copy
joins the same groups on the same interfaces. (A sandbox routes IPv4 multicast over
loopback, native/init.c: a sender's interface chosen by index alone, which reads back as
none, sends the same way without it.)
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import socket
import struct
from collections.abc import Sequence

from .. import kernfs
from . import native, sockopts

_SO_MEMINFO = 55
_MEMINFO = struct.Struct("=3I")    # SK_MEMINFO_RMEM_ALLOC, _RCVBUF, _WMEM_ALLOC
_SIOCGSKNS = 0x894C

_SOL = socket.SOL_SOCKET
_MCAST_JOIN_GROUP, _MCAST_MSFILTER = 42, 48
_MCAST_EXCLUDE = 0
_SS = 128                               # sizeof(struct sockaddr_storage)
_GROUP_REQ = struct.Struct(f"=I4x{_SS}s")          # gr_interface, gr_group
_GROUP_FILTER = struct.Struct(f"=I4x{_SS}sII{_SS}s")  # ..., gf_fmode, gf_numsrc, gf_slist[1]
_libc = ctypes.CDLL(None, use_errno=True)


def is_udp(f: native.FdInfo) -> bool:
    k = f.socket
    return k is not None and k.family in ("inet", "inet6") and k.type == "udp"


def capture(pid: int, f: native.FdInfo, joined: Sequence[tuple[int, str]] | None = None
            ) -> tuple[native.ListenSocket, str | None]:
    """What it takes to make pid's UDP socket at f again, and why it cannot be captured
    now (or None). Read from our own copy of it (pidfd_getfd), with calls that change
    nothing in it: poll, not a peek (a peek would hand over a pending error), and no
    SO_ERROR (reading it clears it). `joined`: its namespace's multicast groups
    (joined_in_namespace; read here if None)."""
    with socket.socket(fileno=native.copy_fd(pid, f.fd)) as s:
        why = elsewhere(pid, s) or _unsettled(s)
        name = s.getsockname()
        try:
            peer = s.getpeername()
        except OSError:
            peer = None
        groups, filtered = memberships(
            s, joined if joined is not None else joined_in_namespace(pid))
        if filtered and why is None:
            why = (f"its multicast membership of {filtered} filters by source: not made "
                   "again")
        ls = sockopts.remade(
            pid, f, s, sockopts.UDP, backlog=0,
            addr=sockopts.sockaddr(s.family, name) if name[1] else b"",
            peer=sockopts.sockaddr(s.family, peer) if peer is not None else b"",
            groups=groups)
    return ls, why


def memberships(s: socket.socket, joined: Sequence[tuple[int, str]]
                ) -> tuple[tuple[tuple[int, str], ...], str | None]:
    """The (interface index, group) memberships of socket s among `joined` (its network
    namespace's: joined_in_namespace), and the first of them filtered by source, if any
    (None)."""
    out, filtered = [], None
    for ifindex, group in joined:
        family, level = _family_level(group)
        if family == socket.AF_INET6 and s.family != socket.AF_INET6:
            continue
        buf = ctypes.create_string_buffer(_GROUP_FILTER.size)
        _GROUP_FILTER.pack_into(buf, 0, ifindex, _sockaddr(family, group), 0, 0, b"")
        size = ctypes.c_uint(_GROUP_FILTER.size)
        if _libc.getsockopt(s.fileno(), level, _MCAST_MSFILTER, buf, ctypes.byref(size)) < 0:
            continue        # EADDRNOTAVAIL: not a member (nor anything else to say)
        _, _, fmode, nsrc, _ = _GROUP_FILTER.unpack_from(buf)
        out.append((ifindex, group))
        if (fmode != _MCAST_EXCLUDE or nsrc) and filtered is None:
            filtered = f"{group} (interface {ifindex})"
    return tuple(out), filtered


def joined_in_namespace(pid: int) -> list[tuple[int, str]]:
    """(interface index, group) of every group joined in pid's network namespace (the
    interfaces' own all-hosts groups among them): read once per process, asked of each of
    its UDP sockets."""
    out: list[tuple[int, str]] = []
    try:
        igmp = kernfs.read(f"/proc/{pid}/net/igmp").decode().splitlines()[1:]
        igmp6 = kernfs.read(f"/proc/{pid}/net/igmp6").decode().splitlines()
    except OSError:
        return out
    ifindex = 0
    for line in igmp:          # "1\tlo : 2 V3" then "\t\t\t\t030201EF 1 0:00000000\t\t0"
        if not line.strip():
            continue
        if not line[0].isspace():
            ifindex = int(line.split()[0])
        else:
            raw = struct.pack("<I", int(line.split()[0], 16))
            out.append((ifindex, socket.inet_ntop(socket.AF_INET, raw)))
    for line in igmp6:         # "1 lo ff020000000000000000000000000001 1 0000000C 0"
        cols = line.split()
        if len(cols) >= 3:
            out.append((int(cols[0]), socket.inet_ntop(socket.AF_INET6,
                                                       bytes.fromhex(cols[2]))))
    return out


def _family_level(group: str) -> tuple[int, int]:
    """A group address's family, and the socket option level its membership is at."""
    if ":" in group:
        return socket.AF_INET6, socket.IPPROTO_IPV6
    return socket.AF_INET, socket.IPPROTO_IP


def _sockaddr(family: int, group: str) -> bytes:
    """A struct sockaddr_in/_in6 of a group address, port 0."""
    if family == socket.AF_INET:
        return struct.pack("=H2x4s", family, socket.inet_pton(family, group))
    return struct.pack("=H6x16s", family, socket.inet_pton(family, group))


def join_request(ifindex: int, group: str) -> tuple[int, int, bytes]:
    """setsockopt's (level, name, value) joining a group on an interface (either family;
    an IPv4 group at the IP level, on an IPv6 socket too)."""
    family, level = _family_level(group)
    return level, _MCAST_JOIN_GROUP, _GROUP_REQ.pack(ifindex, _sockaddr(family, group))


def elsewhere(pid: int, s: socket.socket) -> str | None:
    """Why the socket is not of the process's network namespace (one handed in from
    outside the sandbox: made again in the sandbox's, it would reach other addresses), or
    None. SIOCGSKNS opens the socket's namespace."""
    ns = fcntl.ioctl(s.fileno(), _SIOCGSKNS)
    try:
        if os.fstat(ns).st_ino == os.stat(f"/proc/{pid}/ns/net").st_ino:
            return None
    finally:
        os.close(ns)
    return "made in another network namespace than its process's: not captured"


def waiting(s: socket.socket) -> tuple[bool, bool, int]:
    """Whether something waits to be read in datagram socket s, whether an error does,
    and the bytes of its send queue: from SO_MEMINFO and a poll, neither of which takes
    anything from it (a peek would hand over a pending error; SO_ERROR clears it)."""
    rmem, _rcvbuf, wmem = _MEMINFO.unpack_from(s.getsockopt(_SOL, _SO_MEMINFO, 9 * 4))
    p = select.poll()
    p.register(s.fileno(), select.POLLIN | select.POLLERR)
    events = dict(p.poll(0)).get(s.fileno(), 0)
    return bool(rmem or events & select.POLLIN), bool(events & select.POLLERR), wmem


# A passing refusal (capture.add_listeners): the capture lets its process read it.
DATAGRAM_WAITS = ("a datagram waits to be read: not captured; checkpoint once the process "
                  "has read it")


def _unsettled(s: socket.socket) -> str | None:
    """Why this socket holds state a fresh one would not have, or None."""
    data, error, wmem = waiting(s)
    if data:
        return DATAGRAM_WAITS
    if error:
        return ("an error waits to be read (an earlier datagram's ECONNREFUSED, or its "
                "error queue): not captured; checkpoint once the process has read it")
    if wmem:
        return ("a datagram is being built (UDP_CORK or MSG_MORE): its bytes are not "
                "captured")
    return None

