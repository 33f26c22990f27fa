"""ctypes binding for libdbxcr.so (native/fork_template.c): ptrace-injected process templates.

    info = describe(pid)                      # threads, tracer, ... (refuse early)
    tpl = make_template(pid)                  # stopped copy-on-write copy of pid
    child = tpl.spawn(fds={0: r, 1: w},       # fork from the checkpoint, re-rooted
                      files=regular_files(pid), cwd="/work", set_tid=[pid_in_ns])
    tpl.release()                             # SIGKILL + reap

A whole sandbox at one instant (memory and files agree), see fork_template.h:

    freeze the cgroup (v1 freezer.state = FROZEN, wait for FROZEN)
    stops = [begin_stop(pid) for pid in pids]  # seize + interrupt, never waits
    thaw the cgroup                           # tasks go straight into the ptrace stop
    for s in stops: s.wait(timeout=2.0)       # CRError ESRCH if it exited meanwhile
    snapshot the file system                  # every task is stopped
    tpls = [s.make_template() for s in stops]
    for s in stops: s.resume()                # exactly as before, detached
    # on any error: s.abort() for every handle, thaw, then sweep_stops(timeout)

fds(pid) and proc_status(pid) read /proc so the daemon can refuse what it cannot restore.

Images on disk (native/criu_incr.c, format in native/IMAGE_FORMAT.md):

    st = dump(tpl, img_dir, parent=prev_img_dir)   # DumpStats; delta against prev image
    verify_image(img_dir)                          # ImageCorrupt if damaged (any thread)
    tpl = restore_template(host_pid, img_dir, root_dir)   # a Template again, from disk
    image_depends_on(img_dir)                      # ancestor dirs it needs, nearest first

  - Threads: dump() and restore_template() run on the template owner thread (the ptrace
    worker); restore_template's Template belongs to the calling thread.  verify_image(),
    image_info() and image_depends_on() touch no process: any thread.
  - State: dump() takes any held Template (made by make_template, Stopped.make_template or
    restore_template); it stays parked and usable.  The live process is not touched.
  - Directory: core.img, mm.img, pagemap.img (checksummed headers with the image's random
    id) and pages.img (every page checked against its hash when read); created atomically
    (temp sibling + rename; fsync=True to make it durable); the path must not exist.
  - Chains: with parent=, only pages whose content changed since the parent image are
    written; the parent is recorded relative to the new directory (move image trees as a
    whole) with its id.  Restore follows parent links back `depth` generations, never
    further: an image of depth d needs its d nearest ancestors for as long as it exists;
    depth 0 (full) needs nothing.  max_chain (default 8) forces a full image when the
    parent's depth + 1 would reach it.
  - Restore: the process is forked from host_pid (e.g. the sandbox's init): it lives in
    host's namespaces and cgroup, children spawned from it are host's children; mapped
    files are opened under root_dir and must be unchanged (size, mtime); no descriptors
    are held (pass them to spawn).  Same kernel (vDSO) and CPU (xstate size) only.
  - Errors: CRError naming pid and step; a damaged/truncated/missing image or ancestor
    raises ImageCorrupt (a CRError, errno EBADMSG) naming the file.

Threading rule: a template or a Stopped handle is ptrace-held by the OS thread that
created it; every call on it must come from that same thread (the kernel lets only the
tracer thread wait for, resume or detach a tracee) (the library checks and raises EPERM).  Run
all template work on one dedicated thread (for example a single-thread executor), never on
a pool.  Everything here is x86_64 Linux and needs root (CAP_SYS_PTRACE, CAP_SYS_ADMIN).

The tracer also receives wait notifications for its tracees: code in the same process must
not call waitpid(-1, __WALL) (plain waitpid(pid) of its own children is fine).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import fcntl
import os
import socket
import stat as _stat
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Collection, Iterable, Iterator, Mapping, Sequence

from .. import kernfs

LIB_ENV = "DELTABOX_LIBDBXCR"
DEFAULT_LIB = Path(__file__).resolve().parent.parent / "libexec" / "libdbxcr.so"


class CRError(OSError):
    """A checkpoint/restore step failed; .errno is the errno, str() names pid and step."""


class _Err(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * 512)]


class _Births(ctypes.Structure):  # fork_template.h struct dbxcr_births
    _fields_ = [("n", ctypes.c_size_t), ("carriers", ctypes.POINTER(ctypes.c_void_p)),
                ("set_tid", ctypes.POINTER(ctypes.c_int)),
                ("pgid", ctypes.POINTER(ctypes.c_int)),
                ("victims", ctypes.POINTER(ctypes.c_int)), ("n_victims", ctypes.c_size_t),
                ("timeout_ms", ctypes.c_int), ("done_fd", ctypes.c_int),
                ("born", ctypes.POINTER(ctypes.c_int)), ("errs", ctypes.POINTER(_Err))]


class _Info(ctypes.Structure):
    _fields_ = [("threads", ctypes.c_int), ("tracer_pid", ctypes.c_int),
                ("ppid", ctypes.c_int), ("seccomp", ctypes.c_int),
                ("nspid_depth", ctypes.c_int), ("nspid", ctypes.c_int),
                ("state", ctypes.c_char)]


class _File(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("flags", ctypes.c_int),
                ("offset", ctypes.c_longlong), ("path", ctypes.c_char_p)]


class _FdMap(ctypes.Structure):
    _fields_ = [("src", ctypes.c_int), ("target", ctypes.c_int), ("cloexec", ctypes.c_int)]


class _StopInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_int), ("kind", ctypes.c_int), ("signal", ctypes.c_int),
                ("done", ctypes.c_int)]


SOCKOPT_BYTES = 16   # DBXCR_SOCKOPT_BYTES


class _SockOpt(ctypes.Structure):
    _fields_ = [("level", ctypes.c_int), ("name", ctypes.c_int), ("value", ctypes.c_int),
                ("len", ctypes.c_uint), ("bytes", ctypes.c_ubyte * SOCKOPT_BYTES)]


SOCKOPTS = 16   # DBXCR_SOCKOPTS
MCAST_GROUPS = 20   # DBXCR_MCAST_GROUPS
FILTER_MAX = 512   # DBXCR_FILTER_MAX: instructions of a socket filter made again


class _McastGroup(ctypes.Structure):
    _fields_ = [("ifindex", ctypes.c_uint), ("family", ctypes.c_int),
                ("addr", ctypes.c_ubyte * 16)]


class _Listen(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("family", ctypes.c_int), ("type", ctypes.c_int),
                ("protocol", ctypes.c_int), ("backlog", ctypes.c_int),
                ("reuseaddr", ctypes.c_int), ("reuseport", ctypes.c_int),
                ("v6only", ctypes.c_int), ("addrlen", ctypes.c_uint),
                ("addr", ctypes.c_ubyte * 128), ("peerlen", ctypes.c_uint),
                ("peer", ctypes.c_ubyte * 128), ("nopts", ctypes.c_uint),
                ("opts", _SockOpt * SOCKOPTS), ("ngroups", ctypes.c_uint),
                ("groups", _McastGroup * MCAST_GROUPS), ("nfilter", ctypes.c_uint),
                ("filter", ctypes.c_char_p)]


class _EpollWatch(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_uint),
                ("data", ctypes.c_ulonglong)]


class _Epoll(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("cloexec", ctypes.c_int),
                ("watches", ctypes.POINTER(_EpollWatch)), ("nwatches", ctypes.c_size_t),
                ("dup_of", ctypes.c_int)]


class _Remap(ctypes.Structure):
    _fields_ = [("start", ctypes.c_ulong), ("end", ctypes.c_ulong), ("prot", ctypes.c_int),
                ("src", ctypes.c_int), ("offset", ctypes.c_longlong),
                ("private_map", ctypes.c_int), ("sysv", ctypes.c_int), ("shmid", ctypes.c_int)]


class _ShmSegment(ctypes.Structure):  # fork_template.h struct dbxcr_shm_segment
    _fields_ = [("id", ctypes.c_int), ("key", ctypes.c_int), ("mode", ctypes.c_uint),
                ("uid", ctypes.c_uint), ("gid", ctypes.c_uint), ("nattch", ctypes.c_int),
                ("size", ctypes.c_ulonglong), ("fd", ctypes.c_int), ("removed", ctypes.c_int)]


class _MsgQueue(ctypes.Structure):  # fork_template.h struct dbxcr_msg_queue
    _fields_ = [("id", ctypes.c_int), ("key", ctypes.c_int), ("mode", ctypes.c_uint),
                ("uid", ctypes.c_uint), ("gid", ctypes.c_uint), ("qbytes", ctypes.c_ulonglong),
                ("count", ctypes.c_ulonglong), ("bytes", ctypes.c_ulonglong),
                ("fd", ctypes.c_int)]


class _SemSet(ctypes.Structure):  # fork_template.h struct dbxcr_sem_set
    _fields_ = [("id", ctypes.c_int), ("key", ctypes.c_int), ("mode", ctypes.c_uint),
                ("uid", ctypes.c_uint), ("gid", ctypes.c_uint), ("nsems", ctypes.c_int),
                ("fd", ctypes.c_int)]


class _PosixQueue(ctypes.Structure):  # fork_template.h struct dbxcr_posix_queue
    _fields_ = [("name", ctypes.c_char * 256), ("mode", ctypes.c_uint),
                ("uid", ctypes.c_uint), ("gid", ctypes.c_uint), ("maxmsg", ctypes.c_longlong),
                ("msgsize", ctypes.c_longlong), ("count", ctypes.c_ulonglong),
                ("bytes", ctypes.c_ulonglong), ("notify_pid", ctypes.c_int),
                ("fd", ctypes.c_int)]


class _IpcObjects(ctypes.Structure):  # fork_template.h struct dbxcr_ipc_objects
    _fields_ = [("sem_sets", ctypes.c_int), ("msg_queues", ctypes.c_int),
                ("shm_segments", ctypes.c_int),
                ("posix_queues", ctypes.c_int), ("posix_names", ctypes.c_char * 128)]


class _Prctls(ctypes.Structure):  # fork_template.h struct dbxcr_prctls
    _fields_ = [(name, ctypes.c_int) for name in ("dumpable", "securebits", "thp_disable",
                                                   "memory_merge", "mce_kill",
                                                   "no_new_privs")]


MAX_GROUPS = 64   # fork_template.h DBXCR_MAX_GROUPS


class _Creds(ctypes.Structure):  # fork_template.h struct dbxcr_creds
    _fields_ = [("set", ctypes.c_int), ("uid", ctypes.c_uint32 * 4),
                ("gid", ctypes.c_uint32 * 4), ("ngroups", ctypes.c_int),
                ("groups", ctypes.c_uint32 * MAX_GROUPS),
                ("cap_inh", ctypes.c_uint64), ("cap_prm", ctypes.c_uint64),
                ("cap_eff", ctypes.c_uint64), ("cap_bnd", ctypes.c_uint64),
                ("cap_amb", ctypes.c_uint64)]


class _Lock(ctypes.Structure):  # fork_template.h struct dbxcr_lock
    _fields_ = [("fd", ctypes.c_int), ("kind", ctypes.c_int), ("type", ctypes.c_int),
                ("start", ctypes.c_longlong), ("len", ctypes.c_longlong)]


class _MLock(ctypes.Structure):  # fork_template.h struct dbxcr_mlock
    _fields_ = [("start", ctypes.c_ulong), ("end", ctypes.c_ulong), ("onfault", ctypes.c_int)]


class _SpawnOpts(ctypes.Structure):
    _fields_ = [("mntns_fd", ctypes.c_int), ("cwd", ctypes.c_char_p),
                ("files", ctypes.POINTER(_File)), ("nfiles", ctypes.c_size_t),
                ("fds", ctypes.POINTER(_FdMap)), ("nfds", ctypes.c_size_t),
                ("set_tid", ctypes.POINTER(ctypes.c_int)), ("set_tid_size", ctypes.c_size_t),
                ("pidns_fd", ctypes.c_int), ("ns_pidfd", ctypes.c_int),
                ("cgroup_fds", ctypes.POINTER(ctypes.c_int)), ("ncgroup_fds", ctypes.c_size_t),
                ("pgid", ctypes.c_int),
                ("listens", ctypes.POINTER(_Listen)), ("nlistens", ctypes.c_size_t),
                ("epolls", ctypes.POINTER(_Epoll)), ("nepolls", ctypes.c_size_t),
                ("remaps", ctypes.POINTER(_Remap)), ("nremaps", ctypes.c_size_t),
                ("locks", ctypes.POINTER(_Lock)), ("nlocks", ctypes.c_size_t),
                ("ctty", ctypes.c_int),
                ("mlocks", ctypes.POINTER(_MLock)), ("nmlocks", ctypes.c_size_t),
                ("cwd_made", ctypes.POINTER(ctypes.c_char_p)), ("ncwd_made", ctypes.c_size_t)]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def library_path() -> Path:
    return Path(os.environ.get(LIB_ENV) or DEFAULT_LIB)


def _load() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not path.exists():
            raise CRError(_errno.ENOENT, f"{path}: libdbxcr.so is not built (run `make native`)")
        lib = ctypes.CDLL(str(path), use_errno=True)
        try:
            _bind(lib)
        except AttributeError as e:   # built from an older checkout
            raise CRError(_errno.ENOSYS, f"{path} lacks a function this checkout calls "
                          f"({e}): rebuild it with `make native`") from None
        _lib = lib
        return lib


def _bind(lib: ctypes.CDLL) -> None:
    """Every function's argument and result types (ctypes assumes int otherwise)."""
    err = ctypes.POINTER(_Err)
    lib.dbxcr_describe.argtypes = [ctypes.c_int, ctypes.POINTER(_Info), err]
    lib.dbxcr_describe.restype = ctypes.c_int
    lib.dbxcr_inject_syscall.argtypes = [ctypes.c_int, ctypes.c_long,
                                         ctypes.POINTER(ctypes.c_long),
                                         ctypes.POINTER(ctypes.c_long), err]
    lib.dbxcr_inject_syscall.restype = ctypes.c_int
    lib.dbxcr_make_template.argtypes = [ctypes.c_int, err]
    lib.dbxcr_make_template.restype = ctypes.c_void_p
    lib.dbxcr_template_drop_fds.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_drop_fds.restype = ctypes.c_int
    lib.dbxcr_template_itimers.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_long)]
    lib.dbxcr_template_itimers.restype = None
    lib.dbxcr_template_group_stop.argtypes = [ctypes.c_void_p]
    lib.dbxcr_template_group_stop.restype = ctypes.c_int
    lib.dbxcr_template_set_group_stop.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.dbxcr_template_set_group_stop.restype = None
    ip = ctypes.POINTER(ctypes.c_int)
    lib.dbxcr_template_parent_death.argtypes = [ctypes.c_void_p, ip, ip]
    lib.dbxcr_template_parent_death.restype = None
    lib.dbxcr_template_set_parent_death.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                                    ctypes.c_int, err]
    lib.dbxcr_template_set_parent_death.restype = ctypes.c_int
    lib.dbxcr_template_set_itimers.argtypes = [ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_long), err]
    lib.dbxcr_template_set_itimers.restype = ctypes.c_int
    lib.dbxcr_template_ptimers.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_long),
                                           ctypes.c_int]
    lib.dbxcr_template_ptimers.restype = ctypes.c_int
    lib.dbxcr_template_set_ptimers.argtypes = [ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_long), ctypes.c_int,
                                               err]
    lib.dbxcr_template_set_ptimers.restype = ctypes.c_int
    lib.dbxcr_ptimers_supported.argtypes = []
    lib.dbxcr_ptimers_supported.restype = ctypes.c_int
    lib.dbxcr_template_pid.argtypes = [ctypes.c_void_p]
    lib.dbxcr_template_pid.restype = ctypes.c_int
    lib.dbxcr_template_origin.argtypes = [ctypes.c_void_p]
    lib.dbxcr_template_origin.restype = ctypes.c_int
    lib.dbxcr_template_syscall.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                           ctypes.POINTER(ctypes.c_long)]
    lib.dbxcr_template_syscall.restype = ctypes.c_long
    lib.dbxcr_netns_socket.argtypes = [ctypes.c_int] * 4 + [err]
    lib.dbxcr_netns_socket.restype = ctypes.c_int
    lib.dbxcr_netns_socketpair.argtypes = [ctypes.c_int] * 3 + [
        ctypes.POINTER(ctypes.c_int), err]
    lib.dbxcr_netns_socketpair.restype = ctypes.c_int
    for f in (lib.dbxcr_root_bind, lib.dbxcr_root_connect):
        f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, err]
        f.restype = ctypes.c_int
    lib.dbxcr_mntns_open.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                     ctypes.c_int, err]
    lib.dbxcr_mntns_open.restype = ctypes.c_int
    lib.dbxcr_spawn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_SpawnOpts), err]
    lib.dbxcr_spawn.restype = ctypes.c_int
    lib.dbxcr_spawn_carrier.argtypes = [ctypes.c_void_p, ctypes.POINTER(_SpawnOpts),
                                        ctypes.POINTER(ctypes.c_void_p), err]
    lib.dbxcr_spawn_carrier.restype = ctypes.c_int
    lib.dbxcr_carrier_birth.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                        ctypes.c_size_t, ctypes.c_int, err]
    lib.dbxcr_carrier_birth.restype = ctypes.c_int
    lib.dbxcr_carrier_keep.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_carrier_keep.restype = ctypes.c_int
    lib.dbxcr_carrier_kill.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_carrier_kill.restype = ctypes.c_int
    lib.dbxcr_carrier_install_fds.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                              ctypes.POINTER(ctypes.c_int),
                                              ctypes.POINTER(ctypes.c_int), ctypes.c_size_t,
                                              err]
    lib.dbxcr_carrier_install_fds.restype = ctypes.c_int
    lib.dbxcr_jobs_new.argtypes = [err]
    lib.dbxcr_jobs_new.restype = ctypes.c_void_p
    lib.dbxcr_jobs_post.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Births), err]
    lib.dbxcr_jobs_post.restype = ctypes.c_int
    lib.dbxcr_jobs_wait.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_jobs_wait.restype = ctypes.c_int
    lib.dbxcr_jobs_free.argtypes = [ctypes.c_void_p]
    lib.dbxcr_jobs_free.restype = None
    lib.dbxcr_spawn_held.argtypes = [ctypes.c_void_p, ctypes.POINTER(_SpawnOpts),
                                     ctypes.POINTER(ctypes.c_void_p), err]
    lib.dbxcr_spawn_held.restype = ctypes.c_int
    lib.dbxcr_held_release.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_held_release.restype = ctypes.c_int
    lib.dbxcr_held_foreground.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, err]
    lib.dbxcr_held_foreground.restype = ctypes.c_int
    lib.dbxcr_held_zombie.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_char_p, err]
    lib.dbxcr_held_zombie.restype = ctypes.c_int
    lib.dbxcr_ipcns_mqueue_dir.argtypes = [ctypes.c_int, err]
    lib.dbxcr_ipcns_mqueue_dir.restype = ctypes.c_int
    lib.dbxcr_ipcns_shm_list.argtypes = [ctypes.c_int, ctypes.POINTER(_ShmSegment),
                                         ctypes.c_size_t,
                                         ctypes.POINTER(ctypes.c_size_t), err]
    lib.dbxcr_ipcns_shm_list.restype = ctypes.c_int
    lib.dbxcr_ipcns_shm_make.argtypes = [ctypes.c_int, ctypes.POINTER(_ShmSegment),
                                         ctypes.c_size_t, err]
    lib.dbxcr_ipcns_shm_make.restype = ctypes.c_int
    lib.dbxcr_ipcns_shm_modes.argtypes = lib.dbxcr_ipcns_shm_make.argtypes
    lib.dbxcr_ipcns_shm_modes.restype = ctypes.c_int
    lib.dbxcr_ipcns_msg_list.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgQueue),
                                         ctypes.c_size_t,
                                         ctypes.POINTER(ctypes.c_size_t), err]
    lib.dbxcr_ipcns_msg_list.restype = ctypes.c_int
    lib.dbxcr_ipcns_msg_make.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgQueue),
                                         ctypes.c_size_t, err]
    lib.dbxcr_ipcns_msg_make.restype = ctypes.c_int
    lib.dbxcr_ipcns_sem_list.argtypes = [ctypes.c_int, ctypes.POINTER(_SemSet),
                                         ctypes.c_size_t,
                                         ctypes.POINTER(ctypes.c_size_t), err]
    lib.dbxcr_ipcns_sem_list.restype = ctypes.c_int
    lib.dbxcr_ipcns_sem_make.argtypes = [ctypes.c_int, ctypes.POINTER(_SemSet),
                                         ctypes.c_size_t, err]
    lib.dbxcr_ipcns_sem_make.restype = ctypes.c_int
    lib.dbxcr_ipcns_mq_list.argtypes = [ctypes.c_int, ctypes.POINTER(_PosixQueue),
                                        ctypes.c_size_t,
                                        ctypes.POINTER(ctypes.c_size_t), err]
    lib.dbxcr_ipcns_mq_list.restype = ctypes.c_int
    lib.dbxcr_ipcns_mq_make.argtypes = [ctypes.c_int, ctypes.POINTER(_PosixQueue),
                                        ctypes.c_size_t, err]
    lib.dbxcr_ipcns_mq_make.restype = ctypes.c_int
    lib.dbxcr_ipcns_mq_open.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                        ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(ctypes.c_int), ctypes.c_size_t, err]
    lib.dbxcr_ipcns_mq_open.restype = ctypes.c_int
    lib.dbxcr_ipcns_mq_unlink.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                          ctypes.c_size_t, err]
    lib.dbxcr_ipcns_mq_unlink.restype = ctypes.c_int
    lib.dbxcr_mq_capture_fd.argtypes = [ctypes.c_int, ctypes.POINTER(_PosixQueue), err]
    lib.dbxcr_mq_capture_fd.restype = ctypes.c_int
    lib.dbxcr_held_set_prctls.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Prctls), err]
    lib.dbxcr_held_set_prctls.restype = ctypes.c_int
    lib.dbxcr_held_install_fd.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_int, ctypes.POINTER(_EpollWatch),
                                          ctypes.c_size_t, err]
    lib.dbxcr_held_install_fd.restype = ctypes.c_int
    lib.dbxcr_template_prctls.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Prctls), err]
    lib.dbxcr_template_prctls.restype = ctypes.c_int
    lib.dbxcr_template_set_prctls.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Prctls),
                                              err]
    lib.dbxcr_template_set_prctls.restype = ctypes.c_int
    lib.dbxcr_template_set_creds.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Creds), err]
    lib.dbxcr_template_set_creds.restype = ctypes.c_int
    lib.dbxcr_held_kill.argtypes = [ctypes.c_void_p]
    lib.dbxcr_held_kill.restype = None
    lib.dbxcr_held_pid.argtypes = [ctypes.c_void_p]
    lib.dbxcr_held_pid.restype = ctypes.c_int
    lib.dbxcr_template_own_group.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_own_group.restype = ctypes.c_int
    lib.dbxcr_template_own_session.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_own_session.restype = ctypes.c_int
    lib.dbxcr_template_shmdt.argtypes = [ctypes.c_void_p, ctypes.c_ulong, err]
    lib.dbxcr_template_shmdt.restype = ctypes.c_int
    lib.dbxcr_template_copy.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_copy.restype = ctypes.c_void_p
    lib.dbxcr_template_adopt.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_adopt.restype = ctypes.c_int
    lib.dbxcr_release_template.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_release_template.restype = ctypes.c_int
    lib.dbxcr_stop_begin.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), err]
    lib.dbxcr_stop_begin.restype = ctypes.c_int
    lib.dbxcr_stop_wait.argtypes = [ctypes.c_void_p, ctypes.c_int, err]
    lib.dbxcr_stop_wait.restype = ctypes.c_int
    lib.dbxcr_stop_get_info.argtypes = [ctypes.c_void_p, ctypes.POINTER(_StopInfo)]
    lib.dbxcr_stop_get_info.restype = None
    lib.dbxcr_stop_syscall.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_long)]
    lib.dbxcr_stop_syscall.restype = ctypes.c_long
    lib.dbxcr_stop_hold.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_stop_hold.restype = ctypes.c_int
    lib.dbxcr_template_stopped.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_stopped.restype = ctypes.c_void_p
    lib.dbxcr_template_start.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_start.restype = ctypes.c_int
    lib.dbxcr_template_finish.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_template_finish.restype = ctypes.c_void_p
    lib.dbxcr_stop_resume.argtypes = [ctypes.c_void_p, err]
    lib.dbxcr_stop_resume.restype = ctypes.c_int
    lib.dbxcr_stop_abort.argtypes = [ctypes.c_void_p]
    lib.dbxcr_stop_abort.restype = None
    lib.dbxcr_stop_sweep.argtypes = [ctypes.c_int]
    lib.dbxcr_stop_sweep.restype = ctypes.c_int


