"""A working directory deleted under its process (`cd build && rm -rf ../build`).

The kernel keeps such a directory alive, empty and nameless, while a process is in it:
lookups relative to it fail (ENOENT), so do creating anything in it and `getcwd`, and `..`
still leads to the directory that held it. A restore enters a process's cwd by path (chdir
in the child), which the checkpoint's tree lacks. So the spawned child makes a stand-in
where the directory was (with its missing parents, under their own names; under another
name, `.NAME.deletedN`, where its own is taken again, as after `rm -rf build && mkdir
build`), enters it and removes it and those parents again before it runs, then sets the
times of the directory they were made in back (native/fork_template.c: enter_cwd). Its cwd
is then a deleted, empty directory whose `..` leads where the original's did. What differs:
`stat(".")` shows the stand-in's inode, owner and times, two processes that shared the
directory have one each, `/proc/PID/cwd` names the stand-in's name where it took another,
and the directory the stand-ins were made in has the restore's time as its ctime.
"""

from __future__ import annotations

import errno
import os

from ..fs.files import open_in_root

DELETED = " (deleted)"
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def is_deleted(cwd: str) -> bool:
    """cwd as /proc/PID/cwd reads: a directory removed since the process entered it."""
    return cwd.endswith(DELETED)


def stand_ins(rootfd: int, cwd: str) -> tuple[str, list[str]]:
    """For a process whose cwd reads `cwd`: the path its restored child enters, and the
    directories it makes to enter it (outermost first; none for a cwd that exists),
    looked up in the restored tree at rootfd."""
    if not is_deleted(cwd):
        return cwd, []
    parts = [p for p in cwd.removesuffix(DELETED).split("/") if p]
    fd = open_in_root(rootfd, "/", _DIR)
    at = 0
    try:
        while at < len(parts) - 1:            # down the parents that are still there
            try:
                sub = os.open(parts[at], _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise
                break                         # gone, or something else has its name
            os.close(fd)
            fd, at = sub, at + 1
        first = _free_name(fd, parts[at])
    finally:
        os.close(fd)
    path = "/" + "/".join(parts[:at])
    made = []
    for name in [first, *parts[at + 1:]]:     # below the first, the stand-ins are ours
        path = os.path.join(path, name)
        made.append(path)
    return path, made


def _free_name(fd: int, name: str) -> str:
    """`name` if nothing in directory fd has it, else the first free `.name.deletedN`."""
    for n in range(1000):
        candidate = name if n == 0 else f".{name}.deleted{n}"
        try:
            os.stat(candidate, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return candidate
    raise FileExistsError(errno.EEXIST, f"no free name for a stand-in of {name!r}")
