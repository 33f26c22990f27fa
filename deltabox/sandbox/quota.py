"""Disk quota for a sandbox's writable layer: btrfs *simple quotas* (Linux >= 6.7).

A writable layer is a btrfs subvolume (deltabox/fs/store.py). With simple quotas enabled on
the store, every extent is charged to the subvolume that allocated it, and a qgroup limit on
the layer's subvolume makes writes beyond it fail with EDQUOT ("Disk quota exceeded") inside
the sandbox, before the shared store fills up. Unlike full btrfs qgroups, simple quotas do no
backref walking: snapshots and subvolume deletion cost the same as without quotas (measured
here: a snapshot 1.5 ms either way).

What the limit counts: bytes written into the layer since it was created. A rollback or a
fork gets a fresh writable snapshot whose inherited data is charged to the layer that wrote
it, so its count starts at zero (the limit is per file-system generation, not per family).

Enabling simple quotas is a property of the whole file system: the daemon does it on the
embedded loop store it owns; on an administrator's btrfs it should be asked for explicitly.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

from .. import kernfs
from ..errors import FailedPrecondition

_IOC_WRITE, _IOC_READ = 1, 2
_MAGIC = 0x94


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (_MAGIC << 8) | nr


# struct btrfs_ioctl_quota_ctl_args { __u64 cmd; __s64 status; }
BTRFS_IOC_QUOTA_CTL = _ioc(_IOC_READ | _IOC_WRITE, 40, 16)
# struct btrfs_ioctl_qgroup_limit_args { __u64 qgroupid; struct btrfs_qgroup_limit {
#     __u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl; } lim; }  (declared _IOR)
BTRFS_IOC_QGROUP_LIMIT = _ioc(_IOC_READ, 43, 48)
BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 4
BTRFS_QGROUP_LIMIT_MAX_RFER = 1
BTRFS_QGROUP_LIMIT_MAX_EXCL = 2
BTRFS_SUPER_MAGIC = 0x9123683E


def _is_btrfs(path: Path) -> bool:
    try:
        return kernfs.fs_type(path) == BTRFS_SUPER_MAGIC
    except OSError:
        return False


def supported(store_root: Path) -> bool:
    """True if store_root is on btrfs (simple-quota support is learned by enable())."""
    return _is_btrfs(store_root)


def enable(store_root: Path) -> None:
    """Enable simple quotas on the file system of store_root (idempotent, a few ms).

    Raises FailedPrecondition when the kernel has no simple quotas (before 6.7) or the
    file system already runs full qgroups."""
    fd = os.open(store_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        buf = bytearray(struct.pack("=Qq", BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0))
        try:
            fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, buf)
        except OSError as e:
            if e.errno == errno.EEXIST:
                return
            raise FailedPrecondition(
                f"cannot enable btrfs simple quotas on {store_root}: {e.strerror} (needs "
                "Linux >= 6.7 and a file system without full qgroups)") from e
    finally:
        os.close(fd)


def limit(layer: Path, max_bytes: int) -> None:
    """Limit what the subvolume `layer` may allocate (0 = no limit)."""
    fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL
        big = max_bytes if max_bytes > 0 else (1 << 64) - 1
        # qgroupid 0: the qgroup of the subvolume the fd is in.
        buf = bytearray(struct.pack("=QQQQQQ", 0, flags, big, big, 0, 0))
        try:
            fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, buf)
        except OSError as e:
            raise FailedPrecondition(f"cannot set a quota of {max_bytes} bytes on {layer}: "
                                     f"{e.strerror}") from e
    finally:
        os.close(fd)