def _error(err: _Err) -> CRError:
    code = err.code or _errno.EIO
    return CRError(code, err.msg.decode(errors="replace") or os.strerror(code))


def _raise(err: _Err) -> None:
    raise _error(err)


# native/dbxcr_internal.h: the most threads a captured process may have.
MAX_THREADS = 256
PTIMER_FIELDS = 10      # longs per POSIX timer (fork_template.h DBXCR_PTIMER_FIELDS)


def ptimers_supported() -> int:
    """How many POSIX timers a process may have to be captured; 0 if this kernel cannot
    give a restored timer its id (prctl PR_TIMER_CREATE_RESTORE_IDS)."""
    return _load().dbxcr_ptimers_supported()
NEW_SESSION = -2        # a spawn's pgid: setsid() in the child (fork_template.h DBXCR_NEW_SESSION)


@dataclass(frozen=True)
class ProcInfo:
    threads: int
    tracer_pid: int
    ppid: int
    seccomp: int
    nspid_depth: int
    nspid: int
    state: str

    def refusal(self) -> str | None:
        """Why this process cannot be templated, or None."""
        if self.threads > MAX_THREADS:
            return f"{self.threads} threads (at most {MAX_THREADS} are captured)"
        if self.tracer_pid:
            return f"already traced by pid {self.tracer_pid}"
        if self.state in ("Z", "X"):
            return "exiting"
        return None


@dataclass(frozen=True)
class ListenSocket:
    """A listening TCP socket, a UDP socket or a netlink socket (netlink.py), to create
    afresh in a spawned child and install at fd (a UDP or netlink socket bound if addr,
    connected if peer; it never listens)."""
    fd: int
    family: int
    type: int            # SOCK_STREAM or SOCK_DGRAM | SOCK_NONBLOCK / SOCK_CLOEXEC as the
    protocol: int        # original
    addr: bytes          # raw sockaddr (getsockname); b"": not bound (UDP, netlink)
    backlog: int = 128
    reuseaddr: bool = False
    reuseport: bool = False
    v6only: bool = False
    ino: int = 0         # the socket's inode: the same socket in several processes
    peer: bytes = b""    # raw sockaddr of a connected UDP socket's peer
    # (level, name, value) of the options set away from a fresh socket's value: an int,
    # or a struct's bytes (SO_RCVTIMEO, SO_LINGER)
    options: tuple[tuple[int, int, int | bytes], ...] = ()
    # (interface index, group address) of the multicast groups a UDP socket joined
    groups: tuple[tuple[int, str], ...] = ()
    # its classic BPF socket filter (SO_ATTACH_FILTER): struct sock_filter[], 8 bytes each
    filter: bytes = b""

    @property
    def listens(self) -> bool:
        return self.type & 0xf == socket.SOCK_STREAM

    @property
    def kind(self) -> str:
        if self.family == socket.AF_NETLINK:
            return "netlink socket"
        return "listening socket" if self.listens else "UDP socket"

    def _c(self) -> _Listen:
        if len(self.addr) > 128 or len(self.peer) > 128 or len(self.options) > SOCKOPTS \
                or len(self.groups) > MCAST_GROUPS or len(self.filter) > 8 * FILTER_MAX:
            raise CRError(_errno.EINVAL, f"fd {self.fd}: socket address too long, or more "
                          f"than {SOCKOPTS} options, {MCAST_GROUPS} multicast groups or "
                          f"{FILTER_MAX} filter instructions")
        c = _Listen(self.fd, self.family, self.type, self.protocol, self.backlog,
                    int(self.reuseaddr), int(self.reuseport), int(self.v6only), len(self.addr))
        ctypes.memmove(c.addr, self.addr, len(self.addr))
        c.peerlen = len(self.peer)
        ctypes.memmove(c.peer, self.peer, len(self.peer))
        c.nopts = len(self.options)
        for i, (level, name, value) in enumerate(self.options):
            if isinstance(value, bytes):   # a struct option (sockopts.py)
                if len(value) > SOCKOPT_BYTES:
                    raise CRError(_errno.EINVAL, f"fd {self.fd}: option ({level}, {name}) "
                                  f"of {len(value)} bytes")
                c.opts[i] = _SockOpt(level, name, 0, len(value))
                ctypes.memmove(c.opts[i].bytes, value, len(value))
            else:
                c.opts[i] = _SockOpt(level, name, value)
        c.ngroups = len(self.groups)
        for i, (ifindex, group) in enumerate(self.groups):
            family = socket.AF_INET6 if ":" in group else socket.AF_INET
            raw = socket.inet_pton(family, group)
            c.groups[i].ifindex, c.groups[i].family = ifindex, family
            ctypes.memmove(c.groups[i].addr, raw, len(raw))
        # The C string points into self.filter, which lives as long as this record.
        c.nfilter, c.filter = len(self.filter) // 8, self.filter or None
        return c


