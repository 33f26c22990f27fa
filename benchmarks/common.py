"""Helpers shared by DeltaBox benchmarks.

- `PrivateDaemon`: a deltaboxd of our own on a fresh temp state dir and socket; stopping it
  (always, in a `finally`) kills every sandbox, SIGTERMs the daemon, checks nothing is left
  mounted, and removes the temp dir.
- `stats` / `percentile`: latency summaries (linear-interpolated percentiles, like numpy's
  default).
- `machine_info` / `write_json`: results files carry the machine and store they came from.
- `latency_boxplot`: the grouped, log-scale box plot used by the figures.
- `download_sdists` / `unpack_sdist` / `tar_bytes`: cached real-world source trees from PyPI.
"""

from __future__ import annotations

import io
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "out"


def default_cache_dir() -> Path:
    """Where downloaded sdists and unpacked trees are kept between runs."""
    env = os.environ.get("DELTABOX_BENCH_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "deltabox-bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- signals ---------------------------------------------------------------------------------

class Terminated(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP so every `finally` cleanup still runs."""


@contextmanager
def terminate_as_exception() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into an exception (SIGINT already is KeyboardInterrupt)."""
    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def host_thp(mode: str | None) -> Iterator[None]:
    """For the block: the host's transparent huge page mode set to `mode` ("always",
    "madvise", "never"; None leaves it), then put back whatever happens (a host setting:
    a benchmark that changes it must not leave it changed)."""
    from deltabox.cr import hostmem

    path = hostmem.THP_DIR / "enabled"
    before = hostmem.selected(path)
    if mode is None or mode == before:
        yield
        return
    path.write_text(mode)
    try:
        yield
    finally:
        path.write_text(before)


def run_main(main: Callable[[], int],
             stopped: str = "the private daemon was stopped (cleanup problems, if any, above)"
             ) -> NoReturn:
    """A benchmark's entry point: its exit status; 130 on Ctrl-C, 143 on SIGTERM/SIGHUP
    (raised as Terminated inside `terminate_as_exception`), after its cleanups ran."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log(f"interrupted; {stopped}")
        sys.exit(130)
    except Terminated as e:
        log(f"terminated by {e}; {stopped}")
        sys.exit(143)


# ---- a private daemon ------------------------------------------------------------------------

def _mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mnt = line.split()[1]
            if mnt.startswith(prefix) or mnt == str(path):
                out.append(mnt)
    return out


class PrivateDaemon:
    """deltaboxd on its own temp state dir and socket.

        with PrivateDaemon() as d:
            sbx = Sandbox.create(socket=d.socket)

    The temp dir lives under `parent` (default /var/tmp: disk-backed, unlike a tmpfs /tmp).
    `scratch` is a directory on the same filesystem as the state dir, removed with it.
    `start` returns once the daemon answers and its turn inspector has loaded: the compile
    (LLVM, ~5 s of one CPU here) must not overlap what a benchmark measures.
    """

    def __init__(self, parent: str | Path = "/var/tmp", store_size_gb: int = 16,
                 extra_args: Sequence[str] = (), keep: bool = False) -> None:
        self.parent = Path(parent)
        self.store_size_gb = store_size_gb
        self.extra_args = list(extra_args)
        self.keep = keep
        self.base: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.cleanup_problems: list[str] = []
        self.leaks: list[str] = []
        self._stopped = False

    # paths (valid after start)
    @property
    def state_dir(self) -> Path:
        assert self.base is not None
        return self.base / "state"

    @property
    def socket(self) -> str:
        assert self.base is not None
        return str(self.base / "deltabox.sock")

    @property
    def log_path(self) -> Path:
        assert self.base is not None
        return self.base / "daemon.log"

    @property
    def scratch(self) -> Path:
        assert self.base is not None
        return self.base / "scratch"

    def start(self, timeout: float = 60) -> PrivateDaemon:
        if self.proc is not None and self.proc.poll() is None:
            # `with PrivateDaemon() as d` has started it already: a second daemon would
            # replace this one's handle and be left running.
            raise RuntimeError("this PrivateDaemon is already running")
        self.parent.mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(prefix="dbx-bench-", dir=self.parent))
        self._stopped = False
        self.scratch.mkdir()
        with open(self.log_path, "ab") as logf:
            # Own session: a Ctrl-C meant for the benchmark must not reach the daemon before
            # the benchmark's own cleanup has killed the sandboxes.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deltabox.daemon.main", "--state-dir",
                 str(self.state_dir), "--socket", self.socket, "--store-size-gb",
                 str(self.store_size_gb), *self.extra_args],
                stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        self._wait_ready(timeout)
        wait_inspector(self)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import deltabox

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"deltaboxd exited during start-up:\n{self.log_tail()}")
            if os.path.exists(self.socket):
                try:
                    deltabox.info(socket=self.socket)
                    return
                except deltabox.DeltaBoxError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"deltaboxd not ready after {timeout:g}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no daemon log)"

    def info(self) -> Any:
        import deltabox

        return deltabox.info(socket=self.socket)

    def kill_all_sandboxes(self, timeout: float = 60) -> int:
        """Remove every sandbox the daemon knows; returns how many. Every call has a
        deadline, so a hung daemon cannot hang the cleanup."""
        from deltabox import DeltaBoxError
        from deltabox.api import deltabox_pb2 as pb
        from deltabox.client import connect

        n = 0
        try:
            with connect(self.socket) as client:
                resp = client.call("ListSandboxes", pb.ListSandboxesRequest(), timeout=timeout)
                for box in resp.sandboxes:
                    try:
                        client.call("RemoveSandbox", pb.SandboxRef(sandbox_id=box.id),
                                    timeout=timeout)
                        n += 1
                    except DeltaBoxError as e:
                        self.cleanup_problems.append(f"cannot remove {box.id}: {e}")
        except DeltaBoxError as e:
            self.cleanup_problems.append(f"cannot list sandboxes: {e}")
        return n

    def stop(self) -> None:
        """Kill sandboxes, SIGTERM the daemon, and remove the temp dir (unless something is
        still mounted under it, or keep=True). Safe to call more than once. SIGINT, SIGTERM
        and SIGHUP wait until it is done (a second Ctrl-C must not strand the daemon)."""
        if self.base is None or self._stopped:
            return
        self._stopped = True
        sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        try:
            self._stop()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _stop(self) -> None:
        assert self.base is not None
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.kill_all_sandboxes()
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.cleanup_problems.append("deltaboxd ignored SIGTERM for 60 s; killed")
                    self.proc.kill()
                    self.proc.wait()
            if self.proc is not None and self.proc.returncode not in (0, None):
                self.cleanup_problems.append(
                    f"deltaboxd exited with status {self.proc.returncode}")
        finally:
            _forget_client(self.socket)
            self.leaks = own_leaks(self.base, self.state_dir)
            deadline = time.monotonic() + 5  # a loop device detaches a moment after umount
            while self.leaks and time.monotonic() < deadline:
                time.sleep(0.1)
                self.leaks = own_leaks(self.base, self.state_dir)
            self.cleanup_problems += [f"left behind: {x}" for x in self.leaks]
            left = _mounts_under(self.base)
            if left:
                self.cleanup_problems.append(f"still mounted under {self.base}: {left}; "
                                             "not removing it")
            elif not self.keep:
                shutil.rmtree(self.base, ignore_errors=True)
            for p in self.cleanup_problems:
                log(f"cleanup: {p}")
            if self.keep or left:
                log(f"daemon state kept at {self.base}")
            if not (self.keep or left):
                self.base = None
            self.proc = None

    def __enter__(self) -> PrivateDaemon:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _forget_client(socket: str) -> None:
    """Close the SDK's cached channel to a daemon that is gone."""
    try:
        from deltabox import sdk
    except ImportError:
        return
    with sdk._clients_lock:
        for key in [k for k in sdk._clients if k[0] == socket]:
            try:
                sdk._clients.pop(key).close()
            except Exception:
                pass


def own_leaks(base: Path, state_dir: Path) -> list[str]:
    """What one stopped daemon left behind: mounts, loop devices and processes naming its
    temp dir, its cgroup parent and helpers naming it (the checks of ../shared/tools/leakcheck
    and tests/conftest.py's `leaks`, restricted to this daemon: other daemons on the host are
    not counted)."""
    found = [f"mount {m}" for m in _mounts_under(base)]
    r = subprocess.run(["losetup", "-a"], capture_output=True, text=True)
    found += [f"loop {line}" for line in r.stdout.splitlines() if str(base) in line]
    r = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True)
    found += [f"process {line.strip()}" for line in r.stdout.splitlines()
              if str(base) in line]
    try:
        from deltabox.sandbox.cgroups import parent_name

        name = parent_name(str(state_dir.resolve()))
        found += [f"cgroup {c}" for c in Path("/sys/fs/cgroup").glob(f"*/{name}")]
        found += [f"cgroup {c}" for c in Path("/sys/fs/cgroup").glob(name)]
        # the daemon's helpers (native/dbx-*) name its cgroup parent on their command line
        found += [f"process {line.strip()}" for line in r.stdout.splitlines()
                  if "libexec/dbx-" in line and name in line and str(base) not in line]
    except ImportError:
        pass
    return found


def other_daemons() -> list[str]:
    """Command lines of deltaboxd processes not started by us (they add noise to timings)."""
    r = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True)
    out = []
    for line in r.stdout.splitlines():
        args = line.split(None, 1)[1:] or [""]
        argv0 = os.path.basename(args[0].split(" ", 1)[0])
        if "deltabox.daemon.main" in args[0] or argv0 == "deltaboxd":
            out.append(line.strip())
    return out


