"""DeltaFS layer store: writable layers, frozen checkpoint layers, and their lifecycle.

A layer is a directory holding `upper/` (the overlay upperdir) and `work/` (its workdir).
- btrfs backend: every layer is a subvolume. Freezing a sandbox's writable layer is a
  read-only snapshot (copy-on-write, milliseconds, running processes untouched); rollback and
  fork make a writable snapshot of a frozen one. Layers never depend on each other, so any
  checkpoint can be deleted at any time.
- copy backend (hosts without btrfs or loop devices): the same operations by copying the
  layer (reflinks where the filesystem has them). Slow, but correct; the benchmark baseline.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import FailedPrecondition, Internal, ResourceExhausted
from . import btrfs

log = logging.getLogger("deltaboxd")


@dataclass(frozen=True)
class Changes:
    files: int
    bytes: int


class Store(Protocol):
    backend: str
    root: Path
    cheap_clone: bool

    def layer_path(self, layer_id: str) -> Path: ...
    def new_layer(self, layer_id: str) -> None: ...
    def freeze(self, src_id: str, dst_id: str) -> None: ...
    def clone(self, src_id: str, dst_id: str) -> None: ...
    def delete(self, layer_id: str) -> None: ...
    def generation(self, layer_id: str) -> int: ...
    def changes_since(self, layer_id: str, gen: int) -> Changes | None: ...
    def sync(self) -> None: ...
    def needs_sync(self) -> bool: ...
    def layer_ids(self) -> list[str]: ...
    def clean_deleted(self, at_least: int) -> int: ...


class _BaseStore:
    backend = "?"
    cheap_clone = False  # whether a spare clone per checkpoint costs only metadata

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers = root / "layers"
        self.layers.mkdir(parents=True, exist_ok=True)

    def layer_path(self, layer_id: str) -> Path:
        return self.layers / layer_id

    def layer_ids(self) -> list[str]:
        return sorted(p.name for p in self.layers.iterdir())

    def needs_sync(self) -> bool:
        """Whether enough dirty data waits that flushing it before a freeze pays off."""
        return True

    def clean_deleted(self, at_least: int) -> int:
        """Deleted layers cost nothing once gone here (only btrfs keeps them around)."""
        return 0

    def sync(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _syncfs(fd)
        finally:
            os.close(fd)

    def _make_dirs(self, path: Path) -> None:
        (path / "upper").mkdir(mode=0o755, exist_ok=True)
        (path / "work").mkdir(mode=0o700, exist_ok=True)


# Below this much unwritten data on the store, the snapshot's own flush is short, and a
# separate syncfs would only add a second transaction commit to every checkpoint.
SYNC_THRESHOLD_BYTES = 16 << 20
# Where BtrfsStore makes a writable layer before renaming it into layers/ (its _staged).
STAGING_PREFIX = ".new-"


def _syncfs(fd: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise Internal(f"syncfs failed: {os.strerror(err)}")


class BtrfsStore(_BaseStore):
    backend = "btrfs"
    cheap_clone = True

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fs_uuid = btrfs.fsid(str(root))
        self._deleted = 0  # subvolumes deleted since the cleaner was last woken
        self._deleted_lock = threading.Lock()  # deletes run on worker threads

    def needs_sync(self) -> bool:
        pending = btrfs.pending_data_bytes(self.fs_uuid)
        return pending is None or pending > SYNC_THRESHOLD_BYTES

    def _full_retry(self, fn, *args) -> None:
        """Run a btrfs mutation; on ENOSPC commit the transaction and try once more: space
        freed by deletions (of files, of checkpoints' subvolumes) is pinned until the
        transaction that freed it commits, so a nearly full store says ENOSPC while it is
        not full."""
        try:
            fn(*args)
        except ResourceExhausted:
            btrfs.sync(str(self.root))
            fn(*args)

    def _staged(self, layer_id: str, make: Callable[[str], None]) -> None:
        """Make a writable subvolume (`make(path)`) in a directory of its own, then rename
        it into layers/. btrfs holds the parent directory's lock through the transaction
        commit of a snapshot (or a new subvolume), so those made side by side in one
        directory commit one after the other; each in its own, they share commits (32
        concurrent clones of a 2,000-file layer: 27-32 ms against 55-118 ms in layers/
        itself; one alone: the same; fork(32) of the full scenario, interleaved in one
        daemon, 6 each, twice: 260 vs 283 and 248 vs 284 ms p50). A read-only snapshot
        cannot be renamed across directories (EROFS): freeze stays in place. A crash
        leaves the staging directory, which Daemon.recover deletes as an unreferenced
        layer."""
        stage = self.layers / f"{STAGING_PREFIX}{layer_id}"
        stage.mkdir()
        try:
            self._full_retry(make, str(stage / "layer"))
            os.rename(stage / "layer", self.layer_path(layer_id))
        except BaseException:
            btrfs.delete_tree(str(stage))
            raise
        stage.rmdir()

    def new_layer(self, layer_id: str) -> None:
        self._staged(layer_id, btrfs.create_subvolume)
        self._make_dirs(self.layer_path(layer_id))

    def freeze(self, src_id: str, dst_id: str) -> None:
        self._full_retry(btrfs.snapshot, str(self.layer_path(src_id)),
                         str(self.layer_path(dst_id)), True)

    def clone(self, src_id: str, dst_id: str) -> None:
        src = str(self.layer_path(src_id))
        self._staged(dst_id, lambda path: btrfs.snapshot(src, path, False))

    def delete(self, layer_id: str) -> None:
        path = self.layer_path(layer_id)
        if path.exists():
            self._full_retry(btrfs.delete_tree, str(path))
            with self._deleted_lock:
                self._deleted += 1

    def clean_deleted(self, at_least: int) -> int:
        """If `at_least` layers were deleted since the last time, have btrfs drop them now
        (btrfs.wake_cleaner): a fork fan-out removed and made again, 32 children at a
        time, took 398 -> 606 ms over 8 rounds while they piled up, 355-412 ms with them
        dropped. Returns how many it asked btrfs to drop (0: not enough to bother; a
        wake-up per checkpoint cycle did not pay for itself, README)."""
        with self._deleted_lock:
            n = self._deleted
            if n < max(1, at_least):
                return 0
            self._deleted = 0
        btrfs.wake_cleaner(str(self.root))
        return n

    def generation(self, layer_id: str) -> int:
        return btrfs.generation(str(self.layer_path(layer_id)))

    def changes_since(self, layer_id: str, gen: int) -> Changes | None:
        s = btrfs.changed_since(str(self.layer_path(layer_id)), gen)
        return Changes(files=s.files, bytes=s.bytes)


class CopyStore(_BaseStore):
    backend = "copy"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.backend = "copy-reflink" if _reflink_works(root) else "copy"

    def new_layer(self, layer_id: str) -> None:
        path = self.layer_path(layer_id)
        path.mkdir()
        self._make_dirs(path)

    def _copy(self, src: Path, dst: Path) -> None:
        tmp = dst.with_name(dst.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        r = subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(tmp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if "No space" in r.stderr:
                raise ResourceExhausted(f"store full while copying a layer: {r.stderr.strip()}")
            raise Internal(f"copying layer {src.name}: {r.stderr.strip()}")
        shutil.rmtree(tmp / "work", ignore_errors=True)
        (tmp / "work").mkdir(mode=0o700)
        tmp.rename(dst)

    def freeze(self, src_id: str, dst_id: str) -> None:
        self._copy(self.layer_path(src_id), self.layer_path(dst_id))

    def clone(self, src_id: str, dst_id: str) -> None:
        self._copy(self.layer_path(src_id), self.layer_path(dst_id))

    def delete(self, layer_id: str) -> None:
        shutil.rmtree(self.layer_path(layer_id), ignore_errors=True)

    def generation(self, layer_id: str) -> int:
        return 0

    def changes_since(self, layer_id: str, gen: int) -> Changes | None:
        return None  # unknown without walking; the daemon reports it as such

    def layer_ids(self) -> list[str]:
        return sorted(p.name for p in self.layers.iterdir() if not p.name.endswith(".partial"))


def _reflink_works(root: Path) -> bool:
    a, b = root / ".reflink-probe", root / ".reflink-probe2"
    try:
        a.write_bytes(b"x")
        r = subprocess.run(["cp", "--reflink=always", str(a), str(b)], capture_output=True)
        return r.returncode == 0
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


# ---- opening the embedded default store -------------------------------------------------

def _mounted_at(path: Path) -> str | None:
    """Filesystem type mounted exactly at `path` in our mount namespace, if any."""
    target = str(path)
    fstype = None
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[1] == target:
                fstype = parts[2]
    return fstype


def _loop_options(durable: bool) -> str:
    """Mount options of the embedded loop store.

    Without `durable`, btrfs issues no cache flushes: on a loop device each flush is an fsync
    of the image file on the host disk, which dominated a checkpoint here (7 ms of a 8 ms
    snapshot). The kernel keeps every committed checkpoint across crashes of the daemon; only
    a host crash (power loss, panic) shortly after a checkpoint can lose it.
    """
    return "loop,noatime" + ("" if durable else ",nobarrier")


LOOP_SET_DIRECT_IO = 0x4C08   # linux/loop.h


def loop_device_of(img: Path) -> str | None:
    """The loop device whose backing file is `img`, if one is attached."""
    want = os.path.realpath(img)
    for d in Path("/sys/block").glob("loop*"):
        try:
            if os.path.realpath((d / "loop" / "backing_file").read_text().strip()) == want:
                return f"/dev/{d.name}"
        except OSError:
            continue
    return None


def _loop_direct_io(img: Path, on: bool) -> None:
    """Put the embedded store's loop device in direct-I/O mode (or back in buffered mode).

    Late in a session that keeps its checkpoints, each commit writes more (btrfs's extent
    tree grows with the snapshots: see deltabox/daemon/warm.py, MAX_SPARES), and in buffered
    mode those writes go through the host's page cache. benchmarks/long_session.py ended at
    14.8-16.8 ms per checkpoint (daemon p50, last 10 of 60 cycles) in direct-I/O mode against
    17.6-23.0 buffered (five runs; the direct-I/O ones right after two of them). But in a
    fresh session direct I/O costs: the file-state benchmark's checkpoints of 1 file took
    13.3-14.4 vs 10.9-11.6 ms, sandbox creates 17-20 vs 10.6-12.8 ms (two runs each). Hence
    opt-in (deltaboxd --loop-io direct). Best effort: a loop device that refuses (block sizes
    that do not line up) stays as it was, and the daemon says so in its log."""
    dev = loop_device_of(img)
    if dev is None:
        log.warning("store %s: no loop device found for it; its I/O mode is left as is", img)
        return
    try:
        fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, LOOP_SET_DIRECT_IO, 1 if on else 0)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("store %s: could not set direct I/O %s on %s (%s); it stays as it was",
                    img, "on" if on else "off", dev, e.strerror)


def open_store(state_dir: Path, size_gb: int, backend: str = "auto",
               durable: bool = False, direct_io: bool = False) -> Store:
    """The store for `state_dir`: btrfs in place, btrfs on a loop image, or copy.

    backend: "auto" (the default), "btrfs" (fail if impossible) or "copy" (force).
    durable: keep cache flushes on the embedded loop store (see _loop_options).
    direct_io: the embedded loop store's device in direct-I/O mode (see _loop_direct_io).
    """
    mnt = state_dir / "store"
    mnt.mkdir(parents=True, exist_ok=True)
    if backend == "copy":
        return CopyStore(mnt)
    if btrfs.is_btrfs(str(state_dir)):
        s = BtrfsStore(mnt)
        return s
    if _mounted_at(mnt) == "btrfs":  # left by a previous daemon: reuse it
        opts = _loop_options(durable).replace("loop,", "remount,")
        opts += "" if not durable else ",barrier"
        subprocess.run(["mount", "-o", opts, str(mnt)], capture_output=True)
        _loop_direct_io(state_dir / "store.img", direct_io)
        s = BtrfsStore(mnt)
        s.backend = "btrfs-loop"
        return s
    try:
        _mount_loop_image(state_dir / "store.img", mnt, size_gb, _loop_options(durable))
    except FailedPrecondition:
        if backend == "btrfs":
            raise
        return CopyStore(mnt)
    _loop_direct_io(state_dir / "store.img", direct_io)
    s = BtrfsStore(mnt)
    s.backend = "btrfs-loop"
    return s


def _mount_loop_image(img: Path, mnt: Path, size_gb: int, options: str) -> None:
    if shutil.which("mkfs.btrfs") is None:
        raise FailedPrecondition("mkfs.btrfs not found: install btrfs-progs (make install)")
    fresh = not img.exists()
    if fresh:
        with open(img, "wb") as f:
            f.truncate(size_gb << 30)
        r = subprocess.run(["mkfs.btrfs", "-q", "-f", str(img)], capture_output=True, text=True)
        if r.returncode != 0:
            img.unlink(missing_ok=True)
            raise FailedPrecondition(f"mkfs.btrfs failed: {r.stderr.strip()}")
    r = subprocess.run(["mount", "-o", options, str(img), str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise FailedPrecondition(f"cannot loop-mount {img} at {mnt}: {r.stderr.strip()}")


def close_store(store: Store) -> None:
    """Unmount a loop store (the loop device detaches itself: mount -o loop sets autoclear);
    nothing if it is not mounted (closed already)."""
    if store.backend != "btrfs-loop" or not os.path.ismount(store.root):
        return
    r = subprocess.run(["umount", str(store.root)], capture_output=True, text=True)
    if r.returncode != 0:
        # Still busy (a sandbox namespace not yet torn down): detach lazily; the kernel
        # unmounts and frees the loop device when the last user goes.
        subprocess.run(["umount", "-l", str(store.root)], capture_output=True)
