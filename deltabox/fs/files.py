"""Files API for a sandbox, confined to the sandbox's own root file system.

The daemon runs as host root and holds `rootfd`, an fd to the sandbox's root directory (an
overlay mount in another mount namespace). Every path a client sends is attacker-controlled:
it may contain `..`, and the sandbox can plant absolute symlinks, symlinks to
`/proc/self/root`-style magic links, or swap a directory for a symlink while we work. A plain
`os.path.join(root, path)` would follow all of those on the *host*. So:

* Paths are resolved only with openat2(2) from `rootfd` using RESOLVE_IN_ROOT (`..` and
  absolute symlinks are clamped to the sandbox root, exactly as inside a chroot),
  RESOLVE_NO_MAGICLINKS and RESOLVE_NO_XDEV (never cross into another mount: /proc, /sys, /dev,
  bind mounts and tmpfs mounts inside the sandbox are refused with InvalidArgument).
* Resolution yields a real directory fd for the *parent*; the final component is then acted on
  with dir_fd-relative calls that never follow a symlink (unlinkat, renameat, mkdirat,
  openat2 with RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS, O_EXCL creation). A racing swap can only
  redirect us to another place that is itself inside the sandbox.
* Files are opened for I/O by first pinning the inode with O_PATH (no side effects, no blocking
  on FIFOs), checking it is a regular file, then re-opening that same inode via
  /proc/self/fd/N (the daemon's own /proc), so what we checked is what we read.

Semantics worth knowing:

* Relative paths are relative to `workdir` (default /workspace).
* read, list, download_tar and append follow a symlink in the final component (inside the
  sandbox); stat has lstat semantics; write (non-append), remove and tar extraction act on
  the final component itself: write *replaces* a symlink with a regular file atomically rather
  than writing through it, remove deletes the link, not its target.
* A trailing '/' makes the path name a directory, like POSIX, for stat/read/list/download_tar
  (stat("link/") follows the link); write refuses it; remove and mkdir ignore it.
* upload_tar validates the whole archive before writing anything, but a failure half-way
  through extraction (disk full, a type conflict) leaves the members extracted so far.
* New files and directories take the owner of their parent directory; a replaced file keeps
  its owner and (unless `mode` is given) its permission bits. This keeps files usable by the
  sandbox's own (possibly user-namespace-mapped) users although the daemon is host root.
* In a sandbox with a user namespace (`ids`), every operation runs as the sandbox's root
  (fsuid/fsgid = its host id, capabilities kept; sandbox/userns.py): its layers are mounted
  idmapped and refuse to create a file for host uid 0, which is not mapped there. Archives
  from download_tar carry the ids as the sandbox sees them.

Nothing here holds state beyond the fds each call opens and closes; the class is safe to use
for many sandboxes at once (one call at a time per instance).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import io
import os
import posixpath
import secrets
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Concatenate, Literal, ParamSpec, TypeVar

from deltabox.errors import (
    DeltaBoxError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

from deltabox.sandbox.userns import IdMap, acting_as_root_of

__all__ = ["FileStat", "FileType", "SandboxFiles", "MAX_PATH"]

MAX_PATH = 4096
_CHUNK = 1 << 20
_RETRIES = 64
_DEFAULT_MAX = 512 << 20

# openat2(2). The syscall number is 437 on x86_64 and on every architecture that uses the
# generic syscall table (it was added after the numbering was unified).
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

# A whole path, resolved from the sandbox root as a process chrooted there would (plus no
# magic links, no mount crossing).
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
# A single name relative to a directory fd we already hold: no symlinks at all, stay put.
_ONE_NAME = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long


def _openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2) with O_CLOEXEC; retries EINTR and the EAGAIN that RESOLVE_IN_ROOT returns
    when a concurrent rename/mount makes `..` resolution unverifiable."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    raw = os.fsencode(path)
    for _ in range(_RETRIES):
        fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(raw),
                      ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):
            break
    raise OSError(err, os.strerror(err), path)


def open_in_root(rootfd: int, path: str, flags: int, mode: int = 0) -> int:
    """`path` opened as a process chrooted at `rootfd` would (no magic links; mounts below
    the root are crossed): for the daemon's own files in a sandbox generation."""
    return _openat2(rootfd, path, flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS, mode)


FileType = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True, slots=True)
class FileStat:
    """What the API reports about one entry; `mode` is S_IMODE (permissions + suid/sgid/sticky)."""

    path: str
    type: FileType
    size: int
    mode: int
    mtime: float
    link_target: str = ""

    @classmethod
    def from_stat(cls, path: str, st: os.stat_result, link_target: str = "") -> FileStat:
        fmt = stat.S_IFMT(st.st_mode)
        kind: FileType = ("file" if fmt == stat.S_IFREG else "dir" if fmt == stat.S_IFDIR
                          else "symlink" if fmt == stat.S_IFLNK else "other")
        return cls(path=path, type=kind, size=st.st_size, mode=stat.S_IMODE(st.st_mode),
                   mtime=st.st_mtime_ns / 1e9, link_target=link_target)