@dataclass(frozen=True)
class EpollWatch:
    """One registration of an epoll instance: the watched fd, events, user data."""
    fd: int
    events: int
    data: int


@dataclass(frozen=True)
class Epoll:
    """An epoll instance to create afresh in a spawned child at fd, with its watches (the
    template's is shared with the original process)."""
    fd: int
    cloexec: bool
    watches: tuple[EpollWatch, ...] = ()
    dup_of: int = -1    # another descriptor of the instance at this fd (made before it)


LOCK_FLOCK, LOCK_POSIX, LOCK_OFD = 1, 2, 3   # fork_template.h DBXCR_LOCK_*
_LOCK_KINDS = {"FLOCK": LOCK_FLOCK, "POSIX": LOCK_POSIX, "OFDLCK": LOCK_OFD}
_LOCK_TYPES = {"READ": fcntl.F_RDLCK, "WRITE": fcntl.F_WRLCK}


@dataclass(frozen=True)
class Prctls:
    """A process's prctl state that a fork copies and no /proc file shows (native/prctls.c):
    PR_GET_DUMPABLE, PR_GET_SECUREBITS, PR_GET_THP_DISABLE, PR_GET_MEMORY_MERGE (0
    without KSM), PR_MCE_KILL_GET; and PR_GET_NO_NEW_PRIVS, which only the process sets."""
    dumpable: int
    securebits: int
    thp_disable: int
    memory_merge: int
    mce_kill: int
    no_new_privs: int = 0

    def _c(self) -> _Prctls:
        return _Prctls(self.dumpable, self.securebits, self.thp_disable, self.memory_merge,
                       self.mce_kill, self.no_new_privs)


@dataclass(frozen=True)
class MemoryLock:
    """A range of a process's memory it locked (mlock; on fault only: mlock2's
    MLOCK_ONFAULT), locked again in every child of its template (fork drops locks)."""
    start: int
    end: int
    onfault: bool = False


@dataclass(frozen=True)
class FileLock:
    """A file lock a restored process takes again on its descriptor `fd` (fork_template.h
    struct dbxcr_lock): kind LOCK_*, type fcntl.F_RDLCK or F_WRLCK, bytes from `start`
    (len 0: to the end of the file)."""
    fd: int
    kind: int
    type: int
    start: int = 0
    len: int = 0

    @staticmethod
    def parse(fd: int, text: str) -> FileLock | None:
        """From an FdInfo.locks entry ("POSIX WRITE 5-14", "FLOCK READ 0-EOF"); None for
        what cannot be taken again (a lease, a delegation)."""
        parts = text.split()
        if len(parts) != 3 or parts[0] not in _LOCK_KINDS or parts[1] not in _LOCK_TYPES:
            return None
        first, _, last = parts[2].partition("-")
        if not first.isdigit() or not (last == "EOF" or last.isdigit()):
            return None
        start = int(first)
        return FileLock(fd, _LOCK_KINDS[parts[0]], _LOCK_TYPES[parts[1]], start,
                        0 if last == "EOF" else int(last) - start + 1)


@dataclass(frozen=True)
class Remap:
    """A shared mapping [start, end) to map again in a spawned child from our descriptor
    src at offset (the template's is the original's own object); `private`: a private
    mapping of a file written in place since the checkpoint, mapped again from src (the
    restored tree's file) with the pages the original had written copied from the
    template (cr/private_maps.py). `shmid` >= 0: attach that System V segment of the
    child's IPC namespace over it instead (src unused: cr/sysv_shm.py)."""
    start: int
    end: int
    prot: int
    src: int
    offset: int = 0
    private: bool = False
    shmid: int = -1


@dataclass(frozen=True)
class ReopenFile:
    """A regular file to reopen in a spawned child at fd, with its flags and offset."""
    fd: int
    path: str
    flags: int = os.O_RDONLY
    offset: int = 0


def describe(pid: int) -> ProcInfo:
    lib = _load()
    info, err = _Info(), _Err()
    if lib.dbxcr_describe(pid, ctypes.byref(info), ctypes.byref(err)) < 0:
        _raise(err)
    return ProcInfo(info.threads, info.tracer_pid, info.ppid, info.seccomp,
                    info.nspid_depth, info.nspid, info.state.decode())


def inject_syscall(pid: int, nr: int, *args: int) -> int:
    """Run system call nr with up to 6 integer args inside pid; returns its raw result
    (-errno on failure).  pid resumes exactly where it was."""
    if len(args) > 6:
        raise ValueError("at most 6 syscall arguments")
    lib = _load()
    argv = (ctypes.c_long * 6)(*args)
    ret, err = ctypes.c_long(), _Err()
    if lib.dbxcr_inject_syscall(pid, nr, argv, ctypes.byref(ret), ctypes.byref(err)) < 0:
        _raise(err)
    return ret.value


def regular_files(pid: int) -> list[ReopenFile]:
    """The regular files pid has open, with flags and offsets from /proc/pid/fdinfo.
    Paths are as seen from the caller's root and mount namespace (readlink of
    /proc/pid/fd/N); files that were deleted are skipped."""
    return [ReopenFile(f.fd, f.path, f.flags, f.pos) for f in fds(pid)
            if f.kind == "file" and not f.deleted and f.path.startswith("/")]


