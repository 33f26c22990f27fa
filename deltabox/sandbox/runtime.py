"""A running sandbox: its cgroup, its init (pid 1 of its namespaces) and its current
file-system generation (a mount namespace whose root is the overlay of its writable layer).

Processes are started by the native helpers in deltabox/libexec (see native/*.c):
dbx-init starts the namespaces, dbx-mkroot builds a generation, dbx-enter runs a command.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import trio

from .. import kernfs
from ..background import GuardedNursery

from ..errors import FailedPrecondition, Internal
from . import reaper
from .cgroups import Cgroup
from .userns import IdMap, userns_of

log = logging.getLogger("deltaboxd")

LIBEXEC = Path(__file__).resolve().parent.parent / "libexec"
# Queued to init with a pid: it raises its namespace's pid counter to it (native/common.h
# DBX_SIG_PID_FLOOR, init.c raise_pid_floor).
PID_FLOOR_SIGNAL = signal.SIGUSR2
SI_QUEUE = -1
SYS_pidfd_send_signal = 424   # x86_64; os.pidfd_send_signal takes no siginfo
_libc = ctypes.CDLL(None, use_errno=True)
KILL_CHECK_S = 0.25  # kill_all: exits awaited this long before looking for what holds them
KILL_WAIT_S = 5.0    # kill_all: and this long in all
# The environment of every helper that runs in (or is visible from) a sandbox: never the
# daemon's own, which a sandbox process could read in /proc/1/environ (init's) or in a
# helper's /proc/<pid>/environ, and which may hold tokens.
HELPER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "LANG": "C.UTF-8"}


def raise_fd_limit() -> None:
    """The daemon holds descriptors for every sandbox (pidfds, namespaces, pipes, execs'
    output): its soft RLIMIT_NOFILE goes up to the hard limit, so that a stock soft limit of
    1024 does not cap it at a few dozen sandboxes. Sandboxed processes keep the soft limit
    the daemon was started with (native/common.c sets it back from DBX_SANDBOX_NOFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return
    HELPER_ENV["DBX_SANDBOX_NOFILE"] = str(soft)
    try:
        nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        nr_open = 1 << 20
    target = nr_open if hard == resource.RLIM_INFINITY else min(hard, nr_open)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def helper(name: str) -> str:
    path = LIBEXEC / name
    if not os.access(path, os.X_OK):
        raise FailedPrecondition(f"native helper {path} is missing: run `make install`")
    return str(path)


@dataclass
class Generation:
    """One mount namespace of the sandbox; closing the fds lets the kernel tear it down."""

    layer_id: str
    mntfd: int
    rootfd: int
    # its overlay's layer directories, upper first (an inotify watch's file is found
    # through them: cr/watches.py)
    layers: tuple[str, ...] = ()

    def close(self) -> None:
        for fd in (self.mntfd, self.rootfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.mntfd = self.rootfd = -1


@dataclass
class Runtime:
    sandbox_id: str
    cgroup: Cgroup
    launcher: trio.Process
    init_pid: int
    pidfd: int
    userns: IdMap | None = None   # the sandbox's user namespace, if it has one
    generation: Generation | None = None
    exited: trio.Event = field(default_factory=trio.Event)

    @property
    def keep_pids(self) -> set[int]:
        """Processes a rollback must not kill: the launcher and init."""
        return {self.launcher.pid, self.init_pid}

    def enter_argv(self, argv: list[str], cwd: str, env: dict[str, str], tty: int = -1
                   ) -> list[str]:
        """The dbx-enter command line that runs argv inside this sandbox (`tty`: our fd of
        a pty's slave, its controlling terminal and fd 3)."""
        assert self.generation is not None
        cmd = [helper("dbx-enter"), "--pidfd", str(self.pidfd),
               "--mntfd", str(self.generation.mntfd), "--cwd", cwd]
        if tty >= 0:
            cmd += ["--tty", str(tty)]
        if self.userns:
            cmd.append("--userns")
        for f in self.cgroup.procs_files:
            cmd += ["--cgroup", f]
        for k, v in env.items():
            cmd += ["--env", f"{k}={v}"]
        return cmd + ["--"] + argv

    def raise_pid_floor(self, last: int) -> None:
        """Have the sandbox's pid namespace hand out new pids above `last`: init raises
        its counter (ns_last_pid) when it takes the queued signal (native/init.c
        raise_pid_floor), soon after, not before this returns. A fork's restored processes
        keep their source's pids in a namespace whose counter starts at 1."""
        info = (ctypes.c_int * 32)()                  # siginfo_t: 128 bytes
        info[0], info[2] = PID_FLOOR_SIGNAL, SI_QUEUE  # si_signo, si_code
        info[4], info[5] = os.getpid(), os.getuid()   # si_pid, si_uid
        info[6] = last                                # si_value.sival_int
        if _libc.syscall(ctypes.c_long(SYS_pidfd_send_signal), ctypes.c_long(self.pidfd),
                         ctypes.c_long(PID_FLOOR_SIGNAL), info, ctypes.c_long(0)) < 0:
            e = ctypes.get_errno()
            log.warning("%s: raising the pid counter of its namespace to %d failed: %s",
                        self.sandbox_id, last, os.strerror(e))

    @property
    def pass_fds(self) -> tuple[int, ...]:
        assert self.generation is not None
        return (self.pidfd, self.generation.mntfd)

    def close(self) -> None:
        if self.generation:
            self.generation.close()
            self.generation = None
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


async def start_init(sandbox_id: str, cgroup: Cgroup, hostname: str,
                     nest_under: int | None = None, userns: IdMap | None = None) -> Runtime:
    """Start dbx-init in the cgroup; returns once init's pid is known. `nest_under`: a
    host pid whose pid namespace becomes the parent of the sandbox's. `userns`: the sandbox
    gets a user namespace with this map (nested: it joins `nest_under`'s, which has it)."""
    cmd = [helper("dbx-init"), "--hostname", hostname]
    if nest_under is not None:
        cmd += ["--nest-under", str(nest_under)]
    if userns is not None:
        cmd += ["--userns", userns.arg]
    for f in cgroup.procs_files:
        cmd += ["--cgroup", f]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            env=HELPER_ENV)
    assert proc.stdout is not None and proc.stderr is not None
    line, = await _read_lines(proc.stdout, 1)
    if not line.isdigit():
        err = await _drain(proc)
        if userns is not None and "user namespace" in err:
            raise FailedPrecondition(
                f"sandbox {sandbox_id}: its user namespace could not be made ({err}): "
                "check the host's user.max_user_namespaces, or create it without "
                "user_namespace")
        raise Internal(f"sandbox {sandbox_id}: init did not start: {err or line!r}")
    init_pid = int(line)
    pidfd = os.pidfd_open(init_pid)
    return Runtime(sandbox_id, cgroup, proc, init_pid, pidfd, userns=userns)


async def build_generation(rt: Runtime, layer_id: str, lower: list[str], layer: Path,
                           mountpoint: Path, background: GuardedNursery,
                           pidfd: int | None = None) -> Generation:
    """Mount a fresh overlay of `layer` in a new mount namespace of the sandbox.

    Returns as soon as the namespace is ready and held; the helper's exit is awaited in
    `background`, off the critical path of a rollback."""
    pidfd = rt.pidfd if pidfd is None else pidfd
    cmd = [helper("dbx-mkroot"), "--pidfd", str(pidfd), "--lower", ":".join(lower),
           "--upper", str(layer / "upper"), "--work", str(layer / "work"),
           "--mountpoint", str(mountpoint)]
    fds = [pidfd]
    if rt.userns is not None:
        fds.append(userns_of(pidfd))
        cmd += ["--userns", str(fds[1]), "--root-id", str(rt.userns.base)]
    try:
        proc = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=tuple(fds), env=HELPER_ENV)
    finally:
        for fd in fds[1:]:
            os.close(fd)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        lines = await _read_lines(proc.stdout, 2)
        pids = [x for x in lines if x.isdigit()]
        if "ready" not in lines or not pids:
            err = await _drain(proc)
            if rt.userns is not None and "idmapped mounts" in err:
                raise FailedPrecondition(
                    f"sandbox {rt.sandbox_id}: {err}: put the image and the state dir on "
                    "filesystems that support idmapped mounts (btrfs, ext4, xfs, tmpfs), "
                    "or create it without user_namespace")
            raise Internal(f"sandbox {rt.sandbox_id}: building its file system failed: "
                           f"{err or lines!r}")
        pid = int(pids[0])
        mntfd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        rootfd = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except BaseException:
        with trio.CancelScope(shield=True):
            await _release_helper(proc)
        raise
    background.start_soon(_release_helper, proc)
    return Generation(layer_id, mntfd, rootfd, (str(layer / "upper"), *lower))


