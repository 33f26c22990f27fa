"""libdbxcr through its ctypes binding, on real python3 processes (root, x86_64)."""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import build_libdbxcr

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
    lib = build_libdbxcr("dbxcr-")
    build = lib.parent
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


def _clean_up(tpl, children: list[Proc], p: subprocess.Popen) -> None:
    """Release the template, kill its children and the original."""
    if tpl is not None:
        tpl.release()
    for c in children:
        kill_reap(c.pid)
        c.close()
    p.kill()
    p.wait()


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
        _clean_up(tpl, children, p)


def test_births_run_natively_on_the_ptrace_thread(native, tmp_path: Path) -> None:
    """PtraceWorker.births, a rollback's births: a carrier made on the ptrace thread gives
    birth there (native code, between the Python jobs posted around it) with the pid of
    the original, once the killed original has exited, and continues from the checkpoint;
    a birth that fails (a killed carrier, a second birth) comes back as its CRError beside
    the others, and the thread goes on with its jobs."""
    import trio

    from deltabox.cr.worker import PtraceWorker
    data = tmp_path / "data.txt"
    data.write_text("0123456789abcdef")
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(data)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    orig = Proc(p.pid, p.stdin.fileno(), p.stdout.fileno())
    assert orig.out.read() == {"ready": True}
    orig.ask("inc")
    blocked_in_read(p.pid)
    files = [f for f in native.regular_files(p.pid) if f.path == str(data)]
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    born: Proc | None = None

    async def main() -> None:
        nonlocal born
        async with PtraceWorker("test-ptrace") as w:
            tpl = await w.run(native.make_template, p.pid)
            try:
                carrier = await w.run(lambda: tpl.spawn_carrier(
                    fds={0: r_in, 1: w_out}, files=files))
                gone = await w.run(lambda: tpl.spawn_carrier(files=files))
                await w.run(gone.kill)
            finally:
                await w.run(tpl.release)
            try:
                orig.ask("inc")   # the original moves on, then dies unreaped
                victim = os.pidfd_open(p.pid)
                p.send_signal(signal.SIGKILL)
                ahead: list[float] = []

                def job_ahead() -> None:
                    time.sleep(0.05)
                    ahead.append(time.monotonic())
                try:
                    async with trio.open_nursery() as n:
                        n.start_soon(w.run, job_ahead)
                        await trio.sleep(0.01)
                        got = await w.births([(gone, None, 0), (carrier, p.pid, 0)],
                                             [victim], 2.0)
                        assert ahead, "the births ran before the job posted ahead of them"
                finally:
                    os.close(victim)
                # A killed carrier fails alone, as Carrier.birth would.
                assert isinstance(got[0], native.CRError) and got[0].errno == errno.EINVAL
                assert got[1] == p.pid and carrier.child == p.pid
                born = Proc(p.pid, w_in, r_out)
                assert born.ask("report")["counter"] == 1   # the checkpoint's, not 2
                again = await w.births([(carrier, None, 0)], [], 1.0)
                assert len(again) == 1 and isinstance(again[0], native.CRError)
                assert again[0].errno == errno.EINVAL and "birth" in str(again[0])
                assert await w.run(os.getpid) == os.getpid()   # the thread goes on
            finally:
                if born is not None:
                    born.ask("quit")
                await w.run(carrier.kill)

    try:
        trio.run(main)
    finally:
        for fd in (r_in, w_out):
            os.close(fd)
        if born is None:
            for fd in (w_in, r_out):
                os.close(fd)
        else:
            born.close()
        orig.close()
        p.kill()
        p.wait()   # reaps the born process: it has the original's pid, and is our child


