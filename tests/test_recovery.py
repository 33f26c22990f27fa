"""kill -9 of deltaboxd and a restart: committed checkpoints survive, nothing leaks."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from deltabox import Sandbox
from deltabox.fs import btrfs
from deltabox.sandbox.cgroups import parent_name

from conftest import DaemonProc, launchers_below, leaks, settle


@pytest.fixture
def own_daemon():
    base = Path(tempfile.mkdtemp(prefix="dbx-recover-", dir="/var/tmp"))
    d = DaemonProc(base / "state", str(base / "d.sock"), None, base / "daemon.log")
    try:
        yield d
    finally:
        d.stop()
        settle(base)


def _dbx_processes(d: DaemonProc) -> set[int]:
    """Processes of this daemon's sandboxes (their command lines name its cgroup parent)."""
    parent = parent_name(str(d.state_dir.resolve()))
    out = subprocess.run(["pgrep", "-f", f"libexec/dbx-.*{parent}"], capture_output=True,
                         text=True)
    return {int(p) for p in out.stdout.split()}


def test_kill9_then_restart(own_daemon: DaemonProc) -> None:
    d = own_daemon
    d.start()
    sbx = Sandbox.create(socket=d.socket)
    sbx.files.write("state.txt", "at checkpoint")
    sbx.exec("nohup sleep 1000 >/dev/null 2>&1 &")
    cp = sbx.checkpoint()
    sbx.files.write("state.txt", "after checkpoint")
    kid = sbx.fork(cp)[0]
    deadline = time.monotonic() + 15   # the kid's init, and a spare for the next fork
    while len(launchers_below(sbx.info().init_pid)) < 4:
        assert time.monotonic() < deadline, launchers_below(sbx.info().init_pid)
        time.sleep(0.05)
    old_init = sbx.info().init_pid
    d.kill9()
    # Sandbox processes outlive the daemon until it comes back...
    assert _dbx_processes(d)
    # ...plus an uncommitted layer, as if the crash hit in the middle of a checkpoint.
    store = d.state_dir / "store" / "layers"
    btrfs.create_subvolume(str(store / "L-halfmade01"))
    # ...and a clone made but not yet renamed into place (fs/store.py BtrfsStore._staged).
    (store / ".new-L-halfmade02").mkdir()
    btrfs.snapshot(str(store / "L-halfmade01"), str(store / ".new-L-halfmade02" / "layer"),
                   False)
    d.start()
    assert not (store / "L-halfmade01").exists()
    assert not (store / ".new-L-halfmade02").exists()
    sbx = Sandbox.connect(sbx.id, socket=d.socket)
    assert sbx.info().state == "running"
    assert sbx.files.read("state.txt") == b"after checkpoint"  # files survive a restart
    assert "sleep" not in sbx.exec("ps -eo comm").stdout      # processes do not
    assert launchers_below(old_init) == []                     # nor the fork spare
    assert [c.id for c in sbx.checkpoints()] == [cp.id]
    sbx.rollback(cp)
    assert sbx.files.read("state.txt") == b"at checkpoint"
    again = sbx.fork(cp)[0]
    assert again.files.read("state.txt") == b"at checkpoint"
    assert Sandbox.connect(kid.id, socket=d.socket).files.read("state.txt") == b"at checkpoint"
    d.stop()
    # After a clean stop: no processes of ours, no mounts, no cgroups.
    assert _dbx_processes(d) == set()
    assert not leaks(d.state_dir.parent)


def test_restart_keeps_a_layer_only_forks_stack(own_daemon: DaemonProc) -> None:
    """A shared-layer fork's children stack its checkpoint's layer: once that checkpoint is deleted and
    its sandbox removed, no row names the layer as its own, and recovery must still keep
    it (it deletes layers nothing references)."""
    d = own_daemon
    d.start()
    src = Sandbox.create(socket=d.socket)
    src.files.write("/data/f", "base")
    cp = src.checkpoint()
    kid = src.fork(cp, shared_layer=True)[0]
    src.delete_checkpoint(cp)
    src.kill()
    d.kill9()
    d.start()
    kid = Sandbox.connect(kid.id, socket=d.socket)
    assert kid.files.read("/data/f") == b"base"
    kid.kill()


def test_second_daemon_on_same_state_dir_is_refused(own_daemon: DaemonProc) -> None:
    d = own_daemon
    d.start()
    r = subprocess.run(["python", "-m", "deltabox.daemon.main", "--state-dir", str(d.state_dir),
                        "--socket", d.socket + "2"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH=os.path.dirname(os.sys.executable) + ":" +
                                os.environ["PATH"]))
    assert r.returncode != 0 and "another daemon" in r.stderr


def test_durable_store_is_reported(own_daemon: DaemonProc) -> None:
    import deltabox

    own_daemon.start("--durable")
    info = deltabox.info(socket=own_daemon.socket)
    assert info.store_backend == "btrfs-loop" and info.store_durability == "host-crash-safe"
    mounts = open("/proc/self/mounts").read()
    line = next(x for x in mounts.splitlines() if str(own_daemon.state_dir / "store") in x)
    assert "nobarrier" not in line
