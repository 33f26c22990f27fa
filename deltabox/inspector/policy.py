"""Checkpoint policy: from one turn's effects to skipped / fs / full. Pure and conservative:
whatever is not seen means `full`; a turn is `skipped` only when the inspector saw all of
it and none of it changed state a checkpoint holds.

- skipped: nothing recovery-relevant changed: the checkpoint can alias its parent.
- fs:      only files changed: snapshot the files, reuse the parent's process templates.
- full:    process state (may have) changed: capture processes too.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .effects import TurnEffects

Kind = Literal["skipped", "fs", "full"]
_MAX_REASONS = 12


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: Kind
    reasons: list[str] = Field(default_factory=list)


def _proc(pid: int, comm: str) -> str:
    return f"{pid} ({comm})" if comm else str(pid)


SIGCHLD = 17


def process_changes(e: TurnEffects, *, processes_alive: bool = True,
                    quiet: Collection[int] = ()) -> list[str]:
    """Why the turn changed process state ([] if it did not). With `processes_alive`
    False (no process of the sandbox's own is running at the turn's end), what processes
    did while they lived no longer matters, only that the set of processes changed.
    `quiet`: processes whose running is known not to have changed their state (the
    daemon's session shells whose state digest is unchanged, see daemon/turns.py): that
    they ran, grew their heap or reaped children (SIGCHLD) does not count."""
    out: list[str] = []
    for p in e.processes_exited:
        if p.long_lived:
            out.append(f"{'thread' if p.thread else 'process'} {_proc(p.pid, p.comm)} "
                       f"exited (it was running when the turn began)")
    if e.processes_new_alive:
        out.append("processes started in the turn are still running: " +
                   ", ".join(map(str, e.processes_new_alive[:10])))
    if processes_alive:
        for p in e.processes_ran:
            if p.pid in quiet:
                continue
            out.append(f"process {_proc(p.pid, p.comm)} ran ({p.how})")
        for a in e.address_space_changed:
            if a.pid in quiet:
                continue
            out.append(f"process {_proc(a.pid, a.comm)} changed its address space "
                       f"({', '.join(a.syscalls)})")
        for s in e.processes_signalled:
            if s.pid in quiet and s.signal == SIGCHLD:
                continue
            if s.long_lived:
                out.append(f"process {s.pid} was {s.how} signal {s.signal}")
    for s in e.sockets:
        if s.op in ("connect", "sendto"):
            where = f" {s.address}" if s.address else ""
            where += f":{s.port}" if s.port is not None else ""
            out.append(f"socket {s.op} ({s.family}{where}) by {_proc(s.pid, s.comm)}: a "
                       f"peer in the sandbox may hold the connection or data")
        elif s.long_lived and processes_alive:
            out.append(f"socket {s.op} by long-lived process {_proc(s.pid, s.comm)}")
    out.extend(e.other_effects)
    return out


def touched_processes(e: TurnEffects) -> set[int]:
    """Processes (host pids) the turn did something to or that did something in it: ran,
    were signalled, changed their address space, used a socket, exec-ed, forked, exited."""
    return ({p.pid for p in e.processes_ran} | {a.pid for a in e.address_space_changed}
            | {s.pid for s in e.processes_signalled} | {s.pid for s in e.sockets}
            | {p.pid for p in e.processes_execed} | {p.parent_pid for p in e.processes_forked}
            | {p.pid for p in e.processes_exited})


def untouched_processes(e: TurnEffects) -> set[int]:
    """Processes (host pids) that lived through the whole turn untouched: exactly as they
    were when it began, so a checkpoint may keep the templates it had of them. Stricter
    than process_changes: running counts even for a quiet session shell. Empty whenever the
    inspector did not see the turn whole, or something happened that no single process
    answers for (ptrace, process_vm_writev, IPC, a mount, ...: other_effects)."""
    if (e.lost_events or e.late_events or not e.complete or e.outside_entries
            or e.other_effects or e.processes_truncated):
        return set()
    return set(e.long_lived) - touched_processes(e)


def decide(effects: TurnEffects | None, *, parent_kind: str | None,
           processes_alive: bool, transient_is_change: bool = False,
           quiet: Collection[int] = ()) -> Decision:
    """`parent_kind`: the kind of the checkpoint this one would build on (None: there is
    none, this is the sandbox's first). `processes_alive`: does the sandbox have processes
    of its own (other than its init) at the turn's end. `transient_is_change`: count files
    created and removed within the turn (their parent directories' times changed) as a file
    change; by default such a turn can be skipped. `quiet`: see process_changes."""
    if effects is None:
        return Decision(kind="full", reasons=["inspector unavailable"])
    unseen: list[str] = []
    if effects.lost_events:
        unseen.append(f"{effects.lost_events} inspector events lost (ring buffer full)")
    if effects.late_events:
        unseen.append(f"{effects.late_events} events arrived after their turn had ended")
    if not effects.complete:
        unseen.extend(effects.incomplete_reasons or ["the inspector did not see everything"])
    if effects.outside_entries:
        unseen.append("processes entered the sandbox from outside: " +
                      ", ".join(map(str, effects.outside_entries[:10])))
    if unseen:
        return Decision(kind="full", reasons=unseen[:_MAX_REASONS])
    if parent_kind is None:
        return Decision(kind="full", reasons=["first checkpoint (no parent to build on)"])
    procs = process_changes(effects, processes_alive=processes_alive, quiet=quiet)
    if procs:
        return Decision(kind="full", reasons=procs[:_MAX_REASONS])
    files = []
    for label, lst in (("written", effects.files_written), ("created", effects.files_created),
                       ("deleted", effects.files_deleted), ("renamed", effects.files_renamed),
                       ("chmod", effects.files_chmodded), ("truncated", effects.files_truncated),
                       ("attributes changed", effects.files_attrs_changed)):
        if lst:
            more = f" (+{len(lst) - 3} more)" if len(lst) > 3 else ""
            files.append(f"files {label}: {', '.join(lst[:3])}{more}")
    if effects.files_transient and transient_is_change:
        files.append(f"transient files: {', '.join(effects.files_transient[:3])}")
    if files:
        return Decision(kind="fs", reasons=files)
    if effects.files_transient:
        return Decision(kind="skipped", reasons=[
            "only transient files (created and removed within the turn): " +
            ", ".join(effects.files_transient[:3])])
    return Decision(kind="skipped", reasons=["nothing recovery-relevant changed"])
