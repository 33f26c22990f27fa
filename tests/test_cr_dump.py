"""Process images on disk (native/criu_incr.c through deltabox.cr.native): dump a template,
release it, kill the process, restore from the image in a host process and spawn; real
processes only (root, x86_64)."""

from __future__ import annotations

import json
import logging
import os
import platform
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import build_libdbxcr

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or platform.machine() != "x86_64",
    reason="needs root on x86_64 (ptrace, clone3, process_vm_writev)")

# 200 MB of patterned memory (each MiB a different 32-byte pattern) and a dict; commands
# on stdin, JSON answers on stdout.  "hash" hashes the memory itself.
PROGRAM = r"""
import hashlib, json, os, sys
MB = int(sys.argv[1])
buf = bytearray(MB << 20)
for i in range(MB):
    buf[i << 20:(i + 1) << 20] = hashlib.sha256(i.to_bytes(4, "little")).digest() * 32768
state = {"counter": 0, "items": {"a": 1, "nested": [1, 2, {"x": "y"}]}}

def send(o):
    os.write(1, (json.dumps(o) + "\n").encode())

send({"ready": True, "pid": os.getpid()})
while True:
    line = sys.stdin.buffer.readline()
    if not line or line == b"quit\n":
        break
    state["counter"] += 1
    cmd = line.split()
    if cmd[0] == b"hash":
        send({"hash": hashlib.sha256(buf).hexdigest(), **state})
    elif cmd[0] == b"mutate":           # flip one byte in every page of [a, b) MiB
        a, b = int(cmd[1]), int(cmd[2])
        for off in range(a << 20, b << 20, 4096):
            buf[off] ^= 0xFF
        send({"ok": True})
    elif cmd[0] == b"set":
        state["items"][cmd[1].decode()] = cmd[2].decode()
        send({"ok": True})
"""

# A host for restored templates: reaps its children (restored templates and their
# children are born as its children).
HOST = ("import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        time.sleep(0.05)\n")


@pytest.fixture(scope="module")
def native():
    """The binding on a libdbxcr.so built from the current sources (Makefile command)."""
    lib = build_libdbxcr("dbxcr-dump-")
    build = lib.parent
    os.environ["DELTABOX_LIBDBXCR"] = str(lib)
    from deltabox.cr import native as mod
    mod._lib = None
    mod._img_bound = False
    try:
        yield mod
    finally:
        os.environ.pop("DELTABOX_LIBDBXCR", None)
        mod._lib = None
        mod._img_bound = False
        shutil.rmtree(build, ignore_errors=True)


class Lines:
    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def read_raw(self, timeout: float = 20.0) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError("no line from process")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError("process closed its stdout")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def read(self, timeout: float = 20.0) -> dict:
        return json.loads(self.read_raw(timeout))


class Proc:
    def __init__(self, pid: int, stdin: int, stdout: int) -> None:
        self.pid, self.stdin, self.out = pid, stdin, Lines(stdout)

    def ask(self, cmd: str) -> dict:
        os.write(self.stdin, (cmd + "\n").encode())
        return self.out.read()

    def close(self) -> None:
        for fd in (self.stdin, self.out.fd):
            try:
                os.close(fd)
            except OSError:
                pass


