"""The copy backend, for hosts without btrfs or loop devices: same API, same results."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import deltabox
from deltabox import Sandbox
from conftest import DaemonProc, settle


@pytest.fixture(scope="module")
def copy_daemon():
    base = Path(tempfile.mkdtemp(prefix="dbx-copy-", dir="/var/tmp"))
    state = base / "state"
    state.mkdir()
    # The store must not share a filesystem with the image (the host root): use a tmpfs.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "dbx-copy-test", str(state)],
                   check=True)
    d = DaemonProc(state, str(base / "d.sock"), None, base / "daemon.log")
    try:
        d.start("--store", "copy")
        yield d
    finally:
        d.stop()
        subprocess.run(["umount", str(state)], check=False)
        settle(base)


def test_copy_store_checkpoint_rollback_fork(copy_daemon: DaemonProc) -> None:
    assert deltabox.info(socket=copy_daemon.socket).store_backend == "copy"
    with Sandbox.create(socket=copy_daemon.socket) as sbx:
        sbx.files.write("f", "one")
        a = sbx.checkpoint()
        sbx.files.write("f", "two")
        sbx.exec("rm -rf /usr/share/doc")
        b = sbx.checkpoint()
        sbx.rollback(a)
        assert sbx.files.read("f") == b"one"
        assert sbx.exec("test -d /usr/share/doc").exit_code == 0
        kid = sbx.fork(b)[0]
        try:
            assert kid.files.read("f") == b"two"
            assert kid.exec("test -d /usr/share/doc").exit_code == 1
        finally:
            kid.kill()
        d = sbx.diff(a, b)
        assert d.modified == ["/workspace/f"] and "/usr/share/doc" in d.deleted


def test_copy_store_on_the_image_filesystem_is_refused(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="dbx-copy-same-", dir="/var/tmp"))
    d = DaemonProc(base / "state", str(base / "d.sock"), None, base / "daemon.log")
    try:
        d.start("--store", "copy")
        with pytest.raises(deltabox.FailedPrecondition, match="same filesystem"):
            Sandbox.create(socket=d.socket)
        assert Sandbox.list(socket=d.socket) == []
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)
