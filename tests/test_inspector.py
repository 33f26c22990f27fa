"""The turn inspector on real eBPF: real cgroups, real processes, real system calls.

Each test gets its own cgroup in the cgroup-v2 hierarchy (/sys/fs/cgroup/unified on these
hybrid hosts) and, where the v1 freezer exists, a freezer cgroup of the same name, so that
turns can be cut the way the daemon cuts them (freeze, turn(), thaw). Commands enter the
cgroup the way the daemon's exec helper does: a process started outside joins the cgroup and
then runs the command as its child (`expect_entry` tells the inspector about it).

Skipped, with the reason, only where the inspector cannot load (InspectorUnavailable).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltabox.inspector import (Inspector, InspectorUnavailable, TurnEffects, cgroup_id,
                                decide, prepare_kernel_interfaces, unified_cgroup_mount,
                                untouched_processes)
from deltabox.inspector.effects import (AddressSpaceChange, ExitedProcess, RanProcess,
                                        SignalledProcess, SocketOp)

PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@x", "HOME": "/root", "PATH": os.environ.get("PATH", "")}


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def insp():
    if os.geteuid() != 0:
        pytest.skip("the inspector needs root")
    try:
        i = Inspector.load()
    except InspectorUnavailable as e:
        pytest.skip(f"inspector unavailable: {e}")
    try:
        yield i
    finally:
        i.close()


class Box:
    """A cgroup (unified + v1 freezer where present) and the processes put into it."""

    _n = 0

    def __init__(self, tmp: Path) -> None:
        unified = unified_cgroup_mount()
        if unified is None:
            pytest.skip("no cgroup2 hierarchy mounted")
        Box._n += 1
        name = f"dbx-insp-test-{os.getpid()}-{Box._n}"
        self.unified = unified / name
        self.unified.mkdir()
        fz = Path("/sys/fs/cgroup/freezer")
        self.freezer = fz / name if (fz / "freezer.state").exists() or fz.is_dir() else None
        if self.freezer is not None and unified != Path("/sys/fs/cgroup"):
            try:
                self.freezer.mkdir()
            except OSError:
                self.freezer = None
        else:
            self.freezer = None
        self.id = cgroup_id(self.unified)
        self.tmp = tmp
        self.popens: list[subprocess.Popen] = []

    def _join(self) -> str:
        s = f"echo $$ > {self.unified}/cgroup.procs"
        if self.freezer is not None:
            s += f"; echo $$ > {self.freezer}/cgroup.procs"
        return s

    def run(self, insp: Inspector | None, key: str | None, args: list[str],
            cwd: Path | None = None, *, expect: bool = True, check: bool = True,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """Run `args` in the cgroup from a helper that joins it first (like dbx-enter)."""
        cwd = cwd or self.tmp
        p = subprocess.Popen(["sh", "-c", self._join() + '; cd "$1"; shift; "$@"', "sh",
                              str(cwd), *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        if expect and insp is not None:
            insp.expect_entry(key, p.pid)
        out, err = p.communicate(timeout=120)
        cp = subprocess.CompletedProcess(args, p.returncode, out, err)
        if check and p.returncode != 0:
            raise AssertionError(f"{args} failed ({p.returncode}): {err.decode()[-2000:]}")
        return cp

    def start(self, args: list[str], cwd: Path | None = None, *,
              idle: bool = True) -> subprocess.Popen:
        """A long-lived process in the cgroup (the launcher execs it); with `idle`, returns
        once it has started up and sleeps waiting for something."""
        p = subprocess.Popen(["sh", "-c", self._join() + '; cd "$1"; shift; exec "$@"', "sh",
                              str(cwd or self.tmp), *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.popens.append(p)
        deadline = time.monotonic() + 10
        want = os.path.basename(args[0])[:15]
        while time.monotonic() < deadline:
            try:
                if Path(f"/proc/{p.pid}/comm").read_text().strip() == want:
                    break
            except OSError:
                pass
            time.sleep(0.01)
        if idle:
            _wait_idle(p.pid)
        return p

    def freeze(self, on: bool) -> None:
        assert self.freezer is not None
        state = self.freezer / "freezer.state"
        want = "FROZEN" if on else "THAWED"
        state.write_text(want)
        deadline = time.monotonic() + 10
        while state.read_text().strip() != want:
            if time.monotonic() > deadline:
                raise AssertionError(f"cgroup not {want}")
            time.sleep(0.001)

    def turn(self, insp: Inspector, key: str, settle: float = 0.05) -> TurnEffects:
        """End a turn as the daemon does: with the cgroup frozen (when there is a freezer)."""
        time.sleep(settle)
        if self.freezer is None:
            return insp.turn(key)
        self.freeze(True)
        try:
            return insp.turn(key)
        finally:
            self.freeze(False)

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.unified / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def cleanup(self) -> None:
        if self.freezer is not None:
            try:
                (self.freezer / "freezer.state").write_text("THAWED")
            except OSError:
                pass
        for _ in range(100):
            pids = self.pids()
            if self.freezer is not None:
                try:
                    pids += [int(x) for x in (self.freezer / "cgroup.procs").read_text().split()]
                except OSError:
                    pass
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        for p in self.popens:
            try:
                p.kill()
            except OSError:
                pass
            p.wait()
        for d in (self.unified, self.freezer):
            if d is None:
                continue
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


@pytest.fixture
def box(tmp_path):
    b = Box(tmp_path)
    try:
        yield b
    finally:
        b.cleanup()


@pytest.fixture
def watched(insp, box, request):
    key = f"t-{request.node.name}"
    yield key
    insp.unwatch(key)


def _files(e: TurnEffects) -> list[str]:
    return (e.files_written + e.files_created + e.files_deleted + e.files_renamed +
            e.files_chmodded + e.files_truncated + e.files_attrs_changed)


def _quiet(e: TurnEffects) -> str:
    """Why `e` is not a turn that changed nothing ('' if it is)."""
    d = decide(e, parent_kind="full", processes_alive=True)
    if d.kind != "skipped":
        return f"{d.kind}: {d.reasons}"
    return ""


def _wait_blocked(pid: int, nr: int = 0, fd: int = 0, timeout: float = 10) -> None:
    """Until process `pid` sleeps (state S) in system call `nr` on `fd` (0, 0: a read of
    stdin). The state and the fd matter: /proc/PID/syscall still shows the read a stopped
    process was taken out of (it re-enters it only once continued), and bash reads its
    locale.alias at startup: a stand-in stopped in that read runs on to read stdin, which
    the inspector rightly reports as running (the likely cause of a CI failure at stop 71,
    not reproduced here)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            call = Path(f"/proc/{pid}/syscall").read_text().split()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "S" and call[:2] == [str(nr), hex(fd)]:
                return
        except (OSError, IndexError):
            pass
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} did not block in syscall {nr} on fd {fd}")


