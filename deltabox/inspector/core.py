"""The turn inspector: loads the eBPF program, follows watched cgroups, cuts turns.

One `Inspector` per daemon. Each watched sandbox (a `key`) is a cgroup-v2 cgroup; every
event the program emits carries its cgroup id and the *epoch* (turn number) that cgroup was
in when the event happened. `turn()` starts a new epoch with one map update, drains the ring
buffer, and hands back what the closed epoch did. Events are consumed synchronously (in
`turn()`), or continuously by `run()` in the daemon's trio nursery (no threads).

Call `turn()` with the sandbox's cgroup frozen: then no event of the closing turn can still be
in flight (a frozen task has finished its system call and the program's run for it), and the
boundary is exact. Without a freeze, effects racing with the call may land in the next turn.
"""

from __future__ import annotations

import copy
import ctypes as ct
import os
import struct
import tempfile
import threading
import time
from collections import OrderedDict, namedtuple
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from .. import kernfs
from . import program as P
from .btf import BTF, BTFError
from .effects import (LIST_CAP, AddressSpaceChange, ExecedProcess, ExitedProcess,
                      ForkedProcess, RanProcess, SignalledProcess, SocketOp, TurnEffects)
from .setup import (import_bcc, kernel_headers_problem, prepare_kernel_interfaces)

AT_FDCWD = -100
O_CREAT, O_EXCL, O_TRUNC = 0o100, 0o200, 0o1000
_SIGNED = lambda v: v - (1 << 64) if v >= 1 << 63 else v  # noqa: E731
_FAMILIES = {1: "unix", 2: "inet", 10: "inet6", 16: "netlink", 17: "packet", 40: "vsock"}
_OP_NAMES = {P.SOCK_CREATE: "socket", P.SOCK_PAIR: "socketpair", P.SOCK_BIND: "bind",
             P.SOCK_LISTEN: "listen", P.SOCK_CONNECT: "connect", P.SOCK_ACCEPT: "accept",
             P.SOCK_SENDTO: "sendto"}
_SPECIAL = {P.SP_PTRACE: "ptrace", P.SP_VM_WRITE: "process_vm_writev (wrote another "
            "process's memory)", P.SP_IPC: "System V / POSIX IPC", P.SP_MOUNT: "mount table "
            "changed", P.SP_NS: "host/domain name changed",
            P.SP_PROCFD: "another process's pipe or socket opened for writing through /proc"}
_INCOMPLETE = {P.SP_IO_URING: "io_uring used (its operations are invisible to syscall "
               "tracepoints)", P.SP_AIO: "Linux AIO used (io_submit)",
               P.SP_CLONE_INTO_CGROUP: "a process was cloned into another cgroup",
               P.SP_UNOBSERVED: "a system call begun before the watch completed",
               P.SP_COMPAT: "32-bit (ia32) system calls, which the inspector does not decode"}


# The program's struct ev (96 bytes) and struct ev_path (+ two PATHLEN paths).
_HDR = struct.Struct("<IIQIIiIqQQQQ16sii")
_Ev = namedtuple("_Ev", "type epoch cgid pid tgid nr op ret a0 a1 a2 a3 comm len1 len2")
_PATH_EVENT_SIZE = _HDR.size + 2 * P.PATHLEN
assert _HDR.size == ct.sizeof(P.Event) and _PATH_EVENT_SIZE == ct.sizeof(P.PathEvent)


def _cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode(errors="replace")


class _PathParts:
    __slots__ = ("p1raw", "p2raw", "p1", "p2")

    def __init__(self, raw: bytes) -> None:
        h = _HDR.size
        self.p1raw = raw[h:h + P.PATHLEN]
        self.p2raw = raw[h + P.PATHLEN:h + 2 * P.PATHLEN]
        self.p1 = self.p1raw.split(b"\0", 1)[0]
        self.p2 = self.p2raw.split(b"\0", 1)[0]


class InspectorUnavailable(Exception):
    """The eBPF inspector cannot run here; str(e) says why."""


def _syscall_name(nr: int) -> str:
    name = P.SYSCALL_NAMES_X86_64.get(nr)
    if name is None:
        try:
            from bcc.syscall import syscall_name
            name = syscall_name(nr).decode()
        except Exception:
            name = f"syscall {nr}"
    return name


def _runtime_ns(pid: int, tid: int) -> int | None:
    try:
        return int(kernfs.read(f"/proc/{pid}/task/{tid}/schedstat").split(maxsplit=1)[0])
    except (OSError, ValueError, IndexError):
        return None


def _joined_only(leaf) -> bool:
    """A thread entry the program made when the thread joined the cgroup (a restore moves
    each process in before it runs) and that no system call or signal handler has touched
    since: the thread has not run yet (on a busy machine it may still wait for a CPU when
    the watch is re-armed)."""
    return (leaf.state == P.ST_UNKNOWN and leaf.nr == -1
            and not leaf.flags & (P.TF_RETURNED | P.TF_SEEDED))


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _norm(base: str, rel: str) -> str:
    return os.path.normpath(os.path.join(base, rel)) if rel else base


class _OrderedSet:
    __slots__ = ("d", "cut")

    def __init__(self) -> None:
        self.d: dict[str, None] = {}
        self.cut = False

    def add(self, s: str) -> None:
        if s in self.d:
            return
        if len(self.d) >= LIST_CAP:
            self.cut = True
            return
        self.d[s] = None

    def discard(self, s: str) -> None:
        self.d.pop(s, None)

    def __contains__(self, s: str) -> bool:
        return s in self.d

    def list(self) -> list[str]:
        return list(self.d)