def leakcheck() -> tuple[bool, str]:
    """Run ../shared/tools/leakcheck if present; (clean, output). The tool lists every
    process whose command line names deltabox, which a benchmark's own (`--systems
    deltabox,...`) and its shell's do: those are not leftovers, and are not counted."""
    tool = ROOT.parent / "shared" / "tools" / "leakcheck"
    if not tool.exists():
        return True, "leakcheck not found; skipped"
    r = subprocess.run([str(tool)], capture_output=True, text=True)
    ours = _ancestors(os.getpid())
    lines = [x for x in (r.stdout + r.stderr).strip().splitlines()
             if _leaked_pid(x) not in ours and x != "leakcheck: clean"]
    if any(x.startswith("leak:") for x in lines):
        return False, "\n".join(lines)
    note = " (this benchmark's own processes left out)" if r.returncode else ""
    return True, "\n".join(lines + [f"leakcheck: clean{note}"])


def _ancestors(pid: int) -> set[int]:
    """pid and every process above it."""
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _leaked_pid(line: str) -> int | None:
    """The pid of a leakcheck line "leak: process PID: CMD"; None for other lines."""
    m = re.match(r"leak: process (\d+):", line)
    return int(m.group(1)) if m else None


# ---- statistics ------------------------------------------------------------------------------

