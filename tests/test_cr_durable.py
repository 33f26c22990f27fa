"""Durable process state (daemon/dumps.py): background dumps of full checkpoints, restore from
disk after kill -9 of the daemon, after template eviction, into forks; corrupt images and
dumps that had not completed restart processes and say why. A real private daemon."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from deltabox import Sandbox

from conftest import (OWN_PS, DaemonProc, dump_state, inspector_backend, private_daemon,
                      wait_for)

ARGS = ("--no-inspector", "--templates", "1")
MB = 100
# Patterned memory and a counter; answers requests made through files (the daemon's files
# API), so nothing but its memory tells what state it is in.
PROGRAM = f"""
import hashlib, json, os, time
buf = bytearray({MB} << 20)
for i in range({MB}):
    buf[i << 20:(i + 1) << 20] = hashlib.sha256(i.to_bytes(4, "little")).digest() * 32768
n = 0
while True:
    if os.path.exists("/workspace/req"):
        req = open("/workspace/req").read()
        os.unlink("/workspace/req")
        n += 1
        if req == "mutate":
            for off in range(10 << 20, 20 << 20, 4096):
                buf[off] ^= 0xFF
        out = json.dumps({{"hash": hashlib.sha256(buf).hexdigest(), "n": n}})
        open("/workspace/resp.tmp", "w").write(out)
        os.rename("/workspace/resp.tmp", "/workspace/resp")
    time.sleep(0.02)
"""
SHELL = "X=hello; declare -A M=([k]=v); f() { echo fn$1; }; cd /tmp; echo ok"
PROBE = 'echo "$X ${M[k]} $(f 1) $PWD"'


@pytest.fixture
def d():
    with private_daemon("dbx-durable-") as dp:
        yield dp


def ask(sbx: Sandbox, what: str = "hash", timeout: float = 30) -> dict:
    sbx.exec("rm -f /workspace/resp")
    sbx.files.write("req", what)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sbx.files.exists("resp"):
            return json.loads(sbx.files.read("resp"))
        time.sleep(0.05)
    raise TimeoutError("the python process did not answer")


def start_processes(sbx: Sandbox) -> dict:
    assert sbx.session("s").run(SHELL).stdout.strip() == "ok"
    sbx.files.write("prog.py", PROGRAM)
    sbx.exec("nohup python3 /workspace/prog.py >/dev/null 2>&1 &")
    return ask(sbx, timeout=60)


def test_a_restore_from_disk_does_not_wind_the_pid_counter_back(d: DaemonProc) -> None:
    """A rollback to a checkpoint whose templates were evicted rebuilds them from its dump,
    first making the namespace allocate pids above the ones its processes get back. In a
    sandbox that ran on since, the counter is above them already: it stays there. Until
    stop 78 it was set back to them, so new processes took pids that had been used since,
    ones other checkpoints' processes needed back (a 16 x 400 soak: a pinger came back
    renumbered, its pid held by a later template's own)."""
    d.start(*ARGS)
    sbx = Sandbox.create(socket=d.socket)
    sbx.exec("nohup sleep 1000 >/dev/null 2>&1 &")
    cp1 = sbx.checkpoint(mode="full")
    assert "complete" in dump_state(sbx, cp1.id)
    sbx.exec("for i in $(seq 100); do /bin/true; done")
    before = int(sbx.exec("sh -c 'echo $$'").stdout)
    cp2 = sbx.checkpoint(mode="full")      # --templates 1: cp1's templates go
    assert "complete" in dump_state(sbx, cp2.id)
    r = sbx.rollback(cp1)
    assert r.process_state == "restored" and f"dump of {cp1.id}" in r.note, r.note
    after = int(sbx.exec("sh -c 'echo $$'").stdout)
    assert after > before, (before, after)


