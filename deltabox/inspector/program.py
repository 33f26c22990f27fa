"""The inspector's eBPF program (C for bcc) and the constants shared with the Python side.

Attach points (all stable tracepoints; no kprobes, which these kernels lack):
- raw tracepoints sys_enter / sys_exit (cheaper than the perf-based raw_syscalls events):
  every system call of every task; an array slot test rejects tasks outside watched cgroups.
  For watched ones they drive a per-thread state machine (did the thread execute its own
  code since the turn began?) and record file, socket and special effects at syscall exit,
  on success only.
- sched:sched_process_fork / exec / exit: process tree.
- signal:signal_generate (sender in a watched cgroup) and signal:signal_deliver (receiver).
- cgroup:cgroup_attach_task: a task moved into a watched cgroup from outside.
- fdatasync() by the loading thread: a load-time self-test of the struct offsets (btf.py).

Kernel structs are read only at offsets computed from the running kernel's BTF and passed
in as OFF_* macros, never through header-defined types (the headers bcc compiles with may
belong to another kernel).

Whether a thread "ran" (executed user code, so its memory may have changed) since the turn
began is decided per thread from its system calls:
- sys_exit with a real result: it returns to user mode and runs -> ran;
- sys_exit with -ERESTART* / -EINTR: interrupted (the freezer, a ptrace stop of the
  checkpoint itself): state RESTARTING(nr). Re-entering the same call (or restart_syscall)
  next is the kernel's restart, or the program's retry of an interrupted call, and is not
  counted; any other call is.
- a signal delivered to a handler -> ran.
- user-mode execution without any syscall (a pure computation loop): the thread's state is
  USER or UNKNOWN at the turn's end; user space then compares its run time (schedstat).
System calls that the daemon injects with ptrace (its checkpoint's templates) are ignored:
the tracee is ptraced by the loader's thread group (DAEMON_TGID). The kernel-side cost is
measured by benchmarks/inspector_overhead.py.
"""

from __future__ import annotations

import ctypes as ct

PATHLEN = 256
FILTER_SLOTS = 1024

# Event types.
EV_ENTRY, EV_ATTACH, EV_FORK, EV_EXEC, EV_EXIT, EV_RAN, EV_ASPACE, EV_FILE, EV_FDOP, \
    EV_SIGGEN, EV_SIGDLV, EV_SOCK, EV_SPECIAL, EV_CHDIR, EV_DIRFD = range(1, 16)

# EV_FILE ops (path based).
OP_OPEN, OP_TRUNCATE, OP_UNLINK, OP_RMDIR, OP_RENAME, OP_LINK, OP_SYMLINK, OP_MKDIR, \
    OP_MKNOD, OP_CHMOD, OP_CHOWN, OP_XATTR, OP_UTIMES, OP_SETATTR = range(1, 15)
# EV_FDOP ops (file descriptor based).
FOP_WRITE, FOP_TRUNC, FOP_ALLOC, FOP_CHMOD, FOP_CHOWN, FOP_XATTR, FOP_UTIMES, FOP_MMAP, \
    FOP_IOCTL = range(1, 10)
# File kinds (classification of an open file).
(KIND_NONE, KIND_FILE, KIND_DIR, KIND_MEM, KIND_FIFO, KIND_PSEUDO, KIND_PIPE, KIND_SOCK,
 KIND_CHR, KIND_BLK, KIND_UNKNOWN, KIND_OTHER) = range(12)
# EV_SOCK ops.
SOCK_CREATE, SOCK_PAIR, SOCK_BIND, SOCK_LISTEN, SOCK_CONNECT, SOCK_ACCEPT, SOCK_SENDTO = \
    range(1, 8)
# EV_SPECIAL codes.
SP_IO_URING, SP_AIO, SP_PTRACE, SP_VM_WRITE, SP_IPC, SP_MOUNT, SP_CLONE_INTO_CGROUP, \
    SP_UNOBSERVED, SP_NS, SP_PROCFD, SP_COMPAT = range(1, 12)

# Address-space syscalls: name -> bit.
ASPACE_CALLS = ("mmap", "mprotect", "munmap", "brk", "mremap", "madvise", "shmat", "shmdt",
                "remap_file_pages", "mlock", "munlock", "mlockall", "munlockall", "mlock2",
                "pkey_mprotect", "process_madvise", "mseal", "map_shadow_stack")

# x86_64 system call numbers used by the program.
SYSCALLS_X86_64 = {
    "read": 0, "write": 1, "open": 2, "close": 3, "mmap": 9, "mprotect": 10, "munmap": 11,
    "brk": 12, "ioctl": 16, "pwrite64": 18, "writev": 20, "mremap": 25, "madvise": 28,
    "shmget": 29, "shmat": 30, "shmctl": 31, "sendfile": 40, "socket": 41, "connect": 42,
    "accept": 43, "sendto": 44, "sendmsg": 46, "bind": 49, "listen": 50, "socketpair": 53,
    "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "semget": 64, "semop": 65,
    "semctl": 66, "shmdt": 67, "msgget": 68, "msgsnd": 69, "msgctl": 71, "truncate": 76,
    "ftruncate": 77, "fdatasync": 75, "chdir": 80, "fchdir": 81, "rename": 82, "mkdir": 83, "rmdir": 84,
    "creat": 85, "link": 86, "unlink": 87, "symlink": 88, "chmod": 90, "fchmod": 91,
    "chown": 92, "fchown": 93, "lchown": 94, "ptrace": 101, "utime": 132, "mknod": 133,
    "mlock": 149, "munlock": 150, "mlockall": 151, "munlockall": 152, "pivot_root": 155,
    "mount": 165, "umount2": 166, "sethostname": 170, "setdomainname": 171,
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197,
    "lremovexattr": 198, "fremovexattr": 199, "io_submit": 209, "remap_file_pages": 216,
    "restart_syscall": 219, "semtimedop": 220, "utimes": 235, "mq_open": 240,
    "mq_unlink": 241, "mq_timedsend": 242, "openat": 257, "mkdirat": 258, "mknodat": 259,
    "fchownat": 260, "futimesat": 261, "unlinkat": 263, "renameat": 264, "linkat": 265,
    "symlinkat": 266, "fchmodat": 268, "splice": 275, "utimensat": 280, "fallocate": 285,
    "accept4": 288, "pwritev": 296, "open_by_handle_at": 304, "sendmmsg": 307,
    "process_vm_writev": 311, "renameat2": 316, "mlock2": 325, "copy_file_range": 326,
    "pwritev2": 328, "pkey_mprotect": 329, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsmount": 432,
    "clone3": 435, "openat2": 437, "process_madvise": 440, "mount_setattr": 442,
    "fchmodat2": 452, "map_shadow_stack": 453, "mseal": 462, "setxattrat": 463,
    "removexattrat": 466, "open_tree_attr": 467, "file_setattr": 469,
}
SYSCALL_NAMES_X86_64 = {v: k for k, v in SYSCALLS_X86_64.items()}


