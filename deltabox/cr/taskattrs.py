"""A process's scheduling, resource and prctl attributes, which fork(2) copies from the
parent that forks: nice, scheduling policy and priority, I/O priority, oom_score_adj,
timer slack, core dump filter, resource limits (`ulimit`), and prctl state only the
process itself can set (dumpable, securebits, THP refused, KSM merging, machine-check
policy, no_new_privs: native/prctls.c).

A process spawned from its own template (a fork of it at the checkpoint) has them all.
One restored from an image is another process's fork given the image's memory: an adopted
child is its restored parent's, a chain's ancestor is the chain's child's template's, a
template rebuilt from a dump is the sandbox init's (adoption.py, engine._chain,
daemon/dumps.py). Until stop 52 such a process silently had that other process's
attributes (probe: `nice -n 7` and `ulimit -n 444` of a shell's job came back as 0 and
20000; a python that cleared PR_SET_DUMPABLE and set PR_SET_THP_DISABLE came back with
neither). So they are read once from the template (the live process's values at the
checkpoint instant: a fork copies them and a template never runs; kept in its record, and
so in its dump) and given to each such process before it runs: from outside where a call
or a /proc file takes a pid, by injected prctl calls for the rest.

Not here: PR_SET_CHILD_SUBREAPER and PR_SET_PDEATHSIG, which fork does not copy, so no
template has them to read (native/prctls.c reads them from the original as its template is
made), and CPU affinity, which a spawn pins for a moment
(fork_template.c colocate), so a read of the template's could catch that.
"""

from __future__ import annotations

import ctypes
import dataclasses
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
    prctls: native.Prctls

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> TaskAttrs:
        return cls(d["nice"], d["policy"], d["rt_priority"], d["ioprio"],
                   d["oom_score_adj"], d["timerslack_ns"], d["coredump_filter"],
                   tuple((s, h) for s, h in d["rlimits"]), native.Prctls(**d["prctls"]))


def read(tpl: native.Template) -> TaskAttrs:
    """The template's origin's attributes at the checkpoint (~20 system calls, three /proc
    reads, six injected calls). On the template's owner thread (the ptrace worker).
    Raises CRError."""
    return TaskAttrs(**_outside(tpl.pid), prctls=tpl.prctls())


def give(target: native.Template | native.Held, want: TaskAttrs) -> None:
    """Give `target` (a restored process held before it runs, or a template rebuilt from
    a dump) the attributes `want`, setting only those it lacks. On its owner thread.
    Raises CRError naming the attribute."""
    _apply(target.pid, want)
    target.set_prctls(want.prctls)


def _outside(pid: int) -> dict:
    """pid's attributes that a call or a /proc file reads from outside, by field name."""
    try:
        ioprio = _libc.syscall(_SYS_IOPRIO_GET, _IOPRIO_WHO_PROCESS, pid)
        if ioprio < 0:
            _raise_errno(f"ioprio_get of pid {pid}")
        return dict(
            nice=os.getpriority(os.PRIO_PROCESS, pid),
            policy=os.sched_getscheduler(pid),
            rt_priority=os.sched_getparam(pid).sched_priority,
            ioprio=ioprio,
            oom_score_adj=int(kernfs.read(f"/proc/{pid}/oom_score_adj")),
            timerslack_ns=int(kernfs.read(f"/proc/{pid}/timerslack_ns")),
            coredump_filter=int(kernfs.read(f"/proc/{pid}/coredump_filter"), 16),
            rlimits=_rlimits(pid))
    except OSError as e:
        raise native.CRError(e.errno or errno.EIO,
                             f"reading the attributes of pid {pid}: {e}") from None


def _rlimits(pid: int) -> tuple[tuple[int, int], ...]:
    """pid's (soft, hard) limits in RLIMIT_* order. prlimit(2) of another user's process
    needs CAP_SYS_RESOURCE, which root may lack (a container's): /proc/PID/limits then,
    whose lines follow the same order."""
    try:
        return tuple(resource.prlimit(pid, r) for r in _RLIMITS)
    except PermissionError:
        pass
    lines = kernfs.read(f"/proc/{pid}/limits").decode().splitlines()[1:]
    out = []
    for line in lines[:len(_RLIMITS)]:
        soft, hard = line[26:47].split()[0], line[47:68].split()[0]
        out.append(tuple(resource.RLIM_INFINITY if v == "unlimited" else int(v)
                         for v in (soft, hard)))
    if len(out) != len(_RLIMITS):
        raise OSError(errno.EPROTO, f"/proc/{pid}/limits has {len(out)} limits")
    return tuple(out)  # type: ignore[return-value]


def _apply(pid: int, want: TaskAttrs) -> None:
    """Those _outside reads, set where pid's differ from `want`'s."""
    have = _outside(pid)
    step = ""
    try:
        for r, lim in zip(_RLIMITS, want.rlimits):
            if lim != have["rlimits"][r]:
                step = f"prlimit {r} {lim}"
                resource.prlimit(pid, r, lim)
        if (want.policy, want.rt_priority) != (have["policy"], have["rt_priority"]):
            step = f"sched_setscheduler {want.policy} {want.rt_priority}"
            os.sched_setscheduler(pid, want.policy, os.sched_param(want.rt_priority))
        if want.nice != have["nice"]:
            step = f"setpriority {want.nice}"
            os.setpriority(os.PRIO_PROCESS, pid, want.nice)
        if want.ioprio != have["ioprio"]:
            step = f"ioprio_set {want.ioprio:#x}"
            if _libc.syscall(_SYS_IOPRIO_SET, _IOPRIO_WHO_PROCESS, pid, want.ioprio) < 0:
                _raise_errno(step)
        for name, value in (("oom_score_adj", str(want.oom_score_adj)),
                            ("timerslack_ns", str(want.timerslack_ns)),
                            ("coredump_filter", f"{want.coredump_filter:#x}")):
            if int(value, 0) != have[name]:
                step = f"write {value} to /proc/{pid}/{name}"
                kernfs.write(f"/proc/{pid}/{name}", value.encode())
    except OSError as e:
        raise native.CRError(e.errno or errno.EIO,
                             f"restoring the attributes of pid {pid} ({step}): {e}") from None


def _raise_errno(what: str) -> None:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")
