"""SandboxFiles against a real fake root on the host file system (no mocks).

Each test builds <base>/root (the sandbox root, with /workspace and a fake /etc/passwd) next to
<base>/outside (host files the sandbox must never reach), opens the root O_PATH like the daemon
opens /proc/<pid>/root, and checks that nothing resolves or writes outside it. Tests that need
mounts (tmpfs, bind of /proc) need root; every mount is lazily unmounted before the tree is
removed, and the tree is never removed while something is still mounted inside it.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from deltabox.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from deltabox.fs.files import FileStat, SandboxFiles

FAKE_PASSWD = b"root:x:0:0:fake sandbox root:/root:/bin/sh\n"
SENTINEL = b"host sentinel - must never change\n"


@dataclass
class Box:
    base: str
    root: str
    outside: str
    rootfd: int
    files: SandboxFiles
    mounts: list[str] = field(default_factory=list)

    def path(self, inner: str) -> str:
        """Host path of a sandbox path."""
        return self.root + inner

    def mount(self, *args: str) -> None:
        target = args[-1]
        proc = subprocess.run(["mount", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount ({proc.stderr.strip()}); needs root")
        self.mounts.append(target)


def _cleanup(base: str, mounts: list[str]) -> None:
    for target in reversed(mounts):
        subprocess.run(["umount", "-l", target], capture_output=True)
    still = [m for m in mounts if os.path.ismount(m)]
    if still:  # never let rmtree wander into a mounted file system
        raise RuntimeError(f"still mounted, not removing {base}: {still}")
    shutil.rmtree(base, ignore_errors=True)


def _make_box(base: str, root: str) -> Box:
    outside = os.path.join(base, "outside")
    os.makedirs(os.path.join(root, "workspace"), exist_ok=True)
    os.makedirs(os.path.join(root, "etc"), exist_ok=True)
    os.makedirs(outside, exist_ok=True)
    with open(os.path.join(root, "etc", "passwd"), "wb") as f:
        f.write(FAKE_PASSWD)
    with open(os.path.join(outside, "sentinel"), "wb") as f:
        f.write(SENTINEL)
    rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    return Box(base, root, outside, rootfd, SandboxFiles(rootfd))


@pytest.fixture
def box() -> Iterator[Box]:
    base = tempfile.mkdtemp(prefix="deltabox-files-")
    mounts: list[str] = []
    try:
        b = _make_box(base, os.path.join(base, "root"))
        b.mounts = mounts
        try:
            yield b
        finally:
            os.close(b.rootfd)
    finally:
        _cleanup(base, mounts)


def _sentinel_intact(b: Box) -> bool:
    with open(os.path.join(b.outside, "sentinel"), "rb") as f:
        return f.read() == SENTINEL and sorted(os.listdir(b.outside)) == ["sentinel"]


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "",
            mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = kind, linkname, mode, 1_600_000_000
    return info


# ---- round trips -------------------------------------------------------------------------


def test_write_read_stat_list_remove_mkdir_round_trip(box: Box) -> None:
    f = box.files
    st = f.write("/workspace/a.txt", b"hello")
    assert st == FileStat("/workspace/a.txt", "file", 5, 0o644, st.mtime, "")
    assert f.read("/workspace/a.txt") == b"hello"
    assert f.stat("/workspace/a.txt").size == 5

    d = f.mkdir("/workspace/d/e/f")
    assert (d.type, d.path, d.mode) == ("dir", "/workspace/d/e/f", 0o755)
    assert f.mkdir("/workspace/d/e/f").type == "dir"  # mkdir -p is idempotent
    f.write("/workspace/d/z", b"z")
    f.write("/workspace/d/b", b"bb")
    os.symlink("/etc/passwd", box.path("/workspace/d/link"))
    listing = f.list("/workspace/d")
    assert [(e.path, e.type) for e in listing] == [
        ("/workspace/d/b", "file"), ("/workspace/d/e", "dir"),
        ("/workspace/d/link", "symlink"), ("/workspace/d/z", "file")]
    assert listing[2].link_target == "/etc/passwd"

    link = f.stat("/workspace/d/link")  # lstat semantics
    assert (link.type, link.link_target) == ("symlink", "/etc/passwd")
    os.symlink("/workspace/d/e", box.path("/workspace/dlink"))
    assert f.stat("/workspace/dlink/").type == "dir"  # a trailing slash follows, like POSIX
    with pytest.raises(FailedPrecondition, match="not a directory"):
        f.stat("/workspace/d/link/")
    f.remove("/workspace/dlink/")  # ... but remove acts on the link itself
    assert os.path.isdir(box.path("/workspace/d/e"))

    f.remove("/workspace/d/z")
    with pytest.raises(FailedPrecondition, match="directory not empty"):
        f.remove("/workspace/d")
    f.remove("/workspace/d", recursive=True)
    assert not os.path.lexists(box.path("/workspace/d"))
    with pytest.raises(NotFound, match="no such file in sandbox: /workspace/d"):
        f.stat("/workspace/d")
    # no temp files were left behind by the atomic writes
    assert [e.path for e in f.list("/workspace")] == ["/workspace/a.txt"]


def test_relative_paths_land_in_workspace(box: Box) -> None:
    box.files.write("rel/x.txt", b"1")
    assert open(box.path("/workspace/rel/x.txt"), "rb").read() == b"1"
    assert box.files.stat("rel/x.txt").path == "/workspace/rel/x.txt"
    assert box.files.read("./rel/../rel/x.txt") == b"1"
    other = SandboxFiles(box.rootfd, workdir="/home/u")
    other.write("y", b"2")
    assert open(box.path("/home/u/y"), "rb").read() == b"2"


def test_mkdir_without_parents(box: Box) -> None:
    with pytest.raises(NotFound):
        box.files.mkdir("/workspace/no/such", parents=False)
    assert box.files.mkdir("/workspace/one", parents=False).type == "dir"
    with pytest.raises(FailedPrecondition, match="already exists"):
        box.files.mkdir("/workspace/one", parents=False)
    box.files.write("/workspace/file", b"")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        box.files.mkdir("/workspace/file")
    # A rejected `mkdir -p` takes back the parents it made (found by tests/test_api_fuzz.py).
    before = sorted(box.files.list("/workspace"), key=lambda f: f.path)
    with pytest.raises(FailedPrecondition, match="not a directory"):
        box.files.mkdir("/workspace/cp-new/x/../../file/y")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        box.files.mkdir("/workspace/a/b/c/../../../file/z")
    assert sorted(box.files.list("/workspace"), key=lambda f: f.path) == before


def test_binary_and_large_round_trip(box: Box) -> None:
    blob = bytes(range(256)) * 7 + b"\0\xff\0"
    box.files.write("bin", blob)
    assert box.files.read("bin") == blob
    big = os.urandom(20 << 20)
    assert box.files.write("big", big).size == len(big)
    assert box.files.read("big") == big
    with pytest.raises(ResourceExhausted):
        box.files.read("big", max_bytes=1 << 20)


def test_modes_are_kept_or_set_and_umask_is_ignored(box: Box) -> None:
    old = os.umask(0o077)
    try:
        assert box.files.write("m", b"1").mode == 0o644
        assert box.files.mkdir("md").mode == 0o755
    finally:
        os.umask(old)
    box.files.write("m", b"1", mode=0o755)
    assert box.files.write("m", b"2").mode == 0o755  # kept when not given
    assert box.files.write("m", b"3", mode=0o4750).mode == 0o4750  # suid survives
    assert stat.S_IMODE(os.stat(box.path("/workspace/m")).st_mode) == 0o4750


def test_new_entries_take_the_parent_owner_and_replaced_files_keep_theirs(box: Box) -> None:
    os.chown(box.path("/workspace"), 1234, 2345)
    box.files.write("new/deep/file", b"x")
    for p in ("/workspace/new", "/workspace/new/deep", "/workspace/new/deep/file"):
        st = os.stat(box.path(p))
        assert (st.st_uid, st.st_gid) == (1234, 2345), p
    os.chown(box.path("/workspace/new/deep/file"), 777, 888)
    box.files.write("new/deep/file", b"y")
    st = os.stat(box.path("/workspace/new/deep/file"))
    assert (st.st_uid, st.st_gid) == (777, 888)


def test_append(box: Box) -> None:
    f = box.files
    f.write("log", b"a", append=True)
    f.write("log", b"b", append=True)
    assert f.read("log") == b"ab"
    os.symlink("/workspace/log", box.path("/workspace/log-link"))
    f.write("log-link", b"c", append=True)  # appending follows, inside the root
    assert f.read("log") == b"abc"
    os.symlink(os.path.join(box.outside, "sentinel"), box.path("/workspace/host-link"))
    with pytest.raises(FailedPrecondition):
        f.write("host-link", b"pwned", append=True)
    assert _sentinel_intact(box)


def test_errors_are_mapped(box: Box) -> None:
    f = box.files
    for bad in ("", "a\0b", "/" + "a" * 4096):
        with pytest.raises(InvalidArgument):
            f.read(bad)
    with pytest.raises(NotFound, match=r"^no such file in sandbox: /workspace/missing$"):
        f.read("missing")
    with pytest.raises(FailedPrecondition, match="is a directory"):
        f.read("/workspace")
    with pytest.raises(FailedPrecondition):
        f.write("/workspace", b"x")
    f.mkdir("dir")
    with pytest.raises(FailedPrecondition, match="is a directory"):
        f.write("dir", b"x")
    f.write("plain", b"x")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        f.list("plain")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        f.write("plain/child", b"x")
    with pytest.raises(InvalidArgument):
        f.remove("/")
    with pytest.raises(NotFound):
        f.write("nope/x", b"x", make_parents=False)
    os.mkfifo(box.path("/workspace/fifo"))
    with pytest.raises(FailedPrecondition, match="not a regular file"):
        f.read("fifo")  # must not block on the FIFO
    os.symlink("loop", box.path("/workspace/loop"))
    with pytest.raises(InvalidArgument):
        f.read("loop")


def test_no_fd_is_leaked(box: Box) -> None:
    before = len(os.listdir("/proc/self/fd"))
    f = box.files
    for _ in range(20):
        f.write("t/a", b"1")
        f.write("t/a", b"2", append=True)
        f.read("t/a")
        f.stat("t/a")
        f.list("t")
        f.download_tar("t")
        f.upload_tar("u", f.download_tar("t"))
        for call in (lambda: f.read("missing"), lambda: f.read("t"), lambda: f.remove("t"),
                     lambda: f.upload_tar("u", b"garbage")):
            with pytest.raises(Exception):
                call()
        f.remove("t", recursive=True)
        f.remove("u", recursive=True)
    assert len(os.listdir("/proc/self/fd")) == before


def test_disk_full_is_resource_exhausted() -> None:
    base = tempfile.mkdtemp(prefix="deltabox-files-enospc-")
    small = os.path.join(base, "small")
    os.mkdir(small)
    mounts: list[str] = []
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", small],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount tmpfs: {proc.stderr.strip()}")
        mounts.append(small)
        b = _make_box(base, small)  # the sandbox root *is* the small file system
        try:
            with pytest.raises(ResourceExhausted):
                b.files.write("big", b"x" * (2 << 20))
            assert not [n for n in os.listdir(b.path("/workspace")) if n.startswith(".deltabox")]
        finally:
            os.close(b.rootfd)
    finally:
        _cleanup(base, mounts)


# ---- confinement -------------------------------------------------------------------------


def test_dotdot_stays_inside_the_root(box: Box) -> None:
    assert box.files.read("../../etc/passwd") == FAKE_PASSWD
    assert box.files.read("/../../../../etc/passwd") == FAKE_PASSWD
    os.symlink("../../../../../../../..", box.path("/workspace/up"))
    assert box.files.read("up/etc/passwd") == FAKE_PASSWD
    box.files.write("../../../../../escaped", b"x")
    assert os.path.exists(box.path("/escaped"))
    assert not os.path.exists(os.path.join(box.base, "escaped"))


def test_absolute_symlink_resolves_inside_the_root(box: Box) -> None:
    os.symlink("/etc", box.path("/workspace/evil"))
    assert box.files.read("evil/passwd") == FAKE_PASSWD
    name = f"deltabox-planted-{uuid.uuid4().hex}"
    try:
        box.files.write(f"evil/{name}", b"x")
        assert os.path.exists(box.path(f"/etc/{name}"))
        assert not os.path.exists(f"/etc/{name}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/etc/{name}")


def test_writing_through_a_parent_symlink_never_touches_the_host(box: Box) -> None:
    os.symlink(box.outside, box.path("/workspace/hostdir"))  # absolute *host* path
    # Inside the sandbox that path does not exist: a dangling symlink, so (like mkdir -p)
    # creating parents through it fails instead of writing to the host directory.
    with pytest.raises(NotFound):
        box.files.write("hostdir/pwned", b"x")
    with pytest.raises(NotFound):
        box.files.read("hostdir/sentinel")
    assert _sentinel_intact(box)
    # Once the same path exists inside the root, the write goes there, never to the host.
    os.makedirs(box.path(box.outside))
    box.files.write("hostdir/pwned", b"x")
    assert open(box.path(box.outside + "/pwned"), "rb").read() == b"x"
    assert _sentinel_intact(box)
    os.symlink("../../outside/sentinel", box.path("/workspace/relhost"))  # host-valid relative
    with pytest.raises(NotFound):
        box.files.read("relhost")


def test_write_replaces_a_final_symlink_instead_of_following_it(box: Box) -> None:
    target = os.path.join(box.outside, "sentinel")
    os.symlink(target, box.path("/workspace/victim"))
    os.symlink("/etc/passwd", box.path("/workspace/victim2"))
    st = box.files.write("victim", b"new")
    box.files.write("victim2", b"new2")
    assert st.type == "file"
    assert not os.path.islink(box.path("/workspace/victim"))
    assert open(box.path("/workspace/victim"), "rb").read() == b"new"
    assert open(box.path("/etc/passwd"), "rb").read() == FAKE_PASSWD
    assert _sentinel_intact(box)


def test_remove_recursive_removes_links_not_their_targets(box: Box) -> None:
    os.makedirs(box.path("/workspace/tree/a/b"))
    open(box.path("/workspace/tree/a/b/f"), "wb").close()
    os.symlink(box.outside, box.path("/workspace/tree/a/hostdir"))
    os.symlink("/", box.path("/workspace/tree/a/b/slash"))
    os.symlink("/etc", box.path("/workspace/tree/etc"))
    box.files.remove("tree", recursive=True)
    assert not os.path.lexists(box.path("/workspace/tree"))
    assert _sentinel_intact(box)
    assert open(box.path("/etc/passwd"), "rb").read() == FAKE_PASSWD
    os.symlink(box.outside, box.path("/workspace/l"))
    box.files.remove("l")  # remove a symlink itself, even non-recursively
    assert _sentinel_intact(box)


def test_mounts_inside_the_root_are_refused(box: Box) -> None:
    mnt = box.path("/mnt")
    os.mkdir(mnt)
    box.mount("-t", "tmpfs", "tmpfs", mnt)
    with open(os.path.join(mnt, "secret"), "wb") as f:
        f.write(b"other fs")
    os.symlink("/mnt", box.path("/workspace/m"))
    os.makedirs(box.path("/workspace/tree"))
    os.symlink("/mnt", box.path("/workspace/tree/link-to-mount"))
    f = box.files
    calls = [lambda: f.stat("/mnt"), lambda: f.list("/mnt"), lambda: f.read("/mnt/secret"),
             lambda: f.write("/mnt/x", b"x"), lambda: f.write("m/y", b"y"),
             lambda: f.mkdir("/mnt/sub"), lambda: f.remove("/mnt/secret"),
             lambda: f.remove("/mnt", recursive=True), lambda: f.download_tar("/mnt"),
             lambda: f.upload_tar("/mnt", _tar((_member("z"), b"z")))]
    for call in calls:
        with pytest.raises(InvalidArgument, match="cannot leave the sandbox's file system"):
            call()
    assert sorted(os.listdir(mnt)) == ["secret"]
    # a mount point *inside* a tree: removal refuses to enter it, the archive skips it
    box.files.remove("tree", recursive=True)  # the link to the mount is just a link
    names = tarfile.open(fileobj=io.BytesIO(f.download_tar("/")), mode="r:").getnames()
    assert "mnt" in names and "mnt/secret" not in names
    assert "workspace/m" in names
    with pytest.raises(InvalidArgument):
        f.remove("/", recursive=True)
    assert sorted(os.listdir(mnt)) == ["secret"]


def test_magic_links_and_proc_are_refused(box: Box) -> None:
    proc = box.path("/proc")
    os.mkdir(proc)
    box.mount("--bind", "/proc", proc)
    os.symlink("/proc/self/root", box.path("/workspace/ml"))
    f = box.files
    for call in (lambda: f.read("ml/etc/passwd"), lambda: f.read("/proc/self/root/etc/passwd"),
                 lambda: f.stat("/proc/1"), lambda: f.write("ml/tmp/pwned", b"x"),
                 lambda: f.list("/proc/self/fd")):
        with pytest.raises(InvalidArgument):
            call()


# ---- races -------------------------------------------------------------------------------


@contextlib.contextmanager
def _background(loop_body) -> Iterator[None]:
    """Run loop_body repeatedly in a thread with a tiny GIL switch interval, so it really
    interleaves with the syscalls of the main thread."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            loop_body()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)


