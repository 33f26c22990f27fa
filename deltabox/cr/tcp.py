"""TCP connections between processes of the sandbox: a client and its server on loopback
(a Jupyter kernel and its client over ZeroMQ, an app and its redis or postgres, a test
client on a dev server with keep-alive).

A template shares the connection with the live process, which goes on using it, and a
restore in the same network namespace needs the connection's addresses free. At the
checkpoint (every process stopped) each connection's two ends are read with the kernel's
repair mode (TCP_REPAIR, what CRIU uses; taken on our own copy of the descriptor and
left again, silently, before the processes run): sequence numbers, the bytes waiting in
the receive queue and those sent but not yet acknowledged, windows, timestamp clock, MSS,
window scaling, SACK and timestamp options, and the socket options programs set
(TCP_NODELAY, keep-alive and its timers). Templates drop their copies (as of listeners),
so nothing but the live process holds the connection after the checkpoint. A restore makes
both ends at once, in repair mode: bound to their addresses, given their sequence numbers,
"connected" without a handshake, their queues filled, their windows and options set, then
let go of repair mode; each restored process gets its end at its fds. At a rollback the
killed processes' connections are closed silently first (repair mode again: no FIN, no
RST, no TIME_WAIT), so the restored ends can take their addresses. A carrier made ahead of
a rollback holds its ends as fresh sockets in repair mode (open_ends); the rollback makes
them the connection (connect_ends) once the killed processes have exited, before any
process runs.

Half-closed connections come back half-closed (stop 73): an end that has sent its FIN
(FIN_WAIT2: `shutdown(SHUT_WR)`) or received one (CLOSE_WAIT: the peer shut down or closed)
is read as established, its sequence numbers counting the FIN (`fin_out`, `fin_in`). A
restore makes the connection as it was before the FIN, lets go of repair mode, and has the
end that sent it shut down for writing: the kernel sends the FIN again, the ends reach their
states by themselves, the reader gets its bytes then end-of-file. The commonest case is a
server's CLOSE_WAIT whose client closed and exited (a keep-alive server the checkpoint froze
between its client's close and its own): no process holds the client's end, an orphan in
FIN_WAIT2 (or gone). Its state is the server end's mirrored (orphan_peer); the restore makes
it, sends its FIN and closes it, an orphan again. At a rollback the killed timeline's orphan
on those addresses is dropped first (clear_orphans).

Refused, with the reason: a connection whose other end no process of the sandbox holds (to
or from outside the sandbox) but such an orphan, one in any other state (a FIN not yet
acknowledged, both ends shut down), a CLOSE_WAIT end with bytes its closed peer has not
acknowledged, more than MAX_QUEUED bytes queued. A server's accepted connection shares its
listener's port, and the listener restored beside it binds only if both have SO_REUSEADDR:
the restored ends have it until every process is restored (settle_ends then sets the
original's, their listener's). Connections in TIME_WAIT on a port that a listener without
SO_REUSEADDR binds again are dropped first (clear_time_wait). Not preserved: congestion
state (the window starts again from the kernel's initial one, as after an idle period),
other socket options (buffer sizes stay automatic), urgent data; an orphan's own timeout
(a restored one waits the system's tcp_fin_timeout, not its TCP_LINGER2).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import native, sockdiag, sockopts

MAX_QUEUED = 4 << 20
TCP_REPAIR, TCP_REPAIR_QUEUE, TCP_QUEUE_SEQ, TCP_REPAIR_OPTIONS = 19, 20, 21, 22
TCP_TIMESTAMP, TCP_REPAIR_WINDOW = 24, 29
TCP_NO_QUEUE, TCP_RECV_QUEUE, TCP_SEND_QUEUE = 0, 1, 2
TCP_REPAIR_ON, TCP_REPAIR_OFF_NO_WP = 1, -1
TCPOPT_MSS, TCPOPT_WINDOW, TCPOPT_SACK_PERM, TCPOPT_TIMESTAMP = 2, 3, 4, 8
TCPI_OPT_TIMESTAMPS, TCPI_OPT_SACK, TCPI_OPT_WSCALE = 1, 2, 4
TCP_ESTABLISHED, TCP_FIN_WAIT2, TCP_TIME_WAIT, TCP_CLOSE_WAIT = 1, 5, 6, 8
_HALF_CLOSED = {TCP_FIN_WAIT2: "fin-wait2", TCP_CLOSE_WAIT: "close-wait"}
_INET_REQ = struct.Struct("=BBBBI")   # inet_diag_req_v2: family protocol ext pad states, id
_ID_SIZE = 48                          # struct inet_diag_sockid (sport first, big-endian)
_INET_MSG_ID = 4                       # inet_diag_msg: family state timer retrans, id
_WINDOW = struct.Struct("=5I")   # struct tcp_repair_window: snd_wl1 snd_wnd max_window
#                                   rcv_wnd rcv_wup
_KEEPALIVE_OPTS = (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)


@dataclass
class End:
    """One end of a connection as the kernel holds it at the checkpoint."""
    local: list                          # getsockname() (host, port[, flow, scope])
    remote: list
    send_seq: int                        # the send queue's end (next byte to be queued)
    recv_seq: int                        # the receive queue's end (next byte expected)
    send_data: bytes                     # sent, not yet acknowledged
    recv_data: bytes                     # received, not yet read
    window: bytes                        # struct tcp_repair_window
    timestamp: int                       # the socket's timestamp clock (TCP_TIMESTAMP)
    mss: int
    options: int                         # tcpi_options
    snd_wscale: int
    rcv_wscale: int
    nonblock: bool
    nodelay: bool
    keepalive: list[int] | None          # idle, interval, count when SO_KEEPALIVE is on
    reuseaddr: bool = False              # an accepted end has its listener's
    fin_in: bool = False                 # a FIN received: recv_seq counts it (CLOSE_WAIT)
    fin_out: bool = False                # a FIN sent: send_seq counts it (FIN_WAIT2)
    # its other options away from a fresh socket's (sockopts.TCP_CONNECTION; since stop 67)
    opts: tuple[sockopts.Option, ...] = ()


@dataclass
class TcpConn:
    """A connection as one process holds it: `a` and `b` its fds on each end (either may
    be empty: that end is another process's); `key` names the connection across the
    processes; `ends` both ends' state (a first, the one with the lower address; but
    with `orphan`, b is the end no process holds, orphan_peer)."""
    key: str
    family: int
    a: list[int] = field(default_factory=list)
    b: list[int] = field(default_factory=list)
    ends: list[End] = field(default_factory=list)
    orphan: bool = False


def is_connection(f: native.FdInfo) -> bool:
    """A TCP connection, established (socket.state "connected") or half-closed."""
    k = f.socket
    return (f.kind == "socket" and k is not None and k.family in ("inet", "inet6") and
            k.type == "tcp" and k.state in ("connected", *_HALF_CLOSED.values()))


def _i32(v: int) -> int:
    """A sequence number as the int setsockopt takes (the kernel's u32, signed)."""
    return (v + (1 << 31)) % (1 << 32) - (1 << 31)


@contextlib.contextmanager
def _repair(s: socket.socket) -> Iterator[None]:
    """Repair mode on `s` for the block; left without a window probe (nothing is sent) and
    with its SO_REUSEADDR as it was: leaving repair mode clears it (the kernel sets
    sk_reuse to SK_NO_REUSE). Until stop 74 each checkpoint cleared it on the live
    process's connections, so a server's connection closed after a checkpoint left a
    TIME_WAIT no SO_REUSEADDR bind could share: the server, restarted, could not bind
    its port for a minute."""
    reuse = s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_ON)
    try:
        yield
    finally:
        s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_NO_QUEUE)
        s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP)
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)


