"""ctypes binding for libdbxcr.so (native/fork_template.c): ptrace-injected process templates.

    info = describe(pid)                      # threads, tracer, ... (refuse early)
    tpl = make_template(pid)                  # stopped copy-on-write copy of pid
    child = tpl.spawn(fds={0: r, 1: w},       # fork from the checkpoint, re-rooted
                      files=regular_files(pid), cwd="/work", set_tid=[pid_in_ns])
    tpl.release()                             # SIGKILL + reap

Threading rule: a template is ptrace-held by the OS thread that created it; spawn and
release must be called from that same thread (the library checks and raises EPERM).  Run
all template work on one dedicated thread (for example a single-thread executor), never on
a pool.  Everything here is x86_64 Linux and needs root (CAP_SYS_PTRACE, CAP_SYS_ADMIN).

The tracer also receives wait notifications for its tracees: code in the same process must
not call waitpid(-1, __WALL) (plain waitpid(pid) of its own children is fine).
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import stat as _stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

LIB_ENV = "DELTABOX_LIBDBXCR"
DEFAULT_LIB = Path(__file__).resolve().parent.parent / "libexec" / "libdbxcr.so"


class CRError(OSError):
    """A checkpoint/restore step failed; .errno is the errno, str() names pid and step."""


class _Err(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * 512)]


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


class _SpawnOpts(ctypes.Structure):
    _fields_ = [("mntns_fd", ctypes.c_int), ("cwd", ctypes.c_char_p),
                ("files", ctypes.POINTER(_File)), ("nfiles", ctypes.c_size_t),
                ("fds", ctypes.POINTER(_FdMap)), ("nfds", ctypes.c_size_t),
                ("set_tid", ctypes.POINTER(ctypes.c_int)), ("set_tid_size", ctypes.c_size_t)]


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
        err = ctypes.POINTER(_Err)
        lib.dbxcr_describe.argtypes = [ctypes.c_int, ctypes.POINTER(_Info), err]
        lib.dbxcr_describe.restype = ctypes.c_int
        lib.dbxcr_inject_syscall.argtypes = [ctypes.c_int, ctypes.c_long,
                                             ctypes.POINTER(ctypes.c_long),
                                             ctypes.POINTER(ctypes.c_long), err]
        lib.dbxcr_inject_syscall.restype = ctypes.c_int
        lib.dbxcr_make_template.argtypes = [ctypes.c_int, err]
        lib.dbxcr_make_template.restype = ctypes.c_void_p
        lib.dbxcr_template_pid.argtypes = [ctypes.c_void_p]
        lib.dbxcr_template_pid.restype = ctypes.c_int
        lib.dbxcr_template_origin.argtypes = [ctypes.c_void_p]
        lib.dbxcr_template_origin.restype = ctypes.c_int
        lib.dbxcr_spawn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_SpawnOpts), err]
        lib.dbxcr_spawn.restype = ctypes.c_int
        lib.dbxcr_release_template.argtypes = [ctypes.c_void_p, err]
        lib.dbxcr_release_template.restype = ctypes.c_int
        _lib = lib
        return lib


def _raise(err: _Err) -> None:
    code = err.code or _errno.EIO
    raise CRError(code, err.msg.decode(errors="replace") or os.strerror(code))


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
        if self.threads != 1:
            return f"{self.threads} threads (only single-threaded processes are supported)"
        if self.tracer_pid:
            return f"already traced by pid {self.tracer_pid}"
        if self.state in ("Z", "X"):
            return "exiting"
        return None


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
    out = []
    base = Path(f"/proc/{pid}")
    for entry in sorted(os.listdir(base / "fd"), key=int):
        fd = int(entry)
        try:
            target = os.readlink(base / "fd" / entry)
            st = os.stat(base / "fd" / entry)
            info = (base / "fdinfo" / entry).read_text()
        except FileNotFoundError:
            continue
        if not target.startswith("/") or target.endswith(" (deleted)"):
            continue
        if not _stat.S_ISREG(st.st_mode):
            continue
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        out.append(ReopenFile(fd, target, int(fields["flags"].strip(), 8),
                              int(fields["pos"].strip())))
    return out


class Template:
    """A ptrace-stopped copy-on-write copy of a process at checkpoint time."""

    def __init__(self, handle: int, pid: int, origin: int) -> None:
        self._handle: int | None = handle
        self.pid = pid
        self.origin = origin
        self.owner_thread = threading.get_native_id()

    @property
    def released(self) -> bool:
        return self._handle is None

    def spawn(self, *, fds: Mapping[int, int] | None = None,
              files: Iterable[ReopenFile | tuple] = (), cwd: str | None = None,
              mntns_fd: int | None = None, set_tid: Sequence[int] | None = None,
              cloexec_fds: Iterable[int] = ()) -> int:
        """Fork a child that continues where the origin was at checkpoint time.

        fds: {target_fd_in_child: our_fd}, e.g. fresh stdio pipes ({0: r, 1: w, 2: w}).
        files: regular files reopened at their fd with flags and offset (own description).
        cwd: chdir in the child (after joining mntns_fd).
        mntns_fd: our fd of a mount namespace the child joins (setns).
        set_tid: clone3 set_tid, [0] = pid in the template's own (innermost) namespace.
        Returns the child's pid in our namespace; it is a sibling of the origin (same
        parent, same exit signal)."""
        if self._handle is None:
            raise CRError(_errno.EINVAL, f"template {self.pid} was released")
        lib = _load()
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
        opts = _SpawnOpts(-1 if mntns_fd is None else mntns_fd,
                          os.fsencode(cwd) if cwd is not None else None,
                          cfiles, len(file_items), fdmaps, len(fd_items),
                          ctids if tids else None, len(tids))
        err = _Err()
        pid = lib.dbxcr_spawn(self._handle, ctypes.byref(opts), ctypes.byref(err))
        if pid < 0:
            _raise(err)
        return pid

    def release(self) -> None:
        """SIGKILL the template and reap it.  Idempotent."""
        if self._handle is None:
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
