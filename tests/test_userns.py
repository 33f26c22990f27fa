"""Sandboxes with a user namespace (`create --userns`): root inside is host uid 100000, not
host root; files keep the sandbox's own ids on disk and through the files API; checkpoint,
rollback, fork and restore from disk keep processes' ids. A real daemon, real namespaces.
(The escape catalog, tests/test_escape.py, runs every attempt in such a sandbox too.)"""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltabox import FailedPrecondition, Sandbox
from deltabox.sandbox.userns import IdMap

from conftest import DaemonProc, new_sandbox, private_daemon, wait_for

BASE = 100000  # deltaboxd's default --userns-range 100000:65536
# A background process running as an ordinary user (uid/gid 1000) inside the sandbox.
AS_USER = "setpriv --reuid 1000 --regid 1000 --clear-groups"


@pytest.fixture
def ubox(daemon: DaemonProc) -> Iterator[Sandbox]:
    with new_sandbox(daemon.socket, user_namespace=True) as s:
        yield s


def host_ids(pid: int) -> tuple[int, int]:
    """Real uid and gid of a host pid, as the host sees them."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    uid = next(int(x.split()[1]) for x in status if x.startswith("Uid:"))
    gid = next(int(x.split()[1]) for x in status if x.startswith("Gid:"))
    return uid, gid


def host_pid_of(sbx: Sandbox, pattern: str) -> int:
    """The host pid of the sandbox process (in its init's pid namespace) whose command line
    contains `pattern` (templates are disguised: their command lines never match)."""
    ns = os.readlink(f"/proc/{sbx.info().init_pid}/ns/pid")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if pattern in cmd:
            return int(pid)
    raise AssertionError(f"no process matching {pattern!r} in sandbox {sbx.id}")


def test_root_inside_is_an_unprivileged_host_id(ubox: Sandbox) -> None:
    assert ubox.info().uid_map == f"0 {BASE} 65536"
    r = ubox.exec("id -u; id -g; cat /proc/self/uid_map /proc/self/gid_map; "
                  "sleep 300 >/dev/null 2>&1 & echo started")
    lines = r.stdout.split()
    assert lines[:2] == ["0", "0"], r.stdout
    assert lines[2:8] == ["0", str(BASE), "65536"] * 2, r.stdout
    # The host sees sandbox root as BASE, and init too.
    assert host_ids(host_pid_of(ubox, "sleep 300")) == (BASE, BASE)
    assert host_ids(ubox.info().init_pid) == (BASE, BASE)


def test_host_files_of_unmapped_owners_stay_closed() -> None:
    """Sandbox root's capabilities hold only in its user namespace: a host file visible
    through the host-root image, mode 0600, owned by an id the sandbox does not map (the
    image's ids 0..65535 show inside as themselves; 200000 does not), cannot be read."""
    tag = secrets.token_hex(6)
    secret = Path(f"/etc/dbx-userns-{tag}")
    secret.write_text(f"secret-{tag}\n")
    os.chown(secret, 200000, 200000)
    secret.chmod(0o600)
    try:
        sock = os.environ["DELTABOX_SOCKET"]
        with Sandbox.create(socket=sock, user_namespace=True) as ubox, \
                new_sandbox(sock) as plain:
            probe = f"stat -c %u:%g {secret}; cat {secret}"
            got = ubox.exec(probe)
            assert got.stdout.splitlines()[0] == "65534:65534"  # unmapped: nobody
            assert got.exit_code != 0 and "Permission denied" in got.stderr
            # The same image, no user namespace: host root reads it (the baseline).
            assert plain.exec(probe).stdout.splitlines()[1] == f"secret-{tag}"
        assert secret.read_text() == f"secret-{tag}\n"
    finally:
        secret.unlink()


def test_files_keep_the_sandbox_ids(ubox: Sandbox) -> None:
    """Files made inside, by the files API and restored by a rollback are owned by the
    sandbox's own ids inside, and on disk (its layers are idmapped)."""
    ubox.exec(f"mkdir -p /workspace/u && chown 1000:1000 /workspace/u && "
              f"{AS_USER} sh -c 'echo mine > /workspace/u/own'")
    ubox.files.write("/workspace/api.txt", b"from the api")
    ubox.files.write("/workspace/u/by-api", b"in a user's dir")  # takes the dir's owner
    ubox.files.write("/workspace/u/own", b"replaced")            # keeps the file's owner
    owners = "stat -c '%n %u:%g' /workspace/api.txt /workspace/u /workspace/u/own " \
             "/workspace/u/by-api"
    want = ["/workspace/api.txt 0:0", "/workspace/u 1000:1000", "/workspace/u/own 1000:1000",
            "/workspace/u/by-api 1000:1000"]
    assert ubox.exec(owners).stdout.splitlines() == want
    assert ubox.exec(f"{AS_USER} cat /workspace/u/own").stdout == "replaced"
    tar = tarfile.open(fileobj=io.BytesIO(ubox.files.download_tar("/workspace/u")))
    assert {(m.name.split("/")[-1], m.uid, m.gid) for m in tar.getmembers() if m.isfile()} \
        == {("own", 1000, 1000), ("by-api", 1000, 1000)}
    cp = ubox.checkpoint()
    ubox.exec("rm -rf /workspace/u /workspace/api.txt")
    ubox.rollback(cp)
    assert ubox.exec(owners).stdout.splitlines() == want


def test_processes_keep_their_ids_through_rollback_and_fork(ubox: Sandbox) -> None:
    s = ubox.session("main")
    s.run("X=kept")
    ubox.exec("for i in $(seq 300); do /bin/true; done")   # pids above a fork's first ones
    ubox.exec("sleep 1000 >/dev/null 2>&1 &")
    cp = ubox.checkpoint(mode="full")
    s.run("X=changed")
    ubox.exec("pkill sleep")
    res = ubox.rollback(cp)
    assert res.process_state == "restored", res.note
    assert s.run("echo $X; id -u").stdout.split() == ["kept", "0"]
    assert ubox.exec("ps -o uid=,args= -C sleep").stdout.split() == ["0", "sleep", "1000"]
    assert host_ids(host_pid_of(ubox, "sleep 1000")) == (BASE, BASE)
    kid = ubox.fork(cp)[0]
    try:
        assert kid.process_state == "restored", kid.fork_note
        assert kid.info().uid_map == f"0 {BASE} 65536"
        k = kid.session("main").run("echo $X; id -u; cat /proc/self/uid_map").stdout.split()
        assert k == ["kept", "0", "0", str(BASE), "65536"]
        assert kid.exec("ps -o uid= -C sleep").stdout.split() == ["0"]
        assert host_ids(host_pid_of(kid, "sleep 1000")) == (BASE, BASE)
        # Its init (root of the user namespace) raised the fork's pid counter above the
        # restored processes' pids (test_cr.py: ..._take_pids_above_its_restored_ones).
        top = int(kid.exec("pgrep -x sleep").stdout)
        assert top > 300, top
        pids = [int(kid.exec("sh -c 'echo $$'").stdout)]
        while pids[-1] < top and len(pids) < 10:   # init takes the signal soon after
            time.sleep(0.1)
            pids.append(int(kid.exec("sh -c 'echo $$'").stdout))
        assert pids[-1] > top, (top, pids)
        # A fork of the fork shares the family's user namespace, one level deeper.
        cp2 = kid.checkpoint(mode="full")
        grandkid = kid.fork(cp2)[0]
        try:
            assert grandkid.process_state == "restored", grandkid.fork_note
            assert grandkid.session("main").run("echo $X; id -u").stdout.split() \
                == ["kept", "0"]
        finally:
            grandkid.kill()
    finally:
        kid.kill()


def test_sockets_come_back_in_the_namespace(ubox: Sandbox) -> None:
    """A UDP server beside a connected and an unused UDP socket, and a TCP listener with
    options its connections inherit, in a sandbox of its own user namespace: the sockets
    are made again by the sandbox's root (its namespace's, not the host's) with their
    addresses and options, through a rollback and a fork."""
    from test_cr import ASK_OPTIONS, TCP_OPTIONS_SERVER, UDP_SERVER, _ask_udp

    ubox.files.write("udp.py", UDP_SERVER)
    ubox.files.write("opts.py", TCP_OPTIONS_SERVER)
    ubox.exec("cd /workspace; nohup python3 udp.py >/dev/null 2>&1 &")
    ubox.exec("cd /workspace; nohup python3 opts.py >/dev/null 2>&1 &")
    wait_for(lambda: ubox.files.exists("udp-ready") and ubox.files.exists("listening"))
    n, udp = _ask_udp(ubox, "state")
    m, mine, got = json.loads(ubox.exec(ASK_OPTIONS).stdout)
    cp = ubox.checkpoint(mode="full")
    r = ubox.rollback(cp)
    assert r.process_state == "restored", r.note
    kid = ubox.fork(cp)[0]
    try:
        assert kid.process_state == "restored", kid.fork_note
        for box in (ubox, kid):
            assert _ask_udp(box, "state") == [n + 1, udp]
            assert json.loads(box.exec(ASK_OPTIONS).stdout) == [m + 1, mine, got]
    finally:
        kid.kill()


def test_restore_from_disk_restores_ids_in_the_namespace() -> None:
    """Dumps keep ids as the process's user namespace sees them (0, not the host's 100000):
    after kill -9, a daemon restarted with another --userns-range restores the process from
    disk as root of the sandbox, now host id 300000 (a dump of host ids would have asked
    for setresuid(100000), which that namespace does not map)."""
    with private_daemon("dbx-userns-") as d:
        d.start("--no-inspector")
        sbx = Sandbox.create(socket=d.socket, user_namespace=True)
        sbx.exec("sleep 1000 >/dev/null 2>&1 &")
        cp = sbx.checkpoint(mode="full")
        deadline = time.monotonic() + 60
        while True:
            c = next(c for c in sbx.checkpoints() if c.id == cp.id)
            line = next((r for r in c.reasons if r.startswith("process dump:")), "")
            if "pending" not in line or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "complete" in line, line
        d.kill9()
        d.start("--no-inspector", "--userns-range", "300000:65536")
        sbx = Sandbox.connect(sbx.id, socket=d.socket)
        assert sbx.info().uid_map == "0 300000 65536"
        r = sbx.rollback(cp)
        assert r.process_state == "restored" and "restored from disk" in r.note, r.note
        assert sbx.exec("ps -o uid=,gid= -C sleep").stdout.split() == ["0", "0"]
        assert host_ids(host_pid_of(sbx, "sleep 1000")) == (300000, 300000)
        sbx.kill()


def test_a_sandbox_without_userns_is_unchanged(daemon: DaemonProc) -> None:
    with new_sandbox(daemon.socket) as sbx:
        assert sbx.info().uid_map == ""
        assert sbx.exec("cat /proc/self/uid_map").stdout.split() == ["0", "0", "4294967295"]


@pytest.mark.parametrize("bad", ["0:65536", "100000", "100000:0", "x:y", "4294967000:1000"])
def test_userns_range_is_validated(bad: str) -> None:
    with pytest.raises(ValueError, match="BASE"):
        IdMap.parse(bad)


def test_an_image_without_idmapped_mounts_is_a_clear_error(daemon: DaemonProc) -> None:
    """An image on a filesystem that cannot be idmapped (ramfs, for real) cannot back a
    sandbox with a user namespace: FAILED_PRECONDITION saying what to do, nothing left
    behind; the same image serves a sandbox without one."""
    base = Path(tempfile.mkdtemp(prefix="dbx-ramfs-", dir="/var/tmp"))
    subprocess.run(["mount", "-t", "ramfs", "dbx-ramfs", str(base)], check=True)
    try:
        for d in ("bin", "etc", "workspace", "tmp"):
            (base / d).mkdir()
        before = {s.id for s in Sandbox.list(socket=daemon.socket)}
        with pytest.raises(FailedPrecondition, match="support idmapped mounts"):
            Sandbox.create(socket=daemon.socket, image=str(base), user_namespace=True)
        assert {s.id for s in Sandbox.list(socket=daemon.socket)} == before
        with new_sandbox(daemon.socket, image=str(base)) as plain:
            assert plain.info().state == "running"
    finally:
        subprocess.run(["umount", str(base)], check=True)
        base.rmdir()


def test_posix_message_queues_come_back_in_a_user_namespace(ubox: Sandbox) -> None:
    """The mqueue file system of an IPC namespace owned by a user namespace makes files only
    for ids that namespace maps: the daemon's first try made a queue as host root and got
    EOVERFLOW, so the rollback restarted the processes. Made with the owner's ids, each
    queue comes back owned by sandbox root, in a rollback and in a fork."""
    from test_cr import PMQ, PMQ_SH, _pmq_answer

    ubox.files.write("pmq.py", PMQ)
    ubox.exec(f"nohup {PMQ_SH} serve >/dev/null 2>&1 &")
    wait_for(lambda: ubox.files.exists("ready"), what="the queue holder")
    report = (f"{PMQ_SH} report jobs results left; python3 -c \"import ctypes, os; "
              "q = ctypes.CDLL('librt.so.1').mq_open(b'/jobs', os.O_RDONLY); "
              "print(os.fstat(q).st_uid, os.fstat(q).st_gid)\"")
    before = ubox.exec(report).stdout
    assert before.endswith("left 0o604 2x32 3:l2,2:l1\n0 0\n"), before
    cp = ubox.checkpoint()
    assert cp.kind == "full", cp.reasons
    ubox.exec(f"{PMQ_SH} take jobs && {PMQ_SH} unlink left")
    rb = ubox.rollback(cp)
    assert rb.process_state == "restored", rb.note
    assert ubox.exec(report).stdout == before
    assert _pmq_answer(ubox).endswith(" 5:b,5:d,1:a,1:c")
    [child] = ubox.fork(cp)
    try:
        assert child.exec(report).stdout == before
    finally:
        child.kill()
