"""libdbxcr through its ctypes binding, on real python3 processes (root, x86_64)."""

from __future__ import annotations

import errno
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or platform.machine() != "x86_64",
    reason="needs root on x86_64 (ptrace, setns, clone3 set_tid)")

PROGRAM = r"""
import json, os, sys
state = {"counter": 0, "items": {"a": 1}}
fd = os.open(sys.argv[1], os.O_RDONLY)
os.read(fd, 4)

def send(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())

send({"ready": True})
while True:
    line = sys.stdin.buffer.readline()
    if not line or line == b"quit\n":
        break
    cmd = line.strip().decode()
    if cmd == "inc":
        state["counter"] += 1
        state["items"][f"k{state['counter']}"] = state["counter"]
    elif cmd == "report":
        send({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), **state})
    elif cmd == "readf":
        data = os.read(fd, 3).decode()
        send({"data": data, "offset": os.lseek(fd, 0, os.SEEK_CUR)})
"""


@pytest.fixture(scope="module")
def native():
    """The binding, on a libdbxcr.so built from the current source (same command as the
    Makefile rule) so the test never runs a stale library."""
    build = Path(tempfile.mkdtemp(prefix="dbxcr-"))
    lib = build / "libdbxcr.so"
    subprocess.run(["gcc", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
                    "-D_GNU_SOURCE", "-fPIC", "-shared", "-o", str(lib),
                    str(ROOT / "native" / "fork_template.c")], check=True)
    os.environ["DELTABOX_LIBDBXCR"] = str(lib)
    from deltabox.cr import native as mod
    mod._lib = None
    try:
        yield mod
    finally:
        os.environ.pop("DELTABOX_LIBDBXCR", None)
        lib.unlink()
        build.rmdir()


