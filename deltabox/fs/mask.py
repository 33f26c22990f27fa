"""The mask layer: a read-only overlay layer between the image and the sandbox's writable layer.

It hides host secrets when the image is the host's own root (whiteouts and opaque directories),
and guarantees the directories every sandbox needs (/workspace, /tmp, /proc, /sys, /dev) exist,
whatever the image. Overlay semantics used: a character device 0:0 hides the lower entry of
the same name; a directory with xattr trusted.overlay.opaque="y" hides all lower children.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat
from pathlib import Path

# Directories that start empty and writable (opaque over the host's contents).
HOST_OPAQUE = ("/root", "/home", "/tmp", "/var/tmp", "/run", "/var/run", "/var/log",
               "/workspace", "/mnt", "/media", "/var/lib/deltabox", "/var/mail", "/var/spool")
# Files that vanish (whiteouts), globbed on the host.
HOST_HIDDEN = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-",
               "/etc/ssh/ssh_host_*", "/etc/ssl/private", "/etc/sudoers", "/etc/sudoers.d",
               "/etc/machine-id", "/var/lib/dbus/machine-id")
NEEDED_DIRS = ("/workspace", "/tmp", "/proc", "/sys", "/dev", "/root", "/run")


def _whiteout(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _opaque(path: Path, mode: int = 0o755) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    os.setxattr(path, "trusted.overlay.opaque", b"y")


def _copy_parent_modes(mask: Path, image: Path, rel: str) -> None:
    """Parents created in the mask take the image's mode, or they would shadow it."""
    parts = Path(rel).parts[1:-1]
    for i in range(1, len(parts) + 1):
        sub = Path(*parts[:i])
        src = image / sub
        if src.is_dir() and not src.is_symlink():
            (mask / sub).mkdir(exist_ok=True)
            st = src.stat()
            os.chmod(mask / sub, stat.S_IMODE(st.st_mode))


def build_mask(mask: Path, image: Path, extra_hidden: list[str], host_root: bool) -> None:
    """(Re)build the mask for `image` at `mask` (a fresh directory each daemon start)."""
    if mask.exists():
        shutil.rmtree(mask)
    mask.mkdir(parents=True)
    os.chmod(mask, stat.S_IMODE(image.stat().st_mode))
    if host_root:
        for rel in HOST_OPAQUE:
            if (image / rel[1:]).is_symlink():
                continue  # e.g. /var/run -> /run: the target is masked already
            _copy_parent_modes(mask, image, rel)
            mode = 0o1777 if rel in ("/tmp", "/var/tmp") else 0o700 if rel == "/root" else 0o755
            _opaque(mask / rel[1:], mode)
        for pattern in HOST_HIDDEN:
            for hit in glob.glob(str(image / pattern[1:])):
                rel = "/" + os.path.relpath(hit, image)
                _copy_parent_modes(mask, image, rel)
                _whiteout(mask / rel[1:])
        for rel in extra_hidden:
            if (image / rel.lstrip("/")).exists() and not (mask / rel.lstrip("/")).exists():
                _copy_parent_modes(mask, image, rel)
                _whiteout(mask / rel.lstrip("/"))
    for rel in NEEDED_DIRS:
        target = mask / rel[1:]
        if not target.exists() and not (image / rel[1:]).exists():
            mode = 0o1777 if rel == "/tmp" else 0o755
            target.mkdir(parents=True, exist_ok=True)
            os.chmod(target, mode)