def _wait_idle(pid: int, timeout: float = 20) -> None:
    """Until `pid` sleeps in the same system call for 0.2 s (started up and waiting)."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        try:
            sc = Path(f"/proc/{pid}/syscall").read_text().split()[0]
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            sc, state = None, None
        cur = sc if state == "S" and sc not in (None, "running", "-1") else None
        if cur is None or cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since > 0.2:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not go idle")


def _git_repo(path: Path) -> Path:
    path.mkdir()
    (path / "a.py").write_text("x = 1\n")
    (path / "README").write_text("hello\n")
    # Files older than the index: otherwise git sees them "racily clean" and rewrites the
    # index on every status (a real write, but not the point of the read-only catalog).
    old = time.time() - 100
    for f in ("a.py", "README"):
        os.utime(path / f, (old, old))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "i"]):
        subprocess.run(cmd, cwd=path, check=True, env=GIT_ENV)
    return path


# ---- setup ------------------------------------------------------------------------------------

def test_prepare_kernel_interfaces_is_idempotent():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    assert prepare_kernel_interfaces() == prepare_kernel_interfaces()
    mounts = Path("/proc/self/mounts").read_text()
    assert " /sys/kernel/tracing tracefs " in mounts
    assert " /sys/kernel/debug debugfs " in mounts


def test_backend_names_bcc(insp):
    assert insp.backend.startswith("ebpf (bcc ")


# ---- read-only turns --------------------------------------------------------------------------

READ_ONLY = [
    ["cat", "README"],
    ["ls", "-la", "."],
    ["grep", "-rn", "x", "."],
    ["find", ".", "-name", "*.py"],
    ["git", "status"],
    ["git", "status", "--porcelain"],
    ["git", "log", "--oneline"],
    ["git", "diff"],
    [PY, "-c", "print(1)"],
    [PY, "-c", "import json, argparse, email.parser; print(json.dumps({}))"],
    ["sh", "-c", "cat README | wc -l; echo done > /dev/null"],
    ["head", "-c", "100", "/etc/os-release"],
    ["stat", "README"],
    ["sh", "-c", "ls /proc/self/fd > /dev/null; true"],
]


def test_read_only_turns_change_nothing(insp, box, watched, tmp_path):
    repo = _git_repo(tmp_path / "repo")
    idle = box.start(["sleep", "1000"])
    _wait_idle(idle.pid)
    insp.watch(watched, box.id, pids=[idle.pid])
    # git refreshes its index the first time it looks at a fresh checkout: that turn writes.
    box.run(insp, watched, ["git", "status"], cwd=repo)
    box.turn(insp, watched)
    for cmd in READ_ONLY:
        box.run(insp, watched, cmd, cwd=repo)
        e = box.turn(insp, watched)
        assert _files(e) == [], (cmd, e)
        assert e.processes_new_alive == [] and e.outside_entries == [], (cmd, e)
        assert e.processes_ran == [], (cmd, e)
        assert e.lost_events == 0 and e.complete, (cmd, e)
        assert not _quiet(e), (cmd, _quiet(e))
        assert idle.pid in e.long_lived
        assert any(p.filename.endswith(os.path.basename(cmd[0])) for p in e.processes_execed)


def test_turn_without_activity_is_skipped(insp, box, watched):
    idle = box.start(["sleep", "1000"])
    insp.watch(watched, box.id, pids=[idle.pid])
    for _ in range(3):
        e = box.turn(insp, watched)
        d = decide(e, parent_kind="full", processes_alive=True)
        assert d.kind == "skipped", d
        assert e.events == 0


# ---- changing turns ---------------------------------------------------------------------------

def test_file_changes_are_seen(insp, box, watched, tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    insp.watch(watched, box.id)
    box.turn(insp, watched)

    def turn(cmd: list[str]) -> TurnEffects:
        box.run(insp, watched, cmd, cwd=d)
        e = box.turn(insp, watched)
        dec = decide(e, parent_kind="full", processes_alive=True)
        assert dec.kind == "fs", (cmd, dec, e)
        return e

    e = turn(["sh", "-c", "echo hi > f"])
    assert str(d / "f") in e.files_created and str(d / "f") in e.files_written
    e = turn(["touch", "g"])
    assert str(d / "g") in e.files_created
    e = turn(["touch", "g"])             # existing file: times only
    assert str(d / "g") in e.files_created + e.files_attrs_changed
    e = turn(["rm", "f"])
    assert e.files_deleted == [str(d / "f")]
    e = turn(["mv", "g", "h"])
    assert e.files_renamed == [f"{d / 'g'} -> {d / 'h'}"]
    e = turn(["chmod", "600", "h"])
    assert e.files_chmodded == [str(d / "h")]
    e = turn(["sh", "-c", "echo data >> h"])
    assert str(d / "h") in e.files_written
    e = turn(["truncate", "-s", "0", "h"])
    assert str(d / "h") in e.files_truncated
    e = turn(["mkdir", "sub"])
    assert e.files_created == [str(d / "sub")]
    e = turn(["ln", "-s", "h", "lnk"])
    assert str(d / "lnk") in e.files_created
    e = turn(["ln", "h", "hard"])
    assert str(d / "hard") in e.files_created
    e = turn(["cp", "h", "copy"])
    assert str(d / "copy") in e.files_created
    e = turn(["dd", "if=/dev/zero", "of=z", "bs=1k", "count=4", "status=none"])
    assert str(d / "z") in e.files_written
    e = turn(["chown", "0:0", "z"])
    assert str(d / "z") in e.files_attrs_changed
    e = turn([PY, "-c", "open('h', 'r+').write('xyz')"])   # opened without O_TRUNC
    assert str(d / "h") in e.files_written
    e = turn([PY, "-c", "import mmap, os\nf = open('z', 'r+b')\nm = mmap.mmap(f.fileno(), 0)\n"
                        "m[0:1] = b'q'\nm.close()"])        # a shared writable mapping
    assert str(d / "z") in e.files_written
    e = turn(["rmdir", "sub"])
    assert e.files_deleted == [str(d / "sub")]
    # pip-like: a package directory with files written to temporaries and renamed in place
    e = turn([PY, "-c", "import os, tempfile\nos.makedirs('site/pkg', exist_ok=True)\n"
                        "for n in ('__init__.py', 'mod.py'):\n"
                        "    fd, t = tempfile.mkstemp(dir='site/pkg')\n"
                        "    os.write(fd, b'x = 1\\n'); os.close(fd)\n"
                        "    os.replace(t, os.path.join('site/pkg', n))\n"])
    assert str(d / "site/pkg") in e.files_created
    assert any(r.endswith(str(d / "site/pkg/mod.py")) for r in e.files_renamed)


def test_relative_paths_of_a_process_that_changed_directory(insp, box, watched, tmp_path):
    (tmp_path / "deep").mkdir()
    insp.watch(watched, box.id)
    box.run(insp, watched, ["sh", "-c", "cd deep && echo x > rel && cd .. && touch top"])
    e = box.turn(insp, watched)
    assert str(tmp_path / "deep" / "rel") in e.files_created
    assert str(tmp_path / "top") in e.files_created


def test_transient_files_do_not_count(insp, box, watched, tmp_path):
    insp.watch(watched, box.id)
    box.run(insp, watched, [PY, "-c", "import tempfile, os\n"
                                      "with tempfile.TemporaryDirectory(dir='.') as d:\n"
                                      "    open(os.path.join(d, 'x'), 'w').write('1')\n"
                                      "fd, p = tempfile.mkstemp(dir='.'); os.write(fd, b'y');"
                                      " os.close(fd); os.unlink(p)\n"])
    e = box.turn(insp, watched)
    assert _files(e) == [], e
    assert len(e.files_transient) >= 3
    assert decide(e, parent_kind="full", processes_alive=True).kind == "skipped"
    assert decide(e, parent_kind="full", processes_alive=True,
                  transient_is_change=True).kind == "fs"


def test_writes_to_pipes_devnull_and_proc_are_not_file_changes(insp, box, watched):
    insp.watch(watched, box.id)
    box.run(insp, watched, ["sh", "-c", "echo a; echo b >&2; echo c > /dev/null; "
                                        "echo d | cat > /dev/null; : > /dev/null; "
                                        "cat /proc/self/status > /dev/null"])
    box.run(insp, watched, [PY, "-c", "import sys, os\nsys.stdout.write('x' * 100000)\n"
                                      "r, w = os.pipe(); os.write(w, b'x'); os.read(r, 1)\n"
                                      "open('/dev/null', 'w').write('x')\n"])
    e = box.turn(insp, watched)
    assert _files(e) == [] and e.other_effects == [], e
    assert not _quiet(e)


def test_background_process(insp, box, watched, tmp_path):
    insp.watch(watched, box.id)
    box.run(insp, watched, ["sh", "-c", "(sleep 0.6; echo late > bg) > /dev/null 2>&1 &"])
    e = box.turn(insp, watched)
    d = decide(e, parent_kind="full", processes_alive=True)
    assert d.kind == "full" and e.processes_new_alive, (d, e)
    time.sleep(1.0)
    e = box.turn(insp, watched)
    assert str(tmp_path / "bg") in e.files_created
    assert any(p.long_lived for p in e.processes_exited), e
    assert decide(e, parent_kind="full", processes_alive=True).kind == "full"
    e = box.turn(insp, watched)
    assert not _quiet(e)


LONG_PY = r"""
import mmap, sys
blobs = []
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "alloc":
        blobs.append(bytearray(64 << 20))
    elif cmd == "mmap":
        m = mmap.mmap(-1, 8 << 20); m[0] = 1; blobs.append(m)
    elif cmd == "spin":
        x = 0
        for i in range(3_000_000): x += i
    print("ok", flush=True)
