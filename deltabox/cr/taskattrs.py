"""A process's scheduling and resource attributes, which fork(2) copies from the parent
that forks: nice, scheduling policy and priority, I/O priority, oom_score_adj, timer
slack, core dump filter and resource limits (`ulimit`).

A process spawned from its own template (a fork of it at the checkpoint) has them all.
One restored from an image is another process's fork given the image's memory: an adopted
child is its restored parent's, a chain's ancestor is the chain's child's template's, a
template rebuilt from a dump is the sandbox init's (adoption.py, engine._chain,
daemon/dumps.py). Until stop 52 such a process silently had that other process's
attributes (probe: `nice -n 3` and `ulimit -n 77` of a child its shell waited for came back
as 0 and the shell's limit; the shell of a chain came back with its python's). So they are
read once from the template (the live process's values at the checkpoint instant: a fork
copies them and a template never runs; kept in its record, and so in its dump) and set on
each such process before it runs, from outside: every one of them has a call or a /proc
file that takes a pid.

Not here, because no call reads them from outside (each would be an injected prctl per
process): PR_SET_DUMPABLE, keep-capabilities and securebits, PR_SET_THP_DISABLE, KSM's
PR_SET_MEMORY_MERGE, the machine-check kill policy; PR_SET_CHILD_SUBREAPER, which fork does
not copy either (documented in engine.py); and CPU affinity, which a spawn pins for a moment
(fork_template.c colocate), so a read of the template's could catch that.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from dataclasses import dataclass

from .. import kernfs
from . import native

_SYS_IOPRIO_SET, _SYS_IOPRIO_GET = 251, 252   # x86_64
_IOPRIO_WHO_PROCESS = 1
_RLIMITS = range(16)   # RLIMIT_CPU (0) .. RLIMIT_RTTIME (15): RLIM_NLIMITS on Linux
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class TaskAttrs:
    nice: int
    policy: int                   # sched_getscheduler's, SCHED_RESET_ON_FORK included
    rt_priority: int
    ioprio: int                   # ioprio_get's (0: none set, the CPU's nice decides)
    oom_score_adj: int
    timerslack_ns: int
    coredump_filter: int
    rlimits: tuple[tuple[int, int], ...]   # (soft, hard) per RLIMIT_*, in order

    def to_json(self) -> dict:
        return {"nice": self.nice, "policy": self.policy, "rt_priority": self.rt_priority,
                "ioprio": self.ioprio,
                "oom_score_adj": self.oom_score_adj, "timerslack_ns": self.timerslack_ns,
                "coredump_filter": self.coredump_filter,
                "rlimits": [list(r) for r in self.rlimits]}

    @classmethod
    def from_json(cls, d: dict) -> TaskAttrs:
        return cls(d["nice"], d["policy"], d["rt_priority"], d["ioprio"],
                   d["oom_score_adj"], d["timerslack_ns"], d["coredump_filter"],
                   tuple((s, h) for s, h in d["rlimits"]))


def read(pid: int) -> TaskAttrs:
    """pid's attributes (~20 system calls and three /proc reads). Raises CRError (ESRCH:
    the process is gone)."""
    try:
        ioprio = _libc.syscall(_SYS_IOPRIO_GET, _IOPRIO_WHO_PROCESS, pid)
        if ioprio < 0:
            _raise_errno(f"ioprio_get of pid {pid}")
        return TaskAttrs(
            nice=os.getpriority(os.PRIO_PROCESS, pid),
            policy=os.sched_getscheduler(pid),
            rt_priority=os.sched_getparam(pid).sched_priority,
            ioprio=ioprio,
            oom_score_adj=int(kernfs.read(f"/proc/{pid}/oom_score_adj")),
            timerslack_ns=int(kernfs.read(f"/proc/{pid}/timerslack_ns")),
            coredump_filter=int(kernfs.read(f"/proc/{pid}/coredump_filter"), 16),
            rlimits=tuple(resource.prlimit(pid, r) for r in _RLIMITS))
    except OSError as e:
        raise native.CRError(e.errno or errno.EIO,
                             f"reading the attributes of pid {pid}: {e}") from None


def apply(pid: int, want: TaskAttrs) -> None:
    """Give pid (a restored process not yet running) the attributes it had, setting only
    those that differ from what it has. Raises CRError naming the attribute."""
    have = read(pid)
    step = ""
    try:
        for r, lim in zip(_RLIMITS, want.rlimits):
            if lim != have.rlimits[r]:
                step = f"prlimit {r} {lim}"
                resource.prlimit(pid, r, lim)
        if (want.policy, want.rt_priority) != (have.policy, have.rt_priority):
            step = f"sched_setscheduler {want.policy} {want.rt_priority}"
            os.sched_setscheduler(pid, want.policy, os.sched_param(want.rt_priority))
        if want.nice != have.nice:
            step = f"setpriority {want.nice}"
            os.setpriority(os.PRIO_PROCESS, pid, want.nice)
        if want.ioprio != have.ioprio:
            step = f"ioprio_set {want.ioprio:#x}"
            if _libc.syscall(_SYS_IOPRIO_SET, _IOPRIO_WHO_PROCESS, pid, want.ioprio) < 0:
                _raise_errno(step)
        for name, value, now in (("oom_score_adj", str(want.oom_score_adj), have.oom_score_adj),
                                 ("timerslack_ns", str(want.timerslack_ns), have.timerslack_ns),
                                 ("coredump_filter", f"{want.coredump_filter:#x}",
                                  have.coredump_filter)):
            if int(value, 0) != now:
                step = f"write {value} to /proc/{pid}/{name}"
                kernfs.write(f"/proc/{pid}/{name}", value.encode())
    except OSError as e:
        raise native.CRError(e.errno or errno.EIO,
                             f"restoring the attributes of pid {pid} ({step}): {e}") from None


def _raise_errno(what: str) -> None:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")