def record_cleanup(result: dict[str, Any], *daemons: PrivateDaemon) -> None:
    """Record in the result what the run left behind (its daemons' own leaks, and the
    machine's)."""
    clean, report = leakcheck()
    result["cleanup"] = {"own_leaks": [x for d in daemons for x in d.leaks],
                         "problems": [x for d in daemons for x in d.cleanup_problems],
                         "leakcheck_clean": clean, "leakcheck": report}
    if not clean:
        log(f"leakcheck (whole machine; other runs count too):\n{report}")


def cgroup_procs(init_pid: int) -> Path:
    """The cgroup.procs file of the sandbox whose init has host pid `init_pid`."""
    lines = Path(f"/proc/{init_pid}/cgroup").read_text().splitlines()
    for line in lines:  # cgroup v1: the pids hierarchy
        _, ctrls, path = line.split(":", 2)
        if "pids" in ctrls.split(","):
            return Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "cgroup.procs"
    for line in lines:  # v2
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "cgroup.procs"
    raise RuntimeError(f"no cgroup for pid {init_pid}")


def kill_and_wait(sandboxes: Iterable[Any], timeout: float = 60) -> tuple[float, float]:
    """Kill sandboxes one by one: (ms until the last kill answered, ms until every one's
    cgroup is gone: its processes exited and the daemon tore it down, which it does after
    answering)."""
    sandboxes = list(sandboxes)
    cgroups = []
    for k in sandboxes:
        try:
            cgroups.append(cgroup_procs(k.info().init_pid).parent)
        except Exception:  # gone or stopped already (NotFound, no init): nothing to wait for
            pass
    t0 = time.perf_counter()
    for k in sandboxes:
        k.kill()
    answered = (time.perf_counter() - t0) * 1000
    deadline = time.monotonic() + timeout
    while any(c.exists() for c in cgroups) and time.monotonic() < deadline:
        time.sleep(0.002)
    return answered, (time.perf_counter() - t0) * 1000