"""


def test_long_lived_process_that_allocates_is_seen(insp, box, watched):
    p = box.start([PY, "-c", LONG_PY], idle=False)
    p.stdin.write(b"hello\n")              # wait until it is up and idle
    p.stdin.flush()
    assert p.stdout.readline().strip() == b"ok"
    _wait_blocked(p.pid)
    insp.watch(watched, box.id, pids=[p.pid])
    e = box.turn(insp, watched)
    assert not _quiet(e), _quiet(e)
    for cmd in ("alloc", "mmap", "spin"):
        p.stdin.write(f"{cmd}\n".encode())
        p.stdin.flush()
        assert p.stdout.readline().strip() == b"ok"
        _wait_blocked(p.pid)
        e = box.turn(insp, watched)
        assert [r.pid for r in e.processes_ran] == [p.pid], (cmd, e)
        assert decide(e, parent_kind="full", processes_alive=True).kind == "full"
        if cmd in ("alloc", "mmap"):
            calls = {c for a in e.address_space_changed for c in a.syscalls}
            assert calls & {"mmap", "brk", "munmap", "mremap"}, (cmd, e)
        # Quiet again once it waits for input: the freeze of the turn is not running.
        _wait_blocked(p.pid)
        e = box.turn(insp, watched)
        assert not _quiet(e), (cmd, _quiet(e))


def test_idle_processes_survive_freezes_and_busy_ones_do_not(insp, box, watched):
    if box.freezer is None:
        pytest.skip("no v1 freezer to cut turns with")
    idle = [
        box.start(["bash", "-c", "read x; echo $x"]),
        box.start(["sleep", "1000"]),
        box.start([PY, "-c", "import signal; signal.pause()"]),
        box.start([PY, "-c", "import select, sys; select.select([sys.stdin], [], [])"]),
        box.start([PY, "-c", "import asyncio\nasync def m():\n    await asyncio.sleep(1000)\n"
                             "asyncio.run(m())"]),
        box.start([PY, "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0));"
                             " s.listen(); s.accept()"]),
    ]
    busy = box.start([PY, "-c", "x = 0\nwhile True: x += 1"], idle=False)
    for p in idle:
        _wait_idle(p.pid)                    # started up and waiting
    insp.watch(watched, box.id, pids=[p.pid for p in idle + [busy]])
    for i in range(4):
        e = box.turn(insp, watched, settle=0.2)
        assert [r.pid for r in e.processes_ran] == [busy.pid], (i, e.processes_ran)
        assert e.processes_new_alive == [] and e.outside_entries == [] and e.lost_events == 0


def test_processes_outside_the_cgroup_are_ignored(insp, box, watched, tmp_path):
    idle = box.start(["sleep", "1000"])
    insp.watch(watched, box.id, pids=[idle.pid])
    subprocess.run(["sh", "-c", "echo x > outside; rm outside; sleep 0.1 & wait"],
                   cwd=tmp_path, check=True)
    (tmp_path / "also-outside").write_text("x")
    e = box.turn(insp, watched)
    assert not _quiet(e), _quiet(e)
    assert e.events == 0


def test_outside_entry_means_full(insp, box, watched):
    insp.watch(watched, box.id)
    box.run(insp, watched, ["true"], expect=False)
    e = box.turn(insp, watched)
    assert e.outside_entries, e
    d = decide(e, parent_kind="full", processes_alive=True)
    assert d.kind == "full" and "outside" in d.reasons[0]
    box.run(insp, watched, ["true"], expect=True)
    e = box.turn(insp, watched)
    assert e.outside_entries == [] and not _quiet(e)


def test_signals_to_long_lived_processes(insp, box, watched):
    target = box.start(["sleep", "1000"])
    insp.watch(watched, box.id, pids=[target.pid])
    box.run(insp, watched, ["kill", "-STOP", str(target.pid)])
    e = box.turn(insp, watched)
    assert any(s.pid == target.pid and s.signal == signal.SIGSTOP and s.long_lived
               for s in e.processes_signalled), e
    assert decide(e, parent_kind="full", processes_alive=True).kind == "full"
    os.kill(target.pid, signal.SIGCONT)
    box.turn(insp, watched)
    box.run(insp, watched, ["kill", "-TERM", str(target.pid)])
    e = box.turn(insp, watched)
    assert any(p.pid == target.pid and p.long_lived for p in e.processes_exited), e


def test_sockets_are_recorded(insp, box, watched):
    server = box.start([PY, "-c", "import socket, sys\ns = socket.socket()\n"
                                  "s.bind(('127.0.0.1', 0)); s.listen()\n"
                                  "print(s.getsockname()[1], flush=True)\n"
                                  "while True:\n    c, _ = s.accept(); c.close()"])
    port = int(server.stdout.readline())
    insp.watch(watched, box.id, pids=[server.pid])
    box.turn(insp, watched)
    box.run(insp, watched, [PY, "-c", f"import socket; socket.create_connection(('127.0.0.1', "
                                      f"{port})).close()"])
    e = box.turn(insp, watched)
    conn = [s for s in e.sockets if s.op == "connect"]
    assert conn and conn[0].family == "inet" and conn[0].port == port, e.sockets
    assert decide(e, parent_kind="full", processes_alive=True).kind == "full"


def test_lost_events_are_reported(box, tmp_path):
    """A tiny ring buffer (one page) that nobody drains during a burst of file creations."""
    try:
        small = Inspector.load(ringbuf_pages=1)
    except InspectorUnavailable as e:
        pytest.skip(f"inspector unavailable: {e}")
    try:
        small.watch("lossy", box.id)
        box.run(small, "lossy", [PY, "-c", "import os\nos.mkdir('burst')\n"
                                           "for i in range(500): open(f'burst/{i}', 'w')\n"])
        e = small.turn("lossy")
        assert e.lost_events > 0 and not e.complete, e
        d = decide(e, parent_kind="full", processes_alive=True)
        assert d.kind == "full" and "lost" in d.reasons[0]
        e = small.turn("lossy")
        assert e.lost_events == 0
    finally:
        small.close()


def test_checkpoint_capture_by_the_daemon_is_not_sandbox_activity(insp, box, watched):
    """DeltaCR's capture (ptrace seize, injected clone of a template, resume) is done by the
    loading process: its injected system calls and templates are not the sandbox's doing."""
    native = pytest.importorskip("deltabox.cr.native")
    if not native.library_path().exists():
        pytest.skip("native helpers not built (make native)")
    if box.freezer is None:
        pytest.skip("no v1 freezer")
    procs = [box.start(["bash", "-c", "read x"]), box.start(["sleep", "1000"]),
             box.start([PY, "-c", "import select, sys; select.select([sys.stdin], [], [])"])]
    for p in procs:
        _wait_idle(p.pid)
    insp.watch(watched, box.id, pids=[p.pid for p in procs])
    box.turn(insp, watched)
    templates = []
    try:
        box.freeze(True)
        e = insp.turn(watched)
        assert not _quiet(e), _quiet(e)
        stopped = [native.begin_stop(p.pid) for p in procs]
        box.freeze(False)
        for s in stopped:
            s.wait(5)
        templates = [s.make_template() for s in stopped]
        for s in stopped:
            s.resume()
        for _ in range(3):
            e = box.turn(insp, watched, settle=0.2)
            assert not _quiet(e), _quiet(e)
    finally:
        for t in templates:
            t.release()


