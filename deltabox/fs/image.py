"""Images: the read-only bottom of a sandbox's overlay.

"" is the host's own root (works on a fresh machine, nothing to download; secrets masked).
A directory is used in place. A tarball (`docker export` format, optionally compressed) is
unpacked once into the store, keyed by its path, size and mtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument, NotFound, ResourceExhausted

HOST = "host"
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Image:
    spec: str          # what the user gave, normalised ("host", an absolute dir or tarball)
    rootfs: Path       # the directory used as the overlay's bottom layer
    key: str           # names the mask built for it
    host_root: bool


def resolve(spec: str, images_dir: Path) -> Image:
    """Turn a user's --image into an Image, unpacking a tarball if needed."""
    if spec in ("", HOST, "/"):
        return Image(HOST, Path("/"), HOST, True)
    path = Path(spec)
    if not path.is_absolute():
        raise InvalidArgument(f"image path must be absolute (the daemon has no cwd): {spec!r}")
    try:
        return _resolve_path(spec, path, images_dir)
    except OSError as e:  # e.g. /proc/1/root of a process the daemon may not look into
        raise InvalidArgument(f"image {spec} cannot be read by the daemon ({e.strerror}): "
                              "give a root file system directory or a tarball") from e


def _resolve_path(spec: str, path: Path, images_dir: Path) -> Image:
    if not path.exists():
        raise NotFound(f"image {spec} does not exist (give a rootfs directory or a tarball)")
    if path.is_dir():
        real = path.resolve()
        if real == Path("/"):  # e.g. /proc/self/root: the host, with its secrets masked
            return Image(HOST, Path("/"), HOST, True)
        if _fs_type(real) == PROC_SUPER_MAGIC:
            raise InvalidArgument(f"image {spec} is on procfs, which cannot be an overlay "
                                  "layer: give a root file system directory or a tarball")
        return Image(str(real), real, "dir-" + _digest(str(real)), False)
    if not tarfile.is_tarfile(path):
        raise InvalidArgument(f"image {spec} is neither a directory nor a tar archive")
    st = path.stat()
    key = "tar-" + _digest(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return Image(str(path.resolve()), _unpack(path, images_dir / key), key, False)


PROC_SUPER_MAGIC = 0x9FA0


def _fs_type(path: Path) -> int:
    """statfs(2)'s f_type (the first field of struct statfs), 0 if unknown."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return 0
    return ctypes.c_long.from_buffer(buf).value


def from_spec(spec: str, images_dir: Path) -> Image:
    """An Image recorded in metadata (already unpacked when it was first used)."""
    return resolve("" if spec == HOST else spec, images_dir)


def _digest(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:16]


def _unpack(tarball: Path, dest: Path) -> Path:
    rootfs = dest / "rootfs"
    if rootfs.is_dir():
        return rootfs
    tmp = dest / "rootfs.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # GNU tar as root keeps owners, modes, devices and xattrs exactly as exported.
    r = subprocess.run(["tar", "-x", "--numeric-owner", "--xattrs", "--xattrs-include=*",
                        "-f", str(tarball), "-C", str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if "No space" in r.stderr:
            raise ResourceExhausted(f"store full while unpacking {tarball}")
        raise InvalidArgument(f"cannot unpack image {tarball}: {r.stderr.strip()[:500]}")
    os.chmod(tmp, 0o755)
    tmp.rename(rootfs)
    return rootfs