class Event(ct.Structure):
    _fields_ = [
        ("type", ct.c_uint32), ("epoch", ct.c_uint32), ("cgid", ct.c_uint64),
        ("pid", ct.c_uint32), ("tgid", ct.c_uint32), ("nr", ct.c_int32), ("op", ct.c_uint32),
        ("ret", ct.c_int64), ("a0", ct.c_uint64), ("a1", ct.c_uint64), ("a2", ct.c_uint64),
        ("a3", ct.c_uint64), ("comm", ct.c_char * 16), ("len1", ct.c_int32),
        ("len2", ct.c_int32),
    ]


class PathEvent(ct.Structure):
    _fields_ = [("h", Event), ("p1", ct.c_char * PATHLEN), ("p2", ct.c_char * PATHLEN)]


ST_UNKNOWN, ST_USER, ST_IN, ST_RESTARTING = range(4)
# TF_RETURNED: the thread went back to user mode (a system call's real result, or a signal
# handler) since user space last wrote its entry: how a restore tells a process that only
# re-entered its interrupted call before the watch from one that ran (Inspector.watch).
TF_SEEDED, TF_ENTERED, TF_RETURNED = 1, 2, 4

# Superblock magics of file systems whose "files" are not files (writes change nothing a
# checkpoint of the sandbox's file system holds) and of memory-backed ones.
PSEUDO_MAGICS = (0x9FA0, 0x62656572, 0x27E0EB, 0x63677270, 0x64626720, 0x74726163,
                 0x73636673, 0xCAFE4A11, 0x6165676C, 0x62656570, 0xF97CFF8C, 0x43415D53,
                 0xDE5E81E4, 0x65735543, 0x1CD1, 0x09041934, 0x6E736673, 0x50494446,
                 0x42494E4D, 0x19800202, 0x0187, 0x7655821, 0x444D4142, 0x62646576,
                 0x534F434B, 0x50495045)
MEM_MAGICS = (0x01021994, 0x858458F6, 0x958458F6, 0x5345434D)
PIPEFS_MAGIC = 0x50495045


def defines(*, offsets: dict[str, int], syscalls: dict[str, int], ringbuf_pages: int,
            task_array: int,
            daemon_tgid: int, self_tid: int, unified_root: int, has_group_dead: bool) -> str:
    out = [f"#define PATHLEN {PATHLEN}", f"#define RINGBUF_PAGES {ringbuf_pages}",
           f"#define FILTER_SLOTS {FILTER_SLOTS}", f"#define TASK_ARRAY {task_array}",
           f"#define DAEMON_TGID {daemon_tgid}", f"#define SELF_TID {self_tid}",
           f"#define UNIFIED_ROOT {unified_root}",
           f"#define HAS_GROUP_DEAD {1 if has_group_dead else 0}"]
    out += [f"#define {k} {v}" for k, v in offsets.items()]
    out += [f"#define NR_{k} {v}" for k, v in syscalls.items()]
    for i, name in enumerate(ASPACE_CALLS):
        out.append(f"#define AS_{name} {i}")
    g = globals()
    for prefix in ("EV_", "OP_", "FOP_", "KIND_", "SOCK_", "SP_", "ST_", "TF_"):
        out += [f"#define {k} {v}" for k, v in g.items()
                if k.startswith(prefix) and isinstance(v, int)]
    pseudo = " || ".join(f"m == {m:#x}" for m in PSEUDO_MAGICS if m != PIPEFS_MAGIC)
    mem = " || ".join(f"m == {m:#x}" for m in MEM_MAGICS)
    out.append(f"#define IS_PSEUDO_MAGIC(m) ({pseudo})")
    out.append(f"#define IS_MEM_MAGIC(m) ({mem})")
    out.append(f"#define PIPEFS_MAGIC {PIPEFS_MAGIC:#x}")
    return "\n".join(out) + "\n"