def test_race_directory_swapped_for_symlink_to_slash(box: Box) -> None:
    marker = f"deltabox-race-{uuid.uuid4().hex}"
    flip, hidden = box.path("/workspace/flip"), box.path("/workspace/flip.real")
    os.mkdir(flip)

    def swap() -> None:
        with contextlib.suppress(OSError):
            if os.path.islink(flip):
                os.unlink(flip)
            if os.path.isdir(hidden) and not os.path.lexists(flip):
                os.rename(hidden, flip)
            os.rename(flip, hidden)
            os.symlink("/", flip)  # on the host this is the host's root

    ok = 0
    try:
        with _background(swap):
            for i in range(500):
                name = f"flip/{marker}-{i}"
                with contextlib.suppress(NotFound, InvalidArgument, FailedPrecondition):
                    box.files.write(name, b"x", make_parents=False)
                    ok += 1
                with contextlib.suppress(NotFound, InvalidArgument, FailedPrecondition):
                    box.files.read(name)
                with contextlib.suppress(NotFound, InvalidArgument, FailedPrecondition):
                    box.files.write(f"flip/{marker}-sub/{i}", b"y")  # make_parents through it
        assert ok > 0
        assert glob.glob(f"/{marker}*") == []
        inside = [os.path.join(d, n) for d, dirs, files in os.walk(box.root)
                  for n in files + dirs if n.startswith(marker)]
        assert inside, "expected the writes to land somewhere inside the root"
    finally:
        for stray in glob.glob(f"/{marker}*"):  # never leave litter on the host, even on failure
            shutil.rmtree(stray) if os.path.isdir(stray) and not os.path.islink(stray) \
                else os.unlink(stray)


