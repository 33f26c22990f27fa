"""A checkpoint (auto or full) is answered once committed and its btrfs snapshot (and a full
one's process templates) is made right after, under the sandbox's lock
(Daemon._deferred_snapshot): whatever comes next waits for it, and a sandbox that runs
something stays frozen, or its captured processes stopped, until then, so the checkpoint
holds exactly the files of the instant it was answered. (The crash between the answer and
the snapshot: tests/test_faults.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from deltabox import ResourceExhausted, Sandbox
from deltabox.cr.engine import process_name
from deltabox.cr.native import proc_status
from deltabox.daemon.service import DEFERRED_NOTE
from deltabox.sandbox.cgroups import parent_name

from conftest import DaemonProc, new_sandbox, wait_for


def _deferred(cp) -> bool:
    return DEFERRED_NOTE in cp.reasons


def test_answer_comes_before_the_snapshot_and_the_snapshot_is_that_instant(
        sbx: Sandbox, ebpf: str) -> None:
    sbx.files.write("/workspace/a.txt", "v1")
    sbx.checkpoint()
    sbx.files.write("/workspace/a.txt", "v2")
    sbx.exec("mkdir -p /workspace/d && seq 1000 > /workspace/d/n.txt")
    cp = sbx.checkpoint()
    assert cp.kind == "fs" and _deferred(cp), cp.reasons
    assert cp.files_changed == 0 and cp.bytes_changed == 0   # they come with the snapshot
    # At once, before the snapshot could have been taken: these wait for it.
    sbx.files.write("/workspace/a.txt", "v3")
    sbx.exec("rm -rf /workspace/d; echo late > /workspace/late.txt")
    got = sbx.get_checkpoint(cp)
    assert got.files_changed >= 2 and got.bytes_changed >= len("v2") + 3893, got
    assert not _deferred(got) and any("file snapshot taken" in r for r in got.reasons)
    sbx.rollback(cp)
    assert sbx.files.read("/workspace/a.txt") == b"v2"
    assert sbx.files.read("/workspace/d/n.txt") == "".join(
        f"{i}\n" for i in range(1, 1001)).encode()
    assert not sbx.files.exists("/workspace/late.txt")


def test_a_rollback_right_after_waits_for_the_snapshot(sbx: Sandbox, ebpf: str) -> None:
    sbx.files.write("/workspace/f", "0")
    cps = [sbx.checkpoint()]
    for i in range(1, 6):
        sbx.files.write("/workspace/f", str(i))
        cps.append(sbx.checkpoint())
    assert all(_deferred(c) for c in cps[1:]), [c.reasons for c in cps]
    for i in (3, 1, 5, 2):      # back to back, no pause: each names a fresh checkpoint
        sbx.rollback(cps[i])
        assert sbx.files.read("/workspace/f") == str(i).encode()


def test_concurrent_writers_never_reach_the_snapshot(sbx: Sandbox, ebpf: str) -> None:
    """A write issued from another thread while the checkpoint is answered lands after the
    snapshot, never inside it: the checkpoint restores the file as it was at the answer."""
    sbx.files.write("/workspace/f", "before")
    sbx.checkpoint()
    sbx.files.write("/workspace/f", "at-checkpoint")
    go = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            go.wait(10)
            for i in range(20):
                sbx.files.write("/workspace/f", f"after-{i}")
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    go.set()
    cp = sbx.checkpoint()
    t.join(30)
    assert not errors, errors
    sbx.rollback(cp)
    got = sbx.files.read("/workspace/f")
    # The checkpoint is whatever the file held at its instant: the value before any of the
    # writer's writes, or one of them, never a mix.
    assert got in {b"at-checkpoint"} | {f"after-{i}".encode() for i in range(20)}, got
    assert sbx.get_checkpoint(cp).kind in ("fs", "skipped")


def test_a_sandbox_that_runs_something_stays_stopped_until_the_snapshot(
        sbx: Sandbox, ebpf: str) -> None:
    """A checkpoint that captures running processes is answered before their templates
    and its snapshot: they stay in their stops until both are made. A process appending
    a counter every 2 ms: after each rollback the file counts on with no gap and no
    repeat (the file and the process's memory are of one instant)."""
    sbx.files.write("count.py", "import time\ni = 0\nwhile True:\n    i += 1\n"
                    "    with open('/workspace/n', 'a') as f:\n        f.write(f'{i}\\n')\n"
                    "    time.sleep(0.002)\n")
    sbx.exec("cd /workspace && nohup python3 count.py >/dev/null 2>&1 &")
    wait_for(lambda: len(_counts(sbx)) >= 20)
    cp = sbx.checkpoint()
    assert cp.kind == "full" and _deferred(cp), cp.reasons
    assert cp.files_changed == 0
    assert any(r.endswith("processes captured as templates") for r in cp.reasons), cp.reasons
    got = sbx.get_checkpoint(cp)
    assert not _deferred(got) and any("templates and file snapshot made" in r
                                      for r in got.reasons), got.reasons
    assert got.files_changed >= 1
    assert got.freeze_ms > cp.freeze_ms   # held until the snapshot, after the answer
    for _ in range(3):
        sbx.rollback(cp)
        time.sleep(0.1)
        counts = _counts(sbx)
        assert len(counts) >= 20 and counts == list(range(1, len(counts) + 1)), counts


def _counts(sbx: Sandbox) -> list[int]:
    return [int(x) for x in sbx.files.read("n").split()] if sbx.files.exists("n") else []


def test_forced_fs_mode_is_never_deferred_forced_full_is(sbx: Sandbox, ebpf: str) -> None:
    sbx.files.write("/workspace/a.txt", "v1")
    cp = sbx.checkpoint(mode="fs")
    assert not _deferred(cp) and cp.files_changed >= 1
    sbx.exec("nohup sleep 1000 >/dev/null 2>&1 &")
    cp = sbx.checkpoint(mode="full")
    assert cp.kind == "full" and _deferred(cp), cp.reasons
    sbx.files.write("/workspace/a.txt", "v2")
    sbx.rollback(cp)
    assert sbx.files.read("/workspace/a.txt") == b"v1"
    assert "sleep 1000" in sbx.exec("ps -eo args").stdout


def test_deleting_its_parent_right_after_keeps_the_tree(sbx: Sandbox, ebpf: str) -> None:
    """Deleting the parent right after the answer (it waits for the snapshot underway from
    it): the child then hangs from the grandparent, its files and counts intact."""
    a = sbx.checkpoint()
    sbx.files.write("/workspace/f", "b")
    b = sbx.checkpoint()
    sbx.files.write("/workspace/f", "c")
    c = sbx.checkpoint()
    assert _deferred(c), c.reasons
    assert sbx.delete_checkpoint(b) is True
    cps = {x.id: x for x in sbx.checkpoints()}
    assert b.id not in cps and cps[c.id].parent_id == a.id
    assert cps[c.id].files_changed >= 1 and sbx.info().head_checkpoint_id == c.id
    sbx.files.write("/workspace/f", "d")
    sbx.rollback(c)
    assert sbx.files.read("/workspace/f") == b"c"


def test_a_full_checkpoint_with_no_room_for_its_templates_is_refused_before_its_answer(
        daemon: DaemonProc) -> None:
    """The templates are made after the answer, and each counts against the sandbox's
    pids limit: a checkpoint that has no room for them is refused with the answer (not
    undone after it), nothing is kept, and its processes run on."""
    with new_sandbox(daemon.socket, pids_max=8) as sbx:   # init, its helper, 4 sleeps
        sbx.exec("for i in 1 2 3 4; do nohup sleep 1000 >/dev/null 2>&1 & done")
        # (Looked at from the host: the sandbox has no room left to run ps.)
        procs = Path(f"/sys/fs/cgroup/pids/{parent_name(str(daemon.state_dir.resolve()))}/"
                     f"{sbx.id}/cgroup.procs")

        def sleeps() -> list[int]:
            return [p for p in map(int, procs.read_text().split())
                    if process_name(p) == "sleep"]
        # The shell does not wait for them: on a busy machine the last may still be
        # nohup, not yet sleep, when the exec answers.
        wait_for(lambda: len(sleeps()) == 4, timeout=10, what="4 sleeps")
        with pytest.raises(ResourceExhausted) as e:
            sbx.checkpoint(mode="full")
        assert "pids_max" in str(e.value) and "mode=fs" in str(e.value)
        assert sbx.checkpoints() == []
        pids = sleeps()
        assert len(pids) == 4, pids

        def sleeping_untraced() -> bool:   # not left in a stop ("t"), nor traced
            return all(st.state == "S" and st.tracer_pid == 0
                       for st in map(proc_status, pids))
        # Let go before the answer, each sleep is runnable ("R") until it gets a CPU and
        # sleeps again: on a busy machine, after the answer.
        wait_for(sleeping_untraced, timeout=10, what=f"sleeps {pids} asleep and untraced")
        assert sbx.checkpoint(mode="fs").kind == "fs"