def test_a_failed_job_queue_ends_the_daemon_loudly(native, monkeypatch) -> None:
    """If the ptrace thread's native job queue itself fails, nothing can run there any more:
    the trio run crashes with that error instead of every caller waiting for ever. A mock:
    the queue fails only on a bug (its eventfd closed under it), not a fault to cause."""
    import trio

    from deltabox.cr.worker import PtraceWorker

    def broken(self) -> None:
        raise native.CRError(errno.EBADF, "jobs: wait for a job: Bad file descriptor")
    monkeypatch.setattr(native.JobQueue, "wait", broken)

    async def main() -> None:
        async with PtraceWorker("test-ptrace"):
            with trio.fail_after(5):
                await trio.sleep_forever()

    with pytest.raises(trio.TrioInternalError) as e:
        trio.run(main)
    causes = []
    todo: list[BaseException] = [e.value]
    while todo:
        exc = todo.pop()
        causes.append(exc)
        todo.extend(getattr(exc, "exceptions", ()))
        if exc.__cause__ is not None:
            todo.append(exc.__cause__)
    assert any("job queue failed" in str(c) for c in causes), causes
    assert any(isinstance(c, native.CRError) and c.errno == errno.EBADF for c in causes)


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


def test_template_of_a_multithreaded_process(native) -> None:
    """Its threads are stopped, asked for their registrations and put back: the process
    and its threads run on as before. A child needs its threads' tids, which only a pid
    namespace where they are free gives (tested through the daemon: tests/test_cr.py);
    without a set_tid the spawn is refused by name."""
    p = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, threading, time\n"
         "n = [0, 0]\n"
         "def count(i):\n"
         "    while True:\n"
         "        n[i] += 1\n"
         "        time.sleep(0.002)\n"
         "for i in range(2): threading.Thread(target=count, args=(i,), daemon=True).start()\n"
         "for line in sys.stdin:\n"
         "    os.write(1, b'%d %d\\n' % tuple(n))\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def counts() -> list[int]:
        p.stdin.write(b"?\n")
        p.stdin.flush()
        return [int(x) for x in p.stdout.readline().split()]

    tpl = None
    try:
        counts()
        assert native.describe(p.pid).threads == 3
        tpl = native.make_template(p.pid)
        assert native.describe(p.pid).tracer_pid == 0
        assert all(native.describe(int(t)).tracer_pid == 0
                   for t in os.listdir(f"/proc/{p.pid}/task"))
        first = counts()
        time.sleep(0.2)
        assert all(b > a + 10 for a, b in zip(first, counts()))  # both threads run on
        with pytest.raises(native.CRError, match="multi-threaded.*its own pid") as e:
            tpl.spawn()
        assert e.value.errno == errno.ENOTSUP
    finally:
        if tpl is not None:
            tpl.release()
        p.kill()
        p.wait()


def test_refuses_more_threads_than_it_captures(native) -> None:
    """Threads are captured one by one (native/threads.c), up to MAX_THREADS."""
    n = native.MAX_THREADS + 4
    p = subprocess.Popen(
        [sys.executable, "-c",
         "import threading, time, os\n"
         f"for _ in range({n - 1}): threading.Thread(target=time.sleep, args=(30,)).start()\n"
         "os.write(1, b'r'); time.sleep(30)"],
        stdout=subprocess.PIPE)
    try:
        assert p.stdout.read(1) == b"r"
        assert native.describe(p.pid).threads == n
        assert f"{n} threads" in native.describe(p.pid).refusal()
        with pytest.raises(native.CRError) as e:
            native.make_template(p.pid)
        assert e.value.errno == errno.ENOTSUP
        assert f"pid {p.pid}" in str(e.value) and f"{n} threads" in str(e.value)
    finally:
        p.kill()
        p.wait()


# ---------- one-instant stop of a frozen process tree ----------

FREEZER = Path("/sys/fs/cgroup/freezer")

TREE = r"""
import ctypes, json, os, signal, sys, time
cnt_path, cmd_fd, rep_fd, info_fd = sys.argv[1], *map(int, sys.argv[2:5])
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
os.read(0, 1)                       # go: we are in the cgroup now
marker = 0

def report(**kw):
    os.write(rep_fd, (json.dumps({"pid": os.getpid(), "marker": marker, **kw}) + "\n").encode())

sleeper = os.fork()
if sleeper == 0:                    # nanosleep via libc: an EINTR would be visible
    marker = 111
    t0 = time.monotonic()
    ts = (ctypes.c_long * 2)(1, 0)
    rc = libc.nanosleep(ts, None)
    report(rc=rc, errno=ctypes.get_errno() if rc else 0, elapsed=time.monotonic() - t0)
    os._exit(0)
reader = os.fork()
if reader == 0:
    marker = 222
    report(data=os.read(cmd_fd, 100).decode())
    os._exit(0)
fd = os.open(cnt_path, os.O_WRONLY | os.O_APPEND)
os.write(info_fd, json.dumps({"kids": [sleeper, reader], "fd": fd}).encode() + b"\n")
c, nxt = 0, time.monotonic()
while True:                         # busy loop, one line per millisecond
    while time.monotonic() < nxt:
        pass
    nxt += 0.001
    c += 1
    os.write(fd, b"%d\n" % c)
"""