def test_race_final_component_swapped_for_host_symlink(box: Box) -> None:
    victim = box.path("/workspace/victim")
    host_target = os.path.join(box.outside, "sentinel")

    def swap() -> None:
        with contextlib.suppress(OSError):
            tmp = victim + ".l"
            os.symlink(host_target, tmp)
            os.rename(tmp, victim)  # atomically replace whatever is there with the link

    with _background(swap):
        for i in range(500):
            with contextlib.suppress(NotFound, FailedPrecondition):
                box.files.write("victim", b"%d" % i)
            with contextlib.suppress(NotFound, FailedPrecondition):
                assert box.files.read("victim") != SENTINEL
            with contextlib.suppress(NotFound, FailedPrecondition):
                box.files.write("victim", b"!", append=True)
    assert _sentinel_intact(box)


def test_race_remove_recursive_while_dirs_become_host_symlinks(box: Box) -> None:
    for _ in range(30):
        t = box.path("/workspace/t")
        os.makedirs(os.path.join(t, "d", "e"))
        for i in range(20):
            open(os.path.join(t, "d", "e", f"f{i}"), "wb").close()

        def swap() -> None:
            with contextlib.suppress(OSError):
                d = os.path.join(t, "d")
                os.rename(d, d + ".x")
                os.symlink(box.outside, d)

        with _background(swap):
            with contextlib.suppress(NotFound, FailedPrecondition):
                box.files.remove("t", recursive=True)
        with contextlib.suppress(NotFound):
            box.files.remove("t", recursive=True)
        assert _sentinel_intact(box)