@dataclass
class _Turn:
    """Accumulates one epoch's events of one watched cgroup."""
    written: _OrderedSet = field(default_factory=_OrderedSet)
    created: _OrderedSet = field(default_factory=_OrderedSet)
    deleted: _OrderedSet = field(default_factory=_OrderedSet)
    renamed: _OrderedSet = field(default_factory=_OrderedSet)
    chmodded: _OrderedSet = field(default_factory=_OrderedSet)
    truncated: _OrderedSet = field(default_factory=_OrderedSet)
    attrs: _OrderedSet = field(default_factory=_OrderedSet)
    # path -> list of ("create_excl" | "create" | "delete" | "move"), in order
    path_log: dict[str, list[str]] = field(default_factory=dict)
    paths_cut: bool = False
    forked: dict[int, tuple[int, str, bool]] = field(default_factory=dict)  # tid->(ppid,comm,thr)
    execed: list[tuple[int, str, str]] = field(default_factory=list)
    exited: dict[int, tuple[int, str, bool]] = field(default_factory=dict)  # tid->(tgid,comm,grp)
    signalled: list[tuple[int, int, str, int | None, bool]] = field(default_factory=list)
    ran: dict[int, tuple[str, str]] = field(default_factory=dict)       # tgid -> (comm, how)
    aspace: dict[int, tuple[str, set[str]]] = field(default_factory=dict)
    sockets: list[tuple[int, str, str, str, str | None, int | None]] = field(
        default_factory=list)
    other: list[str] = field(default_factory=list)
    ipc: bool = False         # an IPC call (System V or POSIX): saw_ipc, never capped
    incomplete: list[str] = field(default_factory=list)
    entries: dict[int, int] = field(default_factory=dict)   # tid -> tgid (0: unknown)
    late: int = 0
    events: int = 0
    procs_cut: bool = False

    def log(self, path: str, what: str) -> None:
        lst = self.path_log.setdefault(path, [])
        if len(lst) < 64:
            lst.append(what)


@dataclass
class _Watch:
    key: str
    cgid: int
    epoch: int
    started_at: float
    turn: _Turn = field(default_factory=_Turn)
    tasks: dict[int, int] = field(default_factory=dict)      # alive tid -> tgid
    start_procs: set[int] = field(default_factory=set)      # tgids alive at turn start
    baselines: dict[int, int] = field(default_factory=dict)  # tid -> run time (ns)
    expected: set[int] = field(default_factory=set)
    cwd: dict[int, str | None] = field(default_factory=dict)  # tgid -> cwd
    comm: dict[int, str] = field(default_factory=dict)       # tgid -> comm
    names: OrderedDict = field(default_factory=OrderedDict)  # (dev, ino) -> path
    lost_seen: int = 0
    dirfds: dict = field(default_factory=dict)               # (tgid, fd) -> directory path
    closing: tuple[int, _Turn] | None = None   # (epoch, turn) being closed by turn()
    arm_epoch: int = 0                          # the epoch watch() began with
    named: set[int] = field(default_factory=set)  # tids known when watch() was armed

    def name(self, dev: int, ino: int, path: str) -> None:
        self.names[(dev, ino)] = path
        self.names.move_to_end((dev, ino))
        if len(self.names) > 20000:
            self.names.popitem(last=False)