class Template:
    """A ptrace-stopped copy-on-write copy of a process at checkpoint time."""

    def __init__(self, handle: int, pid: int, origin: int) -> None:
        self._handle: int | None = handle
        self.pid = pid
        self.origin = origin
        self.owner_thread = threading.get_native_id()
        self.own_group_done = False   # moved out of its process group (own_group)
        self.own_session_done = False  # and out of its session (own_session)
        # root's copy of an unprivileged process, rebuilt from its image (cr/creds.py)
        self.rebuilt = False
        self._refs = 1   # checkpoints holding it (share); release() by each, the last frees

    def share(self) -> "Template":
        """One more holder (a later checkpoint of a process that has not run since this
        template was made: the same state); each holder releases once."""
        self._h()
        self._refs += 1
        return self

    @property
    def released(self) -> bool:
        return self._handle is None

    def _h(self) -> int:
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"template {self.pid} was released")
        return self._handle

    def spawn(self, *, fds: Mapping[int, int] | None = None,
              files: Iterable[ReopenFile | tuple] = (), cwd: str | None = None,
              mntns_fd: int | None = None, set_tid: Sequence[int] | None = None,
              cloexec_fds: Iterable[int] = (), pidns_fd: int | None = None,
              ns_pidfd: int | None = None, cgroup_fds: Sequence[int] = (), pgid: int = 0,
              listens: Sequence[ListenSocket] = (), epolls: Sequence[Epoll] = (),
              remaps: Sequence[Remap] = (), locks: Sequence[FileLock] = (),
              ctty: int = -1, mlocks: Sequence[MemoryLock] = (),
              cwd_made: Sequence[str] = ()) -> int:
        """Fork a child that continues where the origin was at checkpoint time.

        fds: {target_fd_in_child: our_fd}, e.g. fresh stdio pipes ({0: r, 1: w, 2: w}).
        files: regular files reopened at their fd with flags and offset (own description).
        cwd: chdir in the child (after joining mntns_fd).
        mntns_fd: our fd of a mount namespace the child joins (setns).
        set_tid: clone3 set_tid, [0] = pid in the innermost namespace the child is born in.
        pidns_fd: our fd of a pid namespace nested below the template's: born there.
        ns_pidfd: pidfd of another sandbox's init: join its net/uts/ipc/cgroup namespaces.
        cgroup_fds: our open cgroup.procs files, the child is moved into before it runs.
        pgid: 0 keep the template's process group, -1 lead a new one, > 0 join that one.
        listens: listening TCP sockets created afresh (after joining the net namespace).
        epolls: epoll instances created afresh, last. remaps: shared mappings mapped again
        from our descriptors. locks: file locks taken again once every descriptor is in
        (a carrier's by its birth). ctty: the child's fd (a pty's slave) that becomes its
        controlling terminal once it leads its session (pgid NEW_SESSION; a carrier's
        birth takes it), or -1. mlocks: memory ranges locked again (fork drops locks).
        cwd_made: for a cwd deleted since the process entered it, the stand-in
        directories the child makes to enter it and removes again (cr/deleted_cwd.py).
        Returns the child's pid in our namespace; it is a sibling of the origin (same
        parent, same exit signal)."""
        with self._opts(fds, files, cwd, mntns_fd, set_tid, cloexec_fds, pidns_fd, ns_pidfd,
                        cgroup_fds, pgid, listens, epolls, remaps, locks, ctty,
                        mlocks, cwd_made) as opts:
            err = _Err()
            pid = _load().dbxcr_spawn(self._handle, ctypes.byref(opts), ctypes.byref(err))
        if pid < 0:
            _raise(err)
        return pid

    def spawn_carrier(self, **kwargs) -> Carrier:
        """A carrier of this template's process, re-rooted as spawn() would (same
        arguments), held stopped until Carrier.birth(). Same thread."""
        return Carrier(*self._spawn_stopped(_load().dbxcr_spawn_carrier, kwargs))

    def spawn_held(self, **kwargs) -> Held:
        """A child spawned as spawn() would (same arguments) but held stopped, with the
        checkpoint's state, until Held.release(): a restored parent whose children
        Held.adopt() gives it first. Same thread."""
        return Held(*self._spawn_stopped(_load().dbxcr_spawn_held, kwargs))

    def held_chain(self, ancestors: Sequence[tuple[dict, str | os.PathLike, Template]],
                   child: dict, root_fd: int) -> list[Held]:
        """This template's process restored held below its held ancestors (root first)
        when it outweighs them (native: dbxcr_held_chain): their processes share this
        template's address space, each born of the previous, the last forking the child;
        then each gets an address space and its own image in place. `ancestors`: (spawn()
        arguments, image directory, the template the image's pages are read from) each;
        `child`: its spawn() arguments. The ancestors' Held then the child's. Raises
        ImageCorrupt / CRError."""
        lib = _load_images()
        n = len(ancestors)
        ifds: list[int] = []
        # Any static program: the ancestors exec it only to drop the child's address space
        # and never run it (native: held_exec).
        stub = library_path().with_name("dbx-init")
        try:
            exe = os.open(stub, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise CRError(e.errno or _errno.EIO, f"open {stub}: {e.strerror}") from None
        try:
            for _, image, _ in ancestors:
                ifds.append(os.open(os.fspath(image),
                                    os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            with contextlib.ExitStack() as stack:
                aopts = (_SpawnOpts * n)(*[stack.enter_context(self._opts(**kw))
                                           for kw, _, _ in ancestors])
                copts = stack.enter_context(self._opts(**child))
                cifds = (ctypes.c_int * n)(*ifds)
                srcs = (ctypes.c_void_p * n)(*[t._handle for _, _, t in ancestors])
                outs = (ctypes.c_void_p * (n + 1))()
                err = _Err()
                pid = lib.dbxcr_held_chain(self._h(), n, aopts, cifds, srcs, root_fd, exe,
                                           ctypes.byref(copts), outs, ctypes.byref(err))
        finally:
            for fd in [*ifds, exe]:
                os.close(fd)
        if pid < 0:
            _raise_img(err)
        return [Held(h, _load().dbxcr_held_pid(h)) for h in outs]

    def _spawn_stopped(self, fn, kwargs: dict) -> tuple[int, int]:
        """(handle, pid) of a child the C call `fn` spawns stopped (a carrier, a held
        process) with spawn()'s options."""
        with self._opts(**kwargs) as opts:
            err = _Err()
            handle = ctypes.c_void_p()
            pid = fn(self._handle, ctypes.byref(opts), ctypes.byref(handle), ctypes.byref(err))
        if pid < 0:
            _raise(err)
        assert handle.value is not None
        return handle.value, pid

    @contextlib.contextmanager
    def _opts(self, fds: Mapping[int, int] | None = None,
              files: Iterable[ReopenFile | tuple] = (), cwd: str | None = None,
              mntns_fd: int | None = None, set_tid: Sequence[int] | None = None,
              cloexec_fds: Iterable[int] = (), pidns_fd: int | None = None,
              ns_pidfd: int | None = None, cgroup_fds: Sequence[int] = (), pgid: int = 0,
              listens: Sequence[ListenSocket] = (), epolls: Sequence[Epoll] = (),
              remaps: Sequence[Remap] = (), locks: Sequence[FileLock] = (), ctty: int = -1,
              mlocks: Sequence[MemoryLock] = (),
              cwd_made: Sequence[str] = ()) -> Iterator[_SpawnOpts]:
        """The C options of a spawn (valid inside the block: it owns the arrays)."""
        self._h()
        cloexec = set(cloexec_fds)
        fd_items = list((fds or {}).items())
        fdmaps = (_FdMap * max(1, len(fd_items)))(
            *[_FdMap(src, target, int(target in cloexec)) for target, src in fd_items])
        file_items = [f if isinstance(f, ReopenFile) else ReopenFile(*f) for f in files]
        paths = [os.fsencode(f.path) for f in file_items]
        cfiles = (_File * max(1, len(file_items)))(
            *[_File(f.fd, f.flags, f.offset, p) for f, p in zip(file_items, paths)])
        tids = list(set_tid or [])
        ctids = (ctypes.c_int * max(1, len(tids)))(*tids)
        cg = list(cgroup_fds)
        ccg = (ctypes.c_int * max(1, len(cg)))(*cg)
        lst = list(listens)
        clst = (_Listen * max(1, len(lst)))(*[x._c() for x in lst])
        cwd_b = os.fsencode(cwd) if cwd is not None else None
        watch_arrays = [(_EpollWatch * max(1, len(e.watches)))(
            *[_EpollWatch(w.fd, w.events, w.data) for w in e.watches]) for e in epolls]
        ceps = (_Epoll * max(1, len(epolls)))(
            *[_Epoll(e.fd, int(e.cloexec), arr, len(e.watches), e.dup_of + 1)
              for e, arr in zip(epolls, watch_arrays)])
        rms = list(remaps)
        crms = (_Remap * max(1, len(rms)))(
            *[_Remap(m.start, m.end, m.prot, m.src, m.offset, int(m.private),
                     int(m.shmid >= 0), m.shmid) for m in rms])
        lks = list(locks)
        clks = (_Lock * max(1, len(lks)))(*[_Lock(k.fd, k.kind, k.type, k.start, k.len)
                                             for k in lks])
        mls = list(mlocks)
        cmls = (_MLock * max(1, len(mls)))(*[_MLock(m.start, m.end, int(m.onfault))
                                             for m in mls])
        made = [os.fsencode(p) for p in cwd_made]
        cmade = (ctypes.c_char_p * max(1, len(made)))(*made)
        yield _SpawnOpts(-1 if mntns_fd is None else mntns_fd, cwd_b,
                         cfiles, len(file_items), fdmaps, len(fd_items),
                         ctids if tids else None, len(tids),
                         -1 if pidns_fd is None else pidns_fd,
                         -1 if ns_pidfd is None else ns_pidfd,
                         ccg, len(cg), pgid, clst, len(lst), ceps, len(epolls),
                         crms, len(rms), clks, len(lks), ctty + 1, cmls, len(mls),
                         cmade, len(made))

    def syscalls(self) -> list[tuple[int, list[int]]]:
        """For each thread of the origin at the checkpoint (the main one first): the
        system call it was stopped in (-1: none) and its six arguments."""
        return _syscalls(_load().dbxcr_template_syscall, self._h())

    def drop_fds(self) -> None:
        """Close every descriptor the template holds: a fork shares its process's open
        file descriptions, so its copies would keep a pipe's write end, a flock or OFD
        lock, a port or a connection alive in the live sandbox after the process closed
        them. Its later children get only what spawn() installs."""
        err = _Err()
        if _load().dbxcr_template_drop_fds(self._h(), ctypes.byref(err)) < 0:
            _raise(err)

    def itimers(self) -> list[int]:
        """The origin's interval timers at the checkpoint, armed again in every child
        (fork drops them): for ITIMER_REAL, _VIRTUAL and _PROF in turn, interval and
        time left as [s, us, s, us]; 12 zeros when none was armed."""
        out = (ctypes.c_long * 12)()
        _load().dbxcr_template_itimers(self._h(), out)
        return list(out)

    def group_stop(self) -> bool:
        """Whether the origin sat in a job-control stop at the checkpoint (kill -STOP, a
        shell's ^Z): every child stops again once let go."""
        return bool(_load().dbxcr_template_group_stop(self._h()))

    def set_group_stop(self, stopped: bool) -> None:
        """Give a template rebuilt from disk its origin's job-control stop."""
        _load().dbxcr_template_set_group_stop(self._h(), int(stopped))

    def parent_death(self) -> tuple[int, bool]:
        """The origin's parent-death signal (0: none) and child-subreaper flag, which
        fork drops (native/prctls.c): every child gets the flag back, a child born of its
        restored parent the signal."""
        sig, sub = ctypes.c_int(), ctypes.c_int()
        _load().dbxcr_template_parent_death(self._h(), ctypes.byref(sig), ctypes.byref(sub))
        return sig.value, bool(sub.value)

    def set_parent_death(self, pdeathsig: int, subreaper: bool) -> None:
        """Give a template rebuilt from disk its origin's parent-death signal and
        child-subreaper flag."""
        err = _Err()
        if _load().dbxcr_template_set_parent_death(self._h(), pdeathsig, int(subreaper),
                                                   ctypes.byref(err)) < 0:
            _raise(err)

    def prctls(self) -> Prctls:
        """Its origin's prctl state at the checkpoint (injected PR_GET_* calls)."""
        out, err = _Prctls(), _Err()
        if _load().dbxcr_template_prctls(self._h(), ctypes.byref(out), ctypes.byref(err)) < 0:
            _raise(err)
        return Prctls(out.dumpable, out.securebits, out.thp_disable, out.memory_merge,
                      out.mce_kill, out.no_new_privs)

    def set_prctls(self, want: Prctls) -> None:
        """Give a template rebuilt from disk (its host's fork) its origin's prctl state,
        which its children then have."""
        err = _Err()
        if _load().dbxcr_template_set_prctls(self._h(), ctypes.byref(want._c()),
                                             ctypes.byref(err)) < 0:
            _raise(err)

    def set_creds(self, uids: Sequence[int], gids: Sequence[int], groups: Sequence[int],
                  caps: Sequence[int]) -> None:
        """Credentials every child of the template gets back last (native/creds.c): ids in
        the process's user namespace (real, effective, saved, filesystem), supplementary
        groups, capability sets (inheritable, permitted, effective, bounding, ambient).
        More than MAX_GROUPS groups: CRError (EINVAL)."""
        c = _Creds(1, (ctypes.c_uint32 * 4)(*uids), (ctypes.c_uint32 * 4)(*gids),
                   len(groups), (ctypes.c_uint32 * MAX_GROUPS)(*groups[:MAX_GROUPS]), *caps)
        err = _Err()
        if _load().dbxcr_template_set_creds(self._h(), ctypes.byref(c), ctypes.byref(err)) < 0:
            _raise(err)

    def set_itimers(self, itimers: Sequence[int]) -> None:
        """Give a template rebuilt from disk the interval timers its origin had."""
        err = _Err()
        if _load().dbxcr_template_set_itimers(self._h(), (ctypes.c_long * 12)(*itimers),
                                              ctypes.byref(err)) < 0:
            _raise(err)

    def ptimers(self) -> list[list[int]]:
        """The origin's POSIX timers at the checkpoint, made again with their ids in every
        child (fork drops them): per timer [id, clock, notify (SIGEV_*), signal,
        sigev_value, interval s, ns, time left s, ns, the tid of the thread it signals if
        not the main one else 0]. CRError if one cannot be made
        again (the capture refuses the process first: capture.posix_timers)."""
        n = 64   # more than a captured process may have (ptimers_supported)
        out = (ctypes.c_long * (n * PTIMER_FIELDS))()
        got = _load().dbxcr_template_ptimers(self._h(), out, n)
        if got < 0:
            raise CRError(_errno.EOPNOTSUPP, f"pid {self.origin}: a POSIX timer cannot be "
                          "made again")
        return [list(out[i * PTIMER_FIELDS:(i + 1) * PTIMER_FIELDS]) for i in range(got)]

    def set_ptimers(self, ptimers: Sequence[Sequence[int]]) -> None:
        """Give a template rebuilt from disk the POSIX timers its origin had (a dump
        written before stop 56 has no thread field: the main thread's, 0)."""
        flat = [v for t in ptimers for v in [*t, 0][:PTIMER_FIELDS]]
        err = _Err()
        if _load().dbxcr_template_set_ptimers(self._h(), (ctypes.c_long * max(len(flat), 1))(
                *flat), len(ptimers), ctypes.byref(err)) < 0:
            _raise(err)

    def own_group(self) -> None:
        """Move the template out of its process group into one of its own, so that the
        group's id (its leader's pid) is free once the group's live members are gone
        (native/fork_template.h). Its children join their group with spawn(pgid=...)."""
        err = _Err()
        if _load().dbxcr_template_own_group(self._h(), ctypes.byref(err)) < 0:
            _raise(err)
        self.own_group_done = True

    def shmdt(self, addr: int) -> None:
        """Detach the System V segment attached at addr in the template
        (native/fork_template.h): its children attach the one the restore makes."""
        err = _Err()
        if _load().dbxcr_template_shmdt(self._h(), addr, ctypes.byref(err)) < 0:
            _raise(err)

    def own_session(self) -> None:
        """Move the template out of its session (and group) into one of its own, so that
        a lone session leader's pid is free once the live leader is gone
        (native/fork_template.h). Its child leads a session again: spawn(pgid=NEW_SESSION)."""
        err = _Err()
        if _load().dbxcr_template_own_session(self._h(), ctypes.byref(err)) < 0:
            _raise(err)
        self.own_group_done = self.own_session_done = True

    def copy(self) -> "Template":
        """A second template of the same process, to spawn from on another thread at the
        same time (a fork lane).  It belongs to no thread until that thread calls adopt();
        release() works from any thread before that."""
        lib = _load()
        err = _Err()
        handle = lib.dbxcr_template_copy(self._h(), ctypes.byref(err))
        if not handle:
            _raise(err)
        cp = Template(handle, lib.dbxcr_template_pid(handle), self.origin)
        cp.owner_thread = 0
        cp.own_group_done = self.own_group_done   # a fork of it: in its group
        cp.own_session_done = self.own_session_done   # and session
        return cp

    def adopt(self) -> None:
        """Make the calling thread this copy's tracer (see copy)."""
        err = _Err()
        if _load().dbxcr_template_adopt(self._h(), ctypes.byref(err)) < 0:
            _raise(err)
        self.owner_thread = threading.get_native_id()

    def release(self) -> None:
        """Drop one holder; the last one SIGKILLs the template and reaps it.  Idempotent
        once released."""
        if self._handle is None:
            return
        self._refs -= 1
        if self._refs > 0:
            return
        lib = _load()
        handle, self._handle = self._handle, None
        err = _Err()
        if lib.dbxcr_release_template(handle, ctypes.byref(err)) < 0:
            _raise(err)

    def __enter__(self) -> "Template":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Template pid={self.pid} origin={self.origin} {state}>"


class Carrier:
    """A child of a template spawned ahead of a rollback (native/fork_template.c, carriers
    and keepers): stopped, our tracee, re-rooted. birth() clones the process itself out of
    it, sharing its address space; the carrier then stays as that process's *keeper*
    (kill the process first, then the keeper: the process's exit is then quick). kill()
    once, at the end. Every call on the thread that spawned it."""

    def __init__(self, handle: int, pid: int) -> None:
        self._handle: int | None = handle
        self.pid = pid
        self.child: int | None = None        # the process, once born
        self.owner_thread = threading.get_native_id()

    def _h(self) -> int:
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"carrier {self.pid} was killed")
        if threading.get_native_id() != self.owner_thread:
            raise CRError(_errno.EPERM, f"carrier {self.pid} is ptrace-held by thread "
                          f"{self.owner_thread}; called from {threading.get_native_id()}")
        return self._handle

    def birth(self, set_tid: Sequence[int] | None = None, pgid: int = 0) -> int:
        """The process, continuing from the checkpoint, with pid set_tid[0] in its pid
        namespace if given (CRError EEXIST while that pid is taken: retry), in process
        group `pgid` as for spawn (0: the carrier's). Its pid."""
        tids = list(set_tid or [])
        ctids = (ctypes.c_int * max(1, len(tids)))(*tids)
        err = _Err()
        pid = _load().dbxcr_carrier_birth(self._h(), ctids if tids else None, len(tids),
                                          pgid, ctypes.byref(err))
        if pid < 0:
            _raise(err)
        self.child = pid
        return pid

    def install_fds(self, fds: dict[int, int], cloexec: Collection[int]) -> None:
        """Before birth: our descriptor at each of the process's fd numbers (`fds`: its fd
        -> ours), close-on-exec for those in `cloexec`; its birth gets them. On failure
        the carrier is in no known state: kill it."""
        n = len(fds)
        arr = ctypes.c_int * max(1, n)
        err = _Err()
        if _load().dbxcr_carrier_install_fds(
                self._h(), arr(*fds.values()), arr(*fds.keys()),
                arr(*[int(fd in cloexec) for fd in fds]), n, ctypes.byref(err)) < 0:
            _raise(err)

    def keep(self) -> None:
        """After birth: drop the carrier's copies of the process's descriptors, keeping
        only its address space alive (a keeper). On failure the carrier is killed (the
        process runs on; its exit is just slower) and CRError raised."""
        err = _Err()
        if _load().dbxcr_carrier_keep(self._h(), ctypes.byref(err)) < 0:
            _raise(err)

    def kill(self) -> None:
        if self._handle is None:
            return
        handle = self._h()
        self._handle = None
        err = _Err()
        if _load().dbxcr_carrier_kill(handle, ctypes.byref(err)) < 0:
            _raise(err)

    @property
    def killed(self) -> bool:
        return self._handle is None

    def __repr__(self) -> str:
        state = "killed" if self._handle is None else (
            f"keeper of {self.child}" if self.child else "carrier")
        return f"<Carrier pid={self.pid} {state}>"


class Births:
    """A rollback's births as one native job for the ptrace thread (JobQueue): each
    carrier gives birth once, as Carrier.birth(set_tid, pgid) would, those taking a pid
    once the processes behind the pidfds `victims` have exited (or `timeout` passed:
    EEXIST then). Built on any thread; run on the carriers' own; `done_fd` (an eventfd)
    is written once every birth has its outcome (`outcomes()`)."""

    def __init__(self, jobs: Sequence[tuple[Carrier, int | None, int]],
                 victims: Sequence[int], timeout: float, done_fd: int) -> None:
        self._carriers = [c for c, _, _ in jobs]
        # A killed carrier fails as Carrier.birth would, without a trip. The others are the
        # caller's alone until done (a kill queued on the thread ahead of the job would
        # free one under it: the rollback that took them from the warm pool owns them).
        self._sent = [not c.killed for c in self._carriers]
        live = [j for j, sent in zip(jobs, self._sent) if sent]
        n = len(live)
        size = max(1, n)
        # Every array lives as long as this object: the job must outlive the wait.
        self._handles = (ctypes.c_void_p * size)(*[c._handle for c, _, _ in live])
        self._tids = (ctypes.c_int * size)(*[t or 0 for _, t, _ in live])
        self._pgids = (ctypes.c_int * size)(*[g for _, _, g in live])
        self._victims = (ctypes.c_int * max(1, len(victims)))(*victims)
        self._born = (ctypes.c_int * size)()
        self._errs = (_Err * size)()
        self.job = _Births(n, self._handles, self._tids, self._pgids, self._victims,
                           len(victims), max(0, int(timeout * 1000)), done_fd, self._born,
                           self._errs)

    def outcomes(self) -> list[int | CRError]:
        """Once done: each carrier's born pid (the carrier now a keeper-to-be, as after
        Carrier.birth), or the CRError its birth failed with."""
        out: list[int | CRError] = []
        i = 0
        for carrier, sent in zip(self._carriers, self._sent):
            if not sent:
                out.append(CRError(_errno.EINVAL, f"carrier {carrier.pid} was killed"))
                continue
            if self._born[i] >= 0:
                carrier.child = self._born[i]
                out.append(self._born[i])
            else:
                out.append(_error(self._errs[i]))
            i += 1
        return out


class JobQueue:
    """The ptrace thread's queue (native/ptrace_jobs.c): the thread waits in wait(), with
    the interpreter's lock released, running the Births posted to it; wait() returns when
    the next job is a Python one (posted as None). Posting is thread-safe; one FIFO."""

    def __init__(self) -> None:
        err = _Err()
        handle = _load().dbxcr_jobs_new(ctypes.byref(err))
        if not handle:
            _raise(err)
        self._handle: int | None = handle

    def _h(self) -> int:
        if self._handle is None:
            raise CRError(_errno.EINVAL, "job queue closed")
        return self._handle

    def post(self, births: Births | None) -> None:
        err = _Err()
        job = ctypes.byref(births.job) if births is not None else None
        if _load().dbxcr_jobs_post(self._h(), job, ctypes.byref(err)) < 0:
            _raise(err)

    def wait(self) -> None:
        err = _Err()
        if _load().dbxcr_jobs_wait(self._h(), ctypes.byref(err)) < 0:
            _raise(err)

    def close(self) -> None:
        """Free the queue (its thread has stopped waiting on it)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _load().dbxcr_jobs_free(handle)


CHAIN_MAX = 8   # ancestors in one Template.held_chain (native: DBXCR_CHAIN_MAX)


class Held:
    """A restored process held stopped before it runs (native/fork_template.c, held
    processes and adopted children): adopt() gives it its own children from their
    images, then release() lets it run (or kill()). One of the two, once, on the thread
    that spawned it."""

    def __init__(self, handle: int | None, pid: int) -> None:
        self._handle = handle
        self.pid = pid
        self.owner_thread = threading.get_native_id()

    def _take(self) -> int:
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"held process {self.pid} was released or killed")
        if threading.get_native_id() != self.owner_thread:
            raise CRError(_errno.EPERM, f"held process {self.pid} is ptrace-held by thread "
                          f"{self.owner_thread}; called from {threading.get_native_id()}")
        handle, self._handle = self._handle, None
        return handle

    def adopt(self, image_dir: str | os.PathLike, root_fd: int, template: Template,
              **kwargs) -> Held:
        """The image's process restored as this process's own child (pid set_tid[0]), its
        mapped files opened under root_fd (ours), re-rooted as template.spawn(**kwargs)
        would re-root a child of the image's template (the image's own, or one restored
        from it: its memory is where the pages are copied from), held in turn. Raises
        ImageCorrupt / CRError."""
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"held process {self.pid} was released or killed")
        lib = _load_images()
        ifd = os.open(os.fspath(image_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with template._opts(**kwargs) as opts:
                err, handle = _Err(), ctypes.c_void_p()
                pid = lib.dbxcr_held_adopt(self._handle, ifd, root_fd, template._handle,
                                           ctypes.byref(opts),
                                           ctypes.byref(handle), ctypes.byref(err))
        finally:
            os.close(ifd)
        if pid < 0:
            _raise_img(err)
        return Held(handle.value, pid)

    def set_foreground(self, fd: int, pgrp: int) -> None:
        """Before release(): make process group pgrp (in its pid namespace) the foreground
        one of its controlling terminal, held at fd (it leads the terminal's session)."""
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"held process {self.pid} was released or killed")
        err = _Err()
        if _load().dbxcr_held_foreground(self._handle, fd, pgrp, ctypes.byref(err)) < 0:
            _raise(err)

    def zombie(self, nspid: int, status: int, comm: str) -> None:
        """Before release(): its child `nspid` (in its pid namespace) named `comm` that had
        exited with wait status `status` and was not waited for yet, made again, exited (a
        zombie)."""
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"held process {self.pid} was released or killed")
        err = _Err()
        if _load().dbxcr_held_zombie(self._handle, nspid, status,
                                     comm.encode(errors="surrogateescape")[:15],
                                     ctypes.byref(err)) < 0:
            _raise(err)

    def set_prctls(self, want: Prctls) -> None:
        """Before release(): the prctl state of the process it restores (it is another
        process's fork: an adopted child, a chain's ancestor)."""
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"held process {self.pid} was released or killed")
        err = _Err()
        if _load().dbxcr_held_set_prctls(self._handle, ctypes.byref(want._c()),
                                         ctypes.byref(err)) < 0:
            _raise(err)

    def install_fd(self, src: int, target: int, cloexec: bool,
                   watched_by: Sequence[EpollWatch] = ()) -> None:
        """Before release(): our descriptor `src` at its fd `target`, and watched by its
        epoll instances (each EpollWatch's fd: the epoll instance's) with those events
        and data (native: dbxcr_held_install_fd)."""
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"held process {self.pid} was released or killed")
        adds = (_EpollWatch * max(1, len(watched_by)))(
            *[_EpollWatch(w.fd, w.events, w.data) for w in watched_by])
        err = _Err()
        if _load().dbxcr_held_install_fd(self._handle, src, target, int(cloexec), adds,
                                         len(watched_by), ctypes.byref(err)) < 0:
            _raise(err)

    def release(self) -> None:
        err = _Err()
        if _load().dbxcr_held_release(self._take(), ctypes.byref(err)) < 0:
            _raise(err)

    def kill(self) -> None:
        if self._handle is not None:
            _load().dbxcr_held_kill(self._take())

    def __repr__(self) -> str:
        return f"<Held pid={self.pid} {'held' if self._handle else 'done'}>"