def test_restart_evict_fork_corrupt(d: DaemonProc) -> None:
    d.start(*ARGS)
    sbx = Sandbox.create(socket=d.socket)
    h0 = start_processes(sbx)
    cp1 = sbx.checkpoint(mode="full")
    assert "complete" in dump_state(sbx, cp1.id)
    assert ask(sbx, "mutate")["hash"] != h0["hash"]
    sbx.session("s").run("X=changed; cd /")

    # kill -9 of the daemon: the templates are gone, the dump is not.
    d.kill9()
    d.start(*ARGS)
    sbx = Sandbox.connect(sbx.id, socket=d.socket)
    assert "complete" in dump_state(sbx, cp1.id)
    r = sbx.rollback(cp1)
    assert r.process_state == "restored", r.note
    assert f"restored from disk (dump of {cp1.id}" in r.note
    assert sbx.session("s").run(PROBE).stdout.strip() == "hello v fn1 /tmp"
    got = ask(sbx)
    assert got["hash"] == h0["hash"] and got["n"] == h0["n"] + 1

    # --templates 1: a new full checkpoint evicts cp1's (rebuilt) templates; its dump is
    # complete, so a rollback to it restores from disk again (through an incremental chain).
    cp2 = sbx.checkpoint(mode="full")
    assert "complete" in dump_state(sbx, cp2.id)
    ask(sbx, "mutate")
    r = sbx.rollback(cp1)
    assert r.process_state == "restored" and f"dump of {cp1.id}" in r.note, r.note
    assert ask(sbx)["hash"] == h0["hash"]
    assert sbx.session("s").run(PROBE).stdout.strip() == "hello v fn1 /tmp"

    # A fork of cp2 (its templates evicted by the rollback above): rebuilt from its dump,
    # into 4 children at once (the 100 MB process's template gets a second fork lane).
    lanes = d.lanes_opened()
    kids = sbx.fork(cp2, count=4)
    try:
        assert d.lanes_opened() == lanes + 1
        for kid in kids:
            assert kid.process_state == "restored", kid.fork_note
            k = ask(kid)
            assert k["hash"] == h0["hash"] and k["n"] == h0["n"] + 2
            assert kid.session("s").run(PROBE).stdout.strip() == "hello v fn1 /tmp"
    finally:
        for kid in kids:
            kid.kill()

    # A corrupt image: the rollback restarts processes and names the damage.
    sbx.checkpoint(mode="full")  # evicts cp1's templates
    images = sorted((d.state_dir / "dumps" / cp1.id).glob("*/pages.img"),
                    key=lambda p: p.stat().st_size)
    pages = images[-1]  # the python process's (full) image
    with open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    r = sbx.rollback(cp1)
    assert r.process_state == "restarted", r.note
    assert f"restoring from the dump of {cp1.id} failed" in r.note and "pages.img" in r.note
    ps = sbx.exec(f"{OWN_PS} args=").stdout.splitlines()
    assert not [line for line in ps if "python3" in line], ps  # nothing half-restored

    # Deleting checkpoints frees their dumps once no other image depends on them (a dump
    # still being written when its checkpoint goes is removed as soon as it stops).
    for c in sbx.checkpoints():
        sbx.delete_checkpoint(c.id)
    deadline = time.monotonic() + 10
    while list((d.state_dir / "dumps").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((d.state_dir / "dumps").iterdir()) == []


def test_incomplete_dump_is_file_state_only(d: DaemonProc) -> None:
    d.start(*ARGS, env={"DELTABOX_TEST_DUMP_DELAY": "30"})
    sbx = Sandbox.create(socket=d.socket)
    start_processes(sbx)
    cp = sbx.checkpoint(mode="full")
    assert "pending" in next(c for c in sbx.checkpoints() if c.id == cp.id).reasons[-1]
    d.kill9()
    d.start(*ARGS)
    sbx = Sandbox.connect(sbx.id, socket=d.socket)
    assert "had not completed when the daemon stopped" in dump_state(sbx, cp.id)
    assert [p.name for p in (d.state_dir / "dumps").iterdir()] == []
    r = sbx.rollback(cp)
    assert r.process_state == "restarted"
    assert "its process dump had not completed when the daemon stopped" in r.note
    assert sbx.files.exists("prog.py")


def test_a_restore_takes_back_templates_evicted_while_their_dump_was_pending(
        d: DaemonProc) -> None:
    """Dumps are written one at a time per sandbox, in checkpoint order (each held back 4 s
    here); templates evicted from that backlog are kept until their dump ends. A rollback
    or fork to such a checkpoint takes them back instead of waiting for its dump (a 32 x
    1000 soak saw rollbacks wait 10-48 s, and up to 212 s): it returns with the processes
    restored from templates while earlier dumps are still pending. Once the dumps have
    ended, the templates not taken back go, and their checkpoints restore from disk."""
    d.start(*ARGS, env={"DELTABOX_TEST_DUMP_DELAY": "4"})
    sbx = Sandbox.create(socket=d.socket)
    h0 = start_processes(sbx)
    cps = [sbx.checkpoint(mode="full") for _ in range(5)]
    # cps[0]'s dump is under way, 1-4 queued; --templates 1 (two while dumps are pending):
    # 0-2's templates are evicted, held for their dumps.
    assert all("pending" in dump_state(sbx, c.id, timeout=0) for c in cps)
    assert ask(sbx, "mutate")["hash"] != h0["hash"]
    sbx.session("s").run("X=changed; cd /")
    r = sbx.rollback(cps[1])
    assert r.process_state == "restored", r.note
    assert "processes restored from templates" in r.note and "disk" not in r.note, r.note
    assert "pending" in dump_state(sbx, cps[0].id, timeout=0)
    assert ask(sbx)["hash"] == h0["hash"]
    assert sbx.session("s").run(PROBE).stdout.strip() == "hello v fn1 /tmp"
    kids = sbx.fork(cps[2], count=2)
    try:
        for kid in kids:
            assert kid.process_state == "restored", kid.fork_note
            assert "from templates" in kid.fork_note, kid.fork_note
            assert ask(kid)["hash"] == h0["hash"]
            assert kid.session("s").run(PROBE).stdout.strip() == "hello v fn1 /tmp"
        assert "pending" in dump_state(sbx, cps[0].id, timeout=0)
    finally:
        for kid in kids:
            kid.kill()
    assert all("complete" in dump_state(sbx, c.id, timeout=120) for c in cps)
    time.sleep(3)   # the periodic check releases templates kept for their dump (2 s)
    ask(sbx, "mutate")
    r = sbx.rollback(cps[0])
    assert r.process_state == "restored", r.note
    assert f"restored from disk (dump of {cps[0].id}" in r.note, r.note
    assert ask(sbx)["hash"] == h0["hash"]


def test_a_restore_to_a_dump_that_cannot_be_written_does_not_wait_for_the_backlog(
        d: DaemonProc) -> None:
    """Past 8 templates held for their dumps, an evicted checkpoint's templates go at
    once and its queued dump cannot be written: it fails then, and a rollback to it
    restarts the processes at once, saying why, instead of waiting for every dump queued
    before it (4 s each here)."""
    d.start(*ARGS, env={"DELTABOX_TEST_DUMP_DELAY": "4"})
    sbx = Sandbox.create(socket=d.socket)
    start_processes(sbx)
    cps = [sbx.checkpoint(mode="full") for _ in range(12)]
    # Held for their dumps: 0-7; released at once: 8 and 9; kept: 10 and 11.
    r = sbx.rollback(cps[9])
    assert r.process_state == "restarted", r.note
    assert "its templates were released before its dump began" in r.note, r.note
    assert "pending" in dump_state(sbx, cps[1].id, timeout=0)
    assert "failed" in dump_state(sbx, cps[9].id, timeout=0)
    r = sbx.rollback(cps[7])   # held: taken back
    assert r.process_state == "restored" and "from templates" in r.note, r.note


def test_a_checkpoint_deleted_before_its_dump_is_not_a_failed_dump(d: DaemonProc) -> None:
    """A checkpoint deleted while its dump waits (held back 2 s here) loses nothing: the
    daemon says so at INFO, not as a failed dump (under load most dumps that do not
    complete end so, and their warnings hid the ones that lose process state); the
    next checkpoint's dump is written."""
    d.start(*ARGS, env={"DELTABOX_TEST_DUMP_DELAY": "2"})
    sbx = Sandbox.create(socket=d.socket)
    start_processes(sbx)
    gone = sbx.checkpoint(mode="full")
    sbx.delete_checkpoint(gone)
    kept = sbx.checkpoint(mode="full")
    assert "complete" in dump_state(sbx, kept.id, timeout=60)
    wait_for(lambda: f"process dump of {gone.id} not written" in d.log.read_text(),
             what="the dump's end")
    log = d.log.read_text()
    assert f"process dump of {gone.id} not written: its checkpoint was deleted" in log
    assert f"process dump of {gone.id} failed" not in log
    assert not (d.state_dir / "dumps" / gone.id).exists()


def test_a_dump_after_a_dev_shm_file_mapped_privately_changed_fails(d: DaemonProc) -> None:
    """A process image keeps the pages of a /dev/shm file's mapping as the template reads
    them; a file mapped privately and written after the checkpoint, before the dump (held
    back 2 s here), would give the new bytes: the dump fails, naming the file, and a
    rollback once the templates are evicted restarts the processes saying so, instead of
    restoring those bytes silently."""
    from test_cr import PAGES, PRIVATE_MAPS
    d.start(*ARGS, env={"DELTABOX_TEST_DUMP_DELAY": "2"})
    sbx = Sandbox.create(socket=d.socket)
    sbx.files.write("pages", PAGES)
    sbx.files.write("pm.py", PRIVATE_MAPS)
    sbx.exec("cd /workspace && cp pages /dev/shm/pages; nohup python3 pm.py /dev/shm/pages "
             ">/dev/null 2>&1 &")
    wait_for(lambda: sbx.exec("grep -c /dev/shm/pages /proc/$(pgrep -xn python3)/maps"
                              ).stdout.strip() == "2", what="its two mappings")
    cp = sbx.checkpoint(mode="full")
    sbx.exec("python3 -c \"open('/dev/shm/pages', 'r+b').write(b'X' * 4096)\"")
    line = dump_state(sbx, cp.id)
    assert "failed" in line and "/dev/shm/pages, mapped privately, was written after the " \
        "checkpoint" in line, line
    sbx.checkpoint(mode="full")   # --templates 1: cp's are evicted
    r = sbx.rollback(cp)
    assert r.process_state == "restarted" and "process dump failed" in r.note, r.note


def test_template_count_enforced_once_dumps_end(d: DaemonProc) -> None:
    """Templates kept over --templates while their dumps were pending are evicted once the
    dumps have ended (the daemon's periodic check), not only at the next checkpoint."""
    d.start(*ARGS)
    sbx = Sandbox.create(socket=d.socket)
    start_processes(sbx)
    cp1 = sbx.checkpoint(mode="full")
    cp2 = sbx.checkpoint(mode="full")  # cp1's dump may still be pending: both kept
    assert "complete" in dump_state(sbx, cp1.id) and "complete" in dump_state(sbx, cp2.id)
    time.sleep(3)  # the check runs every 2 s
    r = sbx.rollback(cp1)
    assert r.process_state == "restored" and f"restored from disk (dump of {cp1.id}" in r.note, \
        r.note


def test_processless_full_checkpoint_dump(d: DaemonProc) -> None:
    """A full checkpoint of a sandbox with no process of its own: its dump (metadata only)
    is recorded with the checkpoint, written in the background, and restores after kill -9."""
    d.start(*ARGS, env={"DELTABOX_TEST_DUMP_DELAY": "1"})
    sbx = Sandbox.create(socket=d.socket)
    sbx.files.write("a.txt", "one")
    cp = sbx.checkpoint(mode="full")
    assert cp.kind == "full"
    assert "pending" in next(c for c in sbx.checkpoints() if c.id == cp.id).reasons[-1]
    assert "complete" in dump_state(sbx, cp.id)
    sbx.files.write("a.txt", "two")
    d.kill9()
    d.start(*ARGS)
    sbx = Sandbox.connect(sbx.id, socket=d.socket)
    r = sbx.rollback(cp)
    assert r.process_state == "restored", r.note
    assert sbx.files.read("a.txt") == b"one"
    assert sbx.exec("echo alive").stdout.strip() == "alive"


IDLE = r"""
import hashlib, signal
buf = bytearray(16 << 20)
for i in range(16):
    buf[i << 20:(i + 1) << 20] = hashlib.sha256(bytes([i])).digest() * 32768
def report(*_):
    open("/workspace/idle.tmp", "w").write(hashlib.sha256(buf).hexdigest())
    import os; os.rename("/workspace/idle.tmp", "/workspace/idle.out")
signal.signal(signal.SIGUSR2, report)
open("/workspace/idle.ready", "w").write("1")
while True:
    signal.pause()
"""


def idle_hash(sbx: Sandbox) -> str:
    sbx.exec("rm -f /workspace/idle.out; pkill -USR2 -f idle.py")
    deadline = time.monotonic() + 30
    while not sbx.files.exists("idle.out"):
        assert time.monotonic() < deadline, "the idle process did not answer"
        time.sleep(0.05)
    return sbx.files.read("idle.out").decode()


def test_kept_template_gets_its_image_linked_and_restores_after_kill9(d: DaemonProc) -> None:
    """A checkpoint that kept a waiting process's template (the inspector saw it wait)
    gets the image of the checkpoint it kept it from, as hard links (nothing read or
    written again), and restores from it after kill -9 of the daemon."""
    d.start("--templates", "1")
    inspector_backend(d.socket, timeout=120)
    sbx = Sandbox.create(socket=d.socket)
    sbx.files.write("idle.py", IDLE)
    sh = sbx.session("s")
    sh.run("nohup python3 /workspace/idle.py >/dev/null 2>&1 & X=one")
    while not sbx.files.exists("idle.ready"):
        time.sleep(0.05)
    want = idle_hash(sbx)
    cp1 = sbx.checkpoint()
    assert cp1.kind == "full" and "complete" in dump_state(sbx, cp1.id)
    sh.run("X=two")                          # the shell runs; the python waits
    cp2 = sbx.checkpoint()
    assert any(r.startswith("templates kept") and "python3" in r for r in cp2.reasons)
    assert "complete" in dump_state(sbx, cp2.id)
    dumps = d.state_dir / "dumps"
    pid = sbx.exec("pgrep -x python3").stdout.split()[0]
    for name in ("core.img", "pages.img"):
        assert (dumps / cp1.id / pid / name).stat().st_ino == \
            (dumps / cp2.id / pid / name).stat().st_ino
    sbx.delete_checkpoint(cp1)               # cp2's image stands on its own links
    d.kill9()
    d.start("--templates", "1")
    sbx = Sandbox.connect(sbx.id, socket=d.socket)
    r = sbx.rollback(cp2)
    assert r.process_state == "restored" and "restored from disk" in r.note, r.note
    assert idle_hash(sbx) == want
    assert sbx.session("s").run("echo $X").stdout == "two\n"


def test_templates_killed_inside_the_sandbox_come_back_from_the_dump(d: DaemonProc) -> None:
    """A template is a fork of a sandbox process, so the sandbox's own processes can kill
    it (`kill -9 -1`, as an agent cleaning up might run; the OOM killer too). A rollback
    then failed ("PTRACE_GETREGS: No such process") and restarted the processes though
    the checkpoint's dump was on disk; a fork did the same. Now the killed templates are
    released and the processes come back from the dump, saying why."""
    d.start("--no-inspector")
    sbx = Sandbox.create(socket=d.socket)
    h0 = start_processes(sbx)
    cp = sbx.checkpoint(mode="full")
    assert "complete" in dump_state(sbx, cp.id)
    ask(sbx, "mutate")
    sbx.exec("kill -9 -1")
    r = sbx.rollback(cp)
    assert r.process_state == "restored", r.note
    assert re.search(r"its process templates for pid [\d, ]+ were killed .*kill -9 -1.*; "
                     rf"\d processes restored from disk \(dump of {cp.id}", r.note), r.note
    got = ask(sbx)
    assert got["hash"] == h0["hash"] and got["n"] == h0["n"] + 1
    assert sbx.session("s").run(PROBE).stdout.strip() == "hello v fn1 /tmp"

    sbx.exec("kill -9 -1")      # the rebuilt templates, now
    kid = sbx.fork(cp)[0]
    try:
        assert kid.process_state == "restored", kid.fork_note
        assert f"restored from disk (dump of {cp.id})" in kid.fork_note
        assert ask(kid)["hash"] == h0["hash"]
    finally:
        kid.kill()


def test_a_fork_finds_its_templates_again_when_they_went_while_it_waited(
        d: DaemonProc) -> None:
    """A fork that found its checkpoint's templates and then waited (for their sandbox's
    lock, behind other operations: seconds under load) finds them gone when another
    operation's budget evicted them meanwhile; it looks again and restores its processes
    from the checkpoint's dump, instead of restarting them (5 of 3302 forks of a 32 x 1000
    soak did). The daemon pauses 3 s before taking the lock here (DELTABOX_PAUSE_AT);
    a checkpoint evicts the templates (--templates 1) inside that window."""
    d.start(*ARGS, env={"DELTABOX_PAUSE_AT": "fork.source_found:3"})
    sbx = Sandbox.create(socket=d.socket)
    h0 = start_processes(sbx)
    cp1 = sbx.checkpoint(mode="full")
    assert "complete" in dump_state(sbx, cp1.id)
    got: dict = {}

    def fork() -> None:
        try:
            got["kids"] = sbx.fork(cp1, count=1)
        except Exception as e:   # re-raised below, in the test's thread
            got["error"] = e

    forker = threading.Thread(target=fork)
    forker.start()
    try:
        wait_for(lambda: "pausing 3.0 s at fork.source_found" in d.log.read_text(),
                 what="the fork to reach its pause")
        ask(sbx, "mutate")
        sbx.checkpoint(mode="full")   # evicts cp1's templates (their dump is complete)
    finally:
        forker.join(timeout=120)
    assert "error" not in got, got.get("error")
    kid = got["kids"][0]
    try:
        assert kid.process_state == "restored", kid.fork_note
        assert "went while it waited" in d.log.read_text()
        assert f"restored from disk (dump of {cp1.id})" in kid.fork_note, kid.fork_note
        assert ask(kid)["hash"] == h0["hash"]
        assert kid.session("s").run(PROBE).stdout.strip() == "hello v fn1 /tmp"
    finally:
        kid.kill()
