"""A real deltaboxd per test session, on its own state dir and socket, checked for leaks."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from deltabox import Sandbox

ROOT = Path(__file__).resolve().parent.parent


def _libdbxcr_sources() -> tuple[str, ...]:
    """libdbxcr.so's C sources, read from the Makefile's DBXCR_SRCS: one list to keep
    (a source added there and not here failed every test that builds its own copy)."""
    lines = (ROOT / "Makefile").read_text().split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("DBXCR_SRCS :="))
    rule = [lines[at]]
    while rule[-1].endswith("\\"):
        at += 1
        rule.append(lines[at])
    return tuple(re.findall(r"native/(\w+\.c)\b", " ".join(rule)))


# libdbxcr.so's sources, as the Makefile builds it (tests that load a fresh build use it)
LIBDBXCR_SOURCES = _libdbxcr_sources()


def build_libdbxcr(prefix: str) -> Path:
    """libdbxcr.so built from the current sources into a new temp dir (the Makefile's
    flags), so a test never loads a stale library: its path."""
    lib = Path(tempfile.mkdtemp(prefix=prefix)) / "libdbxcr.so"
    subprocess.run(["gcc", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
                    "-D_GNU_SOURCE", "-fPIC", "-shared", "-pthread", "-o", str(lib),
                    *(str(ROOT / "native" / s) for s in LIBDBXCR_SOURCES)], check=True)
    return lib
_PYTEST_PID = os.getpid()


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (a CI runner's timeout, a `kill`) ends the run as Ctrl-C does, so that the
    fixtures' finally blocks stop the daemons and take down their mounts, loop devices and
    cgroups; Python's default died at once and left them all. Once: a second SIGTERM does
    not cut that cleanup short. A process a test forked (it has this handler too) dies as
    by default."""
    if os.getpid() != _PYTEST_PID:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt("SIGTERM")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _terminated)


# `ps` inside a sandbox without the stopped copies the daemon holds there: templates,
# carriers and keepers, named dbx-template / dbx-carrier (their command lines are the
# copied process's). Append the output format: f"{OWN_PS} stat=,args=".
OWN_PS = "ps -N -C dbx-template,dbx-carrier -o"
HELD = ("dbx-template", "dbx-carrier")


@dataclass
class DaemonProc:
    state_dir: Path
    socket: str
    proc: subprocess.Popen | None
    log: Path

    def start(self, *extra: str, env: dict[str, str] | None = None) -> None:
        """Start deltaboxd; `env` is added to its environment (e.g. DELTABOX_CRASH_AT)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deltabox.daemon.main", "--state-dir", str(self.state_dir),
             "--socket", self.socket, "--store-size-gb", "16", *extra],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, **env} if env else None)
        wait_ready(self)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def lanes_opened(self) -> int:
        """How many forks opened fork lanes so far (deltaboxd logs each: cr/engine.py)."""
        return self.log.read_text().count("a second lane for pid")


def wait_for(cond: Callable[[], object], timeout: float = 20, what: str = "") -> None:
    """Poll `cond` every 50 ms until it is true; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.05)


def dump_state(sbx: Sandbox, cp_id: str, timeout: float = 60) -> str:
    """The process-dump line of a checkpoint's reasons, once it is no longer pending."""
    deadline = time.monotonic() + timeout
    while True:
        cp = next(c for c in sbx.checkpoints() if c.id == cp_id)
        line = next((r for r in cp.reasons if r.startswith("process dump:")), "")
        if "pending" not in line or time.monotonic() > deadline:
            return line
        time.sleep(0.1)


def dump_complete(sbx: Sandbox, cp_id: str) -> None:
    """Until the checkpoint's process dump is no longer pending; it must be complete."""
    line = dump_state(sbx, cp_id)
    assert "complete" in line, line


def wait_ready(d: DaemonProc, timeout: float = 60) -> None:
    import deltabox

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc is not None and d.proc.poll() is not None:
            raise RuntimeError(f"deltaboxd exited: {d.log.read_text()[-3000:]}")
        if os.path.exists(d.socket):
            try:
                deltabox.info(socket=d.socket)
                return
            except deltabox.DeltaBoxError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"deltaboxd not ready: {d.log.read_text()[-3000:]}")


def inspector_backend(socket: str | None = None, timeout: float = 60) -> str:
    """The daemon's inspector backend once it has loaded (it loads in the background)."""
    import deltabox

    deadline = time.monotonic() + timeout
    while True:
        backend = deltabox.info(socket=socket).inspector_backend
        if backend != "loading":
            return backend
        assert time.monotonic() < deadline, "inspector still loading"
        time.sleep(0.2)


@pytest.fixture
def ebpf(daemon) -> str:
    """The session daemon's inspector backend, which must be eBPF on these machines."""
    backend = inspector_backend()
    assert backend.startswith("ebpf"), f"the eBPF inspector must load on this machine: {backend}"
    return backend