def _drop_deleted(btrfs: Callable[..., str], held: set[str], stuck_s: float = 3.0,
                  cap_s: float = 60) -> None:
    """Wait until btrfs's cleaner has dropped the deleted subvolumes, or until their list
    has not changed for `stuck_s`: a deleted subvolume something still holds (a
    checkpoint's templates keep the generation they were made in) is dropped only once
    released, and waiting for it would stall every run (a CI run once waited the whole
    minute at every settle). Those found so go to `held` (their ids), which later calls
    do not wait for again."""
    deadline = time.monotonic() + cap_s
    last: set[str] | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        # A transaction commit wakes the cleaner; deleted subvolumes are listed until it
        # is done (`subvolume sync` alone waits for a commit that may not come).
        btrfs("filesystem", "sync")
        listed = {line.split()[1] for line in btrfs("subvolume", "list", "-d").splitlines()
                  if line.startswith("ID ")} - held
        if not listed:
            return
        if listed != last:
            last, since = listed, time.monotonic()
        elif time.monotonic() - since >= stuck_s:
            print(f"settle: {len(listed)} deleted subvolume(s) still held after "
                  f"{stuck_s:.0f} s without progress; not waiting for them", file=sys.stderr)
            held |= listed
            return
        time.sleep(0.1)


def make_settle(socket: str) -> Callable[[], float]:
    """Between two measured runs: wait until btrfs has cleaned up the subvolumes the last
    one deleted, and flush dirty pages, so that no run pays for the previous one's
    background work (untimed). Returns the ms it waited."""
    import deltabox

    info = deltabox.info(socket=socket)
    held: set[str] = set()   # deleted subvolumes found held: not waited for again

    def btrfs(*args: str) -> str:
        return subprocess.run(["btrfs", *args, info.store_path], capture_output=True,
                              text=True, timeout=120).stdout

    def settle() -> float:
        t0 = time.perf_counter()
        os.sync()
        if info.store_backend.startswith("btrfs"):
            _drop_deleted(btrfs, held)
        return (time.perf_counter() - t0) * 1000

    return settle


def wait_inspector(daemon: PrivateDaemon, timeout: float = 180) -> str:
    """The daemon's inspector backend once it has loaded (it loads in the background), or
    what it says after `timeout`."""
    deadline = time.monotonic() + timeout
    backend = ""
    while time.monotonic() < deadline:
        backend = daemon.info().inspector_backend
        if not backend.startswith("loading"):
            return backend
        time.sleep(0.2)
    return backend