def exclusive_bytes(pid: int, max_maps: int = 1) -> int:
    """Bytes of pid's resident pages that at most `max_maps` page tables map (pid's own
    and max_maps - 1 others'). Any thread; CRError if pid is gone."""
    out = ctypes.c_uint64()
    err = _Err()
    lib = _load_images()  # native/criu_incr.c, with the other page-level code
    if lib.dbxcr_exclusive_bytes(pid, max_maps, ctypes.byref(out), ctypes.byref(err)) < 0:
        _raise(err)
    return out.value


_SYS_KCMP = 312
_KCMP_FILE, _KCMP_VM, _KCMP_SYSVSEM, _KCMP_EPOLL_TFD = 0, 1, 6, 7


def same_address_space(a: int, b: int) -> bool:
    """Do processes a and b share one address space (kcmp KCMP_VM)? False if either is
    gone or has none (a zombie)."""
    return _libc_raw.syscall(_SYS_KCMP, a, b, _KCMP_VM, 0, 0) == 0


def same_semaphore_undo(a: int, b: int) -> bool:
    """Do processes a and b have one System V semaphore undo list (kcmp KCMP_SYSVSEM: the
    same, or none either)? False if either is gone."""
    return _libc_raw.syscall(_SYS_KCMP, a, b, _KCMP_SYSVSEM, 0, 0) == 0


def same_file(pid1: int, fd1: int, pid2: int, fd2: int) -> bool:
    """Do these descriptors share one open file description (kcmp KCMP_FILE)?"""
    return _libc_raw.syscall(_SYS_KCMP, pid1, pid2, _KCMP_FILE, fd1, ctypes.c_ulong(fd2)) == 0


def epoll_watches_file(pid: int, efd: int, tfd: int) -> bool:
    """Is the file pid's epoll instance at efd watches under fd number tfd the one pid
    holds at tfd (kcmp KCMP_EPOLL_TFD)? False once that fd was closed or reused."""
    slot = (ctypes.c_uint32 * 3)(efd, tfd, 0)       # struct kcmp_epoll_slot, toff 0
    return _libc_raw.syscall(_SYS_KCMP, pid, pid, _KCMP_EPOLL_TFD, tfd,
                             ctypes.byref(slot)) == 0


def make_template(pid: int) -> Template:
    """Fork pid into a stopped template; pid resumes unchanged.  Raises CRError naming the
    pid and reason for processes that cannot be templated (threads, traced, pid-ns init)."""
    lib = _load()
    err = _Err()
    handle = lib.dbxcr_make_template(pid, ctypes.byref(err))
    if not handle:
        _raise(err)
    return Template(handle, lib.dbxcr_template_pid(handle), lib.dbxcr_template_origin(handle))


def spawn(template: Template, **kwargs) -> int:
    return template.spawn(**kwargs)


def release_template(template: Template) -> None:
    template.release()


def _syscalls(call: Any, handle: int) -> list[tuple[int, list[int]]]:
    """(nr, six args) per thread, the main one first, from `call` (dbxcr_*_syscall) until
    it says past the last thread (-2) or not stopped (-3, the last item)."""
    out: list[tuple[int, list[int]]] = []
    args = (ctypes.c_long * 6)()
    while (nr := call(handle, len(out), args)) != -2:
        out.append((nr, list(args)))
        if nr == -3:
            break
    return out


# ---------- stopping a process tree at one instant ----------

STOP_KINDS = {0: "none", 1: "interrupt", 2: "signal", 3: "group-stop"}


