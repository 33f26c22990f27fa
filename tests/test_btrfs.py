"""deltabox.fs.btrfs against a real btrfs: a sparse image, mkfs.btrfs, loop mount.

Needs root, mkfs.btrfs and loop devices; skipped otherwise. Everything is torn down even on
failure: unmount, detach any loop device still bound to the image, remove the temp dir.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from deltabox.errors import Internal, ResourceExhausted
from deltabox.fs import btrfs

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None or shutil.which("losetup") is None,
    reason="needs root, mkfs.btrfs and losetup",
)


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True)


def _loops_for(image: str) -> list[str]:
    out = subprocess.run(["losetup", "-j", image], capture_output=True, text=True).stdout
    return [line.split(":", 1)[0] for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def btrfs_fs():
    """A fresh 1 GiB btrfs mounted from a sparse image; yields the mount point."""
    tmp = tempfile.mkdtemp(prefix="dbx-btrfs-test-")
    image = os.path.join(tmp, "fs.img")
    mnt = os.path.join(tmp, "mnt")
    try:
        os.mkdir(mnt)
        with open(image, "wb") as f:
            f.truncate(1 << 30)
        _run("mkfs.btrfs", "-q", "-f", image)
        _run("mount", "-o", "loop", image, mnt)
        yield mnt
    finally:
        try:
            if os.path.ismount(mnt):
                r = subprocess.run(["umount", mnt], capture_output=True, text=True)
                if r.returncode != 0:  # something still busy: detach lazily
                    subprocess.run(["umount", "-l", mnt], capture_output=True)
        finally:
            try:
                for dev in _loops_for(image):  # autoclear normally did it already
                    subprocess.run(["losetup", "-d", dev], capture_output=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def fs(btrfs_fs, request):
    """A per-test directory on the shared btrfs, emptied afterwards."""
    d = os.path.join(btrfs_fs, request.node.name.replace("[", "_").replace("]", "_"))
    os.mkdir(d)
    try:
        yield d
    finally:
        btrfs.delete_tree(d)


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_ioctl_numbers_match_the_kernel_headers():
    # Values from linux/btrfs.h as compiled on x86_64/arm64.
    assert btrfs.BTRFS_IOC_SUBVOL_CREATE == 0x5000940E
    assert btrfs.BTRFS_IOC_SNAP_DESTROY == 0x5000940F
    assert btrfs.BTRFS_IOC_TREE_SEARCH_V2 == 0xC0709411
    assert btrfs.BTRFS_IOC_SNAP_CREATE_V2 == 0x50009417
    assert btrfs.BTRFS_IOC_SUBVOL_GETFLAGS == 0x80089419
    assert btrfs.BTRFS_IOC_SUBVOL_SETFLAGS == 0x4008941A
    assert btrfs.BTRFS_IOC_GET_SUBVOL_INFO == 0x81F8943C
    assert btrfs.BTRFS_IOC_SNAP_DESTROY_V2 == 0x5000943F
    assert btrfs.BTRFS_IOC_SYNC == 0x9408


def test_is_btrfs(fs):
    assert btrfs.is_btrfs(fs)
    # Cross-check against coreutils' statfs for a few other filesystems.
    for path in (os.path.dirname(os.path.dirname(fs)), "/proc", "/"):
        f_type = int(_run("stat", "-f", "-c", "%t", path).stdout.strip(), 16)
        assert btrfs.is_btrfs(path) == (f_type == btrfs.BTRFS_SUPER_MAGIC)
    assert not btrfs.is_btrfs("/proc")
    assert not btrfs.is_subvolume("/proc")
    with pytest.raises(Internal, match="statfs"):
        btrfs.is_btrfs(os.path.join(fs, "missing"))


def test_subvolume_snapshot_lifecycle(fs):
    L = os.path.join(fs, "L")
    btrfs.create_subvolume(L)
    assert btrfs.is_subvolume(L)
    assert not btrfs.is_readonly(L)
    _write(f"{L}/upper/etc/conf", b"v1")
    _write(f"{L}/upper/big", os.urandom(300_000))
    os.mkdir(f"{L}/work")
    assert not btrfs.is_subvolume(f"{L}/upper")

    ro = os.path.join(fs, "ro")
    t = time.perf_counter()
    btrfs.snapshot(L, ro, readonly=True)
    snap_ms = (time.perf_counter() - t) * 1e3
    assert btrfs.is_subvolume(ro) and btrfs.is_readonly(ro)
    assert _read(f"{ro}/upper/etc/conf") == b"v1"
    assert _read(f"{ro}/upper/big") == _read(f"{L}/upper/big")
    # Inode numbers survive the snapshot (diff.py relies on it).
    assert os.lstat(f"{ro}/upper/big").st_ino == os.lstat(f"{L}/upper/big").st_ino
    with pytest.raises(OSError) as ei:
        _write(f"{ro}/upper/new", b"x")
    assert ei.value.errno == errno.EROFS
    with pytest.raises(OSError) as ei:
        _write(f"{ro}/upper/etc/conf", b"x")
    assert ei.value.errno == errno.EROFS

    rw = os.path.join(fs, "rw")
    btrfs.snapshot(ro, rw, readonly=False)
    assert btrfs.is_subvolume(rw) and not btrfs.is_readonly(rw)
    _write(f"{rw}/upper/etc/conf", b"v2-rw")
    _write(f"{rw}/upper/only-rw", b"x")
    _write(f"{L}/upper/only-L", b"y")
    assert _read(f"{ro}/upper/etc/conf") == b"v1"
    assert _read(f"{L}/upper/etc/conf") == b"v1"
    assert not os.path.exists(f"{ro}/upper/only-rw")
    assert not os.path.exists(f"{L}/upper/only-rw")
    assert not os.path.exists(f"{rw}/upper/only-L")
    assert not os.path.exists(f"{ro}/upper/only-L")

    # A read-only snapshot full of files goes away with SNAP_DESTROY as root, flag and all.
    assert btrfs.is_readonly(ro)
    btrfs.delete_subvolume(ro)
    btrfs.delete_subvolume(rw)
    assert not os.path.exists(ro) and not os.path.exists(rw)
    assert _read(f"{L}/upper/etc/conf") == b"v1"  # the origin is untouched
    btrfs.delete_subvolume(L)
    assert os.listdir(fs) == []
    assert snap_ms < 1000  # typically ~1 ms; a generous bound against a wedged fs


def test_set_readonly(fs):
    s = os.path.join(fs, "s")
    btrfs.create_subvolume(s)
    _write(f"{s}/f", b"x")
    btrfs.set_readonly(s, True)
    assert btrfs.is_readonly(s)
    with pytest.raises(OSError) as ei:
        _write(f"{s}/g", b"y")
    assert ei.value.errno == errno.EROFS
    btrfs.set_readonly(s, True)  # idempotent
    btrfs.set_readonly(s, False)
    assert not btrfs.is_readonly(s)
    _write(f"{s}/g", b"y")
    btrfs.delete_subvolume(s)


def test_delete_tree(fs):
    # A subvolume holding a nested subvolume (plain SNAP_DESTROY says ENOTEMPTY).
    outer = os.path.join(fs, "outer")
    btrfs.create_subvolume(outer)
    _write(f"{outer}/a/file", b"1")
    btrfs.create_subvolume(f"{outer}/a/inner")
    _write(f"{outer}/a/inner/file", b"2")
    with pytest.raises(Internal, match="ENOTEMPTY") as ei:
        btrfs.delete_subvolume(outer)
    assert ei.value.errno == errno.ENOTEMPTY
    btrfs.delete_tree(outer)
    assert not os.path.exists(outer)

    # A plain directory containing a read-only snapshot and files.
    plain = os.path.join(fs, "plain")
    btrfs.create_subvolume(f"{fs}/src")
    _write(f"{fs}/src/f", b"x")
    os.makedirs(f"{plain}/deep")
    _write(f"{plain}/deep/file", b"z")
    btrfs.snapshot(f"{fs}/src", f"{plain}/deep/snap", readonly=True)
    btrfs.delete_tree(plain)
    assert not os.path.exists(plain)

    # A bare read-only snapshot, a file, and a missing path.
    btrfs.snapshot(f"{fs}/src", f"{fs}/ro", readonly=True)
    btrfs.delete_tree(f"{fs}/ro")
    _write(f"{fs}/lonely", b"x")
    btrfs.delete_tree(f"{fs}/lonely")
    btrfs.delete_tree(f"{fs}/never-existed")
    btrfs.delete_tree(f"{fs}/src")
    assert os.listdir(fs) == []


def test_errors_carry_context(fs):
    plain = os.path.join(fs, "plain")
    os.mkdir(plain)
    with pytest.raises(Internal) as ei:  # snapshot source is not a subvolume
        btrfs.snapshot(plain, os.path.join(fs, "snap"), readonly=True)
    assert "SNAP_CREATE" in ei.value.message and plain in ei.value.message
    assert "EINVAL" in ei.value.message
    with pytest.raises(Internal) as ei:
        btrfs.delete_subvolume(os.path.join(fs, "missing"))
    assert ei.value.errno == errno.ENOENT and "missing" in ei.value.message
    with pytest.raises(Internal) as ei:
        btrfs.create_subvolume(os.path.join(fs, "no", "parent"))
    assert ei.value.errno == errno.ENOENT
    btrfs.create_subvolume(os.path.join(fs, "dup"))
    with pytest.raises(Internal) as ei:
        btrfs.create_subvolume(os.path.join(fs, "dup"))
    assert ei.value.errno == errno.EEXIST
    btrfs.delete_subvolume(os.path.join(fs, "dup"))
    # ENOSPC maps to ResourceExhausted (the mapping itself; filling a disk is slow).
    err = btrfs._error("BTRFS_IOC_SNAP_CREATE_V2", "/x", OSError(errno.ENOSPC, "full"))
    assert isinstance(err, ResourceExhausted) and "ENOSPC" in err.message and "/x" in err.message


def test_generation_increases_after_write_and_sync(fs):
    s = os.path.join(fs, "s")
    btrfs.create_subvolume(s)
    btrfs.sync(s)
    g1 = btrfs.generation(s)
    assert g1 > 0
    _write(f"{s}/f", b"data")
    btrfs.sync(s)
    g2 = btrfs.generation(s)
    assert g2 > g1
    assert btrfs.generation(f"{s}") == g2
    btrfs.delete_subvolume(s)


def test_changed_since_counts_new_and_modified_files(fs):
    L = os.path.join(fs, "L")
    btrfs.create_subvolume(L)
    _write(f"{L}/upper/keep", b"k" * 100)
    _write(f"{L}/upper/edit", b"e" * 10)
    btrfs.sync(L)
    base = os.path.join(fs, "base")
    btrfs.snapshot(L, base, readonly=True)
    gen = btrfs.generation(base)

    sizes = {"n1": 5000, "n2": 123, "sub/n3": 70_000}
    for name, size in sizes.items():
        _write(f"{L}/upper/{name}", b"n" * size)
    btrfs.sync(L)
    with open(f"{L}/upper/edit", "ab") as f:
        f.write(b"more" * 1000)
    btrfs.sync(L)

    cs = btrfs.changed_since(L, gen)
    assert cs.files >= 4
    assert cs.bytes >= sum(sizes.values()) + 10 + 4000
    # A frozen checkpoint sees the same change relative to the older one.
    cp = os.path.join(fs, "cp")
    btrfs.snapshot(L, cp, readonly=True)
    assert btrfs.changed_since(cp, gen) == cs
    # Nothing changed since the newest snapshot: in it, nor in the live subvolume.
    assert btrfs.changed_since(cp, btrfs.generation(cp)).files == 0
    assert btrfs.changed_since(L, btrfs.generation(cp)) == btrfs.ChangeSummary(0, 0)
    # Everything since the beginning: all five files.
    assert btrfs.changed_since(L, 0).files == 5
    for p in (cp, base, L):
        btrfs.delete_subvolume(p)


def test_changed_since_is_proportional_to_the_change(fs):
    L = os.path.join(fs, "L")
    btrfs.create_subvolume(L)
    for i in range(2000):
        _write(f"{L}/upper/d{i % 20}/f{i}", b"%d" % i * 10)
    btrfs.sync(L)
    base = os.path.join(fs, "base")
    btrfs.snapshot(L, base, readonly=True)
    gen = btrfs.generation(base)
    full = btrfs.changed_since(L, 0)
    assert full.files == 2000

    _write(f"{L}/upper/d7/f1007", b"changed!")
    btrfs.sync(L)
    t = time.perf_counter()
    cs = btrfs.changed_since(L, gen)
    ms = (time.perf_counter() - t) * 1e3
    assert 1 <= cs.files <= 3
    assert cs.bytes >= len(b"changed!")
    # The kernel skipped the unchanged leaves: far fewer items than a full scan.
    assert cs.items_scanned * 5 < full.items_scanned, (cs, full)
    assert ms < 500
    print(f"changed_since: {cs} in {ms:.2f} ms; full scan {full}")
    btrfs.delete_subvolume(base)
    btrfs.delete_subvolume(L)


def test_other_threads_run_while_a_snapshot_commits(fs):
    """A snapshot is a transaction commit (milliseconds): the daemon's other threads (the
    ptrace thread making a checkpoint's templates, the trio loop) must run meanwhile. With
    fcntl.ioctl, which keeps the GIL for buffers over 1024 bytes, none ran at all."""
    import threading

    btrfs.create_subvolume(f"{fs}/base")
    stop = threading.Event()
    woke: list[float] = []

    def other() -> None:
        while not stop.is_set():
            woke.append(time.perf_counter())
            time.sleep(0.0002)

    t = threading.Thread(target=other)
    t.start()
    spans = []
    try:
        for k in range(5):
            _write(f"{fs}/base/big{k}", os.urandom(8 << 20))  # a commit with work to do
            t0 = time.perf_counter()
            btrfs.snapshot(f"{fs}/base", f"{fs}/s{k}", True)
            spans.append((t0, time.perf_counter()))
    finally:
        stop.set()
        t.join()
    busy = sum(b - a for a, b in spans)
    inside = sum(1 for w in woke for a, b in spans if a + 0.0005 < w < b - 0.0005)
    assert busy > 0.005, f"snapshots took {busy * 1000:.1f} ms in all: too fast to tell"
    assert inside > 0, f"no other thread ran during {busy * 1000:.1f} ms of snapshots"


def deleted_not_dropped(mnt: str) -> int:
    """Subvolumes deleted but not yet dropped by btrfs's cleaner."""
    return len(_run("btrfs", "subvolume", "list", "-d", mnt).stdout.splitlines())


def test_wake_cleaner_drops_deleted_snapshots_now(fs, btrfs_fs):
    src = os.path.join(fs, "src")
    btrfs.create_subvolume(src)
    for i in range(100):
        _write(os.path.join(src, f"f{i}"), b"x" * 100)
    for i in range(20):
        snap = os.path.join(fs, f"s{i}")
        btrfs.snapshot(src, snap, False)
        btrfs.delete_subvolume(snap)
    btrfs.wake_cleaner(fs)
    deadline = time.monotonic() + 10  # the cleaner's own wake-up is up to 30 s away
    while deleted_not_dropped(btrfs_fs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert deleted_not_dropped(btrfs_fs) == 0