@dataclass(frozen=True, slots=True)
class _Target:
    """A validated path: `full` for whole-path resolution, `parent`+`name` for final-component
    operations; `name` is None when there is no final component to act on ('/', '.', '..')."""

    full: str
    parent: str
    name: str | None
    display: str
    trailing_slash: bool

    @property
    def stripped(self) -> str:
        return self.full.rstrip("/") or "/"


def _display(full: str) -> str:
    """The normalised absolute form used in messages and FileStat.path (cosmetic only)."""
    return "/" + posixpath.normpath(full).lstrip("/")


def _split(full: str) -> _Target:
    stripped = full.rstrip("/") or "/"
    idx = stripped.rfind("/")
    name: str | None = stripped[idx + 1:]
    if stripped == "/" or name in (".", ".."):
        name = None
    return _Target(full=full, parent=stripped[:idx] or "/", name=name, display=_display(full),
                   trailing_slash=stripped != full and stripped != "/")


def _error_for(err: OSError, where: str) -> DeltaBoxError:
    """One place that turns errno into the API's error classes."""
    code = err.errno
    if code == errno.ENOENT:
        return NotFound(f"no such file in sandbox: {where}")
    if code == errno.EXDEV:
        return InvalidArgument(f"{where}: path cannot leave the sandbox's file system "
                               "(it resolves into another mount such as /proc, /sys or /dev)")
    if code == errno.ELOOP:
        return InvalidArgument(f"{where}: too many levels of symbolic links, or a magic link "
                               "that would leave the sandbox's file system")
    if code == errno.ENAMETOOLONG:
        return InvalidArgument(f"path too long: {where}")
    if code == errno.EINVAL:
        return InvalidArgument(f"invalid argument: {where}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"no space left in the sandbox's file system: {where} (the "
                                 "layer store is full or the sandbox's disk quota is reached: "
                                 "delete files, or checkpoints and sandboxes no longer needed)")
    if code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EFBIG):
        return ResourceExhausted(f"{os.strerror(code).lower()}: {where}")
    if code == errno.ENOSYS:
        return Internal("openat2(2) is not supported by this kernel (needs Linux >= 5.6)")
    simple = {
        errno.EISDIR: "is a directory",
        errno.ENOTDIR: "not a directory",
        errno.ENOTEMPTY: "directory not empty",
        errno.EEXIST: "already exists",
        errno.EBUSY: "busy (a mount point?)",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only file system",
        errno.ETXTBSY: "text file busy",
        errno.EAGAIN: "changed concurrently, try again",
    }
    if code in simple:
        return FailedPrecondition(f"{simple[code]}: {where}")
    return Internal(f"{os.strerror(code) if code else err}: {where}")


@contextlib.contextmanager
def _confined_errors(where: str) -> Iterator[None]:
    """Never let an OSError reach the caller; already-mapped errors pass through."""
    try:
        yield
    except OSError as err:
        raise _error_for(err, where) from err


@contextlib.contextmanager
def _owned(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _temp_name() -> str:
    return f".deltabox-{secrets.token_hex(8)}.tmp"


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data[:_CHUNK]):]


def _read_upto(fd: int, limit: int, where: str) -> bytes:
    """Read to EOF but never keep more than `limit` bytes (the file may grow under us)."""
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise ResourceExhausted(f"{where} is larger than the {limit}-byte limit")


def _read_at_most(fd: int, size: int) -> bytes:
    """Up to `size` bytes: a snapshot of a file that may be changing under us."""
    chunks: list[bytes] = []
    while size > 0 and (chunk := os.read(fd, min(_CHUNK, size))):
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _require_regular(st: os.stat_result, where: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"is a directory: {where}")
    if not stat.S_ISREG(st.st_mode):
        raise FailedPrecondition(f"not a regular file: {where}")


def _check_limit(value: int, what: str) -> None:
    if not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative integer")


def _member_rel(name: str) -> str:
    """A tar member name as a clean relative path; absolute or escaping names are refused."""
    if "\0" in name:
        raise InvalidArgument(f"tar member name contains a NUL byte: {name!r}")
    if name.startswith("/"):
        raise InvalidArgument(f"tar member has an absolute name: {name!r}")
    parts: list[str] = []
    for comp in name.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                raise InvalidArgument(f"tar member escapes the destination directory: {name!r}")
            parts.pop()
        else:
            parts.append(comp)
    return "/".join(parts)


