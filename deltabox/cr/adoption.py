"""A restored process's children are its own children again.

A process spawned from its template is the template's sibling, a child of the process's
parent at the checkpoint, which a rollback kills: restored so, a shell's `sleep`, a
`subprocess.run` child or a shell's background job became a child of the sandbox's init,
and the restored parent's wait failed at once (ECHILD: Python's subprocess then reports
exit status 0; a shell loses its jobs). No call re-parents a process, and only a copy of
the child's memory can be born from its restored parent. So a restore spawns such a
parent *held* (stopped before it runs, native.Held), restores each such child from an
image of the child's template into a child of its own (Held.adopt: the image's memory
copied in, then re-rooted like any spawn, held in turn for its own children), and lets
them all run together: no parent runs before its children exist, and each can wait for
its own.

Which children (in their parent's session, or leading one of their own):
- those a captured parent was waiting for at the checkpoint (one of its threads stopped
  in a wait4/waitid this child would answer: a shell running a command, a shell loop's
  `sleep`, `subprocess.run`, a child watcher thread): without adoption that wait fails
  as soon as the parent runs, whatever the child's size;
- every other child of a program that is not a shell (since stop 53), whatever its size
  and whatever memory it shares with others (since stop 54: the shared objects, made
  again, are mapped over its image, whose restore skips their pages: criu_incr.c
  skip_remapped): a program that starts a child watches it, and acts on what it finds:
  Python's `Popen.poll()` takes ECHILD for an exit with status 0 (so a Jupyter server's
  restarter killed and restarted its kernel a few seconds after a rollback, its state
  lost), `node --watch` (libuv) never heard of its child's exit again and hung at its
  next reload ("Waiting for graceful termination..."), multiprocessing's workers (which
  share its semaphores) exited with no status for their pool, and the forkserver start
  method's server, which reaps them and tells the pool, never told it: `pool.join()`
  waited for ever;
- a shell's other children up to ADOPT_MAX_RSS_KB resident (same condition): its
  background jobs (`cmd &`, which the shell reaps when it ends and a later `wait` waits
  for), a small tool. Without adoption one comes back as a child of init: the shell's
  `wait` returns at once and its `jobs` say Running forever.
The copy costs its memory (about 0.5 ms per MB here, both CPUs copying, on top of the
mappings and the held spawn): a shell's job or a small tool costs a few ms, a 10 MB
python ~18 ms, 20 of them ~0.5 s, more than restarting them. A child forked without an
exec (a multiprocessing worker, a subshell) costs only the pages it or its parent wrote
since the fork: the adopted child is born a fork of its restored parent, and its
restore keeps the pages still one frame with its template's (criu_incr.c
r_keep_forked, since stop 54). So a shell's bigger children
that it does not wait for (a server or a worker started with `nohup prog &` from a
session) come back from their templates as before (fast, from carriers) as children of
init; the rollback's response names them (orphaned). A program's children are worth
their copy: what it does with them breaks without it. Not adoptable (`adoptable`): a child in
another session than its parent's that does not lead it (it could not be put back in that
session), and one running under other seccomp filters than its parent's (born from its
parent it would get the parent's: since stop 59); its parent waiting for it is refused at
the checkpoint (refusals).

The images: the checkpoint's durable process dump (daemon/dumps.py, written in the
background after every full checkpoint) once it is complete, else a live image of the
child's template (its pages indexed, not copied: a few ms), made once
per checkpoint and removed with it. Either way the pages are copied from the template's
memory (native/criu_incr.c: dbxcr_held_adopt's source).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from . import native
from .capture import ProcessRecord, Refusal, same_session

SYS_WAIT4, SYS_WAITID = 61, 247        # x86_64
# The biggest child adopted though its parent does not wait for it (see the module doc):
# 6 MB resident, a shell, a `sleep`, a small tool (a few ms to adopt); never a python
# interpreter (8 MB idle; a 10 MB one took ~18 ms: the copy, the mappings, the held
# spawn), so that whether one is adopted does not hang on a few pages.
ADOPT_MAX_RSS_KB = 6 * 1024
WNOHANG, P_PID = 1, 1
Calls = Sequence[tuple[int, Sequence[int]]]   # Template.syscalls(): per thread (nr, args)


def adoptees(records: Iterable[ProcessRecord],
             templates: Mapping[int, native.Template],
             forced: set[int] = frozenset()) -> dict[int, int]:
    """Captured child -> captured parent (host pids at the checkpoint) of the children a
    restore gives back to their restored parent (see the module doc); `forced`: children
    adopted whatever their size (a pty session's: born in the restored session only so,
    ptys.py)."""
    calls: dict[int, Calls] = {}   # each parent's, read once
    syscalls = template_syscalls(templates)
    out = {}
    for r, parent in _with_parents(records):
        if not adoptable(r, parent):
            continue
        if cheap(r) or r.pid in forced or not is_shell(parent):
            out[r.pid] = parent.pid
            continue
        if parent.pid not in calls:
            calls[parent.pid] = syscalls(parent.pid)
        if _waiting_for(calls[parent.pid], r):
            out[r.pid] = parent.pid
    return out


# Shells keep their jobs for `jobs`, `wait` and `fg`: their big ones are left to init (above).
SHELLS = frozenset({"bash", "sh", "dash", "zsh", "ksh", "mksh", "fish", "tcsh", "csh",
                    "busybox", "ash"})


def is_shell(rec: ProcessRecord) -> bool:
    """Whether rec runs a shell (its command's program name)."""
    prog = rec.cmd.split(" ", 1)[0].rsplit("/", 1)[-1].lstrip("-")
    return prog in SHELLS


def adopted_sessions(records: Iterable[ProcessRecord]) -> set[int]:
    """Sessions (host ids) with members whose leader is captured and whose every other
    process is adopted by the rules above whatever its parent waits for: a program's
    child (nginx's master and workers, gunicorn's, a database's), or a small child of a
    shell (a session's jobs), its parent in the session. Their templates can all leave
    the session, so the leader gets its pid back (engine.lone_leaders): a daemon's pid
    file stays right (`nginx -s reload` signalled a pid gone before stop 57), and a
    parent waiting for a leader it started (`subprocess.run(["setsid", ...])`) still has
    its child (before, the leader's new pid made that wait fail: the parent went on as if
    it had exited). A shell's big job is adopted only if waited for, so whether its
    session is born can change from one checkpoint to the next: one whose templates stay
    in the session keeps its id taken, and a rollback to another then gives the leader a
    new pid in a new session, and says so (tried at stop 38, reverted then)."""
    recs = list(records)
    by_pid = {r.pid: r for r in recs}
    members: dict[int, list[ProcessRecord]] = {}
    for r in recs:
        members.setdefault(r.sid, []).append(r)
    out = set()
    for sid, those in members.items():
        if sid in by_pid and len(those) > 1 and all(
                r.pid == sid or _born_in_session(r, by_pid) for r in those):
            out.add(sid)
    return out


def _born_in_session(r: ProcessRecord, by_pid: Mapping[int, ProcessRecord]) -> bool:
    parent = by_pid.get(r.ppid)
    return (parent is not None and parent.sid == r.sid and adoptable(r, parent)
            and (cheap(r) or not is_shell(parent)))


def adoptable(child: ProcessRecord, parent: ProcessRecord) -> bool:
    """Whether a restore can give `child` back to `parent` faithfully at all: born in its
    parent's session (it can stay there or lead its own), and running under its parent's
    seccomp filters. An adopted child is born a fork of its restored parent and so gets
    the parent's filters: a child that installed a filter of its own (a sandboxed worker:
    sshd's pre-auth child, a browser's renderer) would come back without it, silently
    (reading it with PTRACE_SECCOMP_GET_FILTER and installing it again in the newborn
    is not done). So it comes back from its template instead, its filters its own, as a
    child of init (the note names it). Compared by count (/proc status): a parent and a
    child that each added as many since the fork are not told apart."""
    return same_session(child, parent) and child.seccomp_filters == parent.seccomp_filters


def _not_adoptable(child: ProcessRecord, parent: ProcessRecord) -> str:
    """Why `adoptable` says no, for a note or a refusal."""
    if not same_session(child, parent):
        return "it is in another session than its parent's, which it does not lead"
    return (f"it runs under {child.seccomp_filters} seccomp filters, its parent under "
            f"{parent.seccomp_filters}, and a child given back to its parent gets the "
            "parent's")


def cheap(child: ProcessRecord) -> bool:
    """Adopted whether or not its parent waits for it: small, and sharing no memory."""
    return child.rss_kb <= ADOPT_MAX_RSS_KB and not child.shared


def orphaned(records: Iterable[ProcessRecord], family: Mapping[int, int],
             most: int = 3) -> list[str]:
    """The captured children of captured parents that a restore does not adopt, as the
    response names them (the first `most`, then how many more): each comes back as a
    child of init, and without its parent-death signal, which init's death would send."""
    out = []
    for r, parent in _with_parents(records):
        if r.pid in family:
            continue
        why = (_not_adoptable(r, parent) if not adoptable(r, parent) else
               "it maps memory shared with another process" if r.shared else
               f"its {r.rss_kb // 1024} MB are over the {ADOPT_MAX_RSS_KB // 1024} MB "
               "copied for a shell's child it does not wait for")
        lost = (f", without its parent-death signal ({_signame(r.pdeathsig)})"
                if r.pdeathsig else "")
        out.append(f"pid {r.nspid} ({r.cmd}) is now a child of init{lost}, not of pid "
                   f"{parent.nspid} ({why})")
    if len(out) > most:
        out[most:] = [f"and {len(out) - most} more children likewise"]
    return out


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:   # a real-time one but the first and last
        return f"signal {sig}"


def refusals(records: Iterable[ProcessRecord],
             syscalls: Callable[[int], Calls]) -> list[Refusal]:
    """A process with a thread waiting for a child that cannot be adopted: once restored
    the wait would fail (ECHILD) and the program would take a made-up exit status.
    `syscalls`: a captured pid's system calls at the checkpoint (its template's or its
    stop's)."""
    calls: dict[int, Calls] = {}   # each parent's, read once
    out = []
    for kid, parent in _with_parents(records):
        if adoptable(kid, parent):
            continue
        if parent.pid not in calls:
            calls[parent.pid] = syscalls(parent.pid)
        name = _waiting_for(calls[parent.pid], kid)
        if name is not None:
            out.append(Refusal(parent.nspid, parent.cmd, (
                f"waits for its child {kid.nspid} ({kid.cmd}) ({name}), which would not be "
                f"its child once restored ({_not_adoptable(kid, parent)}), so the wait "
                "would fail (ECHILD) and a made-up exit status would follow; checkpoint "
                "once the wait has returned, or with mode=\"fs\"")))
    return out


def _with_parents(records: Iterable[ProcessRecord]
                  ) -> Iterator[tuple[ProcessRecord, ProcessRecord]]:
    """Each captured process whose parent is captured too, with that parent."""
    recs = list(records)
    by_pid = {r.pid: r for r in recs}
    for r in recs:
        if (parent := by_pid.get(r.ppid)) is not None:
            yield r, parent


def template_syscalls(templates: Mapping[int, native.Template]) -> Callable[[int], Calls]:
    """A captured pid's system calls at the checkpoint, from its template (none once
    released)."""
    def syscalls(pid: int) -> Calls:
        tpl = templates.get(pid)
        return tpl.syscalls() if tpl is not None and not tpl.released else []
    return syscalls


def _waiting_for(calls: Calls, child: ProcessRecord) -> str | None:
    """The wait call (wait4 / waitid, without WNOHANG) one of the parent's threads was
    stopped in that `child` would answer (a pid or any child: a group is taken as any)."""
    for i, (nr, args) in enumerate(calls):
        where = "" if i == 0 else f" in its thread {i}"
        if nr == SYS_WAIT4 and not args[2] & WNOHANG:
            pid = _i32(args[0])
            if pid <= 0 or pid == child.nspid:
                return "wait4" + where
        elif nr == SYS_WAITID and not args[3] & WNOHANG:
            if args[0] != P_PID or _i32(args[1]) == child.nspid:
                return "waitid" + where
    return None


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def group(rec: ProcessRecord, parent: ProcessRecord, pgid: int,
          ns_pids: dict[int, int]) -> int:
    """The process group an adoptee joins, from `pgid`, what a spawn from its template
    would have been given (0: stay in the template's group). Born in its parent's group
    and session, it stays there if that was its group, leads a session or a group of its
    own if it did, else joins its group by the leader's pid in the target (`ns_pids`: host
    pid at the checkpoint -> pid there), or leads one of its own when that leader is not
    restored (as join_group does when its group is gone)."""
    if pgid == native.NEW_SESSION:
        return pgid
    if rec.pgid == parent.pgid:
        return 0
    if pgid > 0:
        return pgid
    if rec.pgid == rec.pid:
        return -1
    return ns_pids.get(rec.pgid, -1)


class Images:
    """The images of one checkpoint's adopted children: host pid at the checkpoint ->
    image directory. Made on demand (make) into a directory of their own under `base`,
    removed by close(); or given (a checkpoint rebuilt from its dump: kept)."""

    def __init__(self, base: str | None = None, given: dict[int, str] | None = None) -> None:
        self.base = base
        self.dirs: dict[int, str] = dict(given or {})
        self.own: str | None = None     # our directory of images, if we made any

    def give(self, dirs: Mapping[int, str]) -> None:
        """Images written elsewhere (the checkpoint's durable dump) for the processes that
        have none yet: used as they are, never removed here."""
        for pid, path in dirs.items():
            self.dirs.setdefault(pid, path)

    def make(self, rec: ProcessRecord, tpl: native.Template, files_as_of_ns: int = 0) -> str:
        """rec's image, made once: a live one (its pages indexed, left in the template,
        which the adoption copies them from). On the template's owner thread. The
        sandbox's seccomp filter is the one the adopting parent has. files_as_of_ns:
        ProcessState.captured_ns (native.dump)."""
        path = self.dirs.get(rec.pid)
        if path is not None:
            return path
        if self.own is None:
            if self.base is not None:
                os.makedirs(self.base, exist_ok=True)
            self.own = tempfile.mkdtemp(prefix="images-", dir=self.base)
        path = os.path.join(self.own, str(rec.pid))
        native.dump(tpl, path, seccomp_ok=True, live=True, files_as_of_ns=files_as_of_ns)
        self.dirs[rec.pid] = path
        return path

    def drop(self, pid: int) -> None:
        """Forget pid's image, removed if it is ours (its template was replaced)."""
        path = self.dirs.pop(pid, None)
        if path is not None and self.own is not None and path.startswith(self.own + os.sep):
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self.own is not None:
            shutil.rmtree(self.own, ignore_errors=True)
            self.own = None
        self.dirs.clear()