def launchers_below(init_pid: int) -> list[str]:
    """Pids of dbx-init processes (launchers and the inits they start) of sandboxes whose
    pid namespace is nested below the one whose init is init_pid (forks and fork spares)."""
    found = []
    for d in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"/dbx-init") and b"--nest-under" in argv and \
                argv[argv.index(b"--nest-under") + 1] == str(init_pid).encode():
            found.append(d)
    return found


def leaks(state_dir: Path) -> list[str]:
    """What a stopped daemon left behind (the checks of ../shared/tools/leakcheck)."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if str(state_dir) in mnt or fstype == "overlay" and "deltabox" in line:
                found.append(f"mount {fstype} {mnt}")
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    found += [f"loop {line}" for line in loops.splitlines() if str(state_dir) in line]
    from deltabox.sandbox.cgroups import parent_name

    parent = parent_name(str((state_dir / "state").resolve()))
    found += [f"cgroup {c}" for c in Path("/sys/fs/cgroup").glob(f"*/{parent}")]
    found += [f"cgroup {c}" for c in Path("/sys/fs/cgroup").glob(parent)]
    # Our helpers' command lines name this daemon's cgroup parent (other daemons may run).
    # -ww: full command lines whatever COLUMNS says (pytest's terminal width cut them).
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True,
                        text=True).stdout
    found += [f"process {line.strip()}" for line in ps.splitlines()
              if "libexec/dbx-" in line and parent in line]
    return found


def sweep(base: Path) -> None:
    """Take away what a daemon on `base` left behind (leaks): the daemon itself if it still
    runs, and its helpers, killed; its mounts detached (their loop devices with them), its
    cgroups removed."""
    from deltabox.sandbox.cgroups import parent_name

    parent = parent_name(str((base / "state").resolve()))
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True,
                        text=True).stdout
    for line in ps.splitlines():
        if ("libexec/dbx-" in line and parent in line
                or "deltabox.daemon.main" in line and f"{base}/state " in line):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f if str(base) in line.split()[1]]
    for mnt in sorted(mounts, key=len, reverse=True):   # the deepest first
        subprocess.run(["umount", "-l", mnt], capture_output=True)
    tops = [*Path("/sys/fs/cgroup").glob(f"*/{parent}"), *Path("/sys/fs/cgroup").glob(parent)]
    deadline = time.monotonic() + 3   # the killed helpers leave their cgroups as they exit
    while (dirs := [d for t in tops if t.exists() for d in [*t.rglob("*"), t] if d.is_dir()]) \
            and time.monotonic() < deadline:
        for cg in sorted(dirs, key=lambda d: -len(d.parts)):   # the deepest first
            with contextlib.suppress(OSError):
                cg.rmdir()
        time.sleep(0.1)


def settle(base: Path, what: str = "deltaboxd") -> None:
    """After a daemon on `base` stopped: nothing it made may be left behind (a loop device
    detaches a moment after its umount). Whatever is fails the test, and goes first (sweep),
    so that one failing test does not leave it to the next ones; `base` is removed."""
    left = leaks(base)
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = leaks(base)
    if left:
        sweep(base)
    shutil.rmtree(base, ignore_errors=True)
    assert not left, f"{what} left behind: {left}"


@contextlib.contextmanager
def private_daemon(prefix: str, sock: str = "d.sock") -> Iterator[DaemonProc]:
    """A DaemonProc (not started) on a fresh state dir under /var/tmp; stopped afterwards,
    its dir removed, and nothing it made may be left behind."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    d = DaemonProc(base / "state", str(base / sock), None, base / "daemon.log")
    try:
        yield d
    finally:
        d.stop()
        settle(base)


# The shared daemon (the `daemon` fixture) while it runs: a failed test's report shows what
# it logged meanwhile (its log is removed with its state dir, so CI would lose it).
_SHARED: list[DaemonProc] = []


@pytest.fixture(scope="session")
def daemon() -> DaemonProc:
    with private_daemon("dbx-test-", "deltabox.sock") as d:
        os.environ["DELTABOX_SOCKET"] = d.socket
        d.start()
        _SHARED.append(d)
        try:
            yield d
        finally:
            _SHARED.remove(d)


def _log_size() -> int:
    try:
        return _SHARED[0].log.stat().st_size if _SHARED else 0
    except OSError:
        return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    item.stash[_LOG_AT] = _log_size()
    yield


_LOG_AT = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or not _SHARED:
        return
    start = item.stash.get(_LOG_AT, 0)
    try:
        with open(_SHARED[0].log, "rb") as f:
            f.seek(start)
            text = f.read()[-20000:].decode(errors="replace")
    except OSError:
        return
    if text:
        report.sections.append(("deltaboxd's log during the test", text))


@contextlib.contextmanager
def new_sandbox(socket: str, **create: object):
    """A sandbox on the daemon at `socket` (`create`: Sandbox.create's options), killed
    afterwards (whatever state it is in)."""
    from deltabox import Sandbox

    s = Sandbox.create(socket=socket, **create)
    try:
        yield s
    finally:
        try:
            s.kill()
        except Exception:
            pass


@pytest.fixture
def sbx(daemon: DaemonProc):
    with new_sandbox(daemon.socket) as s:
        yield s