SOURCE = r"""
struct cg_val { u32 epoch; u32 flags; };
struct task_val {
    u64 cgid; u64 args[6]; u64 clone_flags;
    u32 tgid; u32 born_epoch; u32 ran_epoch; u32 as_epoch; u32 as_mask; s32 nr;
    u8 state; u8 injected; u8 flags; u8 pad;
};
struct seen_key { u64 cgid; u64 dev; u64 ino; u32 epoch; u32 what; };
struct ev {
    u32 type; u32 epoch; u64 cgid; u32 pid; u32 tgid; s32 nr; u32 op; s64 ret;
    u64 a0; u64 a1; u64 a2; u64 a3; char comm[16]; s32 len1; s32 len2;
};
struct ev_path { struct ev h; char p1[PATHLEN]; char p2[PATHLEN]; };
struct selftest { u32 tgid; u32 pid; u32 kind; u32 hits; u64 dev; u64 ino; };

BPF_HASH(cgroups, u64, struct cg_val, 4096);
BPF_HASH(lost, u64, u64, 4096);
struct cg_slot { u64 cgid; u32 epoch; u32 multi; };
BPF_ARRAY(cgslots, struct cg_slot, FILTER_SLOTS);
/* Per-thread state: an array indexed by tid (lookups the verifier inlines) for tids below
 * TASK_ARRAY, a hash for the rest. An array entry with cgid 0 is free. */
BPF_ARRAY(tasks_arr, struct task_val, TASK_ARRAY);
BPF_HASH(tasks, u32, struct task_val, 65536);
BPF_TABLE("lru_hash", struct seen_key, u8, seen, 65536);
BPF_ARRAY(selftest, struct selftest, 1);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);

#define O_ACCMODE_ 3
#define O_CREAT_ 0100
#define O_EXCL_ 0200
#define O_TRUNC_ 01000
#define O_PATH_ 010000000
#define AT_FDCWD_ -100
#define AT_REMOVEDIR_ 0x200
#define CLONE_THREAD_ 0x10000
#define CLONE_VM_ 0x100
#define CLONE_VFORK_ 0x4000
#define CLONE_INTO_CGROUP_ 0x200000000ULL
#define S_IFMT_ 0170000
#define S_IFREG_ 0100000
#define S_IFDIR_ 0040000
#define S_IFIFO_ 0010000
#define S_IFCHR_ 0020000
#define S_IFBLK_ 0060000
#define S_IFSOCK_ 0140000

static __always_inline struct task_val *task_lookup(u32 tid) {
    if (tid < TASK_ARRAY) {
        struct task_val *t = tasks_arr.lookup(&tid);
        return (t && t->cgid) ? t : 0;
    }
    return tasks.lookup(&tid);
}

static __always_inline int task_update(u32 tid, struct task_val *v) {
    if (tid < TASK_ARRAY) return tasks_arr.update(&tid, v);
    return tasks.update(&tid, v);
}

static __always_inline void task_delete(u32 tid) {
    if (tid < TASK_ARRAY) {
        struct task_val *t = tasks_arr.lookup(&tid);
        if (t) t->cgid = 0;
        return;
    }
    tasks.delete(&tid);
}

/* The epoch of the current task's watched cgroup, or 0 if it is not watched. An array slot
 * per cgid % FILTER_SLOTS (kept by user space: the cgid watched there, its epoch, and whether
 * more than one watched cgroup shares the slot) rejects other tasks with no hash lookup. */
static __always_inline u32 watched_epoch(u64 *cgid_out) {
    u64 cgid = bpf_get_current_cgroup_id();
    u32 slot = cgid & (FILTER_SLOTS - 1);
    struct cg_slot *s = cgslots.lookup(&slot);
    if (!s || !s->cgid) return 0;
    *cgid_out = cgid;
    if (s->cgid == cgid) return s->epoch;
    if (!s->multi) return 0;
    struct cg_val *cg = cgroups.lookup(&cgid);
    return cg ? cg->epoch : 0;
}

static __always_inline u64 reg(u64 regs, u32 off) {
    u64 v = 0;
    bpf_probe_read_kernel(&v, 8, (void *)(regs + off));
    return v;
}

static __always_inline void count_lost(u64 cgid) {
    u64 zero = 0;
    u64 *c = lost.lookup_or_try_init(&cgid, &zero);
    if (c) __sync_fetch_and_add(c, 1);
}

static __always_inline struct ev *ev_small(u64 cgid, u32 epoch, u32 type) {
    struct ev *e = events.ringbuf_reserve(sizeof(struct ev));
    if (!e) { count_lost(cgid); return 0; }
    u64 pt = bpf_get_current_pid_tgid();
    e->type = type; e->epoch = epoch; e->cgid = cgid;
    e->pid = (u32)pt; e->tgid = pt >> 32; e->nr = -1; e->op = 0; e->ret = 0;
    e->a0 = 0; e->a1 = 0; e->a2 = 0; e->a3 = 0; e->len1 = -1; e->len2 = -1;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    return e;
}

static __always_inline struct ev_path *ev_path(u64 cgid, u32 epoch, u32 type) {
    struct ev_path *e = events.ringbuf_reserve(sizeof(struct ev_path));
    if (!e) { count_lost(cgid); return 0; }
    u64 pt = bpf_get_current_pid_tgid();
    e->h.type = type; e->h.epoch = epoch; e->h.cgid = cgid;
    e->h.pid = (u32)pt; e->h.tgid = pt >> 32; e->h.nr = -1; e->h.op = 0; e->h.ret = 0;
    e->h.a0 = 0; e->h.a1 = 0; e->h.a2 = 0; e->h.a3 = 0; e->h.len1 = -1; e->h.len2 = -1;
    e->p1[0] = 0; e->p2[0] = 0;
    bpf_get_current_comm(&e->h.comm, sizeof(e->h.comm));
    return e;
}

/* Is the current thread being ptraced by the daemon (its injected calls are not the
 * sandbox's own doing)? */
static __always_inline int traced_by_daemon_(u64 task, u32 ptrace) {
    if (DAEMON_TGID == 0 || !ptrace) return 0;
    u64 parent = 0;
    bpf_probe_read_kernel(&parent, 8, (void *)(task + OFF_TASK_PARENT));
    if (!parent) return 0;
    u32 ptgid = 0;
    bpf_probe_read_kernel(&ptgid, 4, (void *)(parent + OFF_TASK_TGID));
    return ptgid == DAEMON_TGID;
}

static __always_inline int traced_by_daemon(void) {
    u64 task = bpf_get_current_task();
    u32 ptrace = 0;
    bpf_probe_read_kernel(&ptrace, 4, (void *)(task + OFF_TASK_PTRACE));
    return traced_by_daemon_(task, ptrace);
}

/* What the current task's descriptor `fd` refers to. Reads: task->files, files->fdt,
 * fdt->{max_fds, fd}, fd[fd], file->f_inode, then the inode's and (for files and FIFOs) the
 * superblock's fields in one read each. */
static __always_inline u32 classify_fd(s64 fd, u64 *dev, u64 *ino) {
    *dev = 0; *ino = 0;
    if (fd < 0) return KIND_NONE;
    u64 task = bpf_get_current_task();
    u64 files = 0, fdt = 0, file = 0, inode = 0;
    u64 fdt2[2] = {};   /* max_fds (u32 at 0), fd (at 8) */
    if (bpf_probe_read_kernel(&files, 8, (void *)(task + OFF_TASK_FILES)) || !files)
        return KIND_UNKNOWN;
    if (bpf_probe_read_kernel(&fdt, 8, (void *)(files + OFF_FILES_FDT)) || !fdt)
        return KIND_UNKNOWN;
    if (bpf_probe_read_kernel(fdt2, 16, (void *)fdt))
        return KIND_UNKNOWN;
    if ((u64)fd >= (u32)fdt2[0]) return KIND_NONE;
    if (!fdt2[1] || bpf_probe_read_kernel(&file, 8, (void *)(fdt2[1] + (u64)fd * 8)))
        return KIND_UNKNOWN;
    if (!file) return KIND_NONE;
    if (bpf_probe_read_kernel(&inode, 8, (void *)(file + OFF_FILE_F_INODE)) || !inode)
        return KIND_UNKNOWN;
    u64 ib[INODE_CHUNK / 8] = {};
    if (bpf_probe_read_kernel(ib, INODE_CHUNK, (void *)inode))
        return KIND_UNKNOWN;
    u16 mode = (u16)(ib[OFF_INODE_I_MODE / 8] >> ((OFF_INODE_I_MODE % 8) * 8));
    u64 sb = ib[OFF_INODE_I_SB / 8];
    *ino = ib[OFF_INODE_I_INO / 8];
    u32 fmt = mode & S_IFMT_;
    if (fmt == S_IFSOCK_) return KIND_SOCK;
    if (fmt == S_IFCHR_) return KIND_CHR;
    if (!sb) return KIND_UNKNOWN;
    u64 sbb[SB_CHUNK / 8] = {};
    if (bpf_probe_read_kernel(sbb, SB_CHUNK, (void *)sb))
        return KIND_UNKNOWN;
    u64 magic = sbb[OFF_SB_S_MAGIC / 8];
    *dev = (u32)(sbb[OFF_SB_S_DEV / 8] >> ((OFF_SB_S_DEV % 8) * 8));
    if (fmt == S_IFIFO_) return magic == PIPEFS_MAGIC ? KIND_PIPE : KIND_FIFO;
    if (IS_PSEUDO_MAGIC(magic)) return KIND_PSEUDO;
    if (fmt == S_IFBLK_) return KIND_BLK;
    if (IS_MEM_MAGIC(magic)) return (fmt == S_IFDIR_) ? KIND_PSEUDO : KIND_MEM;
    if (fmt == S_IFREG_) return KIND_FILE;
    if (fmt == S_IFDIR_) return KIND_DIR;
    return KIND_OTHER;
}

static __always_inline void selftest_probe(u64 fd) {
    int k = 0;
    struct selftest *s = selftest.lookup(&k);
    if (!s) return;
    u64 task = bpf_get_current_task();
    u32 v = 0;
    bpf_probe_read_kernel(&v, 4, (void *)(task + OFF_TASK_TGID));
    s->tgid = v;
    v = 0;
    bpf_probe_read_kernel(&v, 4, (void *)(task + OFF_TASK_PID));
    s->pid = v;
    u64 dev, ino;
    s->kind = classify_fd((s64)(int)fd, &dev, &ino);
    s->dev = dev; s->ino = ino;
    s->hits += 1;
}

/* System calls whose arguments the exit handler (or the enter switch) needs. */
static __always_inline int wants_args(s64 nr) {
    switch (nr) {
    case NR_read: case NR_close: return 0;      /* the most frequent, never needed */
    case NR_write: case NR_pwrite64: case NR_writev: case NR_pwritev: case NR_pwritev2:
    case NR_sendfile: case NR_copy_file_range: case NR_splice: case NR_ftruncate:
    case NR_fallocate: case NR_fchmod: case NR_fchown: case NR_fsetxattr:
    case NR_fremovexattr: case NR_ioctl: case NR_mmap: case NR_open: case NR_creat:
    case NR_openat: case NR_openat2: case NR_open_by_handle_at: case NR_truncate:
    case NR_unlink: case NR_rmdir: case NR_unlinkat: case NR_rename: case NR_renameat:
    case NR_renameat2: case NR_link: case NR_linkat: case NR_symlink: case NR_symlinkat:
    case NR_mkdir: case NR_mkdirat: case NR_mknod: case NR_mknodat: case NR_chmod:
    case NR_fchmodat: case NR_fchmodat2: case NR_chown: case NR_lchown: case NR_fchownat:
    case NR_setxattr: case NR_lsetxattr: case NR_removexattr: case NR_lremovexattr:
    case NR_setxattrat: case NR_removexattrat: case NR_utime: case NR_utimes:
    case NR_futimesat: case NR_utimensat: case NR_file_setattr: case NR_chdir:
    case NR_fchdir: case NR_socket: case NR_socketpair: case NR_bind: case NR_listen:
    case NR_connect: case NR_accept: case NR_accept4: case NR_sendto: case NR_sendmsg:
    case NR_sendmmsg: case NR_ptrace: case NR_process_vm_writev: case NR_clone:
    case NR_fork: case NR_vfork: case NR_clone3: case NR_io_uring_setup:
    case NR_io_uring_enter: case NR_io_uring_register: case NR_io_submit:
    case NR_open_tree:
        return 1;
    }
    return 0;
}

static __always_inline void mark_ran(u64 cgid, struct cg_val *cg, struct task_val *t, s32 nr) {
    u32 epoch = cg->epoch;
    if (t->born_epoch == epoch || t->ran_epoch == epoch) return;
    t->ran_epoch = epoch;
    struct ev *e = ev_small(cgid, epoch, EV_RAN);
    if (!e) return;
    e->nr = nr;
    events.ringbuf_submit(e, 0);
}

static __always_inline struct task_val *get_task(u64 cgid, struct cg_val *cg, u32 tid,
                                                 u32 tgid) {
    struct task_val *t = task_lookup(tid);
    if (t && t->cgid == cgid) {
        if (!t->tgid) t->tgid = tgid;
        return t;
    }
    /* Unknown and ptraced by the daemon: a template of a checkpoint, or a process the
     * daemon is restoring (it re-arms the watch with the restored pids). Not ours. */
    if (traced_by_daemon()) return 0;
    /* A thread in a watched cgroup that did not get there by a fork we saw. */
    struct task_val nt = {};
    nt.cgid = cgid; nt.tgid = tgid; nt.born_epoch = cg->epoch; nt.state = ST_UNKNOWN;
    nt.flags = TF_ENTERED; nt.nr = -1;
    if (task_update(tid, &nt)) { count_lost(cgid); return 0; }
    struct ev *e = ev_small(cgid, cg->epoch, EV_ENTRY);
    if (e) events.ringbuf_submit(e, 0);
    return task_lookup(tid);
}

static __always_inline void special(u64 cgid, u32 epoch, u32 code, s32 nr, u64 a0) {
    struct ev *e = ev_small(cgid, epoch, EV_SPECIAL);
    if (!e) return;
    e->op = code; e->nr = nr; e->a0 = a0;
    events.ringbuf_submit(e, 0);
}

/* Has (cgid, epoch, dev, ino, what) been reported already? Marks it reported. */
static __always_inline int seen_before(u64 cgid, u32 epoch, u64 dev, u64 ino, u32 what) {
    struct seen_key k = {};
    k.cgid = cgid; k.epoch = epoch; k.dev = dev; k.ino = ino; k.what = what;
    if (seen.lookup(&k)) return 1;
    u8 one = 1;
    seen.update(&k, &one);
    return 0;
}

static __always_inline void fd_op(u64 cgid, u32 epoch, u32 op, s64 fd, s32 nr) {
    u64 dev, ino;
    u32 kind = classify_fd(fd, &dev, &ino);
    if (kind == KIND_NONE || kind == KIND_PIPE || kind == KIND_SOCK || kind == KIND_CHR ||
        kind == KIND_PSEUDO || kind == KIND_OTHER)
        return;
    if (kind != KIND_UNKNOWN && seen_before(cgid, epoch, dev, ino, 100 + op)) return;
    struct ev *e = ev_small(cgid, epoch, EV_FDOP);
    if (!e) return;
    e->op = op; e->nr = nr; e->a0 = (u64)fd; e->a1 = dev; e->a2 = ino; e->a3 = kind;
    events.ringbuf_submit(e, 0);
}

/* The struct file of the current task's descriptor fd, or 0. */
static __always_inline u64 file_of(s64 fd) {
    if (fd < 0) return 0;
    u64 task = bpf_get_current_task();
    u64 files = 0, fdt = 0, file = 0;
    u64 fdt2[2] = {};
    if (bpf_probe_read_kernel(&files, 8, (void *)(task + OFF_TASK_FILES)) || !files) return 0;
    if (bpf_probe_read_kernel(&fdt, 8, (void *)(files + OFF_FILES_FDT)) || !fdt) return 0;
    if (bpf_probe_read_kernel(fdt2, 16, (void *)fdt)) return 0;
    if ((u64)fd >= (u32)fdt2[0] || !fdt2[1]) return 0;
    bpf_probe_read_kernel(&file, 8, (void *)(fdt2[1] + (u64)fd * 8));
    return file;
}

/* Where a directory descriptor used as the base of a relative path points: its dentry's
 * names up to the root of its mount, leaf first, NUL-separated (once per epoch and
 * (process, fd, dentry)). */
static __always_inline void emit_dirfd(u64 cgid, u32 epoch, s64 dfd) {
    if (dfd < 0) return;
    u64 file = file_of(dfd);
    if (!file) return;
    u64 dentry = 0;
    bpf_probe_read_kernel(&dentry, 8, (void *)(file + OFF_FILE_F_PATH + OFF_PATH_DENTRY));
    if (!dentry) return;
    u64 pt = bpf_get_current_pid_tgid();
    if (seen_before(cgid, epoch, dentry, ((pt >> 32) << 32) | (u32)dfd, 200)) return;
    struct ev_path *e = ev_path(cgid, epoch, EV_DIRFD);
    if (!e) return;
    e->h.a0 = (u64)dfd;
    char *buf = e->p1;      /* p1 and p2: one 2 * PATHLEN buffer */
    u32 off = 0;
    int root = 0;
    for (int i = 0; i < 24; i++) {
        u64 parent = 0, name = 0;
        bpf_probe_read_kernel(&parent, 8, (void *)(dentry + OFF_DENTRY_D_PARENT));
        if (!parent || parent == dentry) { root = 1; break; }
        bpf_probe_read_kernel(&name, 8, (void *)(dentry + OFF_DENTRY_D_NAME + OFF_QSTR_NAME));
        if (off > 2 * PATHLEN - 64) break;
        int n = bpf_probe_read_kernel_str(buf + (off & (2 * PATHLEN - 1)), 64, (void *)name);
        if (n <= 0) break;
        off += n;
        dentry = parent;
    }
    e->h.len1 = off;
    e->h.a1 = root;
    events.ringbuf_submit(e, 0);
}

/* A path-based operation: p1 (relative to dirfd d1) and optionally p2 (to d2). */
static __always_inline void path_op(u64 cgid, u32 epoch, u32 op, s32 nr, s64 d1, u64 p1,
                                    s64 d2, u64 p2, u64 flags) {
    if (p1 && d1 >= 0) emit_dirfd(cgid, epoch, d1);
    if (p2 && d2 >= 0 && d2 != d1) emit_dirfd(cgid, epoch, d2);
    struct ev_path *e = ev_path(cgid, epoch, EV_FILE);
    if (!e) return;
    e->h.op = op; e->h.nr = nr; e->h.a0 = (u64)d1; e->h.a1 = (u64)d2; e->h.a2 = flags;
    if (p1) e->h.len1 = bpf_probe_read_user_str(e->p1, PATHLEN, (void *)p1);
    if (p2) e->h.len2 = bpf_probe_read_user_str(e->p2, PATHLEN, (void *)p2);
    events.ringbuf_submit(e, 0);
}

static __always_inline void do_open(u64 cgid, u32 epoch, s32 nr, s64 dfd, u64 upath,
                                    u64 flags, s64 fd) {
    if (!(flags & (O_ACCMODE_ | O_CREAT_ | O_TRUNC_))) return;
    if (flags & O_PATH_) return;
    u64 dev, ino;
    u32 kind = classify_fd(fd, &dev, &ino);
    if ((kind == KIND_PIPE || kind == KIND_SOCK || kind == KIND_FIFO) && (flags & O_ACCMODE_)
        && upath) {
        /* "/proc/<pid>/fd/N" of another process: its pipe or socket, opened for writing
         * (data it has not read is its state). */
        char pre[8] = {};
        bpf_probe_read_user(pre, 8, (void *)upath);
        if (pre[0] == '/' && pre[1] == 'p' && pre[2] == 'r' && pre[3] == 'o' &&
            pre[4] == 'c' && pre[5] == '/' && pre[6] >= '1' && pre[6] <= '9')
            special(cgid, epoch, SP_PROCFD, nr, 0);
    }
    if (kind == KIND_NONE || kind == KIND_PIPE || kind == KIND_SOCK || kind == KIND_CHR ||
        kind == KIND_PSEUDO || kind == KIND_OTHER)
        return;
    u32 what = 1 + (u32)(flags & (O_CREAT_ | O_EXCL_ | O_TRUNC_));
    if (kind == KIND_MEM && !(flags & (O_CREAT_ | O_TRUNC_))) return;
    if (kind != KIND_UNKNOWN && !(flags & O_EXCL_) && seen_before(cgid, epoch, dev, ino, what))
        return;
    if (kind == KIND_FILE && (flags & O_TRUNC_) && (flags & O_ACCMODE_))
        /* Reported as written (emptied): its later writes need no event of their own. */
        seen_before(cgid, epoch, dev, ino, 100 + FOP_WRITE);
    if (upath && dfd >= 0) emit_dirfd(cgid, epoch, dfd);
    struct ev_path *e = ev_path(cgid, epoch, EV_FILE);
    if (!e) return;
    e->h.op = OP_OPEN; e->h.nr = nr; e->h.ret = fd;
    e->h.a0 = (u64)dfd; e->h.a1 = dev; e->h.a2 = flags; e->h.a3 = ino | ((u64)kind << 56);
    if (upath) e->h.len1 = bpf_probe_read_user_str(e->p1, PATHLEN, (void *)upath);
    events.ringbuf_submit(e, 0);
}

static __always_inline void sock_op(u64 cgid, u32 epoch, u32 op, s32 nr, s64 fd, u64 uaddr,
                                    u64 alen, s64 ret) {
    struct ev_path *e = ev_path(cgid, epoch, EV_SOCK);
    if (!e) return;
    e->h.op = op; e->h.nr = nr; e->h.a0 = (u64)fd; e->h.ret = ret;
    if (uaddr && alen > 0) {
        u32 n = alen > 128 ? 128 : (u32)alen;
        if (n > 0 && n <= 128 && bpf_probe_read_user(e->p1, n, (void *)uaddr) == 0)
            e->h.len1 = n;
    }
    events.ringbuf_submit(e, 0);
}

static __always_inline void aspace(u64 cgid, struct cg_val *cg, struct task_val *t, u32 bit,
                                   s32 nr) {
    u32 epoch = cg->epoch;
    if (t->born_epoch == epoch) return;
    if (t->as_epoch != epoch) { t->as_epoch = epoch; t->as_mask = 0; }
    if (t->as_mask & (1u << bit)) return;
    t->as_mask |= (1u << bit);
    struct ev *e = ev_small(cgid, epoch, EV_ASPACE);
    if (!e) return;
    e->nr = nr; e->a0 = bit;
    events.ringbuf_submit(e, 0);
}

RAW_TRACEPOINT_PROBE(sys_enter) {
    s64 nr = ctx->args[1];
#if SELF_TID
    if (nr == NR_fdatasync && (u32)bpf_get_current_pid_tgid() == SELF_TID) {
        selftest_probe(reg(ctx->args[0], OFF_REGS_DI));
        return 0;
    }
#endif
    u64 cgid = 0;
    struct cg_val cgv = {};
    cgv.epoch = watched_epoch(&cgid);
    if (!cgv.epoch) return 0;
    struct cg_val *cg = &cgv;
    u64 pt = bpf_get_current_pid_tgid();
    struct task_val *t = get_task(cgid, cg, (u32)pt, pt >> 32);
    if (!t) return 0;
    /* task->thread_info.status and task->ptrace in one read (offsets checked at load). */
    u64 task = bpf_get_current_task();
    u32 tf[TASK_FLAGS_CHUNK / 4] = {};
    bpf_probe_read_kernel(tf, TASK_FLAGS_CHUNK, (void *)(task + TASK_FLAGS_BASE));
    if (traced_by_daemon_(task, tf[(OFF_TASK_PTRACE - TASK_FLAGS_BASE) / 4])) {
        t->injected = 1;
        return 0;
    }
    t->injected = 0;
    if (!(t->state == ST_RESTARTING && (nr == t->nr || nr == NR_restart_syscall)))
        mark_ran(cgid, cg, t, nr);
    t->state = ST_IN; t->nr = nr;
    {
        /* A 32-bit (ia32) system call: its numbers are not the ones decoded here. */
        u32 status = tf[(OFF_TI_STATUS - TASK_FLAGS_BASE) / 4];
        if (status & 2) {   /* TS_COMPAT */
            if (!seen_before(cgid, cg->epoch, (u32)pt, 0, 300))
                special(cgid, cg->epoch, SP_COMPAT, nr, 0);
            return 0;
        }
    }
    if (!wants_args(nr)) return 0;
    /* One read of pt_regs r10..di (x86_64 layout, checked against BTF at load). */
    u64 r[8] = {};
    bpf_probe_read_kernel(r, sizeof(r), (void *)(ctx->args[0] + OFF_REGS_R10));
    t->args[0] = r[7]; t->args[1] = r[6]; t->args[2] = r[5];
    t->args[3] = r[0]; t->args[4] = r[2]; t->args[5] = r[1];
    u32 epoch = cg->epoch;
    switch (nr) {
    case NR_clone: t->clone_flags = t->args[0]; break;
    case NR_fork: t->clone_flags = 0; break;
    case NR_vfork: t->clone_flags = CLONE_VM_ | CLONE_VFORK_; break;
    case NR_clone3: {
        u64 f = 0;
        bpf_probe_read_user(&f, 8, (void *)t->args[0]);
        t->clone_flags = f;
        if (f & CLONE_INTO_CGROUP_) special(cgid, epoch, SP_CLONE_INTO_CGROUP, nr, f);
        break;
    }
    /* Their effects happen while the call runs (or after it returns): report now. */
    case NR_io_uring_setup: case NR_io_uring_enter: case NR_io_uring_register:
        special(cgid, epoch, SP_IO_URING, nr, 0); break;
    case NR_io_submit: special(cgid, epoch, SP_AIO, nr, 0); break;
    }
    return 0;
}

RAW_TRACEPOINT_PROBE(sys_exit) {
    u64 cgid = 0;
    struct cg_val cgv = {};
    cgv.epoch = watched_epoch(&cgid);
    if (!cgv.epoch) return 0;
    struct cg_val *cg = &cgv;
    u64 pt = bpf_get_current_pid_tgid();
    struct task_val *t = get_task(cgid, cg, (u32)pt, pt >> 32);
    if (!t) return 0;
    if (t->injected) { t->injected = 0; return 0; }
    s64 ret = ctx->args[1];
    s64 nr = (t->state == ST_IN) ? t->nr : (s64)reg(ctx->args[0], OFF_REGS_ORIG_AX);
    if (ret == -512 || ret == -513 || ret == -514 || ret == -516 || ret == -4) {
        /* Interrupted; it re-enters (restart) or the program retries. */
        t->state = ST_RESTARTING; t->nr = nr;
        return 0;
    }
    int have_args = t->state == ST_IN && t->nr == nr;
    t->state = ST_USER;
    t->flags |= TF_RETURNED;
    mark_ran(cgid, cg, t, nr);
    u32 epoch = cg->epoch;
    if (!have_args) {
        /* A call that began before we knew this thread: its effect is unknown. (A thread
         * that entered the cgroup from outside began its call outside.) */
        if (!(t->flags & TF_SEEDED)) return 0;
        switch (nr) {
        case NR_write: case NR_pwrite64: case NR_writev: case NR_pwritev: case NR_pwritev2:
        case NR_open: case NR_openat: case NR_openat2: case NR_creat: case NR_rename:
        case NR_renameat: case NR_renameat2: case NR_unlink: case NR_unlinkat:
        case NR_truncate: case NR_ftruncate: case NR_fallocate: case NR_copy_file_range:
        case NR_sendfile: case NR_splice: case NR_mkdir: case NR_mkdirat: case NR_rmdir:
        case NR_link: case NR_linkat: case NR_symlink: case NR_symlinkat:
            if (ret >= 0) special(cgid, epoch, SP_UNOBSERVED, nr, 0);
        }
        return 0;
    }
    if (ret < 0 && !(nr == NR_connect && ret == -115)) return 0;
    u64 a0 = t->args[0], a1 = t->args[1], a2 = t->args[2], a3 = t->args[3],
        a4 = t->args[4], a5 = t->args[5];
    switch (nr) {
    /* ---- writes through a descriptor ---- */
    case NR_write: case NR_pwrite64: case NR_writev: case NR_pwritev: case NR_pwritev2:
        if (ret > 0) fd_op(cgid, epoch, FOP_WRITE, (s64)(int)a0, nr);
        break;
    case NR_sendfile: if (ret > 0) fd_op(cgid, epoch, FOP_WRITE, (s64)(int)a0, nr); break;
    case NR_copy_file_range: case NR_splice:
        if (ret > 0) fd_op(cgid, epoch, FOP_WRITE, (s64)(int)a2, nr);
        break;
    case NR_ftruncate: fd_op(cgid, epoch, FOP_TRUNC, (s64)(int)a0, nr); break;
    case NR_fallocate: fd_op(cgid, epoch, FOP_ALLOC, (s64)(int)a0, nr); break;
    case NR_fchmod: fd_op(cgid, epoch, FOP_CHMOD, (s64)(int)a0, nr); break;
    case NR_fchown: fd_op(cgid, epoch, FOP_CHOWN, (s64)(int)a0, nr); break;
    case NR_fsetxattr: case NR_fremovexattr:
        fd_op(cgid, epoch, FOP_XATTR, (s64)(int)a0, nr); break;
    case NR_ioctl:
        if ((a1 >> 30) & 1) {   /* _IOC_WRITE: FICLONE, FS_IOC_SETFLAGS, ... */
            u64 dev, ino;
            u32 kind = classify_fd((s64)(int)a0, &dev, &ino);
            if (kind == KIND_FILE || kind == KIND_DIR || kind == KIND_BLK ||
                kind == KIND_MEM || kind == KIND_UNKNOWN)
                fd_op(cgid, epoch, FOP_IOCTL, (s64)(int)a0, nr);
        }
        break;
    case NR_mmap:
        aspace(cgid, cg, t, AS_mmap, nr);
        if ((a2 & 2) && ((a3 & 0xf) == 1 || (a3 & 0xf) == 3) && (s64)(int)a4 >= 0)
            fd_op(cgid, epoch, FOP_MMAP, (s64)(int)a4, nr);
        break;
    /* ---- opens ---- */
    case NR_open: do_open(cgid, epoch, nr, AT_FDCWD_, a0, a1, ret); break;
    case NR_creat: do_open(cgid, epoch, nr, AT_FDCWD_, a0, 01 | O_CREAT_ | O_TRUNC_, ret); break;
    case NR_openat: do_open(cgid, epoch, nr, (s64)(int)a0, a1, a2, ret); break;
    case NR_openat2: {
        u64 f = 0;
        bpf_probe_read_user(&f, 8, (void *)a2);
        do_open(cgid, epoch, nr, (s64)(int)a0, a1, f, ret);
        break;
    }
    case NR_open_by_handle_at: do_open(cgid, epoch, nr, (s64)(int)a0, 0, a2, ret); break;
    /* ---- path operations ---- */
    case NR_truncate: path_op(cgid, epoch, OP_TRUNCATE, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_unlink: path_op(cgid, epoch, OP_UNLINK, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_rmdir: path_op(cgid, epoch, OP_RMDIR, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_unlinkat:
        path_op(cgid, epoch, (a2 & AT_REMOVEDIR_) ? OP_RMDIR : OP_UNLINK, nr, (s64)(int)a0,
                a1, 0, 0, a2);
        break;
    case NR_rename: path_op(cgid, epoch, OP_RENAME, nr, AT_FDCWD_, a0, AT_FDCWD_, a1, 0); break;
    case NR_renameat:
        path_op(cgid, epoch, OP_RENAME, nr, (s64)(int)a0, a1, (s64)(int)a2, a3, 0); break;
    case NR_renameat2:
        path_op(cgid, epoch, OP_RENAME, nr, (s64)(int)a0, a1, (s64)(int)a2, a3, a4); break;
    case NR_link: path_op(cgid, epoch, OP_LINK, nr, AT_FDCWD_, a0, AT_FDCWD_, a1, 0); break;
    case NR_linkat:
        path_op(cgid, epoch, OP_LINK, nr, (s64)(int)a0, a1, (s64)(int)a2, a3, a4); break;
    case NR_symlink:
        path_op(cgid, epoch, OP_SYMLINK, nr, AT_FDCWD_, a1, AT_FDCWD_, a0, 0); break;
    case NR_symlinkat:
        path_op(cgid, epoch, OP_SYMLINK, nr, (s64)(int)a1, a2, AT_FDCWD_, a0, 0); break;
    case NR_mkdir: path_op(cgid, epoch, OP_MKDIR, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_mkdirat: path_op(cgid, epoch, OP_MKDIR, nr, (s64)(int)a0, a1, 0, 0, 0); break;
    case NR_mknod: path_op(cgid, epoch, OP_MKNOD, nr, AT_FDCWD_, a0, 0, 0, a1); break;
    case NR_mknodat: path_op(cgid, epoch, OP_MKNOD, nr, (s64)(int)a0, a1, 0, 0, a2); break;
    case NR_chmod: path_op(cgid, epoch, OP_CHMOD, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_fchmodat: path_op(cgid, epoch, OP_CHMOD, nr, (s64)(int)a0, a1, 0, 0, 0); break;
    case NR_fchmodat2: path_op(cgid, epoch, OP_CHMOD, nr, (s64)(int)a0, a1, 0, 0, a3); break;
    case NR_chown: case NR_lchown:
        path_op(cgid, epoch, OP_CHOWN, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_fchownat: path_op(cgid, epoch, OP_CHOWN, nr, (s64)(int)a0, a1, 0, 0, a4); break;
    case NR_setxattr: case NR_lsetxattr: case NR_removexattr: case NR_lremovexattr:
        path_op(cgid, epoch, OP_XATTR, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_setxattrat: case NR_removexattrat:
        path_op(cgid, epoch, OP_XATTR, nr, (s64)(int)a0, a1, 0, 0, a2); break;
    case NR_utime: case NR_utimes:
        path_op(cgid, epoch, OP_UTIMES, nr, AT_FDCWD_, a0, 0, 0, 0); break;
    case NR_futimesat: path_op(cgid, epoch, OP_UTIMES, nr, (s64)(int)a0, a1, 0, 0, 0); break;
    case NR_utimensat:
        if (a1) path_op(cgid, epoch, OP_UTIMES, nr, (s64)(int)a0, a1, 0, 0, a3);
        else fd_op(cgid, epoch, FOP_UTIMES, (s64)(int)a0, nr);
        break;
    case NR_file_setattr:
        path_op(cgid, epoch, OP_SETATTR, nr, (s64)(int)a0, a1, 0, 0, a4); break;
    case NR_chdir: {
        struct ev_path *e = ev_path(cgid, epoch, EV_CHDIR);
        if (!e) break;
        e->h.a0 = (u64)AT_FDCWD_;
        e->h.len1 = bpf_probe_read_user_str(e->p1, PATHLEN, (void *)a0);
        events.ringbuf_submit(e, 0);
        break;
    }
    case NR_fchdir: {
        struct ev *e = ev_small(cgid, epoch, EV_CHDIR);
        if (!e) break;
        e->a0 = a0;
        events.ringbuf_submit(e, 0);
        break;
    }
    /* ---- sockets ---- */
    case NR_socket: sock_op(cgid, epoch, SOCK_CREATE, nr, ret, 0, 0, (s64)((a0 << 32) | (a1 & 0xffffffff))); break;
    case NR_socketpair: sock_op(cgid, epoch, SOCK_PAIR, nr, -1, 0, 0, (s64)((a0 << 32) | (a1 & 0xffffffff))); break;
    case NR_bind: sock_op(cgid, epoch, SOCK_BIND, nr, (s64)(int)a0, a1, a2, ret); break;
    case NR_listen: sock_op(cgid, epoch, SOCK_LISTEN, nr, (s64)(int)a0, 0, 0, ret); break;
    case NR_connect: sock_op(cgid, epoch, SOCK_CONNECT, nr, (s64)(int)a0, a1, a2, ret); break;
    case NR_accept: case NR_accept4:
        sock_op(cgid, epoch, SOCK_ACCEPT, nr, (s64)(int)a0, 0, 0, ret); break;
    case NR_sendto:
        if (a4) sock_op(cgid, epoch, SOCK_SENDTO, nr, (s64)(int)a0, a4, a5, ret);
        break;
    case NR_sendmsg: case NR_sendmmsg: {
        u64 name = 0; u32 namelen = 0;
        bpf_probe_read_user(&name, 8, (void *)a1);
        bpf_probe_read_user(&namelen, 4, (void *)(a1 + 8));
        if (name) sock_op(cgid, epoch, SOCK_SENDTO, nr, (s64)(int)a0, name, namelen, ret);
        break;
    }
    /* ---- cross-process and namespace effects ---- */
    case NR_ptrace: special(cgid, epoch, SP_PTRACE, nr, a0); break;
    case NR_process_vm_writev: special(cgid, epoch, SP_VM_WRITE, nr, a0); break;
    case NR_shmget: case NR_shmctl: case NR_semget: case NR_semop:
    case NR_semtimedop: case NR_semctl: case NR_msgget: case NR_msgsnd: case NR_msgctl:
    case NR_mq_open: case NR_mq_unlink: case NR_mq_timedsend:
        special(cgid, epoch, SP_IPC, nr, 0); break;
    case NR_shmat:
        aspace(cgid, cg, t, AS_shmat, nr);
        special(cgid, epoch, SP_IPC, nr, 0); break;
    case NR_mount: case NR_umount2: case NR_pivot_root: case NR_move_mount:
    case NR_fsmount: case NR_mount_setattr: case NR_open_tree_attr:
        special(cgid, epoch, SP_MOUNT, nr, 0); break;
    case NR_open_tree:
        if (a2 & 1) special(cgid, epoch, SP_MOUNT, nr, 0);   /* OPEN_TREE_CLONE */
        break;
    case NR_sethostname: case NR_setdomainname:
        special(cgid, epoch, SP_NS, nr, 0); break;
    /* ---- address space ---- */
    case NR_mprotect: aspace(cgid, cg, t, AS_mprotect, nr); break;
    case NR_munmap: aspace(cgid, cg, t, AS_munmap, nr); break;
    case NR_brk: aspace(cgid, cg, t, AS_brk, nr); break;
    case NR_mremap: aspace(cgid, cg, t, AS_mremap, nr); break;
    case NR_madvise: aspace(cgid, cg, t, AS_madvise, nr); break;
    case NR_shmdt: aspace(cgid, cg, t, AS_shmdt, nr); break;
    case NR_remap_file_pages: aspace(cgid, cg, t, AS_remap_file_pages, nr); break;
    case NR_mlock: aspace(cgid, cg, t, AS_mlock, nr); break;
    case NR_munlock: aspace(cgid, cg, t, AS_munlock, nr); break;
    case NR_mlockall: aspace(cgid, cg, t, AS_mlockall, nr); break;
    case NR_munlockall: aspace(cgid, cg, t, AS_munlockall, nr); break;
    case NR_mlock2: aspace(cgid, cg, t, AS_mlock2, nr); break;
    case NR_pkey_mprotect: aspace(cgid, cg, t, AS_pkey_mprotect, nr); break;
    case NR_process_madvise: aspace(cgid, cg, t, AS_process_madvise, nr); break;
    case NR_mseal: aspace(cgid, cg, t, AS_mseal, nr); break;
    case NR_map_shadow_stack: aspace(cgid, cg, t, AS_map_shadow_stack, nr); break;
    }
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_fork) {
    u64 cgid = bpf_get_current_cgroup_id();
    struct cg_val *cg = cgroups.lookup(&cgid);
    if (!cg) return 0;
    u64 pt = bpf_get_current_pid_tgid();
    struct task_val *t = get_task(cgid, cg, (u32)pt, pt >> 32);
    if (!t) return 0;
    if (t->injected) return 0;          /* a template the daemon forks */
    u32 child = args->child_pid;
    int thread = (t->clone_flags & CLONE_THREAD_) != 0;
    struct task_val nt = {};
    nt.cgid = cgid; nt.tgid = thread ? (u32)(pt >> 32) : child; nt.born_epoch = cg->epoch;
    nt.state = ST_UNKNOWN; nt.nr = -1;
    if (task_update(child, &nt)) count_lost(cgid);
    struct ev_path *e = ev_path(cgid, cg->epoch, EV_FORK);
    if (!e) return 0;
    e->h.a0 = child; e->h.a1 = thread; e->h.a2 = t->clone_flags;
    TP_DATA_LOC_READ_STR(e->p1, child_comm, 16);
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    u64 cgid = bpf_get_current_cgroup_id();
    struct cg_val *cg = cgroups.lookup(&cgid);
    if (!cg) return 0;
    u64 pt = bpf_get_current_pid_tgid();
    struct task_val *t = get_task(cgid, cg, (u32)pt, pt >> 32);
    if (!t) return 0;
    if (t->injected) return 0;
    struct ev_path *e = ev_path(cgid, cg->epoch, EV_EXEC);
    if (!e) return 0;
    e->h.a0 = args->old_pid;
    TP_DATA_LOC_READ_STR(e->p1, filename, PATHLEN);
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 cgid = bpf_get_current_cgroup_id();
    u64 pt = bpf_get_current_pid_tgid();
    u32 tid = (u32)pt;
    struct cg_val *cg = cgroups.lookup(&cgid);
    struct task_val *t = task_lookup(tid);
    if (!cg || !t || t->cgid != cgid) {
        if (t) task_delete(tid);
        return 0;
    }
    struct ev *e = ev_small(cgid, cg->epoch, EV_EXIT);
    if (e) {
#if HAS_GROUP_DEAD
        e->a0 = args->group_dead;
#else
        e->a0 = (u32)pt == (u32)(pt >> 32);
#endif
        e->a1 = t->born_epoch == cg->epoch;
        events.ringbuf_submit(e, 0);
    }
    task_delete(tid);
    return 0;
}

TRACEPOINT_PROBE(signal, signal_generate) {
    u64 cgid = bpf_get_current_cgroup_id();
    struct cg_val *cg = cgroups.lookup(&cgid);
    if (!cg) return 0;
    if (args->result == 1) return 0;    /* TRACE_SIGNAL_IGNORED */
    u32 target = args->pid;
    struct task_val *tt = task_lookup(target);
    if (tt && tt->cgid == cgid && tt->born_epoch == cg->epoch) return 0;  /* new this turn */
    if (traced_by_daemon()) return 0;
    struct ev *e = ev_small(cgid, cg->epoch, EV_SIGGEN);
    if (!e) return 0;
    e->a0 = target; e->a1 = args->sig; e->a2 = args->result; e->a3 = args->group;
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(signal, signal_deliver) {
    u64 cgid = bpf_get_current_cgroup_id();
    struct cg_val *cg = cgroups.lookup(&cgid);
    if (!cg) return 0;
    u64 pt = bpf_get_current_pid_tgid();
    struct task_val *t = get_task(cgid, cg, (u32)pt, pt >> 32);
    if (!t) return 0;
    if (args->sa_handler > 1) {                     /* not SIG_DFL / SIG_IGN */
        t->flags |= TF_RETURNED;
        mark_ran(cgid, cg, t, -1);
    }
    if (t->born_epoch == cg->epoch) return 0;
    struct ev *e = ev_small(cgid, cg->epoch, EV_SIGDLV);
    if (!e) return 0;
    e->a0 = (u32)pt; e->a1 = args->sig; e->a2 = args->sa_handler;
    events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(cgroup, cgroup_attach_task) {
    if (args->dst_root != UNIFIED_ROOT) return 0;
    u64 cgid = args->dst_id;
    struct cg_val *cg = cgroups.lookup(&cgid);
    if (!cg) return 0;
    u32 tid = args->pid;
    struct task_val nt = {};
    nt.cgid = cgid; nt.born_epoch = cg->epoch; nt.state = ST_UNKNOWN; nt.flags = TF_ENTERED;
    nt.nr = -1;
    if (task_update(tid, &nt)) count_lost(cgid);
    struct ev *e = ev_small(cgid, cg->epoch, EV_ATTACH);
    if (!e) return 0;
    e->a0 = tid;
    events.ringbuf_submit(e, 0);
    return 0;
}

"""