class Stopped:
    """A process seized for a checkpoint (dbxcr_stop_*).  Every method must be called on
    the OS thread that called begin_stop (EPERM otherwise).

    .kind after wait(): "interrupt" (our stop), "signal" (a signal was being delivered:
    it is handed back on resume) or "group-stop" (job-control stopped: stays stopped)."""

    def __init__(self, handle: int, pid: int) -> None:
        self._handle: int | None = handle
        self.pid = pid
        self.owner_thread = threading.get_native_id()

    def _h(self) -> int:
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"pid {self.pid}: stop handle already finished")
        return self._handle

    def _info(self) -> _StopInfo:
        info = _StopInfo()
        _load().dbxcr_stop_get_info(self._h(), ctypes.byref(info))
        return info

    @property
    def kind(self) -> str:
        return "none" if self._handle is None else STOP_KINDS[self._info().kind]

    @property
    def signal(self) -> int:
        """The group-stop signal, or the signal that was being delivered, else 0."""
        return 0 if self._handle is None else self._info().signal

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the stop (None: forever) and record registers/mask; returns .kind.
        CRError ETIMEDOUT if still not stopped (wait again or abort), ESRCH if the process
        exited or was killed meanwhile."""
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        err = _Err()
        if _load().dbxcr_stop_wait(self._h(), ms, ctypes.byref(err)) < 0:
            _raise(err)
        return self.kind

    def syscalls(self) -> list[tuple[int, list[int]]]:
        """As Template.syscalls, from the registers saved at the stop: known before any
        template is made. Any thread may ask (nothing is traced for it)."""
        out = _syscalls(_load().dbxcr_stop_syscall, self._h())
        if out and out[-1][0] == -3:
            raise CRError(_errno.ESRCH, f"pid {self.pid}: not stopped (resumed or gone)")
        return out

    def hold(self) -> None:
        """Until resumed, the process (every thread) dies with its tracer
        (PTRACE_O_EXITKILL): held past its checkpoint's answer, it must not run on if the
        daemon does not."""
        err = _Err()
        if _load().dbxcr_stop_hold(self._h(), ctypes.byref(err)) < 0:
            _raise(err)

    def make_template(self) -> Template:
        """Fork the stopped process into a Template; the process stays stopped, unchanged."""
        return self._template_from(_load().dbxcr_template_stopped)

    def start_template(self) -> None:
        """make_template's first half: the process starts its fork and we return at once
        (a large process's fork runs on another CPU while we drive others). Then
        finish_template; resume/abort settle a fork never finished (no template)."""
        err = _Err()
        if _load().dbxcr_template_start(self._h(), ctypes.byref(err)) < 0:
            _raise(err)

    def finish_template(self) -> Template:
        """Wait for the fork start_template began and return the Template."""
        return self._template_from(_load().dbxcr_template_finish)

    def _template_from(self, call: Any) -> Template:
        lib = _load()
        err = _Err()
        handle = call(self._h(), ctypes.byref(err))
        if not handle:
            _raise(err)
        return Template(handle, lib.dbxcr_template_pid(handle),
                        lib.dbxcr_template_origin(handle))

    def resume(self) -> None:
        """Give the process back exactly as it was stopped and detach; frees the handle."""
        err = _Err()
        if _load().dbxcr_stop_resume(self._h(), ctypes.byref(err)) < 0:
            _raise(err)
        self.abort()

    def abort(self) -> None:
        """Best effort resume/detach in any state, then free.  Idempotent.  A process that
        has not stopped yet (cgroup still frozen) is detached later by sweep_stops()."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        _load().dbxcr_stop_abort(handle)

    def __enter__(self) -> "Stopped":
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def __repr__(self) -> str:
        return f"<Stopped pid={self.pid} {self.kind}>"


def begin_stop(pid: int) -> Stopped:
    """PTRACE_SEIZE + PTRACE_INTERRUPT pid without waiting (safe on a frozen cgroup).
    Raises CRError for traced (EBUSY), exiting (ESRCH) pids or ones with more than
    MAX_THREADS threads (ENOTSUP)."""
    lib = _load()
    handle, err = ctypes.c_void_p(), _Err()
    if lib.dbxcr_stop_begin(pid, ctypes.byref(handle), ctypes.byref(err)) < 0:
        _raise(err)
    return Stopped(handle.value, pid)


def sweep_stops(timeout: float = 0.0) -> int:
    """Detach aborted handles (of this thread) whose process has stopped since; waits up
    to timeout seconds.  Returns how many are still pending."""
    return _load().dbxcr_stop_sweep(int(timeout * 1000))


# ---------- /proc inventory ----------

@dataclass(frozen=True)
class ProcStatus:
    ppid: int
    pgid: int
    sid: int
    threads: int
    state: str          # R, S, D, T, t, Z, ...
    tracer_pid: int
    nspid: tuple[int, ...]  # outermost (ours) first, innermost last
    rss_kb: int = 0
    cap_eff: int = -1       # effective capabilities (CapEff); -1: unknown
    uid: int = 0            # real uid, as the host sees it
    tty_nr: int = 0         # its controlling terminal's device number (0: none)
    tpgid: int = -1         # that terminal's foreground process group (host pid)
    locked_kb: int = 0      # memory it locked (VmLck)
    seccomp_filters: int = 0  # seccomp filters it runs under (Seccomp_filters)


def proc_field(text: bytes, name: bytes) -> bytes | None:
    """The value of `name:` in a /proc text of "name: value" lines (None if absent)."""
    key = name + b":"
    if text.startswith(key):
        start = len(key)
    else:
        at = text.find(b"\n" + key)
        if at < 0:
            return None
        start = at + 1 + len(key)
    end = text.find(b"\n", start)
    return text[start:] if end < 0 else text[start:end]


def _required_field(text: bytes, name: bytes, path: str) -> bytes:
    value = proc_field(text, name)
    if value is None:
        raise OSError(_errno.EPROTO, f"{path} has no {name.decode()} field")
    return value


def proc_status(pid: int) -> ProcStatus:
    """Process tree and tracing facts from /proc/pid/stat and /proc/pid/status."""
    stat = kernfs.read(f"/proc/{pid}/stat")
    f = stat[stat.rindex(b")") + 2:].split()
    status = kernfs.read(f"/proc/{pid}/status")
    tracer = _required_field(status, b"TracerPid", f"/proc/{pid}/status")
    nspid = proc_field(status, b"NSpid")
    rss = proc_field(status, b"VmRSS")
    caps = proc_field(status, b"CapEff")
    uid = proc_field(status, b"Uid")
    locked = proc_field(status, b"VmLck")
    filters = proc_field(status, b"Seccomp_filters")
    return ProcStatus(ppid=int(f[1]), pgid=int(f[2]), sid=int(f[3]), threads=int(f[17]),
                      state=f[0].decode(), tracer_pid=int(tracer),
                      nspid=tuple(int(x) for x in nspid.split()) if nspid else (pid,),
                      rss_kb=int(rss.split()[0]) if rss else 0,
                      cap_eff=int(caps, 16) if caps else -1,
                      uid=int(uid.split()[0]) if uid else 0, tty_nr=int(f[4]),
                      tpgid=int(f[5]), locked_kb=int(locked.split()[0]) if locked else 0,
                      seccomp_filters=int(filters) if filters else 0)


def ids_in_namespace(pid: int, level: int) -> tuple[int, int, int] | None:
    """(pid, process group id, session id) of a living process as the pid namespace `level`
    deep below ours sees them (/proc/pid/status NSpid, NSpgid, NSsid); None if it is a
    zombie, has exited, or lives in no such namespace."""
    try:
        status = kernfs.read(f"/proc/{pid}/status")
    except OSError:
        return None
    state = proc_field(status, b"State")
    if state is None or state.split()[:1] == [b"Z"]:
        return None
    ids = [proc_field(status, k) for k in (b"NSpid", b"NSpgid", b"NSsid")]
    if any(v is None for v in ids):
        return None
    per = [v.split() for v in ids]  # type: ignore[union-attr]
    if any(len(v) <= level for v in per):
        return None
    return int(per[0][level]), int(per[1][level]), int(per[2][level])


@dataclass(frozen=True)
class SockInfo:
    family: str         # "unix", "inet", "inet6", "netlink", "packet", "unknown"
    type: str           # unix: "stream"/"dgram"/"seqpacket"; inet: "tcp"/"udp"; else ""
    state: str          # "listen", "connected", "unconnected", or a TCP state name
    local: str = ""     # unix path ("@name" abstract) or "addr:port"
    remote: str = ""    # "addr:port" for inet; "" for unix (peer needs sock_diag)
    filtered: bool = False   # a unix socket or TCP connection with a socket filter

    @property
    def listening(self) -> bool:
        return self.state == "listen"


@dataclass(frozen=True)
class FdInfo:
    fd: int
    kind: str           # file, dir, pipe, fifo, socket, chr, blk, epoll, eventfd, timerfd,
    #                     signalfd, inotify, anon, other
    target: str         # readlink of /proc/pid/fd/N (" (deleted)" removed if deleted)
    deleted: bool = False
    flags: int = 0      # open(2) flags from fdinfo
    pos: int = 0
    inode: int = 0      # pipe / socket / file inode
    rdev: tuple[int, int] | None = None   # (major, minor) for chr / blk
    socket: SockInfo | None = None
    # an inotify instance's /proc fdinfo as read for the inventory (its watches: the
    # kernel formats a file handle per watch, ~5 us each, so it is read once)
    fdinfo: bytes = field(default=b"", compare=False, repr=False)
    # file locks taken through this descriptor, as its fdinfo lists them ("FLOCK WRITE
    # 0-EOF", "POSIX READ 5-14", "OFDLCK ...", "LEASE ..."): flock and OFD locks of its
    # open file description, POSIX locks the process set through it
    locks: tuple[str, ...] = ()
    # the mount it is on (fdinfo's mnt_id: an id of /proc/PID/mountinfo, unless the file
    # is on a mount no table shows: a POSIX message queue's, a memfd's, one detached)
    mnt_id: int = 0

    @property
    def path(self) -> str:
        """Alias of target."""
        return self.target

    def describe(self) -> str:
        """One line for error messages, e.g. "inet tcp listen 127.0.0.1:8000"."""
        if self.socket is not None:
            k = self.socket
            peer = k.remote if k.remote not in ("", "0.0.0.0:0", "[::]:0") else ""
            ends = " ".join(x for x in (k.local, peer and f"-> {peer}") if x)
            return " ".join(x for x in (k.family, k.type, k.state, ends) if x)
        if self.rdev is not None:
            return f"{self.target} ({self.kind} {self.rdev[0]}:{self.rdev[1]})"
        return f"{self.target}{' (deleted)' if self.deleted else ''}"


TCP_STATES = {1: "established", 2: "syn-sent", 3: "syn-recv", 4: "fin-wait1",
              5: "fin-wait2", 6: "time-wait", 7: "close", 8: "close-wait", 9: "last-ack",
              10: "listen", 11: "closing"}
_UNIX_TYPES = {1: "stream", 2: "dgram", 5: "seqpacket"}


def _inet_name(family: int, name: tuple) -> str:
    return f"[{name[0]}]:{name[1]}" if family == socket.AF_INET6 else f"{name[0]}:{name[1]}"


def _unix_name(name: str | bytes) -> str:
    if isinstance(name, bytes):  # abstract (or unnamed: empty)
        return "@" + name[1:].decode(errors="replace") if name else ""
    return name


_TCP_INFO_STATE = 0   # struct tcp_info starts with u8 tcpi_state


def _sock_info(pid: int, fd: int) -> SockInfo:
    """What pid's socket at fd is, from our own copy of it (pidfd_getfd): family, type,
    state and addresses. Not from /proc/PID/net/tcp*: reading those walks the host's whole
    TCP hash table, ~5 ms each here, for every checkpoint of a process with a socket."""
    try:
        s = socket.socket(fileno=copy_fd(pid, fd))
    except OSError:
        return SockInfo("unknown", "", "")
    with s:
        try:
            return _describe_socket(s)
        except OSError:
            return SockInfo("unknown", "", "")


def _describe_socket(s: socket.socket) -> SockInfo:
    fam = s.family
    try:
        peer: Any = s.getpeername()
    except OSError:
        peer = None
    if fam == socket.AF_UNIX:
        typ = _UNIX_TYPES.get(int(s.type), str(int(s.type)))
        state = ("listen" if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) else
                 "connected" if peer is not None else "unconnected")
        return SockInfo("unix", typ, state, _unix_name(s.getsockname()),
                        filtered=_filtered(s))
    if fam in (socket.AF_INET, socket.AF_INET6):
        name = "inet" if fam == socket.AF_INET else "inet6"
        local = _inet_name(fam, s.getsockname())
        remote = _inet_name(fam, peer) if peer is not None else \
            ("0.0.0.0:0" if fam == socket.AF_INET else "[::]:0")
        if s.type == socket.SOCK_STREAM and s.proto in (0, socket.IPPROTO_TCP):
            st = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[_TCP_INFO_STATE]
            state = "listen" if st == 10 else "connected" if st == 1 else TCP_STATES.get(
                st, str(st))
            return SockInfo(name, "tcp", state, local, remote,
                            filtered=state != "listen" and _filtered(s))
        if s.type == socket.SOCK_DGRAM and s.proto in (0, socket.IPPROTO_UDP):
            return SockInfo(name, "udp", "connected" if peer is not None else "unconnected",
                            local, remote)
        return SockInfo(name, "", "", local, remote)
    if fam == socket.AF_NETLINK:
        return SockInfo("netlink", "", "")
    if fam == getattr(socket, "AF_PACKET", 17):
        return SockInfo("packet", "", "")
    return SockInfo("unknown", "", "")


def _filtered(s: socket.socket) -> bool:
    """Whether s has a socket filter (SO_GET_FILTER with no room: its length; EACCES for
    an eBPF one). Made-again sockets' filters are read in full (sockopts.socket_filter)."""
    n = ctypes.c_uint(0)
    if _libc_raw.getsockopt(s.fileno(), socket.SOL_SOCKET, 26, None, ctypes.byref(n)) < 0:
        return ctypes.get_errno() == _errno.EACCES
    return n.value > 0


_SYS_PIDFD_GETFD = 438
_libc_raw = ctypes.CDLL(None, use_errno=True)


def copy_fd(pid: int, fd: int) -> int:
    """Our own duplicate of another process's descriptor (pidfd_getfd): same open file
    description. The caller closes it."""
    pidfd = os.pidfd_open(pid)
    try:
        r = _libc_raw.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    finally:
        os.close(pidfd)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pid {pid}: pidfd_getfd {fd}: {os.strerror(e)}")
    return int(r)


@contextlib.contextmanager
def _netns_of(pid: int) -> Iterator[int]:
    ns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield ns
    finally:
        os.close(ns)


def netns_socket(pid: int, family: int, type: int, proto: int = 0) -> socket.socket:
    """A socket in pid's network namespace (created by a short-lived thread of ours that
    joins it: see dbxcr_netns_socket)."""
    err = _Err()
    with _netns_of(pid) as ns:
        fd = _load().dbxcr_netns_socket(ns, family, type, proto, ctypes.byref(err))
    if fd < 0:
        _raise(err)
    return socket.socket(fileno=fd)


def netns_socketpair(pid: int, type: int) -> tuple[socket.socket, socket.socket]:
    """A unix socket pair made in pid's network namespace (dbxcr_netns_socketpair)."""
    err = _Err()
    sv = (ctypes.c_int * 2)()
    with _netns_of(pid) as ns:
        rc = _load().dbxcr_netns_socketpair(ns, socket.AF_UNIX, type, sv, ctypes.byref(err))
    if rc < 0:
        _raise(err)
    return socket.socket(fileno=sv[0]), socket.socket(fileno=sv[1])


def root_bind(root_fd: int, sock: socket.socket, path: str) -> None:
    """Bind our unix socket to the absolute `path` of the tree at root_fd, resolved there
    only, so that its name (getsockname, sock_diag) is `path` (dbxcr_root_bind)."""
    err = _Err()
    if _load().dbxcr_root_bind(root_fd, sock.fileno(), os.fsencode(path),
                               ctypes.byref(err)) < 0:
        _raise(err)


def root_connect(root_fd: int, sock: socket.socket, path: str) -> None:
    """Connect our unix socket to the absolute `path` of the tree at root_fd, resolved
    there only (a symlink there cannot lead out of it: dbxcr_root_connect)."""
    err = _Err()
    if _load().dbxcr_root_connect(root_fd, sock.fileno(), os.fsencode(path),
                                  ctypes.byref(err)) < 0:
        _raise(err)


def mntns_open(mntns_fd: int, path: str, flags: int, mode: int = 0o600) -> int:
    """`path` opened as the mount namespace `mntns_fd` sees it (a generation's /dev/shm),
    no symlink followed (dbxcr_mntns_open): our fd, close-on-exec."""
    err = _Err()
    fd = _load().dbxcr_mntns_open(mntns_fd, os.fsencode(path), flags, mode, ctypes.byref(err))
    if fd < 0:
        _raise(err)
    return fd


@dataclass(frozen=True)
class IpcObjects:
    """The System V IPC objects and POSIX message queues of an IPC namespace, by kind."""
    sem_sets: int
    msg_queues: int
    shm_segments: int
    posix_queues: int = 0
    posix_names: str = ""   # e.g. "/jobs, /results" (cut short with "...")


_ipcns_objects: Any = None   # dbxcr_ipcns_objects, called with the GIL held (ipc_objects)


def mqueue_dir(ipcns_fd: int) -> int:
    """A directory fd on the root of the IPC namespace's mqueue file system (a detached
    mount it keeps): ipc_objects' `mq_dir`, kept per sandbox so that its calls make no
    mount (native/ipcns.c). Ours to close."""
    err = _Err()
    fd = _load().dbxcr_ipcns_mqueue_dir(ipcns_fd, ctypes.byref(err))
    if fd < 0:
        _raise(err)
    return fd