def _restored_stand_in(box) -> subprocess.Popen:
    """Stand-in for a restored process: bash stopped (SIGSTOP) inside its read, moved
    into the watched cgroup before it runs an instruction there."""
    p = subprocess.Popen(["bash", "-c", "read x"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL)
    box.popens.append(p)
    _wait_blocked(p.pid)
    os.kill(p.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "bash did not stop"
        time.sleep(0.005)
    (box.unified / "cgroup.procs").write_text(str(p.pid))
    if box.freezer is not None:
        (box.freezer / "cgroup.procs").write_text(str(p.pid))
    return p


def test_a_restored_process_not_yet_run_is_not_taken_for_one_that_ran(insp, box, watched):
    """A restore moves each process into the sandbox's cgroup before it runs an instruction,
    then lets it go; on a busy machine it may not have run yet when the daemon re-arms the
    watch. Joining the cgroup is not running: the process re-enters the call it was stopped
    in (as a restored one does) and the turn stays untouched."""
    insp.watch(watched, box.id)
    p = _restored_stand_in(box)
    insp.poll()   # as the daemon re-arms: what came before belongs to the ended turn
    insp.watch(watched, box.id, pids=[p.pid], restored={p.pid: [0]})   # 0: read
    os.kill(p.pid, signal.SIGCONT)
    _wait_blocked(p.pid)
    e = box.turn(insp, watched)
    assert not _quiet(e), _quiet(e)
    assert e.complete and not e.processes_ran, e
    # It does run now: the next turn says so.
    p.stdin.write(b"x\n")
    p.stdin.flush()
    p.wait(10)
    e = box.turn(insp, watched)
    assert _quiet(e), e


def test_a_restored_process_back_in_its_call_before_the_rearm_is_known(insp, box, watched):
    """The other order: the restored process re-enters its call after the daemon's last
    drain and before the re-arm (its entry is stamped with the ended turn's epoch and read
    after the re-arm). The re-arm names it: neither a late event nor an entry from
    outside (a CI run's auto checkpoint after a rollback came out full for this). A
    restored process is cloned into the cgroup (no attach event): it is first seen when it
    re-enters its call; so is the stand-in, moved in before the cgroup is watched."""
    p = _restored_stand_in(box)
    insp.watch(watched, box.id)
    insp.poll()
    os.kill(p.pid, signal.SIGCONT)
    _wait_blocked(p.pid)
    insp.watch(watched, box.id, pids=[p.pid], restored={p.pid: [0]})
    e = box.turn(insp, watched)
    assert e.late_events == 0 and e.outside_entries == [], e
    assert not _quiet(e), _quiet(e)
    # A process the re-arm does not name is still an entry from outside.
    insp.unwatch(watched)
    q = _restored_stand_in(box)
    insp.watch(watched, box.id, pids=[p.pid])
    os.kill(q.pid, signal.SIGCONT)
    _wait_blocked(q.pid)
    insp.watch(watched, box.id, pids=[p.pid])
    e = box.turn(insp, watched)
    assert e.outside_entries == [q.pid], e


def test_turn_effects_are_json(insp, box, watched):
    insp.watch(watched, box.id)
    box.run(insp, watched, ["sh", "-c", "echo x > j"])
    e = box.turn(insp, watched)
    again = TurnEffects.model_validate_json(e.model_dump_json())
    assert again == e


# ---- policy (pure) ----------------------------------------------------------------------------

def _eff(**kw) -> TurnEffects:
    return TurnEffects(key="k", started_at=0.0, ended_at=1.0, **kw)


def test_policy_no_inspector_is_full():
    d = decide(None, parent_kind="full", processes_alive=True)
    assert d.kind == "full" and d.reasons == ["inspector unavailable"]


def test_policy_first_checkpoint_is_full():
    assert decide(_eff(), parent_kind=None, processes_alive=True).kind == "full"


def test_policy_nothing_is_skipped():
    d = decide(_eff(), parent_kind="full", processes_alive=True)
    assert d.kind == "skipped" and d.reasons


@pytest.mark.parametrize("kw", [
    {"lost_events": 3}, {"late_events": 1}, {"complete": False, "incomplete_reasons": ["x"]},
    {"outside_entries": [42]},
])
def test_policy_unseen_is_full(kw):
    d = decide(_eff(files_written=["/a"], **kw), parent_kind="full", processes_alive=True)
    assert d.kind == "full"
    assert decide(_eff(**kw), parent_kind=None, processes_alive=False).kind == "full"


@pytest.mark.parametrize("field", ["files_written", "files_created", "files_deleted",
                                   "files_renamed", "files_chmodded", "files_truncated",
                                   "files_attrs_changed"])
def test_policy_files_only_is_fs(field):
    d = decide(_eff(**{field: ["/x"]}), parent_kind="full", processes_alive=True)
    assert d.kind == "fs" and "/x" in d.reasons[0]


def test_policy_process_changes_are_full():
    ran = _eff(files_written=["/x"], processes_ran=[RanProcess(pid=5, comm="py", how="cpu time")])
    assert decide(ran, parent_kind="fs", processes_alive=True).kind == "full"
    # No process of its own is alive at the end: what processes did no longer matters...
    assert decide(ran, parent_kind="fs", processes_alive=False).kind == "fs"
    # ... but that one that was there at the parent checkpoint is gone does.
    gone = _eff(processes_exited=[ExitedProcess(pid=5, comm="py", long_lived=True)])
    assert decide(gone, parent_kind="full", processes_alive=False).kind == "full"
    short = _eff(processes_exited=[ExitedProcess(pid=6, comm="cat", long_lived=False)])
    assert decide(short, parent_kind="full", processes_alive=True).kind == "skipped"
    new = _eff(processes_new_alive=[7])
    assert decide(new, parent_kind="full", processes_alive=True).kind == "full"
    conn = _eff(sockets=[SocketOp(pid=8, op="connect", family="inet", address="127.0.0.1",
                                  port=80)])
    assert decide(conn, parent_kind="full", processes_alive=True).kind == "full"
    sock = _eff(sockets=[SocketOp(pid=8, op="socket", family="unix")])
    assert decide(sock, parent_kind="full", processes_alive=True).kind == "skipped"
    other = _eff(other_effects=["ptrace: ptrace by pid 3"])
    assert decide(other, parent_kind="full", processes_alive=True).kind == "full"


def test_policy_transient_files():
    e = _eff(files_transient=["/w/.git/index.lock"])
    assert decide(e, parent_kind="full", processes_alive=True).kind == "skipped"
    assert decide(e, parent_kind="full", processes_alive=True,
                  transient_is_change=True).kind == "fs"


def test_run_drains_events_in_a_trio_loop(insp, box, watched, tmp_path):
    import trio

    insp.watch(watched, box.id)
    seen = {}

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(insp.run, 0.005)
            proc = await trio.lowlevel.open_process(
                ["sh", "-c", f"echo $$ > {box.unified}/cgroup.procs; echo x > {tmp_path}/r"])
            insp.expect_entry(watched, proc.pid)
            await proc.wait()
            await trio.sleep(0.2)
            # Drained by run(): what turn() finds left in the buffer is nothing.
            seen["pending"] = insp._watches[watched].turn.events
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen["pending"] > 0
    e = insp.turn(watched)
    assert str(tmp_path / "r") in e.files_created


def test_daemon_file_changes_are_noted(insp, box, watched):
    insp.watch(watched, box.id)
    insp.note_files(watched, written=["/workspace/a"], deleted=["/workspace/b"])
    e = insp.turn(watched)
    assert e.files_written == ["/workspace/a"] and e.files_deleted == ["/workspace/b"]
    assert decide(e, parent_kind="full", processes_alive=True).kind == "fs"
    assert _files(insp.turn(watched)) == []


def test_untouched_processes_are_those_that_only_waited() -> None:
    """Pure policy: which long-lived processes a checkpoint may keep the templates of."""
    e = TurnEffects(
        key="k", started_at=0.0, ended_at=1.0, long_lived=[10, 11, 12, 13, 14, 15],
        processes_ran=[RanProcess(pid=11, comm="bash", how="syscall read")],
        processes_signalled=[SignalledProcess(pid=12, signal=10, how="sent", long_lived=True)],
        address_space_changed=[AddressSpaceChange(pid=13, syscalls=["mmap"])],
        sockets=[SocketOp(pid=15, op="accept", long_lived=True)])
    assert untouched_processes(e) == {10, 14}
    # Not seen whole, or an effect no single process answers for: nothing is untouched.
    for unseen in (dict(lost_events=1), dict(late_events=2), dict(complete=False),
                   dict(outside_entries=[99]), dict(other_effects=["ptrace by 11"]),
                   dict(processes_truncated=True)):
        assert untouched_processes(e.model_copy(update=unseen)) == set(), unseen
