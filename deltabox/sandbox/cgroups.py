"""Cgroup driver: one cgroup per sandbox with memory / pids / cpu limits and a freezer.

Supports cgroup v1 (one hierarchy per controller, as on these machines) and v2 (unified).
Every sandbox cgroup lives under a parent named for the daemon's state dir
(`deltabox-<hash>`), so a restarted daemon finds and removes exactly what its previous run left,
and never touches the sandboxes of another daemon on the same host.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from .. import kernfs
from ..errors import FailedPrecondition, Internal, ResourceExhausted

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A freeze or thaw is awaited by yielding the CPU this long, then by short sleeps.
SPIN_S = 0.002
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")


@dataclass(frozen=True)
class Limits:
    memory_mb: int
    pids_max: int
    cpus: float  # 0 = unlimited


def _write(path: Path, value: str) -> None:
    try:
        kernfs.write(path, value.encode())
    except OSError as e:
        raise Internal(f"cgroup: cannot write {value!r} to {path}: {e.strerror}") from e


def _cgroup_mounts(mounts: str | None = None) -> list[tuple[Path, str, str]]:
    """(mount point, "cgroup" or "cgroup2", options) of every cgroup hierarchy, in the
    order of /proc/self/mounts (or of the given text of it)."""
    text = Path("/proc/self/mounts").read_text() if mounts is None else mounts
    return [(Path(f[1]), f[2], f[3]) for f in (line.split() for line in text.splitlines())
            if len(f) >= 4 and f[2] in ("cgroup", "cgroup2")]


def _v1_mounts() -> dict[str, Path]:
    """Controller name -> mount point of its v1 hierarchy."""
    found: dict[str, Path] = {}
    for mnt, fstype, opts in _cgroup_mounts():
        if fstype != "cgroup":
            continue
        for opt in opts.split(","):
            if opt in V1_CONTROLLERS or opt == "cpu":
                found.setdefault(opt, mnt)
    return found


def _unified_mount() -> Path | None:
    return next((mnt for mnt, fstype, _ in _cgroup_mounts() if fstype == "cgroup2"), None)


def detect_version() -> str:
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return "v2"
    return "v1"


FAVORDYNMODS = "favordynmods"


def dynmods_mount(mounts: str) -> tuple[Path, str] | None:
    """The cgroup hierarchy to remount with favordynmods, from /proc/self/mounts text: the
    cgroup2 one (v2 host, or the hybrid's unified), else a v1 controller's; with its
    options. None without any."""
    found = _cgroup_mounts(mounts)
    return next(((mnt, opts) for mnt, fstype, opts in found if fstype == "cgroup2"),
                next(((mnt, opts) for mnt, _, opts in found if "name=" not in opts), None))


def favors_dynmods(mounts: str | None = None) -> bool:
    """Whether a cgroup hierarchy is mounted with favordynmods (then a cgroup.procs write
    does not wait for an RCU grace period; see favor_dynmods)."""
    return any(FAVORDYNMODS in opts.split(",") for _, _, opts in _cgroup_mounts(mounts))


_STICKY_CHECK_S = 60.0
_sticky: dict[str, float | bool] = {"seen": False, "at": -_STICKY_CHECK_S}


def favordynmods_state() -> str:
    """"on", "off", or "on since boot": the option was turned off again on a kernel that
    keeps its effect until a reboot (Linux 6.18 logs so once). The kernel log is read at most
    once a minute (dmesg takes ~10 ms; `deltabox info` asks), and never again once seen; a
    log that has rotated since no longer tells, and then this says "off"."""
    if favors_dynmods():
        return "on"
    now = time.monotonic()
    if not _sticky["seen"] and now - float(_sticky["at"]) >= _STICKY_CHECK_S:
        log = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
        _sticky.update(seen="rwsem mechanism can't be disabled" in log, at=now)
    return "on since boot" if _sticky["seen"] else "off"


def describe_favordynmods() -> str:
    """The state, with what "off" costs and how to change it (deltabox info)."""
    state = favordynmods_state()
    if state != "off":
        return state
    return ("off: moving a process into a cgroup (each sandbox create, fork child and exec) "
            "waits for an RCU grace period; deltaboxd --cgroup-favordynmods turns it on "
            "(README 'Host tuning')")


def favor_dynmods() -> str:
    """Remount a cgroup hierarchy with favordynmods (Linux >= 6.0); returns a line for the
    log. Moving a process into a cgroup (a write to cgroup.procs: every sandbox's init, each
    process a fork restores, each exec) takes the kernel's global threadgroup rwsem for
    writing, which first waits for an RCU grace period, 5-8 ms on these VMs; favordynmods
    keeps that lock in its slow-reader mode so writers do not wait (forks and exits pay a
    little more). The lock is global: one hierarchy's option applies to all. Host-wide, and
    on Linux 6.18 it cannot be turned off again until a reboot: hence opt-in."""
    text = Path("/proc/self/mounts").read_text()
    if favors_dynmods(text):
        return "cgroup favordynmods: already on"
    target = dynmods_mount(text)
    if target is None:
        raise Internal("cgroup favordynmods: no cgroup hierarchy is mounted")
    mnt, opts = target
    # mount(8) keeps the hierarchy's other options (a cgroup2 remount resets those not given).
    done = subprocess.run(["mount", "-o", f"remount,{FAVORDYNMODS}", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0 or not favors_dynmods():
        raise FailedPrecondition(
            f"cgroup favordynmods: remounting {mnt} ({opts}) with it failed "
            f"({done.stderr.strip() or 'the option did not stick'}); it needs Linux 6.0 or "
            "later: start deltaboxd without --cgroup-favordynmods")
    return f"cgroup favordynmods: on ({mnt} remounted; cgroup.procs writes skip an RCU grace period)"


class Cgroup:
    """The cgroup(s) of one sandbox."""

    def __init__(self, driver: CgroupDriver, name: str) -> None:
        self.driver = driver
        self.name = name
        self.dirs = driver.dirs_for(name)
        self._frozen: bool | None = None  # None: unknown (e.g. left by a crashed daemon)
        self._bpf_id: int | None = None

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        try:
            text = kernfs.read(self.driver.procs_dir(self.name) / "cgroup.procs")
        except FileNotFoundError:
            return set()
        return {int(x) for x in text.split()}

    def apply(self, limits: Limits) -> None:
        self.driver.apply(self.name, limits)

    def freeze(self) -> None:
        self._frozen = None
        self.driver.set_frozen(self.name, True)
        self._frozen = True

    def thaw(self) -> None:
        """Thaw; a no-op when this object thawed it last (a checkpoint thaws as early as
        it can and again, to be sure, on its way out)."""
        if self._frozen is False:
            return
        self.driver.set_frozen(self.name, False)
        self._frozen = False

    def kill(self, keep: set[int] = frozenset(), timeout: float = 5.0) -> int:
        """SIGKILL every process except `keep`; returns how many were killed.

        Frozen first, so nothing can fork while we walk the list.
        """
        self.freeze()
        try:
            victims = self.pids() - set(keep)
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            self.thaw()
        deadline = time.monotonic() + timeout
        while self.pids() - set(keep):
            if time.monotonic() > deadline:
                raise Internal(f"cgroup {self.name}: processes {sorted(self.pids() - set(keep))} "
                               "survived SIGKILL")
            time.sleep(0.001)
        return len(victims)

    def kill_now(self, keep: Collection[int] = frozenset(), rounds: int = 100,
                 group: int | None = None) -> list[int]:
        """SIGKILL every process except `keep` (with `group`: every one of that process
        group) without waiting for them to exit (a rollback waits only for the pids it
        reuses, and a large process's address space takes milliseconds to tear down).
        Returns a pidfd per victim; the caller closes them.

        Not frozen first (a v1 freeze and thaw cost about a millisecond): a child forked
        between our listing and the kill is in the next listing, and a process with SIGKILL
        pending forks no more (copy_process fails), so the rounds end. Signals go through
        pidfds opened while the pid was listed in the cgroup, so a pid that exited and was
        reused by a process elsewhere is never signalled."""
        keep = set(keep)
        done: dict[int, int] = {}
        try:
            for _ in range(rounds):
                new = self.pids() - keep - done.keys()
                if group is not None:
                    new = {p for p in new if kernfs.process_group(p) == group}
                if not new:
                    return list(done.values())
                done.update(self._kill_listed(new))
        except BaseException:
            for fd in done.values():
                os.close(fd)
            raise
        for fd in done.values():
            os.close(fd)
        raise Internal(f"cgroup {self.name}: processes kept appearing through {rounds} rounds "
                       "of SIGKILL")

    def kill_one(self, pid: int) -> None:
        """SIGKILL `pid` if it is in the cgroup (kill_now's checks), not waited for."""
        for fd in self._kill_listed({pid}).values():
            os.close(fd)

    def _kill_listed(self, pids: Collection[int]) -> dict[int, int]:
        """SIGKILL those of `pids` still in the cgroup once held by a pidfd (one that
        exited before, its pid maybe reused elsewhere, is left alone); their pidfds."""
        opened: dict[int, int] = {}
        for pid in pids:
            try:
                opened[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                pass
        listed = self.pids()
        done: dict[int, int] = {}
        for pid, fd in opened.items():
            if pid not in listed:  # gone before we held it: maybe not ours now
                os.close(fd)
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            done[pid] = fd
        return done

    def memory_usage(self) -> int:
        return self.driver.memory_usage(self.name)

    def pids_current(self) -> int | None:
        """How many tasks count against its pids limit now (None: unreadable)."""
        return self.driver.pids_current(self.name)

    @property
    def bpf_id(self) -> int | None:
        """Its id for the inspector: read once (a stat of its directory in cgroupfs took
        0.05-0.34 ms on a rollback's path here, waiting on the hierarchy's lock), then
        kept while the directory lives (remove() forgets it)."""
        if self._bpf_id is None:
            self._bpf_id = self.driver.bpf_id(self.name)
        return self._bpf_id

    def remove(self) -> None:
        """Kill everything and delete the cgroup directories (idempotent)."""
        if any(d.exists() for d in self.dirs):
            self.kill()
        for d in self.dirs:
            _rmdir_retry(d)
        self._bpf_id = None


def _rmdir_retry(d: Path, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            # EBUSY: the last task is exiting but not yet uncharged.
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise Internal(f"cgroup: cannot remove {d}: {e.strerror}") from e
            time.sleep(0.005)


class CgroupDriver:
    """Creates, limits, freezes and removes sandbox cgroups on v1 or v2."""

    def __init__(self, parent: str, version: str | None = None) -> None:
        self.parent = parent
        self._set_up = False
        self.version = version or detect_version()
        self.v1 = _v1_mounts() if self.version == "v1" else {}
        # Hybrid hosts mount cgroup2 beside the v1 hierarchies (controller-less): sandbox
        # processes are put there too, so eBPF can tell them apart by cgroup id.
        self.unified = _unified_mount() if self.version == "v1" else None
        if self.version == "v1":
            missing = [c for c in V1_CONTROLLERS if c not in self.v1]
            if missing:
                raise Internal(f"cgroup v1 controllers not mounted: {', '.join(missing)}")

    def _parents(self) -> list[Path]:
        if self.version == "v2":
            return [CGROUP_ROOT / self.parent]
        out = [self.v1[c] / self.parent for c in V1_CONTROLLERS]
        if self.unified is not None:
            out.append(self.unified / self.parent)
        return out

    def dirs_for(self, name: str) -> list[Path]:
        return [p / name for p in self._parents()]

    def procs_dir(self, name: str) -> Path:
        if self.version == "v1":
            return self.v1["freezer"] / self.parent / name
        return self.dirs_for(name)[0]

    def bpf_id(self, name: str) -> int | None:
        """The cgroup-v2 id of a sandbox (what bpf_get_current_cgroup_id() returns for its
        processes): the inode of its directory in the unified hierarchy. On a v1 host the
        sandbox is placed in the hybrid unified hierarchy too, for this; None without one."""
        d = (self.unified if self.version == "v1" else CGROUP_ROOT)
        if d is None:
            return None
        try:
            return os.stat(d / self.parent / name).st_ino
        except OSError:
            return None

    def setup(self) -> None:
        for p in self._parents():
            p.mkdir(exist_ok=True)
        if self.version == "v2":
            for d in (CGROUP_ROOT, CGROUP_ROOT / self.parent):
                _write(d / "cgroup.subtree_control", "+memory +pids +cpu")
        self._set_up = True

    def create(self, name: str, limits: Limits) -> Cgroup:
        """A new sandbox cgroup with `limits` (the parents are made once, not per sandbox:
        0.13 of the 0.75 ms a create took here; a fork makes one per child)."""
        if not self._set_up:
            self.setup()
        try:
            self._make(name)
        except FileNotFoundError:  # a parent was removed from outside: make them again
            self.setup()
            self._make(name)
        self.apply(name, limits, fresh=True)
        return Cgroup(self, name)

    def _make(self, name: str) -> None:
        for d in self.dirs_for(name):
            d.mkdir(exist_ok=True)

    def existing(self) -> list[str]:
        """Names of sandbox cgroups present (from any daemon)."""
        names: set[str] = set()
        for p in self._parents():
            if p.is_dir():
                names.update(c.name for c in p.iterdir() if c.is_dir())
        return sorted(names)

    def remove_parent(self) -> None:
        self._set_up = False
        for p in self._parents():
            try:
                p.rmdir()
            except OSError:
                pass

    def apply(self, name: str, limits: Limits, fresh: bool = False) -> None:
        """Set the limits; `fresh`: on a cgroup just made, whose CPU bandwidth is the
        kernel's default (unlimited, 100 ms period), which needs no write then."""
        mem = limits.memory_mb * 1024 * 1024
        cpu_default = fresh and not limits.cpus
        if self.version == "v2":
            d = CGROUP_ROOT / self.parent / name
            _write(d / "memory.max", str(mem))
            _write(d / "memory.swap.max", "0") if (d / "memory.swap.max").exists() else None
            _write(d / "pids.max", str(limits.pids_max))
            quota = f"{int(limits.cpus * 100000)} 100000" if limits.cpus else "max 100000"
            if not cpu_default:
                _write(d / "cpu.max", quota)
            return
        _write(self.v1["memory"] / self.parent / name / "memory.limit_in_bytes", str(mem))
        _write(self.v1["pids"] / self.parent / name / "pids.max", str(limits.pids_max))
        if cpu_default:
            return
        cpu = self.v1["cpu"] / self.parent / name
        _write(cpu / "cpu.cfs_period_us", "100000")
        _write(cpu / "cpu.cfs_quota_us", str(int(limits.cpus * 100000)) if limits.cpus else "-1")

    def set_frozen(self, name: str, frozen: bool, timeout: float = 5.0) -> None:
        if self.version == "v2":
            d = CGROUP_ROOT / self.parent / name
            _write(d / "cgroup.freeze", "1" if frozen else "0")
            want = f"frozen {1 if frozen else 0}".encode()
            check = lambda: want in kernfs.read(d / "cgroup.events")  # noqa: E731
        else:
            state = self.v1["freezer"] / self.parent / name / "freezer.state"
            target = "FROZEN" if frozen else "THAWED"
            _write(state, target)
            check = lambda: kernfs.read(state).strip() == target.encode()  # noqa: E731
        start = time.monotonic()
        deadline = start + timeout
        kick = start + 0.05
        while not check():
            now = time.monotonic()
            if now > deadline:
                raise ResourceExhausted(f"cgroup {name}: not {'frozen' if frozen else 'thawed'} "
                                        f"after {timeout}s")
            if self.version == "v1" and frozen and now > kick:
                # v1 signals each task once per write; one that forked or was in a
                # non-freezable sleep at that moment can stay FREEZING: ask again.
                _write(state, target)
                kick = now + 0.05
            if now - start < SPIN_S:
                # Idle tasks freeze within microseconds once they run: yield the CPU to
                # them and look again, rather than sleep (a 0.2 ms sleep lasts ~0.3 ms
                # here; freezing a bash and a 200 MB python: p50 0.43 vs 0.73 ms; the
                # checkpoint's freeze in the full scenario: 0.28 vs 0.58 ms).
                os.sched_yield()
            else:
                time.sleep(0.0002)

    def memory_usage(self, name: str) -> int:
        if self.version == "v2":
            f = CGROUP_ROOT / self.parent / name / "memory.current"
        else:
            f = self.v1["memory"] / self.parent / name / "memory.usage_in_bytes"
        try:
            return int(f.read_text())
        except (OSError, ValueError):
            return 0

    def pids_current(self, name: str) -> int | None:
        d = (CGROUP_ROOT / self.parent / name if self.version == "v2"
             else self.v1["pids"] / self.parent / name)
        try:
            return int(kernfs.read(d / "pids.current"))
        except (OSError, ValueError):
            return None


def parent_name(state_dir: str) -> str:
    """The cgroup parent of one daemon (one state dir)."""
    import hashlib

    return "deltabox-" + hashlib.sha256(state_dir.encode()).hexdigest()[:8]