class Lines:
    """Line reader with a timeout on a pipe fd."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def read(self, timeout: float = 5.0) -> dict:
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
        return json.loads(line)


class Proc:
    """One process running PROGRAM: our ends of its stdin/stdout."""

    def __init__(self, pid: int, stdin: int, stdout: int) -> None:
        self.pid, self.stdin, self.out = pid, stdin, Lines(stdout)

    def ask(self, cmd: str) -> dict | None:
        os.write(self.stdin, (cmd + "\n").encode())
        return self.out.read() if cmd in ("report", "readf") else None

    def close(self) -> None:
        for fd in (self.stdin, self.out.fd):
            try:
                os.close(fd)
            except OSError:
                pass


def blocked_in_read(pid: int, timeout: float = 5.0) -> None:
    """Wait until pid sits in read(2) (seen twice, 20 ms apart)."""
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


def spawn_child(tpl, files, **kw) -> Proc:
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    try:
        pid = tpl.spawn(fds={0: r_in, 1: w_out}, files=files, **kw)
    except BaseException:
        for fd in (w_in, r_out):
            os.close(fd)
        raise
    finally:
        os.close(r_in)
        os.close(w_out)
    return Proc(pid, w_in, r_out)


def _try(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed back to the test thread
        return [e]
    return []


def kill_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def test_template_fork_rollback_python(native, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("0123456789abcdef")
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(data)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    orig = Proc(p.pid, p.stdin.fileno(), p.stdout.fileno())
    children: list[Proc] = []
    tpl = None
    try:
        assert orig.out.read() == {"ready": True}
        orig.ask("inc")
        assert orig.ask("report")["counter"] == 1
        blocked_in_read(p.pid)
        info = native.describe(p.pid)
        assert (info.threads, info.tracer_pid, info.refusal()) == (1, 0, None)

        files = [f for f in native.regular_files(p.pid) if f.path == str(data)]
        assert [(f.offset, f.flags & 3) for f in files] == [(4, os.O_RDONLY)]
        tpl = native.make_template(p.pid)
        assert tpl.origin == p.pid and native.describe(tpl.pid).state == "t"
        assert native.describe(p.pid).tracer_pid == 0

        # The template belongs to this thread's ptrace link; other threads are refused.
        import threading
        caught: list[BaseException] = []
        t = threading.Thread(target=lambda: caught.extend(_try(tpl.spawn)))
        t.start()
        t.join()
        assert len(caught) == 1 and caught[0].errno == errno.EPERM, caught

        # The original goes on and changes its state and its file offset.
        orig.ask("inc")
        orig.ask("inc")
        assert orig.ask("report")["counter"] == 3
        assert orig.ask("readf") == {"data": "456", "offset": 7}

        # Children continue from the checkpoint: old dict and counter, own offset.
        c1 = spawn_child(tpl, files, cwd="/tmp")
        children.append(c1)
        r = c1.ask("report")
        assert (r["pid"], r["ppid"], r["cwd"]) == (c1.pid, os.getpid(), "/tmp")
        assert (r["counter"], r["items"]) == (1, {"a": 1, "k1": 1})
        assert c1.ask("readf") == {"data": "456", "offset": 7}
        assert orig.ask("readf") == {"data": "789", "offset": 10}

        c2 = spawn_child(tpl, files)
        children.append(c2)
        c1.ask("inc")
        assert c1.ask("report")["counter"] == 2
        r = c2.ask("report")
        assert (r["counter"], r["items"]) == (1, {"a": 1, "k1": 1})
        assert c2.ask("readf") == {"data": "456", "offset": 7}
        for c in (c1, c2):
            c.ask("quit")
            assert os.waitpid(c.pid, 0)[1] == 0

        # Rollback: the original dies, a child takes its place with the same pid.
        p.kill()
        p.wait()
        c3 = spawn_child(tpl, files, set_tid=[p.pid])
        children.append(c3)
        assert c3.pid == p.pid
        r = c3.ask("report")
        assert (r["pid"], r["counter"]) == (p.pid, 1)

        with pytest.raises(native.CRError) as e:
            spawn_child(tpl, files, set_tid=[os.getpid()])
        assert e.value.errno == errno.EEXIST and "in use" in str(e.value)

        tpl_pid = tpl.pid
        tpl.release()
        assert not Path(f"/proc/{tpl_pid}").exists()
        with pytest.raises(native.CRError):
            tpl.spawn()
    finally:
        if tpl is not None:
            tpl.release()
        for c in children:
            kill_reap(c.pid)
            c.close()
        p.kill()
        p.wait()


def test_inject_getpid_into_sleeping_python(native) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c",
         "import time, os; t = time.monotonic(); time.sleep(0.5); "
         "os.write(1, b'%.3f' % (time.monotonic() - t))"],
        stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if Path(f"/proc/{p.pid}/syscall").read_text().split()[0] in ("230", "35"):
                    break
            except (FileNotFoundError, IndexError):
                pass
            time.sleep(0.01)
        assert native.inject_syscall(p.pid, 39) == p.pid        # getpid
        assert native.inject_syscall(p.pid, 110) == os.getpid()  # getppid
        out, _ = p.communicate(timeout=5)
        assert p.returncode == 0
        assert 0.5 <= float(out) < 1.5
    finally:
        p.kill()
        p.wait()


def test_refuses_multithreaded_python(native) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c",
         "import threading, time, os; threading.Thread(target=time.sleep, args=(30,)).start();"
         " os.write(1, b'r'); time.sleep(30)"],
        stdout=subprocess.PIPE)
    try:
        assert p.stdout.read(1) == b"r"
        assert native.describe(p.pid).threads == 2
        assert "2 threads" in native.describe(p.pid).refusal()
        with pytest.raises(native.CRError) as e:
            native.make_template(p.pid)
        assert e.value.errno == errno.ENOTSUP
        assert f"pid {p.pid}" in str(e.value) and "2 threads" in str(e.value)
    finally:
        p.kill()
        p.wait()
