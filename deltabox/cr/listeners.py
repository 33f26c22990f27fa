"""Listening TCP sockets of a carrier made ahead of a rollback (a dev server, a Jupyter
kernel's five ZeroMQ ports), its UDP sockets (udp.py: bound and connected, never
listening) and its netlink sockets (netlink.py: bound to their port id, never listening).

A spawn from a template makes its listeners in the child (native recreate_listen: socket,
options, bind, listen). A carrier is spawned while the live process still holds the port,
so it cannot bind: the daemon makes the socket ahead in the sandbox's network namespace,
with the original's type flags and options, and the carrier gets it at the listener's fd.
The rollback binds it and listens (`listen`, on our copy of the same open file description)
once the killed processes have exited and their ports are free, before any process runs.
An epoll set of the carrier may already watch the unbound socket: the watch is on the open
file description, which listen() keeps (a ready mark from the unbound socket's hang-up is
polled again, and dropped, when the process next waits).
"""

from __future__ import annotations

import errno
import os
import socket
import struct

from . import native, sockopts, udp

def open_ahead(ls: native.ListenSocket, netns_pid: int) -> int:
    """A fresh unbound socket for `ls`, made in netns_pid's network namespace, options set
    as a bind needs them: our fd. SO_REUSEADDR is on for the bind (connections of the killed
    original lingering in TIME_WAIT must not block the port); listen() sets the original's."""
    try:
        s = native.netns_socket(netns_pid, ls.family, ls.type, ls.protocol)
    except native.CRError as e:
        raise native.CRError(e.errno, f"listening socket fd {ls.fd}: {e}") from e
    try:
        if ls.filter:
            sockopts.attach_filter(s, ls.filter)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if ls.reuseport:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if ls.family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(ls.v6only))
        for level, name, value in ls.options:
            s.setsockopt(level, name, value)
        for ifindex, group in ls.groups:
            s.setsockopt(*udp.join_request(ifindex, group))
    except OSError as e:
        s.close()
        raise _failed(ls, "options", e) from e
    except BaseException:
        s.close()
        raise
    return s.detach()


def listen(ls: native.ListenSocket, fd: int) -> None:
    """Bind the socket open_ahead gave (ours; still open after) to ls's address and listen
    with its backlog (a UDP socket: bind if it was bound, connect to its peer if it had
    one): from now on the carrier's process holds it."""
    with socket.socket(fileno=os.dup(fd)) as s:
        try:
            if ls.addr:
                s.bind(address(ls.family, ls.addr))
            if ls.listens:
                s.listen(ls.backlog)
            if ls.peer:
                s.connect(address(ls.family, ls.peer))
            if not ls.reuseaddr:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        except OSError as e:
            raise _failed(ls, "bind and listen", e) from e


def address(family: int, raw: bytes) -> tuple:
    """The address Python's bind takes for a raw sockaddr (getsockname's bytes)."""
    if family == socket.AF_INET and len(raw) >= 8:
        return socket.inet_ntop(family, raw[4:8]), struct.unpack("!H", raw[2:4])[0]
    if family == socket.AF_INET6 and len(raw) >= 28:
        (port,) = struct.unpack("!H", raw[2:4])
        (flow,) = struct.unpack("!I", raw[4:8])
        (scope,) = struct.unpack("=I", raw[24:28])
        return socket.inet_ntop(family, raw[8:24]), port, flow, scope
    if family == socket.AF_NETLINK and len(raw) >= 12:
        return struct.unpack_from("=II", raw, 4)       # nl_pid, nl_groups
    raise native.CRError(errno.EAFNOSUPPORT,
                         f"a listening socket of family {family} ({len(raw)} address bytes)")


def _failed(ls: native.ListenSocket, step: str, e: OSError) -> native.CRError:
    where = f" ({address(ls.family, ls.addr)[:2]})" if ls.addr else ""
    return native.CRError(e.errno or errno.EIO,
                          f"{ls.kind} fd {ls.fd}{where}: {step}: {e.strerror or e}")
