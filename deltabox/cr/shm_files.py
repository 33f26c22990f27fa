"""Named files of the sandbox's /dev/shm that its processes hold: POSIX shared memory
(`shm_open`: `multiprocessing.shared_memory.SharedMemory` and `ShareableList`), named
semaphores (`sem_open`: /dev/shm/sem.NAME, mapped), a tmpfs file a program keeps there.

/dev/shm is a tmpfs made afresh for each generation (native/mkroot.c), so the snapshot
does not hold its files, and a restored process reopening one by path found nothing. At
the checkpoint (every process stopped) each /dev/shm file a process holds open or maps is
copied (content, mode, owner; at most MAX_BYTES) into a memfd of the daemon, like a
deleted file (cr/unlinked.py). A restore makes it again at its path in the new
generation's /dev/shm, through that generation's mount namespace (native.mntns_open),
before any process reopens it by path; its shared mappings are mapped again from it
(engine._PipePlan.remaps), so processes that shared it share the new file. A file of
/dev/shm no process holds is not kept (the tmpfs of a new generation starts empty).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass

from . import native
from .capture import ProcessRecord, Refusal, in_dev_shm
from .unlinked import MAX_BYTES, copy_data, data_bytes


@dataclass
class ShmFile:
    path: str                  # /dev/shm/NAME
    mode: int                  # permission bits
    uid: int
    gid: int
    size: int
    saved: int | None = None   # our memfd holding its content at the checkpoint
    # its ctime then (0: unknown). Reading it marks the ctime queried, so any later write
    # is stamped with a fine-grained, different time (multigrain timestamps, tmpfs):
    # private_maps.copied_stale tells a write just before the checkpoint from one after.
    ctime_ns: int = 0


def named_again(records: list[ProcessRecord]) -> None:
    """Give each shared mapping of a /dev/shm file whose mapped name was removed while the
    file kept another name that name, so it is copied and mapped again as a named file.
    glibc's sem_open makes a semaphore under a temporary name, maps it, links it to its
    own name and removes the temporary one: every semaphore of Python's multiprocessing
    with the spawn or forkserver start method (which unlinks it only when it is freed)
    shows in maps as that removed name. Looked at only for such mappings (one listing of
    /dev/shm per process holding one). Call with the processes stopped."""
    for rec in records:
        names: dict[int, str] | None = None
        for i, m in enumerate(rec.shared):
            base = m.path.removesuffix(" (deleted)")
            if base == m.path or not in_dev_shm(base):
                continue
            try:
                st = os.stat(f"/proc/{rec.pid}/map_files/{m.where}")
            except OSError:
                continue   # unlinked.capture says why
            if not st.st_nlink:
                continue
            if names is None:
                names = _dev_shm_names(rec.pid, st.st_dev)
            name = names.get(st.st_ino)
            if name is not None:
                rec.shared[i] = dataclasses.replace(m, path=name)


def _dev_shm_names(pid: int, dev: int) -> dict[int, str]:
    """Inode -> /dev/shm/NAME of the regular files of pid's /dev/shm on device `dev`."""
    out: dict[int, str] = {}
    try:
        with os.scandir(f"/proc/{pid}/root/dev/shm") as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_dev == dev:
                    out.setdefault(st.st_ino, f"/dev/shm/{e.name}")
    except OSError:
        pass
    return out


def held(rec: ProcessRecord) -> set[str]:
    """The /dev/shm files rec holds open or maps (shared, or privately: private_maps.py
    maps one again from the copy if the live file changes)."""
    paths = {f.path for f in rec.fds if f.kind == "file" and not f.deleted}
    paths |= {m.path for m in [*rec.shared, *rec.mapped_ro] if m.named_file}
    paths |= {m.path for m in rec.mapped_private}
    return {p for p in paths if in_dev_shm(p)}


def capture(records: list[ProcessRecord]) -> tuple[list[ShmFile], list[Refusal]]:
    """Copy every /dev/shm file the processes hold. Call with them all stopped."""
    out: list[ShmFile] = []
    refused: list[Refusal] = []
    seen: set[str] = set()
    try:
        for rec in records:
            for path in sorted(held(rec) - seen):
                seen.add(path)
                got = _copy(rec.pid, path)
                if isinstance(got, str):
                    refused.append(Refusal(rec.nspid, rec.cmd, f"{path}: {got}"))
                else:
                    out.append(got)
    except BaseException:
        close_saved(out)
        raise
    if refused:
        close_saved(out)
        return [], refused
    return out, refused


def _copy(pid: int, path: str) -> ShmFile | str:
    """The file at `path` as process `pid` sees it, copied into a memfd; or why not."""
    try:
        fd = os.open(f"/proc/{pid}/root{path}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size > MAX_BYTES and (n := data_bytes(fd, st.st_size)) > MAX_BYTES:
            return (f"{n} bytes written in /dev/shm (more than {MAX_BYTES >> 20} MiB are "
                    "not copied at a checkpoint)")
        saved = os.memfd_create("dbx-shm", os.MFD_CLOEXEC)
        try:
            copy_data(saved, fd, st.st_size)
        except BaseException:
            os.close(saved)
            raise
        return ShmFile(path, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size,
                       saved, st.st_ctime_ns)
    finally:
        os.close(fd)


def make(f: ShmFile, mntns_fd: int) -> int:
    """f made again in the generation of `mntns_fd` (its /dev/shm), filled from the copy:
    our read-write fd of it."""
    assert f.saved is not None
    fd = native.mntns_open(mntns_fd, f.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, f.mode)
    try:
        copy_data(fd, f.saved, f.size)
        os.fchown(fd, f.uid, f.gid)
        os.fchmod(fd, f.mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def close_saved(files: list[ShmFile]) -> None:
    for f in files:
        if f.saved is not None:
            os.close(f.saved)
            f.saved = None