# ---- tar ---------------------------------------------------------------------------------


@pytest.mark.parametrize("members", [
    [(_member("../../x"), b"x")],
    [(_member("a/../../x"), b"x")],
    [(_member("/abs"), b"x")],
    [(_member("l", tarfile.SYMTYPE, "/"), None), (_member("l/etc/pwned"), b"x")],
    [(_member("l", tarfile.SYMTYPE, "../.."), None), (_member("l/x"), b"x")],
    [(_member("l", tarfile.SYMTYPE, "/tmp"), None), (_member("l", tarfile.DIRTYPE), None)],
    [(_member("l", tarfile.SYMTYPE, "/etc"), None),
     (_member("h", tarfile.LNKTYPE, "l/passwd"), None)],
    [(_member("dev", tarfile.CHRTYPE), None)],
    [(_member("blk", tarfile.BLKTYPE), None)],
], ids=["dotdot", "inner-dotdot", "absolute", "through-symlink-abs", "through-symlink-rel",
        "symlink-then-dir", "hardlink-through-symlink", "chr-device", "blk-device"])
def test_upload_tar_rejects_malicious_members(box: Box, members) -> None:
    with pytest.raises(InvalidArgument):
        box.files.upload_tar("dest", _tar(*members))
    assert not os.path.lexists(box.path("/workspace/dest"))  # validated before writing anything
    assert not os.path.lexists(box.path("/x")) and not os.path.lexists(box.path("/etc/pwned"))
    assert _sentinel_intact(box)