class Inspector:
    """See the module docstring. Not thread-safe: use from one thread (the daemon's trio
    thread)."""

    def __init__(self, bpf, version: str, ringbuf_pages: int) -> None:
        self._bpf = bpf
        self._cgroups = bpf[b"cgroups"]
        self._lost = bpf[b"lost"]
        self._tasks = bpf[b"tasks"]
        self._tasks_arr = bpf[b"tasks_arr"]
        self._task_array = len(self._tasks_arr)
        self._events = bpf[b"events"]
        self._slots = bpf[b"cgslots"]
        self._slot_members: dict[int, list[int]] = {}
        self._cg_epoch: dict[int, int] = {}
        self._watches: dict[str, _Watch] = {}
        self._by_cgid: dict[int, _Watch] = {}
        self._epoch = 0
        self._closed = False
        self.ringbuf_pages = ringbuf_pages
        self.backend = f"ebpf (bcc {version}, tracepoints)"
        self._cb = self._on_event          # keep a reference for ctypes
        self._events.open_ring_buffer(self._cb)
        self.events_fd: int = self._events.map_fd

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, *, ringbuf_pages: int = 2048, daemon_pid: int | None = None) -> Inspector:
        """Compile and attach the program. `ringbuf_pages`: size of the event ring buffer in
        pages (a power of two; 2048 = 8 MiB). `daemon_pid`: the process whose ptrace
        injections into sandbox processes are not the sandboxes' own doing (default: this
        process). Raises InspectorUnavailable with the reason."""
        if os.uname().machine != "x86_64":
            raise InspectorUnavailable(f"inspector supports x86_64 only (this is "
                                       f"{os.uname().machine})")
        if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
            raise ValueError("ringbuf_pages must be a power of two")
        if os.geteuid() != 0:
            raise InspectorUnavailable("eBPF needs root")
        problems = prepare_kernel_interfaces()
        fmt_dir = "/sys/kernel/tracing/events"
        if not os.path.isdir(f"{fmt_dir}/raw_syscalls"):
            raise InspectorUnavailable("tracefs not available: " + "; ".join(problems))
        try:
            bcc = import_bcc()
        except ImportError as e:
            raise InspectorUnavailable(str(e)) from None
        hp = kernel_headers_problem()
        if hp:
            raise InspectorUnavailable(hp)
        try:
            btf = BTF.load()
            offsets = {
                "OFF_TASK_FILES": btf.offset("task_struct", "files"),
                "OFF_TASK_PTRACE": btf.offset("task_struct", "ptrace"),
                "OFF_TASK_PARENT": btf.offset("task_struct", "parent"),
                "OFF_TASK_TGID": btf.offset("task_struct", "tgid"),
                "OFF_TASK_PID": btf.offset("task_struct", "pid"),
                "OFF_TI_STATUS": btf.offset("task_struct", "thread_info.status"),
                "OFF_FILES_FDT": btf.offset("files_struct", "fdt"),
                "OFF_FDT_MAX_FDS": btf.offset("fdtable", "max_fds"),
                "OFF_FDT_FD": btf.offset("fdtable", "fd"),
                "OFF_FILE_F_INODE": btf.offset("file", "f_inode"),
                "OFF_FILE_F_PATH": btf.offset("file", "f_path"),
                "OFF_PATH_DENTRY": btf.offset("path", "dentry"),
                "OFF_DENTRY_D_NAME": btf.offset("dentry", "d_name"),
                "OFF_DENTRY_D_PARENT": btf.offset("dentry", "d_parent"),
                "OFF_QSTR_NAME": btf.offset("qstr", "name"),
                "OFF_INODE_I_MODE": btf.offset("inode", "i_mode"),
                "OFF_INODE_I_INO": btf.offset("inode", "i_ino"),
                "OFF_INODE_I_SB": btf.offset("inode", "i_sb"),
                "OFF_SB_S_MAGIC": btf.offset("super_block", "s_magic"),
                "OFF_SB_S_DEV": btf.offset("super_block", "s_dev"),
            }
            regs = {r: btf.offset("pt_regs", r)
                    for r in ("r10", "r9", "r8", "dx", "si", "di", "orig_ax")}
            # The program reads r10..di in one go, in the x86_64 pt_regs order.
            if [regs[r] - regs["r10"] for r in ("r9", "r8", "dx", "si", "di")] != \
                    [8, 16, 40, 48, 56]:
                raise BTFError(f"unexpected struct pt_regs layout {regs}")
            lo = min(offsets["OFF_TI_STATUS"], offsets["OFF_TASK_PTRACE"]) // 8 * 8
            hi = max(offsets["OFF_TI_STATUS"], offsets["OFF_TASK_PTRACE"]) + 4
            if hi - lo > 128 or offsets["OFF_TI_STATUS"] % 4 or offsets["OFF_TASK_PTRACE"] % 4:
                raise BTFError("task_struct thread_info.status / ptrace too far apart")
            offsets["TASK_FLAGS_BASE"] = lo
            offsets["TASK_FLAGS_CHUNK"] = (hi - lo + 7) // 8 * 8
            offsets["OFF_REGS_R10"] = regs["r10"]
            offsets["OFF_REGS_DI"] = regs["di"]
            offsets["OFF_REGS_ORIG_AX"] = regs["orig_ax"]
            for f in ("OFF_INODE_I_MODE", "OFF_INODE_I_SB", "OFF_INODE_I_INO"):
                if f != "OFF_INODE_I_MODE" and offsets[f] % 8:
                    raise BTFError(f"{f} not 8-byte aligned")
            offsets["INODE_CHUNK"] = (max(offsets["OFF_INODE_I_MODE"], offsets["OFF_INODE_I_SB"],
                                          offsets["OFF_INODE_I_INO"]) // 8 + 1) * 8
            offsets["SB_CHUNK"] = (max(offsets["OFF_SB_S_MAGIC"], offsets["OFF_SB_S_DEV"])
                                   // 8 + 1) * 8
            if offsets["INODE_CHUNK"] > 256 or offsets["SB_CHUNK"] > 256 or \
                    offsets["OFF_SB_S_MAGIC"] % 8:
                raise BTFError("inode / super_block fields too far apart")
        except BTFError as e:
            raise InspectorUnavailable(f"kernel BTF: {e}") from None
        try:
            with open(f"{fmt_dir}/sched/sched_process_exit/format") as f:
                group_dead = "group_dead" in f.read()
        except OSError as e:
            raise InspectorUnavailable(f"tracepoint sched_process_exit: {e.strerror}") from None
        self_tid = threading.get_native_id()
        try:
            pid_max = int(open("/proc/sys/kernel/pid_max").read())
        except (OSError, ValueError):
            pid_max = 32768
        text = P.defines(offsets=offsets, syscalls=P.SYSCALLS_X86_64,
                         ringbuf_pages=ringbuf_pages, task_array=min(pid_max, 65536),
                         daemon_tgid=os.getpid() if daemon_pid is None else daemon_pid,
                         self_tid=self_tid, unified_root=0,
                         has_group_dead=group_dead) + P.SOURCE
        try:
            bpf = bcc.BPF(text=text.encode())
        except Exception as e:
            raise InspectorUnavailable(f"eBPF program does not compile or load: {e}") from None
        try:
            _selftest(bpf)
        except InspectorUnavailable:
            bpf.cleanup()
            raise
        version = getattr(bcc, "__version__", "?")
        return cls(bpf, version, ringbuf_pages)

    def close(self) -> None:
        """Detach everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            import trio
            trio.lowlevel.notify_closing(self.events_fd)
        except Exception:
            pass
        self._bpf.cleanup()
        self._watches.clear()
        self._by_cgid.clear()

    def _set_attached(self, on: bool) -> None:
        """Detach every probe (or attach them again) without recompiling: for measuring the
        inspector's overhead. A turn that overlaps a detached period is incomplete."""
        b = self._bpf
        if not on:
            self._attached = (list(b.tracepoint_fds), list(b.raw_tracepoint_fds))
            for tp in self._attached[0]:
                b.detach_tracepoint(tp)
            for tp in self._attached[1]:
                b.detach_raw_tracepoint(tp)
        elif getattr(self, "_attached", None):
            tps, raws = self._attached
            for tp in tps:
                cat, name = tp.split(b":")
                b.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + cat + b"__" + name)
            for tp in raws:
                b.attach_raw_tracepoint(tp=tp, fn_name=b"raw_tracepoint__" + tp)
            self._attached = None
        for w in self._watches.values():
            w.turn.incomplete.append("the inspector was detached during the turn")

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- watching ---------------------------------------------------------------------------

    def _next_epoch(self) -> int:
        self._epoch += 1
        if self._epoch >= 1 << 32:
            self._epoch = 1
        return self._epoch

    def _set_epoch(self, cgid: int, epoch: int) -> None:
        leaf = self._cgroups.Leaf()
        leaf.epoch = epoch
        leaf.flags = 0
        self._cgroups[self._cgroups.Key(cgid)] = leaf
        self._cg_epoch[cgid] = epoch
        self._sync_slot(cgid % P.FILTER_SLOTS)

    def _sync_slot(self, slot: int) -> None:
        members = self._slot_members.get(slot, [])
        leaf = self._slots.Leaf()
        if members:
            first = members[0]
            leaf.cgid = first
            leaf.epoch = self._cg_epoch.get(first, 0)
            leaf.multi = 1 if len(members) > 1 else 0
        self._slots[self._slots.Key(slot)] = leaf

    # The program's per-thread state: an array below TASK_ARRAY, a hash above.
    def _task_get(self, tid: int):
        if tid < self._task_array:
            v = self._tasks_arr[self._tasks_arr.Key(tid)]
            if not v.cgid:
                raise KeyError(tid)
            return v
        return self._tasks[self._tasks.Key(tid)]

    def _task_set(self, tid: int, leaf) -> None:
        if tid < self._task_array:
            self._tasks_arr[self._tasks_arr.Key(tid)] = leaf
        else:
            self._tasks[self._tasks.Key(tid)] = leaf

    def _task_del(self, tid: int) -> None:
        if tid < self._task_array:
            self._tasks_arr[self._tasks_arr.Key(tid)] = self._tasks_arr.Leaf()
        else:
            del self._tasks[self._tasks.Key(tid)]

    def watch(self, key: str, cgroup_id: int, pids: Iterable[int] = (),
              restarting: Mapping[int, int] | None = None,
              lived_on: Collection[int] = (),
              restored: Mapping[int, Collection[int]] | None = None) -> None:
        """Start recording for sandbox `key`, whose processes are in the cgroup-v2 cgroup
        `cgroup_id`. `pids`: host pids of the processes already in it (their threads are
        known from then on; any other process found in the cgroup is an outside entry).
        Calling it again for a watched key re-arms it (after a rollback: the new processes
        in `pids`, the turn restarted). `restarting`: {tid: syscall nr} for threads that
        will re-enter that interrupted system call first when they resume (the daemon's
        restored processes), so that re-entry does not count as running. `lived_on`: those
        of `pids` that are the same processes as before a re-arm (the sandbox's init): not
        looked up again when the watch knew them (0.1-0.2 ms each here). `restored`: those
        of `pids` a restore let go before this call (rollback, fork), with the system calls
        their threads were stopped in at the checkpoint (-1: none): see _seed_restored."""
        if self._closed:
            raise InspectorUnavailable("inspector closed")
        old = self._watches.get(key)
        if old is not None and old.cgid != cgroup_id:
            self.unwatch(key)
        other = self._by_cgid.get(cgroup_id)
        if other is not None and other.key != key:
            raise ValueError(f"cgroup {cgroup_id} is already watched as {other.key}")
        epoch = self._next_epoch()
        w = _Watch(key, cgroup_id, epoch, time.time(), arm_epoch=epoch)
        if old is not None and old.cgid == cgroup_id:
            w.expected = old.expected
            w.names = old.names
            w.lost_seen = old.lost_seen
            w.comm, w.cwd = old.comm, old.cwd
            # Processes that live on across the re-arm (the sandbox's init, ...) stay known.
            w.tasks = {tid: tg for tid, tg in old.tasks.items()
                       if os.path.exists(f"/proc/{tg}/task/{tid}")}
        else:
            w.lost_seen = self._lost_count(cgroup_id)
        self._watches[key] = w
        self._by_cgid[cgroup_id] = w
        known = set(w.tasks.values())
        # Restored processes first: _seed keeps the entries this writes (`seeded`).
        seeded = self._seed_restored(w, restored or {})
        self._seed(w, [p for p in pids if p not in known or p not in lived_on],
                   restarting or {}, seeded)
        members = self._slot_members.setdefault(cgroup_id % P.FILTER_SLOTS, [])
        if cgroup_id not in members:
            members.append(cgroup_id)
        self._set_epoch(cgroup_id, epoch)
        for tid, pid in seeded.items():  # went back to user mode before the new epoch?
            try:
                back = self._task_get(tid).flags & P.TF_RETURNED
            except KeyError:
                back = True
            if back:
                self._ran_unwatched(w, pid, "it ran while the watch began")
        w.named = set(w.tasks)
        w.start_procs = set(w.tasks.values())
        w.baselines = self._runtimes(w.tasks)

    def _seed_restored(self, w: _Watch, restored: Mapping[int, Collection[int]]
                       ) -> dict[int, int]:
        """Restored processes run from their birth, before the daemon can re-arm the watch
        with their pids (their events until then went to the ended turn). A thread that only
        re-entered the call it was stopped in at the checkpoint (or is about to: not seen
        yet) changed nothing: seeded as restarting that call, so its return counts as
        running. A thread that ran (went back to user mode, entered another call, or was in
        user mode at the checkpoint) makes the turn incomplete: what it did was not seen.
        Returns the seeded tids (-> pid): checked again once the new epoch is set."""
        seeded: dict[int, int] = {}
        for pid, calls in restored.items():
            tids = _tids(pid)
            if any(nr < 0 for nr in calls):
                self._ran_unwatched(w, pid, "it was running (not in a system call) at the "
                                    "checkpoint")
                continue
            plan: dict[int, int | None] = {}
            why = None
            for tid in tids:
                try:
                    old = self._task_get(tid)
                    mine = int(old.cgid) == w.cgid and not _joined_only(old)
                except KeyError:
                    mine = False
                if not mine:   # not run yet: its one call, if the process had one
                    plan[tid] = next(iter(calls)) if len(set(calls)) == 1 else None
                elif (old.flags & P.TF_RETURNED or old.state != P.ST_IN
                        or (old.nr not in calls
                            and old.nr != P.SYSCALLS_X86_64["restart_syscall"])):
                    why = f"its thread {tid} ran" if tid != pid else "it ran"
                    break
                else:
                    plan[tid] = int(old.nr)
            if why is not None:
                self._ran_unwatched(w, pid, why)
                continue
            for tid, nr in plan.items():
                self._task_set(tid, self._seed_leaf(w, pid, nr))
                seeded[tid] = pid
        return seeded

    @staticmethod
    def _ran_unwatched(w: _Watch, pid: int, why: str) -> None:
        """A restored process did something before the watch began: unseen."""
        try:
            comm = kernfs.read(f"/proc/{pid}/comm").strip().decode(errors="replace")
        except OSError:
            comm = "?"
        msg = (f"a restored process ({comm}, host pid {pid}): {why} before the inspector "
               "watched it")
        if msg not in w.turn.incomplete:
            w.turn.incomplete.append(msg)

    def _seed_leaf(self, w: _Watch, pid: int, restarting: int | None):
        """A thread's entry as user space seeds it: restarting that call, or unknown."""
        leaf = self._tasks.Leaf()
        leaf.cgid = w.cgid
        leaf.tgid = pid
        leaf.born_epoch = 0
        leaf.ran_epoch = 0
        leaf.as_epoch = 0
        leaf.flags = P.TF_SEEDED
        if restarting is not None:
            leaf.state = P.ST_RESTARTING
            leaf.nr = restarting
        else:
            leaf.state = P.ST_UNKNOWN
            leaf.nr = -1
        return leaf

    def _seed(self, w: _Watch, pids: Iterable[int], restarting: Mapping[int, int],
              seeded: Collection[int] = ()) -> None:
        """Know `pids` from now on; their threads' entries are written afresh (restarting
        their call if in `restarting`) unless the program follows them already or they are
        `seeded` (written by _seed_restored)."""
        for pid in pids:
            tids = _tids(pid)
            if not tids:
                continue
            w.cwd[pid] = _readlink(f"/proc/{pid}/cwd")
            try:
                w.comm[pid] = kernfs.read(f"/proc/{pid}/comm").strip().decode(errors="replace")
            except OSError:
                pass
            for tid in tids:
                w.tasks[tid] = pid
                if tid in seeded:
                    continue
                if tid not in restarting:
                    try:
                        if int(self._task_get(tid).cgid) == w.cgid:
                            continue        # already followed: keep what the program knows
                    except KeyError:
                        pass
                self._task_set(tid, self._seed_leaf(w, pid, restarting.get(tid)))

    def unwatch(self, key: str) -> None:
        w = self._watches.pop(key, None)
        if w is None:
            return
        self._by_cgid.pop(w.cgid, None)
        slot = w.cgid % P.FILTER_SLOTS
        members = self._slot_members.get(slot, [])
        if w.cgid in members:
            members.remove(w.cgid)
        self._cg_epoch.pop(w.cgid, None)
        self._sync_slot(slot)
        try:
            del self._cgroups[self._cgroups.Key(w.cgid)]
        except KeyError:
            pass
        try:
            del self._lost[self._lost.Key(w.cgid)]
        except KeyError:
            pass
        for tid in w.tasks:
            try:
                self._task_del(tid)
            except KeyError:
                pass

    def expect_entry(self, key: str, pid: int) -> None:
        """The daemon puts process `pid` into the sandbox from outside (its exec helper):
        not an outside entry. Call it before the next turn() ends."""
        self._watches[key].expected.add(pid)

    def note_files(self, key: str, *, written: Iterable[str] = (), created: Iterable[str] = (),
                   deleted: Iterable[str] = (), renamed: Iterable[str] = (),
                   chmodded: Iterable[str] = ()) -> None:
        """File changes made by the daemon itself (its files API writes into the sandbox from
        outside the cgroup, where the inspector does not look): counted in the current turn.
        `renamed` entries are "old -> new"."""
        t = self._watches[key].turn
        for lst, paths in ((t.written, written), (t.created, created), (t.deleted, deleted),
                           (t.renamed, renamed), (t.chmodded, chmodded)):
            for p in paths:
                lst.add(p)

    def watched(self) -> list[str]:
        return list(self._watches)

    # ---- consuming --------------------------------------------------------------------------

    def poll(self) -> None:
        """Drain the ring buffer now (never blocks)."""
        if not self._closed:
            self._bpf.ring_buffer_consume()

    async def run(self, batch_interval: float = 0.01) -> None:
        """Drain events whenever the ring buffer has some, at most every `batch_interval`
        seconds. Start it in the daemon's trio nursery; it returns when close() is called."""
        import trio
        while not self._closed:
            try:
                await trio.lowlevel.wait_readable(self.events_fd)
            except (trio.ClosedResourceError, OSError):
                return
            if self._closed:
                return
            self._bpf.ring_buffer_consume()
            if batch_interval:
                await trio.sleep(batch_interval)

    def _lost_count(self, cgid: int) -> int:
        try:
            return int(self._lost[self._lost.Key(cgid)].value)
        except KeyError:
            return 0

    def _on_event(self, ctx, data, size) -> int:
        try:
            self._handle(data, size)
        except Exception:   # never let an exception cross the C callback
            pass
        return 0

    @staticmethod
    def _named_entry(w: _Watch, e: _Ev) -> bool:
        """An entry, stamped before the watch was (re-)armed, of a thread it was armed
        with: a restored process that re-entered its call between the daemon's last drain
        and the re-arm. The daemon named it; what it did is _seed_restored's to judge."""
        if e.type == P.EV_ENTRY:
            return e.pid in w.named
        return e.type == P.EV_ATTACH and int(e.a0) in w.named

    def _handle(self, data, size: int) -> None:
        raw = ct.string_at(data, size)
        e = _Ev._make(_HDR.unpack_from(raw))
        pe = _PathParts(raw) if size >= _PATH_EVENT_SIZE else None
        w = self._by_cgid.get(e.cgid)
        if w is None:
            return
        if e.epoch < w.arm_epoch and self._named_entry(w, e):
            return
        if e.epoch == w.epoch:
            t = w.turn
        elif w.closing is not None:
            t = w.closing[1]
            if e.epoch != w.closing[0]:
                t.late += 1
        else:
            t = w.turn
            t.late += 1
        t.events += 1
        typ = e.type
        comm = _cstr(e.comm)
        tgid = e.tgid
        if tgid and tgid not in w.comm:
            w.comm[tgid] = comm
        if typ == P.EV_RAN:
            if tgid not in t.ran:
                t.ran[tgid] = (comm, "syscall " + _syscall_name(e.nr) if e.nr >= 0
                               else "signal handler")
        elif typ == P.EV_FDOP:
            self._fdop(w, t, e)
        elif typ == P.EV_FILE:
            self._file(w, t, e, pe)
        elif typ == P.EV_FORK:
            child, thread = int(e.a0), bool(e.a1)
            ccomm = pe.p1.decode(errors="replace") if pe else comm
            w.tasks[child] = tgid if thread else child
            if not thread:
                w.cwd[child] = w.cwd.get(tgid)
                w.comm[child] = ccomm
            if len(t.forked) < LIST_CAP:
                t.forked[child] = (e.pid, ccomm, thread)
            else:
                t.procs_cut = True
        elif typ == P.EV_EXEC:
            fn = pe.p1.decode(errors="replace") if pe else ""
            w.comm[tgid] = comm
            if len(t.execed) < LIST_CAP:
                t.execed.append((tgid, fn, comm))
            else:
                t.procs_cut = True
        elif typ == P.EV_EXIT:
            group = bool(e.a0)
            tid = e.pid
            w.tasks.pop(tid, None)
            if group:
                for x in [x for x, g in w.tasks.items() if g == tgid]:
                    w.tasks.pop(x, None)
            if len(t.exited) < 4 * LIST_CAP:
                t.exited[tid] = (tgid, comm, group)
            else:
                t.procs_cut = True
        elif typ == P.EV_ENTRY:
            w.tasks.setdefault(e.pid, tgid)
            t.entries.setdefault(e.pid, tgid)
            if tgid not in w.cwd:
                w.cwd[tgid] = _readlink(f"/proc/{e.pid}/cwd")
        elif typ == P.EV_ATTACH:
            tid = int(e.a0)
            w.tasks.setdefault(tid, tid)
            t.entries.setdefault(tid, 0)
            if tid not in w.cwd:
                w.cwd[tid] = _readlink(f"/proc/{tid}/cwd")
        elif typ == P.EV_SIGGEN:
            target = int(e.a0)
            t.signalled.append((target, int(e.a1), "sent", e.pid, False))
        elif typ == P.EV_SIGDLV:
            t.signalled.append((e.pid, int(e.a1), "delivered", None, int(e.a2) > 1))
        elif typ == P.EV_ASPACE:
            entry = t.aspace.setdefault(tgid, (comm, set()))
            entry[1].add(P.ASPACE_CALLS[e.a0] if e.a0 < len(P.ASPACE_CALLS) else str(e.a0))
        elif typ == P.EV_SOCK:
            self._sock(w, t, e, pe)
        elif typ == P.EV_SPECIAL:
            code = e.op
            if code in _INCOMPLETE:
                msg = f"{_INCOMPLETE[code]} (pid {e.pid} {comm}, {_syscall_name(e.nr)})"
                if msg not in t.incomplete:
                    t.incomplete.append(msg)
            else:
                t.ipc = t.ipc or code == P.SP_IPC
                msg = f"{_SPECIAL.get(code, 'special')}: {_syscall_name(e.nr)} by pid " \
                      f"{e.pid} ({comm})"
                if msg not in t.other and len(t.other) < LIST_CAP:
                    t.other.append(msg)
        elif typ == P.EV_DIRFD:
            if pe is not None and e.len1 > 0:
                raw = (pe.p1raw + pe.p2raw)[:e.len1]
                parts = [x.decode(errors="replace") for x in raw.split(b"\0") if x]
                path = "/" + "/".join(reversed(parts))
                w.dirfds[(tgid, _SIGNED(e.a0))] = path if e.a1 else "<...>" + path
        elif typ == P.EV_CHDIR:
            if pe is not None and e.len1 > 0:
                p = pe.p1.decode(errors="replace")
                base = w.cwd.get(tgid)
                w.cwd[tgid] = (os.path.normpath(p) if p.startswith("/")
                               else _norm(base, p) if base else None)
            else:
                w.cwd[tgid] = _readlink(f"/proc/{e.pid}/cwd")

    # -- helpers of _handle --

    def _path(self, w: _Watch, t: _Turn, e, raw: bytes, length: int, dfd: int) -> str:
        if length < 0:
            return f"<unreadable path, pid {e.pid}>"
        if length >= P.PATHLEN:
            t.paths_cut = True
        p = raw.decode(errors="replace")
        if p.startswith("/"):
            return os.path.normpath(p)
        dfd = _SIGNED(dfd) if dfd >= 1 << 31 else dfd
        if dfd == AT_FDCWD or dfd == (AT_FDCWD & 0xFFFFFFFF):
            base = w.cwd.get(e.tgid)
            return _norm(base, p) if base else f"<cwd>/{p}"
        base = w.dirfds.get((e.tgid, dfd)) or _readlink(f"/proc/{e.pid}/fd/{dfd}")
        if base and base.startswith("/"):
            return _norm(base, p)
        return f"<fd {dfd}>/{p}"

    def _fdname(self, w: _Watch, e, dev: int, ino: int, fd: int) -> str:
        name = w.names.get((dev, ino))
        if name:
            return name
        link = _readlink(f"/proc/{e.pid}/fd/{fd}")
        if link and link.startswith("/"):
            w.name(dev, ino, link)
            return link
        return f"<inode {dev >> 20}:{dev & 0xFFFFF}:{ino}>"

    def _fdop(self, w: _Watch, t: _Turn, e) -> None:
        op, fd, dev, ino, kind = e.op, _SIGNED(e.a0), int(e.a1), int(e.a2), int(e.a3)
        if kind == P.KIND_UNKNOWN:
            name = f"<unclassified fd {fd} of pid {e.pid}>"
        else:
            name = self._fdname(w, e, dev, ino, fd)
        if kind == P.KIND_MEM:
            msg = f"memory-backed file changed: {name} (pid {e.pid})"
            if msg not in t.other and len(t.other) < LIST_CAP:
                t.other.append(msg)
            return
        if kind == P.KIND_FIFO:
            msg = f"named FIFO written: {name}"
            if msg not in t.other:
                t.other.append(msg)
            return
        if op in (P.FOP_WRITE, P.FOP_ALLOC, P.FOP_MMAP, P.FOP_IOCTL):
            t.written.add(name)
        elif op == P.FOP_TRUNC:
            t.truncated.add(name)
        elif op == P.FOP_CHMOD:
            t.chmodded.add(name)
        else:
            t.attrs.add(name)

    def _file(self, w: _Watch, t: _Turn, e, pe) -> None:
        if pe is None:
            return
        op = e.op
        if op == P.OP_OPEN:
            dfd = int(e.a0)
            flags = int(e.a2)
            kind = int(e.a3) >> 56
            ino = int(e.a3) & ((1 << 56) - 1)
            dev = int(e.a1)
            path = (self._path(w, t, e, pe.p1, e.len1, dfd) if e.len1 != -1
                    else self._fdname(w, e, dev, ino, int(e.ret)))
            if kind in (P.KIND_FILE, P.KIND_DIR, P.KIND_BLK):
                w.name(dev, ino, path)
            if kind == P.KIND_MEM:
                msg = f"memory-backed file created or truncated: {path}"
                if msg not in t.other and len(t.other) < LIST_CAP:
                    t.other.append(msg)
                return
            if kind == P.KIND_FIFO:
                msg = f"named FIFO opened for writing: {path}"
                if msg not in t.other:
                    t.other.append(msg)
                return
            if flags & O_CREAT:
                t.created.add(path)
                t.log(path, "create_excl" if flags & O_EXCL else "create")
            if flags & O_TRUNC:
                t.truncated.add(path)
                if flags & 3:           # opened for writing and emptied: written
                    t.written.add(path)
            return
        p1 = self._path(w, t, e, pe.p1, e.len1, int(e.a0)) if e.len1 != -1 else ""
        if op in (P.OP_RENAME, P.OP_LINK):
            p2 = self._path(w, t, e, pe.p2, e.len2, int(e.a1))
        elif op == P.OP_SYMLINK:
            p2 = pe.p2.decode(errors="replace")   # the link's target text
        else:
            p2 = ""
        for p in (p1, p2 if op in (P.OP_RENAME, P.OP_LINK) else ""):
            if p.startswith(("/proc/", "/sys/")) or p in ("/proc", "/sys"):
                return
            if p.startswith("/dev/"):
                msg = f"/dev changed: {p}"
                if msg not in t.other:
                    t.other.append(msg)
                return
        if op == P.OP_TRUNCATE:
            t.truncated.add(p1)
        elif op in (P.OP_UNLINK, P.OP_RMDIR):
            t.deleted.add(p1)
            t.log(p1, "delete")
            if op == P.OP_RMDIR:
                t.log(p1, "rmdir")
        elif op == P.OP_RENAME:
            t.renamed.add(f"{p1} -> {p2}")
            t.log(p1, "move")
            t.log(p2, "move")
        elif op == P.OP_LINK:
            t.created.add(p2)
            t.log(p1, "move")
            t.log(p2, "create_excl")
        elif op in (P.OP_SYMLINK, P.OP_MKDIR, P.OP_MKNOD):
            t.created.add(p1)
            t.log(p1, "mkdir" if op == P.OP_MKDIR else "create_excl")
        elif op == P.OP_CHMOD:
            t.chmodded.add(p1)
        else:
            t.attrs.add(p1)

    def _sock(self, w: _Watch, t: _Turn, e, pe) -> None:
        op = _OP_NAMES.get(e.op, str(e.op))
        family, addr, port = "", None, None
        if e.op in (P.SOCK_CREATE, P.SOCK_PAIR):
            fam = (int(e.ret) >> 32) & 0xFFFF
            family = _FAMILIES.get(fam, str(fam))
        elif pe is not None and e.len1 >= 2:
            raw = pe.p1raw[:e.len1]
            fam = int.from_bytes(raw[:2], "little")
            family = _FAMILIES.get(fam, str(fam))
            if fam == 2 and len(raw) >= 8:
                port = int.from_bytes(raw[2:4], "big")
                addr = ".".join(str(b) for b in raw[4:8])
            elif fam == 10 and len(raw) >= 24:
                import ipaddress
                port = int.from_bytes(raw[2:4], "big")
                addr = str(ipaddress.IPv6Address(raw[8:24]))
            elif fam == 1:
                sun = raw[2:]
                if sun[:1] == b"\0":
                    addr = "@" + sun[1:].split(b"\0")[0].decode(errors="replace")
                elif sun:
                    rel = sun.split(b"\0")[0].decode(errors="replace")
                    addr = rel if rel.startswith("/") else (
                        _norm(w.cwd[e.tgid], rel) if w.cwd.get(e.tgid) else f"<cwd>/{rel}")
                    if e.op == P.SOCK_BIND:
                        t.created.add(addr)
                        t.log(addr, "create_excl")
        if len(t.sockets) < LIST_CAP:
            t.sockets.append((e.tgid, _cstr(e.comm), op, family, addr, port))

    # ---- turns ------------------------------------------------------------------------------

    def _runtimes(self, tasks: Mapping[int, int]) -> dict[int, int]:
        out = {}
        for tid, tgid in tasks.items():
            r = _runtime_ns(tgid, tid)
            if r is not None:
                out[tid] = r
        return out

    def turn(self, key: str, pids: Iterable[int] = ()) -> TurnEffects:
        """End the current turn of `key` and start the next; returns the ended turn's
        effects. `pids`: host pids of the sandbox's live processes now, not its templates
        (optional: the inspector follows the cgroup's processes itself; a pid given here
        that it does not know is a process that appeared unseen)."""
        if self._closed:
            raise InspectorUnavailable("inspector closed")
        w = self._watches[key]
        lost_before = self._lost_count(w.cgid)
        new_epoch = self._next_epoch()
        self._set_epoch(w.cgid, new_epoch)
        w.closing = (w.epoch, w.turn)
        w.turn, w.epoch = _Turn(), new_epoch
        try:
            # Events of the closing epoch still in the buffer go to the closing turn.
            self._bpf.ring_buffer_consume()
        finally:
            closing = w.closing[1]
            w.closing = None
        # Losses before the epoch switch are the closing turn's; those during the drain
        # may be either turn's: they count for both.
        lost_after = self._lost_count(w.cgid)
        lost = lost_after - w.lost_seen
        w.lost_seen = lost_before
        now = time.time()
        eff = self._effects(w, closing, set(pids), lost, now)
        w.started_at = now
        return eff

    def saw_ipc(self, key: str) -> bool:
        """Whether the current turn may have made IPC objects so far: an IPC call seen, or
        a part of the turn not seen. Cheaper than peek (no effects computed)."""
        if self._closed:
            raise InspectorUnavailable("inspector closed")
        w = self._watches[key]
        self.poll()
        t = w.turn
        return t.ipc or bool(t.incomplete) or self._lost_count(w.cgid) != w.lost_seen

    def peek(self, key: str) -> TurnEffects:
        """The current turn's effects so far, without ending it (nothing is changed: the
        watch's bookkeeping is put back after the computation)."""
        if self._closed:
            raise InspectorUnavailable("inspector closed")
        w = self._watches[key]
        self.poll()
        saved = (dict(w.tasks), set(w.start_procs), dict(w.baselines), set(w.expected))
        try:
            return self._effects(w, copy.deepcopy(w.turn), set(),
                                 self._lost_count(w.cgid) - w.lost_seen, time.time())
        finally:
            w.tasks, w.start_procs, w.baselines, w.expected = saved

    def _effects(self, w: _Watch, t: _Turn, pids: set[int], lost: int,
                 now: float) -> TurnEffects:
        start = w.start_procs
        # Processes that appeared without our seeing them (given by the daemon).
        unseen = sorted(p for p in pids if p not in set(w.tasks.values()) and _tids(p))
        self._seed(w, unseen, {})       # the daemon vouches for them: known from now on
        # Drop processes that are gone without our seeing the exit (a lost event).
        for tid, tgid in list(w.tasks.items()):
            if not os.path.exists(f"/proc/{tgid}/task/{tid}"):
                w.tasks.pop(tid)
                if tgid in start and tid == tgid and tid not in t.exited:
                    t.exited[tid] = (tgid, w.comm.get(tgid, ""), True)
        alive_procs = set(w.tasks.values())
        long_lived = sorted(start & alive_procs)

        # Did long-lived threads run without a system call (pure computation)?
        new_base = self._runtimes(w.tasks)
        for tid, r in new_base.items():
            tgid = w.tasks[tid]
            if tgid not in start or tgid in t.ran:
                continue
            b = w.baselines.get(tid)
            if b is None or r == b:
                continue
            try:
                st = self._task_get(tid)
                state, cg = int(st.state), int(st.cgid)
            except KeyError:
                state, cg = P.ST_UNKNOWN, w.cgid
            if cg != w.cgid or state in (P.ST_UNKNOWN, P.ST_USER):
                t.ran[tgid] = (w.comm.get(tgid, ""), "cpu time")
        w.baselines = new_base

        forked = []
        for child, (ppid, comm, thread) in t.forked.items():
            alive = child in w.tasks
            forked.append(ForkedProcess(pid=child, parent_pid=ppid, comm=comm, thread=thread,
                                        alive_at_end=alive))
        new_alive = sorted({w.tasks[c] for c in t.forked if c in w.tasks} |
                           {w.tasks[c] for c in t.entries if c in w.tasks} |
                           set(unseen) | (alive_procs - start - {0}))
        exited = [ExitedProcess(pid=tid, comm=comm, thread=not group,
                                long_lived=tgid in start)
                  for tid, (tgid, comm, group) in t.exited.items()
                  if group or tgid in start]
        tid_to_tgid = dict(w.tasks)
        for tid, (tgid, _c, _g) in t.exited.items():
            tid_to_tgid.setdefault(tid, tgid)
        signalled = []
        for target, sig, how, sender, handler in t.signalled:
            tg = tid_to_tgid.get(target, target)
            if how == "sent" and tg not in start:
                continue
            signalled.append(SignalledProcess(pid=target, signal=sig, how=how, sender=sender,
                                              handler=handler, long_lived=tg in start))
        ran = [RanProcess(pid=tg, comm=comm, how=how) for tg, (comm, how) in t.ran.items()
               if tg in start]
        aspace = [AddressSpaceChange(pid=tg, comm=comm, syscalls=sorted(calls))
                  for tg, (comm, calls) in t.aspace.items() if tg in start]
        sockets = [SocketOp(pid=tg, comm=comm, op=op, family=fam, address=addr, port=port,
                            long_lived=tg in start)
                   for tg, comm, op, fam, addr, port in t.sockets]
        entries = sorted({tid for tid, tg in t.entries.items()
                          if tid not in w.expected and (tg == 0 or tg not in w.expected)})
        incomplete = list(t.incomplete)
        w.expected = {p for p in w.expected if os.path.exists(f"/proc/{p}")}

        # Transient paths: created exclusively and removed again in this turn (and never
        # moved); so is anything under a transient directory.
        transient: list[str] = []
        tdirs: list[str] = []
        for path, log in t.path_log.items():
            if (log and log[0] in ("create_excl", "mkdir") and log[-1] in ("delete", "rmdir")
                    and "move" not in log and not path.startswith("<")):
                transient.append(path)
                if "mkdir" == log[0]:
                    tdirs.append(path + "/")

        def is_transient(p: str) -> bool:
            return p in tset or any(p.startswith(d) for d in tdirs)

        tset = set(transient)
        for p in list(t.path_log):
            if p not in tset and tdirs and any(p.startswith(d) for d in tdirs):
                transient.append(p)
                tset.add(p)

        def final(s: _OrderedSet) -> list[str]:
            return [p for p in s.list() if not is_transient(p)]

        renamed = [r for r in t.renamed.list()
                   if not all(is_transient(x) for x in r.split(" -> "))]
        paths_cut = t.paths_cut or any(s.cut for s in (t.written, t.created, t.deleted,
                                                        t.renamed, t.chmodded, t.truncated,
                                                        t.attrs))
        complete = not incomplete and lost == 0
        w.start_procs = alive_procs
        return TurnEffects(
            key=w.key, started_at=w.started_at, ended_at=now, backend=self.backend,
            files_written=final(t.written), files_created=final(t.created),
            files_deleted=final(t.deleted), files_renamed=renamed,
            files_chmodded=final(t.chmodded), files_truncated=final(t.truncated),
            files_attrs_changed=final(t.attrs), files_transient=transient[:LIST_CAP],
            paths_truncated=paths_cut,
            processes_forked=forked, processes_execed=[
                ExecedProcess(pid=p, filename=f, comm=c) for p, f, c in t.execed],
            processes_exited=exited, processes_signalled=signalled[:LIST_CAP],
            processes_ran=ran, processes_new_alive=new_alive,
            processes_truncated=t.procs_cut or len(signalled) > LIST_CAP,
            long_lived=long_lived, address_space_changed=aspace, sockets=sockets,
            other_effects=t.other, lost_events=lost, late_events=t.late,
            outside_entries=entries, complete=complete, incomplete_reasons=incomplete,
            events=t.events)


def _selftest(bpf) -> None:
    """Check the BTF offsets against reality: fdatasync() on a file we know, read back what
    the program saw."""
    fd, path = tempfile.mkstemp(prefix=".dbx-inspector-", dir="/var/tmp")
    try:
        os.write(fd, b"x")
        os.fdatasync(fd)
        st = os.fstat(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    s = bpf[b"selftest"][ct.c_int(0)]
    want_dev = (os.major(st.st_dev) << 20) | os.minor(st.st_dev)
    tid = threading.get_native_id()
    if s.hits == 0:
        raise InspectorUnavailable("eBPF self-test: the fdatasync tracepoint did not fire")
    if (s.tgid, s.pid) != (os.getpid(), tid) or s.ino != st.st_ino or s.dev != want_dev \
            or s.kind not in (P.KIND_FILE, P.KIND_MEM):
        raise InspectorUnavailable(
            f"eBPF self-test: kernel struct offsets from BTF do not match this kernel "
            f"(read tgid {s.tgid} pid {s.pid} kind {s.kind} dev {s.dev} ino {s.ino}; "
            f"want {os.getpid()} {tid} file {want_dev} {st.st_ino})")


