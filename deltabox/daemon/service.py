"""The daemon's core: sandboxes, checkpoints, rollback and fork (all async, on trio).

Every operation that changes a sandbox's file system or processes holds that sandbox's lock;
the SQLite transaction at the end of each operation is its commit point. What exists on disk
but is not committed is garbage that `recover()` removes on the next start.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import logging
import math
import os
import re
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import trio

from .. import __version__, kernfs
from ..errors import (DeadlineExceeded, DeltaBoxError, FailedPrecondition, Internal,
                      InvalidArgument, NotFound, ResourceExhausted, Unavailable)
from ..fs import image as images
from ..fs.diff import diff_stacks
from ..fs.files import FileStat, SandboxFiles, check_mode, check_path
from ..fs.mask import build_mask
from ..fs.store import Changes, Store, close_store
from ..models import CreateParams
from ..sandbox import execute, quota, runtime
from ..sandbox.cgroups import Cgroup, CgroupDriver, Limits, describe_favordynmods
from ..sandbox.reaper import wait_exited
from ..sandbox.session import AdoptedShell, Session
from ..sandbox.userns import IdMap
from ..background import GuardedNursery, run_all
from ..cr import hostmem, native, tcp
from ..cr.capture import ProcessRecord, Unsettled, waiting
from ..cr.engine import (DeltaCR, Elsewhere, Prespawned, ProcessState, Restored, Resumed,
                         highest_pid, in_vfork, killed_templates, namespace_only,
                         process_name, stopped_calls)
from ..inspector import Decision, TurnEffects, touched_processes, untouched_processes
from ..inspector.effects import LIST_CAP
from . import budget
from . import faults
from .faults import crash_point
from .foreground import Foreground
from .db import CheckpointRow, Database, SandboxRow
from .dumps import NOT_COMPLETED, Dumps, init_seccomp_filters
from .pending import EarlyAnswer, PendingCheckpoints, Underway
from .scheduler import IOScheduler
from .spares import Kind as SpareKind, Spare, Spares
from .turns import Turns
from .warm import Ready, WarmPool, source_layer, stacked_key

log = logging.getLogger("deltaboxd")

SANDBOX_ID = re.compile(r"^sb-[0-9a-f]{10}$")
CHECKPOINT_ID = re.compile(r"^cp-[0-9a-f]{10}$")
SESSION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "USER": "root",
}
MAX_FORK = 256
# Times a fork looks for its templates again when they went while it waited for their
# sandbox's lock.
FORK_SOURCE_TRIES = 3
# Checkpoint layers a sandbox's overlay may stack under its own (each fork adds one; the
# image's mask and root come below them, and dbx-mkroot takes at most 8 lowers).
MAX_BASES = 4
# The kernel nests pid namespaces at most 32 deep (host = level 0); leave headroom.
MAX_NEST_LEVEL = 30
RETIRE_WORKERS = 2    # tasks deleting retired layers (each job also takes an I/O slot)
RETIRE_RETRY_S = (0.5, 2.0)  # pauses before trying a failed layer deletion again
CLEAN_AFTER_DELETES = 16  # deleted layers that make btrfs drop them at once (store.py)
CLEAN_INTERVAL_S = 1.0
VFORK_ATTEMPTS = 20   # thaw-and-refreeze rounds while a process is inside vfork()
VFORK_WAIT_S = 0.2    # per round, for its child to exec
UNREAD_ATTEMPTS = 4   # captures while a state passes (events or descriptors unread, a vfork)
UNREAD_WAIT_S = 0.25  # between them, for it to read them


@dataclass
class Config:
    state_dir: Path
    socket: str
    store_size_gb: int = 64
    store_backend: str = "auto"
    default_memory_mb: int = 4096
    default_pids_max: int = 4096
    default_disk_mb: int = 10240         # quota per writable layer; 0 = none
    max_sandboxes: int = 1024
    warm_per_sandbox: int = 32
    prewarm_mb: int = 64                 # per ready generation, its layer's files read ahead
    quiet_wait_ms: int = 1000            # deferrable work's wait for a command (foreground.py)
    fork_spares: int = 32                # inits booted ahead per sandbox that forks (spares.py)
    durable: bool = False
    templates_per_sandbox: int = 32
    template_budget_mb: int = 0          # host-wide memory for templates; 0 = no limit
    # host ids of the sandboxes that have a user namespace (their 0..count-1)
    userns: IdMap = field(default_factory=lambda: IdMap(100000, 65536))


@dataclass
class Live:
    """Daemon-side state of a running sandbox (nothing here is durable)."""

    rt: runtime.Runtime
    lock: trio.Lock = field(default_factory=trio.Lock)
    sessions: dict[str, Session] = field(default_factory=dict)
    restarted: set[str] = field(default_factory=set)     # sessions lost by a rollback
    procs: set[trio.Process] = field(default_factory=set)
    # checkpoint id -> the processes captured at it (templates live in this sandbox's pid
    # namespace); checkpoints whose `procs_of` names it restore these
    captured: dict[str, ProcessState] = field(default_factory=dict)
    held_fds: list[int] = field(default_factory=list)    # pipe ends kept for restored processes
    evicted: set[str] = field(default_factory=set)       # checkpoints whose templates went
    # A fork that runs processes restored from another sandbox's templates lives in a pid
    # namespace nested below that sandbox's (see fork()): its id, else None.
    nest_parent: str | None = None
    # The `procs_of` of the checkpoint the running processes were restored from or captured
    # at (None: they were started afresh since): a checkpoint may reuse its parent's
    # captured processes only if they are the ones running (daemon/turns.py).
    procs_from: str | None = None
    # Evicted or deleted checkpoints' templates waiting to be released (_release_later):
    # still processes of the sandbox, and ours, until then.
    releasing: list[ProcessState] = field(default_factory=list)
    # of those, the ones waiting for their own checkpoint's pending dump first, by its id:
    # a rollback or fork to that checkpoint takes them back (Daemon._take_back)
    held: dict[str, ProcessState] = field(default_factory=dict)
    # pidfds of processes a rollback killed that may not have exited yet (reaper.wait_exited)
    dying: list[int] = field(default_factory=list)
    # carriers spawned ahead for rollbacks (warm.py), held stopped: not running yet
    prespawned: set[int] = field(default_factory=set)
    # host pid of a running process born from a carrier -> its keeper (engine.restore)
    keepers: dict[int, native.Carrier] = field(default_factory=dict)
    # set once the last rollback's carriers are keepers (_keep_carriers); None: none made
    keeping: trio.Event | None = None
    # keepers of processes a rollback killed, until reaped (_victims_gone)
    old_keepers: list[OldKeepers] = field(default_factory=list)
    # a checkpoint captured a TCP connection: a rollback closes the killed processes'
    # connections silently first (cr/tcp.py: their addresses are the restored ones')
    tcp_captured: bool = False
    # IPC objects may exist in its namespace: no check found it empty since the
    # inspector last saw an IPC call or missed part of a turn (_look_at_ipc)
    ipc_seen: bool = True
    # A rollback's: the IPC objects made since its checkpoint go before its processes
    # come back (_clear_ipc), those not the checkpoint's shared memory segments
    ipc_clear: bool = False
    # its IPC namespace's mqueue directory (native.mqueue_dir), opened at the first IPC
    # check and kept: each check lists it with no mount of its own
    mq_dir: int = -1
    init_filters: int | None = None  # seccomp filters of its init (Daemon._init_filters)
    # (procs_from, pids): processes that ran in a turn whose checkpoint kept the parent's
    # templates for them (Daemon._note_drift): not reused while procs_from is the same
    drift: tuple[str | None, frozenset[int]] = (None, frozenset())

    def drifted(self) -> frozenset[int]:
        """The drift recorded for the running processes (none once they are others)."""
        return self.drift[1] if self.drift[0] == self.procs_from else frozenset()

    @property
    def template_pids(self) -> set[int]:
        """The daemon's stopped processes in the sandbox's cgroup: templates, carriers and
        keepers. Not the sandbox's own (never captured or killed as such)."""
        return ({p for st in [*self.captured.values(), *self.releasing]
                 for p in st.template_pids} | self.prespawned |
                {k.pid for k in self.keepers.values()} |
                {k.pid for old in self.old_keepers for k in old.carriers})

    async def kill_group(self, group: int) -> None:
        """Kill a process group of the sandbox (host id) but the daemon's stopped processes
        in it: a session's close, whose processes' templates share their group."""
        await runtime.kill_group(self.rt.cgroup, group, self.rt.keep_pids | self.template_pids)

    async def kill_command(self, helper: int) -> bool:
        """Kill the command that dbx-enter `helper` (host pid) runs with its process group,
        but the daemon's stopped processes (kill_group); False if it is not found. Its
        command is its child in the sandbox's cgroup that is not a template: a template
        takes its original's parent, and so does a fork child's process spawned from one."""
        spared = self.rt.keep_pids | self.template_pids
        try:
            kids = kernfs.read(f"/proc/{helper}/task/{helper}/children").split()
        except OSError:
            return False
        command = {int(k) for k in kids} & self.rt.cgroup.pids() - spared
        if len(command) != 1:
            return False
        pid = command.pop()
        if runtime.own_group(pid) is None:
            # Not yet out of the daemon's group (runtime.own_group), so it has no children
            # yet: killed alone, then the group it may be making this instant (its pid).
            self.rt.cgroup.kill_one(pid)
        await runtime.kill_group(self.rt.cgroup, pid, spared)
        return True


@dataclass
class Kept:
    """What a checkpoint may share of its parent's templates (Daemon._kept_templates):
    running processes (host pids) the turn left untouched, and the parent's templates by
    pid in the sandbox."""
    untouched: set[int] = field(default_factory=set)
    by_nspid: dict[int, native.Template] = field(default_factory=dict)

    def templates_for(self, procs: dict[int, native.ProcStatus]) -> dict[int, native.Template]:
        """Host pid -> template, for the untouched processes among `procs` that the parent
        holds (same pid in the sandbox)."""
        out = {}
        for pid, st in procs.items():
            tpl = self.by_nspid.get(st.nspid[-1] if st.nspid else pid)
            if pid in self.untouched and tpl is not None and not tpl.released:
                out[pid] = tpl
        return out


def _template_of(live: Live, host_pid: int) -> str:
    """Whose template host_pid is, for a log line: the checkpoint's key and the process
    it copies (its pid in the sandbox, command, and whether its group's and session's
    leaders were captured with it: a group or session whose leader was not keeps its id
    held by the templates); "" if it is none of the sandbox's templates."""
    for key, st in live.captured.items():
        for rec in st.records:
            tpl = st.templates.get(rec.pid)
            if tpl is not None and tpl.pid == host_pid:
                pids = {r.pid for r in st.records}
                return (f": a template of {key}, of pid {rec.nspid} ({rec.cmd[:40]}); its "
                        f"group's leader {'captured' if rec.pgid in pids else 'not captured'}"
                        f", its session's {'captured' if rec.sid in pids else 'not captured'}"
                        f"{', it left its group' if tpl.own_group_done else ''}")
    return ""


async def _close_sessions(sessions: dict[str, Session]) -> None:
    """Close sessions whose shells a rollback killed: release our ends of their pipes."""
    for sess in sessions.values():
        await sess.close()


def _stacked_bases(row: SandboxRow, cp: CheckpointRow) -> list[str] | None:
    """The sandbox's bases if it stacks `cp`'s layer on `cp`'s own bases (a shared-layer
    fork child going back to the checkpoint it was forked from): a rollback to `cp` then
    gives it a new empty layer over them, as the fork did, so its files stay shared and
    read-only below; a clone of `cp`'s layer would be a writable copy of all of them, read
    cold from a new snapshot. None otherwise."""
    if row.bases and row.bases[0] == cp.layer_id and row.bases[1:] == cp.bases:
        return list(row.bases)
    return None


def _warm_key(cp: CheckpointRow, stacked: list[str] | None) -> str:
    """What the warm pool prepares for a rollback to `cp` (warm.py): a clone of its layer,
    or an empty layer over it for a sandbox that stacks it."""
    return stacked_key(cp.layer_id) if stacked else cp.layer_id


def _keep_stacking(decision: Decision, row: SandboxRow, parent: CheckpointRow | None
                   ) -> Decision:
    """A `skipped` checkpoint stands for its parent's files: its parent's layer on its
    parent's read-only bases. A shared-layer fork child that changed nothing since the
    checkpoint it came from has those files as its read-only base under an empty layer of
    its own; an alias would make a rollback to it give the child a writable copy of its
    whole base, every file of which is then read from a new snapshot (cold page cache, and
    counted in its disk quota) while its siblings share one. Such a turn takes a file
    snapshot of the child's own layer instead (answered before it when nothing runs)."""
    if decision.kind != "skipped" or parent is None or parent.bases == row.bases:
        return decision
    return Decision(kind="fs", reasons=[
        *decision.reasons, f"a snapshot of its own layer, not an alias of {parent.id}: "
        "the sandbox stacks that checkpoint's files read-only (shared-layer fork)"])


def _with_reused(decision: Decision, state: ProcessState | None) -> Decision:
    """The decision's reasons, plus which processes kept their parent's templates."""
    if state is None or not state.reused:
        return decision
    names = [f"{r.nspid} ({r.cmd.split()[0] if r.cmd else '?'})"
             for r in state.records if r.pid in state.reused]
    return decision.model_copy(update=dict(reasons=[
        *decision.reasons, "templates kept from the parent checkpoint for processes that "
        f"did not run since: {', '.join(names[:10])}"]))


@dataclass
class OldKeepers:
    """The keepers of the processes one rollback killed: killed once those have exited
    (then their address spaces are torn down, off the rollback's path); the old
    generation, where they live, is retired after them."""
    carriers: list[native.Carrier]
    gone: trio.Event = field(default_factory=trio.Event)
    reaping: bool = False


# Carriers are spawned only when the ptrace thread and the sandbox are idle: checked this
# many times, this far apart, then given up (that rollback forks from the templates).
PRESPAWN_TRIES = 10
PRESPAWN_RETRY_S = 0.02

# A background checkpoint waits at most this long for its caller's answer to go out.
ANSWER_WAIT_S = 0.05
# How long a stopping daemon waits for the checkpoints it answered or promised.
SHUTDOWN_PENDING_S = 10.0
# The reason an fs checkpoint's answer carries when its snapshot follows the answer.
DEFERRED_NOTE = ("file snapshot taken right after this answer: files_changed and "
                 "bytes_changed come with it (get_checkpoint)")

# After a rollback, how long its killed processes' keepers wait before dying (their exit
# tears down the address spaces: CPU time better spent after the client has its answer).
KEEPER_KILL_DELAY_S = 0.05
# How long the generation a rollback left stays mounted: its teardown (the unmount of its
# tree) contends with the first command in the new one, which an agent runs at once (that
# command's spawn took 2.6-4.2 ms instead of 1.7-1.9 ms with a delay, the same command
# without a rollback 1.5 ms; a whole step: benchmarks/README.md, `search_step`).
GEN_RETIRE_DELAY_S = 0.1


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(5)}"


def checkpoint_mode(mode: str, label: str) -> str:
    """A checkpoint request's mode ("" means auto), checked with its label."""
    mode = mode or "auto"
    if mode not in ("auto", "fs", "full"):
        raise InvalidArgument(f"checkpoint mode {mode!r}: use auto, fs or full")
    if len(label) > 200:
        raise InvalidArgument("label longer than 200 characters")
    return mode


@dataclass
class Snapshot:
    """A checkpoint's frozen layer: what changed since the sandbox's last one (None on the
    copy store) and the store generation it ends at."""
    changes: Changes | None
    generation: int


@dataclass
class Ran:
    """A command's end, as Exec and SessionRun report it: its output, a note, the id of
    the checkpoint asked for at its end ("" if none was; `note` says why if it could not
    be), and the rollback asked for before it (Daemon.rollback's answer; None if none)."""
    out: execute.ExecOutput
    note: str = ""
    checkpoint_id: str = ""
    rollback: dict | None = None


@dataclass
class Wrote:
    """A file write's end, as WriteFile reports it: the file's stat, and as in Ran the
    checkpoint asked for after it and the rollback asked for before it."""
    stat: FileStat
    note: str = ""
    checkpoint_id: str = ""
    rollback: dict | None = None


@dataclass
class Read:
    """A file read's end, as ReadFile reports it: the data, and the rollback asked for
    before it."""
    data: bytes
    rollback: dict | None = None


R = TypeVar("R", Ran, Wrote)