_TarPlan = list[tuple[tarfile.TarInfo, str, str | None]]


def _plan_tar(members: list[tarfile.TarInfo]) -> _TarPlan:
    """Validate the whole archive before touching the file system.

    Besides absolute/escaping names and device nodes, refuse any member that would be written
    *through* a symlink the same archive creates (the classic tar-slip: `x -> /etc`, then
    `x/passwd`). Pre-existing symlinks in the sandbox are still followed, inside the sandbox.
    """
    symlinks = {_member_rel(m.name) for m in members if m.issym()}
    plan: _TarPlan = []
    for m in members:
        if m.ischr() or m.isblk():
            raise InvalidArgument(f"tar member is a device node, which is not allowed: {m.name!r}")
        rel = _member_rel(m.name)
        link_rel = _member_rel(m.linkname) if m.islnk() else None
        if not rel and not m.isdir():
            raise InvalidArgument(f"tar member has no name: {m.name!r}")
        if link_rel == "":
            raise InvalidArgument(f"tar hard link has no target: {m.name!r}")
        if m.isdir() and rel in symlinks:
            raise InvalidArgument(f"tar member {m.name!r} is both a symlink and a directory")
        for candidate in (rel, link_rel):
            parts = candidate.split("/") if candidate else []
            for i in range(1, len(parts)):
                prefix = "/".join(parts[:i])
                if prefix in symlinks:
                    raise InvalidArgument(f"tar member {m.name!r} would be written through the "
                                          f"symlink {prefix!r} created by the same archive")
        plan.append((m, rel, link_rel))
    return plan


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _as_sandbox_root(method: Callable[Concatenate[SandboxFiles, _P], _R]
                     ) -> Callable[Concatenate[SandboxFiles, _P], _R]:
    """A public operation runs as the sandbox's root if it has a user namespace."""
    @functools.wraps(method)
    def run(self: SandboxFiles, *args: _P.args, **kw: _P.kwargs) -> _R:
        if self._ids is None:
            return method(self, *args, **kw)
        with acting_as_root_of(self._ids):
            return method(self, *args, **kw)
    return run


def check_path(path: object) -> None:
    """Refuse a path no operation could resolve (InvalidArgument), before any I/O: also
    what a write that rolls back first checks before its rollback (Daemon.write_file)."""
    if not isinstance(path, str):
        raise InvalidArgument("path must be a string")
    if not path:
        raise InvalidArgument("path is empty")
    if "\0" in path:
        raise InvalidArgument("path contains a NUL byte")
    if len(os.fsencode(path)) > MAX_PATH:
        raise InvalidArgument(f"path is longer than {MAX_PATH} bytes")


def check_mode(mode: object) -> None:
    """Refuse permission bits a write cannot set (InvalidArgument); None keeps the file's."""
    if mode is not None and (not isinstance(mode, int) or not 0 <= mode <= 0o7777):
        raise InvalidArgument(f"mode must be between 0 and 0o7777, got {mode!r}")


