"""Thin btrfs bindings for DeltaFS: subvolumes, snapshots and "what changed since".

Everything here runs in the hot path of checkpoint and rollback, so it talks to the kernel
directly with ioctls on bytearrays (fcntl.ioctl, or ctypes: see _committing_ioctl), never by
spawning `btrfs`.
A call is one or two open()s plus one ioctl: tens of microseconds.

Errors are raised as deltabox.errors exceptions naming the path, the step and the errno:
ENOSPC / EDQUOT -> ResourceExhausted, everything else -> Internal. The underlying errno
is kept on the exception as `.errno` (and the OSError is chained as __cause__).
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import os
import shutil
import stat
import struct
from dataclasses import dataclass, field

from deltabox import kernfs
from deltabox.errors import DeltaBoxError, Internal, ResourceExhausted

__all__ = [
    "BTRFS_SUPER_MAGIC",
    "ChangeSummary",
    "changed_since",
    "create_subvolume",
    "delete_subvolume",
    "delete_tree",
    "generation",
    "is_btrfs",
    "is_readonly",
    "is_subvolume",
    "set_readonly",
    "snapshot",
    "sync",
]

BTRFS_SUPER_MAGIC = 0x9123683E

# --------------------------------------------------------------------------------------
# ioctl numbers: the <asm-generic/ioctl.h> encoding, computed rather than copied.
#   bits 0-7 nr, 8-15 type, 16-29 size, 30-31 direction (1 = write, 2 = read).
# --------------------------------------------------------------------------------------
_IOC_NONE, _IOC_WRITE, _IOC_READ = 0, 1, 2


def _IOC(direction: int, typ: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (typ << 8) | nr


def _IOW(typ: int, nr: int, size: int) -> int:
    return _IOC(_IOC_WRITE, typ, nr, size)


def _IOR(typ: int, nr: int, size: int) -> int:
    return _IOC(_IOC_READ, typ, nr, size)


def _IOWR(typ: int, nr: int, size: int) -> int:
    return _IOC(_IOC_READ | _IOC_WRITE, typ, nr, size)


BTRFS_IOCTL_MAGIC = 0x94

# struct btrfs_ioctl_vol_args {            4096 bytes
#     __s64 fd;                            @0
#     char  name[BTRFS_PATH_NAME_MAX + 1]; @8, 4088 bytes (NUL-terminated)
# };
_VOL_ARGS_SIZE = 4096
_VOL_ARGS_NAME_OFF = 8
_VOL_ARGS_NAME_MAX = 4087

# struct btrfs_ioctl_vol_args_v2 {         4096 bytes
#     __s64 fd;                            @0
#     __u64 transid;                       @8
#     __u64 flags;                         @16
#     union { struct { __u64 size; struct btrfs_qgroup_inherit *qgroup_inherit; };
#             __u64 unused[4]; };          @24, 32 bytes
#     union { char name[BTRFS_SUBVOL_NAME_MAX + 1];   @56, 4040 bytes
#             __u64 devid; __u64 subvolid; };
# };
_VOL_ARGS_V2_SIZE = 4096
_VOL_ARGS_V2_FLAGS_OFF = 16
_VOL_ARGS_V2_NAME_OFF = 56
_VOL_ARGS_V2_NAME_MAX = 4039

# struct btrfs_ioctl_search_key {          104 bytes, native endian
#     __u64 tree_id;                       @0   (0 = the subvolume the fd lives in)
#     __u64 min_objectid, max_objectid;    @8, @16
#     __u64 min_offset, max_offset;        @24, @32
#     __u64 min_transid, max_transid;      @40, @48 (tree blocks older than min_transid
#                                                    are skipped wholesale by the kernel)
#     __u32 min_type, max_type;            @56, @60
#     __u32 nr_items;                      @64  (in: max items, out: items returned)
#     __u32 unused;                        @68
#     __u64 unused1..unused4;              @72
# };
# struct btrfs_ioctl_search_args_v2 {      112 bytes + buffer
#     struct btrfs_ioctl_search_key key;   @0
#     __u64 buf_size;                      @104 (in: buffer size, out: size needed on EOVERFLOW)
#     __u64 buf[];                         @112
# };
# The key range is compound: (min_objectid, min_type, min_offset) .. (max_*), compared as
# one 136-bit key, so items of every type between the two ends come back.
_SEARCH_KEY = struct.Struct("=7Q4I4Q")
assert _SEARCH_KEY.size == 104
_SEARCH_ARGS_V2_HDR = 112
_SEARCH_BUF_SIZE = 64 * 1024  # bigger than any btrfs leaf item can be (nodesize <= 64 KiB)

# struct btrfs_ioctl_search_header {       32 bytes, native endian
#     __u64 transid;    generation of the leaf the item was found in
#     __u64 objectid;
#     __u64 offset;
#     __u32 type;
#     __u32 len;        length of the item data that follows
# };
_SEARCH_HEADER = struct.Struct("=QQQII")
assert _SEARCH_HEADER.size == 32

# struct btrfs_inode_item {                160 bytes, little endian, packed (on-disk format)
#     __le64 generation;   @0
#     __le64 transid;      @8   transaction that last changed this inode
#     __le64 size;         @16
#     __le64 nbytes;       @24
#     __le64 block_group;  @32
#     __le32 nlink;        @40
#     __le32 uid;          @44
#     __le32 gid;          @48
#     __le32 mode;         @52
#     __le64 rdev;         @56
#     __le64 flags;        @64
#     __le64 sequence;     @72
#     __le64 reserved[4];  @80
#     struct btrfs_timespec atime, ctime, mtime, otime;  @112, 12 bytes each
# };
_INODE_TRANSID_SIZE = struct.Struct("<QQ")  # transid, size at offset 8
_INODE_MODE = struct.Struct("<I")  # at offset 52
_INODE_MODE_OFF = 52
_INODE_ITEM_MIN_LEN = 56

# struct btrfs_ioctl_timespec { __u64 sec; __u32 nsec; };   16 bytes (not packed)
# struct btrfs_ioctl_get_subvol_info_args {  504 bytes
#     __u64 treeid;                        @0
#     char  name[BTRFS_VOL_NAME_MAX + 1];  @8, 256 bytes
#     __u64 parent_id;                     @264
#     __u64 dirid;                         @272
#     __u64 generation;                    @280
#     __u64 flags;                         @288
#     __u8  uuid[16], parent_uuid[16], received_uuid[16];   @296
#     __u64 ctransid, otransid, stransid, rtransid;         @344
#     struct btrfs_ioctl_timespec ctime, otime, stime, rtime;  @376
#     __u64 reserved[8];                   @440
# };
_SUBVOL_INFO_SIZE = 504
_SUBVOL_INFO_GENERATION_OFF = 280

BTRFS_IOC_SYNC = _IOC(_IOC_NONE, BTRFS_IOCTL_MAGIC, 8, 0)
BTRFS_IOC_SUBVOL_CREATE = _IOW(BTRFS_IOCTL_MAGIC, 14, _VOL_ARGS_SIZE)
BTRFS_IOC_SNAP_DESTROY = _IOW(BTRFS_IOCTL_MAGIC, 15, _VOL_ARGS_SIZE)
BTRFS_IOC_TREE_SEARCH_V2 = _IOWR(BTRFS_IOCTL_MAGIC, 17, _SEARCH_ARGS_V2_HDR)
BTRFS_IOC_SNAP_CREATE_V2 = _IOW(BTRFS_IOCTL_MAGIC, 23, _VOL_ARGS_V2_SIZE)
BTRFS_IOC_SUBVOL_GETFLAGS = _IOR(BTRFS_IOCTL_MAGIC, 25, 8)  # __u64
BTRFS_IOC_SUBVOL_SETFLAGS = _IOW(BTRFS_IOCTL_MAGIC, 26, 8)  # __u64
BTRFS_IOC_GET_SUBVOL_INFO = _IOR(BTRFS_IOCTL_MAGIC, 60, _SUBVOL_INFO_SIZE)
BTRFS_IOC_SNAP_DESTROY_V2 = _IOW(BTRFS_IOCTL_MAGIC, 63, _VOL_ARGS_V2_SIZE)
# struct btrfs_ioctl_fs_info_args: max_id u64, num_devices u64, fsid u8[16], ... = 1024 bytes
_FS_INFO_SIZE = 1024
BTRFS_IOC_FS_INFO = _IOR(BTRFS_IOCTL_MAGIC, 31, _FS_INFO_SIZE)

BTRFS_SUBVOL_RDONLY = 1 << 1

BTRFS_INODE_ITEM_KEY = 1
BTRFS_FIRST_FREE_OBJECTID = 256  # the subvolume's root directory; lower ids are reserved
BTRFS_LAST_FREE_OBJECTID = (1 << 64) - 256  # above this: orphan/free-space pseudo inodes
_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)  # the C library already loaded in this process
_libc.syncfs.argtypes = [ctypes.c_int]
_libc.syncfs.restype = ctypes.c_int
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_libc.statfs.restype = ctypes.c_int
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int


def _committing_ioctl(fd: int, request: int, buf: bytearray | None) -> None:
    """ioctl(fd, request, buf) for the calls that commit a transaction (create, snapshot,
    destroy: milliseconds, 20+ with a few dozen checkpoints), buf read and written in
    place; raw OSError.

    Not fcntl.ioctl: given a buffer over 1024 bytes (btrfs's vol_args are 4096) it keeps
    the GIL for the whole call, so every other thread of the daemon (the ptrace thread
    making a checkpoint's templates, the trio loop, gRPC) stood still meanwhile. ctypes
    lets go of the GIL around the call. Quick queries keep fcntl.ioctl: letting go of the
    GIL for microseconds costs a wait of up to a switch interval to get it back."""
    arg = None if buf is None else (ctypes.c_char * len(buf)).from_buffer(buf)
    if _libc.ioctl(fd, request, arg) < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------
def _error(step: str, path: str, exc: OSError) -> DeltaBoxError:
    code = exc.errno or 0
    name = _errno.errorcode.get(code, str(code))
    msg = f"btrfs {step} failed for {path!r}: {name} ({os.strerror(code) if code else exc})"
    cls = ResourceExhausted if code in (_errno.ENOSPC, _errno.EDQUOT) else Internal
    if cls is ResourceExhausted:
        msg += (": the layer store is full; free space by deleting files in sandboxes, "
                "checkpoints (`deltabox rmcp`) or sandboxes (`deltabox rm`) no longer needed, "
                "then retry")
    err = cls(msg)
    err.errno = code  # type: ignore[attr-defined]
    return err


def _open_dir(path: str, step: str) -> int:
    try:
        return os.open(path, _O_DIR)
    except OSError as e:
        raise _error(f"{step}: open", path, e) from e


def _split(path: str) -> tuple[str, bytes]:
    """(parent directory, name as bytes) of a subvolume path."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise _error("resolve name", path, OSError(_errno.EINVAL, "no final component"))
    return parent, os.fsencode(name)


def _ioctl(fd: int, request: int, buf: bytearray | None, step: str, path: str,
           commits: bool = False) -> None:
    try:
        if commits:
            _committing_ioctl(fd, request, buf)
        else:
            fcntl.ioctl(fd, request, buf, True)
    except OSError as e:
        raise _error(step, path, e) from e


# --------------------------------------------------------------------------------------
# queries
# --------------------------------------------------------------------------------------
def is_btrfs(path: str) -> bool:
    """True if `path` lives on a btrfs filesystem (statfs f_type == BTRFS_SUPER_MAGIC)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.statfs(os.fsencode(path), buf) != 0:
        code = ctypes.get_errno()
        raise _error("statfs", path, OSError(code, os.strerror(code)))
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF  # __fsword_t f_type @0
    return f_type == BTRFS_SUPER_MAGIC


def fsid(path: str) -> str:
    """The filesystem's UUID, as named under /sys/fs/btrfs/."""
    fd = _open_dir(path, "fs_info")
    try:
        buf = bytearray(_FS_INFO_SIZE)
        _ioctl(fd, BTRFS_IOC_FS_INFO, buf, "BTRFS_IOC_FS_INFO", path)
    finally:
        os.close(fd)
    h = bytes(buf[16:32]).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def pending_data_bytes(fs_uuid: str) -> int | None:
    """Dirty data not yet written (delalloc reservations) on this filesystem, or None.

    /sys/fs/btrfs/<fsid>/allocation/data/bytes_may_use counts the space reserved for buffered
    writes that have not been allocated yet: per filesystem, unlike /proc/meminfo's Dirty.
    """
    try:  # every checkpoint asks: a plain read (kernfs) is 14 against 33 us for open()
        return int(kernfs.read(f"/sys/fs/btrfs/{fs_uuid}/allocation/data/bytes_may_use"))
    except (OSError, ValueError):
        return None


def is_subvolume(path: str) -> bool:
    """True if `path` is the root directory of a btrfs subvolume (inode 256 on btrfs)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _error("lstat", path, e) from e
    return (stat.S_ISDIR(st.st_mode) and st.st_ino == BTRFS_FIRST_FREE_OBJECTID
            and is_btrfs(path))


def generation(path: str) -> int:
    """The generation (last committed transid) of the subvolume containing directory `path`.

    It advances when a transaction that changed the subvolume commits (sync, snapshot,
    the periodic commit), so "write then sync" makes it grow.
    """
    fd = _open_dir(path, "get subvol info")
    try:
        buf = bytearray(_SUBVOL_INFO_SIZE)
        _ioctl(fd, BTRFS_IOC_GET_SUBVOL_INFO, buf, "BTRFS_IOC_GET_SUBVOL_INFO", path)
        return struct.unpack_from("=Q", buf, _SUBVOL_INFO_GENERATION_OFF)[0]
    finally:
        os.close(fd)


def _get_flags(fd: int, path: str) -> int:
    buf = bytearray(8)
    _ioctl(fd, BTRFS_IOC_SUBVOL_GETFLAGS, buf, "BTRFS_IOC_SUBVOL_GETFLAGS", path)
    return struct.unpack("=Q", buf)[0]


def is_readonly(path: str) -> bool:
    fd = _open_dir(path, "get flags")
    try:
        return bool(_get_flags(fd, path) & BTRFS_SUBVOL_RDONLY)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------
# mutations
# --------------------------------------------------------------------------------------
def sync(path: str) -> None:
    """syncfs(2) the filesystem holding `path`: flush data and commit the transaction."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _error("sync: open", path, e) from e
    try:
        if _libc.syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise _error("syncfs", path, OSError(code, os.strerror(code)))
    finally:
        os.close(fd)


def create_subvolume(path: str) -> None:
    """Create an empty subvolume at `path` (the parent must exist, the name must not)."""
    parent, name = _split(path)
    if len(name) > _VOL_ARGS_NAME_MAX:
        raise _error("create subvolume", path, OSError(_errno.ENAMETOOLONG, "name too long"))
    buf = bytearray(_VOL_ARGS_SIZE)
    buf[_VOL_ARGS_NAME_OFF:_VOL_ARGS_NAME_OFF + len(name)] = name
    fd = _open_dir(parent, "create subvolume")
    try:
        _ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, buf, "BTRFS_IOC_SUBVOL_CREATE", path, commits=True)
    finally:
        os.close(fd)


def snapshot(src: str, dst: str, readonly: bool) -> None:
    """Snapshot subvolume `src` to the new path `dst` (same filesystem), optionally read-only."""
    parent, name = _split(dst)
    if len(name) > _VOL_ARGS_V2_NAME_MAX:
        raise _error("snapshot", dst, OSError(_errno.ENAMETOOLONG, "name too long"))
    src_fd = _open_dir(src, "snapshot source")
    try:
        dst_fd = _open_dir(parent, "snapshot destination")
        try:
            buf = bytearray(_VOL_ARGS_V2_SIZE)
            struct.pack_into("=qQQ", buf, 0, src_fd, 0, BTRFS_SUBVOL_RDONLY if readonly else 0)
            buf[_VOL_ARGS_V2_NAME_OFF:_VOL_ARGS_V2_NAME_OFF + len(name)] = name
            _ioctl(dst_fd, BTRFS_IOC_SNAP_CREATE_V2, buf,
                   f"BTRFS_IOC_SNAP_CREATE_V2 (from {src!r})", dst, commits=True)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def set_readonly(path: str, ro: bool) -> None:
    """Set or clear the read-only property of the subvolume rooted at `path`."""
    fd = _open_dir(path, "set flags")
    try:
        flags = _get_flags(fd, path)
        new = (flags | BTRFS_SUBVOL_RDONLY) if ro else (flags & ~BTRFS_SUBVOL_RDONLY)
        if new != flags:
            _ioctl(fd, BTRFS_IOC_SUBVOL_SETFLAGS, bytearray(struct.pack("=Q", new)),
                   "BTRFS_IOC_SUBVOL_SETFLAGS", path)
    finally:
        os.close(fd)


def _destroy(parent_fd: int, name: bytes) -> None:
    """SNAP_DESTROY_V2 by name, falling back to v1 on kernels older than 5.7. Raw OSError."""
    buf = bytearray(_VOL_ARGS_V2_SIZE)
    buf[_VOL_ARGS_V2_NAME_OFF:_VOL_ARGS_V2_NAME_OFF + len(name)] = name
    try:
        _committing_ioctl(parent_fd, BTRFS_IOC_SNAP_DESTROY_V2, buf)
        return
    except OSError as e:
        if e.errno not in (_errno.ENOTTY, _errno.EOPNOTSUPP):
            raise
    buf = bytearray(_VOL_ARGS_SIZE)
    buf[_VOL_ARGS_NAME_OFF:_VOL_ARGS_NAME_OFF + len(name)] = name
    _committing_ioctl(parent_fd, BTRFS_IOC_SNAP_DESTROY, buf)


def wake_cleaner(path: str) -> None:
    """Have btrfs drop deleted subvolumes now (BTRFS_IOC_SYNC: flush, commit, and wake the
    cleaner thread), not at the cleaner's next periodic wake-up (up to the 30 s commit
    interval). Until dropped, a deleted snapshot's back-references stay in the extent tree
    and every later snapshot and commit pays for them (README: fork fan-outs)."""
    fd = _open_dir(path, "wake cleaner")
    try:
        _ioctl(fd, BTRFS_IOC_SYNC, None, "BTRFS_IOC_SYNC", path, commits=True)
    finally:
        os.close(fd)


def delete_subvolume(path: str) -> None:
    """Delete the subvolume (or snapshot, read-only or not) rooted at `path`.

    The directory entry disappears at once; the kernel's cleaner thread frees the blocks
    later, so this costs the same for an empty subvolume and a full one. Fails (ENOTEMPTY)
    if the subvolume still contains nested subvolumes: use delete_tree for that.
    """
    parent, name = _split(path)
    fd = _open_dir(parent, "delete subvolume")
    try:
        try:
            _destroy(fd, name)
        except OSError as e:
            if e.errno not in (_errno.EPERM, _errno.EACCES, _errno.EROFS):
                raise _error("BTRFS_IOC_SNAP_DESTROY_V2", path, e) from e
            # Not needed by root on current kernels, but a read-only snapshot may be
            # refused (e.g. to unprivileged users under user_subvol_rm_allowed): clear
            # the read-only flag and try once more.
            try:
                set_readonly(path, False)
            except DeltaBoxError:
                raise _error("BTRFS_IOC_SNAP_DESTROY_V2", path, e) from e
            try:
                _destroy(fd, name)
            except OSError as e2:
                raise _error("BTRFS_IOC_SNAP_DESTROY_V2 (after clearing ro)", path, e2) from e2
    finally:
        os.close(fd)


def delete_tree(path: str) -> None:
    """Remove `path` whatever it is: a subvolume (with nested subvolumes), a plain
    directory (that may contain subvolumes), or a file. A missing path is not an error."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise _error("delete tree: lstat", path, e) from e
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _error("delete tree: unlink", path, e) from e
        return
    on_btrfs = is_btrfs(path)
    if on_btrfs and st.st_ino == BTRFS_FIRST_FREE_OBJECTID:
        try:
            delete_subvolume(path)
            return
        except DeltaBoxError as e:
            if getattr(e, "errno", None) != _errno.ENOTEMPTY:
                raise
        # Nested subvolumes must go first. Their directory entries live in this
        # subvolume's tree, so it has to be writable for that.
        if is_readonly(path):
            set_readonly(path, False)
        _delete_nested(path)
        delete_subvolume(path)
        return
    if on_btrfs:
        _delete_nested(path)
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise _error("delete tree: rmtree", path, e) from e


def _delete_nested(root: str) -> None:
    """Delete every subvolume found below `root` (not `root` itself)."""
    try:
        it = os.scandir(root)
    except OSError as e:
        raise _error("delete tree: scandir", root, e) from e
    with it:
        entries = list(it)
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        # Not entry.inode(): readdir reports a subvolume's *tree id* as d_ino; only
        # stat shows its root directory's inode number, 256.
        try:
            ino = entry.stat(follow_symlinks=False).st_ino
        except FileNotFoundError:
            continue
        except OSError as e:
            raise _error("delete tree: lstat", entry.path, e) from e
        if ino == BTRFS_FIRST_FREE_OBJECTID:
            delete_tree(entry.path)
        else:
            _delete_nested(entry.path)


# --------------------------------------------------------------------------------------
# change tracking
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChangeSummary:
    """Regular files whose inode changed after a transid, and the sum of their sizes.

    `items_scanned` is how many tree items the kernel handed back (diagnostic: it is
    proportional to the number of changed tree leaves, not to the subvolume's size).
    """

    files: int
    bytes: int
    items_scanned: int = field(default=0, compare=False)


def changed_since(subvol_path: str, min_transid: int) -> ChangeSummary:
    """Count regular files in the subvolume containing directory `subvol_path` whose inode
    item was changed by a transaction newer than `min_transid`, and sum their sizes.

    Uses BTRFS_IOC_TREE_SEARCH_V2 on the subvolume's own tree with min_transid set, so the
    kernel skips every tree block that has not been rewritten since then (the mechanism
    behind `btrfs subvolume find-new`): the cost follows the change, not the tree size.

    Sees committed state (and the running transaction's already-updated tree); sync() or
    snapshot first for exact numbers. Deleted files are invisible (they left no item).
    Note that an atime update also bumps an inode's transid (mount noatime to avoid it).
    """
    fd = _open_dir(subvol_path, "changed_since")
    try:
        return _changed_since_fd(fd, subvol_path, min_transid)
    finally:
        os.close(fd)


def _changed_since_fd(fd: int, path: str, min_transid: int) -> ChangeSummary:
    bufsize = _SEARCH_BUF_SIZE
    args = bytearray(_SEARCH_ARGS_V2_HDR + bufsize)
    # Leaves holding an item with transid > min_transid were written at a generation
    # >= item transid, so blocks with generation <= min_transid can all be skipped.
    search_min_transid = min(min_transid + 1, _U64_MAX) if min_transid >= 0 else 0
    objectid, typ, offset = BTRFS_FIRST_FREE_OBJECTID, BTRFS_INODE_ITEM_KEY, 0
    files = nbytes = scanned = 0
    hdr_unpack = _SEARCH_HEADER.unpack_from
    hdr_size = _SEARCH_HEADER.size
    while True:
        _SEARCH_KEY.pack_into(
            args, 0,
            0,  # tree_id: the subvolume the fd is in
            objectid, BTRFS_LAST_FREE_OBJECTID,
            offset, _U64_MAX,
            search_min_transid, _U64_MAX,
            typ, BTRFS_INODE_ITEM_KEY,
            _U32_MAX,  # nr_items: as many as fit in the buffer
            0, 0, 0, 0, 0,
        )
        struct.pack_into("=Q", args, 104, bufsize)
        try:
            fcntl.ioctl(fd, BTRFS_IOC_TREE_SEARCH_V2, args, True)
        except OSError as e:
            if e.errno == _errno.EOVERFLOW:  # one item bigger than the buffer: grow it
                need = struct.unpack_from("=Q", args, 104)[0]
                if need > bufsize:
                    bufsize = need
                    args = bytearray(_SEARCH_ARGS_V2_HDR + bufsize)
                    continue
            raise _error("BTRFS_IOC_TREE_SEARCH_V2", path, e) from e
        nr = struct.unpack_from("=I", args, 64)[0]
        if nr == 0:
            break
        pos = _SEARCH_ARGS_V2_HDR
        for _ in range(nr):
            _transid, objectid, offset, typ, length = hdr_unpack(args, pos)
            pos += hdr_size
            if (typ == BTRFS_INODE_ITEM_KEY and length >= _INODE_ITEM_MIN_LEN
                    and objectid >= BTRFS_FIRST_FREE_OBJECTID):
                item_transid, size = _INODE_TRANSID_SIZE.unpack_from(args, pos + 8)
                if item_transid > min_transid:
                    mode = _INODE_MODE.unpack_from(args, pos + _INODE_MODE_OFF)[0]
                    if stat.S_ISREG(mode):
                        files += 1
                        nbytes += size
            pos += length
        scanned += nr
        # Continue just after the last key returned (compound increment).
        if offset < _U64_MAX:
            offset += 1
        elif typ < 0xFF:
            typ, offset = typ + 1, 0
        elif objectid < BTRFS_LAST_FREE_OBJECTID:
            objectid, typ, offset = objectid + 1, 0, 0
        else:
            break
        if objectid > BTRFS_LAST_FREE_OBJECTID or (
                objectid == BTRFS_LAST_FREE_OBJECTID and typ > BTRFS_INODE_ITEM_KEY):
            break
    return ChangeSummary(files=files, bytes=nbytes, items_scanned=scanned)