async def _release_helper(proc: trio.Process) -> None:
    """Close dbx-mkroot's stdin (its cue to exit) and reap it."""
    assert proc.stdin is not None
    await proc.stdin.aclose()
    with trio.move_on_after(5):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()
    await close_process(proc)


async def stop(rt: Runtime) -> None:
    """Kill every process of the sandbox and wait for its launcher. The exits are awaited
    here, not polled on the daemon's thread: a large address space takes milliseconds to
    tear down, and so does the mount namespace that closing the generation drops."""
    try:  # not the launcher: trio reaps it (its exit status is trio's to collect)
        await kill_all(rt.cgroup, keep={rt.launcher.pid})
    finally:
        if rt.launcher.returncode is None:
            try:
                rt.launcher.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        await close_process(rt.launcher)
        await trio.to_thread.run_sync(rt.close)


async def kill_all(cgroup: Cgroup, keep: set[int]) -> None:
    """SIGKILL every process of the cgroup but `keep` and await their exits through pidfds
    (a large address space takes milliseconds to tear down: not polled on the daemon's
    thread); any that slipped in meanwhile go through the frozen kill. Exits still awaited
    after KILL_CHECK_S may be held by a dead process we trace: it is reaped
    (reaper.reap_dead_tracees), and the wait goes on."""
    try:
        await reaper.wait_exited(cgroup.kill_now(keep=keep), timeout=KILL_CHECK_S, reap=False)
    except Internal:
        reaped = reaper.reap_dead_tracees()
        if reaped:  # e.g. carriers killed as a dump of their template was cut short
            log.info("cgroup %s: reaped dead processes we traced, which held its exits: %s",
                     cgroup.name, ", ".join(reaped))
        try:
            await reaper.wait_exited(cgroup.kill_now(keep=keep), reap=False,
                                     timeout=KILL_WAIT_S - KILL_CHECK_S)
        except Internal:
            raise Internal(f"cgroup {cgroup.name}: processes killed with SIGKILL had not "
                           f"exited after {KILL_WAIT_S:g} s: "
                           f"{reaper.describe(cgroup.pids() - keep)}") from None
    if cgroup.pids() - keep:
        cgroup.kill(keep=keep)