def _queue_seq(s: socket.socket) -> int:
    return s.getsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ) & 0xFFFFFFFF


def _peek(s: socket.socket, size: int) -> bytes:
    return s.recv(size, socket.MSG_PEEK | socket.MSG_DONTWAIT) if size else b""


def _recv_queue(s: socket.socket, tries: int = 8) -> tuple[int, bytes]:
    """The receive queue's end sequence number and its bytes (peeked: they stay). Bytes
    still arrive while every process is stopped: the sender's kernel sends what it held
    back (Nagle) once an ACK comes, in its softirq. So the end is read again after the
    bytes, until it stayed put: the bytes are then exactly those before it."""
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE)
    for _ in range(tries):
        seq = _queue_seq(s)
        size = int.from_bytes(_ioctl_int(s, 0x541B), "little")   # SIOCINQ (FIONREAD)
        data = _peek(s, size)
        if _queue_seq(s) == seq and len(data) == size:
            return seq, data
    raise OSError(0, f"bytes kept arriving in the receive queue through {tries} reads")


def _send_queue(s: socket.socket, size: int) -> tuple[int, bytes]:
    """The send queue's end sequence number and its bytes not yet acknowledged (peeked).
    Its end stays put (its process is stopped), but ACKs still come (a delayed ACK's
    timer runs in the peer's kernel): fewer than `size` bytes may be left to peek, the
    queue's last ones, and the peer has received the others."""
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)
    return _queue_seq(s), _peek(s, size)


