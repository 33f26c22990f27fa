"""Reaping orphans of sandbox processes.

A command's parent is dbx-enter, which lives outside the sandbox's pid namespace. When both
die (a rollback kills everything), the kernel hands the command's zombie to the nearest child
subreaper ancestor, or to the host's pid 1, which may never reap it; its pid then stays taken,
and restoring a process with that pid (clone3 set_tid) fails. So deltaboxd is a child
subreaper and reaps those zombies itself: only processes of sandbox pid namespaces (its own
helpers are awaited by trio) and only ones nobody traces.
"""

from __future__ import annotations

import ctypes
import glob
import os
import select
import signal
from collections.abc import Collection, Iterable

import trio

from ..errors import Internal

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def _children() -> set[int]:
    out: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            out.update(int(p) for p in open(path).read().split())
        except OSError:
            continue
    return out


def _any_zombie() -> bool:
    """Whether any child of ours (of any of our threads, traced ones included) is a zombie:
    one waitid that reaps nothing, where the scan reads a file per thread and per child
    (about 1 ms of the daemon's thread per sweep with a fork's 32 children live, py-spy)."""
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False


def _zombie(pid: int) -> bool:
    """From /proc/pid/stat (short; most children are not zombies: stopped templates)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"Z"


def _reapable(pid: int) -> bool:
    if not _zombie(pid):
        return False
    st = _status(pid)  # {} once reaped meanwhile: no tracer field, not reapable
    return st.get("TracerPid") == "0" and len(st.get("NSpid", "").split()) >= 2


def _status(pid: int) -> dict[str, str]:
    """/proc/pid/status as a dict (empty once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
    except OSError:
        return {}


def reap_orphans(skip: Collection[int] = ()) -> int:
    """Reap adopted zombies of sandbox processes; returns how many. skip: children known
    not to be orphans (process templates, reaped by their tracer); with many of them
    (each a child of ours once its original's parent died) this is the bulk of the work."""
    if not _any_zombie():
        return 0
    n = 0
    for pid in _children() - set(skip):
        if _reapable(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
                n += 1
            except ChildProcessError:
                pass
    return n


__WALL = 0x40000000  # wait for clone children and tracees alike (linux/wait.h)


def reap_dead_tracees() -> list[str]:
    """Reap every zombie that one of our threads traces (a process template that died
    outside the ptrace thread's own jobs, e.g. killed while a dump of it was cut short):
    only its tracer may reap it, and until then the init of its pid namespace, killed,
    cannot finish exiting (it waits for every process of the namespace). Returns what
    was reaped, as "pid (comm)"."""
    own = set(os.listdir("/proc/self/task"))
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or not _zombie(int(name)):
            continue
        st = _status(int(name))
        if st.get("TracerPid") not in own:
            continue
        try:
            if os.waitid(os.P_PID, int(name), os.WEXITED | os.WNOHANG | __WALL) is not None:
                out.append(f"{name} ({st.get('Name', '?')})")
        except ChildProcessError:
            pass
    return out


def describe(pids: Iterable[int]) -> str:
    """pid (comm, state, tracer) of each, for an error that names what would not exit."""
    parts = []
    for pid in sorted(pids):
        st = _status(pid)
        parts.append(f"{pid} ({st.get('Name', 'gone')}, {st.get('State', '-').split(' ')[0]}"
                     f", tracer {st.get('TracerPid', '-')})")
    return ", ".join(parts) or "none"


def kill_pidfds(pids: Iterable[int]) -> list[int]:
    """SIGKILL `pids` through pidfds and return those (for wait_exited, or a poll): a pidfd
    polls readable once its process has exited. Pids already gone are skipped."""
    fds = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        fds.append(fd)
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return fds


def _reap(pidfd: int) -> None:
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        pass  # not our child


def _exited(pidfd: int) -> bool:
    """Whether the process has exited (a pidfd polls readable then). poll, not select:
    the daemon's fds go past select's limit of 1024."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


async def wait_exited(pidfds: list[int], timeout: float = 5.0, reap: bool = True) -> None:
    """Wait until every process behind `pidfds` (killed by us) has exited, reap those that
    are our children (orphans adopted by the subreaper; `reap=False`: left to
    reap_orphans), close the pidfds (and empty the list). The sandbox's init reaps the
    rest; until it has, their pids are still taken (restores retry). Those exited already
    cost no trip through trio's scheduler."""
    try:
        with trio.move_on_after(timeout) as scope:
            for fd in pidfds:
                if not _exited(fd):
                    await trio.lowlevel.wait_readable(fd)
                if reap:
                    _reap(fd)
    finally:
        for fd in pidfds:
            os.close(fd)
        pidfds.clear()
    if scope.cancelled_caught:
        raise Internal(f"processes killed with SIGKILL had not exited after {timeout:g} s")