def _lines(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def _wait(cond, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


def _in_syscall(pid: int, nr: str) -> bool:
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == nr
    except (FileNotFoundError, IndexError):
        return False


class Freezer:
    """A cgroup v1 freezer cgroup for the test (removed on close)."""

    def __init__(self) -> None:
        self.path = FREEZER / f"dbx-test-{os.getpid()}-{os.urandom(4).hex()}"
        self.path.mkdir()

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def set(self, state: str) -> None:
        (self.path / "freezer.state").write_text(state)
        _wait(lambda: (self.path / "freezer.state").read_text().strip() == state, 2.0,
              f"freezer {state}")

    def thaw_now(self) -> None:
        """Thaw without waiting (cleanup: v1-frozen tasks die of SIGKILL only once thawed)."""
        try:
            (self.path / "freezer.state").write_text("THAWED")
        except OSError:
            pass

    def close(self) -> None:
        self.thaw_now()
        deadline = time.monotonic() + 2
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


@pytest.mark.skipif(not FREEZER.is_dir(), reason="no cgroup v1 freezer")
def test_stop_frozen_tree_python(native, tmp_path: Path) -> None:
    cnt, snap = tmp_path / "counter", tmp_path / "counter.snap"
    cnt.write_text("")
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()
    info_r, info_w = os.pipe()
    cg = Freezer()
    stops, tpls, extra, kids = [], [], [], []
    p = None
    try:
        p = subprocess.Popen([sys.executable, "-c", TREE, str(cnt), str(cmd_r), str(rep_w),
                              str(info_w)], stdin=subprocess.PIPE,
                             pass_fds=(cmd_r, rep_w, info_w))
        for fd in (cmd_r, rep_w, info_w):
            os.close(fd)
        cg.add(p.pid)
        p.stdin.write(b"g")
        p.stdin.flush()
        info = Lines(info_r).read()
        kids = info["kids"]
        pids = [p.pid, *kids]
        _wait(lambda: _in_syscall(kids[0], "230"), what="sleeper in clock_nanosleep")
        _wait(lambda: _in_syscall(kids[1], "0"), what="reader in read")
        _wait(lambda: len(_lines(cnt)) > 50, what="counter counting")

        cg.set("FROZEN")
        frozen_size = cnt.stat().st_size
        t0 = time.monotonic()
        stops = [native.begin_stop(pid) for pid in pids]
        assert time.monotonic() - t0 < 0.5          # never waits for a frozen task
        assert [s.kind for s in stops] == ["none"] * 3
        cg.set("THAWED")
        assert [s.wait(timeout=3) for s in stops] == ["interrupt"] * 3
        assert [native.proc_status(pid).state for pid in pids] == ["t"] * 3
        assert native.proc_status(kids[0]).tracer_pid == os.getpid()

        # Everything is stopped: the file holds still; snapshot it.
        # No user code ran between the thaw and the stops: not a single new line.
        assert cnt.stat().st_size == frozen_size
        time.sleep(0.03)
        assert cnt.stat().st_size == frozen_size
        snap.write_bytes(cnt.read_bytes())
        last = len(_lines(snap))
        assert _lines(snap) == list(range(1, last + 1))

        tpls = [s.make_template() for s in stops]
        for s in stops:
            s.resume()
        assert [native.proc_status(pid).tracer_pid for pid in pids] == [0] * 3

        # The originals continue: counting without gap, sleep without EINTR, read gets data.
        _wait(lambda: len(_lines(cnt)) > last + 20, what="counter continues")
        got = _lines(cnt)
        assert got == list(range(1, len(got) + 1))
        os.write(cmd_w, b"after")
        reports = Lines(rep_r)
        by_pid = {}
        while len(by_pid) < 2:
            r = reports.read(timeout=3)
            by_pid[r["pid"]] = r
        assert by_pid[kids[1]] == {"pid": kids[1], "marker": 222, "data": "after"}
        r = by_pid[kids[0]]
        assert (r["rc"], r["errno"], r["marker"]) == (0, 0, 111) and 0.99 <= r["elapsed"] < 2.5

        # Children of the templates start from the stop instant.
        r_in, w_in = os.pipe()
        try:
            extra.append(tpls[0].spawn(files=[native.ReopenFile(
                info["fd"], str(snap), os.O_WRONLY | os.O_APPEND, 0)]))
            extra.append(tpls[1].spawn())
            extra.append(tpls[2].spawn(fds={cmd_r: r_in}))
        finally:
            os.close(r_in)
        _wait(lambda: len(_lines(snap)) > last + 20, what="counter child counting")
        got = _lines(snap)
        assert got == list(range(1, len(got) + 1)), f"first new value {got[last]} != {last + 1}"
        os.write(w_in, b"tpl")
        os.close(w_in)
        by_pid = {}
        while len(by_pid) < 2:
            r = reports.read(timeout=3)
            by_pid[r["pid"]] = r
        assert by_pid[extra[2]] == {"pid": extra[2], "marker": 222, "data": "tpl"}
        r = by_pid[extra[1]]
        assert (r["rc"], r["errno"], r["marker"]) == (0, 0, 111) and 0.99 <= r["elapsed"] < 3
    finally:
        for s in stops:
            s.abort()
        for t in tpls:
            t.release()
        cg.thaw_now()
        for pid in extra + kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if extra:
            kill_reap(extra[0])     # a sibling of the tree parent: our child
        if p is not None:
            p.kill()
            p.wait()
        for fd in (cmd_w, rep_r, info_r):
            os.close(fd)
        cg.close()
        assert native.sweep_stops(0) == 0


SPAWN_THROUGH_FIFO = """
import os, sys
sys.stdin.read(1)
os.posix_spawn("/bin/true", ["true"], {}, file_actions=[
    (os.POSIX_SPAWN_OPEN, 0, sys.argv[1], os.O_RDONLY, 0)])
"""


def test_a_stop_inside_vfork_is_given_up_at_once(native, tmp_path: Path) -> None:
    """A process inside vfork() reaches no stop while its child is stopped too (here the
    child blocks opening a FIFO before its exec). The capture's wait names it as a passing
    state (Unsettled: the daemon lets the processes run and captures again) within a
    fraction of a second, not at the 5 s stop timeout."""
    from deltabox.cr import engine
    from deltabox.cr.capture import Unsettled
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    cg = Freezer()
    stops: list = []
    p = subprocess.Popen([sys.executable, "-c", SPAWN_THROUGH_FIFO, str(fifo)],
                         stdin=subprocess.PIPE)
    child = None
    try:
        cg.add(p.pid)
        p.stdin.write(b"g")
        p.stdin.flush()
        _wait(lambda: engine.in_vfork([p.pid]) == [p.pid], what="inside vfork")
        child = int(Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()[0])
        cg.set("FROZEN")
        stops = [native.begin_stop(child), native.begin_stop(p.pid)]
        cg.set("THAWED")
        t0 = time.monotonic()
        with pytest.raises(Unsettled, match=rf"pid {p.pid} \(python3?\) was inside vfork\(\)"):
            engine._wait_all(stops)
        assert time.monotonic() - t0 < 1.0
        assert stops[0].kind == "interrupt"       # the child did stop
    finally:
        for s in stops:
            s.abort()
        cg.thaw_now()
        if child is not None:
            os.kill(child, signal.SIGKILL)        # its parent's vfork() ends: it stops, then
        assert native.sweep_stops(2.0) == 0       # is detached by the sweep
        p.kill()
        p.wait()
        cg.close()


def test_stop_refusals_and_abort_python(native) -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _wait(lambda: _in_syscall(p.pid, "230"), what="sleeping")
        with native.begin_stop(p.pid) as s:
            import threading
            caught: list[BaseException] = []
            t = threading.Thread(target=lambda: caught.extend(_try(s.wait)))
            t.start()
            t.join()
            assert len(caught) == 1 and caught[0].errno == errno.EPERM, caught
            assert s.wait(timeout=2) == "interrupt"
            with pytest.raises(native.CRError) as e:
                native.begin_stop(p.pid)
            assert e.value.errno == errno.EBUSY and f"pid {p.pid}" in str(e.value)
        assert native.proc_status(p.pid).tracer_pid == 0
        _wait(lambda: _in_syscall(p.pid, "230"), what="sleeping again after abort")
    finally:
        p.kill()
        p.wait()


def test_resume_after_a_captured_process_was_killed(native) -> None:
    """A process SIGKILLed after its template was made (the OOM killer does it: templates'
    page tables are charged to the sandbox) is not an error at resume: it was captured."""
    from deltabox.cr.engine import _resume_all

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    tpl = None
    try:
        _wait(lambda: _in_syscall(p.pid, "230") and _in_syscall(live.pid, "230"),
              what="sleeping")
        stops = [native.begin_stop(p.pid), native.begin_stop(live.pid)]
        assert [s.wait(timeout=3) for s in stops] == ["interrupt"] * 2
        tpl = stops[0].make_template()
        os.kill(p.pid, signal.SIGKILL)
        _resume_all(stops)  # raised Internal("resuming after the checkpoint failed") before
        assert native.proc_status(live.pid).tracer_pid == 0  # the other one is resumed
        _wait(lambda: _in_syscall(live.pid, "230"), what="the other sleeping again")
        assert p.wait(timeout=5) == -signal.SIGKILL
    finally:
        if tpl is not None:
            tpl.release()
        for q in (p, live):
            q.kill()
            q.wait()


def test_a_held_stop_names_its_call_and_dies_with_its_tracer(native) -> None:
    """A process held in its stop past its checkpoint's answer (engine: a `later`
    capture, templates made after the answer): its stop says which call it was in before
    any template exists (the adoption check needs it), and once held it is SIGKILLed when
    its tracing thread exits (a daemon killed before the templates) instead of running
    on; a stop that is not held is detached and sleeps on."""
    import threading

    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    held, plain = subprocess.Popen(sleeper), subprocess.Popen(sleeper)
    calls: dict[int, list] = {}
    errors: list[BaseException] = []

    def tracer() -> None:  # exits with both processes still in their stops
        try:
            for p, hold in ((held, True), (plain, False)):
                s = native.begin_stop(p.pid)
                assert s.wait(timeout=3) == "interrupt"
                calls[p.pid] = s.syscalls()
                if hold:
                    s.hold()
        except BaseException as e:  # reported below
            errors.append(e)

    try:
        _wait(lambda: _in_syscall(held.pid, "230") and _in_syscall(plain.pid, "230"),
              what="sleeping")
        t = threading.Thread(target=tracer)
        t.start()
        t.join()
        assert not errors, errors
        assert [nr for nr, _ in calls[held.pid]] == [230]   # clock_nanosleep, one thread
        assert held.wait(timeout=5) == -signal.SIGKILL
        _wait(lambda: native.proc_status(plain.pid).tracer_pid == 0
              and _in_syscall(plain.pid, "230"), what="the unheld one sleeping on")
        assert plain.poll() is None
    finally:
        for q in (held, plain):
            q.kill()
            q.wait()


def _blocked_in(pid: int, nr: int, timeout: float = 3.0) -> None:
    """Wait until `pid` sleeps inside call `nr` (the kernel's own /proc/PID/syscall)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/syscall").read_text().split()[0] != str(nr):
        assert time.monotonic() < deadline, f"pid {pid} never blocked in call {nr}"
        time.sleep(0.002)


def _calls_at_stops(native, program: str, stops: int, blocked_in: int | None = None) -> list[int]:
    """Stop a python3 `program` `stops` times (after it has started): the call its main
    thread was in at each stop. With `blocked_in`, each stop waits until the thread is
    back asleep in that call: resumed from a stop, a program that retries a call after
    EINTR runs its own code first, where a stop rightly names no call."""
    p = subprocess.Popen([sys.executable, "-c", program])
    seen = []
    try:
        time.sleep(0.3)
        for _ in range(stops):
            if blocked_in is not None:
                _blocked_in(p.pid, blocked_in)
            s = native.begin_stop(p.pid)
            assert s.wait(timeout=3) == "interrupt"
            seen.append(s.syscalls()[0][0])
            s.resume()
    finally:
        p.kill()
        p.wait()
    return seen


@pytest.mark.parametrize("program,nr", [
    ("import os\nr, w = os.pipe()\nos.read(r, 1)\n", 0),                 # -ERESTARTSYS
    ("import select, os\nr, w = os.pipe()\nselect.select([r], [], [], 30)\n", 270),
    ("import time\ntime.sleep(30)\n", 230),                             # RESTARTBLOCK
    ("import select\ne = select.epoll()\nwhile True: e.poll(30)\n", 232),  # -EINTR
], ids=["read", "pselect6", "clock_nanosleep", "epoll_wait"])
def test_a_blocking_call_is_named_as_the_one_stopped_in(native, program: str, nr: int) -> None:
    """A thread stopped inside a blocking call re-enters it when resumed, whether the
    kernel restarts it (rax -ERESTART*) or the program calls again after EINTR (epoll_wait
    is never restarted): the inspector then counts the re-entry as the call going on."""
    assert _calls_at_stops(native, program, 3, blocked_in=nr) == [nr] * 3


def test_a_call_that_had_returned_is_not_named_as_the_one_stopped_in(native) -> None:
    """A thread the stop finds on its way back from a call that completed runs on in user
    mode when resumed; it was in no call (-1). Its orig_rax still holds the call's number,
    so taking that for "stopped in getppid" told the inspector the restored process would
    only re-enter the call (its running unseen) and the adoption check that a finished
    wait was still waiting. A loop of getppid() is stopped there nearly every time."""
    seen = _calls_at_stops(native, "import os\nwhile True: os.getppid()\n", 30)
    assert 110 not in seen and set(seen) == {-1}, seen   # 110: getppid


TIMED = r"""
import json, signal, sys, time
signal.signal(signal.SIGALRM, lambda *_: None)
signal.signal(signal.SIGVTALRM, lambda *_: None)
signal.signal(signal.SIGPROF, lambda *_: None)
signal.setitimer(signal.ITIMER_REAL, 30, 0.5)
signal.setitimer(signal.ITIMER_VIRTUAL, 20)
signal.setitimer(signal.ITIMER_PROF, 10, 2)

def report(*_):
    with open(sys.argv[1], "w") as f:
        json.dump([list(signal.getitimer(w)) for w in (signal.ITIMER_REAL,
                   signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)], f)

signal.signal(signal.SIGUSR1, report)
report()
while True:
    time.sleep(10)
"""


def _timers(path: Path, pid: int) -> list[list[float]]:
    """[[time left, interval] for REAL, VIRTUAL, PROF] as pid reports them on SIGUSR1."""
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    _wait(lambda: path.exists() and path.read_text(), what=f"pid {pid}'s timers")
    return json.loads(path.read_text())


def test_interval_timers_are_carried_into_every_child(native, tmp_path: Path) -> None:
    """fork drops a process's interval timers (alarm, setitimer): a template reads them
    from the stopped original and arms them again in each child, each with the time it
    had left at the checkpoint (before, a child never got its SIGALRM)."""
    out = tmp_path / "timers"
    p = subprocess.Popen([sys.executable, "-c", TIMED, str(out)])
    child = None
    try:
        _wait(lambda: out.exists() and out.read_text(), what="timers armed")
        time.sleep(0.5)
        with native.begin_stop(p.pid) as s:
            s.wait(timeout=3)
            tpl = s.make_template()
            s.resume()
        try:
            got = tpl.itimers()
            intervals = [got[0] + got[1] / 1e6, got[4] + got[5] / 1e6, got[8] + got[9] / 1e6]
            left = [got[2] + got[3] / 1e6, got[6] + got[7] / 1e6, got[10] + got[11] / 1e6]
            assert intervals == [0.5, 0, 2]
            # CPU-time timers read rounded up to a tick (4 ms): 20.004 for 20
            assert 28 < left[0] < 29.6 and 19 < left[1] <= 20.01 and 9 < left[2] <= 10.01, left
            child = tpl.spawn()
            kid = _timers(out, child)
            assert [round(iv, 3) for _, iv in kid] == [0.5, 0, 2]
            for (now, _), then in zip(kid, left):   # counted from the spawn, not from 0
                assert then - 1 < now <= then + 0.01, (kid, left)
            assert _timers(out, p.pid)[0][0] < left[0]   # the original's run on
        finally:
            tpl.release()
    finally:
        if child is not None:
            kill_reap(child)
        p.kill()
        p.wait()


FD_HOLDER = r"""
import json, os, socket, sys, time
d = sys.argv[1]
reg = os.open(os.path.join(d, "reg"), os.O_RDWR | os.O_CREAT)
os.write(reg, b"hello")
gone = os.open(os.path.join(d, "gone"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
os.unlink(os.path.join(d, "gone"))
pr, pw = os.pipe()
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen()
a, b = socket.socketpair()
ev = os.eventfd(0)
null = os.open("/dev/null", os.O_RDONLY)
dirfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
print(json.dumps({"reg": reg, "gone": gone, "pr": pr, "pw": pw, "lst": lst.fileno(),
                  "port": lst.getsockname()[1], "a": a.fileno(), "b": b.fileno(), "ev": ev,
                  "null": null, "dir": dirfd}), flush=True)
time.sleep(30)
"""


def test_fds_inventory_python(native, tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", FD_HOLDER, str(tmp_path)],
                         stdout=subprocess.PIPE)
    try:
        n = Lines(p.stdout.fileno()).read()
        inv = {f.fd: f for f in native.fds(p.pid)}
        reg, gone = inv[n["reg"]], inv[n["gone"]]
        assert (reg.kind, reg.target, reg.deleted, reg.pos, reg.flags & 3) == (
            "file", str(tmp_path / "reg"), False, 5, os.O_RDWR)
        assert (gone.kind, gone.target, gone.deleted) == ("file", str(tmp_path / "gone"), True)
        assert gone.flags & os.O_APPEND
        pr, pw = inv[n["pr"]], inv[n["pw"]]
        assert pr.kind == pw.kind == "pipe" and pr.inode == pw.inode > 0
        assert pr.target == f"pipe:[{pr.inode}]" and pw.flags & 3 == os.O_WRONLY
        lst = inv[n["lst"]]
        assert lst.kind == "socket" and lst.socket == native.SockInfo(
            "inet", "tcp", "listen", f"127.0.0.1:{n['port']}", "0.0.0.0:0")
        assert lst.socket.listening
        assert lst.describe() == f"inet tcp listen 127.0.0.1:{n['port']}"
        a, b = inv[n["a"]], inv[n["b"]]
        assert a.socket.family == b.socket.family == "unix"
        assert (a.socket.type, a.socket.state) == ("stream", "connected") and a.inode != b.inode
        ev = inv[n["ev"]]
        assert (ev.kind, ev.target) == ("eventfd", "anon_inode:[eventfd]")
        null = inv[n["null"]]
        assert (null.kind, null.target, null.rdev) == ("chr", "/dev/null", (1, 3))
        assert (inv[n["dir"]].kind, inv[n["dir"]].target) == ("dir", str(tmp_path))

        st = native.proc_status(p.pid)
        assert (st.ppid, st.threads, st.tracer_pid, st.nspid) == (os.getpid(), 1, 0, (p.pid,))
        assert st.pgid == os.getpgid(p.pid) and st.sid == os.getsid(p.pid)
        assert st.state in "SR"
    finally:
        p.kill()
        p.wait()


class Tracer:
    """A thread of our own that runs calls one at a time (a tracee belongs to the thread
    that attached it, and dies when that thread ends: it lives until close())."""

    def __init__(self) -> None:
        import queue
        import threading
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the test thread
                box.append((False, e))
            done.set()

    def run(self, fn):
        import threading
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        assert done.wait(30), "tracer thread stuck"
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(30)


def test_template_copy_spawns_from_another_thread(native, tmp_path: Path) -> None:
    """A copy of a template (a fork lane) is driven by the thread that adopts it: its
    children continue from the checkpoint like the template's own, at the same time."""
    data = tmp_path / "data.txt"
    data.write_text("0123456789abcdef")
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(data)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    orig = Proc(p.pid, p.stdin.fileno(), p.stdout.fileno())
    lane = Tracer()
    children: list[Proc] = []
    tpl = copy = None
    try:
        assert orig.out.read() == {"ready": True}
        orig.ask("inc")
        blocked_in_read(p.pid)
        files = [f for f in native.regular_files(p.pid) if f.path == str(data)]
        tpl = native.make_template(p.pid)
        orig.ask("inc")  # the original moves on: the copy holds the checkpoint
        copy = tpl.copy()
        assert copy.pid not in (tpl.pid, p.pid) and copy.origin == p.pid
        info = native.describe(copy.pid)
        assert (info.tracer_pid, info.ppid) == (0, os.getpid())  # handed over, asleep
        with pytest.raises(native.CRError) as e:
            copy.spawn()  # nobody drives it before it is adopted
        assert e.value.errno == errno.EPERM

        lane.run(copy.adopt)
        assert native.describe(copy.pid).tracer_pid == lane.thread.native_id
        with pytest.raises(native.CRError) as e:
            spawn_child(copy, files)  # only its adopting thread drives it
        assert e.value.errno == errno.EPERM
        children.append(lane.run(lambda: spawn_child(copy, files)))
        children.append(spawn_child(tpl, files))
        for c in children:
            r = c.ask("report")
            assert (r["counter"], r["items"], r["ppid"]) == (1, {"a": 1, "k1": 1}, os.getpid())
            assert c.ask("readf") == {"data": "456", "offset": 7}
        children[0].ask("inc")
        assert children[1].ask("report")["counter"] == 1  # each its own memory

        copy_pid = copy.pid
        lane.run(copy.release)
        assert not Path(f"/proc/{copy_pid}").exists()
        spare = tpl.copy()  # never adopted: released from any thread
        spare_pid = spare.pid
        spare.release()
        os.waitpid(spare_pid, 0)  # our child (the original's parent is us): reap it
        assert not Path(f"/proc/{spare_pid}").exists()
    finally:
        if copy is not None:
            try:
                lane.run(copy.release)
            except native.CRError:
                pass
        lane.close()
        _clean_up(tpl, children, p)


def test_a_udp_socket_of_another_network_namespace_is_refused() -> None:
    """A UDP socket made before its process entered a network namespace of its own (one
    handed in from outside a sandbox) is not captured: made again in the process's
    namespace it would reach other addresses. One of its own namespace is."""
    from deltabox.cr import native, udp
    prog = ("import ctypes, socket, time\n"
            "outer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "assert ctypes.CDLL(None).unshare(0x40000000) == 0   # CLONE_NEWNET\n"
            "inner = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "print(outer.fileno(), inner.fileno(), flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True)
    try:
        outer, inner = map(int, p.stdout.readline().split())
        fds = {f.fd: f for f in native.fds(p.pid)}
        assert udp.is_udp(fds[outer]) and udp.is_udp(fds[inner])
        assert udp.capture(p.pid, fds[inner])[1] is None
        why = udp.capture(p.pid, fds[outer])[1]
        assert why and "another network namespace" in why, why
    finally:
        p.kill()
        p.wait()


def test_a_linux_aio_context_is_refused_by_name() -> None:
    """io_setup's ring is a shared mapping of no file a restore could map again. A sandbox
    process cannot make one (its io_setup fails with ENOSYS since stop 64); one that holds
    it anyway is refused, naming it (here a process of the host, captured as a sandbox's)."""
    from deltabox.cr import capture, native, unlinked
    prog = ("import ctypes, time\nctx = ctypes.c_ulong(0)\n"
            "assert ctypes.CDLL(None).syscall(206, 8, ctypes.byref(ctx)) == 0\n"
            "print(ctx.value, flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    try:
        ring = int(p.stdout.readline())
        rec = capture.record(p.pid, native.proc_status(p.pid))
        files, refused = unlinked.capture([rec])
        unlinked.close_saved(files)
        assert len(refused) == 1 and re.fullmatch(
            rf"shared memory /\[aio\] \(deleted\) at {ring:x}-[0-9a-f]+: a Linux AIO "
            r"context's ring \(io_setup\), not a file of the sandbox's tree or memory: not "
            r"captured", refused[0].reason), refused
    finally:
        p.kill()
        p.wait()
