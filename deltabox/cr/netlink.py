"""Netlink sockets of a sandbox process: what it takes to make one again (its protocol, its
port id, its multicast groups, its peer, its options and filter), and what cannot be
captured.

A program that follows the network's changes (Chromium's address tracker on
NETLINK_ROUTE), watches devices (libudev's monitor on NETLINK_KOBJECT_UEVENT) or asks the
kernel about sockets (NETLINK_SOCK_DIAG) keeps a netlink socket open for its whole life.
For these three protocols the kernel keeps nothing for a socket but what it reads back:
its port id and groups (getsockname, NETLINK_LIST_MEMBERSHIPS), its peer (getpeername),
its flags (sockopts.py) and its filter. A copy bound to the same port id (free again in
a rollback once the killed original is gone, and free in a fork's own network
namespace), in the same groups, is the same socket to its process once nothing waits in
it. It is made like a UDP socket (listeners.py, native recreate_listen): bound if the
original was, connected if it was, never listening.

Refused, naming the socket: another protocol (their kernel side keeps state for the
socket's port that a copy would not get back: an audit daemon's registration, a netfilter
queue's binding, a generic netlink family's listeners, a connector's subscription), one
made in another network namespace than its process's, a message waiting to be read, an
error waiting (ENOBUFS after an overrun), a dump still being answered, more groups past
the first 32 than options a copy takes.
"""

from __future__ import annotations

import dataclasses
import socket
import struct

from .. import kernfs
from . import native, sockopts, udp

PROTOCOLS = {0: "NETLINK_ROUTE", 4: "NETLINK_SOCK_DIAG", 15: "NETLINK_KOBJECT_UEVENT"}
_OTHERS = {6: "NETLINK_XFRM", 9: "NETLINK_AUDIT", 11: "NETLINK_CONNECTOR",
           12: "NETLINK_NETFILTER", 16: "NETLINK_GENERIC"}
_ADD_MEMBERSHIP, _LIST_MEMBERSHIPS = 1, 9
_SOCKADDR_NL = struct.Struct("=HxxII")   # nl_family, nl_pad, nl_pid, nl_groups


def is_netlink(f: native.FdInfo) -> bool:
    k = f.socket
    return k is not None and k.family == "netlink"


def dumping(pid: int) -> set[int]:
    """The inodes of pid's network namespace's netlink sockets a dump is still being
    answered on (/proc/PID/net/netlink's Dump column): read once per process."""
    out = set()
    try:
        lines = kernfs.read(f"/proc/{pid}/net/netlink").decode().splitlines()[1:]
    except OSError:
        return out
    for line in lines:   # sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
        cols = line.split()
        if len(cols) >= 10 and cols[6] != "0":
            out.add(int(cols[9]))
    return out


def capture(pid: int, f: native.FdInfo, busy: set[int]
            ) -> tuple[native.ListenSocket | None, str | None]:
    """What it takes to make pid's netlink socket at f again, and why it cannot be
    captured now (or None). Read from our own copy (pidfd_getfd), with calls that change
    nothing in it (poll, no peek, no SO_ERROR). `busy`: dumping(pid)."""
    with socket.socket(fileno=native.copy_fd(pid, f.fd)) as s:
        protocol = s.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL)
        if protocol not in PROTOCOLS:
            name = _OTHERS.get(protocol, f"netlink protocol {protocol}")
            return None, (f"a {name} socket: only NETLINK_ROUTE, NETLINK_SOCK_DIAG and "
                          "NETLINK_KOBJECT_UEVENT sockets are made again (the kernel keeps "
                          "state for the others' ports that a copy would not get back)")
        why = udp.elsewhere(pid, s) or _unsettled(s, f.inode in busy)
        portid, low = s.getsockname()
        dst_pid, dst_groups = s.getpeername()
        groups = memberships(s)
        bound = portid != 0
        # A bind sets the first 32 groups and keeps the others: those past 32 (all of them
        # for a socket never bound) are added as options before it.
        extra = [g for g in groups if g > 32 or not bound]
        ls = sockopts.remade(
            pid, f, s, sockopts.NETLINK,
            addr=_SOCKADDR_NL.pack(socket.AF_NETLINK, portid, low) if bound else b"",
            peer=(_SOCKADDR_NL.pack(socket.AF_NETLINK, dst_pid, dst_groups)
                  if dst_pid or dst_groups else b""),
            backlog=0)
        options = ls.options + tuple((sockopts.SOL_NETLINK, _ADD_MEMBERSHIP, g)
                                     for g in extra)
        if len(options) > native.SOCKOPTS:
            raise native.CRError(22, f"{len(extra)} netlink groups and {len(ls.options)} "
                                 f"options (at most {native.SOCKOPTS} in all are made again)")
    return dataclasses.replace(ls, options=options), why


def memberships(s: socket.socket) -> list[int]:
    """The numbers (from 1) of the multicast groups s is a member of."""
    raw = s.getsockopt(sockopts.SOL_NETLINK, _LIST_MEMBERSHIPS, 512)
    words = struct.unpack(f"={len(raw) // 4}I", raw[:len(raw) // 4 * 4])
    return [32 * i + b + 1 for i, w in enumerate(words) for b in range(32) if w >> b & 1]


def _unsettled(s: socket.socket, dump: bool) -> str | None:
    """Why this socket holds state a fresh one would not have, or None."""
    data, error, _wmem = udp.waiting(s)
    if data:
        return ("a message waits to be read: not captured; checkpoint once the process "
                "has read it")
    if error:
        return ("an error waits to be read (ENOBUFS: messages were lost): not captured; "
                "checkpoint once the process has read it")
    if dump:
        return ("a dump is still being answered: not captured; checkpoint once the "
                "process has read it to the end")
    return None