def wait_until(cond: Callable[[], Any], what: str, timeout: float = 60,
               interval: float = 0.002) -> None:
    """Until cond() is true; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what} ({timeout:g} s)")
        time.sleep(interval)


def wait_for_file(sbx: Any, path: str, timeout: float, what: str,
                  interval: float = 0.05) -> None:
    """Until `path` exists in the sandbox (files API); TimeoutError naming `what`."""
    wait_until(lambda: sbx.files.exists(path), f"{what} (no {path})", timeout, interval)


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100]; linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def stats(values: Sequence[float]) -> dict[str, float]:
    """Summary of a latency sample (same unit in and out)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "min": min(vals),
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
        "max": max(vals),
        "mean": statistics.fmean(vals),
        "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0,
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


class Timer:
    """`with Timer() as t: ...` then `t.ms`."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ms = (time.perf_counter() - self.t0) * 1000.0


# ---- machine info and JSON -------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fs_type(path: str | Path) -> str:
    """Filesystem type of the mount holding `path` (longest matching mount point)."""
    p = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt, fstype = parts[1], parts[2]
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fstype
    return kind


def _git(*args: str) -> str | None:
    """Output of a read-only git command in the repository, or None."""
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                           timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine_info(socket: str | None = None) -> dict[str, Any]:
    """The machine, Python, and (given a daemon socket) the daemon's store backend."""
    from deltabox.sandbox import cgroups

    u = os.uname()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    info: dict[str, Any] = {
        "uname": {"sysname": u.sysname, "nodename": u.nodename, "release": u.release,
                  "version": u.version, "machine": u.machine},
        "cpu_model": _cpu_model(),
        "nproc": affinity,
        "cpu_count": os.cpu_count(),
        "memory_bytes": _mem_total_bytes(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_modified_files": (_git("diff", "--name-only", "HEAD") or "").split(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # README 'Host tuning: cgroup favordynmods'
        "cgroup_favordynmods": cgroups.favordynmods_state(),
    }
    if socket is not None:
        import deltabox

        try:
            d = deltabox.info(socket=socket)
            info["deltabox"] = dict(d.model_dump(), store_fs=fs_type(d.store_path),
                                    state_dir_fs=fs_type(d.state_dir))
        except deltabox.DeltaBoxError as e:
            info["deltabox"] = {"error": str(e)}
    return info


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "model_dump"):
        return o.model_dump()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _finite(o: Any) -> Any:
    """JSON has no NaN/Infinity: write them as null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str | Path, data: Mapping[str, Any],
               machine: Mapping[str, Any] | None = None) -> Path:
    """Write `data` (plus a "machine" section) atomically, pretty-printed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(data)
    if machine is not None:
        doc["machine"] = dict(machine)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(doc), indent=1, default=_json_default) + "\n")
    tmp.replace(path)
    return path


# ---- plotting --------------------------------------------------------------------------------

def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_figure(fig: Any, path: Path, title: str, machine: Mapping[str, Any]) -> None:
    """Title a figure with the machine and commit it was measured on, and save it."""
    plt = pyplot()
    dbx = machine.get("deltabox", {})
    fig.suptitle(
        f"{title}; store {dbx.get('store_backend', '?')}; {machine.get('cpu_model', '?')}, "
        f"{machine.get('nproc', '?')} cpus; {machine.get('uname', {}).get('release', '?')}; "
        f"commit {(machine.get('git_commit') or '?')[:10]}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_boxplot(ax: Any, groups: Mapping[str, Mapping[str, Sequence[float]]],
                    colors: Mapping[str, str] | None = None, log_scale: bool = True,
                    ylabel: str = "latency (ms)", title: str = "",
                    hlines: Iterable[tuple[float, str]] = (),
                    legend_loc: str = "above") -> None:
    """Grouped box plots: one cluster per group (x tick), one box per series in it.

    groups = {"k=1": {"deltabox": [...], "copytree": [...]}, "k=10": {...}}
    Boxes span p25-p75, whiskers p1-p99, dots beyond; each box's p50 is written above it.
    hlines: (y, label) reference lines, e.g. a target.
    """
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    colors = dict(colors or {})
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    for i, s in enumerate(series):
        colors.setdefault(s, palette[i % len(palette)])
    width = 0.8 / max(1, len(series))
    for gi, (gname, g) in enumerate(groups.items()):
        for si, s in enumerate(series):
            vals = list(g.get(s, []))
            if not vals:
                continue
            x = gi - 0.4 + width * (si + 0.5)
            bp = ax.boxplot([vals], positions=[x], widths=width * 0.85, whis=(1, 99),
                            showfliers=True, patch_artist=True,
                            flierprops={"markersize": 2, "alpha": 0.4},
                            medianprops={"color": "black"})
            for patch in bp["boxes"]:
                patch.set_facecolor(colors[s])
                patch.set_alpha(0.75)
            ax.annotate(_fmt_ms(percentile(vals, 50)), (x, max(vals)),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    for y, label in hlines:
        ax.axhline(y, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(label, (len(groups) - 0.5, y), textcoords="offset points", xytext=(0, 2),
                    ha="right", fontsize=7, color="gray")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups))
    ax.set_xlim(-0.6, len(groups) - 0.4)
    if log_scale:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="y", which="both", alpha=0.25)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colors[s], alpha=0.75, label=s) for s in series]
    if legend_loc == "above":  # right of a left-aligned title, outside the data
        ax.legend(handles=handles, fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                  ncol=len(series), frameon=False, borderaxespad=0.2)
    else:
        ax.legend(handles=handles, fontsize=8, loc=legend_loc)