class Daemon:
    def __init__(self, cfg: Config, store: Store, db: Database, cgroups: CgroupDriver,
                 background: GuardedNursery, cr: DeltaCR) -> None:
        self.cfg = cfg
        self.store = store
        self.db = db
        self.cgroups = cgroups
        self.background = background
        self.cr = cr
        self.live: dict[str, Live] = {}
        self.run_dir = cfg.state_dir / "run"
        self.mountpoint = self.run_dir / "rootmnt"
        self.masks: dict[str, Path] = {}
        self.io = IOScheduler()
        # Checkpoint layers a fork in progress stacks under its children (not yet in a row).
        self._base_pins: collections.Counter[str] = collections.Counter()
        self._retire_send: trio.MemorySendChannel | None = None  # _retire_later's queue
        # Durable process state: background dumps of full checkpoints (daemon/dumps.py).
        self.dumps = Dumps(db, cfg.state_dir / "dumps", cr, self.io, fsync=cfg.durable,
                           sandbox_lock=lambda sid: self.live[sid].lock
                           if sid in self.live else None,
                           ended=lambda sid: self._evict_templates(self.live[sid])
                           if sid in self.live else None)
        self.disk_quota = self._enable_quota()
        self.warm = WarmPool(store, background, self._build_for,
                             lambda layer: self.db.layer_refs(layer) > 0,
                             lambda sid, rt: sid in self.live and self.live[sid].rt is rt,
                             self.io, per_sandbox=cfg.warm_per_sandbox,
                             prewarm_bytes=cfg.prewarm_mb << 20)
        self.warm.new_id = lambda: new_id("L")
        self.warm.prespawn = self._prespawn
        self.warm.discard_procs = self._discard_prespawned
        # the work a rollback leaves waits for the command after it
        self.foreground = Foreground(cfg.quiet_wait_ms / 1000)
        self.warm.quiet = self.foreground.quiet
        self.spares = Spares(self._boot_spare, self._stop_spare, lambda: new_id("sb"),
                             background, per_owner=cfg.fork_spares)
        self.family_locks: dict[str, trio.Lock] = {}
        # Removed sandboxes whose init must live on because forks' pid namespaces are
        # nested in theirs (init's exit would kill every nested process): id -> (runtime,
        # its own nest parent). Only init remains in them.
        self.holders: dict[str, tuple[runtime.Runtime, str | None]] = {}
        # Removed sandboxes whose processes are still exiting (_stop_soon): id -> done.
        self.stopping: dict[str, trio.Event] = {}
        self.turns = Turns()
        self.pending = PendingCheckpoints()
        self.underway = Underway()

    # ---- lookups and validation ------------------------------------------------------

    def _sandbox(self, sid: str) -> SandboxRow:
        if not SANDBOX_ID.match(sid or ""):
            raise InvalidArgument(f"{sid!r} is not a sandbox id (like sb-0123456789); "
                                  "`deltabox ls` lists them")
        row = self.db.get_sandbox(sid)
        if row is None:
            raise NotFound(f"no sandbox {sid}: it was removed or never existed; "
                           "`deltabox ls` lists sandboxes")
        return row

    async def _settled_checkpoint(self, cid: str) -> CheckpointRow:
        """The checkpoint, once committed if it is pending (a background one)."""
        if CHECKPOINT_ID.match(cid or ""):
            await self.pending.wait(cid)
        return self._checkpoint(cid)

    def _checkpoint(self, cid: str) -> CheckpointRow:
        if not CHECKPOINT_ID.match(cid or ""):
            raise InvalidArgument(f"{cid!r} is not a checkpoint id (like cp-0123456789)")
        row = self.db.get_checkpoint(cid)
        if row is None:
            raise NotFound(f"no checkpoint {cid}: it was deleted or never existed; "
                           "`deltabox checkpoints SANDBOX` lists them")
        return row

    def _live(self, sid: str) -> Live:
        """The running sandbox `sid`. Its row is read only to say why there is none: a
        live sandbox's row exists (remove stops it before deleting the row), and every
        read costs ~0.1 ms on a request's path here."""
        live = self.live.get(sid)
        if live is None:
            self._sandbox(sid)  # InvalidArgument / NotFound for what is not a sandbox
        if live is None or live.rt.generation is None or live.rt.exited.is_set():
            raise FailedPrecondition(f"sandbox {sid} is not running (its init exited); roll it "
                                     "back to a checkpoint to start it again")
        return live

    def _image(self, spec: str) -> images.Image:
        return images.from_spec(spec, self.store.root / "images")

    def _lowers(self, img: images.Image, bases: Sequence[str] = ()) -> list[str]:
        """The overlay's lower layers: the checkpoint layers `bases` (top first), then
        the image (its mask over its root)."""
        return [*(str(self.store.layer_path(b) / "upper") for b in bases),
                *self._image_lowers(img)]

    def _image_lowers(self, img: images.Image) -> list[str]:
        if _nested(self.store.root, img.rootfs):
            # overlayfs refuses a layer stack where one layer lies inside another (ELOOP).
            raise FailedPrecondition(
                f"the {self.store.backend} store at {self.store.root} is on the same filesystem "
                f"as the image {img.spec}, which overlayfs cannot stack: put --state-dir on "
                "another filesystem, or let the daemon use btrfs (--store auto)")
        mask = self.masks.get(img.key)
        if mask is None:
            mask = self.store.root / "masks" / img.key
            hidden = [str(self.cfg.state_dir.resolve())]
            build_mask(mask, img.rootfs, hidden, img.host_root)
            self.masks[img.key] = mask
        return [str(mask), str(img.rootfs)]

    def _env(self, row: SandboxRow, extra: dict[str, str] | None) -> dict[str, str]:
        env = dict(BASE_ENV, HOSTNAME=row.hostname)
        env.update(row.env)
        env.update(extra or {})
        for k in env:
            if not k or "=" in k or "\0" in k or "\0" in env[k]:
                raise InvalidArgument(f"bad environment variable name or value: {k[:100]!r}")
        _check_args([], env)
        return env

    # ---- daemon lifecycle ------------------------------------------------------------

    def info(self) -> dict:
        usage = shutil.disk_usage(self.store.root)
        return dict(
            version=__version__, state_dir=str(self.cfg.state_dir), socket=self.cfg.socket,
            store_backend=self.store.backend, store_path=str(self.store.root),
            cgroup_version=self.cgroups.version, sandboxes=len(self.db.sandboxes()),
            checkpoints=len(self.db.all_checkpoints()), store_bytes_total=usage.total,
            store_bytes_free=usage.free, process_backend="templates (ptrace fork)",
            disk_quota="btrfs simple quota per writable layer" if self.disk_quota else
            "none (the store is not btrfs with simple quotas)",
            inspector_backend=self.turns.status,
            store_durability=self._durability(), transparent_hugepages=hostmem.describe(),
            cgroup_favordynmods=describe_favordynmods())

    def _enable_quota(self) -> bool:
        """Simple quotas on the embedded loop store (ours); an administrator's btrfs keeps
        its own settings (enable them there with `btrfs quota enable --simple`)."""
        if self.store.backend != "btrfs-loop":
            return False
        try:
            quota.enable(self.store.root)
        except FailedPrecondition as e:
            log.warning("no disk quotas for sandboxes: %s", e)
            return False
        return True

    def _durability(self) -> str:
        """What a committed checkpoint survives (copies are never fsynced; the loop store
        drops cache flushes unless --durable; an admin's btrfs keeps its own settings)."""
        if self.store.backend == "btrfs" or (self.store.backend == "btrfs-loop"
                                            and self.cfg.durable):
            return "host-crash-safe"
        return "daemon-crash-safe"

    async def recover(self) -> None:
        """Clean what a previous daemon left, then boot every sandbox again."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(exist_ok=True)
        for name in self.cgroups.existing():
            if SANDBOX_ID.match(name):
                log.info("recover: killing leftover processes of %s", name)
                Cgroup(self.cgroups, name).remove()
        self._unmount_leftovers()
        referenced = self.db.referenced_layers()
        for layer in self.store.layer_ids():
            if layer not in referenced:
                log.info("recover: deleting uncommitted layer %s", layer)
                self.store.delete(layer)
        self._finish_snapshots()
        self.dumps.recover({c.id for c in self.db.all_checkpoints()})
        for row in self.db.sandboxes():
            try:
                await self._boot(row)
            except Exception as e:  # keep the daemon up; the sandbox says why
                log.error("recover: cannot restart sandbox %s: %s", row.id, e)
                row.state = "stopped"
                self.db.put_sandbox(row)

    def _unmount_leftovers(self) -> None:
        prefix = str(self.run_dir) + "/"
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f]
        for mnt in reversed(mounts):
            if mnt.startswith(prefix):
                subprocess.run(["umount", "-l", mnt], capture_output=True)

    async def shutdown(self) -> None:
        """Stop every sandbox (their files stay; they boot again on the next start). One
        sandbox failing to stop must not keep the others or the store from being released."""
        with trio.CancelScope(shield=True):
            # Checkpoints already answered (a snapshot after its answer) or promised (turn
            # boundary) are taken first; recovery would take the former anyway.
            with trio.move_on_after(SHUTDOWN_PENDING_S):
                for sid in list(self.live):
                    await self.pending.wait_sandbox(sid)
            for sid in list(self.live):
                try:
                    await self._stop(sid)
                except Exception:
                    log.exception("shutdown: stopping sandbox %s failed", sid)
            for done in list(self.stopping.values()):  # removals finishing in the background
                await done.wait()
            await self.spares.close()  # none left but those of sandboxes that failed above
            for rt, _ in list(self.holders.values()):  # left only if something failed above
                await _stop_runtime(rt)
            self.holders.clear()
            self.turns.close()
            self.warm.close()
            self.cgroups.remove_parent()
            self.db.close()
            close_store(self.store)

    # ---- sandboxes -------------------------------------------------------------------

    async def create(self, params: CreateParams) -> SandboxRow:
        if len(self.live) >= self.cfg.max_sandboxes:
            raise ResourceExhausted(f"{len(self.live)} sandboxes are running (the limit is "
                                    f"{self.cfg.max_sandboxes}); remove some with `deltabox rm`")
        img = await trio.to_thread.run_sync(images.resolve, params.image,
                                            self.store.root / "images")
        sid = new_id("sb")
        row = SandboxRow(
            id=sid, family_id="fam-" + sid[3:], state="running", image=img.spec,
            layer_id=new_id("L"), head_cp=None,
            memory_mb=params.memory_mb or self.cfg.default_memory_mb,
            pids_max=params.pids_max or self.cfg.default_pids_max, cpus=params.cpus,
            hostname=params.hostname or sid, env=dict(params.env), created_at=time.time(),
            disk_mb=params.disk_mb or self.cfg.default_disk_mb, userns=params.user_namespace)
        if params.huge_pages:  # in the sandbox's env: its forks and restarts keep it
            try:
                row.env = hostmem.with_huge_pages(row.env)
            except ValueError as e:
                raise FailedPrecondition(f"huge_pages: {e}") from None
        self._env(row, None)
        self.store.new_layer(row.layer_id)
        try:
            row.base_gen = 0  # a new layer: everything in it is a change
            await self._boot(row)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._stop(sid)
                self.store.delete(row.layer_id)
            raise
        self.db.put_sandbox(row)
        return row

    async def _boot(self, row: SandboxRow, nest_under: str | None = None,
                    take_layer: Callable[[], Awaitable[None]] | None = None,
                    spare: Spare | None = None) -> None:
        """Start init and the first file-system generation of a sandbox (its pid namespace
        nested below the live sandbox `nest_under`'s, if given), and its first turn: a
        fork child's begins before its processes are restored, or what they do before
        the restore re-arms the watch with them would go unseen (Inspector.watch,
        `restored`). `take_layer`: gets the sandbox its layer (sets row.layer_id) while
        init starts, which needs none (a fork's children start their inits while their
        layers are cloned). `spare`: an init booted ahead for it (spares.py), used instead
        of a new one."""
        if take_layer is None:
            await self._limit_disk(row, row.layer_id)  # before anything runs: it may fail
        limits = Limits(row.memory_mb, row.pids_max, row.cpus)
        parent_pid = self.live[nest_under].rt.init_pid if nest_under else None

        async def start() -> None:
            if spare is not None:
                rt = spare.rt
            else:
                # Made here, not before the tasks start: a fork's children each start
                # their init right after their own cgroup, instead of after all of theirs.
                rt = await self._start_init(row.id, row.hostname, limits, parent_pid,
                                            row.userns)
            self.live[row.id] = Live(rt, nest_parent=nest_under)  # _stop finds it from here
            self.background.start_soon(self._watch, row.id, rt)

        if take_layer is None:
            await start()
        else:
            await run_all([start, take_layer])
        live = self.live[row.id]
        rt = live.rt
        lowers = self._lowers(self._image(row.image), row.bases)

        async def build() -> None:
            rt.generation = await runtime.build_generation(
                rt, row.layer_id, lowers, self.store.layer_path(row.layer_id),
                self.mountpoint, self.background)

        if take_layer is None:
            await build()
        else:  # the layer's quota while its generation is built: nothing runs there yet
            await run_all([build, functools.partial(self._limit_disk, row, row.layer_id)])
        row.state = "running"
        self._new_turn(row.id, live)

    async def _start_init(self, sid: str, hostname: str, limits: Limits,
                          nest_under: int | None, userns: bool) -> runtime.Runtime:
        """A sandbox's cgroup and init (its pid namespace nested below the host pid
        `nest_under`'s, if given)."""
        cg = self.cgroups.create(sid, limits)
        try:
            return await runtime.start_init(sid, cg, hostname, nest_under=nest_under,
                                            userns=self.cfg.userns if userns else None)
        except BaseException:
            cg.remove()
            raise

    async def _boot_spare(self, sid: str, kind: SpareKind) -> runtime.Runtime:
        """An init for a future fork child of kind.owner (spares.py), named as a fork
        child is: its id."""
        owner = self.live.get(kind.owner)
        if owner is None or owner.rt.exited.is_set():
            raise NotFound(f"sandbox {kind.owner} is gone")
        return await self._start_init(sid, sid, kind.limits, owner.rt.init_pid, kind.userns)

    @staticmethod
    async def _stop_spare(rt: runtime.Runtime) -> None:
        with trio.CancelScope(shield=True):
            await _stop_runtime(rt)

    def _new_turn(self, sid: str, live: Live, restored: Resumed | None = None) -> None:
        """A turn of the sandbox begins (boot, rollback, fork): the inspector follows its
        cgroup from here, knowing init and the `restored` processes (already running: with
        the calls they were stopped in, engine.stopped_calls)."""
        cgid = live.rt.cgroup.bpf_id
        if cgid is None:
            return
        keep = live.rt.keep_pids
        self.turns.watch(sid, cgid, keep | set(restored or ()), lived_on=keep,
                         restored=restored)

    async def _limit_disk(self, row: SandboxRow, layer: str) -> None:
        """Put the sandbox's disk quota on a writable layer it is about to use (btrfs simple
        quota: a write beyond it fails with EDQUOT inside the sandbox; sandbox/quota.py).
        In a thread: the ioctl joins a btrfs transaction, so it waits for a commit under
        way (a snapshot's: up to 30 ms in a fork(32)), which must not stall the loop."""
        if row.disk_mb and self.disk_quota:
            await trio.to_thread.run_sync(quota.limit, self.store.layer_path(layer),
                                          row.disk_mb << 20)

    async def _watch(self, sid: str, rt: runtime.Runtime) -> None:
        """Reap the launcher. If init dies on its own, the pid namespace is gone: the sandbox
        is stopped (its files stay; a rollback boots it again)."""
        await rt.launcher.wait()
        rt.exited.set()
        live = self.live.get(sid)
        if live is None or live.rt is not rt:
            return  # stopped on purpose
        log.warning("sandbox %s: init exited unexpectedly (status %s); sandbox stopped",
                    sid, rt.launcher.returncode)
        async with live.lock:
            if self.live.get(sid) is live:
                await self._stop(sid)

    async def _stop(self, sid: str) -> None:
        """Stop a sandbox: every process killed and reaped, its cgroup and generation gone.
        It reads as stopped from the start; a boot of it waits for the end (_torn_down)."""
        live = self._unregister(sid)
        if live is not None:
            await self._tracked_teardown(sid, live, self._stopping(sid))

    def _stopping(self, sid: str) -> trio.Event:
        """Register a teardown of `sid` under way (shutdown and a boot of it wait for it)."""
        done = self.stopping[sid] = trio.Event()
        return done

    async def _tracked_teardown(self, sid: str, live: Live, done: trio.Event,
                                step: str = "") -> None:
        """_teardown, then `done` set and unregistered, whatever happens."""
        try:
            if step:
                crash_point(step)
            await self._teardown(sid, live)
        finally:
            del self.stopping[sid]
            done.set()

    async def _torn_down(self, sid: str) -> None:
        """Wait for a stop of `sid` still tearing it down: booting it meanwhile would put
        the new init in the cgroup that teardown is killing and removing."""
        done = self.stopping.get(sid)
        if done is not None:
            await done.wait()

    def _stop_soon(self, sid: str) -> trio.Event | None:
        """`_stop` for a removal, whose caller needs the sandbox's processes dead, not
        reaped: they are SIGKILLed here (all but init, its launcher and the stopped
        templates, which run none of the user's code), the rest (their exits, a 200 MB
        address space takes milliseconds to tear down; the helpers; the mount namespace;
        the cgroup) follows in the background. Returns the event set once that is done
        (None: nothing left to do); shutdown waits for it, and a restart after a crash finds
        the cgroup and the mounts as leftovers."""
        live = self._unregister(sid)
        if live is None:
            return None
        done = self._stopping(sid)
        try:
            for fd in live.rt.cgroup.kill_now(keep=live.rt.keep_pids | live.template_pids):
                os.close(fd)
        finally:  # torn down even if the kill failed (the frozen kill comes in the teardown)
            self.background.start_soon(self._tracked_teardown, sid, live, done,
                                       "remove.tearing_down")
        return done

    def _unregister(self, sid: str) -> Live | None:
        """The first step of a stop: the sandbox leaves the daemon's tables (no request
        finds it from here) and the warm pool and the inspector let it go."""
        self.warm.drop_sandbox(sid)
        self.turns.unwatch(sid)
        live = self.live.pop(sid, None)
        if live is None and sid not in self.stopping:  # else its teardown owns the cgroup
            Cgroup(self.cgroups, sid).remove()
        return live

    async def _teardown(self, sid: str, live: Live) -> None:
        await self.spares.drop(sid)  # nested below it: before it is told whether to stay
        for s in live.sessions.values():
            await s.close()
        # A session holds a method of its Live (kill_group): a cycle, which only the
        # collector's full pass (rare under load, idlegc) would free, and with it every
        # checkpoint's process records the Live held (soak, stop 76: 7280 of them alive
        # 10 s after every sandbox was gone).
        live.sessions.clear()
        for p in list(live.procs):
            _kill(p)
        for state in live.captured.values():
            await self.cr.release(state)
        # Keepers after their processes (killed here; they are not the keepers' children).
        for fd in live.rt.cgroup.kill_now(keep=live.rt.keep_pids | live.template_pids):
            os.close(fd)
        await self.cr.kill_carriers(list(live.keepers.values()))
        live.keepers.clear()
        for fd in live.held_fds:
            os.close(fd)
        if live.mq_dir >= 0:
            os.close(live.mq_dir)
            live.mq_dir = -1
        for fd in live.dying:
            os.close(fd)
        if self._nested_in(sid):
            # Forks live in pid namespaces below ours: keep init (and the namespace) alive,
            # everything else goes.
            await runtime.kill_all(live.rt.cgroup, live.rt.keep_pids)
            if live.rt.generation is not None:
                await trio.to_thread.run_sync(live.rt.generation.close)
                live.rt.generation = None
            self.holders[sid] = (live.rt, live.nest_parent)
            return
        await _stop_runtime(live.rt)
        await self._release_holders(live.nest_parent)

    def _nested_in(self, sid: str) -> bool:
        """Whether a sandbox (live or held) has its pid namespace nested below sid's."""
        return (any(lv.nest_parent == sid for lv in self.live.values()) or
                any(parent == sid for _, parent in self.holders.values()))

    async def _release_holders(self, sid: str | None) -> None:
        """Stop held inits that no nested sandbox needs any more, up the chain."""
        while sid is not None and sid in self.holders and not self._nested_in(sid):
            rt, parent = self.holders.pop(sid)
            await _stop_runtime(rt)
            sid = parent

    def _nest_level(self, sid: str) -> int:
        """How deep a live sandbox's pid namespace is (the host's is 0)."""
        try:
            return len(native.proc_status(self.live[sid].rt.init_pid).nspid) - 1
        except OSError:
            return MAX_NEST_LEVEL

    def get(self, sid: str) -> SandboxRow:
        return self._sandbox(sid)

    def list(self) -> list[SandboxRow]:
        return self.db.sandboxes()

    def own_children(self) -> set[int]:
        """Children of ours that are never orphans to reap (host pids): every sandbox's
        process templates and its launcher (reaped by its own wait)."""
        return set().union(*(live.template_pids | {live.rt.launcher.pid}
                             for live in self.live.values()))

    def init_pid(self, sid: str) -> int:
        live = self.live.get(sid)
        return live.rt.init_pid if live else 0

    def uid_map(self, row: SandboxRow) -> str:
        """The sandbox's uid (and gid) map as /proc/pid/uid_map shows it, "" without one."""
        live = self.live.get(row.id)
        ids = live.rt.userns if live else (self.cfg.userns if row.userns else None)
        return f"0 {ids.base} {ids.count}" if ids else ""

    async def remove(self, sid: str) -> int:
        """Remove a sandbox; when it was the last of its family, free the family's checkpoints."""
        row = self._sandbox(sid)
        lock = self.live[sid].lock if sid in self.live else trio.Lock()
        async with lock:
            stopped = self._stop_soon(sid)
            after = [stopped] if stopped is not None else None
            freed = 0
            others = self.db.family_has_other(row.family_id, sid)
            cps = [] if others else self.db.family_checkpoints(row.family_id)
            crash_point("remove.before_commit")
            with self.db.transaction():
                self.db.delete_sandbox(sid)
                for cp in cps:
                    self.db.delete_checkpoint(cp.id)
            crash_point("remove.after_commit")
            self.dumps.drop([cp.id for cp in cps])
            self._retire_later(None, row.layer_id, "remove.before_layer_delete", after)
            for layer in dict.fromkeys(cp.layer_id for cp in cps):  # aliases share layers
                if self.db.layer_refs(layer) == 0:
                    self.warm.drop_layer(layer)
                    self._retire_later(None, layer, "remove.before_layer_delete")
                    freed += 1
            self._release_bases(list(dict.fromkeys(
                [*row.bases, *(b for cp in cps for b in cp.bases)])), after)
            return freed

    def _retire_later(self, gen: runtime.Generation | None, layer_id: str,
                      step: str = "", after: list[trio.Event] | None = None,
                      quiet_for: str = "") -> None:
        """Drop a layer (and the generation mounted on it, if any) after the call returned,
        off the hot path, and after `after` (keepers living in the generation, a removed
        sandbox's teardown); a generation GEN_RETIRE_DELAY_S later (the one a rollback
        left: the command that follows goes first), and once the sandbox `quiet_for` runs
        no command of its caller's (foreground.py). Closing the last reference to a mount
        namespace unmounts its tree synchronously (milliseconds of RCU grace periods), so
        it happens in a worker thread (it holds two fds and a mount namespace), then the
        layer goes through a queue drained by RETIRE_WORKERS tasks: a task per deletion
        would hold ~13 KiB each while waiting for an I/O slot, and under load they pile
        up."""
        if self._retire_send is None:
            self._retire_send, recv = trio.open_memory_channel(math.inf)
            for _ in range(RETIRE_WORKERS):
                self.background.start_soon(self._retire_worker, recv.clone())
            recv.close()
        send = self._retire_send
        if gen is None and not after:
            send.send_nowait((layer_id, step))
            return

        async def close_then_queue() -> None:
            try:
                if gen is not None:
                    await trio.sleep(GEN_RETIRE_DELAY_S)
                if quiet_for:
                    await self.foreground.quiet(quiet_for)
                for ev in after or ():
                    await ev.wait()
                if gen is not None:
                    await trio.to_thread.run_sync(gen.close)
            finally:
                send.send_nowait((layer_id, step))
        self.background.start_soon(close_then_queue)

    async def _retire_worker(self, recv: trio.MemoryReceiveChannel) -> None:
        async with recv:
            async for layer_id, step in recv:
                try:
                    await self._retire(layer_id, step)
                except Exception:
                    log.exception("retiring layer %s failed", layer_id)

    async def _retire(self, layer_id: str, step: str) -> None:
        await self.io.wait(layer_id)  # a clone of it still being made
        if self._is_base(layer_id):  # deleted with its last dependent (_release_bases)
            return
        if step:
            crash_point(step)  # test-only (faults.py)
        for pause in (*RETIRE_RETRY_S, None):
            try:
                await self.io.run(layer_id, self.store.delete, layer_id)
                return
            except Exception as e:
                if pause is None:  # retried on the next start (orphan layer)
                    log.warning("deleting layer %s failed: %s (retried at restart)",
                                layer_id, e)
                    return
                log.info("deleting layer %s failed: %s (again in %g s)", layer_id, e, pause)
                await trio.sleep(pause)  # e.g. busy for a moment: a mount on it going away

    def _is_base(self, layer_id: str) -> bool:
        """Whether a row, or a fork in progress, stacks `layer_id` under its layer."""
        return self._base_pins[layer_id] > 0 or self.db.base_refs(layer_id) > 0

    def _release_bases(self, bases: list[str], after: list[trio.Event] | None = None) -> None:
        """After a commit that dropped references to `bases`: delete those that no row
        names any more (their checkpoint deleted while they were bases), once `after` is
        set (a removed sandbox's overlay, which stacks them, unmounted)."""
        for b in bases:  # no row names it: its warm clones went with its checkpoint
            if self.db.layer_refs(b) == 0 and not self._is_base(b):
                self._retire_later(None, b, after=after)

    # ---- running commands ------------------------------------------------------------

    async def exec(self, sid: str, argv: list[str], shell: str, cwd: str, env: dict[str, str],
                   stdin: bytes, timeout: float,
                   sink: Callable[[str, bytes], None] | None = None,
                   checkpoint: str = "", checkpoint_label: str = "",
                   answered: trio.Event | None = None, rollback_to: str = "") -> Ran:
        """Run a command to completion; background jobs it starts keep running. With
        `checkpoint` (a mode), a checkpoint is promised at its end (checkpoint_soon); with
        `rollback_to`, the sandbox is rolled back to that checkpoint first."""
        if checkpoint:
            checkpoint = checkpoint_mode(checkpoint, checkpoint_label)
        if shell:
            argv = ["bash", "-c", shell]
        if not argv or any("\0" in a for a in argv):
            raise InvalidArgument("nothing to run: give a command (argv or shell), no NUL bytes")
        _check_timeout(timeout)
        cwd = _abs_in_sandbox(cwd)
        env = self._env(self._sandbox(sid), env)
        _check_args(argv + [cwd], env)
        rolled = await self._rollback_first(sid, rollback_to)
        live = self._live(sid)
        # Spawn under the lock, so a concurrent rollback either precedes this command or
        # sees it in `procs` and kills it.
        async with live.lock:
            live = self._live(sid)
            running = await execute.spawn(live.rt, argv, cwd=cwd, env=env, stdin=stdin,
                                          background=self.background, sink=sink)
            live.procs.add(running.proc)
            self.turns.expect_entry(sid, running.proc.pid)
        try:
            with self.foreground.command(sid):
                out = await execute.wait(running, timeout or None, live.kill_command)
        finally:
            live.procs.discard(running.proc)
        if out.timed_out:
            raise DeadlineExceeded(_timeout_message(" ".join(argv)[:200], timeout, out))
        return await self._turn_end(sid, Ran(out, rollback=rolled), checkpoint,
                                    checkpoint_label, answered)

    async def _rollback_first(self, sid: str, cp_id: str) -> dict | None:
        """The rollback a command asked for before it runs (None: none asked). A tree
        search's step is then one call, not two: each call costs a round trip of 2-3 ms
        here after the agent's pause, against 1.5-2 ms of the rollback's own work.
        Shielded: a streamed command's client that goes away cancels the command, not a
        rollback half done (milliseconds)."""
        if not cp_id:
            return None
        with trio.CancelScope(shield=True):
            return await self.rollback(sid, cp_id)

    async def _turn_end(self, sid: str, ran: R, mode: str, label: str,
                        answered: trio.Event | None) -> R:
        """Promise the checkpoint a command (or a write) asked for at its end. If the
        sandbox cannot take one now (it stopped meanwhile), the output is still returned,
        with a note."""
        if mode:
            try:
                ran.checkpoint_id = await self.checkpoint_soon(sid, mode, label, answered)
            except DeltaBoxError as e:
                ran.note = "; ".join(filter(None, [ran.note, f"no checkpoint taken: {e}"]))
        return ran

    async def write_file(self, sid: str, path: str, data: bytes, mode: int | None = None,
                         append: bool = False, make_parents: bool = False,
                         checkpoint: str = "", checkpoint_label: str = "",
                         answered: trio.Event | None = None, rollback_to: str = "") -> Wrote:
        """Write a file (SandboxFiles.write); with `checkpoint` and `rollback_to` as in exec:
        an agent's edit as a tree search's step, one round trip instead of three. A request
        refused for its own arguments is refused before the rollback."""
        if checkpoint:
            checkpoint = checkpoint_mode(checkpoint, checkpoint_label)
        check_path(path)
        check_mode(mode)
        rolled = await self._rollback_first(sid, rollback_to)
        stat = await self.files(sid, "write", path, data, mode=mode, append=append,
                                make_parents=make_parents)
        assert isinstance(stat, FileStat)
        return await self._turn_end(sid, Wrote(stat, rollback=rolled), checkpoint,
                                    checkpoint_label, answered)

    async def read_file(self, sid: str, path: str, rollback_to: str = "") -> Read:
        """Read a file (SandboxFiles.read); with `rollback_to`, the sandbox rolled back to
        that checkpoint first, as exec and write_file do: a step that begins by reading the
        file it edits, at the node it expands, is one round trip. A path refused for itself
        is refused before the rollback; a read that fails after it (the file is absent at
        that checkpoint) leaves the sandbox rolled back, as two calls would."""
        check_path(path)
        rolled = await self._rollback_first(sid, rollback_to)
        data = await self.files(sid, "read", path)
        assert isinstance(data, bytes)
        return Read(data, rollback=rolled)

    async def session_run(self, sid: str, name: str, command: str, timeout: float,
                          checkpoint: str = "", checkpoint_label: str = "",
                          answered: trio.Event | None = None, rollback_to: str = "",
                          tty: bool = False) -> Ran:
        """Run bash source in a named persistent shell (created on first use, on a
        pseudo-terminal with `tty`); with `checkpoint` and `rollback_to`, as in exec (after
        the rollback, the session is the checkpoint's)."""
        if checkpoint:
            checkpoint = checkpoint_mode(checkpoint, checkpoint_label)
        if not SESSION_NAME.match(name or ""):
            raise InvalidArgument(f"session name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -")
        if "\0" in command:
            raise InvalidArgument("command contains a NUL byte")
        _check_timeout(timeout)
        rolled = await self._rollback_first(sid, rollback_to)
        row = self._sandbox(sid)
        live = self._live(sid)
        note = ""
        async with live.lock:
            live = self._live(sid)
            session = live.sessions.get(name)
            if session is not None and session.alive and session.tty != tty:
                kinds = ("on pipes", "on a pseudo-terminal")
                raise FailedPrecondition(
                    f"session {name!r} runs {kinds[session.tty]}, not {kinds[tty]}: close "
                    "it first, or use another name")
            if session is None or not session.alive:
                if name in live.restarted:
                    note = f"session {name!r} was restarted: the sandbox was rolled back"
                    live.restarted.discard(name)
                elif session is not None:
                    note = f"session {name!r} was restarted: its shell had exited"
                session = Session(name, tty, kill_group=live.kill_group)
                term = "xterm-256color" if tty else "dumb"
                await session.start(live.rt, self._env(row, {"TERM": term}), self.background)
                live.sessions[name] = session
                if session.spawned is not None:
                    self.turns.expect_entry(sid, session.spawned.pid)
            if session.spawned is not None:
                live.procs.add(session.spawned)
        async with session.lock:
            with self.foreground.command(sid):
                out = await session.run(command, timeout or None)
        if out.timed_out:
            live.sessions.pop(name, None)
            raise DeadlineExceeded(_timeout_message(command[:200], timeout, out) +
                                   f"; session {name!r} was killed and restarts on next use")
        return await self._turn_end(sid, Ran(out, note, rollback=rolled), checkpoint,
                                    checkpoint_label, answered)

    async def session_close(self, sid: str, name: str) -> None:
        live = self._live(sid)
        session = live.sessions.pop(name, None)
        if session is None:
            raise NotFound(f"sandbox {sid} has no session {name!r}")
        await session.close()

    def sessions(self, sid: str) -> list[str]:
        live = self._live(sid)
        return sorted(n for n, s in live.sessions.items() if s.alive)

    # ---- files -----------------------------------------------------------------------

    async def files(self, sid: str, op: str, *args: object, **kw: object) -> object:
        """Run a SandboxFiles operation on the sandbox's current root (under its lock, so a
        rollback cannot swap the root underneath)."""
        live = self._live(sid)
        async with live.lock:
            live = self._live(sid)
            assert live.rt.generation is not None
            fs = SandboxFiles(live.rt.generation.rootfd, ids=live.rt.userns)
            try:
                return await trio.to_thread.run_sync(lambda: getattr(fs, op)(*args, **kw))
            finally:  # even a failed write may have changed something
                if args and isinstance(args[0], str):
                    self.turns.note_files(sid, op, args[0])  # invisible to the inspector

    # ---- checkpoints -----------------------------------------------------------------

    async def checkpoint(self, sid: str, mode: str, label: str,
                         answered: trio.Event | None = None) -> CheckpointRow:
        """Capture the sandbox's state as a new checkpoint, child of its head. mode "auto"
        (the default) does only what the turn since the parent needs (daemon/turns.py):
        nothing (`skipped`), a file snapshot (`fs`) or files and processes (`full`);
        "fs" forces file state only, "full" forces a capture of both.

        `answered` (set once the caller's answer has gone out: the gRPC bridge) lets a
        checkpoint (any but a forced "fs") answer as soon as it is committed and take the
        file snapshot right after (_deferred_snapshot); a sandbox that runs something
        stays frozen until then, the processes captured stopped."""
        mode = checkpoint_mode(mode, label)
        live = self._live(sid)
        cp_id = new_id("cp")
        if answered is None or mode == "fs" or not self._may_defer_snapshots():
            async with live.lock:
                return await self._checkpoint_locked(sid, mode, label, cp_id)
        answer = EarlyAnswer()

        async def run() -> None:
            try:
                async with live.lock:
                    answer.give(await self._checkpoint_locked(sid, mode, label, cp_id,
                                                              answer, answered))
            except Exception as e:
                if answer.given:
                    raise  # after the answer: logged by the background nursery
                answer.fail(e)
            except BaseException:
                answer.fail(Unavailable("deltaboxd is stopping; take the checkpoint again"))
                raise

        self.background.start_soon(run)
        return await answer.wait()

    def _may_defer_snapshots(self) -> bool:
        """Whether a checkpoint may be answered before its file snapshot: on the daemon's
        own loop store without --durable, what a committed checkpoint survives is a crash
        of the daemon, and recovery takes a snapshot left to take (_finish_snapshots).
        Where a checkpoint must survive a host crash, the snapshot's transaction commit is
        what makes it durable: it stays before the answer."""
        return self.store.cheap_clone and self._durability() == "daemon-crash-safe"

    async def checkpoint_soon(self, sid: str, mode: str, label: str,
                              answered: trio.Event | None = None) -> str:
        """Promise a checkpoint and return its id at once; it is taken right after, before
        any operation that comes later to the sandbox's lock (daemon/pending.py), and once
        `answered` is set: the caller's answer has gone out (the capture's Python would
        otherwise hold the GIL the answer needs, for up to a switch interval, 5 ms)."""
        mode = checkpoint_mode(mode, label)
        live = self._live(sid)
        cp_id = new_id("cp")
        self.pending.promise(cp_id, sid)
        try:
            await self.background.start(self._checkpoint_later, sid, live, mode, label, cp_id,
                                        answered)
        except BaseException:
            self.pending.settle(cp_id, Internal(f"checkpoint {cp_id} of {sid} never started"))
            raise
        return cp_id

    async def _checkpoint_later(self, sid: str, live: Live, mode: str, label: str, cp_id: str,
                                answered: trio.Event | None,
                                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                                ) -> None:
        error: DeltaBoxError | None = Unavailable(
            "deltaboxd stopped before it was taken; take a new checkpoint")
        try:
            async with live.lock:
                task_status.started()  # in the lock's queue: nothing later goes first
                with trio.move_on_after(ANSWER_WAIT_S):
                    await (answered.wait() if answered is not None else trio.sleep(0))
                await self._checkpoint_locked(sid, mode, label, cp_id)
            error = None
        except DeltaBoxError as e:
            error = e
        except Exception as e:
            log.exception("background checkpoint %s of %s failed", cp_id, sid)
            error = Internal(f"internal error in deltaboxd: {e!r} (see the daemon log)")
        finally:
            if error is not None:
                log.warning("background checkpoint %s of %s: %s", cp_id, sid, error.message)
            self.pending.settle(cp_id, error)

    async def _checkpoint_locked(self, sid: str, mode: str, label: str, cp_id: str,
                                 answer: EarlyAnswer | None = None,
                                 answered: trio.Event | None = None) -> CheckpointRow:
        """The checkpoint itself, under the sandbox's lock. With `answer`, the file
        snapshot is taken after the committed row is answered."""
        row = self._sandbox(sid)
        parent = self.db.get_checkpoint(row.head_cp) if row.head_cp else None
        with self.underway.hanging_from(row.head_cp):  # a delete of it waits for us
            return await self._checkpoint_from(sid, row, parent, mode, label, cp_id, answer,
                                               answered)

    async def _checkpoint_from(self, sid: str, row: SandboxRow, parent: CheckpointRow | None,
                               mode: str, label: str, cp_id: str, answer: EarlyAnswer | None,
                               answered: trio.Event | None) -> CheckpointRow:
        live = self._live(sid)
        t0 = time.perf_counter()
        layer = new_id("L")
        # Flush a large dirty set first, so the snapshot inside the freeze window is short.
        if self.store.needs_sync():
            await trio.to_thread.run_sync(self.store.sync)
        t_freeze = time.perf_counter()
        captured: ProcessState | None = None
        snap: Snapshot | None = None
        frozen = not self._nothing_runs(live)
        hold = False  # kept frozen (and captured processes stopped) until a later snapshot
        if frozen:
            if live.keeping is not None and not live.keeping.is_set():
                await live.keeping.wait()   # never frozen midway (_keep_carriers)
            live.rt.cgroup.freeze()
        try:
            crash_point("checkpoint.frozen")
            alive = self._candidates(live) if frozen else set()
            effects = self.turns.end_turn(sid, alive)
            if _may_have_made_ipc(effects):
                live.ipc_seen = True
            decision = _keep_stacking(self._decide(mode, live, parent, effects, alive), row,
                                      parent)
            if decision.kind == "full":
                kept = self._kept_templates(mode, live, parent, effects)
                captured, snap = await self._capture(live, row, layer, alive, kept,
                                                     later=answer is not None)
                # Held in their ptrace stops until their templates and the snapshot are
                # made after the answer, the cgroup thawed: the templates' forks run in
                # them. A daemon killed meanwhile takes them with it (Stopped.hold), and
                # its successor takes the snapshot of the untouched layer.
                hold = captured.held is not None
                decision = _with_reused(decision, captured)
            else:
                self._note_drift(live, effects)
                hold = frozen and answer is not None and decision.kind == "fs"
            # Nothing runs, or it stays frozen, and every operation that could write waits
            # for the lock: the layer stays as it is now until the snapshot, taken right
            # after the answer.
            defer = hold or (answer is not None and decision.kind == "fs")
            if decision.kind == "fs" and not defer:
                # The transaction commit (5-15 ms here) in a worker thread: on the trio
                # loop it would stall every other sandbox's calls meanwhile (a neighbour's
                # p99 38-40 ms instead of 13: benchmarks/neighbours.py). Its summary stays
                # here: Python in that thread would wait for the GIL behind the loop's
                # calls. Shielded: a cancel between the snapshot and the commit below
                # would leave the layer behind.
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.store.freeze, row.layer_id, layer)
                snap = self._frozen(row, layer)
            crash_point("checkpoint.snapshotted")
        except BaseException:
            self.turns.lost_turn(sid)  # what it did is not in any checkpoint
            if hold:
                hold = False
                with trio.CancelScope(shield=True):
                    await self._drop_capture(live, captured, held=True)
            raise
        finally:
            if frozen and not hold:
                live.rt.cgroup.thaw()
        crash_point("checkpoint.captured")
        freeze_ms = (time.perf_counter() - t_freeze) * 1000 if frozen else 0.0
        if decision.kind == "full":
            procs_of: str | None = cp_id
        elif mode == "auto" and parent is not None:
            procs_of = parent.procs_of  # the policy saw no process change since it
        else:
            procs_of = None
        try:
            cp = self._checkpoint_row(cp_id, row, parent, layer, decision, captured, label,
                                      procs_of, snap)
            if defer:
                cp.snapshot_of = row.layer_id
            cp.freeze_ms = freeze_ms
            cp.duration_ms = (time.perf_counter() - t0) * 1000
            row.head_cp = cp_id
            crash_point("checkpoint.before_commit")
            with self.db.transaction():
                self.db.put_checkpoint(cp)
                self.db.put_sandbox(row)
                if captured is not None:
                    self.dumps.add_pending(cp_id, sid)
            crash_point("checkpoint.after_commit")
        except BaseException:
            self.turns.lost_turn(sid)
            with trio.CancelScope(shield=True):
                await self._drop_capture(live, captured, held=hold)
                if decision.kind != "skipped" and self.store.layer_path(layer).exists():
                    self.store.delete(layer)
            raise
        self.turns.record(sid, cp_id, effects, decision)
        for sess in live.sessions.values():
            sess.turn_state = sess.state
        if captured is not None:
            captured.session_states = {n: s.state for n, s in live.sessions.items()}
        if captured is not None and not hold:
            self._keep_captured(sid, live, cp_id, captured)
        if cp.snapshot_of is not None:
            assert answer is not None and answered is not None
            self.pending.promise(cp_id, sid)
            answer.give(dataclasses.replace(cp, reasons=list(cp.reasons)))
            await self._deferred_snapshot(sid, row, cp, answered, hold, captured)
            return cp
        self.warm.prepare(sid, cp.layer_id)
        return cp

    def _keep_captured(self, sid: str, live: Live, cp_id: str, captured: ProcessState) -> None:
        """A committed checkpoint's processes: kept for its rollbacks and forks, and dumped
        to disk in the background."""
        live.captured[cp_id] = captured
        live.procs_from = cp_id
        self.dumps.schedule(self.background.start_soon, sid, cp_id, captured,
                            self._init_filters(live))
        self._evict_templates(live)

    async def _drop_capture(self, live: Live, captured: ProcessState | None,
                            held: bool) -> None:
        """A checkpoint that failed after its capture: let a held sandbox go, and release
        the templates it made."""
        if held:
            await self._let_go(live, captured)
        if captured is not None:
            await self.cr.release(captured)

    async def _let_go(self, live: Live, captured: ProcessState | None) -> None:
        """Thaw a sandbox kept frozen for a later snapshot, and let the processes a capture
        held stopped (ProcessState.held) run again."""
        live.rt.cgroup.thaw()
        if captured is not None and captured.held is not None:
            await self.cr.resume(captured)

    async def _deferred_snapshot(self, sid: str, row: SandboxRow, cp: CheckpointRow,
                                 answered: trio.Event, hold: bool,
                                 captured: ProcessState | None) -> None:
        """The file snapshot of checkpoint `cp` (and the templates of the processes it
        `captured`), answered before them and still under the sandbox's lock (the layer
        has not changed since). Operations that name `cp` wait for it (pending); if it
        fails, the checkpoint is undone and they get the error. A daemon killed before it
        leaves `cp.snapshot_of` set: the next start takes it (the processes, not
        templated, are lost as with any template at a crash). `hold`: the sandbox was kept
        frozen for it (an fs checkpoint), or the processes `captured` held in their stops
        (a full one): it runs again once both are made (before the change summary)."""
        errors: list[DeltaBoxError] = []
        answered_at = time.perf_counter()
        later = captured is not None and captured.held is not None

        async def templates() -> None:
            assert captured is not None
            try:
                await self.cr.make_templates(captured)  # on the ptrace thread
            except Exception as e:
                errors.append(_cr_limit_error(e, "capturing") or _templates_error(cp, e))

        async def files() -> None:
            try:
                await trio.to_thread.run_sync(self.store.freeze, row.layer_id, cp.layer_id)
            except Exception as e:
                errors.append(_snapshot_error(cp, e))

        with trio.CancelScope(shield=True):
            with trio.move_on_after(ANSWER_WAIT_S):
                await answered.wait()  # the answer's thread needs the GIL more than we do
            crash_point("checkpoint.answered")
            t0 = time.perf_counter()
            await run_all([templates, files] if later else [files])
            error = errors[0] if errors else None
            live = self._live(sid)
            if hold:
                await self._let_go(live, captured)
                cp.freeze_ms += (time.perf_counter() - answered_at) * 1000
            if error is None and later:
                assert captured is not None
                try:   # from the templates, the processes running again meanwhile
                    await self._give_creds(live, captured)
                except Exception as e:
                    error = _templates_error(cp, e)
            if error is None:
                try:
                    snap = await trio.to_thread.run_sync(self._frozen, row, cp.layer_id)
                except Exception as e:
                    error = _snapshot_error(cp, e)
            if error is not None:
                log.error("checkpoint %s of %s: %s; the checkpoint is undone", cp.id, sid,
                          error.message)
                self._undo_checkpoint(sid, cp)
                if later:
                    assert captured is not None
                    self.dumps.drop([cp.id])
                    await self.cr.release(captured)
            else:
                made = "templates and file snapshot made" if later else "file snapshot taken"
                self._snapshot_taken(row, cp, snap, (
                    f"{made} {(time.perf_counter() - t0) * 1000:.1f} ms after the answer "
                    "(nothing ran in the sandbox meanwhile; operations waited)"))
                if later:
                    assert captured is not None
                    self._keep_captured(sid, live, cp.id, captured)
        self.pending.settle(cp.id, error)
        if error is None:
            self.warm.prepare(sid, cp.layer_id)

    def _snapshot_taken(self, row: SandboxRow, cp: CheckpointRow, snap: Snapshot,
                        how: str) -> None:
        """Commit what a deferred snapshot found (the change summary, the generation the
        sandbox's next checkpoint counts from); `how` replaces the answer's reason."""
        if snap.changes is not None:
            cp.files_changed, cp.bytes_changed = snap.changes.files, snap.changes.bytes
        cp.reasons = [r for r in cp.reasons if r != DEFERRED_NOTE] + [how]
        cp.snapshot_of = None
        row.base_gen = snap.generation
        with self.db.transaction():
            self.db.snapshot_taken(cp.id, cp.files_changed, cp.bytes_changed, cp.reasons,
                                   cp.freeze_ms)
            self.db.set_base_gen(row.id, snap.generation)

    def _undo_checkpoint(self, sid: str, cp: CheckpointRow) -> None:
        """A checkpoint that never got its files: gone, its children and its sandbox's head
        on its parent (as delete_checkpoint does; the parent cannot have gone meanwhile:
        its delete waits for a checkpoint underway from it)."""
        with self.db.transaction():
            self.db.delete_checkpoint(cp.id)
            self.db.reparent(cp.id, cp.parent_id)
        self.turns.lost_turn(sid)
        if self.store.layer_path(cp.layer_id).exists():
            self.store.delete(cp.layer_id)

    def _finish_snapshots(self) -> None:
        """At start: take the file snapshots a previous daemon answered for but did not
        take. Their sandbox's layer is as it was then: nothing ran in it, or it stayed
        frozen (its processes were killed above, still frozen), every later operation
        waited for the snapshot, and the daemon's death stopped them all."""
        for cp in self.db.unsnapshotted():
            row = self.db.get_sandbox(cp.sandbox_id)
            try:
                if row is None or row.layer_id != cp.snapshot_of or not \
                        self.store.layer_path(row.layer_id).exists():
                    raise Internal("the layer it was to be taken from is gone")
                if not self.store.layer_path(cp.layer_id).exists():
                    snap = self._snapshot(row, cp.layer_id)
                else:  # taken; the daemon died before recording it
                    snap = self._frozen(row, cp.layer_id)
            except Exception as e:
                log.error("recover: checkpoint %s never got its file snapshot (%s); "
                          "dropping it", cp.id, e)
                self._undo_checkpoint(cp.sandbox_id, cp)
                continue
            log.info("recover: took the file snapshot of checkpoint %s", cp.id)
            self._snapshot_taken(row, cp, snap, (
                "file snapshot taken when deltaboxd started again (it had stopped between "
                "the answer and the snapshot; nothing ran in the sandbox meanwhile)"))

    def _kept_templates(self, mode: str, live: Live, parent: CheckpointRow | None,
                        effects: TurnEffects | None) -> Kept:
        """For an auto checkpoint: which running processes the turn left untouched, and
        the templates (by pid in the sandbox) that stand for them: those of the parent
        checkpoint, when its processes are the ones running (the turn began when they were
        captured there, or restored from them). A capture shares those templates instead
        of copying 200 MB of page tables again for a process that only waited."""
        if (mode != "auto" or effects is None or parent is None or parent.procs_of is None
                or parent.procs_of != live.procs_from):
            return Kept()
        state = live.captured.get(parent.procs_of)
        if state is None or state.from_dump is not None:
            return Kept()
        untouched = untouched_processes(effects) - live.drifted()
        if not untouched:
            return Kept()
        # An armed alarm or POSIX timer runs down in wall time: the parent's template would
        # give the process back the time it had left then.
        return Kept(untouched, {r.nspid: state.templates[r.pid] for r in state.records
                                if r.running_timer is None})

    @staticmethod
    def _note_drift(live: Live, effects: TurnEffects | None) -> None:
        """A checkpoint that keeps its parent's templates (fs, skipped) although some
        process ran: the policy let a session shell whose state digest did not change
        (turns.py) stand for itself. Its template is then not exactly the running
        process: never reused for it (_kept_templates) until processes are captured or
        restored again."""
        ran = touched_processes(effects) if effects is not None else set()
        if ran:
            live.drift = (live.procs_from, live.drifted() | ran)

    @staticmethod
    def _init_filters(live: Live) -> int:
        """How many seccomp filters the sandbox's init carries (a dump compares its
        templates' with it). Fixed once init is ready (dbx-init confines itself before it
        says so), so read once: a /proc read is ~0.2 ms on a checkpoint's path here."""
        if live.init_filters is None:
            n = init_seccomp_filters(live.rt.init_pid)
            if n < 0:  # unreadable (init gone): the dump will fail on its own
                return n
            live.init_filters = n
        return live.init_filters

    def _decide(self, mode: str, live: Live, parent: CheckpointRow | None,
                effects, alive: set[int]) -> Decision:
        """The checkpoint's kind: forced by `mode`, else the turn policy."""
        if mode != "auto":
            why = ("file state only (processes restart on rollback)" if mode == "fs"
                   else "files and processes")
            return Decision(kind=mode, reasons=[f"mode={mode} requested: {why}"])
        reuse = None
        if parent is not None:
            if parent.procs_of != live.procs_from:
                reuse = ("the running processes are not the ones the parent checkpoint "
                         "holds (they were restarted since)")
            elif parent.procs_of is not None and not self._procs_available(live,
                                                                           parent.procs_of):
                reuse = "the parent checkpoint's process templates were evicted"
            elif parent.procs_of is None and alive:
                reuse = "the parent checkpoint holds file state only"
            elif (timed := self._timed(live, parent.procs_of)) is not None:
                reuse = (f"pid {timed.nspid} ({timed.cmd}) has {timed.running_timer} "
                         "running: its time left is not the parent checkpoint's")
        # Never captured, so their running changes no process state of the checkpoint:
        # the sandbox's init and launcher (they reap), the daemon's dbx-enter helpers (they
        # wait for their commands; they also reap the daemon's carriers and keepers when the
        # daemon kills them in the background). A child they reap shows as its own exit.
        quiet = set(live.rt.keep_pids) | {p.pid for p in live.procs}
        for sess in live.sessions.values():
            pid = sess.shell_pid(exclude=live.template_pids) if sess.alive else None
            if pid is not None and sess.state is not None and sess.state == sess.turn_state:
                quiet.add(pid)
        return self.turns.decide(effects, parent_reuse=reuse, has_parent=parent is not None,
                                 processes_alive=bool(alive), quiet=quiet)

    def _snapshot(self, row: SandboxRow, layer: str) -> Snapshot:
        """Freeze the sandbox's layer as `layer` and summarise what changed since its last
        checkpoint: in a full checkpoint both run in a worker thread while the templates are
        made, off the critical path (interleaved A/B, 20 each, three times: daemon p50
        8.67 vs 8.70, 7.79 vs 8.56, 8.35 vs 9.26 ms)."""
        self.store.freeze(row.layer_id, layer)
        # The snapshot committed its transaction: later writes are strictly newer.
        return self._frozen(row, layer)

    def _frozen(self, row: SandboxRow, layer: str) -> Snapshot:
        """A frozen layer's change summary since the sandbox's last checkpoint."""
        return Snapshot(self.store.changes_since(layer, row.base_gen),
                        self.store.generation(layer))

    def _checkpoint_row(self, cp_id: str, row: SandboxRow, parent: CheckpointRow | None,
                        layer: str, decision: Decision, captured: ProcessState | None,
                        label: str, procs_of: str | None, snap: Snapshot | None
                        ) -> CheckpointRow:
        """The new checkpoint's metadata (advances the sandbox's change generation)."""
        reasons = list(decision.reasons)
        files = nbytes = 0
        if decision.kind == "skipped":
            assert parent is not None
            layer = parent.layer_id
            reasons.append(f"aliases {parent.id}: no snapshot, no capture")
        elif snap is None:  # taken after the answer (Daemon._deferred_snapshot)
            reasons.append(DEFERRED_NOTE)
            if decision.kind == "full":
                reasons.append(f"{len(captured.records) if captured else 0} processes "
                               "captured as templates")
        else:
            changes = snap.changes
            row.base_gen = snap.generation
            if changes:
                files, nbytes = changes.files, changes.bytes
            else:
                reasons.append("change summary unavailable on the copy store")
            if decision.kind == "full":
                reasons.append(f"{len(captured.records) if captured else 0} processes "
                               "captured as templates")
            elif procs_of is not None:
                reasons.append(f"processes: those captured at {procs_of} (unchanged)")
        return CheckpointRow(
            id=cp_id, family_id=row.family_id, sandbox_id=row.id, parent_id=row.head_cp,
            layer_id=layer, image=row.image, kind=decision.kind, label=label,
            created_at=time.time(), duration_ms=0.0, files_changed=files,
            bytes_changed=nbytes, freeze_ms=0.0, reasons=reasons, procs_of=procs_of,
            bases=list(parent.bases if decision.kind == "skipped" and parent else row.bases))

    def _timed(self, live: Live, key: str | None) -> ProcessRecord | None:
        """A process of checkpoint `key` (held here or by an ancestor) with a timer armed
        at that checkpoint (ProcessRecord.running_timer)."""
        state = self._held_state(live, key)
        return next((r for r in state.records if r.running_timer), None) if state else None

    def _clear_ipc(self, live: Live, state: ProcessState | None) -> None:
        """A rollback's IPC objects made since its checkpoint, removed before the restore of
        `state` (its shared memory segments are made again by the restore: sysv_shm), or,
        with no state, before the processes restart."""
        if live.ipc_clear:
            live.ipc_clear = False
            native.ipc_objects(live.rt.pidfd, _mq_dir(live), clear=True,
                               keep_shm=state is not None and bool(state.sysv_shm))

    def _held_state(self, live: Live, key: str | None) -> ProcessState | None:
        """The processes captured at checkpoint `key`, held here or by an ancestor."""
        if key is None:
            return None
        holder = live if key in live.captured else self._ancestor_holding(live, key)
        return holder.captured.get(key) if holder is not None else None

    def _procs_available(self, live: Live, key: str) -> bool:
        """Whether the processes captured at checkpoint `key` can be restored here."""
        return (key in live.captured or self._ancestor_holding(live, key) is not None or
                self.dumps.complete(key) or self.dumps.pending(key))

    async def enforce_template_budget(self, interval: float = 2.0) -> None:
        """Forever: keep all sandboxes' templates within the memory budget (budget.py), and
        within the per-sandbox count once the dumps that held them over it have ended.
        Each pass is a call of its own: what it looked at (sandboxes, their checkpoints'
        process states) is not kept while this sleeps, after those sandboxes are gone."""
        walked = 0.0   # seconds the last page walk took
        while True:
            await trio.sleep(max(interval, walked / budget.WALK_SHARE))
            walked = await self._budget_pass()

    async def _budget_pass(self) -> float:
        """One pass of enforce_template_budget: the seconds its page walk took."""
        for live in list(self.live.values()):
            if len(live.captured) > self.cfg.templates_per_sandbox:
                self._evict_templates(live)
        limit = self.cfg.template_budget_mb << 20
        if limit <= 0:
            return 0.0
        held = [(sid, key, st) for sid, live in self.live.items()
                for key, st in live.captured.items()]
        if not held or await trio.to_thread.run_sync(
                budget.states_bound, [st for _, _, st in held]) <= limit:
            return 0.0
        carriers = [self.warm.carriers_of(sid, st) for sid, _, st in held]
        t = time.monotonic()
        costs = await trio.to_thread.run_sync(
            lambda: [budget.state_bytes(st, c) for (_, _, st), c in zip(held, carriers)])
        walked = time.monotonic() - t
        log.debug("template budget: %d checkpoints' templates measured in %.0f ms",
                  len(held), walked * 1000)
        where = {key: (sid, st) for sid, key, st in held}
        for key in budget.over_budget(
                [(key, st, c) for (_, key, st), c in zip(held, costs)], limit,
                prefer=self.dumps.complete_among({key for _, key, _ in held}),
                keep={key for _, key, _ in held if self.dumps.pending(key)}):
            sid, st = where[key]
            live = self.live.get(sid)
            if live is None:
                continue
            async with live.lock:
                if live.captured.get(key) is st:
                    await self._evict_now(live, key, st)
                    log.info("templates of %s (sandbox %s) evicted: over the %d MiB "
                             "template budget", key, sid, self.cfg.template_budget_mb)
        return walked

    async def _evict_now(self, live: Live, key: str, st: ProcessState) -> None:
        """Release checkpoint `key`'s templates `st` now, with what was spawned ahead from
        them; the checkpoint keeps its files (and its dump). Under the sandbox's lock."""
        del live.captured[key]
        live.evicted.add(key)
        self.warm.drop_procs(live.rt.sandbox_id, st)
        await self.cr.release(st)

    async def sweep_keepers(self, interval: float = 2.0) -> None:
        """Forever: a keeper whose process has exited or called execve holds an address
        space nobody uses (its memory stays charged to the sandbox): kill it."""
        while True:
            await trio.sleep(interval)
            self._sweep_keepers_pass()   # a call: keeps no sandbox while this sleeps

    def _sweep_keepers_pass(self) -> None:
        for live in list(self.live.values()):
            stale = [pid for pid, k in live.keepers.items()
                     if not native.same_address_space(pid, k.pid)]
            if stale:
                old = OldKeepers([live.keepers.pop(pid) for pid in stale], reaping=True)
                live.old_keepers.append(old)
                self.background.start_soon(self._reap_keepers, live, old)

    async def clean_store(self, interval: float = CLEAN_INTERVAL_S) -> None:
        """Forever: once enough layers were deleted (forks removed, retired generations),
        have the store drop them now, before they slow every later snapshot down."""
        while True:
            await trio.sleep(interval)
            try:
                await trio.to_thread.run_sync(self.store.clean_deleted, CLEAN_AFTER_DELETES)
            except DeltaBoxError as e:  # the next snapshot pays; nothing is lost
                log.warning("asking btrfs to drop deleted layers failed: %s", e)

    def _evict_templates(self, live: Live) -> None:
        """Keep the templates of the most recently used checkpoints only: each holds the
        pages its processes dirtied since. The checkpoint keeps its files; a rollback to it
        restarts processes and says why."""
        while len(live.captured) > self.cfg.templates_per_sandbox:
            # Least recently used first, preferring those a complete dump can rebuild; not
            # those whose dump is still being written from them (they go at a later call).
            free = [k for k in live.captured if not self.dumps.pending(k)]
            if not free:
                if len(live.captured) <= 2 * self.cfg.templates_per_sandbox:
                    return
                # A dump backlog must not keep templates usable forever: evict one now,
                # release it once its dump has been written (a rollback to it waits) --
                # unless as many again (at least 8) already wait so: then at once (its dump
                # fails, the checkpoint keeps its files and says so): memory stays bounded.
                free = list(live.captured)
            cp_id = next((k for k in free if self.dumps.complete(k)), free[0])
            after = (cp_id if self.dumps.pending(cp_id) and
                     len(live.held) < max(8, 2 * self.cfg.templates_per_sandbox)
                     else None)
            if after is None:
                self.dumps.abandon(cp_id)
            self._release_later(live, live.captured.pop(cp_id), after_dump=after)
            live.evicted.add(cp_id)

    def _release_later(self, live: Live, state: ProcessState,
                       after_dump: str | None = None) -> None:
        """Release templates in the background, under the sandbox's lock: templates live
        in the sandbox's cgroup, and on cgroup v1 a frozen task cannot die, so reaping one
        during a checkpoint's freeze would block the ptrace thread that the checkpoint
        needs to thaw (a deadlock seen in fault tests). after_dump: not before that
        checkpoint's process dump (written from these templates) has ended."""
        live.releasing.append(state)
        if after_dump is not None:
            live.held[after_dump] = state
        self.warm.drop_procs(live.rt.sandbox_id, state)

        async def release() -> None:
            if after_dump is not None:
                try:
                    await self.dumps.wait(after_dump)  # not under the lock: the dump needs it
                finally:
                    ours = live.held.get(after_dump) is state
                    if ours:
                        del live.held[after_dump]
                if not ours:   # taken back by a restore meanwhile (_take_back)
                    return
            async with live.lock:
                try:
                    await self.cr.release(state)
                finally:
                    live.releasing.remove(state)
        self.background.start_soon(release)

    async def _capture(self, live: Live, row: SandboxRow, layer: str,
                       candidates: set[int], kept: Kept, later: bool = False
                       ) -> tuple[ProcessState, Snapshot | None]:
        """With the cgroup frozen: capture every process of the sandbox and snapshot the
        files at the same instant (DeltaCR); `kept`: templates to share rather than make
        (_kept_templates). Thaws the cgroup whatever happens; on failure the snapshot is
        removed and nothing changed. `later`: no snapshot (None) and no templates, the
        processes stay stopped (ProcessState.held) for the caller to make them and
        snapshot the files, then let go."""
        thawed = False

        def thaw() -> None:
            nonlocal thawed
            if not thawed:
                live.rt.cgroup.thaw()
                thawed = True

        snap: list[Snapshot] = []  # set by the engine's call of snapshot()

        async def snapshot() -> None:
            snap.append(await trio.to_thread.run_sync(self._snapshot, row, layer))

        try:
            _look_at_ipc(live)
            for attempt in range(1, UNREAD_ATTEMPTS + 1):
                listed = self._sandbox_processes(candidates)
                procs = await self._settle_vforks(live, listed)
                if not procs:  # nothing runs but init: the snapshot and the IPC objects
                    alone = namespace_only(live.rt.pidfd, live.ipc_seen)
                    try:
                        await snapshot()
                    except BaseException:
                        await self.cr.release(alone)
                        raise
                    return alone, snap[0]
                # A thaw to let a vfork() finish, or events be read (below), let every
                # process run: nothing is untouched then.
                reuse = kept.templates_for(procs) if procs is listed and attempt == 1 else {}
                try:
                    state = await self.cr.capture(
                        procs, thaw, snapshot, lambda: self._daemon_pipes(live),
                        tracer_ok=set(), reuse=reuse,
                        layers=live.rt.generation.layers if live.rt.generation else (),
                        later=later, scope=row.id,
                        session_ttys={n: fd for n, sess in live.sessions.items()
                                      if (fd := sess.master_fd()) is not None},
                        ipcns=live.rt.pidfd, ipc_maybe=live.ipc_seen)
                    if later:
                        await self._room_for_templates(live, row, state)
                    else:
                        try:
                            await self._give_creds(live, state)
                        except BaseException:
                            with trio.CancelScope(shield=True):
                                await self.cr.release(state)
                            raise
                    live.tcp_captured |= state.holds_tcp
                    return state, snap[0] if snap else None
                except Unsettled as e:
                    if attempt == UNREAD_ATTEMPTS:
                        raise FailedPrecondition(f"{e.message} (at each of {attempt} "
                                                 "attempts)") from None
                    log.info("sandbox %s: a passing state, capturing again (attempt %d): %s",
                             live.rt.sandbox_id, attempt + 1, e.message)
                    snap.clear()
                    await self._let_settle(live, e.queues, layer)
                    thawed = False
                    candidates = self._candidates(live)
            raise AssertionError("unreachable")
        except BaseException as e:
            with trio.CancelScope(shield=True):
                thaw()
                if self.store.layer_path(layer).exists():
                    self.store.delete(layer)
            if (limit := _cr_limit_error(e, "capturing")) is not None:
                raise limit from e
            raise
        finally:
            thaw()

    async def _give_creds(self, live: Live, state: ProcessState) -> None:
        """A capture's unprivileged processes made restorable (cr/creds.py), or
        FailedPrecondition (the caller releases the capture)."""
        if not any(r.creds is not None for r in state.records):
            return
        gen = live.rt.generation
        assert gen is not None
        try:
            await self.cr.give_creds(state, live.rt.init_pid, f"/proc/self/fd/{gen.rootfd}")
        except native.CRError as e:
            raise FailedPrecondition(
                f"the processes that run without the capabilities to restore themselves "
                f"could not be made restorable: {e}; checkpoint with mode=fs (files "
                "only)") from e

    async def _room_for_templates(self, live: Live, row: SandboxRow,
                                  state: ProcessState) -> None:
        """A `later` capture's templates are made after the answer, each a task that counts
        against the sandbox's pids limit (row.pids_max, as written to its cgroup): one
        that has no room for them is refused now, its processes let go, rather than
        undone once answered."""
        assert state.held is not None
        need = len(state.held.stopped) - len(state.reused)
        current = live.rt.cgroup.pids_current()
        room = row.pids_max - current if current is not None else need
        if need > room:
            await self.cr.resume(state)
            raise ResourceExhausted(
                f"capturing the sandbox's processes would hit its limits: {need} templates "
                f"to make, room for {room} more tasks under its pids limit. Every captured "
                "process is kept as a template that counts against the sandbox's pids_max "
                "and memory_mb; create it with higher limits, or checkpoint with mode=fs "
                "(files only)")

    async def _let_settle(self, live: Live, queues: Sequence[tuple[int, int]],
                          layer: str) -> None:
        """A capture refused only for a passing state (Unsettled): drop its snapshot, let
        the processes run until the `queues` are empty (capture.waiting: an inotify
        instance of a file watcher woken by the last command's writes, a socket with
        descriptors in flight or a datagram, a listener with connections its server has not
        accepted yet; UNREAD_WAIT_S at most), then freeze again. With no
        queues (a process caught inside vfork() at its stop) the next attempt's vfork
        check lets it finish."""
        with trio.CancelScope(shield=True):
            if self.store.layer_path(layer).exists():
                await trio.to_thread.run_sync(self.store.delete, layer)
        ours = []
        try:
            for pid, fd in queues:
                try:  # our copy of the instance: its queue is the process's
                    ours.append(native.copy_fd(pid, fd))
                except OSError:
                    pass  # gone: nothing to wait for
            live.rt.cgroup.thaw()
            deadline = trio.current_time() + UNREAD_WAIT_S
            while trio.current_time() < deadline and any(waiting(fd) for fd in ours):
                await trio.sleep(0.001)
        finally:
            for fd in ours:
                os.close(fd)
        live.rt.cgroup.freeze()

    async def _settle_vforks(self, live: Live, procs: dict[int, native.ProcStatus]
                             ) -> dict[int, native.ProcStatus]:
        """With the cgroup frozen: if a process is inside vfork() (shells and Python's
        subprocess use it for every command), no ptrace stop can reach it until its child
        execs. Thaw briefly until it has, freeze again and list anew; a process that stays
        in vfork() is refused by name."""
        for _ in range(VFORK_ATTEMPTS):
            threads = {pid: st.threads for pid, st in procs.items()}
            busy = in_vfork(list(procs), threads)
            if not busy:
                return procs
            live.rt.cgroup.thaw()
            deadline = trio.current_time() + VFORK_WAIT_S
            while in_vfork(busy, threads) and trio.current_time() < deadline:
                await trio.sleep(0.001)
            live.rt.cgroup.freeze()
            procs = self._sandbox_processes(self._candidates(live))
        busy = in_vfork(list(procs), {pid: st.threads for pid, st in procs.items()})
        if not busy:
            return procs
        pid = busy[0]
        raise FailedPrecondition(
            f"pid {pid} ({process_name(pid)}) stayed inside vfork(), waiting for its child "
            f"to exec, at each of {VFORK_ATTEMPTS} attempts: it cannot be stopped there. "
            f"Retry the checkpoint, or checkpoint with mode=\"fs\" (files only)")

    def _nothing_runs(self, live: Live) -> bool:
        """Whether the sandbox has no process of its own, and none of the daemon's (exec,
        session) on its way in: then nothing can change its files or start a process (init
        only reaps; everything else that enters holds the sandbox's lock), and a checkpoint
        needs no freeze. A v1 freeze and thaw cost ~0.6 ms here, and an agent's sandbox
        between two commands usually runs nothing. (A session's shell that exited, or was
        killed at a timeout, stays in `live.procs` until the next rollback: not running.)"""
        return (all(p.returncode is not None for p in live.procs)
                and not self._candidates(live))

    @staticmethod
    def _candidates(live: Live) -> set[int]:
        """The cgroup's processes but init, our helpers and the templates (list it with
        the cgroup frozen)."""
        return live.rt.cgroup.pids() - live.rt.keep_pids - live.template_pids

    def _sandbox_processes(self, candidates: set[int]) -> dict[int, native.ProcStatus]:
        """The sandbox's own processes (host pid -> status, read once for the whole capture)
        among `candidates` (its cgroup's processes but init and our templates, listed by the
        caller with the cgroup frozen): those in its pid namespace, not zombies."""
        out = {}
        for pid in sorted(candidates):
            try:
                st = native.proc_status(pid)
            except OSError:
                continue  # exited meanwhile
            if len(st.nspid) >= 2 and st.state != "Z":
                out[pid] = st
        return out

    def _daemon_pipes(self, live: Live) -> tuple[dict[int, str], set[int]]:
        """Inodes of pipes whose other end is ours: sessions' (name:fd) and all others."""
        sessions: dict[int, str] = {}
        for name, sess in live.sessions.items():
            if sess.shell is None:
                continue
            for n, stream in enumerate((sess.shell.stdin, sess.shell.stdout, sess.shell.stderr)):
                try:
                    sessions[os.fstat(stream.fileno()).st_ino] = f"{name}:{n}"
                except (OSError, AttributeError):
                    pass
        ours = set()
        for fd in os.listdir("/proc/self/fd"):  # fstat: a readlink each costs ~10x more
            try:
                st = os.fstat(int(fd))
            except OSError:
                continue
            if stat.S_ISFIFO(st.st_mode):
                ours.add(st.st_ino)
        return sessions, ours

    async def rollback(self, sid: str, cp_id: str,
                       answer: Callable[[dict], None] | None = None) -> dict:
        """Make the sandbox's files exactly the checkpoint's, its processes the
        checkpoint's. `answer`: called with the result as soon as the sandbox is in the
        checkpoint's state, before the bookkeeping that follows (the turn's watch, the old
        sessions' pipes), which then overlaps the answer's way back to the client."""
        row = self._sandbox(sid)
        cp = await self._settled_checkpoint(cp_id)
        if cp.family_id != row.family_id:
            raise FailedPrecondition(
                f"checkpoint {cp_id} belongs to another sandbox family than {sid}; roll back "
                f"to one of `deltabox checkpoints {sid}`, or `deltabox fork {cp_id}`")
        live = self.live.get(sid)
        if live is None:  # stopped: boot it on the checkpoint
            await self._torn_down(sid)
            return await self._rollback_stopped(row, cp)
        t0 = time.perf_counter()
        await self._await_dump_if_needed(sid, live, cp)
        async with live.lock:
            row = self._sandbox(sid)
            cp = self._checkpoint(cp_id)
            stacked = _stacked_bases(row, cp)
            ready = self.warm.take_ready(sid, _warm_key(cp, stacked), live.rt)
            pre = ready.procs if ready is not None else None
            try:
                if ready is not None:  # prepared in the background: no snapshot, no mount
                    # Carriers dropped there first: their discard waits for this lock, and
                    # they hold objects of the generation (a pty's index) made again here.
                    for dropped in ready.dropped:
                        await self._discard_prespawned(None, dropped, live)
                    ready.dropped.clear()
                    layer, new_gen = ready.layer_id, ready.generation
                    killed = self._kill_processes(live)
                else:
                    layer, killed, new_gen = await self._fresh_generation(live, row, cp,
                                                                          stacked)
            except BaseException:
                if pre is not None:
                    with trio.CancelScope(shield=True):
                        await self._discard_prespawned(None, pre, live)
                raise
            try:
                return await self._rollback_to(live, row, cp, t0, layer, killed, new_gen, pre,
                                               prepared=ready is not None, stacked=stacked,
                                               answer=answer)
            finally:
                with trio.CancelScope(shield=True):
                    await self._victims_gone(live)
                self._kill_old_keepers(live)

    async def _rollback_to(self, live: Live, row: SandboxRow, cp: CheckpointRow, t0: float,
                           layer: str, killed: int, new_gen: runtime.Generation,
                           pre: Prespawned | None, prepared: bool = False,
                           stacked: list[str] | None = None,
                           answer: Callable[[dict], None] | None = None) -> dict:
        """The rest of a rollback, under the sandbox's lock, once its processes are killed:
        switch to the new generation, commit, restore the processes, `answer` (see
        rollback), then re-arm the turn's watch and close the old sessions: no await
        between the answer and the re-arm, so no other call on the sandbox runs before
        it. `stacked`: the sandbox's bases, kept (`layer` is a new empty layer over the
        checkpoint's)."""
        sid, cp_id = row.id, cp.id
        old_sessions: dict[str, Session] = {}
        try:
            crash_point("rollback.generation")
            if not prepared:  # the warm pool sets it as it prepares (_build_for)
                await self._limit_disk(row, layer)
            old = live.rt.generation
            live.rt.generation = new_gen
            old_layer, old_bases = self._move_to(row, cp, layer, stacked)
            crash_point("rollback.before_commit")
            with self.db.transaction():
                self.db.put_sandbox(row)
            crash_point("rollback.after_commit")
            self._retire_later(old, old_layer, after=[k.gone for k in live.old_keepers],
                               quiet_for=sid)
            self._release_bases([b for b in old_bases if b not in row.bases])
            self.warm.prepare(sid, _warm_key(cp, stacked))  # for the next rollback to it
            old_sessions, live.sessions = live.sessions, {}
            pre, taken = None, pre  # the restore owns it now
            if cp.procs_of is not None:
                # Its IPC objects (System V, POSIX message queues) the restore makes
                # again: those made since go before anything runs again, looked for only
                # if some may have been (a look costs ~0.25 ms).
                live.ipc_clear = live.ipc_seen or self.turns.may_have_made_ipc(sid)
                live.ipc_seen = False
            try:
                state, note, resumed = await self._restore_processes(live, cp, new_gen, taken)
            finally:
                self._clear_ipc(live, None)   # no restore came to it (processes restarted)
        except BaseException:
            await _close_sessions(old_sessions)
            raise
        finally:
            if pre is not None:  # failed before the restore
                with trio.CancelScope(shield=True):
                    await self._discard_prespawned(None, pre, live)
        await self._victims_gone(live)  # if no restore waited: nothing killed lingers
        live.procs_from = cp.procs_of if state == "restored" else None
        restarted = sorted(set(old_sessions) - set(live.sessions))
        live.restarted.update(restarted)
        result = dict(sandbox_id=sid, checkpoint_id=cp_id,
                      duration_ms=(time.perf_counter() - t0) * 1000,
                      sessions_restarted=restarted, processes_killed=killed,
                      process_state=state, note=note)
        if answer is not None:
            answer(result)
        self._new_turn(sid, live, resumed)
        await _close_sessions(old_sessions)
        return result

    async def _victims_gone(self, live: Live) -> None:
        """Wait until the processes a rollback killed have exited (their pids are about to
        be reused)."""
        await wait_exited(live.dying)

    def _kill_old_keepers(self, live: Live) -> None:
        """Once the processes a rollback killed have exited, their keepers: they tear the
        address spaces down in the background (after the rollback: milliseconds of CPU per
        100 MB the restore should not share), and the old generation is retired after
        them."""
        for old in live.old_keepers:
            if not old.reaping:
                old.reaping = True
                self.background.start_soon(self._reap_keepers, live, old)

    async def _reap_keepers(self, live: Live, old: OldKeepers) -> None:
        try:
            await trio.sleep(KEEPER_KILL_DELAY_S)  # let the rollback's response go first
            await self.foreground.quiet(live.rt.sandbox_id)  # and the command after it
            await self.cr.kill_carriers(old.carriers)
        finally:
            old.gone.set()
            live.old_keepers.remove(old)

    async def _await_dump_if_needed(self, sid: str, live: Live, cp: CheckpointRow) -> None:
        """If cp's processes can only come back from a process dump still being written
        (its templates were evicted from a dump backlog, and released since), wait for
        that dump. Not under the sandbox's lock: the dump takes it for every process image
        (dumps.py). Templates evicted but kept for their dump are taken back instead."""
        key = cp.procs_of
        if key is None:
            return
        # After the operations queued before: a checkpoint evicts templates after its
        # answer (a rollback right after it saw them captured, and found them gone).
        async with live.lock:
            if key in live.captured or (key in live.held and self._reclaim(live, key)):
                return
        if await self._take_back(key):   # held by an ancestor (a fork rolling back)
            return
        if self.dumps.pending(key) and self._ancestor_holding(live, key) is None:
            log.info("rollback of %s to %s waits for the process dump of %s", sid, cp.id, key)
            await self.dumps.wait(key, urgent=True)

    async def _restore_processes(self, live: Live, cp: CheckpointRow,
                                 gen: runtime.Generation, pre: Prespawned | None = None
                                 ) -> tuple[str, str, Resumed]:
        """Bring back the checkpoint's processes from their templates, held by this sandbox
        or an ancestor (`pre`: some spawned ahead into `gen`). Returns (process_state,
        note, host pids restored)."""
        key = cp.procs_of
        if key and key not in live.captured and key in live.held:
            self._reclaim(live, key)   # evicted again since _await_dump_if_needed
        captured = live.captured.get(key) if key else None
        if pre is not None and (captured is None or pre.state is not captured):
            await self._discard_prespawned(None, pre, live)
            pre = None
        if key:
            live.captured.pop(key, None)
        holder = None if captured is not None or key is None else \
            self._ancestor_holding(live, key)
        if holder is not None:  # a fork rolling back to a checkpoint of its ancestor
            async with holder.lock:
                if key not in holder.captured and key in holder.held:
                    self._reclaim(holder, key)
                state = holder.captured.get(key)
                if state is not None:
                    return await self._restore_logged(
                        live, state, cp, f"{len(state.records)} processes restored from "
                        "templates held by an ancestor sandbox", fresh=False)
        if captured is None and key is not None and holder is None:
            disk = await self._restore_from_disk(live, cp, key, gen)
            if disk is not None:
                return disk
        if captured is not None and captured.from_dump is not None:
            live.captured[key] = captured  # rebuilt from disk: restore as into a fork
            return await self._restore_logged(
                live, captured, cp, f"{len(captured.records)} processes restored from "
                f"templates (rebuilt from the dump of {captured.from_dump})", fresh=False)
        if captured is None:
            if key is None:
                why = "the checkpoint holds file state only"
            elif key in live.evicted:
                why = (f"its process templates were evicted (deltaboxd keeps "
                       f"{self.cfg.templates_per_sandbox} per sandbox, least recently used out)")
            else:
                why = "its process templates live in another sandbox or were lost in a restart"
            return "restarted", f"processes restarted: {why}", {}
        live.captured[key] = captured  # most recently used last
        got = await self._restore_logged(
            live, captured, cp, f"{len(captured.records)} processes restored from templates",
            fresh=None, gen=gen, pre=pre)
        if got[0] != "restored" and (killed := await self._drop_killed(live, key)):
            # Not on the way of a rollback that works: looked at once one failed.
            disk = await self._restore_from_disk(live, cp, key, gen)
            got = disk if disk is not None else ("restarted", "processes restarted", {})
            got = (got[0], f"{killed}; {got[1]}", got[2])
        return got

    async def _drop_killed(self, live: Live, key: str) -> str:
        """If a process of the sandbox (or the OOM killer) killed some of key's templates,
        release them all (the checkpoint's processes come back from its dump, or restart)
        and say which; "" if none was."""
        state = live.captured.get(key)
        killed = killed_templates(state) if state is not None else []
        if state is None or not killed:
            return ""
        del live.captured[key]
        self.dumps.abandon(key)
        await self.cr.release(state)
        log.warning("sandbox %s: the templates of %s for pid %s were killed: released",
                    live.rt.sandbox_id, key, killed)
        return (f"its process templates for pid {', '.join(map(str, killed))} were killed (a "
                "template is a fork of a sandbox process: `kill -9 -1` in the sandbox reaches "
                "it)")

    async def _prespawn(self, sid: str, cp_layer: str, ready: Ready) -> None:
        """Warm pool hook: spawn carriers, into `ready`'s generation, of the processes a
        rollback to the checkpoint on `cp_layer` restores (engine.DeltaCR.prespawn), and
        make the images it restores others from (images_ahead). Only
        when idle: not while the ptrace thread or this sandbox is busy (under load the extra
        forks cost more than the rollbacks they would speed up; a soak of 32 sandboxes ran
        at 41 instead of 59 cycles/s); else that rollback forks from the templates."""
        for _ in range(PRESPAWN_TRIES):
            live = self.live.get(sid)
            if live is None or not self.warm.is_ready(sid, cp_layer, ready):
                return
            if not live.lock.locked() and not self.cr.worker.busy:
                break
            await trio.sleep(PRESPAWN_RETRY_S)
        else:
            return
        key = self.db.procs_of_layer(source_layer(cp_layer))
        if key is None:
            return
        async with live.lock:
            state = live.captured.get(key)
            # Templates rebuilt from a dump restore as into a fork (_restore_from_disk).
            if (state is None or state.from_dump is not None or live.rt is not ready.runtime
                    or not self.warm.is_ready(sid, cp_layer, ready)):
                return
            try:
                pre = await self.cr.prespawn(state, ready.generation.mntfd,
                                             ready.generation.rootfd)
            except Exception as e:  # the rollback will spawn them itself
                log.warning("sandbox %s: spawning ahead for %s failed: %s", sid, key, e)
                return
            if pre is not None:
                ready.procs = pre
                live.prespawned |= pre.spawned
            await self.cr.images_ahead(state)

    async def _discard_prespawned(self, sid: str | None, pre: Prespawned,
                                  live: Live | None = None) -> None:
        """Kill children spawned ahead that no rollback used. Under the sandbox's lock
        (given `live`: the caller holds it): on cgroup v1 a frozen task cannot die, and a
        checkpoint freezes the cgroup while it needs the ptrace thread."""
        if live is not None:
            await self.cr.discard(pre)
            live.prespawned -= pre.spawned
            return
        live = self.live.get(sid) if sid is not None else None
        if live is None:
            await self.cr.discard(pre)
            return
        async with live.lock:
            await self.cr.discard(pre)
            live.prespawned -= pre.spawned

    async def _keep_carriers(self, done: trio.Event, carriers: list[native.Carrier]) -> None:
        """Carriers that gave birth become keepers (DeltaCR.keep), then `done` (the
        sandbox's `keeping`) is set: keep injects calls into them, in the sandbox's
        cgroup, so a checkpoint waits for it before it freezes the cgroup (frozen midway,
        the ptrace thread waited for ever, and the checkpoint behind it: a CI rehearsal
        hung so). The next command does not wait."""
        try:
            await self.cr.keep(carriers)
        finally:
            done.set()

    async def _restore_logged(self, live: Live, state: ProcessState, cp: CheckpointRow,
                              note: str, fresh: bool | None,
                              gen: runtime.Generation | None = None,
                              pre: Prespawned | None = None
                              ) -> tuple[str, str, Resumed]:
        """Restore into `live` (its own templates when `fresh` is None, else an
        ancestor's); a failure restarts the processes and says why."""
        crash_point("rollback.restoring")
        budget.touch(state)
        try:
            self._clear_ipc(live, state)
            if fresh is None:
                assert gen is not None
                try:
                    live.tcp_captured |= state.holds_tcp
                    restored = await self.cr.restore(
                        state, gen.mntfd, gen.rootfd, victims=live.dying, pre=pre,
                        pid_held=functools.partial(self._pid_held, live),
                        free_pid=functools.partial(self._free_pid, live, state),
                        ipcns=live.rt.pidfd)
                finally:
                    if pre is not None:  # born by the restore, or killed by it
                        live.prespawned -= pre.spawned
                live.keepers.update(restored.keepers)
                if restored.keepers:  # on the ptrace thread while the rollback answers
                    live.keeping = trio.Event()
                    self.background.start_soon(self._keep_carriers, live.keeping,
                                               list(restored.keepers.values()))
                self._adopt(live, restored, state)
            else:
                await self._victims_gone(live)  # the killed originals' pids must be free
                restored = await self._restore_into(live, state, fresh=fresh)
            if state.sysv_shm or state.sysv_msg or state.sysv_sem or state.posix_mq:
                # made again: looked at
                live.ipc_seen = True
        except Exception as e:
            log.error("rollback %s: restoring processes failed: %s", cp.id, e)
            return "restarted", f"restoring the processes failed ({e}); sessions restart", {}
        if restored.renumbered:
            note += (f"; pid {', '.join(map(str, restored.renumbered))} was in use by another "
                     "checkpoint's templates (as a pid, process group or session id): "
                     "restored with a new pid")
        if restored.note:
            note += f"; {restored.note}"
        return "restored", _with(note, state.orphans), stopped_calls(state, restored)

    async def _restore_from_disk(self, live: Live, cp: CheckpointRow, key: str,
                                 gen: runtime.Generation) -> tuple[str, str, Resumed] | None:
        """Rebuild the templates of `key` from its dump (templates evicted, or lost in a
        daemon restart) and restore from them. None: no dump to use (the caller says why).
        The rebuilt templates are init's children, in init's process group and session:
        processes get their own process groups again (setpgid, as in a fork); sessions are
        init's; leaders of groups come back with new pids, as in any rollback."""
        if self.dumps.pending(key):  # never wait under the lock (dumps.py): it needs it
            return ("restarted", "processes restarted: its templates were evicted before its "
                    "process dump completed", {})
        row = self.dumps.row(key)
        if row is None:
            if key in live.evicted:
                return None
            return ("restarted", "processes restarted: its process templates are gone and it "
                    "has no process dump", {})
        if row.state != "complete":
            why = NOT_COMPLETED if row.error == NOT_COMPLETED else \
                f"its templates are gone and its process dump failed ({row.error})"
            return "restarted", f"processes restarted: {why}", {}
        t0 = time.perf_counter()
        try:
            state = await self.dumps.load(key, live.rt.init_pid, f"/proc/self/fd/{gen.rootfd}",
                                          reserve_pids=True)
        except Exception as e:
            log.error("rollback %s: restoring from the dump of %s failed: %s", cp.id, key, e)
            return ("restarted", f"processes restarted: restoring from the dump of {key} "
                    f"failed: {e}", {})
        load_ms = (time.perf_counter() - t0) * 1000
        live.captured[key] = state
        live.evicted.discard(key)
        got = await self._restore_logged(
            live, state, cp, f"{len(state.records)} processes restored from disk (dump of "
            f"{key}; templates rebuilt in {load_ms:.0f} ms)", fresh=False)
        if got[0] != "restored" and live.captured.get(key) is state:
            del live.captured[key]
            await self.cr.release(state)
        self._evict_templates(live)
        return got

    async def _take_back(self, key: str) -> bool:
        """Templates evicted while their checkpoint's dump was pending live until it ends
        (_release_later): a restore to that checkpoint takes them back rather than wait
        for the dump and rebuild them from it (behind a dump backlog: 10-48 s in a 32 x
        1000 soak). Whether they were, in whichever sandbox held them."""
        for live in list(self.live.values()):
            if key in live.held:
                async with live.lock:
                    return key in live.held and self._reclaim(live, key)
        return False

    def _reclaim(self, live: Live, key: str) -> bool:
        """Under live's lock: key's templates, evicted and waiting for their dump, are
        captured again (most recently used); their release is off."""
        state = live.held[key]
        if any(t.released for t in state.templates.values()):
            return False
        del live.held[key]
        live.releasing.remove(state)
        live.captured[key] = state
        live.evicted.discard(key)
        log.info("templates of %s (sandbox %s) taken back before their dump ended",
                 key, live.rt.sandbox_id)
        return True

    def _ancestor_holding(self, live: Live, cp_id: str) -> Live | None:
        """The sandbox up our pid-namespace chain that holds cp's templates, if any."""
        sid = live.nest_parent
        while sid is not None and sid in self.live:
            anc = self.live[sid]
            if cp_id in anc.captured or cp_id in anc.held:
                return anc
            sid = anc.nest_parent
        return None

    def _pid_held(self, live: Live, nspid: int) -> bool:
        """Whether a living process in the sandbox's cgroup (a template, a keeper, a carrier:
        the processes a rollback killed are zombies or gone once it restores a pid) holds
        `nspid` of the sandbox's pid namespace as its pid, process group or session id: no
        wait frees it then. False when that cannot be told (init gone): the restore then
        retries as without it."""
        level = self._ns_level(live)
        if level is None:
            return False
        for pid in live.rt.cgroup.pids():
            ids = native.ids_in_namespace(pid, level)
            if ids is not None and nspid in ids:
                log.info("%s: pid %d of its namespace is held by host pid %d (%s) as its "
                         "%s%s", live.rt.sandbox_id, nspid, pid, process_name(pid),
                         " and ".join(role for role, i in zip(
                             ("pid", "process group id", "session id"), ids) if i == nspid),
                         _template_of(live, pid))
                return True
        return False

    @staticmethod
    def _ns_level(live: Live) -> int | None:
        """How deep the sandbox's pid namespace is below ours (None: its init is gone)."""
        try:
            return len(native.proc_status(live.rt.init_pid).nspid) - 1
        except OSError:
            return None

    async def _free_pid(self, live: Live, restoring: ProcessState, nspid: int) -> bool:
        """Make `nspid` free for a rollback that must give it back (an exited child's: its
        parent waits for that pid): release the templates of the sandbox's other
        checkpoints that hold it (as their session's or group's id) if their dump is
        complete, so that they restore from it instead; True if any went. The rollback
        holds the sandbox's lock."""
        level = self._ns_level(live)
        if level is None:
            return False
        freed = False
        for key, st in list(live.captured.items()):
            if st is restoring or not self.dumps.complete(key) or not any(
                    nspid in (native.ids_in_namespace(t.pid, level) or ())
                    for t in st.templates.values()):
                continue
            await self._evict_now(live, key, st)
            log.info("templates of %s (sandbox %s) released: they held pid %d, which a "
                     "rollback gives back; that checkpoint restores from its dump",
                     key, live.rt.sandbox_id, nspid)
            freed = True
        return freed

    def _adopt(self, live: Live, restored: Restored, state: ProcessState) -> None:
        """Take over the daemon's side of restored processes: their session shells, and
        pipes they write to us (drained) or read from us (held open)."""
        for name, (pid, stdin_w, out_r, err_r) in restored.session_fds.items():
            master = restored.session_ttys.get(name)
            sess = Session(name, tty=master is not None, kill_group=live.kill_group)
            sess.attach(AdoptedShell(pid, os.pidfd_open(pid), trio.lowlevel.FdStream(stdin_w),
                                     trio.lowlevel.FdStream(out_r),
                                     trio.lowlevel.FdStream(err_r),
                                     None if master is None else
                                     trio.lowlevel.FdStream(master)), self.background)
            sess.state = sess.turn_state = state.session_states.get(name)
            live.sessions[name] = sess
        for fd, is_read in restored.daemon_fds:
            if is_read:  # a restored process writes to us: drain it, as for any exec
                sink = execute.Capture("drain", 0, None)
                sink.detach()
                self.background.start_soon(execute.pump, trio.lowlevel.FdStream(fd), sink)
            else:        # it reads from us: keep the pipe open, as it was
                live.held_fds.append(fd)

    async def _build_for(self, sid: str, key: str, layer: str
                         ) -> tuple[runtime.Generation, runtime.Runtime] | None:
        """Build a generation of a live sandbox on `layer`, a clone of the checkpoint layer
        `key` (for the warm pool), or for a stacked key an empty layer over that layer."""
        live = self.live.get(sid)
        row = self.db.get_sandbox(sid)
        if live is None or live.rt.exited.is_set() or row is None or live.rt.pidfd < 0:
            return None
        # Not under the sandbox's lock (a rollback must not wait for this): our own dup of
        # init's pidfd cannot be closed underneath us, and the pool drops the result if the
        # sandbox changed meanwhile.
        await self._limit_disk(row, layer)  # here, not on the rollback's critical path
        cp_layer = source_layer(key)
        bases = self.db.bases_of_layer(cp_layer)
        if cp_layer != key:
            bases = [cp_layer, *bases]
            if bases != row.bases:  # it was rolled back elsewhere meanwhile: not worth it
                return None
        rt, pidfd = live.rt, os.dup(live.rt.pidfd)
        try:
            gen = await runtime.build_generation(
                rt, layer, self._lowers(self._image(row.image), bases),
                self.store.layer_path(layer), self.mountpoint, self.background, pidfd=pidfd)
        finally:
            os.close(pidfd)
        return gen, rt

    async def _fresh_generation(self, live: Live, row: SandboxRow, cp: CheckpointRow,
                                stacked: list[str] | None = None
                                ) -> tuple[str, int, runtime.Generation]:
        """Clone the checkpoint (in a worker thread, while this thread kills the sandbox's
        processes) and mount a generation on it; with `stacked` (_stacked_bases), a new
        empty layer over those bases instead."""
        layer, killed = "", 0

        async def take() -> None:
            nonlocal layer
            layer = await self._rollback_layer(cp, stacked)

        async def kill() -> None:
            nonlocal killed
            killed = self._kill_processes(live)

        try:
            await run_all([take, kill])
        except BaseException:
            with trio.CancelScope(shield=True):
                if layer:
                    self.store.delete(layer)
            raise
        try:
            gen = await runtime.build_generation(
                live.rt, layer, self._lowers(self._image(row.image), stacked or cp.bases),
                self.store.layer_path(layer), self.mountpoint, self.background)
        except BaseException:
            with trio.CancelScope(shield=True):
                self.store.delete(layer)
            raise
        return layer, killed, gen

    def _kill_processes(self, live: Live) -> int:
        """Kill everything in the sandbox but its init (the pid namespace must live on) and
        the templates of its checkpoints. Not waited for: see `live.dying`."""
        helpers = sum(p.returncode is None for p in live.procs)
        # dbx-enter: its command dies with it (PDEATHSIG); trio waits for it (and reaps it:
        # never reap it ourselves, its exit status would be lost), and its pid is not one
        # of the sandbox's.
        ours = {p.pid for p in live.procs}
        for p in list(live.procs):
            _kill(p)
        live.procs.clear()
        for fd in live.held_fds:
            os.close(fd)
        live.held_fds.clear()
        keep = live.rt.keep_pids | live.template_pids | ours
        if live.tcp_captured:
            tcp.quiet_all(live.rt.cgroup.pids() - keep)
        dying = live.rt.cgroup.kill_now(keep=keep)
        live.dying.extend(dying)
        if live.keepers:  # killed once their processes have exited (_victims_gone)
            live.old_keepers.append(OldKeepers(list(live.keepers.values())))
            live.keepers = {}
        crash_point("rollback.killed")
        return helpers + len(dying)

    def _move_to(self, row: SandboxRow, cp: CheckpointRow, layer: str,
                 stacked: list[str] | None) -> tuple[str, list[str]]:
        """Point the sandbox's row (not committed) at checkpoint `cp` on its new writable
        `layer` (_rollback_layer); returns the layer and bases it had."""
        old = row.layer_id, row.bases
        row.layer_id, row.head_cp = layer, cp.id
        row.bases = list(stacked or cp.bases)
        row.base_gen = 0 if stacked else self.store.generation(layer)
        return old

    async def _rollback_layer(self, cp: CheckpointRow, stacked: list[str] | None) -> str:
        """The writable layer a rollback to `cp` goes on: a clone of cp's layer, or, for a
        sandbox that stacks it (_stacked_bases), a new empty layer."""
        if not stacked:
            return await self.warm.take_layer(cp.layer_id, spare_after=False)
        layer = new_id("L")
        await trio.to_thread.run_sync(self.store.new_layer, layer,
                                      limiter=self.warm.clone_threads)
        return layer

    async def _rollback_stopped(self, row: SandboxRow, cp: CheckpointRow) -> dict:
        t0 = time.perf_counter()
        stacked = _stacked_bases(row, cp)
        layer = await self._rollback_layer(cp, stacked)
        old_layer, old_bases = self._move_to(row, cp, layer, stacked)
        try:
            await self._boot(row)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._stop(row.id)
                self.store.delete(layer)
            raise
        with self.db.transaction():
            self.db.put_sandbox(row)
        self._retire_later(None, old_layer)
        self._release_bases([b for b in old_bases if b not in row.bases])
        return dict(sandbox_id=row.id, checkpoint_id=cp.id,
                    duration_ms=(time.perf_counter() - t0) * 1000, sessions_restarted=[],
                    processes_killed=0, process_state="restarted",
                    note="the sandbox was stopped: it booted again; processes restarted")

    async def fork(self, cp_id: str, count: int, shared_layer: bool = False
                   ) -> tuple[list[SandboxRow], str, str]:
        """N new sandboxes whose files are the checkpoint's and, when its process templates
        are at hand, whose processes are the checkpoint's too (`shared_layer`: see
        _fork_files). Returns (rows, process_state, note).

        Isolation: a template can spawn only into its own pid namespace or one nested
        below it (kernel rule), so forks that get processes have their pid namespace nested
        in the template holder's sandbox: forks cannot see or signal one another, nor the
        holder; the holder's processes can see and signal its forks' (one agent's tree)."""
        cp = await self._settled_checkpoint(cp_id)
        count = count or 1
        if not 1 <= count <= MAX_FORK:
            raise InvalidArgument(f"fork count must be 1..{MAX_FORK}, got {count}")
        if len(self.live) + count > self.cfg.max_sandboxes:
            raise ResourceExhausted(f"forking {count} would exceed the limit of "
                                    f"{self.cfg.max_sandboxes} sandboxes")
        owner, disk, why = await self._locked_fork_source(cp)
        if owner is None:
            rows = await self._fork_files(cp, count, shared_layer, None)
            return rows, "restarted", f"processes restarted: {why}"
        live_owner, key = self.live[owner], cp.procs_of
        try:  # its templates stay put while we spawn from them (its lock is held)
            if key in live_owner.captured:
                # Each child's processes are restored as soon as it has booted, while the
                # others boot: the templates' page-table copies (the bulk of a restore, in
                # the kernel, on one CPU) overlap the boots. Nothing is committed before
                # every child is whole (_fork_files undoes them all on a failure).
                state = live_owner.captured[key]
                budget.touch(state)
                try:
                    rows = await self._fork_files(
                        cp, count, shared_layer, owner,
                        functools.partial(self._restore_fork_child, key, state),
                        alongside=functools.partial(self.cr.open_lanes, state, count))
                except Exception as e:
                    if (limit := _fork_failed(cp, e)) is not None:
                        raise limit from e
                    if not isinstance(e, native.CRError):
                        raise
                    # A template the restore could not use (one killed from outside: the
                    # OOM killer): the children were undone; as a rollback would, they
                    # get the checkpoint's files and say why their processes restarted.
                    rows = await self._fork_files(cp, count, shared_layer, None)
                    return rows, "restarted", (f"processes restarted: restoring them "
                                               f"failed ({e})")
                finally:
                    self._close_lanes_soon(state)
                return rows, "restored", _with(f"{len(state.records)} processes restored "
                                               "from templates in each fork", state.orphans)
            # The templates come from the dump, rebuilt in the holder from the first child's
            # files: the children boot first, then their processes are restored.
            rows = await self._fork_files(cp, count, shared_layer, owner)
            kid_gen = self.live[rows[0].id].rt.generation  # the checkpoint's files
            assert kid_gen is not None
            try:
                live_owner.captured[key] = await self.dumps.load(
                    key, live_owner.rt.init_pid, f"/proc/self/fd/{kid_gen.rootfd}")
            except Exception as e:
                log.error("fork %s: restoring from the dump of %s failed: %s", cp.id, key, e)
                return rows, "restarted", (f"processes restarted: restoring from the dump "
                                           f"of {key} failed: {e}")
            live_owner.evicted.discard(key)
            state = live_owner.captured[key]
            budget.touch(state)
            try:
                await self.cr.open_lanes(state, count)
                await run_all([functools.partial(self._restore_fork_child, key, state, r)
                               for r in rows])
            except Exception as e:
                with trio.CancelScope(shield=True):
                    for r in rows:
                        await self._stop(r.id)
                        self.store.delete(r.layer_id)
                    with self.db.transaction():
                        for r in rows:
                            self.db.delete_sandbox(r.id)
                if (limit := _fork_failed(cp, e)) is not None:
                    raise limit from e
                raise
            finally:
                self._close_lanes_soon(state)
        finally:
            live_owner.lock.release()
        if self.live.get(owner) is live_owner:
            self._evict_templates(live_owner)  # the dump added templates
        return rows, "restored", _with(f"{len(state.records)} processes restored from disk "
                                       f"(dump of {key}) in each fork", state.orphans)

    async def _locked_fork_source(self, cp: CheckpointRow
                                  ) -> tuple[str | None, str | None, str]:
        """The sandbox a fork of cp spawns its processes from, with its lock taken (the
        caller releases it), whether its templates are rebuilt there from the dump (not
        None) or not (None), and why there is none. Found again when the templates
        went while the fork waited for that lock (evicted by another operation's budget,
        their sandbox removed): a fork under load waits seconds for it."""
        why = ""
        for _ in range(FORK_SOURCE_TRIES):
            owner, disk, why = await self._fork_source(cp)
            await faults.pause_point("fork.source_found")
            if owner is None:
                return None, None, why
            live_owner = self.live[owner]
            await live_owner.lock.acquire()
            if self.live.get(owner) is live_owner and (cp.procs_of in live_owner.captured
                                                       or disk is not None):
                return owner, disk, why
            live_owner.lock.release()
            log.info("fork of %s: the templates of %s went while it waited for %s; "
                     "looking again", cp.id, cp.procs_of, owner)
            why = "the templates went meanwhile"
        return None, None, why

    async def _fork_source(self, cp: CheckpointRow) -> tuple[str | None, str | None, str]:
        """The sandbox holding cp's templates (and None), else one of its family to rebuild
        them in from the dump (and not None), else None and why (_locked_fork_source)."""
        owner, why = self._template_owner(cp)
        killed = ""
        if owner is not None and cp.procs_of is not None:
            async with self.live[owner].lock:   # a template killed: fork from the dump
                killed = await self._drop_killed(self.live[owner], cp.procs_of)
            if killed:
                owner, why = self._template_owner(cp)
        if (owner is None and cp.procs_of is not None and self.dumps.pending(cp.procs_of)
                and not await self._take_back(cp.procs_of)):
            await self.dumps.wait(cp.procs_of, urgent=True)  # evicted from a dump backlog
        if owner is None and cp.procs_of is not None:
            owner, why = self._template_owner(cp)
        if killed and owner is None:
            why = killed
        disk = None
        if owner is None:  # rebuild the templates from the dump, in a live family sandbox
            owner, disk = await self._dump_holder(cp, why)
            why = disk if owner is None else why
        return owner, disk, why

    def _close_lanes_soon(self, state: ProcessState) -> None:
        """A fork is over: its lane copies go in the background (DeltaCR.release_lanes)."""
        copies = self.cr.detach_lanes(state)
        if copies:
            self.background.start_soon(self.cr.release_lanes, copies)

    async def _restore_fork_child(self, key: str, state: ProcessState, row: SandboxRow
                                  ) -> None:
        """The processes captured at `key`, from their templates, into a booted fork."""
        kid = self.live[row.id]
        resumed = stopped_calls(state, await self._restore_into(kid, state))
        kid.procs_from = key
        self._new_turn(row.id, kid, resumed)

    async def _dump_holder(self, cp: CheckpointRow, why: str) -> tuple[str | None, str]:
        """A live sandbox of cp's family to rebuild cp's templates in from its dump (the
        forks nest below it), or (None, why not)."""
        key = cp.procs_of
        if key is None:
            return None, why
        row = self.dumps.row(key)  # a pending dump cannot be used: its templates went
        if row is None or row.state != "complete":
            return None, (why if row is None else NOT_COMPLETED
                          if row.error == NOT_COMPLETED else
                          f"{why}, and its process dump failed ({row.error})")
        family = [cp.sandbox_id] + [r.id for r in self.db.family_sandboxes(cp.family_id)]
        for sid in family:
            live = self.live.get(sid)
            if (live is not None and live.rt.generation is not None
                    and not live.rt.exited.is_set()
                    and self._nest_level(sid) < MAX_NEST_LEVEL):
                return sid, ""
        return None, f"{why}; no sandbox of its family runs to rebuild them from its dump in"

    def _template_owner(self, cp: CheckpointRow) -> tuple[str | None, str]:
        """The live sandbox holding cp's templates, if forks can be spawned from them."""
        key = cp.procs_of
        if key is None:
            return None, "the checkpoint is file-state only (mode=fs)"
        for sid, live in self.live.items():
            if key in live.captured:
                if self._nest_level(sid) >= MAX_NEST_LEVEL:
                    return None, (f"forks of forks nest pid namespaces, and {sid} is "
                                  f"{MAX_NEST_LEVEL} deep already")
                return sid, ""
            if key in live.evicted:
                return None, "its process templates were evicted"
        return None, "its process templates are gone (their sandbox was removed or restarted)"

    async def _restore_into(self, live: Live, state: ProcessState,
                            fresh: bool = True) -> Restored:
        """Spawn a checkpoint's processes (templates of an ancestor sandbox) into a fork:
        a new one (`fresh`), or one rolling back."""
        rt = live.rt
        assert rt.generation is not None
        pidns = os.open(f"/proc/{rt.init_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        cg_fds: list[int] = []
        try:
            for f in rt.cgroup.procs_files:
                cg_fds.append(os.open(f, os.O_WRONLY | os.O_CLOEXEC))
            live.tcp_captured |= state.holds_tcp
            restored = await self.cr.restore(
                state, rt.generation.mntfd, rt.generation.rootfd,
                Elsewhere(pidns, rt.pidfd, cg_fds, rt.init_pid, fresh, pid_fallback=not fresh),
                pid_held=functools.partial(self._pid_held, live))
        finally:
            for fd in [pidns, *cg_fds]:
                os.close(fd)
        # Its counter started low, below the pids given back: raised above them, so that
        # its new processes (templates of its own checkpoints among them) do not take
        # pids a later rollback needs back (dumps._skip_pids, for a restore from disk).
        rt.raise_pid_floor(highest_pid(state, restored))
        self._adopt(live, restored, state)
        return restored

    async def _fork_files(self, cp: CheckpointRow, count: int, shared_layer: bool,
                          nest_under: str | None,
                          then: Callable[[SandboxRow], Awaitable[None]] | None = None,
                          alongside: Callable[[], Awaitable[None]] | None = None
                          ) -> list[SandboxRow]:
        """Boot `count` sandboxes on the checkpoint's files, each followed by `then` (its
        processes' restore), and commit them; on any failure, undo them all. `alongside`
        runs while their layers are made (preparing the restores).

        Each child gets a clone of the checkpoint's layer, unless `shared_layer`: then its
        writable layer starts empty over the checkpoint's, read-only and shared by all of
        them (_fork_bases), as a container's over its image: the files they read come from
        one set of inodes, whose page cache stays warm across the children and their
        rollbacks to their own checkpoints (with a clone each, every file is read from disk
        again after each rollback), with overlayfs's limits on lower files (EXDEV on
        renaming a lower directory, hard links broken by copy-up). Beyond MAX_BASES stacked
        layers, a child gets a clone."""
        bases = self._fork_bases(cp) if shared_layer else None
        if bases is None:
            return await self._fork_layers(cp, count, nest_under, None, then, alongside)
        self._base_pins[cp.layer_id] += 1
        try:
            return await self._fork_layers(cp, count, nest_under, bases, then, alongside)
        finally:
            self._base_pins[cp.layer_id] -= 1
            if not self._base_pins[cp.layer_id]:
                del self._base_pins[cp.layer_id]
            self._release_bases([cp.layer_id])  # deleted meanwhile, and no child was made

    @staticmethod
    def _fork_bases(cp: CheckpointRow) -> list[str] | None:
        """The bases of a fork's children: the checkpoint's layer over its own bases; None
        (a clone of the layer instead) once MAX_BASES would be exceeded."""
        if len(cp.bases) >= MAX_BASES:
            return None
        return [cp.layer_id, *cp.bases]

    async def _fork_layers(self, cp: CheckpointRow, count: int, nest_under: str | None,
                           bases: list[str] | None,
                           then: Callable[[SandboxRow], Awaitable[None]] | None,
                           alongside: Callable[[], Awaitable[None]] | None
                           ) -> list[SandboxRow]:
        """_fork_files with the children's bases decided (None: each gets a clone)."""
        src = self.db.get_sandbox(cp.sandbox_id) or next(
            iter(self.db.family_sandboxes(cp.family_id)), None)
        rows: list[SandboxRow] = []
        limits = (Limits(src.memory_mb, src.pids_max, src.cpus) if src else
                  Limits(self.cfg.default_memory_mb, self.cfg.default_pids_max, 0.0))
        userns = src.userns if src else False
        kind = SpareKind(nest_under, limits, userns) if nest_under is not None else None
        taken: dict[str, Spare] = {}
        for _ in range(count):
            spare = self.spares.take(kind) if kind is not None else None
            sid = spare.sid if spare is not None else new_id("sb")
            if spare is not None:
                taken[sid] = spare
            rows.append(SandboxRow(
                id=sid, family_id=cp.family_id, state="running", image=cp.image,
                layer_id=new_id("L"), head_cp=cp.id,
                memory_mb=limits.memory_mb, pids_max=limits.pids_max, cpus=limits.cpus,
                hostname=sid, env=dict(src.env) if src else {}, created_at=time.time(),
                disk_mb=src.disk_mb if src else self.cfg.default_disk_mb, userns=userns))
        try:
            # Concurrent snapshot ioctls join one btrfs transaction commit; each child's
            # init starts meanwhile (_boot), and its processes are restored once the lanes
            # are ready.
            lanes_ready = trio.Event()

            async def lanes() -> None:
                try:
                    if alongside is not None:
                        await alongside()
                finally:
                    lanes_ready.set()

            async def take(r: SandboxRow) -> None:
                if bases is None:
                    r.layer_id = await self.warm.take_layer(cp.layer_id)
                    r.bases = list(cp.bases)
                    r.base_gen = self.store.generation(r.layer_id)
                    return
                await trio.to_thread.run_sync(self.store.new_layer, r.layer_id,
                                              limiter=self.warm.clone_threads)
                r.bases = list(bases)
                r.base_gen = 0  # a new layer: everything in it is a change

            async def boot(r: SandboxRow) -> None:
                await self._boot(r, nest_under, take_layer=functools.partial(take, r),
                                 spare=taken.get(r.id))
                await lanes_ready.wait()
                crash_point("fork.cloned")
                if then is not None:
                    await then(r)

            await run_all([lanes] + [functools.partial(boot, r) for r in rows])
            crash_point("fork.booted")
        except BaseException:
            with trio.CancelScope(shield=True):
                for r in rows:
                    if r.id not in self.live and r.id in taken:  # its init never started
                        await self._stop_spare(taken[r.id].rt)
                    await self._stop(r.id)
                    self.store.delete(r.layer_id)
            raise
        crash_point("fork.before_commit")
        with self.db.transaction():
            for r in rows:
                self.db.put_sandbox(r)
        if kind is not None:  # the next fork from the same sandbox finds its inits booted
            self.spares.want(kind, count)
        return rows

    async def turn_effects(self, sid: str, cp_id: str = ""
                           ) -> tuple[str, TurnEffects | None, Decision | None]:
        """What the sandbox did in its current turn so far (`cp_id` empty), or in the turn
        that checkpoint `cp_id` closed: (inspector backend, effects, the policy's decision).
        Effects are None when the inspector did not watch (the backend says why)."""
        self._sandbox(sid)
        if not cp_id:
            self._live(sid)
            return self.turns.status, self.turns.current(sid), None
        cp = await self._settled_checkpoint(cp_id)
        if cp.sandbox_id != sid:
            raise InvalidArgument(f"checkpoint {cp_id} was taken of {cp.sandbox_id}, not {sid}")
        got = self.turns.recorded(sid, cp_id)
        if got is None:
            raise NotFound(f"the turn that {cp_id} closed is no longer kept (the daemon keeps "
                           f"the last few per sandbox, in memory); its reasons are in "
                           f"`deltabox checkpoints {sid}`")
        return self.turns.status, got[0], got[1]

    async def checkpoints(self, sid: str) -> list[CheckpointRow]:
        row = self._sandbox(sid)
        await self.pending.wait_sandbox(sid)
        return [self._with_dump(c) for c in
                _tree_order(self.db.family_checkpoints(row.family_id))]

    async def get_checkpoint(self, cp_id: str) -> CheckpointRow:
        return self._with_dump(await self._settled_checkpoint(cp_id))

    def _with_dump(self, c: CheckpointRow) -> CheckpointRow:
        """The row with the state of its process dump as a last reason (not stored)."""
        line = self.dumps.describe(c.id) if c.procs_of == c.id else None
        if line:
            c.reasons = [*c.reasons, line]
        return c

    async def delete_checkpoint(self, cp_id: str) -> bool:
        """Forget a checkpoint; its children hang from its parent; its layer is freed when
        nothing else references it."""
        await self._settled_checkpoint(cp_id)
        await self.underway.clear(cp_id)  # a checkpoint being taken hangs from it
        cp = self._checkpoint(cp_id)  # as it is now (a concurrent delete: NOT_FOUND)
        crash_point("delete_checkpoint.before_commit")
        with self.db.transaction():
            self.db.delete_checkpoint(cp_id)
            self.db.reparent(cp_id, cp.parent_id)
        crash_point("delete_checkpoint.after_commit")
        key = cp.procs_of
        if key is not None and self.db.procs_refs(key) == 0:  # no checkpoint restores them
            for live in self.live.values():
                state = live.captured.pop(key, None)
                if state is not None:
                    self._release_later(live, state)  # not while it may be frozen
            self.dumps.drop([key])
        self._release_bases(cp.bases)
        if self.db.layer_refs(cp.layer_id) == 0:  # skipped checkpoints share their parent's
            self.warm.drop_layer(cp.layer_id)
            if self._is_base(cp.layer_id):  # its forks' files: kept while they need it
                return False
            self._retire_later(None, cp.layer_id)
            return True
        return False

    async def diff(self, a_id: str, b_id: str) -> tuple[list[str], list[str], list[str], str]:
        a, b = await self._settled_checkpoint(a_id), await self._settled_checkpoint(b_id)
        if a.image != b.image:
            raise FailedPrecondition(f"{a_id} and {b_id} have different images "
                                     f"({a.image} vs {b.image}); diff compares one image's layers")
        img = self._image(a.image)
        r = await trio.to_thread.run_sync(  # each view: its layer, its bases, the image
            diff_stacks, self._lowers(img, [a.layer_id, *a.bases]),
            self._lowers(img, [b.layer_id, *b.bases]))
        return list(r.added), list(r.modified), list(r.deleted), r.note


def _nested(store_root: Path, image_root: Path) -> bool:
    """Whether the store's layers would lie inside the image on the same filesystem."""
    if os.stat(store_root).st_dev != os.stat(image_root).st_dev:
        return False
    return store_root.resolve().is_relative_to(image_root.resolve())


async def _stop_runtime(rt: runtime.Runtime) -> None:
    """Kill a sandbox's every process, its init too, and remove its cgroup."""
    await runtime.stop(rt)
    rt.cgroup.remove()


def _snapshot_error(cp: CheckpointRow, e: Exception) -> DeltaBoxError:
    return e if isinstance(e, DeltaBoxError) else Internal(
        f"taking the file snapshot of {cp.id} failed: {e!r}")


def _templates_error(cp: CheckpointRow, e: Exception) -> DeltaBoxError:
    """A checkpoint's process templates that could not be made after its answer."""
    why = e.message if isinstance(e, DeltaBoxError) else repr(e)
    return FailedPrecondition(f"the processes of checkpoint {cp.id} could not be kept after "
                              f"it was answered ({why}); it was undone: checkpoint again, "
                              "or with mode=\"fs\" (files only)")


def _with(note: str, more: str) -> str:
    """A response's note with `more` after it, if any."""
    return f"{note}; {more}" if more else note


def _fork_failed(cp: CheckpointRow, e: Exception) -> ResourceExhausted | None:
    """Log a fork that failed while restoring processes; a kernel limit it hit becomes
    RESOURCE_EXHAUSTED (else the error is raised as itself)."""
    log.error("fork %s: booting or restoring the children failed: %s", cp.id, e)
    return _cr_limit_error(e, "restoring")


def _may_have_made_ipc(effects: TurnEffects | None) -> bool:
    """Whether a turn may have made System V IPC objects: the inspector saw an IPC call,
    or did not see the whole turn."""
    return (effects is None or not effects.complete or effects.lost_events > 0
            or len(effects.other_effects) >= LIST_CAP   # the list was cut short
            or any(e.startswith("System V") for e in effects.other_effects))


def _look_at_ipc(live: Live) -> None:
    """Whether the sandbox's IPC namespace still holds objects (Live.ipc_seen), which a
    full checkpoint captures (cr/sysv_shm.py, cr/sysv_msg.py, cr/sysv_sem.py,
    cr/posix_mq.py) and a rollback makes again. Looked at only when an IPC call may have
    happened since the namespace was last found empty (the call costs ~0.1 ms in the
    daemon, a thread joining the namespace and the GIL back)."""
    if not live.ipc_seen:
        return
    objects = native.ipc_objects(live.rt.pidfd, _mq_dir(live))
    live.ipc_seen = bool(objects.shm_segments or objects.msg_queues or objects.sem_sets or
                         objects.posix_queues)


def _mq_dir(live: Live) -> int:
    """The sandbox's mqueue directory, opened the first time (closed with the sandbox)."""
    if live.mq_dir < 0:
        live.mq_dir = native.mqueue_dir(live.rt.pidfd)
    return live.mq_dir


def _cr_limit_error(e: BaseException, what: str) -> ResourceExhausted | None:
    """A DeltaCR failure that is the sandbox's own limits (templates and restored
    processes count against its pids and memory limits), as a clear RESOURCE_EXHAUSTED."""
    if isinstance(e, native.CRError) and e.errno in (errno.EAGAIN, errno.ENOMEM):
        return ResourceExhausted(
            f"{what} the sandbox's processes hit its limits ({e}): every captured process "
            "is kept as a template that counts against the sandbox's pids_max and memory_mb; "
            "create it with higher limits, or checkpoint with mode=fs (files only)")
    return None


# Linux refuses an exec whose single argument or environment entry exceeds MAX_ARG_STRLEN
# (128 KiB) or whose whole argv + environment exceeds ARG_MAX (a quarter of the stack limit,
# 2 MiB by default); the daemon's helpers add their own few arguments.
MAX_ARG_BYTES = 128 * 1024 - 1
MAX_ARGS_TOTAL = 1 << 20


def _check_args(argv: list[str], env: dict[str, str]) -> None:
    sizes = [len(a.encode(errors="surrogateescape")) + 1 for a in argv]
    sizes += [len(f"{k}={v}".encode(errors="surrogateescape")) + 1 for k, v in env.items()]
    if any(n > MAX_ARG_BYTES for n in sizes) or sum(sizes) > MAX_ARGS_TOTAL:
        raise InvalidArgument(
            f"command line and environment too large ({sum(sizes)} bytes; at most "
            f"{MAX_ARG_BYTES} per argument or variable and {MAX_ARGS_TOTAL} in all): pass "
            "large data through stdin or a file")


def _check_timeout(timeout: float) -> None:
    if timeout < 0 or timeout != timeout:
        raise InvalidArgument(f"timeout must be >= 0 seconds (0 = none), got {timeout}")


def _abs_in_sandbox(cwd: str) -> str:
    if not cwd:
        return "/workspace"
    if "\0" in cwd:
        raise InvalidArgument("cwd contains a NUL byte")
    return cwd if cwd.startswith("/") else "/workspace/" + cwd


def _timeout_message(what: str, timeout: float, out: execute.ExecOutput) -> str:
    tail = out.stdout[-500:].decode(errors="replace")
    return (f"command {what!r} ran past its timeout of {timeout:g}s and was killed "
            f"(raise the timeout or run it in the background); last output: {tail!r}")


def _tree_order(cps: list[CheckpointRow]) -> list[CheckpointRow]:
    """Parents before children, siblings by creation time."""
    by_parent: dict[str | None, list[CheckpointRow]] = {}
    ids = {c.id for c in cps}
    for c in cps:
        by_parent.setdefault(c.parent_id if c.parent_id in ids else None, []).append(c)
    out: list[CheckpointRow] = []
    stack = list(reversed(by_parent.get(None, [])))
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(reversed(by_parent.get(c.id, [])))
    return out


def _kill(p: trio.Process) -> None:
    if p.returncode is None:
        try:
            p.kill()
        except ProcessLookupError:
            pass