def test_upload_tar_follows_preexisting_symlinks_only_inside_the_root(box: Box) -> None:
    os.makedirs(box.path("/workspace/dest"))
    os.symlink("/", box.path("/workspace/dest/slash"))
    os.symlink(box.outside, box.path("/workspace/dest/host"))
    name = f"deltabox-tar-{uuid.uuid4().hex}"
    try:
        with pytest.raises(NotFound):  # dangling inside the sandbox
            box.files.upload_tar("dest", _tar((_member("host/pwned"), b"2")))
        assert _sentinel_intact(box)
        os.makedirs(box.path(box.outside))
        n = box.files.upload_tar("dest", _tar((_member(f"slash/{name}"), b"1"),
                                              (_member("host/pwned"), b"2")))
        assert n == 2
        assert os.path.exists(box.path(f"/{name}")) and not os.path.exists(f"/{name}")
        assert os.path.exists(box.path(box.outside + "/pwned"))
        assert _sentinel_intact(box)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/{name}")


def test_upload_tar_garbage_and_compressed_are_invalid(box: Box) -> None:
    with pytest.raises(InvalidArgument):
        box.files.upload_tar("dest", b"not a tar at all" * 100)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.addfile(_member("x"), io.BytesIO(b""))
    with pytest.raises(InvalidArgument):
        box.files.upload_tar("dest", buf.getvalue())


