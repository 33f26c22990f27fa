"""Sandboxes from a rootfs directory and from a `docker export`-style tarball."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

import deltabox
from deltabox import Sandbox


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory) -> Path:
    """A minimal rootfs: busybox-free, built from the host's bash and its libraries."""
    root = tmp_path_factory.mktemp("rootfs")
    for d in ("bin", "etc", "lib", "lib64", "usr/bin"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for tool in ("bash", "cat", "ls", "echo"):
        src = shutil.which(tool)
        assert src
        shutil.copy2(src, root / "bin" / tool)
        libs = subprocess.run(["ldd", src], capture_output=True, text=True).stdout
        for word in libs.split():
            if word.startswith("/") and Path(word).exists():
                dst = root / word.lstrip("/")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(word, dst)
    (root / "etc" / "image-name").write_text("tiny\n")
    return root


def test_image_directory(daemon, rootfs: Path) -> None:
    with Sandbox.create(image=str(rootfs), socket=daemon.socket) as sbx:
        r = sbx.exec(["/bin/bash", "-c", "cat /etc/image-name; ls -A /usr/bin; echo end"])
        assert r.stdout == "tiny\nend\n"
        sbx.exec(["/bin/bash", "-c", "echo changed > /etc/image-name"])
        cp = sbx.checkpoint()
        sbx.exec(["/bin/bash", "-c", "echo again > /etc/image-name"])
        sbx.rollback(cp)
        assert sbx.files.read("/etc/image-name") == b"changed\n"
    assert (rootfs / "etc" / "image-name").read_text() == "tiny\n"  # image untouched


def test_image_tarball(daemon, rootfs: Path, tmp_path: Path) -> None:
    tar = tmp_path / "image.tar"
    with tarfile.open(tar, "w") as t:
        t.add(rootfs, arcname=".")
    with Sandbox.create(image=str(tar), socket=daemon.socket) as sbx:
        assert sbx.exec(["/bin/cat", "/etc/image-name"]).stdout == "tiny\n"


def test_bad_images(daemon, tmp_path: Path) -> None:
    with pytest.raises(deltabox.NotFound):
        Sandbox.create(image="/nonexistent/image", socket=daemon.socket)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a tarball")
    with pytest.raises(deltabox.InvalidArgument):
        Sandbox.create(image=str(junk), socket=daemon.socket)
    with pytest.raises(deltabox.InvalidArgument):
        Sandbox.create(image="relative/path", socket=daemon.socket)
    # procfs cannot be an overlay layer: refused clearly (was an INTERNAL mount failure,
    # found by the API fuzzer)
    with pytest.raises(deltabox.InvalidArgument, match="procfs"):
        Sandbox.create(image="/proc", socket=daemon.socket)


def test_path_to_host_root_is_the_masked_host(daemon) -> None:
    """A directory that resolves to / (here /proc/self/root) is the host image, with the
    host's secrets masked, never the bare host root."""
    with Sandbox.create(image="/proc/self/root", socket=daemon.socket) as sbx:
        assert sbx.info().image == "host"
        r = sbx.exec(["bash", "-c", "cat /etc/shadow 2>/dev/null | wc -c"])
        assert r.stdout.strip() == "0"
