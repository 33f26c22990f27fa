"""Processes that run as another user, or without capabilities: a database's server as
its own user (`su postgres -c ...`), nginx's workers, a tool run with `setpriv` or
`runuser`, a program that dropped root.

A restore makes every process by calls injected into a process of the daemon's: clone3
with the original pid (CAP_SYS_ADMIN over the sandbox's pid namespace), setns into the
restored tree (CAP_SYS_ADMIN), reopening its files whatever their mode, binding its ports.
A template is a fork of the process and has its credentials, so a child spawned from the
template of an unprivileged process could do none of it (until stop 57 such a process was
refused at the checkpoint). Instead, such a process comes back from a copy that is
root's, and its credentials are given back last, in every thread, before it runs
(native/creds.c):

- a child of a captured process of its own session is born of its restored parent
  (adoption.py: forced, whatever its size), from an image of its template; so is one
  leading a session of its own that a restore leads again whoever runs in it (alone in
  it, as each of PostgreSQL's backends; a pty's, as a tmux pane's shell; one whose
  members are all adopted: _again);
- any other leads its session (a server started with setsid, as `pg_ctl` starts
  PostgreSQL): its template is rebuilt once per checkpoint, once the processes run
  again, from an image of the fork (native.restore_template, forked from the sandbox's
  init, as a dump's are), and its child leads its session again at every restore, the
  others of the session born in it of their restored parents (as a terminal's session:
  engine.lone_leaders);
- one that leads no session and has no captured parent in its session (an orphan in
  another's session) is refused: it could only come back in init's session.

What is read (/proc/PID/status, the ids mapped into the process's own user namespace by
its uid_map and gid_map): real, effective, saved and filesystem uids and gids, the
supplementary groups, the inheritable, permitted, effective, bounding and ambient
capability sets. Every thread of a process must have the same (a thread that changed
its own with a raw syscall is refused). Not given back: the parent-death signal (as for
any restored process) and a zombie child's owner (it is made again by its root parent).
The rebuilt template holds a copy of the process's memory, not a copy-on-write share
of it: memory per template is the process's size.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import kernfs
from . import adoption, capture, native, ptys

if TYPE_CHECKING:
    from .capture import ProcessRecord

CAP_SYS_ADMIN = 21
MAX_GROUPS = native.MAX_GROUPS


@dataclass(frozen=True)
class Creds:
    """A process's credentials in its own user namespace."""

    uids: tuple[int, int, int, int]     # real, effective, saved, filesystem
    gids: tuple[int, int, int, int]
    groups: tuple[int, ...]
    caps: tuple[int, int, int, int, int]  # inheritable, permitted, effective, bounding, ambient

    def to_json(self) -> dict:
        return dict(uids=list(self.uids), gids=list(self.gids), groups=list(self.groups),
                    caps=list(self.caps))

    @classmethod
    def from_json(cls, d: dict) -> Creds:
        return cls(tuple(d["uids"]), tuple(d["gids"]), tuple(d["groups"]),  # type: ignore
                   tuple(d["caps"]))  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"uid {self.uids[1]}, gid {self.gids[1]}"


def give(tpl: native.Template, c: Creds) -> None:
    """Set c on tpl: its children get them back last (the owner thread's call)."""
    tpl.set_creds(c.uids, c.gids, c.groups, c.caps)


def unprivileged(cap_eff: int) -> bool:
    """Whether a process with these effective capabilities could not restore itself (see
    the module doc): its credentials are given back instead."""
    return cap_eff >= 0 and not cap_eff >> CAP_SYS_ADMIN & 1


class Unmapped(ValueError):
    """An id the process's user namespace does not map."""


def _id_map(pid: int, which: str) -> list[tuple[int, int, int]]:
    """(inside, outside, count) lines of /proc/PID/{uid,gid}_map, outside as we see it."""
    out = []
    for line in kernfs.read(f"/proc/{pid}/{which}_map").decode().splitlines():
        inside, outside, count = (int(x) for x in line.split())
        out.append((inside, outside, count))
    return out


def _inside(host_id: int, lines: list[tuple[int, int, int]], what: str) -> int:
    for inside, outside, count in lines:
        if outside <= host_id < outside + count:
            return inside + host_id - outside
    raise Unmapped(f"{what} {host_id} (as the host sees it) has no mapping in its user "
                   "namespace")


def _ids(status: bytes, name: bytes) -> list[int]:
    value = native.proc_field(status, name)
    return [int(x) for x in value.split()] if value is not None else []


def read(pid: int, status: bytes | None = None) -> Creds:
    """pid's credentials from its status (read now unless given); Unmapped if an id has
    no mapping in its user namespace."""
    status = status if status is not None else kernfs.read(f"/proc/{pid}/status")
    uid_map, gid_map = _id_map(pid, "uid"), _id_map(pid, "gid")
    uids = [_inside(u, uid_map, "uid") for u in _ids(status, b"Uid")]
    gids = [_inside(g, gid_map, "gid") for g in _ids(status, b"Gid")]
    groups = tuple(_inside(g, gid_map, "group") for g in _ids(status, b"Groups"))
    caps = tuple(int(native.proc_field(status, name) or b"0", 16)
                 for name in (b"CapInh", b"CapPrm", b"CapEff", b"CapBnd", b"CapAmb"))
    return Creds(tuple(uids), tuple(gids), groups, caps)  # type: ignore[arg-type]