def read_end(pid: int, fd: int) -> End | str:
    """The state of the connection end pid holds at fd, or why it cannot be read."""
    with socket.socket(fileno=native.copy_fd(pid, fd)) as s:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        if info[0] != TCP_ESTABLISHED and info[0] not in _HALF_CLOSED:
            return (f"closing ({native.TCP_STATES.get(info[0], info[0])}: a FIN not yet "
                    "acknowledged, or both ends shut down): not captured; checkpoint once "
                    "it is closed")
        outq = int.from_bytes(_ioctl_int(s, 0x5411), "little")   # SIOCOUTQ (TIOCOUTQ)
        inq = int.from_bytes(_ioctl_int(s, 0x541B), "little")    # SIOCINQ (FIONREAD)
        if inq > MAX_QUEUED or outq > MAX_QUEUED:
            return f"{inq} + {outq} bytes queued (more than {MAX_QUEUED} are not captured)"
        keep = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
        end = dict(local=list(s.getsockname()), remote=list(s.getpeername()),
                   mss=s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG),
                   options=info[5], snd_wscale=info[6] & 0xF, rcv_wscale=info[6] >> 4,
                   nonblock=not s.getblocking(),
                   nodelay=bool(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)),
                   reuseaddr=bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)),
                   keepalive=[s.getsockopt(socket.IPPROTO_TCP, o) for o in _KEEPALIVE_OPTS]
                   if keep else None,
                   opts=sockopts.differing(None, s, sockopts.TCP_CONNECTION),
                   fin_in=info[0] == TCP_CLOSE_WAIT, fin_out=info[0] == TCP_FIN_WAIT2)
        with _repair(s):
            recv_seq, recv_data = _recv_queue(s)
            send_seq, send_data = _send_queue(s, outq)
            s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_NO_QUEUE)
            window = s.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR_WINDOW, _WINDOW.size)
            stamp = s.getsockopt(socket.IPPROTO_TCP, TCP_TIMESTAMP) & 0xFFFFFFFF
    return End(send_seq=send_seq, recv_seq=recv_seq, send_data=send_data,
               recv_data=recv_data, window=window, timestamp=stamp, **end)


def orphan_peer(e: End) -> End | str:
    """The end no process holds of e's connection, e in CLOSE_WAIT: its peer closed after
    its FIN (an orphan in FIN_WAIT2, or gone since), made from e's state mirrored. Its
    receive queue is empty (a closed socket's bytes are dropped) and it has nothing to
    send: what e received is taken as acknowledged, its window as e's advertised one."""
    if not e.fin_in or e.fin_out:
        return "connected to an address no process of the sandbox holds"
    if e.send_data:
        return (f"half-closed by a peer that closed, with {len(e.send_data)} bytes it has "
                "not acknowledged (it answers them with a reset): checkpoint once that "
                "came")
    _, snd_wnd, max_window, rcv_wnd, _ = _WINDOW.unpack(e.window)
    window = _WINDOW.pack(e.send_seq, rcv_wnd, max(max_window, rcv_wnd), snd_wnd, e.send_seq)
    return End(local=e.remote, remote=e.local, send_seq=e.recv_seq, recv_seq=e.send_seq,
               send_data=b"", recv_data=b"", window=window, timestamp=e.timestamp,
               mss=e.mss, options=e.options, snd_wscale=e.rcv_wscale,
               rcv_wscale=e.snd_wscale, nonblock=False, nodelay=False, keepalive=None,
               fin_out=True)


def pair_refusal(a: End, b: End) -> str | None:
    """Why two ends read at once do not make one connection's state, or None: a FIN one
    sent that the other has not received is on its way (both stopped on the loopback,
    it is seldom)."""
    if a.fin_out != b.fin_in or b.fin_out != a.fin_in:
        return "a FIN on its way between the two ends: checkpoint once it arrived"
    return None


def _ioctl_int(s: socket.socket, req: int) -> bytes:
    return fcntl.ioctl(s.fileno(), req, b"\0\0\0\0")


def _options(e: End) -> bytes:
    """struct tcp_repair_opt entries for the options the connection negotiated."""
    out = struct.pack("=II", TCPOPT_MSS, e.mss)
    if e.options & TCPI_OPT_WSCALE:
        out += struct.pack("=II", TCPOPT_WINDOW, e.snd_wscale | e.rcv_wscale << 16)
    if e.options & TCPI_OPT_SACK:
        out += struct.pack("=II", TCPOPT_SACK_PERM, 0)
    if e.options & TCPI_OPT_TIMESTAMPS:
        out += struct.pack("=II", TCPOPT_TIMESTAMP, 0)
    return out