def _fmt_ms(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:.2f} s"
    if v >= 10:
        return f"{v:.0f} ms"
    return f"{v:.2g} ms" if v < 1 else f"{v:.1f} ms"


# ---- real-world source trees from PyPI -------------------------------------------------------

def download_sdists(specs: Sequence[str], dest: Path) -> dict[str, Path]:
    """`pip download --no-binary :all: --no-deps` each spec (e.g. "django==5.0.6") into
    `dest`, unless already there. Returns spec -> archive path."""
    dest.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for spec in specs:
        found = _find_sdist(spec, dest)
        if found is None:
            log(f"downloading sdist {spec} ...")
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary",
                                ":all:", "--no-deps", "--dest", str(dest), spec],
                               capture_output=True, text=True)
            found = _find_sdist(spec, dest)
            if found is None:
                raise RuntimeError(f"pip download {spec} failed:\n{r.stdout}\n{r.stderr}")
        out[spec] = found
    return out


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _find_sdist(spec: str, dest: Path) -> Path | None:
    name, _, version = spec.partition("==")
    for p in sorted(dest.iterdir()):
        if not p.name.endswith((".tar.gz", ".zip", ".tar.bz2")):
            continue
        stem = p.name.rsplit(".tar", 1)[0].removesuffix(".zip")
        pname, _, pver = stem.rpartition("-")
        if _norm(pname) == _norm(name) and (not version or pver == version):
            return p
    return None


def unpack_sdist(archive: Path, dest_parent: Path) -> Path:
    """Unpack once (a `.unpacked` marker makes it idempotent); returns the top directory."""
    stem = archive.name.rsplit(".tar", 1)[0].removesuffix(".zip")
    top = dest_parent / stem
    marker = dest_parent / f".{stem}.unpacked"
    if marker.exists() and top.is_dir():
        return top
    shutil.rmtree(top, ignore_errors=True)
    dest_parent.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".zip"):
        shutil.unpack_archive(str(archive), str(dest_parent))
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(dest_parent, filter="data")
    if not top.is_dir():
        raise RuntimeError(f"{archive} did not unpack to {top}")
    marker.touch()
    return top


def count_files(tree: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(tree))


def list_files(tree: Path) -> list[str]:
    """Regular files under `tree`, relative, sorted."""
    out = []
    for dirpath, _, files in os.walk(tree):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(os.path.relpath(p, tree))
    return sorted(out)


def tar_bytes(src: Path, arcname: str | None = None) -> bytes:
    """An uncompressed tar of directory `src` (as `arcname`, default its basename)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(str(src), arcname=arcname or src.name)
    return buf.getvalue()