_LINES = (b"Uid", b"Gid", b"Groups", b"CapInh", b"CapPrm", b"CapEff", b"CapBnd", b"CapAmb")


def _thread_lines(status: bytes) -> tuple[bytes | None, ...]:
    return tuple(native.proc_field(status, n) for n in _LINES)


def refusal(rec: ProcessRecord) -> str | None:
    """Why rec's credentials could not be given back, if so."""
    if rec.creds is None:
        return None
    if len(rec.creds.groups) > MAX_GROUPS:
        return (f"runs as {rec.creds.describe()} with {len(rec.creds.groups)} supplementary "
                f"groups: at most {MAX_GROUPS} are given back")
    if rec.threads > 1:
        try:
            tids = os.listdir(f"/proc/{rec.pid}/task")
            lines = {tid: _thread_lines(kernfs.read(f"/proc/{rec.pid}/task/{tid}/status"))
                     for tid in tids}
        except OSError as e:
            return f"its threads' credentials could not be read ({e})"
        if len(set(lines.values())) > 1:
            return ("its threads run with different credentials (one changed its own with a "
                    "raw system call): a restore gives every thread the same")
    return None


def _by_pid(records: Iterable[ProcessRecord]) -> dict[int, ProcessRecord]:
    return {r.pid: r for r in records}


def born_of_parent(rec: ProcessRecord, by_pid: dict[int, ProcessRecord],
                   again: set[int]) -> bool:
    """Whether rec is born of its restored parent: a captured process of its session, or
    any captured parent if rec leads a session its restore leads again whatever anyone's
    credentials (`again`: _again), as PostgreSQL's backends, each alone in a session of
    its own, or a tmux pane's shell."""
    parent = by_pid.get(rec.ppid)
    return parent is not None and (parent.sid == rec.sid or rec.sid in again
                                   and rec.pid == rec.sid)


def _again(records: list[ProcessRecord]) -> set[int]:
    """Sessions whose leader leads them again at a restore (engine.lone_leaders) whatever
    anyone's credentials: a lone process's, a pty's, one whose members are all adopted."""
    count: dict[int, int] = {}
    for r in records:
        count[r.sid] = count.get(r.sid, 0) + 1
    return ({sid for sid, n in count.items() if n == 1} | ptys.terminal_sessions(records)
            | adoption.adopted_sessions(records))


def rebuilt(records: list[ProcessRecord]) -> set[int]:
    """The unprivileged processes whose templates are rebuilt as root's (see the module
    doc): those not born of a restored parent."""
    if not _any(records):
        return set()
    by_pid, again = _by_pid(records), _again(records)
    return {r.pid for r in records
            if r.creds is not None and not born_of_parent(r, by_pid, again)}


def _any(records: list[ProcessRecord]) -> bool:
    """Whether any process has credentials to give back (else, as a rule, nothing here
    applies: every capture asks)."""
    return any(r.creds is not None for r in records)


def sessions(records: list[ProcessRecord]) -> set[int]:
    """The sessions (host ids) led by a process whose template is rebuilt: every other
    process of such a session is born in it of its restored parent."""
    by_pid = _by_pid(records)
    return {by_pid[p].sid for p in rebuilt(records) if by_pid[p].pid == by_pid[p].sid}


def forced(records: list[ProcessRecord]) -> set[int]:
    """Children adopted whatever their size (adoption.adoptees' `forced`): unprivileged
    ones born of their restored parent, and every other process of a rebuilt leader's
    session."""
    if not _any(records):
        return set()
    by_pid, again = _by_pid(records), _again(records)
    led = sessions(records)
    return {r.pid for r in records if born_of_parent(r, by_pid, again)
            and (r.creds is not None or (r.sid in led and r.pid != r.sid))}


def refusals(records: list[ProcessRecord]) -> list[capture.Refusal]:
    """Unprivileged processes that could not come back in their session, and the processes
    of a rebuilt leader's session that could not be born in it."""
    if not _any(records):
        return []
    by_pid, again = _by_pid(records), _again(records)
    out = []
    for pid in sorted(rebuilt(records)):
        r = by_pid[pid]
        if r.pid != r.sid:
            out.append(capture.Refusal(r.nspid, r.cmd, (
                f"runs as {r.creds.describe() if r.creds else '?'} without the capabilities "
                "a process needs to restore itself, and neither leads its session nor is "
                "the child of a captured process of its session: it would come back in "
                "init's session; start it with setsid, or from the sandbox's processes")))
    led = sessions(records)
    for r in records:
        if r.sid in led and r.pid != r.sid and not born_of_parent(r, by_pid, again):
            leader = by_pid[r.sid]
            out.append(capture.Refusal(r.nspid, r.cmd, (
                f"in the session of pid {leader.nspid} ({leader.cmd}), which runs as "
                f"{leader.creds.describe() if leader.creds else '?'} and comes back as its "
                "leader, but not the child of a captured process of that session: it "
                "could not be born in it again")))
    return out
