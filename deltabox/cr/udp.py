"""UDP sockets of a sandbox process: what it takes to make one again (its address, its peer,
the options that change what its process sees), and what cannot be captured.

A UDP socket carries no connection: a copy bound to the same address, connected to the same
peer, with the same options (sockopts.py), is the same socket to its process, once nothing
waits in it.
The sandbox's network namespace has loopback only (native/init.c), so its addresses are
loopback or wildcard ones, free again in a rollback once the killed processes are gone and
free in a fork's own namespace. It is made like a listener (listeners.py, native
recreate_listen): bound, connected, never listening.

Refused, naming the socket: one made in another network namespace than its process's
(handed in from outside), a datagram waiting to be read (a restored socket could not have
it), an error waiting to be read (an ICMP port-unreachable's ECONNREFUSED, an error
queue: the next call would not see it), a datagram being built (UDP_CORK or MSG_MORE: its
bytes are in the kernel), a buffer size above what a process may set now (sockopts.py). Not
restored: multicast memberships (no call lists them; loopback takes none: the namespace
has no multicast route).
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct

from . import native, sockopts

_SO_MEMINFO = 55
_MEMINFO = struct.Struct("=3I")    # SK_MEMINFO_RMEM_ALLOC, _RCVBUF, _WMEM_ALLOC
_SIOCGSKNS = 0x894C

_SOL = socket.SOL_SOCKET

def is_udp(f: native.FdInfo) -> bool:
    k = f.socket
    return k is not None and k.family in ("inet", "inet6") and k.type == "udp"


def capture(pid: int, f: native.FdInfo) -> tuple[native.ListenSocket, str | None]:
    """What it takes to make pid's UDP socket at f again, and why it cannot be captured
    now (or None). Read from our own copy of it (pidfd_getfd), with calls that change
    nothing in it: poll, not a peek (a peek would hand over a pending error), and no
    SO_ERROR (reading it clears it)."""
    with socket.socket(fileno=native.copy_fd(pid, f.fd)) as s:
        why = _elsewhere(pid, s) or _unsettled(s)
        name = s.getsockname()
        try:
            peer = s.getpeername()
        except OSError:
            peer = None
        ls = sockopts.remade(
            pid, f, s, sockopts.UDP, backlog=0,
            addr=sockopts.sockaddr(s.family, name) if name[1] else b"",
            peer=sockopts.sockaddr(s.family, peer) if peer is not None else b"")
    return ls, why


def _elsewhere(pid: int, s: socket.socket) -> str | None:
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


def _unsettled(s: socket.socket) -> str | None:
    """Why this socket holds state a fresh one would not have, or None."""
    rmem, _rcvbuf, wmem = _MEMINFO.unpack_from(s.getsockopt(_SOL, _SO_MEMINFO, 9 * 4))
    p = select.poll()
    p.register(s.fileno(), select.POLLIN | select.POLLERR)
    events = dict(p.poll(0)).get(s.fileno(), 0)
    if rmem or events & select.POLLIN:
        return ("a datagram waits to be read: not captured; checkpoint once the process "
                "has read it")
    if events & select.POLLERR:
        return ("an error waits to be read (an earlier datagram's ECONNREFUSED, or its "
                "error queue): not captured; checkpoint once the process has read it")
    if wmem:
        return ("a datagram is being built (UDP_CORK or MSG_MORE): its bytes are not "
                "captured")
    return None