def test_upload_tar_creates_all_kinds_and_replaces_links(box: Box) -> None:
    os.makedirs(box.path("/workspace/dest"))
    os.symlink(os.path.join(box.outside, "sentinel"), box.path("/workspace/dest/f"))
    n = box.files.upload_tar("dest", _tar(
        (_member("./", tarfile.DIRTYPE, mode=0o700), None),
        (_member("d/", tarfile.DIRTYPE, mode=0o750), None),
        (_member("f", mode=0o600), b"file"),  # replaces the pre-existing host symlink
        (_member("d/x.sh", mode=0o755), b"#!/bin/sh\n"),
        (_member("s", tarfile.SYMTYPE, "/etc/passwd"), None),
        (_member("h", tarfile.LNKTYPE, "d/x.sh"), None),
        (_member("p", tarfile.FIFOTYPE, mode=0o640), None),
        (_member("a/../b"), b"b")))
    assert n == 8
    ls = {e.path.rsplit("/", 1)[1]: e for e in box.files.list("dest")}
    assert {k: (v.type, v.mode) for k, v in ls.items()} == {
        "b": ("file", 0o644), "d": ("dir", 0o750), "f": ("file", 0o600),
        "h": ("file", 0o755), "p": ("other", 0o640), "s": ("symlink", 0o777)}
    assert ls["s"].link_target == "/etc/passwd"
    assert ls["d"].mtime == 1_600_000_000
    assert box.files.read("dest/h") == b"#!/bin/sh\n"
    assert os.stat(box.path("/workspace/dest/h")).st_ino == \
        os.stat(box.path("/workspace/dest/d/x.sh")).st_ino
    assert stat.S_IMODE(os.stat(box.path("/workspace/dest")).st_mode) == 0o755  # './' left alone
    assert _sentinel_intact(box)