def own_group(pid: int) -> int | None:
    """The process group (host id) of `pid`, a command dbx-enter runs, if the command made
    it (None: gone, or not yet). dbx-enter's child calls setsid() first thing, but until
    then it is in dbx-enter's group, which is the daemon's, shared by every helper it
    spawned: killing that group in the sandbox's cgroup killed the dbx-enter of each of
    its sessions, and their shells with them (PDEATHSIG). An exec timed out that early in
    a loaded 32 x 1000 soak, and a session lost its variables (stop 79)."""
    group = kernfs.process_group(pid)
    return None if group is None or group == os.getpgrp() else group


async def kill_group(cgroup: Cgroup, group: int, keep: set[int]) -> None:
    """SIGKILL the cgroup's processes of process group `group` (host id) but `keep`, and
    await their exits, so what they held (a listening port) is free when this returns.
    Bounded: one that has not exited after KILL_WAIT_S is logged and left to the
    sandbox's own kill."""
    try:
        await reaper.wait_exited(cgroup.kill_now(keep=keep, group=group), reap=False,
                                 timeout=KILL_WAIT_S)
    except Internal as e:
        log.warning("cgroup %s: process group %d: %s", cgroup.name, group, e)


async def close_process(proc: trio.Process) -> None:
    """Reap a helper and close our ends of its pipes (each one an fd of the daemon)."""
    await proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            await stream.aclose()


async def _read_lines(stream: trio.abc.ReceiveStream, count: int,
                      limit: int = 4096) -> list[str]:
    """A helper's first `count` lines ("" for those it never wrote). The helpers write each
    line whole and we read nothing after them, so whole chunks: reading a byte at a time
    cost the daemon's thread 0.7 ms per boot (cProfile of fork(32))."""
    buf = b""
    while buf.count(b"\n") < count and len(buf) < limit:
        chunk = await stream.receive_some(limit)
        if not chunk:
            break
        buf += chunk
    lines = [x.strip() for x in buf.decode(errors="replace").split("\n")][:count]
    return lines + [""] * (count - len(lines))


async def _drain(proc: trio.Process) -> str:
    """Collect a failed helper's stderr (its one-line reason)."""
    err = b""
    if proc.stderr is not None:
        with trio.move_on_after(2):
            while chunk := await proc.stderr.receive_some(65536):
                err += chunk
    with trio.move_on_after(2):
        await proc.wait()
    return err.decode(errors="replace").strip()
