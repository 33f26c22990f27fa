"""The kernel's sock_diag netlink family, the only place it tells a unix socket's peer
and lists (and destroys) TCP connections no process holds (TIME_WAIT). A socket made in a
sandbox's network namespace asks about that namespace only."""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator

from . import native

NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, SOCK_DESTROY = 4, 20, 21
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP, NLMSG_DONE, NLMSG_ERROR = 1, 4, 0x300, 3, 2
_NLMSG = struct.Struct("=IHHII")


def open_in(netns_pid: int) -> socket.socket:
    """A sock_diag socket in netns_pid's network namespace."""
    return native.netns_socket(netns_pid, socket.AF_NETLINK, socket.SOCK_RAW,
                               NETLINK_SOCK_DIAG)


def send(s: socket.socket, kind: int, flags: int, body: bytes) -> None:
    s.send(_NLMSG.pack(_NLMSG.size + len(body), kind, flags | NLM_F_REQUEST, 0, 0) + body)


def replies(s: socket.socket, what: str) -> Iterator[bytes]:
    """The bodies of a request's answers, up to its end (NLMSG_DONE, or the
    acknowledgement); an error answer raises OSError naming `what` (but ENOENT: the
    object went meanwhile)."""
    while True:
        buf = s.recv(1 << 16)
        if not buf:
            return
        at = 0
        while at + _NLMSG.size <= len(buf):
            length, kind, _, _, _ = _NLMSG.unpack_from(buf, at)
            body = buf[at + _NLMSG.size:at + length]
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", body)[0]
                if code and code != errno.ENOENT:
                    raise OSError(code, f"sock_diag of {what}: {os.strerror(code)}")
                return
            yield body
            at += (length + 3) & ~3
