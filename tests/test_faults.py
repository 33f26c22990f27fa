"""kill -9 of deltaboxd at named steps inside checkpoint, rollback, fork, rm and
delete-checkpoint (DELTABOX_CRASH_AT, deltabox/daemon/faults.py: the daemon really SIGKILLs
itself), then a restart without the switch: every checkpoint committed before the crash is
there and rolls back to its exact files, the interrupted operation either fully happened (the
crash came after its commit) or left no trace, and nothing leaks once the daemon stops.

Also: a full store during a checkpoint, and an OOM inside a sandbox during a checkpoint.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import deltabox
from deltabox import Sandbox
from deltabox.cr.capture import cmdline
from deltabox.daemon.faults import STEPS
from deltabox.sandbox.cgroups import parent_name

from conftest import DaemonProc, inspector_backend, leaks, settle, wait_for

# Fault tests run without the eBPF inspector (it loads for seconds in the background) and
# without warm ready generations; spare clones are uncommitted layers that recovery removes.
FLAGS = ("--no-inspector", "--warm-generations", "0")

# (step, operation, whether the operation is committed when the crash hits)
CASES = [
    ("checkpoint.frozen", "checkpoint", False),
    ("checkpoint.snapshotted", "checkpoint", False),
    ("checkpoint.snapshotted", "checkpoint-fs", False),
    ("checkpoint.captured", "checkpoint", False),
    ("checkpoint.before_commit", "checkpoint", False),
    ("checkpoint.after_commit", "checkpoint", True),
    ("rollback.killed", "rollback", False),
    ("rollback.generation", "rollback", False),
    ("rollback.before_commit", "rollback", False),
    ("rollback.after_commit", "rollback", True),
    ("rollback.restoring", "rollback", True),
    ("fork.cloned", "fork", False),
    ("fork.booted", "fork", False),
    ("fork.before_commit", "fork", False),
    ("remove.before_commit", "remove", False),
    ("remove.after_commit", "remove", True),
    ("remove.tearing_down", "remove", True),
    ("remove.before_layer_delete", "remove", True),
    ("delete_checkpoint.before_commit", "delete_checkpoint", False),
    ("delete_checkpoint.after_commit", "delete_checkpoint", True),
]
# How many times the setup passes each step before the operation under test.
SETUP_HITS = {"checkpoint": 3}


# Steps with a test of their own (below).
OWN_TESTS = {"checkpoint.answered"}  # two: fs and full checkpoints


def test_every_step_is_covered() -> None:
    assert {c[0] for c in CASES} | OWN_TESTS == set(STEPS)


@pytest.fixture(scope="module")
def base():
    """One state dir (and loop store) for the whole module: each test starts and stops its
    own daemon on it."""
    b = Path(tempfile.mkdtemp(prefix="dbx-faults-", dir="/var/tmp"))
    yield b
    settle(b)


@pytest.fixture
def d(base: Path):
    dp = DaemonProc(base / "state", str(base / "d.sock"), None, base / "daemon.log")
    try:
        yield dp
    finally:
        if dp.proc is not None and dp.proc.poll() is not None and dp.proc.returncode != 0:
            # a test that failed while its daemon was dead (killed at a crash point): a
            # start recovers what that daemon left (its sandboxes' processes, its mounts)
            try:
                dp.start(*FLAGS)
            except Exception:
                pass
        if dp.proc is not None and dp.proc.poll() is None:
            # whatever a failed test left: remove it, so the next test starts clean
            try:
                for s in Sandbox.list(socket=dp.socket):
                    Sandbox.connect(s.id, socket=dp.socket).kill()
            except Exception:
                pass
        dp.stop()


def _db(d: DaemonProc) -> tuple[dict[str, tuple[str, str | None]], dict[str, str]]:
    """Committed state read straight from SQLite: sandboxes {id: (layer, head)}, checkpoints
    {id: layer}."""
    con = sqlite3.connect(f"file:{d.state_dir / 'deltabox.db'}?mode=ro", uri=True)
    try:
        sbs = {r[0]: (r[1], r[2]) for r in con.execute(
            "SELECT id, layer_id, head_cp FROM sandboxes")}
        cps = {r[0]: r[1] for r in con.execute("SELECT id, layer_id FROM checkpoints")}
    finally:
        con.close()
    return sbs, cps


def _layers_on_disk(d: DaemonProc) -> set[str]:
    return {p.name for p in (d.state_dir / "store" / "layers").iterdir()}


def _sandbox_processes(d: DaemonProc) -> set[int]:
    parent = parent_name(str(d.state_dir.resolve()))
    out = subprocess.run(["pgrep", "-f", f"libexec/dbx-.*{parent}"], capture_output=True,
                         text=True)
    return {int(p) for p in out.stdout.split()}


def _wait_layers_settle(d: DaemonProc, timeout: float = 10.0) -> None:
    """Every layer on disk is referenced by a committed row and vice versa (layers of
    removed sandboxes go in the background: wait for that)."""
    deadline = time.monotonic() + timeout
    while True:
        sbs, cps = _db(d)
        referenced = {v[0] for v in sbs.values()} | set(cps.values())
        disk = _layers_on_disk(d)
        if disk == referenced or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert referenced <= disk, f"committed layers missing on disk: {referenced - disk}"
    assert disk == referenced, f"uncommitted layers left on disk: {disk - referenced}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step,op,committed", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_crash_at(d: DaemonProc, step: str, op: str, committed: bool) -> None:
    kind = op.split("-")[0]
    nth = SETUP_HITS.get(kind, 0) + 1
    d.start(*FLAGS, env={"DELTABOX_CRASH_AT": f"{step}:{nth}"})
    s = d.socket

    # ---- state committed before the crash
    by = Sandbox.create(socket=s)
    by.files.write("b.txt", "bystander")
    bcp = by.checkpoint(mode="fs")
    sb = Sandbox.create(socket=s)
    sb.files.write("a.txt", "v1")
    sb.session("main").run("cd /tmp && export X=1")
    # 24 MB resident: a fork into 4 sandboxes copies its template onto the second lane
    sb.exec("nohup python3 -c 'import time; x = b\"x\" * (24 << 20); "
            "open(\"/tmp/big\", \"w\").close(); time.sleep(1000)' >/dev/null 2>&1 &")
    sb.exec("while [ ! -e /tmp/big ]; do sleep 0.01; done", timeout=20)
    cp1 = sb.checkpoint(mode="full")
    sb.files.write("a.txt", "v2")
    cp2 = sb.checkpoint(mode="fs")
    sb.files.write("a.txt", "v3")
    content = {bcp.id: ("b.txt", b"bystander"), cp1.id: ("a.txt", b"v1"),
               cp2.id: ("a.txt", b"v2")}
    sbs_before, cps_before = _db(d)
    assert d.proc is not None and d.proc.poll() is None, "crashed during the setup"

    # ---- the operation: the daemon kills itself at `step`
    ops = {
        "checkpoint": lambda: sb.checkpoint(mode="fs" if op.endswith("-fs") else "full"),
        "rollback": lambda: sb.rollback(cp1),
        "fork": lambda: sb.fork(cp1, count=4),
        "remove": lambda: sb.kill(),
        "delete_checkpoint": lambda: sb.delete_checkpoint(cp2),
    }
    try:
        ops[kind]()
        # only a crash in the background after the reply (the teardown of the removed
        # sandbox, the deletion of its layers) may let it succeed
        assert step in ("remove.tearing_down", "remove.before_layer_delete"), \
            f"{op} succeeded despite the crash"
    except deltabox.DeltaBoxError as e:
        assert isinstance(e, deltabox.Unavailable), f"{type(e).__name__}: {e}"
    assert d.proc.wait(30) == -signal.SIGKILL
    assert f"killing deltaboxd (SIGKILL) at {step}" in d.log.read_text()
    if kind == "fork":  # the crash came with a template copy on the lane thread
        assert d.lanes_opened() >= 1
    assert _sandbox_processes(d), "sandbox processes should outlive the daemon"

    # ---- restart without the switch
    d.start(*FLAGS)
    deltabox.info(socket=s)
    sbs, cps = _db(d)
    expect_cps = set(cps_before)
    expect_sbs = set(sbs_before)
    head, files = cp2.id, b"v3"
    if kind == "checkpoint" and committed:
        (new,) = set(cps) - set(cps_before)
        content[new] = ("a.txt", b"v3")
        expect_cps.add(new)
        head = new
    elif kind == "rollback" and committed:
        head, files = cp1.id, b"v1"
    elif kind == "remove" and committed:
        expect_sbs.discard(sb.id)
        expect_cps -= {cp1.id, cp2.id}   # the family's last sandbox: its checkpoints go
    elif kind == "delete_checkpoint" and committed:
        expect_cps.discard(cp2.id)
        head = cp1.id                    # the head moves up to the deleted one's parent
    assert set(cps) == expect_cps, "checkpoints after the restart"
    assert set(sbs) == expect_sbs, "sandboxes after the restart"
    _wait_layers_settle(d)

    # every sandbox boots again on its committed files
    assert Sandbox.connect(by.id, socket=s).files.read("b.txt") == b"bystander"
    if sb.id in expect_sbs:
        sb = Sandbox.connect(sb.id, socket=s)
        info = sb.info()
        assert info.state == "running" and info.head_checkpoint_id == head
        assert sb.files.read("a.txt") == files
        assert sb.exec("echo ok").stdout == "ok\n"
    # every committed checkpoint rolls back to its exact content
    for cp_id, (path, data) in content.items():
        if cp_id not in expect_cps:
            continue
        owner = by if cp_id == bcp.id else sb
        owner.rollback(cp_id)
        assert owner.files.read(path) == data, f"rollback to {cp_id}"
    for cp_id in content:
        if cp_id not in expect_cps:
            with pytest.raises(deltabox.NotFound):
                Sandbox.connect(by.id, socket=s).rollback(cp_id)

    # ---- nothing leaks
    for info in Sandbox.list(socket=s):
        Sandbox.connect(info.id, socket=s).kill()
    _wait_layers_settle(d)
    assert _layers_on_disk(d) == set()
    d.stop()
    assert d.proc.returncode == 0
    assert _sandbox_processes(d) == set()
    assert not leaks(d.state_dir.parent)


@pytest.mark.timeout(120)
def test_crash_inside_a_background_checkpoint(d: DaemonProc) -> None:
    """A checkpoint promised at a command's end (exec checkpoint=) and cut by a kill -9
    before its commit: after the restart its id is unknown (never a half-made checkpoint),
    the sandbox runs on its last committed state, and nothing leaks."""
    d.start(*FLAGS, env={"DELTABOX_CRASH_AT": "checkpoint.before_commit:2"})
    s = d.socket
    sb = Sandbox.create(socket=s)
    sb.files.write("a.txt", "v1")
    cp1 = sb.checkpoint(mode="fs")
    promised = ""
    try:
        # The answer is sent once the checkpoint holds the sandbox's lock, and the crash
        # comes milliseconds later, in the background; should the kill win the race, the
        # call fails as the daemon being gone.
        promised = sb.exec("echo v2 > /workspace/a.txt", checkpoint="fs").checkpoint_id
        assert promised
    except deltabox.Unavailable:
        pass
    assert d.proc is not None and d.proc.wait(30) == -signal.SIGKILL
    d.start(*FLAGS)
    sbs, cps = _db(d)
    assert set(cps) == {cp1.id} and sbs[sb.id][1] == cp1.id
    _wait_layers_settle(d)
    sb = Sandbox.connect(sb.id, socket=s)
    if promised:
        with pytest.raises(deltabox.NotFound):
            sb.rollback(promised)
    sb.rollback(cp1)
    assert sb.files.read("a.txt") == b"v1"
    sb.kill()
    _wait_layers_settle(d)
    d.stop()
    assert d.proc.returncode == 0 and _sandbox_processes(d) == set()
    assert not leaks(d.state_dir.parent)


# ---- a full store, an OOM ------------------------------------------------------------------

PROPER = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
          "DEADLINE_EXCEEDED"}


@pytest.fixture
def small_store():
    """A daemon on the smallest loop store (1 GiB), which a sandbox fills in seconds."""
    b = Path(tempfile.mkdtemp(prefix="dbx-full-", dir="/var/tmp"))
    dp = DaemonProc(b / "state", str(b / "d.sock"), None, b / "daemon.log")
    try:
        # no per-sandbox disk quota: the point is the whole store filling up (as many
        # sandboxes together would)
        dp.start("--no-inspector", "--store-size-gb", "1", "--default-disk-mb", "0")
        yield dp
    finally:
        try:
            for info in Sandbox.list(socket=dp.socket):
                Sandbox.connect(info.id, socket=dp.socket).kill()
        except Exception:
            pass
        dp.stop()
        settle(b)


def test_full_store_during_checkpoint(small_store: DaemonProc) -> None:
    """Data full: snapshots are metadata only, so checkpoints still work and writes fail
    with RESOURCE_EXHAUSTED. Keep checkpointing until metadata is full too: the checkpoint
    fails with RESOURCE_EXHAUSTED saying what to do, leaves no row, and the sandbox runs on;
    once space is freed, checkpoints work again."""
    d = small_store
    sb = Sandbox.create(socket=d.socket)
    sb.files.write("keep.txt", "kept")
    first = sb.checkpoint(mode="fs")
    filler = Sandbox.create(socket=d.socket)          # another tenant fills the store
    r = filler.exec("dd if=/dev/zero of=/workspace/big bs=1M; sync", timeout=120)
    assert "No space left on device" in r.stderr
    assert sb.exec("echo more > /workspace/more.txt").exit_code != 0  # ENOSPC inside
    with pytest.raises(deltabox.ResourceExhausted) as ei:
        sb.files.write("x.txt", b"y" * 100_000)
    assert "no space left" in ei.value.message and "delete files" in ei.value.message
    cp = sb.checkpoint(mode="fs")                     # data full: a snapshot still fits
    assert cp.kind == "fs"
    err = None
    for _ in range(3000):                             # ~300 snapshots fill 1 GiB's metadata
        try:
            sb.checkpoint(mode="fs")
        except deltabox.ResourceExhausted as e:
            err = e
            break
    assert err is not None, "the store never filled up"
    assert "ENOSPC" in err.message and "layer store is full" in err.message
    assert "rmcp" in err.message
    n = len(sb.checkpoints())
    # the sandbox keeps running, the daemon answers, the failed checkpoint left no row
    assert sb.exec("echo alive").stdout == "alive\n"
    assert sb.info().state == "running"
    assert deltabox.info(socket=d.socket).checkpoints == n
    # free space: remove the filler and most checkpoints; checkpoints work again
    filler.kill()
    for c in sb.checkpoints():
        if c.id != first.id:
            sb.delete_checkpoint(c)
    deadline = time.monotonic() + 60
    while True:                                       # btrfs frees deleted snapshots lazily
        try:
            sb.files.write("keep.txt", "after")
            again = sb.checkpoint(mode="fs")
            break
        except deltabox.ResourceExhausted:
            assert time.monotonic() < deadline, "space never came back"
            time.sleep(0.5)
    sb.rollback(first)
    assert sb.files.read("keep.txt") == b"kept"
    sb.rollback(again)
    assert sb.files.read("keep.txt") == b"after"


def test_oom_during_checkpoint(d: DaemonProc) -> None:
    """A sandbox with 64 MiB of memory runs hogs that get OOM-killed while checkpoints are
    taken: every call ends with a proper status, the daemon stays healthy, the sandbox runs."""
    import grpc

    d.start("--no-inspector")
    sb = Sandbox.create(socket=d.socket, memory_mb=64)
    sb.files.write("a.txt", "before")
    base_cp = sb.checkpoint(mode="fs")
    hog = ("python3 -c 'import time\nb=[]\nwhile True:\n    b.append(bytearray(8<<20))\n"
           "    time.sleep(0.01)'")
    results: list[str] = []
    stop = threading.Event()

    def hogs() -> None:
        while not stop.is_set():
            try:
                r = sb.exec(hog, timeout=30)
                results.append(f"hog exit {r.exit_code}")
            except deltabox.DeltaBoxError as e:
                results.append(f"hog {e.code.name}")

    t = threading.Thread(target=hogs)
    t.start()
    codes: list[str] = []
    improper: list[str] = []
    try:
        for i in range(30):
            try:
                sb.checkpoint(mode="full" if i % 2 else "fs")
                codes.append("OK")
            except deltabox.DeltaBoxError as e:
                codes.append(e.code.name)
                assert e.message, "an error without a message"
                if e.code.name not in PROPER:
                    improper.append(f"{e.code.name}: {e.message}")
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(60)
    if not set(codes) <= PROPER:
        print(d.log.read_text()[-6000:])  # the daemon's side of the failure
    assert set(codes) <= PROPER, (codes, improper)
    assert codes.count("OK") >= 10, codes
    assert any("exit 137" in r for r in results), results   # the hog was OOM-killed (SIGKILL)
    # the daemon is healthy: alive, answering, the sandbox runs and rolls back
    assert d.proc is not None and d.proc.poll() is None
    deltabox.info(socket=d.socket)
    assert sb.exec("echo ok").stdout == "ok\n"
    sb.rollback(base_cp)
    assert sb.files.read("a.txt") == b"before"
    oom = Path(d.log).read_text()
    assert "internal error" not in oom.lower(), oom[-2000:]
    assert grpc  # noqa: the import documents the status names used above


@pytest.mark.timeout(180)
def test_crash_after_an_fs_checkpoint_was_answered_before_its_snapshot(d: DaemonProc) -> None:
    """An auto fs checkpoint of a sandbox that runs nothing is answered before its snapshot
    (tests/test_checkpoint_deferred.py); a kill -9 right after the answer: the restarted
    daemon takes the snapshot from the sandbox's layer, untouched since, and the checkpoint
    restores exactly what it held at the answer. Needs the inspector (the auto policy)."""
    d.start("--warm-generations", "0", env={"DELTABOX_CRASH_AT": "checkpoint.answered"})
    s = d.socket
    assert inspector_backend(s).startswith("ebpf")
    sb = Sandbox.create(socket=s)
    sb.files.write("a.txt", "v1")
    cp1 = sb.checkpoint(mode="fs")
    sb.files.write("a.txt", "v2")
    sb.exec("seq 100 > /workspace/n.txt")
    cp2 = sb.checkpoint()   # answered, then the daemon dies before the snapshot
    assert cp2.kind == "fs" and cp2.files_changed == 0, cp2
    assert d.proc is not None and d.proc.wait(30) == -signal.SIGKILL
    assert "killing deltaboxd (SIGKILL) at checkpoint.answered" in d.log.read_text()
    d.start(*FLAGS)
    sbs, cps = _db(d)
    assert set(cps) == {cp1.id, cp2.id} and sbs[sb.id][1] == cp2.id
    _wait_layers_settle(d)
    sb = Sandbox.connect(sb.id, socket=s)
    got = sb.get_checkpoint(cp2)
    assert got.files_changed >= 2 and any("file snapshot taken" in r for r in got.reasons)
    sb.files.write("a.txt", "v3")
    sb.rollback(cp2)
    assert sb.files.read("a.txt") == b"v2"
    assert sb.files.read("n.txt") == "".join(f"{i}\n" for i in range(1, 101)).encode()
    sb.rollback(cp1)
    assert sb.files.read("a.txt") == b"v1" and not sb.files.exists("n.txt")
    sb.kill()
    _wait_layers_settle(d)
    assert _layers_on_disk(d) == set()
    d.stop()
    assert d.proc.returncode == 0 and not leaks(d.state_dir.parent)



@pytest.mark.timeout(180)
def test_crash_after_a_full_checkpoint_was_answered_before_its_snapshot(
        d: DaemonProc) -> None:
    """A checkpoint that captures running processes is answered before their templates
    and its file snapshot, those processes held in their ptrace stops until both are made.
    A kill -9 right after the answer: nothing runs on while the daemon is gone (the held
    processes die with their tracer, the counter file in the layer does not grow), the
    restarted daemon takes the snapshot, and the checkpoint holds the files of the
    instant it answered (the processes' memory went with the daemon: no template, no
    dump)."""
    d.start(*FLAGS, env={"DELTABOX_CRASH_AT": "checkpoint.answered"})
    sb = Sandbox.create(socket=d.socket)
    sb.files.write("count.py", "import time\ni = 0\nwhile True:\n    i += 1\n"
                   "    with open('/workspace/count-n.txt', 'a') as f:\n"
                   "        f.write(f'{i}\\n')\n    time.sleep(0.005)\n")
    sb.exec("cd /workspace && nohup python3 count.py >/dev/null 2>&1 &")
    deadline = time.monotonic() + 20
    while not sb.files.exists("count-n.txt") or len(sb.files.read("count-n.txt").split()) < 20:
        assert time.monotonic() < deadline, "the counter never counted"
        time.sleep(0.02)
    cp = sb.checkpoint(mode="full")   # answered, then the daemon dies before the snapshot
    assert cp.kind == "full" and cp.files_changed == 0, cp
    assert d.proc is not None and d.proc.wait(30) == -signal.SIGKILL
    assert "killing deltaboxd (SIGKILL) at checkpoint.answered" in d.log.read_text()
    parent = parent_name(str(d.state_dir.resolve()))
    procs = Path(f"/sys/fs/cgroup/pids/{parent}/{sb.id}/cgroup.procs")
    wait_for(lambda: not [p for p in procs.read_text().split()
                          if "count.py" in cmdline(int(p))],
             timeout=5, what="the held counter to die with the daemon")
    layer = _db(d)[0][sb.id][0]
    (counter,) = (d.state_dir / "store" / "layers" / layer).rglob("count-n.txt")
    at_crash = counter.read_bytes()
    time.sleep(0.3)
    assert counter.read_bytes() == at_crash, "the counter ran on after the answer"
    d.start(*FLAGS)
    sb = Sandbox.connect(sb.id, socket=d.socket)
    got = sb.get_checkpoint(cp)
    assert any("file snapshot taken" in r for r in got.reasons), got.reasons
    assert sb.rollback(cp).process_state == "restarted"
    sb.files.write("count-n.txt", "later\n")
    sb.rollback(cp)
    assert sb.files.read("count-n.txt").startswith(at_crash)
    n = len(at_crash.split())
    assert at_crash.split() == [str(i).encode() for i in range(1, n + 1)]
    sb.kill()
    _wait_layers_settle(d)
    assert _layers_on_disk(d) == set()
    d.stop()
    assert d.proc.returncode == 0 and not leaks(d.state_dir.parent)


def test_a_layer_busy_for_a_moment_is_deleted_soon_after(d: DaemonProc) -> None:
    """A deleted checkpoint's layer that cannot be removed at once (a real fault: a tmpfs
    mounted on it, so its directory is busy) is tried again shortly after, not left to the
    next start (`Daemon._retire`)."""
    d.start("--no-inspector", "--warm-generations", "0")
    sb = Sandbox.create(socket=d.socket)
    try:
        sb.files.write("a.txt", "kept")
        cp = sb.checkpoint(mode="fs")
        sb.files.write("a.txt", "changed")
        sb.checkpoint(mode="fs")
        layer = d.state_dir / "store" / "layers" / _db(d)[1][cp.id]
        subprocess.run(["mount", "-t", "tmpfs", "busy", str(layer)], check=True)
        try:
            assert sb.delete_checkpoint(cp) is True
            time.sleep(0.3)  # the first attempt fails meanwhile (EBUSY)
        finally:
            subprocess.run(["umount", str(layer)], check=True)
        deadline = time.monotonic() + 10
        while layer.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not layer.exists(), "the layer was left to the next start"
        assert "again in" in d.log.read_text()   # it did fail first
    finally:
        sb.kill()
        d.stop()