def _address(family: int, addr: list) -> tuple:
    return (addr[0], addr[1]) if family == socket.AF_INET else tuple(addr)


def _made(s: socket.socket, family: int, e: End) -> None:
    """Turn the fresh socket `s` (in repair mode: open_ends) into end `e`, still in
    repair mode."""
    s.bind(_address(family, e.local))
    # A queue's sequence number is where its bytes start: putting them back moves it on.
    # A FIN is made again after (connect_ends): the sequence numbers before it.
    recv_seq, send_seq = (e.recv_seq - e.fin_in) % (1 << 32), (e.send_seq - e.fin_out) % (1 << 32)
    for q, seq, data in ((TCP_RECV_QUEUE, recv_seq, e.recv_data),
                         (TCP_SEND_QUEUE, send_seq, e.send_data)):
        s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, q)
        s.setsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ, _i32(seq - len(data)))
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_NO_QUEUE)
    s.connect(_address(family, e.remote))        # in repair mode: no handshake
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_OPTIONS, _options(e))
    s.setsockopt(socket.IPPROTO_TCP, TCP_TIMESTAMP, _i32(e.timestamp))
    for q, data in ((TCP_SEND_QUEUE, e.send_data), (TCP_RECV_QUEUE, e.recv_data)):
        if data:
            s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, q)
            s.sendall(data)
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_NO_QUEUE)
    # Checked against the receive queue's end: set once the bytes are back. Before the FIN
    # received, the window's left edge (acknowledged up to) is before it too.
    window = e.window
    if e.fin_in:
        wl1, wnd, mx, rwnd, wup = _WINDOW.unpack(window)
        window = _WINDOW.pack(wl1, wnd, mx, rwnd, wup if wup != e.recv_seq else recv_seq)
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_WINDOW, window)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(e.nodelay))
    if e.keepalive is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, v in zip(_KEEPALIVE_OPTS, e.keepalive):
            s.setsockopt(socket.IPPROTO_TCP, opt, v)
    sockopts.set_all(s, e.opts)


def open_ends(c: TcpConn, netns_pid: int) -> tuple[int, int]:
    """Two fresh TCP sockets for c's ends, made in netns_pid's network namespace and put
    in repair mode, not bound yet: a carrier made ahead of a rollback holds them while
    the live connection still has their addresses (connect_ends, at the rollback, makes
    them the connection). Our fds (a, b)."""
    made: list[socket.socket] = []
    try:
        for _ in c.ends:
            s = native.netns_socket(netns_pid, c.family, socket.SOCK_STREAM)
            made.append(s)
            # Before anything else: SO_REUSEADDR set later would undo repair's forced reuse.
            s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_ON)
    except OSError as e:
        for s in made:
            s.close()
        raise _restoring(c, e) from e
    except BaseException:
        for s in made:
            s.close()
        raise
    a, b = made
    return a.detach(), b.detach()


def connect_ends(c: TcpConn, fds: tuple[int, int]) -> None:
    """Make the two sockets open_ends gave (ours; still open after) c's connection and let
    them out of repair mode: the processes that hold them can use it."""
    made = [socket.socket(fileno=os.dup(fd)) for fd in fds]
    try:
        for s, e in zip(made, c.ends):
            _made(s, c.family, e)
        for s, e in zip(made, c.ends):   # both exist: neither is reset by the other's stack
            s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP)
            # Leaving repair mode clears SO_REUSEADDR. An accepted end shares its
            # listener's port, and the listener restored beside it binds only if both
            # have it: on until settle_ends sets the original's, once listeners are bound.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setblocking(not e.nonblock)
        for s, e in zip(made, c.ends):   # half-closed: the FIN sent again (module doc)
            if e.fin_out:
                s.shutdown(socket.SHUT_WR)
    except OSError as e:
        raise _restoring(c, e) from e
    finally:
        for s in made:
            s.close()


def settle_ends(c: TcpConn, fds: tuple[int, int]) -> None:
    """Give c's restored ends (ours) their original SO_REUSEADDR (an accepted end has its
    listener's), once every listener of the restore is bound (a bind checks it; nothing
    after does)."""
    for fd, e in zip(fds, c.ends):
        if not e.reuseaddr:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)


def _restoring(c: TcpConn, e: OSError) -> native.CRError:
    return native.CRError(e.errno or errno.EIO, f"restoring the TCP connection {c.key}: {e}")