class World:
    """Everything a test starts, torn down even when the test fails."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.pids: list[int] = []
        self.templates: list = []
        self.procs: list[Proc] = []
        self.dir = Path(tempfile.mkdtemp(prefix="dbxcr-img-"))

    def start(self, argv: list[str]) -> Proc:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.popens.append(p)
        proc = Proc(p.pid, os.dup(p.stdin.fileno()), os.dup(p.stdout.fileno()))
        p.stdin.close()
        p.stdout.close()
        self.procs.append(proc)
        return proc

    def host(self) -> int:
        p = subprocess.Popen([sys.executable, "-c", HOST])
        self.popens.append(p)
        time.sleep(0.2)
        return p.pid

    def spawn(self, tpl) -> Proc:
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        try:
            pid = tpl.spawn(fds={0: r_in, 1: w_out})
        except BaseException:
            for fd in (w_in, r_out):
                os.close(fd)
            raise
        finally:
            os.close(r_in)
            os.close(w_out)
        self.pids.append(pid)
        proc = Proc(pid, w_in, r_out)
        self.procs.append(proc)
        return proc

    def keep(self, tpl):
        self.templates.append(tpl)
        return tpl

    def cleanup(self) -> None:
        for t in self.templates:
            try:
                t.release()
            except Exception:
                pass
        for pid in self.pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for p in self.popens:
            p.kill()
            p.wait()
        for proc in self.procs:
            proc.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def world():
    w = World()
    try:
        yield w
    finally:
        w.cleanup()


def blocked_in_read(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        try:
            nr = Path(f"/proc/{pid}/syscall").read_text().split()[0]
        except (FileNotFoundError, IndexError):
            nr = ""
        seen = seen + 1 if nr == "0" else 0
        if seen >= 2:
            return
        time.sleep(0.02)
    raise TimeoutError(f"pid {pid} never blocked in read")


def private_mb(pid: int) -> float:
    """Memory only this process maps (smaps_rollup Private_Clean + Private_Dirty)."""
    kb = 0
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            kb += int(line.split()[1])
    return kb / 1024


def kill_original(world: World, proc: Proc) -> None:
    for p in world.popens:
        if p.pid == proc.pid:
            p.kill()
            p.wait()


def test_dump_restore_python_200mb_incremental(native, world: World) -> None:
    proc = world.start([sys.executable, "-c", PROGRAM, "200"])
    assert proc.out.read(60)["ready"]
    assert proc.ask("set k v")["ok"]
    h0 = proc.ask("hash")
    blocked_in_read(proc.pid)
    tpl = world.keep(native.make_template(proc.pid))
    full = native.dump(tpl, world.dir / "c1")
    # Dumping reads the template's pages without unsharing them from the live process (a
    # pinned read would: then every template cost its whole RSS and its process too).
    assert private_mb(tpl.pid) < 20 and private_mb(proc.pid) < 20, \
        (private_mb(tpl.pid), private_mb(proc.pid))
    assert full.depth == 0
    assert full.pages_written >= 200 * 256
    assert full.bytes_written >= 200 << 20
    native.verify_image(world.dir / "c1")

    # The process changes 10 MB; the next checkpoint's image is a delta.
    assert proc.ask("mutate 50 60")["ok"]
    h1 = proc.ask("hash")
    assert h1["hash"] != h0["hash"]
    blocked_in_read(proc.pid)
    tpl2 = world.keep(native.make_template(proc.pid))
    inc = native.dump(tpl2, world.dir / "c2", parent=world.dir / "c1")
    changed = 10 << 20
    assert inc.depth == 1
    assert inc.bytes_written <= 1.2 * changed, inc
    assert inc.pages_parent >= 190 * 256
    assert native.image_depends_on(world.dir / "c2") == [str(world.dir / "c1")]

    # Templates gone, original gone: only the images remain.
    tpl.release()
    tpl2.release()
    kill_original(world, proc)

    host = world.host()
    t0 = time.perf_counter()
    rtpl = world.keep(native.restore_template(host, world.dir / "c2", "/"))
    restore_ms = (time.perf_counter() - t0) * 1000
    assert rtpl.origin == proc.pid
    child = world.spawn(rtpl)
    got = child.ask("hash")
    # Same memory, same dict; the loop continued (counter one past the checkpoint's).
    assert got["hash"] == h1["hash"]
    assert got["items"] == {"a": 1, "nested": [1, 2, {"x": "y"}], "k": "v"}
    assert got["counter"] == h1["counter"] + 1
    assert child.ask("set z 1")["ok"]
    assert child.ask("hash")["items"]["z"] == "1"
    # A second child from the same restored template starts from the checkpoint again.
    child2 = world.spawn(rtpl)
    got2 = child2.ask("hash")
    assert got2["hash"] == h1["hash"] and "z" not in got2["items"]
    print(f"restore 200 MB from disk: {restore_ms:.1f} ms; full dump {full.ms:.0f} ms "
          f"{full.bytes_written >> 20} MiB; incremental {inc.ms:.0f} ms "
          f"{inc.bytes_written / changed:.3f}x of the bytes changed")

    # The full image restores the first checkpoint.
    rtpl1 = world.keep(native.restore_template(host, world.dir / "c1", "/"))
    assert world.spawn(rtpl1).ask("hash")["hash"] == h0["hash"]


BASH_INIT = "X=hello; declare -A M=([k]=v); N=41\n"


def test_dump_restore_bash(native, world: World) -> None:
    proc = world.start(["bash", "--norc", "--noprofile"])
    os.write(proc.stdin, BASH_INIT.encode())
    os.write(proc.stdin, b'echo "ready $X"\n')
    assert proc.out.read_raw() == b"ready hello"
    blocked_in_read(proc.pid)
    tpl = world.keep(native.make_template(proc.pid))
    native.dump(tpl, world.dir / "b1")
    tpl.release()
    kill_original(world, proc)
    host = world.host()
    rtpl = world.keep(native.restore_template(host, world.dir / "b1"))
    child = world.spawn(rtpl)
    os.write(child.stdin, b'echo "$X ${M[k]} $((N+1)) $$"\n')
    words = child.out.read_raw().split()
    assert words[:3] == [b"hello", b"v", b"42"]
    os.write(child.stdin, b"echo $(echo sub)shell\n")   # fork + exec + wait still work
    assert child.out.read_raw() == b"subshell"


def test_corrupted_and_truncated_images_are_refused(native, world: World) -> None:
    proc = world.start([sys.executable, "-c", PROGRAM, "8"])
    assert proc.out.read(30)["ready"]
    blocked_in_read(proc.pid)
    tpl = world.keep(native.make_template(proc.pid))
    native.dump(tpl, world.dir / "a")
    assert proc.ask("mutate 0 2")["ok"]
    blocked_in_read(proc.pid)
    tpl2 = world.keep(native.make_template(proc.pid))
    native.dump(tpl2, world.dir / "b", parent=world.dir / "a")
    host = world.host()

    # A flipped byte in the parent's pages: the child image depends on it.
    pages = world.dir / "a" / "pages.img"
    data = bytearray(pages.read_bytes())
    data[5 * 4096 + 123] ^= 1
    pages.write_bytes(bytes(data))
    with pytest.raises(native.ImageCorrupt, match="pages.img"):
        native.verify_image(world.dir / "b")
    with pytest.raises(native.ImageCorrupt, match="hash check"):
        native.restore_template(host, world.dir / "b")
    data[5 * 4096 + 123] ^= 1
    pages.write_bytes(bytes(data))
    native.verify_image(world.dir / "b")

    # Truncated page data, truncated metadata, flipped metadata, missing parent.
    bpages = world.dir / "b" / "pages.img"
    good = bpages.read_bytes()
    bpages.write_bytes(good[:-4096])
    with pytest.raises(native.ImageCorrupt, match="truncated"):
        native.restore_template(host, world.dir / "b")
    bpages.write_bytes(good)
    core = world.dir / "b" / "core.img"
    cgood = core.read_bytes()
    core.write_bytes(cgood[:100] + bytes([cgood[100] ^ 0x10]) + cgood[101:])
    with pytest.raises(native.ImageCorrupt, match="core.img checksum"):
        native.restore_template(host, world.dir / "b")
    core.write_bytes(cgood[:-3])
    with pytest.raises(native.ImageCorrupt, match="core.img"):
        native.verify_image(world.dir / "b")
    core.write_bytes(cgood)
    (world.dir / "a").rename(world.dir / "a-moved")
    with pytest.raises(native.ImageCorrupt, match="parent image"):
        native.restore_template(host, world.dir / "b")
    (world.dir / "a-moved").rename(world.dir / "a")
    # Intact again: restores, and nothing is left behind by the failed attempts.
    rtpl = world.keep(native.restore_template(host, world.dir / "b"))
    assert world.spawn(rtpl).ask("hash")["counter"] >= 1
    assert sorted(p.name for p in world.dir.iterdir()) == ["a", "b"]


def test_dump_refusals(native, world: World) -> None:
    proc = world.start([sys.executable, "-c", PROGRAM, "1"])
    assert proc.out.read(30)["ready"]
    blocked_in_read(proc.pid)
    tpl = world.keep(native.make_template(proc.pid))
    native.dump(tpl, world.dir / "x")
    with pytest.raises(native.CRError) as e:
        native.dump(tpl, world.dir / "x")
    assert not isinstance(e.value, native.ImageCorrupt)
    tpl.release()
    with pytest.raises(native.CRError, match="released"):
        native.dump(tpl, world.dir / "y")
    with pytest.raises(native.ImageCorrupt):
        native.restore_template(os.getpid(), world.dir / "nonexistent")


def test_dump_gc_keeps_the_chains_of_images_being_read(native, world: World, caplog) -> None:
    """The daemon deletes a deleted checkpoint's dump once no image needs it
    (daemon/dumps.py, Dumps.gc). An image read as a dump's parent needs its own parents
    too: a 32 x 1000 soak deleted them while a dump read their child, and the restores
    of later dumps failed ("parent image ... is missing"). A chain broken anyway keeps
    what is before the break."""
    from deltabox.daemon.db import Database
    from deltabox.daemon.dumps import DumpRow, Dumps
    from deltabox.daemon.scheduler import IOScheduler

    root = world.dir / "dumps"
    proc = world.start([sys.executable, "-c", PROGRAM, "8"])
    assert proc.out.read(30)["ready"]
    images = {}
    parent = None
    for cp in ("cp-a", "cp-b", "cp-c"):
        assert proc.ask("mutate 0 1")["ok"]
        blocked_in_read(proc.pid)
        tpl = world.keep(native.make_template(proc.pid))
        images[cp] = root / cp / "7"
        images[cp].parent.mkdir(parents=True)
        native.dump(tpl, images[cp], parent=parent)
        parent = images[cp]
        tpl.release()
    assert native.image_depends_on(images["cp-c"]) == [str(images["cp-b"]),
                                                       str(images["cp-a"])]

    def dumps() -> Dumps:   # a daemon's, on the same state (a restart: nothing cached)
        return Dumps(Database(world.dir / "db.sqlite"), root, cr=None, io=IOScheduler())

    d = dumps()
    for cp in ("cp-a", "cp-b"):      # their checkpoints deleted
        d._put(DumpRow(cp, "sb", "dropped", created_at=time.time()))
    d._hold([images["cp-b"]])        # c's dump under way, reading b as its parent
    assert d.gc() == 0
    assert images["cp-a"].is_dir() and images["cp-b"].is_dir()
    d._put(DumpRow("cp-c", "sb", "complete", created_at=time.time()))
    d._let_go([images["cp-b"]])
    assert d.gc() == 0 and d.in_use == {}
    assert images["cp-a"].is_dir() and images["cp-b"].is_dir()

    shutil.rmtree(images["cp-a"].parent)    # damage: c's chain breaks past b
    with caplog.at_level(logging.WARNING, logger="deltaboxd"):
        assert dumps().gc() == 0
    assert images["cp-b"].is_dir()
    assert "process dump of cp-c:" in caplog.text and "cp-a" in caplog.text
    d._put(DumpRow("cp-c", "sb", "dropped", created_at=time.time()))
    assert dumps().gc() == 3 and list(root.iterdir()) == []