def ipc_objects(ipcns_fd: int, mq_dir: int, clear: bool = False,
                keep_shm: bool = False) -> IpcObjects:
    """The System V IPC objects and POSIX message queues of the IPC namespace `ipcns_fd`
    (native/ipcns.c), the queues listed in `mq_dir` (mqueue_dir's); with `clear`, removed
    first (what is left), but for the shared memory segments with `keep_shm`. Called with
    the GIL held (ctypes.PyDLL): the call takes ~40 us here warm (a thread made to join
    the namespace; the listing ~15 of them), while taking the GIL back after a releasing
    call waits for the daemon's other threads (0.1-0.2 ms measured in the daemon)."""
    global _ipcns_objects
    if _ipcns_objects is None:
        _load()   # the library exists
        fn = ctypes.PyDLL(str(library_path())).dbxcr_ipcns_objects
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_IpcObjects),
                       ctypes.POINTER(_Err)]
        fn.restype = ctypes.c_int
        _ipcns_objects = fn
    out, err = _IpcObjects(), _Err()
    mode = (2 if keep_shm else 1) if clear else 0   # 2: DBXCR_IPC_CLEAR_BUT_SHM
    if _ipcns_objects(ipcns_fd, mode, mq_dir, ctypes.byref(out),
                      ctypes.byref(err)) < 0:
        _raise(err)
    names = out.posix_names.decode(errors="replace")
    if not names.endswith("..."):   # in the directory's order, unless cut short
        names = ", ".join(sorted(names.split(", ")))
    return IpcObjects(out.sem_sets, out.msg_queues, out.shm_segments,
                      out.posix_queues, names)


@dataclass
class ShmSegment:
    """A System V shared memory segment of an IPC namespace (native/ipcns.c). `fd`: from
    shm_segments, a read-only descriptor of its memory (the caller's to close); for
    make_shm_segments, its content (-1: zeros)."""
    id: int
    key: int
    mode: int       # shm_perm.mode: permission bits, SHM_DEST, SHM_LOCKED
    uid: int
    gid: int
    size: int
    nattch: int = 0
    fd: int = -1


SHM_SEGMENTS_MAX = 256   # captured per namespace (the kernel's default limit is 4096)


def shm_segments(ipcns_fd: int) -> list[ShmSegment]:
    """The System V shared memory segments of the IPC namespace `ipcns_fd` (a pidfd of a
    process in it), each with a descriptor of its memory."""
    out = (_ShmSegment * SHM_SEGMENTS_MAX)()
    n, err = ctypes.c_size_t(), _Err()
    if _load().dbxcr_ipcns_shm_list(ipcns_fd, out, SHM_SEGMENTS_MAX, ctypes.byref(n),
                                    ctypes.byref(err)) < 0:
        _raise(err)
    return [ShmSegment(s.id, s.key, s.mode, s.uid, s.gid, s.size, s.nattch, s.fd)
            for s in out[:n.value]]


def _shm_array(segments: Sequence[ShmSegment]) -> Any:
    return (_ShmSegment * max(1, len(segments)))(
        *[_ShmSegment(s.id, s.key, s.mode, s.uid, s.gid, 0, s.size, s.fd) for s in segments])


def make_shm_segments(ipcns_fd: int, segments: Sequence[ShmSegment]) -> list[int]:
    """Make the IPC namespace's segments exactly `segments` (any other removed), each with
    its id, owner, mode and content: the ids of those found there removed (IPC_RMID) but
    still attached, which keep their id but not their key."""
    arr = _shm_array(segments)
    err = _Err()
    if _load().dbxcr_ipcns_shm_make(ipcns_fd, arr, len(segments), ctypes.byref(err)) < 0:
        _raise(err)
    return [s.id for s in arr[:len(segments)] if s.removed]


def shm_segment_modes(ipcns_fd: int, segments: Sequence[ShmSegment]) -> None:
    """Give the segments made by make_shm_segments (open to all until then) their modes."""
    arr = _shm_array(segments)
    err = _Err()
    if _load().dbxcr_ipcns_shm_modes(ipcns_fd, arr, len(segments), ctypes.byref(err)) < 0:
        _raise(err)


class _MessageCopy:
    """A queue's copy of its messages in a memfd (`fd`): `count` records of a 16-byte head
    and the message, `bytes` of messages in all."""
    fd: int
    count: int
    bytes: int

    @property
    def saved(self) -> int | None:
        """The copy (as other copies of a capture are named: dumps.py)."""
        return self.fd if self.fd >= 0 else None

    @property
    def size(self) -> int:
        """The copy's bytes: a 16-byte head per message, and the messages."""
        return 16 * self.count + self.bytes


@dataclass
class MsgQueue(_MessageCopy):
    """A System V message queue of an IPC namespace (native/ipcns.c). `fd`: its messages
    in order, each an 8-byte type, an 8-byte length and its bytes (msg_queues: a memfd,
    the caller's to close; make_msg_queues: -1 for none)."""
    id: int
    key: int
    mode: int       # msg_perm.mode: permission bits
    uid: int
    gid: int
    qbytes: int     # its size limit
    count: int = 0  # messages (msg_queues)
    bytes: int = 0  # their bytes
    fd: int = -1


MSG_QUEUES_MAX = 256   # captured per namespace (the kernel's default limit is 32000)


def msg_queues(ipcns_fd: int) -> list[MsgQueue]:
    """The System V message queues of the IPC namespace `ipcns_fd` (a pidfd of a process
    in it), each with a copy of its messages (left queued)."""
    return _ipc_list("dbxcr_ipcns_msg_list", _MsgQueue, MsgQueue, MSG_QUEUES_MAX, ipcns_fd)


def make_msg_queues(ipcns_fd: int, queues: Sequence[MsgQueue]) -> None:
    """Make the IPC namespace's message queues exactly `queues` (every other removed),
    each with its id, key, owner, mode, limit and messages."""
    _ipc_make("dbxcr_ipcns_msg_make", _MsgQueue, ipcns_fd, queues)


def _ipc_list(fn: str, struct: Any, cls: Any, most: int, ipcns_fd: int) -> list[Any]:
    """What a dbxcr_ipcns_*_list call fills (at most `most`), as `cls` objects (a
    dataclass whose fields are the struct's)."""
    out = (struct * most)()
    n, err = ctypes.c_size_t(), _Err()
    if getattr(_load(), fn)(ipcns_fd, out, most, ctypes.byref(n), ctypes.byref(err)) < 0:
        _raise(err)
    return [_from_struct(cls, c) for c in out[:n.value]]


def _from_struct(cls: Any, c: Any) -> Any:
    """A `cls` dataclass from a struct with its fields."""
    return cls(**{f.name: getattr(c, f.name) for f in fields(cls)})


def _c_value(v: Any) -> Any:
    """A field's value as its struct takes it (a name: bytes)."""
    return v.encode(errors="surrogateescape") if isinstance(v, str) else v


def _ipc_make(fn: str, struct: Any, ipcns_fd: int, objects: Sequence[Any]) -> None:
    """A dbxcr_ipcns_*_make call given `objects` (with the struct's fields)."""
    arr = (struct * max(1, len(objects)))(
        *[struct(*(_c_value(getattr(x, name)) for name, _ in struct._fields_))
          for x in objects])
    err = _Err()
    if getattr(_load(), fn)(ipcns_fd, arr, len(objects), ctypes.byref(err)) < 0:
        _raise(err)


@dataclass
class SemSet:
    """A System V semaphore set of an IPC namespace (native/ipcns.c). `fd`: its values,
    unsigned shorts in order (sem_sets: a memfd, the caller's to close; make_sem_sets: -1
    for zeros)."""
    id: int
    key: int
    mode: int       # sem_perm.mode: permission bits
    uid: int
    gid: int
    nsems: int
    fd: int = -1

    @property
    def saved(self) -> int | None:
        """The copy of its values (as other copies of a capture are named: dumps.py)."""
        return self.fd if self.fd >= 0 else None

    @property
    def size(self) -> int:
        return 2 * self.nsems


SEM_SETS_MAX = 256   # captured per namespace (the kernel's default limit is 32000)


def sem_sets(ipcns_fd: int) -> list[SemSet]:
    """The System V semaphore sets of the IPC namespace `ipcns_fd` (a pidfd of a process in
    it), each with a copy of its values."""
    return _ipc_list("dbxcr_ipcns_sem_list", _SemSet, SemSet, SEM_SETS_MAX, ipcns_fd)


def make_sem_sets(ipcns_fd: int, sets: Sequence[SemSet]) -> None:
    """Make the IPC namespace's semaphore sets exactly `sets` (every other removed), each
    with its id, key, size, owner, mode and values."""
    _ipc_make("dbxcr_ipcns_sem_make", _SemSet, ipcns_fd, sets)


@dataclass
class PosixQueue(_MessageCopy):
    """A POSIX message queue of an IPC namespace (native/ipcns.c): `name` without its
    leading "/". `fd`: its messages in the order a receiver gets them, each an 8-byte
    priority, an 8-byte length and its bytes (posix_queues: a memfd, the caller's to close;
    make_posix_queues: -1 for none)."""
    name: str
    mode: int       # permission bits
    uid: int
    gid: int
    maxmsg: int     # mq_attr: its sizes
    msgsize: int
    count: int = 0  # messages (posix_queues)
    bytes: int = 0  # their bytes
    notify_pid: int = 0   # registered for its notification (mq_notify; host pid): not read
    fd: int = -1

    def __post_init__(self) -> None:
        if isinstance(self.name, bytes):   # as the struct has it
            self.name = self.name.decode(errors="surrogateescape")


POSIX_QUEUES_MAX = 256   # captured per namespace (the kernel's default limit is 256)


def posix_queues(ipcns_fd: int) -> list[PosixQueue]:
    """The POSIX message queues of the IPC namespace `ipcns_fd` (a pidfd of a process in
    it), each with a copy of its messages (taken and sent back: every process of the
    namespace must be stopped), unless a process is registered for its notification."""
    return _ipc_list("dbxcr_ipcns_mq_list", _PosixQueue, PosixQueue, POSIX_QUEUES_MAX,
                     ipcns_fd)


def make_posix_queues(ipcns_fd: int, queues: Sequence[PosixQueue]) -> None:
    """Make the IPC namespace's POSIX message queues exactly `queues` (every other
    unlinked), each with its name, sizes, owner, mode and messages."""
    _ipc_make("dbxcr_ipcns_mq_make", _PosixQueue, ipcns_fd, queues)


def open_posix_queues(ipcns_fd: int, queues: Sequence[tuple[str, int]]) -> list[int]:
    """Descriptors (close-on-exec, the caller's) of the IPC namespace `ipcns_fd`'s queues,
    each (name, flags: access mode and O_NONBLOCK), opened by one thread in the namespace."""
    n = len(queues)
    names = (ctypes.c_char_p * max(1, n))(*[_c_value(name) for name, _ in queues])
    flags = (ctypes.c_int * max(1, n))(*[f for _, f in queues])
    fds, err = (ctypes.c_int * max(1, n))(), _Err()
    if _load().dbxcr_ipcns_mq_open(ipcns_fd, names, flags, fds, n, ctypes.byref(err)) < 0:
        _raise(err)
    return list(fds[:n])


def unlink_posix_queues(ipcns_fd: int, names: Sequence[str]) -> None:
    """Unlink the IPC namespace's queues `names` (one gone already is no error)."""
    arr = (ctypes.c_char_p * max(1, len(names)))(*[_c_value(n) for n in names])
    err = _Err()
    if _load().dbxcr_ipcns_mq_unlink(ipcns_fd, arr, len(names), ctypes.byref(err)) < 0:
        _raise(err)


def capture_posix_queue(fd: int, name: str) -> PosixQueue:
    """The queue open at our descriptor `fd` (read-write), as posix_queues lists one, to
    be made again as /`name`: its messages taken and sent back."""
    out = _PosixQueue(_c_value(name))
    err = _Err()
    if _load().dbxcr_mq_capture_fd(fd, ctypes.byref(out), ctypes.byref(err)) < 0:
        _raise(err)
    return _from_struct(PosixQueue, out)


def fds(pid: int) -> list[FdInfo]:
    """Inventory of pid's open descriptors (a descriptor closed meanwhile is skipped)."""
    out = []
    for entry in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        fd = int(entry)
        link, where = f"/proc/{pid}/fd/{entry}", f"/proc/{pid}/fdinfo/{entry}"
        try:
            target = os.readlink(link)
            st = os.stat(link)
            info = kernfs.read(where)
        except FileNotFoundError:
            continue
        flags = int(_required_field(info, b"flags", where), 8)
        pos = int(_required_field(info, b"pos", where))
        mnt_id = int(_required_field(info, b"mnt_id", where))
        mode, deleted, rdev, sock = st.st_mode, False, None, None
        if target.startswith("pipe:["):
            kind = "pipe"
        elif target.startswith("socket:["):
            kind = "socket"
            sock = _sock_info(pid, fd)
        elif target == "anon_inode:[eventpoll]":
            kind = "epoll"
        elif target == "anon_inode:[eventfd]":
            kind = "eventfd"
        elif target == "anon_inode:[timerfd]":
            kind = "timerfd"
        elif target == "anon_inode:[signalfd]":
            kind = "signalfd"
        elif target == "anon_inode:inotify":
            kind = "inotify"
        elif target == "anon_inode:[pidfd]" or target.startswith("pidfd:"):
            kind = "pidfd"
        elif target.startswith("anon_inode:"):
            kind = "anon"
        elif _stat.S_ISREG(mode):
            kind = "file"
            # Unlinked: no name left, or the name it was opened by is gone (a hard link
            # may remain elsewhere; the kernel's readlink says " (deleted)").
            deleted = st.st_nlink == 0 or target.endswith(" (deleted)")
        elif _stat.S_ISDIR(mode):
            kind = "dir"
        elif _stat.S_ISFIFO(mode):
            kind = "fifo"
        elif _stat.S_ISCHR(mode) or _stat.S_ISBLK(mode):
            kind = "chr" if _stat.S_ISCHR(mode) else "blk"
            rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        else:
            kind = "other"
        if target.endswith(" (deleted)") and (deleted or kind == "anon"):
            deleted = True
            target = target[:-len(" (deleted)")]
        out.append(FdInfo(fd, kind, target, deleted, flags, pos, st.st_ino, rdev, sock,
                          fdinfo=info if kind in ("inotify", "pidfd") else b"",
                          locks=_locks(info),
                          mnt_id=mnt_id))
    return out


