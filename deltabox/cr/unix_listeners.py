"""Listening unix sockets bound to a name: `multiprocessing.managers` (a socket file in
/tmp/pymp-*), a server started with `--uds PATH`, a language server, Python 3.14's
forkserver (an abstract name).

At the checkpoint sock_diag gives each listener's name, type, backlog and the connections
waiting to be accepted (refused if any: a connection nobody accepted yet has no process to
come back in); a name in the file system is checked to be the socket file it was (owner and
mode kept). A restore makes a new socket in the sandbox's network namespace, binds it to
the same name (a path in the restored tree, its stale socket file replaced; an abstract
name once the killed processes have let it go) and listens, once for all the processes
that held it (a preforked server's workers). Its connections accepted before the
checkpoint come back as socket pairs (cr/eventloop.py); not preserved: the names their
getsockname and getpeername gave (a pair has none).
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass

from ..fs.files import open_in_root
from . import native

TCP_LISTEN = 10     # the unix socket states sock_diag gives are TCP's


@dataclass
class UnixListener:
    key: str                 # one object per restore, whoever holds it
    fds: list[int]           # the process's descriptors of it
    type: int                # SOCK_STREAM or SOCK_SEQPACKET
    name: str                # a path, or an abstract name (its bytes after the NUL, hex)
    abstract: bool
    backlog: int
    nonblock: bool
    mode: int = 0            # a path's socket file: permissions and owner
    uid: int = 0
    gid: int = 0


def diag_name(raw: bytes) -> tuple[str, bool]:
    """sock_diag's UNIX_DIAG_NAME as (name, abstract): a path without its NUL, or an
    abstract name's bytes (after the leading NUL) in hex (they may be anything)."""
    if raw[:1] == b"\0":
        return raw[1:].hex(), True
    return raw.rstrip(b"\0").decode(errors="surrogateescape"), False


def shown(name: str, abstract: bool) -> str:
    """A name as diag_name gives it, for messages: a path, or "@" and an abstract name."""
    return f"@{bytes.fromhex(name)!r}" if abstract else name


def describe(u: UnixListener) -> str:
    return shown(u.name, u.abstract)


def capture(pid: int, ino: int, type_: int, raw_name: bytes, waiting: int, backlog: int,
            nonblock: bool) -> UnixListener | str:
    """The listener at socket inode `ino` named `raw_name` (sock_diag's), as process `pid`
    holds it, or why not."""
    name, abstract = diag_name(raw_name)
    where = shown(name, abstract)
    if type_ not in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        return f"listening unix socket {where}: socket type {type_} is not captured"
    if waiting:
        return (f"listening unix socket {where}: {waiting} connection(s) waiting to be "
                "accepted are not captured (checkpoint once they are accepted)")
    u = UnixListener(f"unix-listen:{ino}", [], type_, name, abstract, backlog, nonblock)
    if abstract:
        return u
    owner = socket_file(pid, name)
    if isinstance(owner, str):
        return f"listening unix socket {name}: {owner}"
    u.mode, u.uid, u.gid = owner
    return u


def socket_file(pid: int, path: str) -> tuple[int, int, int] | str:
    """The permissions, owner and group of the socket file at `path` as process pid sees
    it, or why it is not that socket's file any more."""
    try:
        st = os.stat(f"/proc/{pid}/root{path}", follow_symlinks=False)
    except OSError as e:
        return f"its socket file: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return "the path is no longer its socket file"
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def make(u: UnixListener, netns_pid: int, root: int) -> int:
    """A new listener like `u`, in netns_pid's network namespace (where the next
    checkpoint's sock_diag finds it), bound to its name (a path: in the tree at `root`)
    and listening: our fd."""
    s = native.netns_socket(netns_pid, socket.AF_UNIX, u.type)
    try:
        bind_name(s, u.name, u.abstract, root, (u.mode, u.uid, u.gid))
        s.listen(u.backlog)
        s.setblocking(not u.nonblock)
        return s.detach()
    except OSError as e:
        s.close()
        raise native.CRError(e.errno or 5, f"listening unix socket {describe(u)}: "
                             f"{e.strerror}") from None
    except BaseException:
        s.close()
        raise


def bind_name(s: socket.socket, name: str, abstract: bool, root: int,
              owner: tuple[int, int, int]) -> None:
    """Bind s to `name`: an abstract one (hex, diag_name's) in s's network namespace, or a
    path in the tree at `root` with its socket file's (mode, uid, gid) `owner`."""
    if abstract:
        s.bind(b"\0" + bytes.fromhex(name))
    else:
        _bind_path(s, name, root, owner)


def _bind_path(s: socket.socket, path: str, root: int, owner: tuple[int, int, int]) -> None:
    """Bind to `path` in the tree at `root` (resolved in that tree only, and the
    socket's name: until stop 50 it was bound through its directory's /proc/self/fd link,
    which became its name, so the next checkpoint looked for a socket file there and
    refused), the checkpoint's stale socket file replaced, owner and mode as they were."""
    mode, uid, gid = owner
    parent, base = os.path.split(path)
    d = open_in_root(root, parent or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            if stat.S_ISSOCK(os.stat(base, dir_fd=d, follow_symlinks=False).st_mode):
                os.unlink(base, dir_fd=d)
        except FileNotFoundError:
            pass
        native.root_bind(root, s, path)
        os.chown(base, uid, gid, dir_fd=d, follow_symlinks=False)
        os.chmod(base, mode, dir_fd=d)
    finally:
        os.close(d)