class SandboxFiles:
    """Confined file operations on one sandbox's root file system (see module docstring)."""

    def __init__(self, rootfd: int, workdir: str = "/workspace",
                 ids: IdMap | None = None) -> None:
        if not isinstance(workdir, str) or not workdir.startswith("/") or "\0" in workdir:
            raise InvalidArgument(f"workdir must be an absolute path: {workdir!r}")
        self._rootfd = rootfd
        self._workdir = workdir.rstrip("/")
        self._ids = ids

    # ---- public API ------------------------------------------------------------------------

    @_as_sandbox_root
    def read(self, path: str, max_bytes: int = _DEFAULT_MAX) -> bytes:
        """Contents of a regular file; a final symlink is followed, but only inside the root."""
        _check_limit(max_bytes, "max_bytes")
        t = self._target(path)
        with _confined_errors(t.display), contextlib.ExitStack() as stack:
            pin = stack.enter_context(_owned(self._open_full(t.full, os.O_PATH)))
            st = os.fstat(pin)
            _require_regular(st, t.display)
            if st.st_size > max_bytes:
                raise ResourceExhausted(f"{t.display} is {st.st_size} bytes, larger than the "
                                        f"{max_bytes}-byte limit")
            fd = stack.enter_context(_owned(self._reopen(pin, os.O_RDONLY)))
            return _read_upto(fd, max_bytes, t.display)

    @_as_sandbox_root
    def write(self, path: str, data: bytes, mode: int | None = None, append: bool = False,
              make_parents: bool = True) -> FileStat:
        """Create or replace a regular file.

        Not appending: the data goes to a temp file in the same directory which is then renamed
        over the target, so readers never see half a file, and a symlink at the target is
        replaced (never written through). Appending follows a final symlink inside the root.
        Without `mode`, an existing file keeps its permissions (new files get 0o644).
        """
        t = self._target(path)
        if t.name is None or t.trailing_slash:
            raise FailedPrecondition(f"cannot write a file at {t.display}: "
                                     "the path names a directory")
        check_mode(mode)
        try:
            payload = memoryview(data).cast("B")
        except TypeError:
            raise InvalidArgument("data must be bytes") from None
        with _confined_errors(t.display), contextlib.ExitStack() as stack:
            if append:
                st = self._append(t, payload, mode, make_parents)
            else:
                pfd = stack.enter_context(_owned(self._parent(t, make_parents)))
                st = self._write_file(pfd, t.name, lambda fd: _write_all(fd, payload), mode)
        return FileStat.from_stat(t.display, st)

    @_as_sandbox_root
    def stat(self, path: str) -> FileStat:
        """lstat semantics: a final symlink is reported, not followed (unless the path ends
        in '/'), so callers can see links without us ever resolving them."""
        t = self._target(path)
        with _confined_errors(t.display), contextlib.ExitStack() as stack:
            if t.name is None or t.trailing_slash:
                fd = stack.enter_context(_owned(self._open_full(t.full, os.O_PATH)))
                return FileStat.from_stat(t.display, os.fstat(fd))
            pfd = stack.enter_context(_owned(self._open_dir(t.parent)))
            fd = stack.enter_context(_owned(self._open_one(pfd, t.name, os.O_PATH)))
            st = os.fstat(fd)
            # readlinkat(fd, "") reads the very symlink we pinned, not whatever is there now.
            target = os.readlink("", dir_fd=fd) if stat.S_ISLNK(st.st_mode) else ""
            return FileStat.from_stat(t.display, st, target)

    @_as_sandbox_root
    def list(self, path: str) -> list[FileStat]:
        """Entries of a directory (a final symlink to a directory is followed), sorted by name,
        each with lstat semantics. Mount points show as the kernel's lstat reports them."""
        t = self._target(path)
        with _confined_errors(t.display), contextlib.ExitStack() as stack:
            dfd = stack.enter_context(_owned(self._open_dir(t.full)))
            out: list[FileStat] = []
            for name in sorted(os.listdir(dfd)):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since getdents: just not there any more
                target = ""
                if stat.S_ISLNK(st.st_mode):
                    with contextlib.suppress(OSError):
                        target = os.readlink(name, dir_fd=dfd)
                out.append(FileStat.from_stat(posixpath.join(t.display, name), st, target))
            return out

    @_as_sandbox_root
    def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, symlink (the link itself) or directory.

        Recursive removal walks with directory fds and unlinkat and never follows a symlink, so
        a link to a host-looking path inside the tree only loses the link. It refuses to cross
        into a mount inside the tree (InvalidArgument).
        """
        t = self._target(path)
        if t.name is None:
            raise InvalidArgument(f"refusing to remove {t.display}")
        name = t.name
        with _confined_errors(t.display), contextlib.ExitStack() as stack:
            pfd = stack.enter_context(_owned(self._open_dir(t.parent)))
            for _ in range(_RETRIES):  # retried only when the sandbox swaps the entry's type
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    try:
                        os.unlink(name, dir_fd=pfd)
                        return
                    except IsADirectoryError:
                        continue
                try:
                    dfd = self._open_one(pfd, name, os.O_RDONLY | os.O_DIRECTORY)
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        continue  # no longer a directory
                    raise
                try:
                    if recursive:
                        self._clear_dir(dfd, t.display)
                finally:
                    os.close(dfd)
                try:
                    os.rmdir(name, dir_fd=pfd)
                    return
                except NotADirectoryError:
                    continue
                except OSError as err:
                    if err.errno == errno.ENOTEMPTY and recursive:
                        continue  # something was created while we emptied it
                    raise
            raise FailedPrecondition(f"{t.display} kept changing while being removed")

    @_as_sandbox_root
    def mkdir(self, path: str, parents: bool = True) -> FileStat:
        """Create a directory (0o755). With `parents` this is `mkdir -p`: missing parents are
        created and an existing directory is fine; without it, the parent must exist and the
        target must not."""
        t = self._target(path)
        with _confined_errors(t.display), contextlib.ExitStack() as stack:
            if parents or t.name is None:
                if not parents:
                    raise FailedPrecondition(f"already exists: {t.display}")
                fd = stack.enter_context(_owned(self._ensure_dir(t.full)))
                return FileStat.from_stat(t.display, os.fstat(fd))
            pfd = stack.enter_context(_owned(self._open_dir(t.parent)))
            if not self._make_subdir(pfd, t.name):
                raise FailedPrecondition(f"already exists: {t.display}")
            fd = stack.enter_context(_owned(self._open_one(pfd, t.name, os.O_PATH)))
            return FileStat.from_stat(t.display, os.fstat(fd))

    @_as_sandbox_root
    def upload_tar(self, path: str, tar_bytes: bytes) -> int:
        """Extract an uncompressed tar into directory `path` (created if missing); returns the
        number of entries. The archive is validated as a whole first (see _plan_tar); then each
        member goes through the same confined resolution as write(). Files, symlinks, FIFOs and
        hard links replace existing non-directories atomically; ownership follows the parent
        directory, not the archive; permission bits and mtimes come from the archive."""
        t = self._target(path)
        try:
            tf = tarfile.open(fileobj=io.BytesIO(bytes(tar_bytes)), mode="r:")
            members = tf.getmembers()
        except (tarfile.TarError, EOFError, ValueError, TypeError, UnicodeError) as err:
            raise InvalidArgument(f"not a valid uncompressed tar archive: {err}") from None
        with tf:
            plan = _plan_tar(members)
            dest = t.stripped.rstrip("/")
            dir_times: list[tuple[str, int]] = []
            # What this call creates (the topmost new path of each member), so that a member
            # failing half-way (e.g. a name leading through a symlink the archive itself made)
            # leaves no new entries behind. Entries it replaced stay replaced.
            created: list[str] = []
            try:
                self._note_created(t.full, created)
                with _confined_errors(t.display):
                    os.close(self._ensure_dir(t.full))
                for member, rel, link_rel in plan:
                    full = f"{dest}/{rel}" if rel else t.full
                    self._note_created(full, created)
                    with _confined_errors(_display(full)):
                        link_full = f"{dest}/{link_rel}" if link_rel is not None else None
                        self._extract(tf, member, full, bool(rel), link_full, dir_times)
            except BaseException:
                for full in reversed(created):
                    try:
                        self.remove(_display(full), recursive=True)
                    except Exception:
                        pass
                raise
            # Directory mtimes last, since creating their children changed them.
            for full, mtime_ns in reversed(dir_times):
                with _confined_errors(_display(full)), _owned(self._open_dir(full)) as fd:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
        return len(plan)

    def _note_created(self, full: str, created: list[str]) -> None:
        """Append the topmost component of `full` that does not exist yet (if any)."""
        prefix = ""
        for comp in (c for c in full.split("/") if c):
            prefix += "/" + comp
            try:
                os.close(self._open_full(prefix, os.O_PATH | os.O_NOFOLLOW))
            except FileNotFoundError:
                if comp not in (".", "..") and prefix not in created:
                    created.append(prefix)
                return
            except OSError:
                return  # not ours to judge here: extraction reports it

    @_as_sandbox_root
    def download_tar(self, path: str, max_bytes: int = _DEFAULT_MAX) -> bytes:
        """An uncompressed tar of a file or a directory tree.

        A directory's archive holds its contents with relative names (like `tar -C path .`), so
        upload_tar(path, download_tar(path)) round-trips; a file's archive holds one member named
        after it. The top-level path is followed if it is a symlink; symlinks inside are stored
        as symlinks, sockets are skipped, hard links are stored as separate files and mount
        points inside the tree are stored as empty directories (like tar --one-file-system).
        """
        _check_limit(max_bytes, "max_bytes")
        t = self._target(path)
        buf = io.BytesIO()
        with _confined_errors(t.display), contextlib.ExitStack() as stack:
            pin = stack.enter_context(_owned(self._open_full(t.full, os.O_PATH)))
            st = os.fstat(pin)
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
                if stat.S_ISDIR(st.st_mode):
                    dfd = stack.enter_context(
                        _owned(self._reopen(pin, os.O_RDONLY | os.O_DIRECTORY)))
                    self._tar_tree(tf, buf, dfd, t.display, max_bytes)
                else:
                    name = posixpath.basename(t.display)
                    self._tar_entry(tf, buf, pin, st, name, t.display, max_bytes)
        if buf.tell() > max_bytes:
            raise ResourceExhausted(f"archive of {t.display} is larger than the "
                                    f"{max_bytes}-byte limit")
        return buf.getvalue()

    # ---- resolution ------------------------------------------------------------------------

    def _target(self, path: str) -> _Target:
        check_path(path)
        return _split(path if path.startswith("/") else f"{self._workdir}/{path}")

    def _open_full(self, full: str, flags: int) -> int:
        """Resolve a whole sandbox path from the root, following symlinks the way the sandbox
        would see them, but never out of the root or into another mount."""
        return _openat2(self._rootfd, full, flags, _IN_ROOT)

    def _open_dir(self, full: str) -> int:
        return self._open_full(full, os.O_RDONLY | os.O_DIRECTORY)

    @staticmethod
    def _open_one(dirfd: int, name: str, flags: int, mode: int = 0) -> int:
        """Open exactly one name in a directory we hold; a symlink there is never followed
        (with O_PATH it is opened itself), a mount point there is refused."""
        return _openat2(dirfd, name, flags | os.O_NOFOLLOW, _ONE_NAME, mode)

    @staticmethod
    def _reopen(pinned: int, flags: int) -> int:
        """Open the very inode behind an O_PATH fd (no re-resolution, so no race)."""
        return os.open(f"/proc/self/fd/{pinned}", flags | os.O_CLOEXEC | os.O_NOCTTY)

    def _parent(self, t: _Target, create: bool) -> int:
        return self._ensure_dir(t.parent) if create else self._open_dir(t.parent)

    def _ensure_dir(self, full: str) -> int:
        """`mkdir -p`, returning an fd for the directory. Each missing component is created
        with mkdirat in the directory fd we hold and then re-resolved from the root, so a
        symlink planted meanwhile is interpreted inside the sandbox."""
        try:
            return self._open_dir(full)
        except FileNotFoundError:
            pass
        cur = self._open_dir("/")
        made: list[str] = []   # what we created, to take back if a later component fails
        try:
            prefix = ""
            for comp in (c for c in full.split("/") if c):
                prefix += "/" + comp
                try:
                    nxt = self._open_dir(prefix)
                except FileNotFoundError:
                    if comp in (".", ".."):
                        raise
                    if self._make_subdir(cur, comp):
                        made.append(prefix)
                    nxt = self._open_dir(prefix)  # ENOENT again: a dangling symlink is in the way
                cur, old = nxt, cur
                os.close(old)
            return cur
        except BaseException:
            os.close(cur)
            self._unmake(made)  # a rejected call changes nothing
            raise

    def _unmake(self, made: list[str]) -> None:
        """Remove directories `_ensure_dir` created, deepest first, if they are still empty."""
        for path in reversed(made):
            parent, _, name = path.rpartition("/")
            try:
                pfd = self._open_dir(parent or "/")
            except OSError:
                continue
            try:
                os.rmdir(name, dir_fd=pfd)
            except OSError:
                pass
            finally:
                os.close(pfd)

    def _make_subdir(self, pfd: int, name: str) -> bool:
        """mkdirat, then give the new directory its parent's owner and 0o755 (not the daemon's
        umask). False if something already exists there."""
        try:
            os.mkdir(name, 0o700, dir_fd=pfd)
        except FileExistsError:
            return False
        owner = os.fstat(pfd)
        try:
            fd = self._open_one(pfd, name, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return True  # already replaced by the sandbox; it is theirs now
        try:
            self._chown_like(fd, owner)
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
        return True

    # ---- writing ---------------------------------------------------------------------------

    @staticmethod
    def _chown_like(fd: int, ref: os.stat_result) -> None:
        """Best effort: IDs not mapped into the sandbox's mount give EINVAL/EOVERFLOW."""
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (ref.st_uid, ref.st_gid):
            try:
                os.fchown(fd, ref.st_uid, ref.st_gid)
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.EINVAL, errno.EOVERFLOW):
                    raise

    @staticmethod
    def _install(pfd: int, name: str, make: Callable[[str], None]) -> None:
        """Create an entry under a fresh temp name with `make`, then renameat it over `name`:
        atomic for readers, and a symlink at `name` is replaced rather than followed."""
        tmp = _temp_name()
        try:
            make(tmp)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=pfd)
            raise

    def _write_file(self, pfd: int, name: str, fill: Callable[[int], None], mode: int | None,
                    mtime_ns: int | None = None) -> os.stat_result:
        existing: os.stat_result | None
        try:
            existing = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            existing = None
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        if mode is None:
            is_file = existing is not None and stat.S_ISREG(existing.st_mode)
            mode = stat.S_IMODE(existing.st_mode) if is_file else 0o644  # type: ignore[union-attr]
        owner = existing if existing is not None else os.fstat(pfd)
        result: list[os.stat_result] = []

        def make(tmp: str) -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=pfd)
            try:
                fill(fd)
                self._chown_like(fd, owner)
                os.fchmod(fd, mode)  # after chown, which would clear suid/sgid
                if mtime_ns is not None:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
                result.append(os.fstat(fd))
            finally:
                os.close(fd)

        self._install(pfd, name, make)
        return result[0]

    def _append(self, t: _Target, data: memoryview, mode: int | None,
                make_parents: bool) -> os.stat_result:
        assert t.name is not None
        for _ in range(8):
            try:
                pin = self._open_full(t.full, os.O_PATH)
            except FileNotFoundError:
                with _owned(self._parent(t, make_parents)) as pfd:
                    try:
                        fd = os.open(t.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL
                                     | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
                    except FileExistsError:
                        continue  # created meanwhile, or a dangling symlink: look again
                    try:
                        self._chown_like(fd, os.fstat(pfd))
                        os.fchmod(fd, 0o644 if mode is None else mode)
                    except BaseException:
                        os.close(fd)
                        raise
            else:
                with _owned(pin):
                    _require_regular(os.fstat(pin), t.display)
                    fd = self._reopen(pin, os.O_WRONLY | os.O_APPEND)
                if mode is not None:
                    try:
                        os.fchmod(fd, mode)
                    except BaseException:
                        os.close(fd)
                        raise
            with _owned(fd):
                _write_all(fd, data)
                return os.fstat(fd)
        raise FailedPrecondition(f"cannot append to {t.display}: it is a dangling symbolic link "
                                 "or keeps changing")

    # ---- removal ---------------------------------------------------------------------------

    def _clear_dir(self, top: int, top_display: str) -> None:
        """Empty the directory behind `top` (which the caller owns) without recursion in
        Python: a stack of (dirfd, pending names, display, name in parent)."""
        stack: list[tuple[int, list[str], str, str]] = [(top, os.listdir(top), top_display, "")]
        swaps = 0
        try:
            while stack:
                fd, names, where, own_name = stack[-1]
                if not names:
                    if len(stack) == 1:
                        return
                    stack.pop()
                    os.close(fd)
                    parent_fd, parent_names = stack[-1][0], stack[-1][1]
                    with _confined_errors(where):
                        try:
                            os.rmdir(own_name, dir_fd=parent_fd)
                        except FileNotFoundError:
                            pass
                        except OSError as err:
                            if err.errno not in (errno.ENOTEMPTY, errno.ENOTDIR):
                                raise
                            swaps += 1  # refilled or swapped meanwhile: visit it again
                            parent_names.append(own_name)
                    continue
                name = names.pop()
                sub = posixpath.join(where, name)
                if swaps > 100 * _RETRIES:
                    raise FailedPrecondition(f"{sub} kept changing while being removed")
                with _confined_errors(sub):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISDIR(st.st_mode):
                        try:
                            os.unlink(name, dir_fd=fd)
                        except FileNotFoundError:
                            pass
                        except IsADirectoryError:
                            swaps += 1
                            names.append(name)
                        continue
                    try:
                        child = self._open_one(fd, name, os.O_RDONLY | os.O_DIRECTORY)
                    except FileNotFoundError:
                        continue
                    except OSError as err:
                        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                            raise  # EXDEV: a mount inside the tree is refused
                        swaps += 1
                        names.append(name)
                        continue
                    try:
                        entries = os.listdir(child)
                    except BaseException:
                        os.close(child)
                        raise
                    stack.append((child, entries, sub, name))
        finally:
            for frame in stack[1:]:
                os.close(frame[0])

    # ---- tar -------------------------------------------------------------------------------

    def _extract(self, tf: tarfile.TarFile, m: tarfile.TarInfo, full: str, named: bool,
                 link_full: str | None, dir_times: list[tuple[str, int]]) -> None:
        mode = m.mode & 0o7777
        mtime_ns = int(m.mtime * 1_000_000_000)
        if m.isdir():
            with _owned(self._ensure_dir(full)) as fd:
                if named:  # leave the destination's own mode alone for a './' member
                    os.fchmod(fd, mode)
                    dir_times.append((full, mtime_ns))
            return
        t = _split(full)
        assert t.name is not None
        name = t.name
        with _owned(self._ensure_dir(t.parent)) as pfd:
            owner = os.fstat(pfd)
            if m.isreg():
                src = tf.extractfile(m)
                assert src is not None

                def fill(fd: int) -> None:
                    while chunk := src.read(_CHUNK):
                        _write_all(fd, memoryview(chunk))

                self._write_file(pfd, name, fill, mode, mtime_ns)
            elif m.issym():
                def make_link(tmp: str) -> None:
                    os.symlink(m.linkname, tmp, dir_fd=pfd)
                    os.chown(tmp, owner.st_uid, owner.st_gid, dir_fd=pfd, follow_symlinks=False)
                    os.utime(tmp, ns=(mtime_ns, mtime_ns), dir_fd=pfd, follow_symlinks=False)

                self._install(pfd, name, make_link)
            elif m.islnk():
                assert link_full is not None
                s = _split(link_full)
                if s.name is None:
                    raise InvalidArgument(f"tar hard link has no target: {m.linkname!r}")
                with _owned(self._open_dir(s.parent)) as spfd:
                    self._install(pfd, name, lambda tmp: os.link(
                        s.name, tmp, src_dir_fd=spfd, dst_dir_fd=pfd, follow_symlinks=False))
            elif m.isfifo():
                def make_fifo(tmp: str) -> None:
                    os.mkfifo(tmp, 0o600, dir_fd=pfd)
                    with _owned(self._open_one(pfd, tmp, os.O_PATH)) as pin:
                        os.chown(f"/proc/self/fd/{pin}", owner.st_uid, owner.st_gid)
                        os.chmod(f"/proc/self/fd/{pin}", mode)  # the pinned inode, not a name

                self._install(pfd, name, make_fifo)
            else:
                raise InvalidArgument(f"unsupported tar member type {m.type!r}: {m.name!r}")

    def _tar_tree(self, tf: tarfile.TarFile, buf: io.BytesIO, top: int, top_display: str,
                  limit: int) -> None:
        """Depth-first walk with directory fds; each entry is pinned with O_PATH|O_NOFOLLOW and
        everything (type, contents, link target) is read from that pinned inode."""
        stack: list[tuple[int, list[str], str, str]] = [
            (top, sorted(os.listdir(top), reverse=True), "", top_display)]
        try:
            while stack:
                fd, names, prefix, where = stack[-1]
                if not names:
                    stack.pop()
                    if stack:  # the caller owns `top`
                        os.close(fd)
                    continue
                name = names.pop()
                rel, sub = prefix + name, posixpath.join(where, name)
                with _confined_errors(sub):
                    try:
                        pin = self._open_one(fd, name, os.O_PATH)
                    except FileNotFoundError:
                        continue
                    except OSError as err:
                        if err.errno != errno.EXDEV:
                            raise
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):  # a mount point: recorded, not entered
                            self._add(tf, buf, self._info(rel, st, tarfile.DIRTYPE), None,
                                      limit, sub)
                        continue
                    with _owned(pin):
                        st = os.fstat(pin)
                        if not stat.S_ISDIR(st.st_mode):
                            self._tar_entry(tf, buf, pin, st, rel, sub, limit)
                            continue
                        self._add(tf, buf, self._info(rel, st, tarfile.DIRTYPE), None, limit, sub)
                        child = self._reopen(pin, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        entries = sorted(os.listdir(child), reverse=True)
                    except BaseException:
                        os.close(child)
                        raise
                    stack.append((child, entries, rel + "/", sub))
        finally:
            for frame in stack[1:]:
                os.close(frame[0])

    def _tar_entry(self, tf: tarfile.TarFile, buf: io.BytesIO, pin: int, st: os.stat_result,
                   rel: str, where: str, limit: int) -> None:
        """Add one non-directory, read from its pinned O_PATH fd."""
        mode = st.st_mode
        if stat.S_ISREG(mode):
            if buf.tell() + 1536 + st.st_size > limit:
                raise ResourceExhausted(f"archive of {where} would exceed the {limit}-byte limit")
            with _owned(self._reopen(pin, os.O_RDONLY)) as fd:
                data = _read_at_most(fd, st.st_size)
            self._add(tf, buf, self._info(rel, st, tarfile.REGTYPE), data, limit, where)
        elif stat.S_ISLNK(mode):
            info = self._info(rel, st, tarfile.SYMTYPE)
            info.linkname = os.readlink("", dir_fd=pin)
            self._add(tf, buf, info, None, limit, where)
        elif stat.S_ISFIFO(mode):
            self._add(tf, buf, self._info(rel, st, tarfile.FIFOTYPE), None, limit, where)
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            info = self._info(rel, st, tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE)
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
            self._add(tf, buf, info, None, limit, where)
        # sockets cannot be archived; skipped like tar does

    def _info(self, rel: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(rel)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.uid, info.gid = st.st_uid, st.st_gid
        if self._ids is not None:
            info.uid, info.gid = self._ids.to_sandbox(st.st_uid), self._ids.to_sandbox(st.st_gid)
        return info

    @staticmethod
    def _add(tf: tarfile.TarFile, buf: io.BytesIO, info: tarfile.TarInfo, data: bytes | None,
             limit: int, where: str) -> None:
        if data is not None:
            info.size = len(data)  # what we actually read, even if the file changed size
        tf.addfile(info, io.BytesIO(data) if data is not None else None)
        if buf.tell() > limit:
            raise ResourceExhausted(f"archive of {where} would exceed the {limit}-byte limit")