def new_connection(c: TcpConn, netns_pid: int) -> tuple[int, int]:
    """Both ends of c, made in netns_pid's network namespace: our fds (a, b)."""
    a, b = open_ends(c, netns_pid)
    try:
        connect_ends(c, (a, b))
    except BaseException:
        os.close(a)
        os.close(b)
        raise
    return a, b


def clear_time_wait(netns_pid: int, ports: set[int]) -> None:
    """Drop the connections in TIME_WAIT on these local ports of netns_pid's network
    namespace. A server without SO_REUSEADDR leaves them behind each connection it closed
    first, and its listener restored by a rollback could not bind its port beside them for
    a minute; they belong to the discarded timeline (the rollback's killed processes, or
    before), nothing of the checkpoint's."""
    if ports:
        _destroy(netns_pid, 1 << TCP_TIME_WAIT, "in TIME_WAIT",
                 lambda family, sock_id: struct.unpack_from("!H", sock_id)[0] in ports)


def _destroy(netns_pid: int, states: int, what: str,
             match: Callable[[int, bytes], bool]) -> None:
    """Drop the TCP sockets in `states` (a mask) of netns_pid's network namespace whose
    struct inet_diag_sockid `match`es (sock_diag's SOCK_DESTROY)."""
    with sockdiag.open_in(netns_pid) as s:
        for family in (socket.AF_INET, socket.AF_INET6):
            ask = _INET_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, states)
            sockdiag.send(s, sockdiag.SOCK_DIAG_BY_FAMILY, sockdiag.NLM_F_DUMP,
                          ask + bytes(_ID_SIZE))
            ids = [m[_INET_MSG_ID:_INET_MSG_ID + _ID_SIZE]
                   for m in sockdiag.replies(s, f"TCP sockets {what}")
                   if match(family, m[_INET_MSG_ID:_INET_MSG_ID + _ID_SIZE])]
            for sock_id in ids:
                sockdiag.send(s, sockdiag.SOCK_DESTROY, sockdiag.NLM_F_ACK, ask + sock_id)
                for _ in sockdiag.replies(s, f"a TCP socket {what} (destroy)"):
                    pass


def orphan_addresses(conns: list[TcpConn]) -> set[tuple[str, int, str, int]]:
    """The (local host, port, remote host, port) of the ends in `conns` no process holds
    (orphan_peer): a rollback drops the killed timeline's orphan there (clear_orphans)."""
    return {(e.local[0], e.local[1], e.remote[0], e.remote[1])
            for c in conns if c.orphan for e in c.ends[1:]}


def clear_orphans(netns_pid: int, addrs: set[tuple[str, int, str, int]]) -> None:
    """Drop the sockets no process holds on these addresses in netns_pid's network
    namespace: a client's end that closed after its FIN, in FIN_WAIT2 or TIME_WAIT, would
    keep a restored orphan of the same connection from being made (its addresses taken).
    They belong to the discarded timeline."""
    if addrs:
        _destroy(netns_pid, 1 << TCP_FIN_WAIT2 | 1 << TCP_TIME_WAIT, "closing",
                 lambda family, sock_id: _diag_addresses(family, sock_id) in addrs)


def _diag_addresses(family: int, sock_id: bytes) -> tuple[str, int, str, int]:
    """struct inet_diag_sockid's addresses: ports, then 16-byte source and destination."""
    sport, dport = struct.unpack_from("!HH", sock_id)
    size = 4 if family == socket.AF_INET else 16
    src = socket.inet_ntop(family, sock_id[4:4 + size])
    dst = socket.inet_ntop(family, sock_id[20:20 + size])
    return src, sport, dst, dport


def quiet(pid: int, fd: int) -> None:
    """Put the connection pid holds at fd in repair mode: when it is closed (pid killed),
    it goes away without a FIN, a RST or a TIME_WAIT (its addresses free at once). Only
    connections on the loopback: within the sandbox's network namespace."""
    with socket.socket(fileno=native.copy_fd(pid, fd)) as s:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        if (info[0] == TCP_ESTABLISHED or info[0] in _HALF_CLOSED) and \
                is_loopback(s.getpeername()[0]):
            s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_ON)


def is_loopback(host: str) -> bool:
    """Whether the peer is on the sandbox's loopback (one outside gets its FIN)."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def quiet_all(pids: set[int]) -> None:
    """quiet() every TCP connection the processes `pids` hold (they are
    about to be killed by a rollback)."""
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
                quiet(pid, int(name))
            except OSError:
                continue  # not TCP (ENOPROTOOPT), or gone