def test_download_tar_round_trips_a_tree(box: Box) -> None:
    f = box.files
    blob = os.urandom(100_000)
    f.write("src/a.bin", blob, mode=0o640)
    f.write("src/sub/b.txt", b"b")
    f.mkdir("src/empty")
    os.symlink("/etc/passwd", box.path("/workspace/src/abs-link"))
    os.symlink("a.bin", box.path("/workspace/src/sub/rel-link"))
    os.symlink(box.outside, box.path("/workspace/src/host-link"))

    data = f.download_tar("src")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        kinds = {m.name: ("dir" if m.isdir() else "sym" if m.issym() else "file")
                 for m in tf.getmembers()}
    assert kinds == {"a.bin": "file", "abs-link": "sym", "empty": "dir", "host-link": "sym",
                     "sub": "dir", "sub/b.txt": "file", "sub/rel-link": "sym"}

    assert f.upload_tar("dst", data) == len(kinds)

    def tree(top: str) -> dict[str, tuple]:
        out = {}
        stack = [top]
        while stack:
            d = stack.pop()
            for e in f.list(d):
                rel = e.path[len(top):]
                out[rel] = (e.type, e.mode, e.size if e.type != "dir" else 0, e.link_target,
                            f.read(e.path) if e.type == "file" else None)
                if e.type == "dir":
                    stack.append(e.path)
        return out

    assert tree("/workspace/dst") == tree("/workspace/src")
    assert f.read("dst/a.bin") == blob
    assert _sentinel_intact(box)

    single = f.download_tar("src/sub/b.txt")
    with tarfile.open(fileobj=io.BytesIO(single), mode="r:") as tf:
        assert [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()] == [("b.txt", b"b")]
    with pytest.raises(ResourceExhausted):
        f.download_tar("src", max_bytes=50_000)