def _locks(fdinfo: bytes) -> tuple[str, ...]:
    """The "lock:" lines of an fdinfo, e.g. b"lock:\t1: POSIX  ADVISORY  WRITE 42
    fe:00:123 5 14" -> "POSIX WRITE 5-14" (kind, type, first and last byte)."""
    if b"lock:" not in fdinfo:
        return ()
    out = []
    for line in fdinfo.splitlines():
        if line.startswith(b"lock:"):
            f = line.split()
            # lock: N: KIND ADVISORY|MANDATORY TYPE PID DEV:INODE START END
            out.append(f"{f[2].decode()} {f[4].decode()} {f[-2].decode()}-{f[-1].decode()}"
                       if len(f) >= 9 else line[5:].strip().decode(errors="replace"))
    return tuple(out)


# ---------- images on disk (native/criu_incr.c, format in native/IMAGE_FORMAT.md) ----------
#
# Durable process state, for evicting templates and surviving a daemon restart.
#
#   stats = dump(tpl, "/state/img/ck7/p42", parent="/state/img/ck6/p42")  # delta vs ck6
#   verify_image("/state/img/ck7/p42")                 # optional deep check, any thread
#   tpl2 = restore_template(host_pid, "/state/img/ck7/p42", root_dir="/path/to/ck7/rootfs")
#   child = tpl2.spawn(fds=..., files=..., cwd=..., set_tid=[pid])  # exactly as before
#
# Threads: dump() takes a Template, so it must run on the thread that owns the template
#   (the ptrace worker), like every Template call.  restore_template() returns a Template
#   owned by the calling thread: call it on the ptrace worker too.  verify_image() touches
#   no process and may run on any thread (it reads and hashes the whole chain: I/O bound).
# Template state: any held (not released) Template, from make_template, Stopped.make_template
#   or restore_template; it is parked and stays usable (spawn/dump again) after the dump.
#   The live process is not involved at all: dumping never stops or slows it.
# Image directory (created atomically: written under a temporary sibling name, renamed;
#   fsync=True also fsyncs files and directories): core.img (registers, xstate, signal
#   mask/handlers/pending, mm fields, auxv, rseq, ids, parent link), mm.img (VMAs),
#   pagemap.img (per-page index with 128-bit content hashes), pages.img (raw pages).  Every
#   metadata file has a header with a checksum and the image's random id; pages are checked
#   against their hashes when read.  Damage raises ImageCorrupt naming the file.
# Chains: with parent=, only pages whose content differs from the parent image's page at
#   the same address are written; unchanged pages are references to the ancestor image that
#   holds the bytes.  The parent is recorded as a path relative to the new image directory
#   (so a whole tree of images can be moved together) plus its image id.  The chain is
#   bounded: when the parent's depth + 1 reaches max_chain (default 8) a full image is
#   written instead (stats.depth == 0).  An image of depth d needs its d nearest ancestors
#   (parent, grandparent, ...) intact and in place for as long as it exists; an image of
#   depth 0 needs nothing else.  So delete an image only when no image within max_chain - 1
#   generations below it refers to it (image_depends_on() lists what one needs).
# Restore: the new process is forked from host_pid (injected clone; pick the sandbox's init
#   or any single-threaded process in the target namespaces), so it lives in host's pid,
#   mount, net namespaces and cgroup with host's credentials changed to the dumped uid/gid;
#   mapped files are opened under root_dir (RESOLVE_IN_ROOT) and must have the size and
#   mtime they had at dump time.  Its children (spawn) are born as host's children.  The
#   restored template holds no file descriptors: pass stdio and files to spawn as usual.
#   Same machine type and kernel only (the vdso must be identical; checked).


class ImageCorrupt(CRError):
    """An image (or an ancestor it depends on) is damaged, truncated, mismatched or missing."""


@dataclass(frozen=True)
class DumpStats:
    pages_total: int     # candidate pages examined (present private memory)
    pages_written: int   # stored in this image's pages.img
    pages_parent: int    # unchanged: referenced in an ancestor image
    pages_zero: int      # all-zero: no data stored
    bytes_written: int   # all files of this image
    vmas: int
    depth: int           # 0: full image
    ms: float


class _DumpOpts(ctypes.Structure):
    _fields_ = [("parent_path", ctypes.c_char_p), ("parent_ref", ctypes.c_char_p),
                ("max_chain", ctypes.c_int), ("fsync", ctypes.c_int),
                ("strip_prefix", ctypes.c_char_p), ("seccomp_ok", ctypes.c_int),
                ("live", ctypes.c_int), ("files_as_of_ns", ctypes.c_longlong)]


class _ImageInfo(ctypes.Structure):
    _fields_ = [("depth", ctypes.c_int), ("origin_pid", ctypes.c_int),
                ("parent_ref", ctypes.c_char * 4096), ("max_tid", ctypes.c_int)]


class _DumpStats(ctypes.Structure):
    _fields_ = [("pages_total", ctypes.c_uint64), ("pages_written", ctypes.c_uint64),
                ("pages_parent", ctypes.c_uint64), ("pages_zero", ctypes.c_uint64),
                ("bytes_written", ctypes.c_uint64), ("vmas", ctypes.c_uint64),
                ("depth", ctypes.c_int), ("ms", ctypes.c_double)]


_img_bound = False


def _load_images() -> ctypes.CDLL:
    global _img_bound
    lib = _load()
    if not _img_bound:
        if not hasattr(lib, "dbxcr_dump_begin"):
            raise CRError(_errno.ENOSYS, f"{library_path()} was built without criu_incr.c "
                          "(run `make native`)")
        err = ctypes.POINTER(_Err)
        lib.dbxcr_dump_begin.argtypes = [ctypes.c_void_p, ctypes.c_char_p,
                                         ctypes.POINTER(_DumpOpts),
                                         ctypes.POINTER(ctypes.c_void_p), err]
        lib.dbxcr_dump_begin.restype = ctypes.c_int
        lib.dbxcr_dump_finish.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DumpStats), err]
        lib.dbxcr_dump_finish.restype = ctypes.c_int
        lib.dbxcr_dump_abort.argtypes = [ctypes.c_void_p]
        lib.dbxcr_dump_abort.restype = None
        lib.dbxcr_verify_image.argtypes = [ctypes.c_int, err]
        lib.dbxcr_verify_image.restype = ctypes.c_int
        lib.dbxcr_restore_template.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, err]
        lib.dbxcr_restore_template.restype = ctypes.c_void_p
        lib.dbxcr_restore_template_from.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                    ctypes.c_void_p, err]
        lib.dbxcr_restore_template_from.restype = ctypes.c_void_p
        lib.dbxcr_held_adopt.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_void_p, ctypes.POINTER(_SpawnOpts),
                                         ctypes.POINTER(ctypes.c_void_p), err]
        lib.dbxcr_held_adopt.restype = ctypes.c_int
        lib.dbxcr_held_chain.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.POINTER(_SpawnOpts),
                                         ctypes.POINTER(ctypes.c_int),
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                         ctypes.c_int, ctypes.POINTER(_SpawnOpts),
                                         ctypes.POINTER(ctypes.c_void_p), err]
        lib.dbxcr_held_chain.restype = ctypes.c_int
        lib.dbxcr_image_info.argtypes = [ctypes.c_int, ctypes.POINTER(_ImageInfo), err]
        lib.dbxcr_image_info.restype = ctypes.c_int
        lib.dbxcr_exclusive_bytes.argtypes = [ctypes.c_int, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_uint64), err]
        lib.dbxcr_exclusive_bytes.restype = ctypes.c_int
        _img_bound = True
    return lib


def _raise_img(err: _Err) -> None:
    code = err.code or _errno.EIO
    msg = err.msg.decode(errors="replace") or os.strerror(code)
    if code == _errno.EBADMSG:
        raise ImageCorrupt(code, msg)
    raise CRError(code, msg)


def _dump_opts(path: str, parent: str | os.PathLike | None, max_chain: int, fsync: bool,
               strip_prefix: str | None, seccomp_ok: bool, live: bool = False,
               files_as_of_ns: int = 0) -> _DumpOpts:
    ppath = pref = None
    if parent is not None:
        parent_abs = os.path.abspath(os.fspath(parent))
        ppath = os.fsencode(parent_abs)
        pref = os.fsencode(os.path.relpath(parent_abs, path))
    return _DumpOpts(ppath, pref, max_chain, int(fsync),
                     os.fsencode(strip_prefix) if strip_prefix else None, int(seccomp_ok),
                     int(live), files_as_of_ns)


def _stats(st: _DumpStats) -> DumpStats:
    return DumpStats(st.pages_total, st.pages_written, st.pages_parent, st.pages_zero,
                     st.bytes_written, st.vmas, st.depth, st.ms)


def dump(template: Template, path: str | os.PathLike, parent: str | os.PathLike | None = None,
         *, max_chain: int = 8, fsync: bool = False,
         strip_prefix: str | None = None, seccomp_ok: bool = False,
         live: bool = False, files_as_of_ns: int = 0) -> DumpStats:
    """Write the template's checkpoint state into the new directory `path` (must not
    exist), as a delta against the image `parent` if given.  strip_prefix: the sandbox's
    root as this process sees it, removed from mapped file paths so they resolve under the
    root_dir given at restore.  seccomp_ok: dump a process with a seccomp filter (not in the
    image: the restored process gets its restore host's filter; pass it only when that host
    is confined alike).  live: index the pages without copying them (no parent): an image
    only Held.adopt with this template restores, while it is held.  files_as_of_ns: when
    the checkpoint saw the files (time.time_ns()): a privately mapped file written since
    is not checked at restore (native/criu_incr.h).  Call on the template's owner
    thread."""
    return dump_begin(template, path, parent, max_chain=max_chain, fsync=fsync,
                      strip_prefix=strip_prefix, seccomp_ok=seccomp_ok, live=live,
                      files_as_of_ns=files_as_of_ns).finish()


class DumpJob:
    """A dump begun on the template's owner thread (dump_begin): finish() copies the pages
    and writes the image on any thread, without the tracer; abort() drops it. Exactly one
    of the two must be called."""

    def __init__(self, handle: int, pid: int) -> None:
        self._handle: int | None = handle
        self.pid = pid

    def finish(self) -> DumpStats:
        handle, self._handle = self._handle, None
        if handle is None:
            raise CRError(_errno.EINVAL, f"dump of {self.pid} already finished or aborted")
        st, err = _DumpStats(), _Err()
        if _load_images().dbxcr_dump_finish(handle, ctypes.byref(st), ctypes.byref(err)) < 0:
            _raise_img(err)
        return _stats(st)

    def abort(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            _load_images().dbxcr_dump_abort(handle)


def dump_begin(template: Template, path: str | os.PathLike,
               parent: str | os.PathLike | None = None, *, max_chain: int = 8,
               fsync: bool = False, strip_prefix: str | None = None,
               seccomp_ok: bool = False, live: bool = False,
               files_as_of_ns: int = 0) -> DumpJob:
    """The part of dump() that needs the tracer (call on the template's owner thread,
    with the template able to run injected calls); the returned job does the rest."""
    if template.released:
        raise CRError(_errno.EINVAL, f"template {template.pid} was released")
    lib = _load_images()
    path = os.path.abspath(os.fspath(path))
    opts = _dump_opts(path, parent, max_chain, fsync, strip_prefix, seccomp_ok, live,
                      files_as_of_ns)
    handle, err = ctypes.c_void_p(), _Err()
    if lib.dbxcr_dump_begin(template._handle, os.fsencode(path), ctypes.byref(opts),
                            ctypes.byref(handle), ctypes.byref(err)) < 0:
        _raise_img(err)
    assert handle.value is not None
    return DumpJob(handle.value, template.pid)


def verify_image(path: str | os.PathLike) -> None:
    """Check every checksum and page hash of the image and the ancestors it depends on.
    Raises ImageCorrupt if anything is damaged or missing."""
    lib = _load_images()
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ImageCorrupt(_errno.EBADMSG, f"image {path} is missing") from e
    try:
        err = _Err()
        if lib.dbxcr_verify_image(fd, ctypes.byref(err)) < 0:
            _raise_img(err)
    finally:
        os.close(fd)


def restore_template(host_pid: int, image_dir: str | os.PathLike,
                     root_dir: str | os.PathLike = "/", source: Template | None = None
                     ) -> Template:
    """Rebuild a parked Template from an image (see the section comment above).  Owned by
    the calling thread.  `source`: the template a live image was made from (its pages
    are there; it also gives its timers, stop and credentials).  Raises ImageCorrupt for
    a damaged image, CRError otherwise."""
    lib = _load_images()
    try:
        ifd = os.open(os.fspath(image_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ImageCorrupt(_errno.EBADMSG, f"image {image_dir} is missing") from e
    try:
        rfd = os.open(os.fspath(root_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            err = _Err()
            handle = (lib.dbxcr_restore_template(host_pid, ifd, rfd, ctypes.byref(err))
                      if source is None else lib.dbxcr_restore_template_from(
                          host_pid, ifd, rfd, source._h(), ctypes.byref(err)))
            if not handle:
                _raise_img(err)
        finally:
            os.close(rfd)
    finally:
        os.close(ifd)
    return Template(handle, lib.dbxcr_template_pid(handle), lib.dbxcr_template_origin(handle))


def image_info(path: str | os.PathLike) -> tuple[int, int, str, int]:
    """(depth, origin pid, parent reference relative to path or "", highest tid of its
    other threads or 0) of an image; checks core.img's checksum only."""
    lib = _load_images()
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ImageCorrupt(_errno.EBADMSG, f"image {path} is missing") from e
    try:
        info, err = _ImageInfo(), _Err()
        if lib.dbxcr_image_info(fd, ctypes.byref(info), ctypes.byref(err)) < 0:
            _raise_img(err)
    finally:
        os.close(fd)
    return info.depth, info.origin_pid, info.parent_ref.decode(), info.max_tid


def image_depends_on(path: str | os.PathLike) -> list[str]:
    """The ancestor image directories `path` needs (nearest first).  Reads core.img files
    only; does not verify page data (use verify_image)."""
    out: list[str] = []
    cur = os.path.abspath(os.fspath(path))
    depth = image_info(cur)[0]
    for _ in range(depth):
        cur = os.path.normpath(os.path.join(cur, image_info(cur)[2]))
        out.append(cur)
    return out
