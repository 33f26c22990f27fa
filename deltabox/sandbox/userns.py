"""The optional user namespace of a sandbox: its uids and gids 0..count-1 are the host's
base..base+count-1, so sandbox root is not host root.

The namespaces are made by the native helpers (dbx-init writes the maps, dbx-mkroot mounts
the layers idmapped so that their on-disk ids stay the sandbox's own, dbx-enter joins it).
What the daemon itself does on the sandbox's behalf lives here: finding a sandbox's user
namespace from its init's pidfd, and writing into its file system as its root.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import FailedPrecondition

# ioctl(pidfd, PIDFD_GET_USER_NAMESPACE): an fd of the process's user namespace (Linux 6.11;
# <linux/pidfd.h> _IO(PIDFS_IOCTL_MAGIC 0xFF, 9)). Unlike /proc/<pid>/ns/user it cannot
# name a recycled pid.
_PIDFD_GET_USER_NAMESPACE = 0xFF09
_SYS_SETFSUID, _SYS_SETFSGID = 122, 123  # x86_64
_PR_GET_SECUREBITS, _PR_SET_SECUREBITS = 27, 28
_SECBIT_NO_SETUID_FIXUP = 1 << 2
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True, slots=True)
class IdMap:
    """Sandbox ids 0..count-1 are host ids base..base+count-1 (the same for uids and gids)."""

    base: int
    count: int

    @classmethod
    def parse(cls, text: str) -> IdMap:
        """`BASE:COUNT`, as `deltaboxd --userns-range` takes it."""
        try:
            base, count = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"{text!r}: want BASE:COUNT, e.g. 100000:65536") from None
        if base <= 0 or count <= 0 or base + count > 0xFFFFFFFF:
            raise ValueError(f"{text!r}: BASE must be > 0 (host root is never mapped), COUNT "
                             "> 0 and BASE+COUNT <= 4294967295")
        return cls(base, count)

    @property
    def arg(self) -> str:
        return f"{self.base}:{self.count}"

    def to_sandbox(self, host_id: int) -> int:
        """A host id as the sandbox sees it (an unmapped one shows as nobody, 65534)."""
        inside = host_id - self.base
        return inside if 0 <= inside < self.count else 65534


def userns_of(pidfd: int) -> int:
    """An fd of the user namespace of the process behind `pidfd` (caller closes it)."""
    try:
        return fcntl.ioctl(pidfd, _PIDFD_GET_USER_NAMESPACE)
    except OSError as e:
        if e.errno in (errno.ENOTTY, errno.EINVAL):
            raise FailedPrecondition("sandboxes with a user namespace need Linux >= 6.11 "
                                     "(PIDFD_GET_USER_NAMESPACE)") from e
        raise


def _check(rc: int, what: str) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _set_fsids(uid: int, gid: int) -> None:
    """setfsuid/setfsgid of the calling thread only (raw system calls: glibc broadcasts
    setresuid to every thread, not these); they return the previous id, never an error,
    so the result is read back."""
    _libc.syscall(_SYS_SETFSGID, gid)
    _libc.syscall(_SYS_SETFSUID, uid)
    if (_libc.syscall(_SYS_SETFSUID, -1) & 0xFFFFFFFF,
            _libc.syscall(_SYS_SETFSGID, -1) & 0xFFFFFFFF) != (uid, gid):
        raise OSError(errno.EPERM, f"setfsuid/setfsgid {uid}/{gid} refused")


@contextmanager
def acting_as_root_of(ids: IdMap) -> Iterator[None]:
    """Run the block's file operations (in this thread only) as the sandbox's root.

    Its layers are mounted idmapped, and a file created through them by host uid 0 (not
    mapped in the sandbox) fails with EOVERFLOW: the daemon's files API creates with fsuid
    and fsgid `ids.base` instead, keeping its capabilities (SECBIT_NO_SETUID_FIXUP: else the
    kernel clears CAP_DAC_OVERRIDE and friends when fsuid leaves 0). Meant for a worker
    thread (trio.to_thread): credentials are per thread, and everything is put back."""
    bits = _libc.prctl(_PR_GET_SECUREBITS, 0, 0, 0, 0)
    _check(bits, "PR_GET_SECUREBITS")
    _check(_libc.prctl(_PR_SET_SECUREBITS, bits | _SECBIT_NO_SETUID_FIXUP, 0, 0, 0),
           "PR_SET_SECUREBITS")
    try:
        _set_fsids(ids.base, ids.base)
        yield
    finally:
        _set_fsids(0, 0)
        _check(_libc.prctl(_PR_SET_SECUREBITS, bits, 0, 0, 0), "PR_SET_SECUREBITS")
