"""DeltaCR: capture a sandbox's processes at a checkpoint, and bring them back on rollback.

Capture (the checkpoint instant): with the sandbox's cgroup frozen, every process is
PTRACE_SEIZEd and interrupted; the thaw lets each fall straight into its ptrace stop before it
runs a single instruction. Now nothing moves: the file layer is snapshotted, each process is
forked into a stopped *template* (copy-on-write: costs page tables, not memory), unread data
of pipes is copied aside with tee(2), and the processes resume.

Restore (rollback): the live processes are killed; each template forks a child that joins the
new mount namespace, takes the original pid in the sandbox's pid namespace (clone3 set_tid),
its cwd, its regular files reopened at their offsets (no file description shared with the
template) and fresh pipes, so pipes between restored processes work and the daemon's ends
(session shells, drained output) are reconnected.

Ahead of a rollback (prespawn, driven by daemon/warm.py) that child is made in advance as a
stopped *carrier*, re-rooted into the generation the rollback will use; the rollback clones
the process out of it with CLONE_VM (no page tables to copy) and the pid it needs, once the
killed original has released that pid. The carrier stays as the process's *keeper*: while
it holds the address space, killing the process does not tear it down, so the next
rollback's pid is free at once; the keeper is killed afterwards (kill_carriers), off the
rollback's path.

What is preserved: memory, registers, threads, signal state, process group and session, cwd,
files and offsets, pipes (with unread data), ptys and controlling terminals (ptys.py),
locked memory (mlock: locked again in every copy, which fork would not), memory
protection keys (x86 PKU: a fork keeps them; a process restored from an image gets its
keys and each private mapping's key back, native criu_incr.c r_pkeys), and
the pid of every process that did not lead its session. A group leader's pid too: the kernel keeps a pid number allocated while any
process uses it as a group id, and a template is such a process, so the templates of a
group whose leader is captured leave it after the capture (_own_groups), and the children
rejoin it at the rollback. Not preserved:
- the pid of a session leader with a process in its session that is not born in it of
  a restored parent (lone_leaders: a pty's session, an unprivileged leader's, one whose
  members are all adopted keep theirs): its templates stay in its session (no call
  joins an existing session), so it comes back with a new pid (its group and session
  ids, and its own idea of `$$`, unchanged); the same for any process whose pid is, by
  the rollback, another template's session or group id (the response's note names
  those pids);
- the *parent* of a child bigger than adoption.ADOPT_MAX_RSS_KB that its parent was not
  waiting for: it is the parent its template had, the sandbox's init once the original
  parent died in the rollback (the response's note names it). Every other child of a
  captured parent is adopted by its restored parent (adoption.py): restored held, its
  memory copied in from its template;
- what a fork resets and no call sets back: the CPU time a process used (times(2),
  CLOCK_PROCESS_CPUTIME_ID start again from zero), memory marked MADV_WIPEONFORK (a
  random generator's state: zero-filled, so it reseeds), the parent-death signal of a
  process not born of its restored parent (PR_SET_PDEATHSIG: its parent is init; the
  others and every child subreaper's flag get theirs back, native/prctls.c), mlockall's
  MCL_FUTURE, the protection key of a shared mapping made again (the default key).
A process restored from an image (adopted, a chain's, rebuilt from a dump) is another
process's fork: its nice, priorities, rlimits and prctl state are set back from its
template's (taskattrs.py). One that ran as another user or without capabilities comes
back from a copy of root's and gets its credentials back last (creds.py).

Restoring into a fork (`Elsewhere`): the fork's pid namespace is nested below the templates'
sandbox's, so a template can give birth there (setns into it around clone3); the child joins
the fork's other namespaces and cgroups. Every pid is free there, leaders' too; process
groups are re-made in the fork (setpgid), since the templates' groups belong to the source.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import math
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from .. import kernfs
from ..background import run_all
from ..errors import FailedPrecondition, Internal
from ..fs.files import open_in_root
from . import (adoption, creds, deleted_cwd, eventloop, fifos, listeners, native, pidfds, pipebuf,
               posix_mq, private_maps, ptys, shared_files, shm_files, sigio, sockopts,
               sysv_msg, sysv_sem, sysv_shm, taskattrs, tcp, unix_listeners, unlinked,
               watches)
from ..sandbox.reaper import kill_pidfds, reap_orphans, wait_exited
from .taskattrs import TaskAttrs
from .capture import (DEV_TTY, ProcessRecord, Refusal, SharedMapping, Unsettled, add_listeners,
                      in_writable_layer, private_in_writable_layer, record, record_head,
                      refusals, shared_lock_refusals, status_refused)
from .worker import PtraceWorker

T = TypeVar("T")

log = logging.getLogger("deltaboxd")
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
# A child adopted by its restored parent is copied from its template's memory; when it is
# bigger than the family's root (a shell's 3 MB against a server it started with `cd dir
# && server &`), the root's image is copied instead and the child is its template's
# copy-on-write copy (_chains): as many images either way, and the child's memory stays
# shared with its templates (an adopted copy is private: every later template of it then
# holds all of its pages). From this many KB more than the root: the chain's execs, and
# the root's fidelity, which falls to an adoptee's (what an image holds).
CHAIN_MIN_GAIN_KB = 4 << 10
# Fork lanes (see DeltaCR.open_lanes): for a fan-out of at least this many children, each
# process of at least this size gets a second template on a second tracer thread.
LANE_MIN_CHILDREN = 4
LANE_MIN_RSS_KB = 16 << 10
PRIVATE_KNOWN_MAX = 50_000   # mapped files remembered (DeltaCR.private_known)


@dataclass
class PipeEnd:
    pid: int            # host pid of the process holding it
    fd: int
    write: bool
    flags: int = 0      # its open(2) flags at the checkpoint (O_NONBLOCK, O_CLOEXEC)


@dataclass
class PipeGroup:
    inode: int
    ends: list[PipeEnd] = field(default_factory=list)
    saved: int | None = None        # read end of a tee'd copy of unread data
    owner: str = ""                 # "session:<name>:<0|1|2>" | "daemon" | "" (nobody else)
    size: int = pipebuf.PIPE_DEFAULT_SIZE   # capacity (F_GETPIPE_SZ) of a pipe among processes


@dataclass
class Held:
    """A `later` capture's processes, still in their ptrace stops (DeltaCR.capture), and
    the templates to share rather than make for those that had not run (its `reuse`)."""

    stopped: list[native.Stopped]
    reuse: dict[int, native.Template]


@dataclass
class ProcessState:
    """What a checkpoint holds for DeltaCR (in memory: templates are processes)."""

    records: list[ProcessRecord]
    templates: dict[int, native.Template]          # host pid at checkpoint -> template
    pipes: dict[int, PipeGroup]
    sessions: dict[str, int]                         # session name -> host pid of its shell
    # session name -> digest of its shell's state at the capture (daemon/turns.py)
    session_states: dict[str, str | None] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)   # daemon/budget.py
    # Set when the templates were rebuilt from this checkpoint's dump (daemon/dumps.py):
    # they are init's children, in init's process group and session, so they restore
    # like a fork (process groups re-made with setpgid), never keeping their group.
    from_dump: str | None = None
    # host pid at checkpoint -> a copy of its template traced by the lane thread, while a
    # fan-out fork uses it (DeltaCR.open_lanes)
    lanes: dict[int, native.Template] = field(default_factory=dict)
    # host pids (at the checkpoint) whose template is shared with the checkpoint before
    # (they had not run since it was made: DeltaCR.capture's `reuse`)
    reused: list[int] = field(default_factory=list)
    # deleted-but-open files, their content copied at the checkpoint (cr/unlinked.py)
    unlinked: list[unlinked.UnlinkedFile] = field(default_factory=list)
    # open file descriptions of named files that several descriptors share
    # (cr/shared_files.py)
    shared_files: list[shared_files.SharedFile] = field(default_factory=list)
    # the /dev/shm files the processes hold, copied at the checkpoint (cr/shm_files.py)
    shm_files: list[shm_files.ShmFile] = field(default_factory=list)
    # the named pipes the processes hold, their unread bytes copied (cr/fifos.py)
    fifos: list[fifos.Fifo] = field(default_factory=list)
    # the pseudo-terminals they hold, with whose controlling terminal each is (cr/ptys.py)
    ptys: list[ptys.Pty] = field(default_factory=list)
    # the System V shared memory segments of the sandbox's IPC namespace (cr/sysv_shm.py)
    sysv_shm: list[sysv_shm.Segment] = field(default_factory=list)
    # ...and its System V message queues, with their messages (cr/sysv_msg.py)
    sysv_msg: list[sysv_msg.Queue] = field(default_factory=list)
    # ...and its semaphore sets, with their values (cr/sysv_sem.py)
    sysv_sem: list[sysv_sem.Set] = field(default_factory=list)
    # ...and its POSIX message queues, with their messages (cr/posix_mq.py)
    posix_mq: list[posix_mq.Queue] = field(default_factory=list)
    # When the templates' view of the files they map was the checkpoint's (the capture's
    # start, or a dump's rebuild): a file written after it is mapped again (private_maps.py)
    captured_ns: int = 0
    # images of the processes a restore adopts (cr/adoption.py), made at the first one
    images: adoption.Images | None = None
    # The processes, still in their stops after a capture that left the templates and
    # the files for later (DeltaCR.capture's `later`): DeltaCR.resume lets them go.
    held: Held | None = None

    @property
    def template_pids(self) -> set[int]:
        return {t.pid for t in [*self.templates.values(), *self.lanes.values()]
                if not t.released}

    @property
    def holds_tcp(self) -> bool:
        """Whether its processes hold TCP connections (cr/tcp.py)."""
        return any(_connected(r) for r in self.records)

    @functools.cached_property
    def lone(self) -> set[int]:
        """lone_leaders of its records (fixed once captured)."""
        return lone_leaders(self.records)

    @functools.cached_property
    def family(self) -> dict[int, int]:
        """adoption.adoptees of its records: child -> parent, restored as such (fixed
        once captured: the templates hold the stops' registers)."""
        return adoption.adoptees(self.records, self.templates,
                                 forced=born_members(self.records) |
                                 pidfds.children(self.records) | creds.forced(self.records))

    @functools.cached_property
    def adopters(self) -> set[int]:
        """The parents in `family`, and those of zombies (ProcessRecord.zombies): restored
        held until their children exist."""
        return set(self.family.values()) | {r.pid for r in self.records if r.zombies}

    @functools.cached_property
    def orphans(self) -> str:
        """What a restore's response says of the children it does not adopt ("": none)."""
        return "; ".join(adoption.orphaned(self.records, self.family))


@dataclass
class Restored:
    pids: dict[int, int]                 # nspid -> new host pid
    session_fds: dict[str, tuple[int, int, int, int]]   # name -> (pid, stdin_w, out_r, err_r)
    daemon_fds: list[tuple[int, bool]]   # our ends: (fd, is_read_end) to drain or hold
    # name -> the master of the session's terminal (a session on a pty: sandbox/session.py)
    session_ttys: dict[str, int] = field(default_factory=dict)
    # pids (in the sandbox) that were still allocated, as another template's process group
    # or session id, so their processes came back with new pids
    renumbered: list[int] = field(default_factory=list)
    # host pid of a process born from a carrier -> its keeper (native.Carrier): kill the
    # process first, then the keeper
    keepers: dict[int, native.Carrier] = field(default_factory=dict)
    note: str = ""   # what came back otherwise than it was (System V segments removed)


# Restored processes (host pids) -> the calls they were stopped in (stopped_calls).
Resumed = dict[int, frozenset[int]]
# A rollback's way to free a pid a process that will not exit holds (restore's free_pid).
FreePid = Callable[[int], Awaitable[bool]]


def stopped_calls(state: ProcessState, restored: Restored) -> Resumed:
    """The restored processes (host pids) and the system calls their threads were stopped
    in at the checkpoint (-1: none, or unknown): each re-enters its call when let go, which
    the inspector must not take for running (Turns.watch)."""
    out = {}
    for rec in state.records:
        host = restored.pids.get(rec.nspid)
        if host is None:
            continue
        tpl = state.templates.get(rec.pid)
        calls = [nr for nr, _ in tpl.syscalls()] if tpl is not None and not tpl.released \
            else [-1]
        out[host] = frozenset(calls or [-1])
    return out


def highest_pid(state: ProcessState, restored: Restored) -> int:
    """The highest pid a restore gave back in its pid namespace: a process's, one of its
    threads' (their tids are kept too) or an exited child's it had not waited for."""
    top = 0
    for rec in state.records:
        top = max(top, rec.nspid, *(z[0] for z in rec.zombies))
        host = restored.pids.get(rec.nspid)
        if rec.threads > 1 and host is not None:
            top = max(top, _highest_tid(host))
    return top


def _highest_tid(host_pid: int) -> int:
    """The highest thread id of a process in its own pid namespace (0 if it is gone)."""
    top = 0
    try:
        tids = os.listdir(f"/proc/{host_pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{host_pid}/task/{tid}/status") as f:
                ns = next(line for line in f if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        top = max(top, int(ns.split()[-1]))
    return top


@dataclass
class Prespawned:
    """Carriers of a checkpoint's processes spawned ahead of a rollback into the generation
    it will use (DeltaCR.prespawn): stopped, traced by the ptrace thread, in the sandbox's
    cgroup (keep them out of kills and captures), with the restore's pipes."""
    state: ProcessState
    plan: _PipePlan
    carriers: dict[int, native.Carrier]  # record pid (host pid at the checkpoint) -> carrier
    spawned: set[int] = field(default_factory=set)   # every carrier's pid
    # record pid -> the files its carrier maps again privately (written in place since the
    # checkpoint when it was made: private_maps.py)
    remapped: dict[int, set[str]] = field(default_factory=dict)
    discarded: bool = False   # DeltaCR.discard ran (it may be asked twice)

    def stale(self, rec: ProcessRecord, changed: list[SharedMapping]) -> bool:
        """Whether rec's carrier maps a file written in place since it was made."""
        return bool({m.path for m in changed} - self.remapped.get(rec.pid, set()))


class DeltaCR:
    def __init__(self, worker: PtraceWorker, lane_worker: PtraceWorker | None = None,
                 images_dir: str | None = None) -> None:
        self.worker = worker
        self.images_dir = images_dir   # where adopted children's images go (adoption.py)
        # which maps lines of which process map a file of the writable layer
        # (capture.private_in_writable_layer)
        self.private_known: dict[tuple[str, str, int], bool] = {}
        self.lane_worker = lane_worker
        self._lane_users = 0   # fan-outs holding lanes (the threads are pinned meanwhile)
        self._masks: tuple[set[int], set[int]] | None = None
        self.watch_paths = watches.Paths()   # inotify watches' paths found so far

    # ---- fork lanes --------------------------------------------------------------------
    # A template forks one child at a time, copying its page tables in its own context on
    # one CPU (5 ms per 200 MB here): a fan-out to many sandboxes is a chain of those. A
    # copy of the template, traced by a second thread (ptrace binds a tracee to a thread),
    # lets two chains run on two CPUs; each spawn goes to the less busy thread.

    async def open_lanes(self, state: ProcessState, children: int) -> None:
        """Copies of state's large templates for a fork into `children` sandboxes (none
        for a small fan-out: a copy costs one fork). Best effort: without them a fork
        just spawns every child from the one template. Not cancellable (a copy made is a
        process to release); close_lanes undoes it."""
        if self.lane_worker is None or children < LANE_MIN_CHILDREN:
            return
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return
        with trio.CancelScope(shield=True):
            await self._copy_templates(state)
            if state.lanes:
                await self._pin_lanes(cpus)
                log.info("fork into %d sandboxes: a second lane for pid(s) %s (template "
                         "copies on the lane thread)", children,
                         ", ".join(str(p) for p in state.lanes))

    async def _copy_templates(self, state: ProcessState) -> None:
        assert self.lane_worker is not None
        for rec in state.records:
            tpl = state.templates.get(rec.pid)
            if (rec.rss_kb < LANE_MIN_RSS_KB or tpl is None or tpl.released
                    or rec.pid in state.lanes):
                continue
            try:
                copy = await self.worker.run(tpl.copy)
            except native.CRError as e:
                log.warning("no fork lane for pid %d: copying its template failed: %s",
                            rec.pid, e)
                continue
            try:
                await self.lane_worker.run(copy.adopt)
            except native.CRError as e:
                log.warning("no fork lane for pid %d: adopting its copy failed: %s",
                            rec.pid, e)
                await self.lane_worker.run(_release_all, [copy])
                continue
            state.lanes[rec.pid] = copy

    async def close_lanes(self, state: ProcessState) -> None:
        await self.release_lanes(self.detach_lanes(state))

    @staticmethod
    def detach_lanes(state: ProcessState) -> list[native.Template]:
        """Take the lane copies off state once the fork that used them is over
        (release_lanes ends them): the next fan-out makes its own."""
        copies, state.lanes = list(state.lanes.values()), {}
        return copies

    async def release_lanes(self, copies: list[native.Template]) -> None:
        """Release detached lane copies and unpin the tracer threads. A fork does this in
        the background: a copy of a 200 MB process takes ~10 ms to exit (its page tables),
        which the fork's answer waited for."""
        if copies and self.lane_worker is not None:
            await self.lane_worker.run(_release_all, copies)
            await self._unpin_lanes()

    async def _pin_lanes(self, cpus: list[int]) -> None:
        """While fan-outs use lanes: each tracer thread on a CPU of its own. A spawn runs
        its template's fork on its tracer's CPU (see colocate in fork_template.c); left to
        the scheduler, both threads were often on one CPU and the chains ran one after the
        other (fork(32): 0.80x with the pin, 0.94x without, against no lanes)."""
        assert self.lane_worker is not None
        self._lane_users += 1
        if self._lane_users > 1:
            return
        try:
            self._masks = (await self.worker.run(os.sched_getaffinity, 0),
                           await self.lane_worker.run(os.sched_getaffinity, 0))
            await self.worker.run(os.sched_setaffinity, 0, {cpus[0]})
            await self.lane_worker.run(os.sched_setaffinity, 0, {cpus[1]})
        except OSError as e:  # e.g. a cpuset changed meanwhile: the lanes just share CPUs
            log.warning("fork lanes: pinning the tracer threads failed: %s", e)

    async def _unpin_lanes(self) -> None:
        assert self.lane_worker is not None
        self._lane_users -= 1
        if self._lane_users > 0 or self._masks is None:
            return
        main, lane = self._masks
        self._masks = None
        try:
            await self.worker.run(os.sched_setaffinity, 0, main)
            await self.lane_worker.run(os.sched_setaffinity, 0, lane)
        except OSError as e:
            log.warning("fork lanes: unpinning the tracer threads failed: %s", e)

    def _spawner(self, sp: _Spawn) -> tuple[PtraceWorker, native.Template]:
        """The thread and template for a spawn: the lane if it has fewer jobs waiting."""
        if (sp.lane is not None and not sp.lane.released and self.lane_worker is not None
                and self.lane_worker.queued < self.worker.queued):
            return self.lane_worker, sp.lane
        return self.worker, sp.tpl

    # ---- capture -----------------------------------------------------------------------

    async def capture(self, procs: dict[int, native.ProcStatus], thaw: Callable[[], None],
                      snapshot_files: Callable[[], Awaitable[None]],
                      daemon_pipes: Callable[[], tuple[dict[int, str], set[int]]],
                      tracer_ok: set[int],
                      reuse: Mapping[int, native.Template] | None = None,
                      layers: Sequence[str] = (), later: bool = False, scope: str = "",
                      session_ttys: Mapping[str, int] | None = None,
                      ipcns: int = -1, ipc_maybe: bool = False) -> ProcessState:
        """Stop `procs` (the sandbox's processes and their status, cgroup frozen by the caller
        before listing them), snapshot the files, template every process, resume. Raises
        FailedPrecondition listing every process that cannot be captured, changing nothing.
        `reuse`: templates, by pid, of processes known not to have run since the template
        was made (the caller's inspector says so): shared instead of forked anew. They are
        stopped and read like the others (their records, pipes and files are the
        checkpoint's own); only their page tables are not copied again. `layers`: the
        directories of the sandbox's overlay layers, upper first (cr/watches.py). Raises
        Unsettled if the only refusals are inotify events not read yet. `later`: once
        the processes are stopped, read and found capturable, return: `snapshot_files` is
        not called and no template is made; the processes stay stopped
        (ProcessState.held) until the caller, having called make_templates() and
        snapshotted the files, calls resume(). `scope`: the sandbox's id (what the capture
        remembers of its files is kept per sandbox: private_in_writable_layer).
        `session_ttys`: the masters of the sessions' terminals the daemon holds (name ->
        its fd): their ptys are captured as the sessions' (ptys.capture). `ipcns`: a
        pidfd of a process in the sandbox's IPC namespace, whose System V segments are
        captured when a process has one attached or `ipc_maybe` (sysv_shm.wanted)."""
        pids = list(procs)
        own = {int(t) for t in os.listdir("/proc/self/task")}
        if any(st.tracer_pid in own for st in procs.values()):
            # Still attached by our own ptrace thread: an aborted stop of an earlier capture
            # whose tracee had not stopped yet (it is detached once it does). Detach it now.
            await self.worker.run(native.sweep_stops, 0.5)
            procs = {p: native.proc_status(p) for p in pids}
        if any(status_refused(st, tracer_ok) for st in procs.values()):
            # What would stop a seize or a template (threads, a tracer, capabilities) is
            # known from the status alone; name every reason, as below, before any stop.
            records = [record(p, st) for p, st in procs.items()]
            thaw()
            raise _refusal([r for rec in records for r in refusals(rec, tracer_ok)])
        # What reads a process's memory map (its command line, its mappings) is read now:
        # a template's fork holds that map locked for milliseconds.
        heads = {p: record_head(p) for p in pids}
        captured_ns = time.time_ns()   # the processes stopped, the files not yet written
        cap = _Pass()
        stops_done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        pipes: dict[int, PipeGroup] = {}
        files: list[unlinked.UnlinkedFile] = []
        shared: list[shared_files.SharedFile] = []
        shm: list[shm_files.ShmFile] = []
        named_pipes: list[fifos.Fifo] = []
        terminals: list[ptys.Pty] = []
        segments: list[sysv_shm.Segment] = []
        queues: list[sysv_msg.Queue] = []
        sets: list[sysv_sem.Set] = []
        pqueues: list[posix_mq.Queue] = []

        async def ptrace_pass() -> None:
            # Not cancellable once the ptrace thread runs it: the failure path needs what
            # it made (in `cap`) to undo it.
            try:
                with trio.CancelScope(shield=True):
                    await self.worker.run(
                        _stop_and_template, cap, pids, thaw,
                        lambda: token.run_sync_soon(stops_done.set),
                        {p: st.rss_kb for p, st in procs.items()}, dict(reuse or {}),
                        not later)
            finally:
                stops_done.set()  # also when it failed: the others must not wait forever

        async def snapshot() -> None:
            # Everything is stopped: the file snapshot (a btrfs transaction commit) goes
            # alongside the templates (page-table copies on the ptrace thread).
            await stops_done.wait()
            try:
                if cap.stops_done and not later:
                    await snapshot_files()
                    cap.files_ok = True
            finally:
                cap.files_done.set()

        async def read_processes() -> None:
            # Meanwhile the processes are read from /proc (~0.7 ms of Python): while the
            # ptrace thread is inside the templates' forks it needs no GIL, whereas during
            # the stops it would wait for it (a thread wanting the GIL from a busy one gets
            # it only when that one blocks, or after the 5 ms switch interval).
            nonlocal pipes, files, shared, shm, named_pipes, terminals, segments, queues, sets
            nonlocal pqueues
            await stops_done.wait()
            try:
                if not cap.stops_done:
                    return
                await trio.lowlevel.checkpoint()  # the snapshot's thread starts first
                alive = {s.pid for s in cap.stopped}  # the rest died meanwhile
                records = [record(p, procs[p], heads[p], procs) for p in pids if p in alive]
                cap.refused.extend(r for rec in records for r in refusals(rec, tracer_ok))
                cap.refused.extend(shared_lock_refusals(records))
                cap.refused.extend(creds.refusals(records))
                in_writable_layer(records, layers)
                if len(self.private_known) > PRIVATE_KNOWN_MAX:
                    self.private_known.clear()
                private_in_writable_layer(records, heads, layers, self.private_known, scope)
                if not cap.refused:
                    cap.refused.extend(r for rec in records for r in add_listeners(rec))
                if not cap.refused:   # before eventloop.capture drops the fdinfo it read
                    cap.refused.extend(pidfds.capture(records))
                if not cap.refused:
                    cap.refused.extend(sigio.capture(records))
                if not cap.refused:
                    cap.refused.extend(eventloop.capture(records, layers, self.watch_paths))
                if not cap.refused:
                    shm_files.named_again(records)   # before unlinked.capture looks
                    files, why = unlinked.capture(records)
                    cap.refused.extend(why)
                if not cap.refused:
                    shared, why = shared_files.capture(records)
                    cap.refused.extend(why)
                if not cap.refused:
                    shm, why = shm_files.capture(records)
                    cap.refused.extend(why)
                if not cap.refused:
                    named_pipes, why = fifos.capture(records)
                    cap.refused.extend(why)
                if not cap.refused:
                    terminals, why = ptys.capture(records, session_ttys)
                    cap.refused.extend(why)
                if not cap.refused and sysv_shm.wanted(records, ipc_maybe):
                    if ipcns < 0:
                        raise Internal("System V shared memory to capture, but no IPC "
                                       "namespace given")
                    segments, why = sysv_shm.capture(ipcns, records)
                    cap.refused.extend(why)
                if not cap.refused and ipc_maybe:
                    queues, why = sysv_msg.capture(ipcns)
                    cap.refused.extend(why)
                if not cap.refused and ipc_maybe:
                    sets, why = sysv_sem.capture(ipcns, records)
                    cap.refused.extend(why)
                posix_mq.held(records)
                if not cap.refused and (ipc_maybe or any(r.mqueues for r in records)):
                    _need_ipcns(ipcns, "POSIX message queues")
                    pqueues, why = posix_mq.capture(ipcns, records)
                    cap.refused.extend(why)
                if cap.refused:
                    unlinked.close_saved(files)
                    sysv_shm.close_saved(segments)
                    sysv_msg.close_saved(queues)
                    sysv_sem.close_saved(sets)
                    return
                pipes = _pipe_groups(records, *daemon_pipes())
                cap.refused.extend(_save_unread(pipes, records))
                if cap.refused:
                    _close_saved(pipes)
                    unlinked.close_saved(files)
                    shm_files.close_saved(shm)
                    fifos.close_saved(named_pipes)
                    sysv_shm.close_saved(segments)
                    sysv_msg.close_saved(queues)
                    sysv_sem.close_saved(sets)
                    posix_mq.close_saved(pqueues)
                    return
                cap.records = records
            finally:
                cap.records_ready.set()

        try:
            await run_all([ptrace_pass, snapshot, read_processes])
            if not cap.refused and cap.records:
                cap.refused.extend(adoption.refusals(cap.records, _syscalls_at_stop(cap, later)))
            if cap.refused:
                raise _refusal(cap.refused)
            if not cap.resumed and not later:
                await self.worker.run(_resume_all, cap.stopped)
            if segments and not later:   # the processes run again meanwhile
                await self.worker.run(_detach_segments, cap.templates, segments,
                                      set(reuse or {}))
        except BaseException as e:
            with trio.CancelScope(shield=True):
                if not cap.resumed:
                    await self.worker.run(_abort_all, cap.stopped)
                await self.worker.run(_release_all, list(cap.templates.values()))
            _close_saved(pipes)
            unlinked.close_saved(files)
            shm_files.close_saved(shm)
            fifos.close_saved(named_pipes)
            sysv_shm.close_saved(segments)
            sysv_msg.close_saved(queues)
            sysv_sem.close_saved(sets)
            posix_mq.close_saved(pqueues)
            if cap.refused and isinstance(e, Exception):  # the reasons, not what the stops
                raise _refusal(cap.refused) from None     # made of them
            raise
        sessions = {}
        for g in pipes.values():
            if g.owner.startswith("session:") and g.owner.endswith(":0"):
                for e in g.ends:
                    if e.fd == 0:
                        sessions[g.owner.split(":")[1]] = e.pid
        stopped = {s.pid for s in cap.stopped}
        return ProcessState(cap.records, cap.templates, pipes, sessions,
                            reused=sorted(p for p in reuse or {} if p in stopped),
                            unlinked=files, shared_files=shared, shm_files=shm,
                            fifos=named_pipes, ptys=terminals, captured_ns=captured_ns,
                            sysv_shm=segments, sysv_msg=queues, sysv_sem=sets,
                            posix_mq=pqueues,
                            held=Held(cap.stopped, dict(reuse or {})) if later else None)

    async def make_templates(self, state: ProcessState) -> None:
        """The templates of a `later` capture, its processes still in their stops, made
        as capture makes them. On failure none is left (the processes stay stopped:
        resume() lets them go)."""
        assert state.held is not None and not state.templates
        with trio.CancelScope(shield=True):
            state.templates = await self.worker.run(_template_held, state.held,
                                                    state.records)
            if state.sysv_shm:
                try:
                    await self.worker.run(_detach_segments, state.templates,
                                          state.sysv_shm, set(state.held.reuse))
                except BaseException:
                    await self.worker.run(_release_all, list(state.templates.values()))
                    state.templates = {}
                    raise

    async def give_creds(self, state: ProcessState, host_pid: int, root_dir: str) -> None:
        """Once a capture's templates exist: the credentials of its unprivileged processes
        on their templates, and for those not born of a restored parent, a template of
        root's rebuilt from an image of their fork (cr/creds.py), forked from `host_pid`
        (the sandbox's init) with mapped files resolved under `root_dir`. Raises CRError
        (the capture is undone by the caller)."""
        rebuilt = creds.rebuilt(state.records)
        for rec in state.records:
            if rec.creds is None or state.templates[rec.pid].rebuilt:
                continue   # root's, or shared with a checkpoint before (and rebuilt then)
            tpl = state.templates[rec.pid]
            await self.worker.run(creds.give, tpl, rec.creds)
            if rec.pid not in rebuilt:
                continue
            await self._task_of(state, rec)   # the fork's: the rebuilt one is init's fork
            image = await self._image(state, rec)
            new = await self.worker.run(_rebuild, rec, host_pid, image, root_dir, tpl)
            assert state.images is not None
            state.images.drop(rec.pid)
            state.templates[rec.pid] = new
            await self.worker.run(_release_all, [tpl])

    async def resume(self, state: ProcessState) -> None:
        """Let the processes a `later` capture holds stopped run again."""
        held, state.held = state.held, None
        if held is not None:
            with trio.CancelScope(shield=True):
                await self.worker.run(_resume_all, held.stopped)

    # ---- restore -----------------------------------------------------------------------

    async def _spawn_retrying(self, sp: _Spawn, carrier: native.Carrier | None = None,
                              pid_held: Callable[[int], bool] | None = None) -> int:
        """Spawn (or birth from `carrier`) with the original pid (if given); the killed
        original may not be reaped yet (EEXIST), so reap and retry for a while, with backoff
        and off the ptrace thread between attempts (other sandboxes' operations need it).
        `pid_held`: see restore."""
        deadline = trio.current_time() + 2.0
        set_tid = [sp.nspid] if sp.nspid is not None else None
        into = sp.into
        delay = 0.0002
        asked = False
        while True:
            try:
                if carrier is not None:
                    return await self.worker.run(carrier.birth, set_tid, sp.pgid)
                # A held process stays with the thread that adopts its children.
                worker, tpl = ((self.worker, None) if sp.hold or sp.parent is not None
                               else self._spawner(sp))
                return await worker.run(_spawn_once, sp, set_tid, tpl)
            except native.CRError as e:
                # Taken as a live group or session id (of another checkpoint's templates, or
                # of processes rebuilt from a dump), not by a killed original waiting to be
                # reaped: a new pid, as for a leader. Known at once when `pid_held` says so
                # (asked once), else assumed after 0.3 s of reaping. Not for a
                # multi-threaded process (native/threads.c: glibc caches its tids).
                if (e.errno == errno.EEXIST and set_tid and not sp.threaded
                        and (into is None or into.pid_fallback)):
                    held = False
                    if pid_held is not None and not asked:
                        asked, held = True, pid_held(set_tid[0])
                    if held or trio.current_time() > deadline - 1.7:
                        set_tid = None
                        sp.renumbered = True
                        continue
                if e.errno != errno.EEXIST or trio.current_time() > deadline:
                    raise
            delay = await _until_reaped(delay)

    async def restore(self, state: ProcessState, mntfd: int, rootfd: int,
                      into: Elsewhere | None = None,
                      victims: list[int] | None = None,
                      pre: Prespawned | None = None,
                      pid_held: Callable[[int], bool] | None = None,
                      ipcns: int = -1,
                      free_pid: FreePid | None = None) -> Restored:
        """Spawn every template's child into the generation `mntfd`: in the templates' own
        sandbox (rollback: the caller killed the live processes; `victims`, their pidfds,
        are waited for, closed and emptied before a pid is reused), or `into` another
        sandbox whose pid namespace is nested below theirs (fork). Processes that get a
        new pid anyway come first, while the killed ones are still dying, unless they
        listen on a port (the killed ones hold it until they exit). Those with a
        carrier in `pre` (spawned ahead into this same generation; consumed here) are born
        from it, and keep it as their keeper; their connections and listeners take their
        addresses first.
        `pid_held(nspid)`: whether a process that will not exit holds that pid of the
        target namespace (as its pid, group or session id), where a pid may fall back to
        a new one: then it does at once, not after 0.3 s of retries. `ipcns`: (rollback) a
        pidfd of a process in the sandbox's IPC namespace, where the checkpoint's System V
        segments are made again (a fork's are made in `into`'s). `free_pid(nspid)`:
        (rollback) frees a pid held so that an exited child can get it back (_zombies).
        On failure, kills what it spawned and raises."""
        if (state.sysv_shm or state.sysv_msg or state.sysv_sem or state.posix_mq) and \
                into is None:
            # The killed processes write no more to the segments the restore fills, nor
            # send to the queues or change the sets it makes again (a call they were
            # entering when killed would find the new object under the same id), nor
            # hold the POSIX queues it replaces (charged to the user until closed).
            await wait_exited(victims or [])
            victims = None
        target_ipc = into.init_pidfd if into is not None else ipcns
        # Made before any process attaches one.
        note = _make_segments(state, target_ipc) if state.sysv_shm else ""
        if state.sysv_msg:   # made before any process that waits on one is born
            _need_ipcns(target_ipc, "System V message queues")
            sysv_msg.make(target_ipc, state.sysv_msg)
        if state.sysv_sem:
            _need_ipcns(target_ipc, "System V semaphore sets")
            sysv_sem.make(target_ipc, state.sysv_sem)
        if state.posix_mq:   # made before any process that holds or opens one is born
            _need_ipcns(target_ipc, "POSIX message queues")
            posix_mq.make(target_ipc, state.posix_mq)
        plan = pre.plan if pre is not None else _plan(state, rootfd, mntfd)
        if state.posix_mq:   # every holder's descriptors, opened before the queues made
            plan.queue_fds = posix_mq.open_held(target_ipc, state.records, state.posix_mq)
            plan.loops += plan.queue_fds.values()   # for their holders alone go
        plan.arm()  # a prespawned plan's timers start now, with the rollback
        out = Restored({}, {}, [], note=note)
        groups: dict[int, int] = {}          # host pgid at checkpoint -> pgid in the target
        records = _leaders_first(state.records)
        born: dict[int, int | native.CRError] = {}  # checkpoint pid -> born pid, or why not
        # A rollback binds its listeners where its killed processes may have left
        # connections in TIME_WAIT: its own sandbox, also when it rolls back onto
        # templates rebuilt from a dump (into, not fresh); a new fork's namespace has none.
        time_wait = _time_wait_ports(state) if into is None or not into.fresh else set()
        orphans = _orphan_addresses(state) if into is None or not into.fresh else set()
        # Restored parents of adopted children, then those children (record pid -> held
        # process; adoption.py): all held until every one exists.
        held: dict[int, native.Held] = {}

        async def addresses_free() -> None:
            """The killed processes' pids and addresses are free: they have exited, and
            the connections in TIME_WAIT on a port a listener without SO_REUSEADDR binds
            again are gone."""
            nonlocal victims
            if victims is not None:
                await wait_exited(victims)
                victims = None
            netns_pid = (into.init_pid if into is not None
                         else state.templates[records[0].pid].pid)
            if time_wait:
                tcp.clear_time_wait(netns_pid, time_wait)
                time_wait.clear()
            if orphans:
                tcp.clear_orphans(netns_pid, orphans)
                orphans.clear()

        async def take_addresses() -> None:
            """The plan's sockets made unbound (a carrier's, a listener several processes
            hold: listener_fds) take their addresses, once the killed ones are free."""
            if plan.addresses_to_take:
                await addresses_free()
                plan.take_addresses()

        # Files written in place since the checkpoint that a process maps privately, looked
        # at once: a carrier made before the write holds their new bytes (private_maps.py).
        changed = {r.pid: _changed_maps(state, r) for r in records if r.mapped_private}
        try:
            if pre is not None:
                stale = [pre.carriers.pop(r.pid) for r in records
                         if r.pid in pre.carriers and pre.stale(r, changed.get(r.pid, []))]
                if stale:
                    await self.kill_carriers(stale)
                await self._queues_to_carriers(records, pre, plan)
            await take_addresses()  # carriers' connections and listeners
            if into is None and pre is not None:
                born = await self._births(records, pre, victims)
                if born:
                    victims = None  # waited for by _births
            ids = _rollback_ids(state) if into is None else {}

            async def args_for(rec: ProcessRecord) -> _Spawn:
                if into is None and (_connected(rec) or _abstract_name(rec) or
                                     _named_pair_end(rec)):
                    # Its connections (and abstract names) take the killed ones'
                    # addresses: gone once they have exited (tcp.quiet_all closed them
                    # silently).
                    await addresses_free()
                elif orphans and _connected(rec):   # onto rebuilt templates: the killed
                    await addresses_free()          # timeline's orphans (tcp.clear_orphans)
                spawn = _spawn_args(state, plan, rec, mntfd, into, changed.get(rec.pid, []))
                await take_addresses()  # a listener several processes hold
                if into is None:
                    # A kept pid, and a listener's port, are free once the killed
                    # originals have exited (their pages go before their files: a big one
                    # holds the port for tens of ms).
                    spawn.nspid, spawn.pgid = ids[rec.pid]
                    spawn.ctty = _ctty(state, rec, spawn.pgid)
                    if spawn.nspid is not None or spawn.listens:
                        await addresses_free()
                else:
                    # A fresh pid namespace: every pid is free. The template's process
                    # group belongs to the source sandbox, so each child leads or joins a
                    # group of the target's own (sessions stay the source's: see module doc).
                    # In a pid namespace that already holds templates of its own, a group
                    # leader's pid may still be allocated (see above): a new pid then, at
                    # once unless a taken pid may fall back to one anyway (pid_fallback:
                    # its parent waits for it by its pid, as a shell for `timeout`).
                    alone = _new_session(state, rec)   # its session's id is free
                    spawn.nspid = (rec.nspid if into.fresh or into.pid_fallback
                                   or not _leader(rec) or alone else None)
                    spawn.into = into
                    spawn.pgid = native.NEW_SESSION if alone else groups.get(rec.pgid, -1)
                    spawn.ctty = _ctty(state, rec, spawn.pgid)
                    if spawn.listens:   # (a rollback onto rebuilt templates: time_wait)
                        await addresses_free()
                return spawn

            chains = _chains(state)
            chained: set[int] = set()
            for rec in _restore_order(records, state.family):
                if rec.pid in chained:
                    continue
                spawn = await args_for(rec)
                carrier: native.Carrier | None = None
                if rec.pid in chains:   # the root of a family with a far bigger child
                    path = chains[rec.pid]
                    if await self._chain(state, path, spawn, args_for, held, rootfd, out,
                                         groups, pid_held, free_pid):
                        chained.update(path)
                        continue
                if rec.pid in state.family:   # its restored parent's own child
                    pid = await self._adopted(state, rec, spawn, held, rootfd, out, groups,
                                              pid_held, free_pid)
                else:
                    spawn.hold = rec.pid in state.adopters or bool(rec.sigio)
                    carrier = pre.carriers.pop(rec.pid, None) if pre is not None else None
                    first = born.pop(rec.pid, None)
                    if isinstance(first, int):
                        pid = first
                    else:
                        pid = await self._born_or_spawned(spawn, carrier, pid_held,
                                                          failed=first)
                    if spawn.held is not None:
                        held[rec.pid] = spawn.held
                        await self._zombies(rec, spawn.held, pid_held, free_pid)
                out.pids[rec.nspid] = pid
                if carrier is not None and carrier.child == pid:
                    out.keepers[pid] = carrier
                if spawn.renumbered:
                    out.renumbered.append(rec.nspid)
                if into is not None:
                    groups.setdefault(rec.pgid, rec.nspid)
            if state.sysv_shm:   # every process has attached its segments
                sysv_shm.settle(target_ipc, state.sysv_shm)
            if any(r.pidfds for r in records):
                await self.worker.run(_give_pidfds, state, held)
            for rec in records:   # every process exists; the holders are held
                if rec.sigio:
                    sigio.give(rec, held[rec.pid].pid,
                               lambda pid: out.pids[_nspid(state, pid)])
            if held:   # children before their parents, all at once
                await self.worker.run(_release_held, list(held.values())[::-1],
                                      _foregrounds(state, held))
        except BaseException:
            if state.sysv_shm:   # not left open to all (the restarted processes' sandbox)
                with contextlib.suppress(native.CRError):
                    sysv_shm.settle(target_ipc, state.sysv_shm)
            with trio.CancelScope(shield=True):
                # Gone before we say the restore failed: nothing half-restored lingers.
                await self.worker.run(_kill_held, list(held.values())[::-1])
                early = [p for p in born.values() if isinstance(p, int)]
                await wait_exited(kill_pidfds([*out.pids.values(), *early]))
                await self.kill_carriers(list(out.keepers.values()))
            plan.close_all()
            raise
        finally:
            if pre is not None and pre.carriers:  # none left on success
                leftover = list(pre.carriers.values())
                pre.carriers.clear()
                with trio.CancelScope(shield=True):
                    await self.kill_carriers(leftover)
        plan.settle()
        out.session_fds = {name: (out.pids[_nspid(state, pid)], *plan.session_ends(name))
                           for name, pid in state.sessions.items()}
        out.session_ttys = {name: fd for name in state.sessions
                            if (fd := plan.session_tty(name)) is not None}
        out.daemon_fds = plan.daemon_ends()
        plan.close_child_ends()
        return out

    async def _adopted(self, state: ProcessState, rec: ProcessRecord, spawn: _Spawn,
                       held: dict[int, native.Held], rootfd: int, out: Restored,
                       groups: dict[int, int],
                       pid_held: Callable[[int], bool] | None,
                       free_pid: FreePid | None = None) -> int:
        """rec restored from an image of its template into a child of its held restored
        parent (adoption.py), held in turn: its pid."""
        parent = _adopt_group(state, rec, spawn, out, groups)
        spawn.image = await self._image(state, rec)
        spawn.remaps = _image_remaps(spawn.remaps)
        spawn.parent, spawn.rootfd = held[parent.pid], rootfd
        pid = await self._spawn_retrying(spawn, pid_held=pid_held)
        assert spawn.held is not None
        held[rec.pid] = spawn.held
        await self._zombies(rec, spawn.held, pid_held, free_pid)
        # A fork of its held parent, which has the parent's own attributes by now (spawned
        # from its template, or given them like this): set only if the child's differ (a
        # shell's job has the shell's, as a rule: ~0.5 ms saved per adopted child).
        if await self._task_of(state, rec) != await self._task_of(state, parent):
            await self._give_attrs(state, rec, spawn.held)
        return pid

    async def _zombies(self, rec: ProcessRecord, held: native.Held,
                       pid_held: Callable[[int], bool] | None = None,
                       free_pid: FreePid | None = None) -> None:
        """rec's children that had exited, not waited for yet, made again as such. Their
        pids are free once the originals, orphaned by the rollback's kill, are reaped
        (EEXIST until then: reap and retry, as _spawn_retrying). A zombie keeps its pid
        (its parent waits for that one): when a process that will not exit holds it
        (`pid_held`: another checkpoint's templates, in a session that pid leads), it is
        freed if `free_pid` can (those templates released, their checkpoint restoring
        from its dump), else the restore fails at once, saying so."""
        for nspid, status, comm in rec.zombies:
            deadline = trio.current_time() + 2.0
            delay = 0.0002
            ask_at = 0.0   # when to ask pid_held (once, and again once after free_pid)
            while True:
                try:
                    await self.worker.run(held.zombie, nspid, status, comm)
                    break
                except native.CRError as e:
                    if e.errno != errno.EEXIST or trio.current_time() > deadline:
                        raise
                    if pid_held is not None and trio.current_time() >= ask_at:
                        ask_at = math.inf
                        if pid_held(nspid):
                            if free_pid is not None and await free_pid(nspid):
                                # Released; what they had spawned ahead may still be dying.
                                free_pid, ask_at = None, trio.current_time() + 0.3
                                continue
                            raise native.CRError(errno.EEXIST, (
                                f"pid {rec.nspid}: its exited child {nspid} ({comm}), not "
                                f"waited for yet, cannot be made again: another process "
                                f"of the sandbox holds pid {nspid} (as its pid, process "
                                f"group or session id; the daemon's log names it)")) from e
                delay = await _until_reaped(delay)

    async def _task_of(self, state: ProcessState, rec: ProcessRecord) -> TaskAttrs:
        """rec's nice, priorities, rlimits, prctl state (taskattrs.py), read from its
        template the first time."""
        if rec.task is None:
            rec.task = await self.worker.run(taskattrs.read, state.templates[rec.pid])
        return rec.task

    async def _give_attrs(self, state: ProcessState, rec: ProcessRecord,
                          held: native.Held) -> None:
        """rec's attributes on its copy restored from an image as another process's fork,
        held before it runs."""
        await self.worker.run(taskattrs.give, held, await self._task_of(state, rec))

    async def _image(self, state: ProcessState, rec: ProcessRecord) -> str:
        """The image a restore copies rec's memory from (adoption.Images: made once per
        checkpoint)."""
        if state.images is None:
            state.images = adoption.Images(self.images_dir)
        tpl = state.templates[rec.pid]
        image = state.images.dirs.get(rec.pid)  # made already: no trip to the worker
        if image is None:
            image = await self.worker.run(state.images.make, rec, tpl, state.captured_ns)
        stale = private_maps.copied_stale(rec, tpl.pid, state.captured_ns,
                                           state.shm_files)
        if stale:
            raise native.CRError(errno.ESTALE, stale)
        return image

    async def _chain(self, state: ProcessState, path: list[int], root: _Spawn,
                     args_for: Callable[[ProcessRecord], Awaitable[_Spawn]],
                     held: dict[int, native.Held], rootfd: int, out: Restored,
                     groups: dict[int, int],
                     pid_held: Callable[[int], bool] | None = None,
                     free_pid: FreePid | None = None) -> bool:
        """A family's root and the held ancestors of its far biggest adopted child, and that
        child, in one call (native.Template.held_chain: the child's memory is shared
        copy-on-write, the ancestors' images are copied). False (nothing made) if it
        fails: the caller restores them one by one as before."""
        by_pid = {r.pid: r for r in state.records}
        recs = [by_pid[p] for p in path]
        spawns = [root]
        for rec in recs[1:]:
            sp = await args_for(rec)
            _adopt_group(state, rec, sp, out, groups)
            spawns.append(sp)
        try:
            images = [await self._image(state, r) for r in recs[:-1]]
            made = await self.worker.run(
                state.templates[recs[-1].pid].held_chain,
                [(_image_kwargs(sp, _pid(sp), sp is root), img, state.templates[r.pid])
                 for sp, img, r in zip(spawns, images, recs)],
                _spawn_kwargs(spawns[-1], _pid(spawns[-1]), False), rootfd)
        except native.CRError as e:
            log.warning("restoring pids %s as a chain failed (%s): one by one",
                        [r.nspid for r in recs], e)
            return False
        for rec, h in zip(recs, made):
            held[rec.pid] = h
            await self._zombies(rec, h, pid_held, free_pid)
            out.pids[rec.nspid] = h.pid
            await self._give_attrs(state, rec, h)   # an ancestor: the child's template's fork
            if root.into is not None:
                groups.setdefault(rec.pgid, rec.nspid)
        return True

    async def _queues_to_carriers(self, records: list[ProcessRecord], pre: Prespawned,
                                  plan: _PipePlan) -> None:
        """Processes born from carriers get their POSIX queue descriptors from them: the
        queues are this restore's, made after the carriers were spawned, so each carrier
        is given them now (native.Carrier.install_fds). A carrier that fails is killed
        and its process spawned instead, which opens them itself (_PipePlan.file_fds)."""
        for rec in records:
            carrier = pre.carriers.get(rec.pid)
            if carrier is None or not rec.mqueues:
                continue
            fds = {h.fd: plan.queue_fds[(rec.pid, h.fd)] for h in rec.mqueues}
            try:
                cloexec = {f.fd for f in rec.fds if f.fd in fds and f.flags & os.O_CLOEXEC}
                await self.worker.run(carrier.install_fds, fds, cloexec)
            except native.CRError as e:
                log.warning("the carrier %d of pid %s failed (%s): spawning it anew",
                            carrier.pid, rec.nspid, e)
                del pre.carriers[rec.pid]
                await self.kill_carriers([carrier])

    async def _births(self, records: list[ProcessRecord], pre: Prespawned,
                      victims: list[int] | None) -> dict[int, int | native.CRError]:
        """A rollback whose every process has a carrier: birth them all in one native job
        on the ptrace thread (PtraceWorker.births: no interpreter hand-over either way),
        which waits there for the killed processes (`victims`) to exit before it reuses
        a pid. One attempt each: checkpoint pid -> born pid, or the
        CRError for the usual path to retry or fall back from. Empty (nothing done) unless
        every process has a carrier."""
        if not records or any(r.pid not in pre.carriers for r in records):
            return {}
        ids = _rollback_ids(pre.state)
        jobs = [(pre.carriers[r.pid], ids[r.pid][0], ids[r.pid][1]) for r in records]
        born = await self.worker.births(jobs, list(victims or ()), VICTIMS_TIMEOUT_S)
        if victims:
            await wait_exited(victims)  # exited by now: closes them
        return {r.pid: b for r, b in zip(records, born)}

    async def _born_or_spawned(self, spawn: _Spawn, carrier: native.Carrier | None,
                               pid_held: Callable[[int], bool] | None = None,
                               failed: native.CRError | None = None) -> int:
        """The process from its carrier if it has one, else (or if that fails: a carrier
        the sandbox killed while it waited) spawned from its template. `failed`: how a
        first birth from the carrier failed (_births); only a taken pid is retried."""
        if carrier is not None:
            try:
                if failed is not None and failed.errno != errno.EEXIST:
                    raise failed
                return await self._spawn_retrying(spawn, carrier, pid_held)
            except native.CRError as e:
                if e.errno == errno.EEXIST:
                    raise
                log.warning("the carrier %d of pid %s failed (%s): spawning it anew",
                            carrier.pid, spawn.nspid, e)
                await self.kill_carriers([carrier])
        return await self._spawn_retrying(spawn, pid_held=pid_held)

    async def images_ahead(self, state: ProcessState) -> None:
        """The images a rollback to `state` restores processes from (adopted children not
        at the end of a chain, a chain's ancestors: restore), made now (warm pool) rather
        than on the rollback's path: a shell's live image takes ~2.5 ms to index. One that
        cannot be made is left to the rollback, which says why."""
        wanted = set(state.family)
        for path in _chains(state).values():
            wanted.update(path[:-1])
            wanted.discard(path[-1])
        for rec in state.records:
            if rec.pid in wanted:
                try:
                    await self._image(state, rec)
                except native.CRError as e:
                    log.debug("image of pid %s ahead of a rollback: %s", rec.nspid, e)

    async def prespawn(self, state: ProcessState, mntfd: int, rootfd: int
                       ) -> Prespawned | None:
        """Carriers, in the generation `mntfd` that a rollback to `state` will use, of
        every process but multi-threaded ones a rollback does not restore (a session leader:
        native/threads.c), those holding /dev/tty open (reopened once a spawn has given
        the process its terminal: ptys.py), those watching a signalfd with epoll (the
        watch waits on the signal queue of the task that made it: the carrier's, not its
        birth's), those listening on an abstract unix name (the live process holds it:
        bound by their spawn once it has exited), those attaching a System V segment
        (made again by the rollback, with the live one's id), those with signal-driven
        I/O (held until their descriptors' owners exist: sigio.py) and captured parents and
        children (restored held, and adopted: adoption.py): restore(pre=...) gives birth
        to the processes from them. A TCP connection's or listener's sockets are made
        ahead, their addresses taken by the rollback (the live process still holds them),
        and the deleted-but-open files and shared memory copied afresh (make_objects). None
        if there is nothing to make."""
        ids = _rollback_ids(state)
        attaching = {a.pid for s in state.sysv_shm for a in s.attached}
        recs = [r for r in state.records if not (r.threads > 1 and ids[r.pid][0] is None)
                and not eventloop.watches_signalfd(r.loop) and not _abstract_name(r)
                and r.pid not in attaching
                and r.pid not in state.family and r.pid not in state.adopters
                and not r.sigio
                and not ptys.holds_dev_tty(r)]
        if not recs and not state.unlinked:
            return None
        pre = Prespawned(state, _plan(state, rootfd, mntfd, armed=False), {})
        try:
            # Shared memory copied afresh for the processes that get no carrier too
            # (PostgreSQL's shared buffers: ~4 ms for 12 MiB written, off the rollback).
            pre.plan.make_objects()
            for rec in recs:
                changed = _changed_maps(state, rec)
                spawn = _spawn_args(state, pre.plan, rec, mntfd, changed=changed)
                spawn.ctty = _ctty(state, rec, ids[rec.pid][1])   # for its birth
                carrier = pre.carriers[rec.pid] = await self.worker.run(_carrier_of, spawn)
                pre.spawned.add(carrier.pid)
                pre.remapped[rec.pid] = {m.path for m in changed}
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.discard(pre)
            raise
        return pre

    async def discard(self, pre: Prespawned) -> None:
        """Kill the carriers no rollback used and close their pipes (a rollback that did
        not use them, or a warm generation dropped). Once: a second call does nothing."""
        if pre.discarded:
            return
        pre.discarded = True
        carriers = list(pre.carriers.values())
        pre.carriers.clear()
        pre.plan.close_all()
        await self.kill_carriers(carriers)

    async def keep(self, carriers: list[native.Carrier]) -> None:
        """Turn carriers that gave birth into keepers (they drop their copies of the
        processes' descriptors). Left out of restore: the ptrace thread does it while the
        rollback answers. A carrier that fails is killed (its process runs on)."""
        await self.worker.run(_keep_all, carriers)

    async def kill_carriers(self, carriers: list[native.Carrier]) -> None:
        """Kill carriers or keepers and reap them. Their exit (a page-table teardown, or
        a whole address space for a keeper) runs while this task waits, not on the ptrace
        thread, which only reaps them once they have exited. Kill a keeper's process
        first. (On cgroup v1 a frozen task cannot die: this then waits for the thaw.)"""
        fds = []
        try:
            for c in carriers:
                if c.killed:
                    continue
                try:  # our unreaped tracee: its pid cannot have been reused
                    fds.append(os.pidfd_open(c.pid))
                    # Its exit tears down an address space: CPU time nobody waits for,
                    # taken only when a CPU is idle (the kernel does it in its context).
                    os.sched_setscheduler(c.pid, os.SCHED_IDLE, os.sched_param(0))
                    os.kill(c.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for fd in fds:
                await trio.lowlevel.wait_readable(fd)
        finally:
            for fd in fds:
                os.close(fd)
            with trio.CancelScope(shield=True):
                await self.worker.run(_kill_carriers, carriers)

    async def release(self, state: ProcessState) -> None:
        await self.close_lanes(state)
        await self.worker.run(_release_all, list(state.templates.values()))
        _close_saved(state.pipes)
        unlinked.close_saved(state.unlinked)
        shm_files.close_saved(state.shm_files)
        fifos.close_saved(state.fifos)
        sysv_shm.close_saved(state.sysv_shm)
        sysv_msg.close_saved(state.sysv_msg)
        sysv_sem.close_saved(state.sysv_sem)
        posix_mq.close_saved(state.posix_mq)
        if state.images is not None:
            await trio.to_thread.run_sync(state.images.close)


def _rebuild(rec: ProcessRecord, host_pid: int, image: str, root_dir: str,
             source: native.Template) -> native.Template:
    """On the ptrace thread: rec's template of root's, rebuilt from the live image of its
    fork `source` (give_creds), which gives it its timers, stop and credentials."""
    tpl = native.restore_template(host_pid, image, root_dir, source)
    try:
        if rec.task is not None:   # a fork of host_pid's: its nice, rlimits, ...
            taskattrs.give(tpl, rec.task)
        tpl.rebuilt = True
        # In init's group and session, not the process's: its child leads its session
        # again (creds.sessions, lone_leaders).
        tpl.own_group_done = tpl.own_session_done = True
    except BaseException:
        tpl.release()
        raise
    return tpl


def rebuilt_as(tpl: native.Template, rec: ProcessRecord) -> None:
    """Give a template rebuilt from rec's image (a fork of the sandbox's init) what rec's
    process had and the image does not hold: its attributes, timers and job-control stop
    (a dump's rebuilt templates: daemon/dumps.py)."""
    if rec.task is not None:
        taskattrs.give(tpl, rec.task)
    if any(rec.itimers):
        tpl.set_itimers(rec.itimers)
    if rec.ptimers:
        tpl.set_ptimers(rec.ptimers)
    if rec.stopped:
        tpl.set_group_stop(True)
    if rec.pdeathsig or rec.subreaper:
        tpl.set_parent_death(rec.pdeathsig, rec.subreaper)


def _nspid(state: ProcessState, host_pid: int) -> int:
    return next(r.nspid for r in state.records if r.pid == host_pid)


# ---- pipes ---------------------------------------------------------------------------------

def _pipe_groups(records: list[ProcessRecord], session_inodes: dict[int, str],
                 daemon_inodes: set[int]) -> dict[int, PipeGroup]:
    groups: dict[int, PipeGroup] = {}
    for rec in records:
        for f in rec.fds:
            if f.kind != "pipe" or f.inode is None:
                continue
            g = groups.setdefault(f.inode, PipeGroup(f.inode))
            g.ends.append(PipeEnd(rec.pid, f.fd, (f.flags & os.O_ACCMODE) != os.O_RDONLY,
                                  f.flags))
    for g in groups.values():
        if g.inode in session_inodes:
            g.owner = "session:" + session_inodes[g.inode]
        elif g.inode in daemon_inodes:
            g.owner = "daemon"
    return groups


def _save_unread(groups: dict[int, PipeGroup], records: list[ProcessRecord]
                 ) -> list[Refusal]:
    """Copy the data waiting in pipes that captured processes read from, and note the
    capacity of the pipes among them (the daemon's session and output pipes are its own,
    of the default size). A copy that falls short refuses the reader."""
    out = []
    for g in groups.values():
        reader = next((e for e in g.ends if not e.write), None)
        if g.owner.startswith("session:") or (reader is None and g.owner):
            continue
        end = reader or g.ends[0]
        fd = native.copy_fd(end.pid, end.fd)
        try:
            g.size = pipebuf.size_of(fd)
            if reader is not None:
                g.saved, missing = pipebuf.tee_copy(fd, g.size)
                if missing:
                    rec = next(r for r in records if r.pid == reader.pid)
                    out.append(Refusal(rec.nspid, rec.cmd, f"fd {reader.fd}: {missing} bytes "
                                       "of the pipe's unread data could not be copied"))
        finally:
            os.close(fd)
    return out


def _close_saved(groups: dict[int, PipeGroup]) -> None:
    for g in groups.values():
        if g.saved is not None:
            os.close(g.saved)
            g.saved = None


def _plan(state: ProcessState, rootfd: int, mntfd: int, armed: bool = True) -> _PipePlan:
    plan = _PipePlan(state.pipes, state.unlinked, rootfd, armed, state.shared_files,
                     state.fifos, [u for r in state.records if r.loop
                                   for u in r.loop.unix_listeners if not u.abstract],
                     _shared_listeners(state),
                     {x.key: x for r in state.records if r.loop for x in r.loop.lone})
    try:
        plan.make_shm(state.shm_files, mntfd)
        plan.make_ptys(state.ptys, mntfd)
    except BaseException:
        plan.close_all()
        raise
    return plan


class _PipePlan:
    """The objects one restore gives its processes, made afresh: one pipe per captured
    pipe, refilled with its unread data; the event loops' eventfds and socket pairs
    (loop_fds); the deleted-but-open files and the shared descriptions of named files
    (file_fds)."""

    def __init__(self, groups: dict[int, PipeGroup],
                 files: list[unlinked.UnlinkedFile] = (), rootfd: int = -1,
                 armed: bool = True, shared: list[shared_files.SharedFile] = (),
                 named_pipes: list[fifos.Fifo] = (),
                 named_listeners: Sequence[unix_listeners.UnixListener] = (),
                 shared_listeners: Collection[int] = (),
                 lones: Mapping[str, eventloop.LoneSocket] | None = None) -> None:
        self.groups = groups
        # every process's lone unix sockets, by key: a datagram client's target (_lone)
        self.lones = lones or {}
        self.shared_listeners = shared_listeners   # TCP listeners' inodes: listener_fds
        self.named_listeners = named_listeners   # every process's, bound before any watch
        # Timers run from when the restored processes do: a plan made ahead for carriers
        # (prespawn) holds its timerfds disarmed until the restore calls arm().
        self.armed = armed
        self.to_arm: list[tuple[int, eventloop.TimerFd]] = []
        # Made ahead, their addresses taken by take_addresses():
        self.unconnected: list[tuple[tcp.TcpConn, tuple[int, int]]] = []
        self.unbound: list[tuple[native.ListenSocket, int]] = []
        self.unnamed: list[tuple[eventloop.SocketPair, tuple[int, int]]] = []
        self.connections: list[tuple[tcp.TcpConn, tuple[int, int]]] = []  # for settle()
        self.listeners_of: dict[int, dict[int, int]] = {}   # pid -> its listeners made here
        self.fresh: dict[int, tuple[int, int]] = {}
        self.loops: list[int] = []     # our copies of objects made (loop_fds, file_fds)
        # (record pid, fd) -> our descriptor of the POSIX queue the restore made for it
        self.queue_fds: dict[tuple[int, int], int] = {}
        self.files = files             # deleted-but-open files, made in rootfd's tree
        self.rootfd = rootfd
        self.made: dict[int, dict[int, int]] = {}   # index in files -> its descriptions'
        self.loops_of: dict[int, dict[int, int]] = {}   # pid -> its loop_fds
        self.objects: dict[str, int | tuple[int, int]] = {}  # eventfd / pair key -> ours
        self.named: dict[tuple[str, bool], int] = {}   # shared-mapped files: ours
        self.shared = shared           # named files' shared descriptions
        self.shared_made: dict[int, int] = {}   # index in shared -> ours
        self.shm: dict[str, int] = {}  # /dev/shm files made again (make_shm): ours
        self.fifos = named_pipes
        self.fifos_made: dict[int, list[int]] = {}   # index in fifos -> its descriptions
        self.ptys: list[ptys.Pty] = []
        self.ptys_made: list[list[int]] = []   # per pty (make_ptys): its descriptions
        for g in groups.values():
            r, w = os.pipe2(os.O_CLOEXEC)
            self.fresh[g.inode] = (r, w)
            pipebuf.set_size(w, g.size)
            if g.saved is not None:
                pipebuf.put_back(g.saved, w, g.size)
            # Status flags belong to the open file description: the restored processes'
            # end gets the original's (an event loop's reader must stay non-blocking).
            for e in g.ends:
                if e.flags & os.O_NONBLOCK:
                    os.set_blocking(w if e.write else r, False)

    def loop_fds(self, rec: ProcessRecord, netns_pid: int) -> dict[int, int]:
        """Fresh eventfds, timerfds, signalfds and socket pairs for one restored process,
        as rec's were at the checkpoint: its fd -> our copy (closed with the pipes' child
        ends). Pairs are made in the network namespace of `netns_pid` (the sandbox it is
        restored into). Made once per process (a carrier's, spawned ahead, serve its
        restore), and once for all the processes that share one (by its key)."""
        loop = rec.loop
        out = self.loops_of.setdefault(rec.pid, {})
        if not loop or out:
            return out
        for ev in loop.eventfds:
            fd = self._object(ev.key, lambda ev=ev: os.eventfd(
                ev.count, os.EFD_CLOEXEC | (os.EFD_SEMAPHORE if ev.semaphore else 0) |
                (os.EFD_NONBLOCK if ev.nonblock else 0)))
            out.update((n, fd) for n in ev.fds)
        for t in loop.timerfds:
            fd = self._object(t.key, lambda t=t: self._timer(t))
            out.update((n, fd) for n in t.fds)
        for sf in loop.signalfds:
            fd = self._object(sf.key, lambda sf=sf: eventloop.new_signalfd(sf))
            out.update((n, fd) for n in sf.fds)
        if loop.inotifies:
            self._bind_named_listeners(netns_pid)
        for ino in loop.inotifies:
            fd = self._object(ino.key, lambda ino=ino: watches.new_inotify(ino, self._root()))
            out.update((n, fd) for n in ino.fds)
        for p in loop.pairs:
            ab = self._pair(p.key, lambda p=p: self._named_pair(p, netns_pid))
            out.update((n, ab[0]) for n in p.a)
            out.update((n, ab[1]) for n in p.b)
        for x in loop.lone:
            out.update((n, self._lone(x, netns_pid)) for n in x.fds)
        for c in loop.tcp:
            ab = self._pair(c.key, lambda c=c: self._connection(c, netns_pid))
            out.update((n, ab[0]) for n in c.a)
            out.update((n, ab[1]) for n in c.b)
        for u in loop.unix_listeners:
            out.update((n, self._unix_listener(u, netns_pid)) for n in u.fds)
        return out

    def _unix_listener(self, u: unix_listeners.UnixListener, netns_pid: int) -> int:
        return self._object(u.key, lambda: unix_listeners.make(u, netns_pid, self._root()))

    def _bind_named_listeners(self, netns_pid: int) -> None:
        """Every process's unix listeners and datagram sockets bound to a path, before the
        first inotify watch is made: binding replaces the checkpoint's stale socket file,
        and a watch on its directory would report that file deleted (gpg-agent then shuts
        down: "socket file has been removed")."""
        for u in self.named_listeners:
            self._unix_listener(u, netns_pid)
        for x in self.lones.values():
            if x.name and not x.abstract:
                self._lone(x, netns_pid)

    def _lone(self, x: eventloop.LoneSocket, netns_pid: int) -> int:
        """The lone socket `x` made again (once per restore), bound to its name, connected
        to its target once that one is made (eventloop.LoneSocket)."""
        return self._object(x.key, lambda: self._made_lone(x, netns_pid))

    def _made_lone(self, x: eventloop.LoneSocket, netns_pid: int) -> int:
        fd = _lone_socket(x, netns_pid)
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if x.name:
                    unix_listeners.bind_name(s, x.name, x.abstract, self._root(), x.owner)
                if x.to_key:
                    self._lone(self.lones[x.to_key], netns_pid)   # bound first
                    if x.to_abstract:
                        s.connect(b"\0" + bytes.fromhex(x.to))
                    else:
                        native.root_connect(self._root(), s, x.to)
        except OSError as e:
            os.close(fd)
            name = unix_listeners.shown(x.name, x.abstract) if x.name else "unnamed"
            raise native.CRError(e.errno or errno.EIO, f"unix socket {x.key} ({name}): "
                                 f"{e.strerror or e}") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _named_pair(self, p: eventloop.SocketPair, netns_pid: int) -> tuple[int, int]:
        """p's two ends (_fresh_pair) with their abstract names: bound at once, or, in a
        plan made ahead (prespawn), once the killed processes have let the names go
        (take_addresses)."""
        ab = _fresh_pair(p, netns_pid)
        if p.name_a or p.name_b:
            if self.armed:
                _bind_names(p, ab)
            else:
                self.unnamed.append((p, ab))
        return ab

    def _connection(self, c: tcp.TcpConn, netns_pid: int) -> tuple[int, int]:
        """c's two ends: connected at once, or, in a plan made ahead (prespawn), left
        unbound until connect() (the live connection holds their addresses)."""
        if self.armed:
            ab = tcp.new_connection(c, netns_pid)
        else:
            ab = tcp.open_ends(c, netns_pid)
            self.unconnected.append((c, ab))
        self.connections.append((c, ab))
        return ab

    def settle(self) -> None:
        """Once every process is restored (every listener bound): the connections'
        original SO_REUSEADDR (tcp.settle_ends)."""
        for c, ab in self.connections:
            tcp.settle_ends(c, ab)

    def listener_fds(self, rec: ProcessRecord, netns_pid: int) -> dict[int, int]:
        """rec's listening sockets the daemon makes, unbound until take_addresses() (the
        killed processes hold their ports): its fd -> our copy. A plan made ahead
        (prespawn) makes them all; the restore's own plan those several processes share (a
        prefork server's master and workers, a reloader and its child: one socket they all
        hold again; each child making its own, the second bind failed with EADDRINUSE),
        the spawned child making the others (native). Made once per process (its carrier's
        serve a spawn that replaces it), and once per socket."""
        out = self.listeners_of.get(rec.pid)
        if out is not None or not rec.listens:
            return out or {}
        out = self.listeners_of[rec.pid] = {}
        for ls in rec.listens:
            if not self.armed or ls.ino in self.shared_listeners:
                key = f"listen:{ls.ino}" if ls.ino else f"listen:{rec.pid}:{ls.fd}"
                out[ls.fd] = self._object(key, lambda ls=ls: self._unbound(ls, netns_pid))
        return out

    def _unbound(self, ls: native.ListenSocket, netns_pid: int) -> int:
        fd = listeners.open_ahead(ls, netns_pid)
        self.unbound.append((ls, fd))
        return fd

    @property
    def addresses_to_take(self) -> bool:
        return bool(self.unconnected or self.unbound or self.unnamed)

    def take_addresses(self) -> None:
        """Make the connections and listeners a plan made ahead holds (call once the
        killed processes' are gone, before any process holding one runs). Connections
        first: a listener binds its port beside its accepted ones."""
        todo, self.unconnected = self.unconnected, []
        for c, ab in todo:
            tcp.connect_ends(c, ab)
        unbound, self.unbound = self.unbound, []
        for ls, fd in unbound:
            listeners.listen(ls, fd)
        unnamed, self.unnamed = self.unnamed, []
        for p, ab in unnamed:
            _bind_names(p, ab)

    def _pair(self, key: str, make: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        """The two ends `key` names, made once per restore (ours, closed with the rest)."""
        ab = self.objects.get(key)
        if ab is None:
            ab = self.objects[key] = make()
            self.loops += ab
        assert isinstance(ab, tuple)
        return ab

    def _object(self, key: str, make: Callable[[], int]) -> int:
        """The object `key` names, made once per restore (ours, closed with the rest)."""
        fd = self.objects.get(key)
        if fd is None:
            fd = self.objects[key] = make()
            self.loops.append(fd)
        assert isinstance(fd, int)
        return fd

    def _timer(self, t: eventloop.TimerFd) -> int:
        fd = eventloop.new_timerfd(t)
        if not self.armed:
            self.to_arm.append((fd, t))
            return fd
        try:
            eventloop.arm_timerfd(fd, t)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def arm(self) -> None:
        """Start the timers (now and for every timerfd made from here on)."""
        self.armed = True
        todo, self.to_arm = self.to_arm, []
        for fd, t in todo:
            eventloop.arm_timerfd(fd, t)

    def file_fds(self, rec: ProcessRecord) -> dict[int, int]:
        """rec's deleted-but-open files, each made afresh once per restore, and its
        named files' descriptions that several descriptors share, each opened once per
        restore, and its named pipes' descriptions, each pipe made once per restore (all
        shared by the descriptors that shared them), and its POSIX message queues'
        descriptors, opened on those the restore made: its fd -> our descriptor of that
        description."""
        out: dict[int, int] = {}
        for i, u in enumerate(self.files):
            for j, d in enumerate(u.descriptions):
                for pid, fd in d.holders:
                    if pid == rec.pid:
                        out[fd] = self._made(i)[j]
        # (A carrier's plan, made ahead, has none yet: the rollback makes the queues, then
        # gives the carrier their descriptors, DeltaCR._queues_to_carriers.)
        out.update({h.fd: self.queue_fds[(rec.pid, h.fd)] for h in rec.mqueues
                    if (rec.pid, h.fd) in self.queue_fds})
        for fd, i in shared_files.holders_of(self.shared, rec.pid).items():
            if i not in self.shared_made:
                s = self.shared[i]
                try:
                    self.shared_made[i] = (shared_files.reopen(self.shm[s.path], s)
                                           if s.path in self.shm
                                           else shared_files.open_again(self._root(), s))
                except OSError as e:
                    raise native.CRError(e.errno or errno.EIO, (
                        f"{self.shared[i].path}, open in several descriptors: not in the "
                        f"restored tree ({e.strerror})")) from None
                self.loops.append(self.shared_made[i])
            out[fd] = self.shared_made[i]
        for fd, (i, j) in fifos.holders_of(self.fifos, rec.pid).items():
            out[fd] = self._fifo(i)[j]
        for fd, (i, j) in ptys.holders_of(self.ptys, rec.pid).items():
            out[fd] = self.ptys_made[i][j]
        return out

    def make_ptys(self, terminals: list[ptys.Pty], mntfd: int) -> None:
        """The pseudo-terminals, each a new pair at its index in the devpts of the
        generation `mntfd` (all at once: each takes the lowest free index there)."""
        self.ptys = terminals
        for p in terminals:
            try:
                made = ptys.make(p, mntfd)
            except (OSError, native.CRError) as e:
                raise native.CRError(e.errno or errno.EIO, (
                    f"pseudo-terminal {p.path}: making it again in the restored devpts "
                    f"failed ({e})")) from None
            self.ptys_made.append(made)
            self.loops += made

    def _fifo(self, i: int) -> list[int]:
        """The i-th named pipe's descriptions, made once per restore."""
        if i not in self.fifos_made:
            try:
                self.fifos_made[i] = fifos.make(self.fifos[i], self._root())
            except OSError as e:
                raise native.CRError(e.errno or errno.EIO, (
                    f"named pipe {self.fifos[i].path}: opening it in the restored tree "
                    f"failed ({e.strerror})")) from None
            self.loops += self.fifos_made[i]
        return self.fifos_made[i]

    def remaps(self, rec: ProcessRecord, changed: list[SharedMapping]
               ) -> list[native.Remap]:
        """rec's shared mappings of those objects (shared memory), mapped again from the
        same new object as every other process that shared it; of the sandbox's named
        files (capture.SharedMapping.named_file; read-only ones of its writable layer:
        ProcessRecord.mapped_ro), from the file in the restored tree; and its private
        mappings of files written in place since the checkpoint (`changed`:
        private_maps.changed), from the file in the restored tree with the pages it had
        written."""
        return [native.Remap(m.start, m.end, m.prot, self._made(i)[unlinked.MAPPING],
                             m.offset)
                for i, u in enumerate(self.files) for m in u.maps if m.pid == rec.pid] + [
            native.Remap(m.start, m.end, m.prot, self._named(m.path, m.writable), m.offset)
            for m in [*rec.shared, *rec.mapped_ro] if m.named_file] + [
            native.Remap(m.start, m.end, m.prot, self._named(m.path, False), m.offset,
                         private=True) for m in changed]

    def make_shm(self, files: list[shm_files.ShmFile], mntfd: int) -> None:
        """The /dev/shm files of the checkpoint, made again in the generation `mntfd`
        before any process reopens one by path (cr/shm_files.py)."""
        for f in files:
            try:
                self.shm[f.path] = shm_files.make(f, mntfd)
            except (OSError, native.CRError) as e:
                raise native.CRError(e.errno or errno.EIO, f"{f.path}: making it again in "
                                     f"the restored /dev/shm failed ({e})") from None

    def _named(self, path: str, writable: bool) -> int:
        """Our descriptor of a named file in the restored tree, opened once per restore
        (closed with the other objects made); a /dev/shm file's, as make_shm made it."""
        if path in self.shm:
            return self.shm[path]
        key = (path, writable)
        if key not in self.named:
            try:
                fd = open_in_root(self._root(), path, os.O_RDWR if writable else os.O_RDONLY)
            except OSError as e:
                raise native.CRError(e.errno or errno.EIO, f"{path}, mapped shared: not in "
                                     f"the restored tree ({e.strerror})") from None
            self.named[key] = fd
            self.loops.append(fd)
        return self.named[key]

    def cwd(self, rec: ProcessRecord) -> tuple[str, list[str]]:
        """The directory rec's child enters, and for a cwd deleted since rec entered it
        the stand-ins the child makes to enter it and removes again (deleted_cwd.py)."""
        if not deleted_cwd.is_deleted(rec.cwd):
            return rec.cwd, []
        try:
            return deleted_cwd.stand_ins(self._root(), rec.cwd)
        except OSError as e:
            raise native.CRError(e.errno or errno.EIO, f"pid {rec.nspid}: its deleted working "
                                 f"directory {rec.cwd}: no stand-in ({e})") from None

    def _root(self) -> int:
        if self.rootfd < 0:
            raise native.CRError(errno.EINVAL, "restoring a deleted-but-open file, an "
                                 "inotify instance or a deleted working directory needs "
                                 "the generation's root")
        return self.rootfd

    def make_objects(self) -> None:
        """Every deleted-but-open file and shared memory object, made now (ahead of a
        rollback) rather than by the first process that holds it."""
        for i in range(len(self.files)):
            self._made(i)

    def _made(self, i: int) -> dict[int, int]:
        """The i-th object, made once per restore."""
        if i not in self.made:
            u = self.files[i]
            self.made[i] = unlinked.recreate(u, self.rootfd if u.memory else self._root())
            self.loops += self.made[i].values()
        return self.made[i]

    def child_end(self, g: PipeGroup, e: PipeEnd) -> int:
        r, w = self.fresh[g.inode]
        return w if e.write else r

    def session_ends(self, name: str) -> tuple[int, int, int]:
        """Our ends for a restored session shell: (stdin write, stdout read, stderr read)."""
        ends = []
        for stream in ("0", "1", "2"):
            g = next((g for g in self.groups.values() if g.owner == f"session:{name}:{stream}"),
                     None)
            if g is None:
                raise Internal(f"session {name}: its pipe for fd {stream} was not captured")
            r, w = self.fresh[g.inode]
            ends.append(w if stream == "0" else r)
        return ends[0], ends[1], ends[2]

    def session_tty(self, name: str) -> int | None:
        """Our copy of the master of a restored session's terminal (None: on pipes)."""
        fd = ptys.owned_master(self.ptys, self.ptys_made, f"session:{name}")
        return None if fd is None else os.dup(fd)

    def daemon_ends(self) -> list[tuple[int, bool]]:
        """Other ends the daemon keeps: a read end to drain, or a write end to hold open."""
        out = []
        for g in self.groups.values():
            if g.owner != "daemon":
                continue
            r, w = self.fresh[g.inode]
            writers = any(e.write for e in g.ends)
            out.append((r, True) if writers else (w, False))
        return out

    def close_child_ends(self) -> None:
        """Close our copies of every end now held by a restored process (or by nobody)."""
        keep = set()
        for g in self.groups.values():
            r, w = self.fresh[g.inode]
            if g.owner.startswith("session:"):
                keep.add(w if g.owner.endswith(":0") else r)
            elif g.owner == "daemon":
                keep.add(r if any(e.write for e in g.ends) else w)
        for r, w in self.fresh.values():
            for fd in (r, w):
                if fd not in keep:
                    os.close(fd)
        self._close_loops()

    def _close_loops(self) -> None:
        fds, self.loops = self.loops, []
        self.to_arm.clear()
        self.unconnected.clear()
        self.unbound.clear()
        self.unnamed.clear()
        self.connections.clear()
        self.loops_of.clear()
        self.listeners_of.clear()
        self.objects.clear()
        self.made.clear()
        self.shared_made.clear()
        self.fifos_made.clear()
        self.ptys_made.clear()
        fds += self.shm.values()
        self.shm.clear()
        for fd in fds:
            os.close(fd)

    def close_all(self) -> None:
        for r, w in self.fresh.values():
            for fd in (r, w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._close_loops()


def _fresh_pair(p: eventloop.SocketPair, netns_pid: int) -> tuple[int, int]:
    """A new socket pair like `p` was, in netns_pid's network namespace (where the next
    checkpoint's sock_diag finds it), its queued bytes sent again (each end's data comes
    from the other end), its buffer sizes, options and non-blocking flags set, its ends
    shut down as they were; our fds. The options come after the bytes: an end passing
    credentials would be given a name by its first send (the kernel autobinds it), and
    the bytes carry none; the shutdowns last (nothing can be sent to an end shut down
    for reading)."""
    a, b = native.netns_socketpair(netns_pid, p.type)
    try:
        _set_bufs(a, p.bufs_a)
        _set_bufs(b, p.bufs_b)
        _send_all(b, p.data_a)
        _send_all(a, p.data_b)
        sockopts.set_all(a, p.opts_a)
        sockopts.set_all(b, p.opts_b)
        _shut(a, p.shut_a)
        _shut(b, p.shut_b)
        a.setblocking(not p.nonblock_a)
        b.setblocking(not p.nonblock_b)
        return a.detach(), b.detach()
    except BaseException:
        a.close()
        b.close()
        raise


def _lone_socket(x: eventloop.LoneSocket, netns_pid: int) -> int:
    """A new socket like `x` was, in netns_pid's network namespace; our fd. A widowed one
    is a fresh pair's end whose other end sent it the bytes waiting and was closed (which
    shuts a stream end down, as the original's peer's close did); sent one byte it never
    reads first if the original has ECONNRESET pending (the kernel's report of a peer
    closed with bytes unread)."""
    if not x.widowed:
        a = native.netns_socket(netns_pid, socket.AF_UNIX, x.type)
        try:
            _set_bufs(a, x.bufs)
            sockopts.set_all(a, x.opts)
            a.setblocking(not x.nonblock)
            return a.detach()
        except BaseException:
            a.close()
            raise
    a, b = native.netns_socketpair(netns_pid, x.type)
    with b:
        try:
            _set_bufs(a, x.bufs)
            _send_all(b, x.data)
            if x.reset:
                _send_all(a, b"\0")
            sockopts.set_all(a, x.opts)
            a.setblocking(not x.nonblock)
        except BaseException:
            a.close()
            raise
    return a.detach()


def _bind_names(p: eventloop.SocketPair, ab: tuple[int, int]) -> None:
    """Give p's ends (ours) their abstract names again, in their network namespace."""
    for fd, name in zip(ab, (p.name_a, p.name_b)):
        if name:
            with socket.socket(fileno=os.dup(fd)) as s:
                try:
                    s.bind(b"\0" + bytes.fromhex(name))
                except OSError as e:
                    raise native.CRError(e.errno or errno.EIO, f"socket pair {p.key}: "
                                         f"binding the name @{bytes.fromhex(name)!r}: "
                                         f"{e.strerror or e}") from e


def _shut(s: socket.socket, bits: int) -> None:
    """Shut s down as sock_diag's bits say (RCV_SHUTDOWN 1, SEND_SHUTDOWN 2)."""
    how = {1: socket.SHUT_RD, 2: socket.SHUT_WR, 3: socket.SHUT_RDWR}.get(bits & 3)
    if how is not None:
        s.shutdown(how)


def _set_bufs(s: socket.socket, bufs: tuple[int, int]) -> None:
    """The buffer sizes getsockopt reported: the kernel doubles what is set (its
    bookkeeping) and reports the doubled value, so half is set; FORCE passes the sysctl
    caps (root)."""
    snd, rcv = bufs
    if snd:
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, snd // 2)
    if rcv:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcv // 2)


def _send_all(src: socket.socket, data: bytes) -> None:
    """Queue `data` at src's peer again, in one send (a stream socket's queue)."""
    if data:
        src.setblocking(False)
        if src.send(data) != len(data):
            raise OSError(errno.ENOBUFS, "the queued bytes did not fit again")


def namespace_only(ipcns: int, ipc_maybe: bool) -> ProcessState:
    """A full checkpoint's state when no process runs: the IPC namespace's System V
    segments, message queues and semaphore sets and its POSIX message queues, which
    outlive their processes (none when `ipc_maybe` is false: no IPC call was seen since
    the namespace was last found empty)."""
    if not ipc_maybe:
        return ProcessState([], {}, {}, {})
    segments, refused = sysv_shm.capture(ipcns, [])
    queues: list[sysv_msg.Queue] = []
    sets: list[sysv_sem.Set] = []
    pqueues: list[posix_mq.Queue] = []
    if not refused:
        queues, refused = sysv_msg.capture(ipcns)
    if not refused:
        sets, refused = sysv_sem.capture(ipcns, [])
    if not refused:
        pqueues, refused = posix_mq.capture(ipcns, [])
    if refused:
        sysv_shm.close_saved(segments)
        sysv_msg.close_saved(queues)
        sysv_sem.close_saved(sets)
        raise _refusal(refused)
    return ProcessState([], {}, {}, {}, sysv_shm=segments, sysv_msg=queues, sysv_sem=sets,
                        posix_mq=pqueues)


def _refusal(refused: list[Refusal]) -> FailedPrecondition:
    message = ("cannot capture the sandbox's processes faithfully: " +
               "; ".join(str(r) for r in refused))
    queues = [r.unread for r in refused if r.unread is not None]
    if len(queues) == len(refused):
        return Unsettled(message + ". Checkpoint again once they have read them, or "
                         "checkpoint with mode=\"fs\" (files only)", queues)
    return FailedPrecondition(
        message + ". Stop those processes, or checkpoint with mode=\"fs\" (files only)")


# ---- jobs run on the ptrace thread ------------------------------------------------------------

@dataclass
class _Pass:
    """What a capture's pass on the ptrace thread made so far (the failure path undoes
    it), and the file snapshot's progress, which that pass waits for to resume."""

    stopped: list[native.Stopped] = field(default_factory=list)
    stops_done: bool = False
    templates: dict[int, native.Template] = field(default_factory=dict)
    records: list[ProcessRecord] = field(default_factory=list)
    records_ready: threading.Event = field(default_factory=threading.Event)
    refused: list[Refusal] = field(default_factory=list)  # final once records_ready is set
    files_done: threading.Event = field(default_factory=threading.Event)
    files_ok: bool = False
    resumed: bool = False


# How long the ptrace thread waits, templates made, for the file snapshot to commit so that
# it resumes the processes itself (one trip less through the trio loop); past that, the
# capture resumes them once the snapshot is done. Other sandboxes' ptrace work waits as long.
RESUME_WAIT_S = 0.005
# The records are read in the trio loop while this thread makes the templates: done long
# before, unless the daemon is in trouble.
RECORDS_WAIT_S = 10.0


def _stop_and_template(cap: _Pass, pids: list[int], thaw: Callable[[], None],
                       stopped: Callable[[], None], rss_kb: dict[int, int],
                       reuse: dict[int, native.Template], template: bool) -> None:
    """A capture's whole ptrace side in one trip to the ptrace thread: stop every process
    (the cgroup thawed once each is seized, so that it can reach its stop), call `stopped`
    (the file snapshot starts, and the trio loop reads the processes), and unless not
    `template`, template them (each without descriptors: _templates), wait for the records
    (nothing more if one is refused), and resume them if the snapshot has been committed
    by then. Each hop between this thread and the trio loop costs a thread wake-up (about
    0.1 ms)."""
    try:
        cap.stopped = _begin_stops(pids)
    finally:
        thaw()
    cap.stopped = _wait_all(cap.stopped)
    cap.stops_done = True
    stopped()
    if not template:  # made later (DeltaCR.make_templates), the processes held till then
        for s in cap.stopped:
            _died_in_checkpoint(s, s.hold)
        return
    cap.templates = _templates(cap.stopped, rss_kb, reuse)
    if not cap.records_ready.wait(RECORDS_WAIT_S):
        raise Internal("the capture's process records were not read in time")
    if cap.refused:  # the capture fails: its templates are released
        return
    _note_timers(cap.templates, cap.records)
    if cap.files_done.wait(RESUME_WAIT_S) and cap.files_ok:
        _resume_all(cap.stopped)
        cap.resumed = True
    _leave_groups(cap.templates, cap.records)


def _template_held(held: Held, records: list[ProcessRecord]) -> dict[int, native.Template]:
    """The templates of a `later` capture (as _stop_and_template makes them, groups
    left); none left on failure."""
    templates = _templates(held.stopped, {r.pid: r.rss_kb for r in records}, held.reuse)
    try:
        _note_timers(templates, records)
        _leave_groups(templates, records)
    except BaseException:
        _release_all(list(templates.values()))
        raise
    return templates


def _note_timers(templates: dict[int, native.Template],
                 records: list[ProcessRecord]) -> None:
    """Each record gets its template's interval and POSIX timers, its job-control stop,
    parent-death signal and subreaper flag (read at the stop; a shared template's from its
    own checkpoint): kept with it for a restore from disk."""
    for rec in records:
        tpl = templates.get(rec.pid)
        if tpl is not None:
            rec.itimers = tpl.itimers()
            rec.ptimers = tpl.ptimers()
            rec.stopped = tpl.group_stop()
            rec.pdeathsig, rec.subreaper = tpl.parent_death()


def _syscalls_at_stop(cap: _Pass, later: bool) -> Callable[[int], adoption.Calls]:
    """What each captured process's threads were calling at the checkpoint: read from
    its template (its stop may have been resumed), or, none made yet (a `later`
    capture), from its stop."""
    if not later:
        return adoption.template_syscalls(cap.templates)
    stops = {s.pid: s for s in cap.stopped}
    return lambda pid: stops[pid].syscalls()


def _begin_stops(pids: list[int]) -> list[native.Stopped]:
    """Seize every process; one already exiting (killed, e.g. by the OOM killer, while
    the cgroup froze) is gone at the checkpoint instant: it is left out."""
    out: list[native.Stopped] = []
    try:
        for pid in pids:
            try:
                out.append(native.begin_stop(pid))
            except native.CRError as e:
                # The kernel refuses to seize a task that is exiting (EPERM) or gone (ESRCH).
                if e.errno not in (errno.ESRCH, errno.EPERM) or not _exiting(pid):
                    raise
    except BaseException:
        _abort_all(out)
        raise
    return out


def _exiting(pid: int) -> bool:
    """Gone, a zombie, or with SIGKILL pending (it dies as soon as it runs)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True
    if fields.get("State", "").strip()[:1] in ("Z", "X"):
        return True
    sigkill = 1 << (signal.SIGKILL - 1)
    return any(int(fields.get(k, "0").strip() or "0", 16) & sigkill for k in ("SigPnd", "ShdPnd"))


# Where a process inside vfork() sleeps until its child execs or exits (the wait is inlined
# into kernel_clone on this kernel). Only a fatal signal ends that wait, so a ptrace stop
# never reaches such a process, and its child shares its memory until the exec.
VFORK_WCHANS = frozenset({b"kernel_clone", b"wait_for_vfork_done"})


def in_vfork(pids: list[int], threads: Mapping[int, int] | None = None,
             every_thread: bool = False) -> list[int]:
    """Those of `pids` that are waiting inside vfork() for their child, in any thread
    (`threads`: how many each has, where more than one; `every_thread`: look at each
    thread whatever the count)."""
    out = []
    for pid in pids:
        try:
            if every_thread or (threads or {}).get(pid, 1) > 1:
                wchans = [kernfs.read(f"/proc/{pid}/task/{t}/wchan")
                          for t in os.listdir(f"/proc/{pid}/task")]
            else:
                wchans = [kernfs.read(f"/proc/{pid}/wchan")]
        except OSError:
            continue
        if any(w.strip() in VFORK_WCHANS for w in wchans):
            out.append(pid)
    return out


STOP_TIMEOUT_S = 5.0
STOP_LOOK_S = 0.05  # between looks at a stop that has not come: is it inside vfork()?


def _wait_all(stopped: list[native.Stopped]) -> list[native.Stopped]:
    """Wait for every stop; those that exited before stopping are left out (freed)."""
    out: list[native.Stopped] = []
    for s in stopped:
        try:
            _wait_stop(s)
            out.append(s)
        except native.CRError as e:
            if e.errno == errno.ESRCH:
                s.abort()
                continue
            raise FailedPrecondition(f"pid {s.pid}: did not stop for the checkpoint: {e}. "
                                     "Retry, or checkpoint with mode=\"fs\"") from e
    return out


def _wait_stop(s: native.Stopped) -> None:
    """Wait for one stop. A process inside vfork() cannot stop until its child execs, and
    if that child is among those stopped here, never: the capture is then refused as
    Unsettled at once (the caller lets the processes run and captures again) instead of
    after STOP_TIMEOUT_S. The caller's check, with the cgroup frozen and before any
    seize, should leave no process in vfork(); a CI run once found a thread there all the
    same (not understood, not reproduced)."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while True:
        try:
            s.wait(STOP_LOOK_S)
            return
        except native.CRError as e:
            if e.errno != errno.ETIMEDOUT or time.monotonic() >= deadline:
                raise
            if in_vfork([s.pid], every_thread=True):
                raise Unsettled(
                    f"pid {s.pid} ({process_name(s.pid)}) was inside vfork() at its stop, "
                    "waiting for its child to exec. Retry the checkpoint, or checkpoint "
                    "with mode=\"fs\" (files only)") from None


def killed_templates(state: ProcessState) -> list[int]:
    """The checkpoint pids whose template is gone (a zombie, or no longer there): a
    template is a fork of a sandbox process, so the sandbox's own processes can kill it
    (`kill -9 -1`; the OOM killer too). Its checkpoint's processes then come back from
    its dump, or restart."""
    return [r.nspid for r in state.records
            if r.pid in state.templates and _exiting(state.templates[r.pid].pid)]


def process_name(pid: int) -> str:
    """Its command name (comm), "?" once gone: for errors that name a process."""
    try:
        return kernfs.read(f"/proc/{pid}/comm").decode().strip()
    except OSError:
        return "?"


def _templates(stopped: list[native.Stopped], rss_kb: dict[int, int],
               reuse: dict[int, native.Template]) -> dict[int, native.Template]:
    """Template every stopped process (those in `reuse`: share that template). All forks
    are started first, largest first, and collected smallest first: each fork's page-table
    copy runs in its own process, so on a second CPU the big ones proceed while we finish
    the small ones. A fork started and not collected (an error) is settled by the stop's
    abort. Each new template drops its descriptors at once (Template.drop_fds): its
    children get theirs afresh (_spawn_args), and its copies would keep the live
    processes' pipes, locks, ports and connections open after they close them."""
    out: dict[int, native.Template] = {}
    by_size = sorted((s for s in stopped if s.pid not in reuse),
                     key=lambda s: rss_kb.get(s.pid, 0), reverse=True)
    try:
        for s in stopped:
            if s.pid in reuse:
                out[s.pid] = reuse[s.pid].share()
        for s in by_size:
            _died_in_checkpoint(s, s.start_template)
        for s in reversed(by_size):
            out[s.pid] = _died_in_checkpoint(s, s.finish_template)
            out[s.pid].drop_fds()
    except BaseException:
        _release_all(list(out.values()))
        raise
    return out


def _died_in_checkpoint(s: native.Stopped, step: Callable[[], T]) -> T:
    """step(), with a process killed meanwhile (ESRCH) said as such."""
    try:
        return step()
    except native.CRError as e:
        if e.errno != errno.ESRCH:
            raise
        raise FailedPrecondition(
            f"pid {s.pid} died while it was being checkpointed ({e}; a SIGKILL, e.g. "
            "the sandbox ran out of memory): retry the checkpoint") from e


def _connected(rec: ProcessRecord) -> bool:
    """Whether rec holds a TCP connection (tcp.py)."""
    return bool(rec.loop and rec.loop.tcp)


def _abstract_name(rec: ProcessRecord) -> bool:
    """Whether rec listens on an abstract unix name (unix_listeners.py), or holds a
    datagram socket bound to one or connected to one (eventloop.LoneSocket): the killed
    process holds it until it exits (the sandbox's network namespace is the same)."""
    return bool(rec.loop and (any(u.abstract for u in rec.loop.unix_listeners) or any(
        x.abstract and x.name or x.to_abstract for x in rec.loop.lone)))


def _named_pair_end(rec: ProcessRecord) -> bool:
    """Whether rec holds a socket pair's end with an abstract name, bound by its spawn
    (a carrier's at the rollback, with its listeners: not a reason to have none) once the
    killed process has let it go."""
    return bool(rec.loop and any(p.name_a or p.name_b for p in rec.loop.pairs))


def _resume_all(stopped: list[native.Stopped]) -> None:
    errors = []
    for s in stopped:
        try:
            s.resume()
        except native.CRError as e:
            s.abort()
            # SIGKILLed since it was templated (e.g. by the OOM killer: the templates' page
            # tables are charged to the sandbox): it was captured at the checkpoint instant,
            # and what happens to it after is the sandbox's own business.
            if e.errno == errno.ESRCH or _exiting(s.pid):
                continue
            errors.append(str(e))
    if errors:
        raise Internal("resuming after the checkpoint failed: " + "; ".join(errors))


def _abort_all(stopped: list[native.Stopped]) -> None:
    """Undo stops in any state (the cgroup is thawed by now); handles that had not stopped
    yet are detached by the sweep once they do."""
    for s in stopped:
        try:
            s.abort()
        except native.CRError:
            pass
    native.sweep_stops(1.0)


def _quietly(calls: Iterable[Callable[[], None]]) -> None:
    """Best-effort cleanup on the ptrace thread: each call, whatever the others did."""
    for call in calls:
        try:
            call()
        except native.CRError:
            pass


def _release_all(templates: list[native.Template]) -> None:
    _quietly(t.release for t in templates)


@dataclass
class Elsewhere:
    """Another sandbox to restore into (a fork): its pid namespace (nested below the
    templates'), a pidfd of its init (for its net/uts/ipc/cgroup namespaces) and its open
    cgroup.procs files."""
    pidns_fd: int
    init_pidfd: int
    cgroup_fds: list[int]
    init_pid: int           # the same init (the network namespace a restore's pairs use)
    fresh: bool = True      # a new fork: no pid of the namespace is taken yet
    # A pid still taken (e.g. as the process-group id of another checkpoint's template,
    # or as a template's own pid) gives the process a new pid instead of failing the
    # restore (a sandbox rolling back: templates rebuilt from a dump, or a fork's
    # ancestor's, whose children are born among the fork's own templates).
    pid_fallback: bool = False


@dataclass
class _Spawn:
    tpl: native.Template
    fdmap: dict[int, int]
    files: list[native.ReopenFile]
    cwd: str
    mntfd: int
    listens: list[native.ListenSocket]
    nspid: int | None = None
    into: Elsewhere | None = None
    pgid: int = 0
    renumbered: bool = False   # the original pid was held: restored with a new one
    lane: native.Template | None = None   # a copy of tpl on the lane thread (open_lanes)
    cloexec: set[int] = field(default_factory=set)   # fdmap targets to close on exec
    epolls: list[native.Epoll] = field(default_factory=list)  # made in the child, last
    threaded: bool = False     # its threads need their tids back: never a new pid
    hold: bool = False         # spawn it held (a parent of adopted children: adoption.py)
    held: native.Held | None = None
    # adopted (adoption.py): restored from `image` as this held parent's own child
    parent: native.Held | None = None
    image: str | None = None
    rootfd: int = -1
    remaps: list[native.Remap] = field(default_factory=list)  # its shared memory, made anew
    locks: list[native.FileLock] = field(default_factory=list)  # its file locks, taken again
    ctty: int = -1             # its fd of the pty it takes back as its controlling terminal
    mlocks: list[native.MemoryLock] = field(default_factory=list)  # its memory locked again
    cwd_made: list[str] = field(default_factory=list)   # a deleted cwd's (deleted_cwd.py)


async def _until_reaped(delay: float) -> float:
    """Between attempts at a pid still taken (EEXIST) by a killed original: reap it if it
    was a zombie waiting for us, else wait `delay`; the next attempt's delay."""
    if reap_orphans():
        return delay
    await trio.sleep(delay)
    return min(delay * 2, 0.05)


def _shared_listeners(state: ProcessState) -> set[int]:
    """The inodes of the TCP listeners more than one process holds (a fork shares them)."""
    held = collections.Counter(ino for r in state.records
                               for ino in {ls.ino for ls in r.listens if ls.ino})
    return {ino for ino, n in held.items() if n > 1}


def _time_wait_ports(state: ProcessState) -> set[int]:
    """The ports of the listeners a rollback binds again without SO_REUSEADDR: one
    connection in TIME_WAIT there would block the bind (tcp.clear_time_wait)."""
    return {struct.unpack_from("!H", ls.addr, 2)[0]
            for r in state.records for ls in r.listens if not ls.reuseaddr
            and ls.listens}


def _orphan_addresses(state: ProcessState) -> set[tuple[str, int, str, int]]:
    """Where the half-closed connections' orphan ends are (tcp.orphan_peer): the killed
    timeline's there would keep the restore from making them (tcp.clear_orphans)."""
    return tcp.orphan_addresses([c for r in state.records if r.loop for c in r.loop.tcp])


def _leader(rec: ProcessRecord) -> bool:
    """Leads its process group or session (host-namespace ids at the checkpoint)."""
    return rec.pid in (rec.pgid, rec.sid)


def _spawn_args(state: ProcessState, plan: _PipePlan, rec: ProcessRecord,
                mntfd: int, into: Elsewhere | None = None,
                changed: list[SharedMapping] | None = None) -> _Spawn:
    """What a child of rec's template needs: its pipes from `plan`, its files, its cwd,
    its private mappings of files written in place since the checkpoint (`changed`,
    looked at if None)."""
    fdmap = {e.fd: plan.child_end(g, e) for g in state.pipes.values()
             for e in g.ends if e.pid == rec.pid}
    netns_pid = into.init_pid if into is not None else state.templates[rec.pid].pid
    if rec.loop:
        fdmap.update(plan.loop_fds(rec, netns_pid))
    ahead = plan.listener_fds(rec, netns_pid)   # the others the child makes
    fdmap.update(ahead)
    fdmap.update(plan.file_fds(rec))
    cloexec = {f.fd for f in rec.fds if f.fd in fdmap and f.flags & os.O_CLOEXEC}
    queues = {h.fd for h in rec.mqueues}   # "/NAME": not a path (posix_mq.py)
    files = [native.ReopenFile(f.fd, f.path, f.flags, -1 if f.rdev == DEV_TTY else f.pos)
             for f in rec.fds if f.kind in ("file", "dir", "chr") and not f.deleted
             and f.fd not in fdmap and f.fd not in queues]
    cwd, cwd_made = plan.cwd(rec)
    return _Spawn(state.templates[rec.pid], fdmap, files, cwd, mntfd,
                  [ls for ls in rec.listens if ls.fd not in ahead], cwd_made=cwd_made,
                  lane=state.lanes.get(rec.pid), cloexec=cloexec,
                  epolls=pidfds.without_pidfd_watches(rec, rec.loop.epolls) if rec.loop
                  else [], threaded=rec.threads > 1,
                  remaps=plan.remaps(rec, _changed_maps(state, rec) if changed is None
                                     else changed) + sysv_shm.remaps(state.sysv_shm, rec.pid),
                  locks=_locks(rec), mlocks=rec.mlocks)


def _detach_segments(templates: Mapping[int, native.Template],
                     segments: list[sysv_shm.Segment], reused: Collection[int]) -> None:
    """On the ptrace thread: every new template's System V attachments detached
    (native.Template.shmdt: the restore makes the segments and its children attach them);
    a reused one's were at its own capture."""
    for s in segments:
        for a in s.attached:
            if a.pid not in reused:
                templates[a.pid].shmdt(a.start)


def _need_ipcns(ipcns: int, what: str) -> None:
    if ipcns < 0:
        raise Internal(f"{what} to restore, but no IPC namespace given")


def _make_segments(state: ProcessState, ipcns: int) -> str:
    """The checkpoint's System V segments, made again in the namespace of `ipcns`; the
    note sysv_shm.make gives."""
    _need_ipcns(ipcns, "System V shared memory")
    try:
        return sysv_shm.make(ipcns, state.sysv_shm)
    except native.CRError as e:
        raise native.CRError(e.errno or errno.EIO, f"making the System V shared memory "
                             f"segments again failed ({e})") from None


def _image_remaps(remaps: list[native.Remap]) -> list[native.Remap]:
    """The remaps of a process restored from an image, which maps its files from the
    restored tree already (criu_incr.c): no private mapping to make again."""
    return [m for m in remaps if not m.private]


def _image_kwargs(sp: _Spawn, set_tid: list[int] | None, into: bool) -> dict:
    """_spawn_kwargs for a process restored from an image (_image_remaps)."""
    kwargs = _spawn_kwargs(sp, set_tid, into)
    kwargs["remaps"] = _image_remaps(kwargs["remaps"])
    return kwargs


def _changed_maps(state: ProcessState, rec: ProcessRecord) -> list[SharedMapping]:
    """rec's private mappings whose file was written in place since the checkpoint."""
    return private_maps.changed(rec, state.templates[rec.pid].pid, state.captured_ns)


def _locks(rec: ProcessRecord) -> list[native.FileLock]:
    """The file locks rec's process held (capture refuses those that cannot be taken
    again, and flock and OFD locks on a description it shares)."""
    out = []
    for f in rec.fds:
        for text in f.locks:
            lock = native.FileLock.parse(f.fd, text)
            if lock is None:
                raise Internal(f"pid {rec.nspid}: fd {f.fd}: lock {text!r} cannot be taken "
                               "again")
            out.append(lock)
    return out


def _carrier_of(sp: _Spawn) -> native.Carrier:
    return sp.tpl.spawn_carrier(fds=sp.fdmap, files=sp.files, cwd=sp.cwd, mntns_fd=sp.mntfd,
                                cloexec_fds=sp.cloexec, epolls=sp.epolls, remaps=sp.remaps,
                                locks=sp.locks, ctty=sp.ctty, mlocks=sp.mlocks,
                                cwd_made=sp.cwd_made)


def _keep_all(carriers: list[native.Carrier]) -> None:
    for c in carriers:
        if c.killed:
            continue
        try:
            c.keep()
        except native.CRError as e:
            log.warning("carrier %d could not become a keeper (%s): killed; its process "
                        "runs on", c.pid, e)


def _kill_carriers(carriers: list[native.Carrier]) -> None:
    """Kill and reap carriers or keepers (ptrace thread)."""
    _quietly(c.kill for c in carriers)


def _own_groups(records: list[ProcessRecord]) -> dict[int, int]:
    """Process groups whose leader is captured and leads no session (host pgid -> the
    leader's pid in the sandbox). Their templates leave them (Template.own_group): a
    group's id stays allocated while a member exists, and the templates would keep the
    leader's pid taken, so that a rollback could not give it back. A session's cannot be
    freed so (no call joins an existing session: children are born in theirs)."""
    return {r.pgid: r.nspid for r in records if r.pid == r.pgid and r.pid != r.sid}


def lone_leaders(records: list[ProcessRecord], born: set[int] | None = None) -> set[int]:
    """Session leaders that are the only captured process of their session (a server
    started with setsid, a kernel by jupyter_client), or that lead a session every other
    process of which a restore gives back to its restored parent (_born_sessions: a
    pty's, ...): their templates leave the session (Template.own_session; so do those of
    the session's others: born_members), which frees its id, the leader's pid, once the
    live processes are gone; the leader's child gets it back and leads a session again.
    With other members, the session's templates stay in it: its members must be born in
    it."""
    sessions = collections.Counter(r.sid for r in records)
    born = _born_sessions(records) if born is None else born
    return {r.pid for r in records if r.pid == r.sid
            and (sessions[r.sid] == 1 or r.sid in born)}


def _born_sessions(records: list[ProcessRecord]) -> set[int]:
    """Sessions whose leader leads them again and whose other members are all born in
    them of their restored parents: a pty's (ptys.py), an unprivileged leader's whose
    template is rebuilt as root's (creds.py), and one whose members are all adopted
    anyway (adoption.adopted_sessions)."""
    return (ptys.terminal_sessions(records) | creds.sessions(records)
            | adoption.adopted_sessions(records))


def born_members(records: list[ProcessRecord], born: set[int] | None = None) -> set[int]:
    """The processes of a _born_sessions session (`born`, computed if not given) other
    than its leader: each is born of its restored parent, in the restored session
    (adoption.adoptees' `forced`)."""
    born = _born_sessions(records) if born is None else born
    return {r.pid for r in records if r.sid in born and r.pid != r.sid}


def _leave_groups(templates: dict[int, native.Template], records: list[ProcessRecord]) -> None:
    """On the ptrace thread, once the capture's processes run again: move the templates
    of _own_groups' members out of their group, and those of lone_leaders out of their
    session (one injected setpgid or setsid each)."""
    groups = _own_groups(records)
    born = _born_sessions(records)
    lone = lone_leaders(records, born) | born_members(records, born)
    for rec in records:
        tpl = templates.get(rec.pid)
        if rec.pid in lone and tpl is not None and not tpl.own_session_done:
            try:
                tpl.own_session()
            except native.CRError as e:  # it comes back with a new pid
                log.warning("template of pid %d: leaving its session: %s", rec.pid, e)
        elif rec.pgid in groups and tpl is not None and not tpl.own_group_done:
            try:
                tpl.own_group()
            except native.CRError as e:  # its group's leader comes back with a new pid
                log.warning("template of pid %d: leaving its process group: %s", rec.pid, e)


def _rollback_ids(state: ProcessState) -> dict[int, tuple[int | None, int]]:
    """Record pid -> (the pid to give back, or None for a new one; the process group to
    join, or 0 to stay in the template's; NEW_SESSION: lead a session) for each process's
    child at a rollback. A session leader's pid stays allocated while its templates exist
    (they are in its session) unless it is alone in it (lone_leaders), as does a group
    leader's while a template is in its group (see _own_groups): such a leader comes back
    with a new pid. A child of a template that left its group joins it again by the
    leader's pid (which creates it, for the leader itself)."""
    groups = _own_groups(state.records)
    stayed = {r.pgid for r in state.records if not state.templates[r.pid].own_group_done}
    out: dict[int, tuple[int | None, int]] = {}
    for rec in state.records:
        if _new_session(state, rec):
            out[rec.pid] = rec.nspid, native.NEW_SESSION
            continue
        freed = rec.pgid in groups and rec.pgid not in stayed
        keep = not _leader(rec) or (freed and rec.pid != rec.sid)
        pgid = groups.get(rec.pgid, 0) if state.templates[rec.pid].own_group_done else 0
        out[rec.pid] = (rec.nspid if keep else None), pgid
    return out


def _ctty(state: ProcessState, rec: ProcessRecord, pgid: int) -> int:
    """rec's fd of the pty its child takes back as its controlling terminal, or -1. Only
    a session's new leader can (pgid NEW_SESSION: the capture let only lone leaders
    through, cr/ptys.py); one whose template could not leave the session fails the
    restore rather than come back without its terminal."""
    fd = ptys.controlling_fd(state.ptys, rec.pid)
    if fd >= 0 and pgid != native.NEW_SESSION:
        raise native.CRError(errno.EPERM, (
            f"pid {rec.nspid}: it cannot lead a session again (its template did not leave "
            "the session), so its controlling terminal cannot be given back"))
    return fd


def _new_session(state: ProcessState, rec: ProcessRecord) -> bool:
    """Whether rec's child leads a session of its own again: a lone session leader whose
    template left the session (lone_leaders)."""
    return rec.pid in state.lone and state.templates[rec.pid].own_session_done


def _restore_order(records: list[ProcessRecord],
                   family: Mapping[int, int]) -> list[ProcessRecord]:
    """`records` (leaders first) reordered so that a parent comes before the children it
    adopts (adoption.py) and a group's leader before its members, otherwise as given
    (without adoptions, leaders first already is)."""
    if not family:
        return records
    pids = {r.pid for r in records}
    needs = {r.pid: {family[r.pid]} if r.pid in family else set() for r in records}
    for r in records:
        if r.pgid != r.pid and r.pgid in pids:
            needs[r.pid].add(r.pgid)
    out: list[ProcessRecord] = []
    done: set[int] = set()
    while len(out) < len(records):
        rest = [r for r in records if r.pid not in done]
        r = next((r for r in rest if needs[r.pid] <= done), rest[0])  # a tree: no cycle
        out.append(r)
        done.add(r.pid)
    return out


def _leaders_first(records: list[ProcessRecord]) -> list[ProcessRecord]:
    """Group and session leaders first (stable otherwise): before the members that join
    their group; in a rollback, those that get new pids need not wait for the killed
    processes to free theirs."""
    return sorted(records, key=lambda r: not _leader(r))


# How long the ptrace thread waits for a rollback's killed processes to exit before it
# births the rest anyway (they then retry through the usual path).
VICTIMS_TIMEOUT_S = 0.5


def _spawn_kwargs(sp: _Spawn, set_tid: list[int] | None, into: bool) -> dict:
    """native spawn() arguments for sp, with the pid set_tid; `into`: joining the target
    sandbox's namespaces and cgroups (not for a process born of a parent already there)."""
    kwargs = dict(
        fds=sp.fdmap, files=sp.files, cwd=sp.cwd, mntns_fd=sp.mntfd, set_tid=set_tid,
        cloexec_fds=sp.cloexec, epolls=sp.epolls, remaps=sp.remaps, pgid=sp.pgid,
        listens=sp.listens, locks=sp.locks, ctty=sp.ctty, mlocks=sp.mlocks,
        cwd_made=sp.cwd_made)
    if into and sp.into is not None:
        kwargs.update(pidns_fd=sp.into.pidns_fd, ns_pidfd=sp.into.init_pidfd,
                      cgroup_fds=sp.into.cgroup_fds)
    return kwargs


def _spawn_once(sp: _Spawn, set_tid: list[int] | None,
                tpl: native.Template | None = None) -> int:
    """Spawn sp's process (held: sp.held, when sp.hold or adopted): its pid."""
    if sp.parent is not None:   # from its image as its parent's child, in the parent's
        assert sp.image is not None   # namespaces and cgroup
        sp.held = sp.parent.adopt(sp.image, sp.rootfd, sp.tpl,
                                  **_spawn_kwargs(sp, set_tid, False))
        return sp.held.pid
    kwargs = _spawn_kwargs(sp, set_tid, True)
    if sp.hold:
        sp.held = (tpl or sp.tpl).spawn_held(**kwargs)
        return sp.held.pid
    return (tpl or sp.tpl).spawn(**kwargs)


def _adopt_group(state: ProcessState, rec: ProcessRecord, spawn: _Spawn, out: Restored,
                 groups: dict[int, int]) -> ProcessRecord:
    """Set spawn's process group for rec, born its restored parent's own child
    (adoption.group); returns that parent's record."""
    parent = next(r for r in state.records if r.pid == state.family[rec.pid])
    ns_pids = groups if spawn.into is not None else {
        r.pid: r.nspid for r in state.records if r.nspid not in out.renumbered}
    spawn.pgid = adoption.group(rec, parent, spawn.pgid, ns_pids)
    return parent


def _pid(sp: _Spawn) -> list[int] | None:
    """The set_tid of sp's pid, if it keeps one."""
    return [sp.nspid] if sp.nspid is not None else None


def _chains(state: ProcessState) -> dict[int, list[int]]:
    """Family root -> the path (record pids, root first) to its biggest adopted child when
    that child outweighs the root (CHAIN_MIN_GAIN_KB): all single-threaded, the
    ancestors mapping no memory shared with another process (their images cannot share
    it again), at most native's chain length."""
    by_pid = {r.pid: r for r in state.records}
    best: dict[int, list[int]] = {}
    for kid in state.records:
        if kid.pid not in state.family or kid.threads != 1 or kid.creds is not None:
            continue   # (one without the rights to spawn itself: creds.py)
        path = [kid.pid]
        while path[-1] in state.family:
            path.append(state.family[path[-1]])
        path.reverse()
        ancestors = [by_pid[p] for p in path[:-1]]
        if (len(ancestors) > native.CHAIN_MAX
                or any(r.threads != 1 or r.shared for r in ancestors)
                or kid.rss_kb < ancestors[0].rss_kb + CHAIN_MIN_GAIN_KB):
            continue
        old = best.get(path[0])
        if old is None or by_pid[old[-1]].rss_kb < kid.rss_kb:
            best[path[0]] = path
    return best


def _foregrounds(state: ProcessState, held: dict[int, native.Held]
                 ) -> list[tuple[native.Held, int, int]]:
    """(held leader, its fd of its terminal, the foreground group there) of each pty whose
    foreground group was not its leader's (its members are restored by now)."""
    out = []
    for p in state.ptys:
        if p.foreground:
            if p.leader not in held:
                raise native.CRError(errno.ESRCH, (
                    f"{p.path}: its session's leader was not restored held, so its "
                    "foreground process group cannot be given back"))
            out.append((held[p.leader], p.leader_fd, p.foreground))
    return out


def _give_pidfds(state: ProcessState, held: dict[int, native.Held]) -> None:
    """The held restored parents' pidfds of their children, which exist now (pidfds.py)."""
    for rec in state.records:
        if rec.pidfds:
            if rec.pid not in held or any(p.child not in held for p in rec.pidfds):
                raise native.CRError(errno.EPROTO, f"pid {rec.nspid}: its pidfds' children "
                                     "were not restored as its own")
            pidfds.install(rec, held[rec.pid], lambda pid: held[pid].pid)


def _release_held(held: list[native.Held],
                  foregrounds: list[tuple[native.Held, int, int]] = ()) -> None:
    """Let held processes run (children before their parents), the terminals'
    foreground groups set first; on a failure the rest are left for _kill_held."""
    for h, fd, pgrp in foregrounds:
        h.set_foreground(fd, pgrp)
    for h in held:
        h.release()


def _kill_held(held: list[native.Held]) -> None:
    for h in held:
        h.kill()   # a no-op for one released already
