"""The host-wide memory budget for process templates (deltaboxd --template-memory-mb): the
least recently used checkpoints' templates are released when the pages they alone hold exceed
it; rollbacks to them restore from their process dumps (or restart processes and say why),
the others still restore from templates."""

from __future__ import annotations

import time
from pathlib import Path

from deltabox import Sandbox

# Holds 64 MiB and rewrites all of it on SIGUSR1: then every template made before holds its
# own 64 MiB copy (copy-on-write broken by the writer).
HOG = r"""
import signal
buf = bytearray(64 << 20)
gen = [0]
def rewrite(*_):
    gen[0] += 1
    for i in range(0, len(buf), 4096):
        buf[i] = gen[0] & 0xff
signal.signal(signal.SIGUSR1, rewrite)
rewrite()
while True:
    signal.pause()
"""


def test_templates_over_the_budget_are_evicted_lru(tmp_path: Path) -> None:
    from conftest import DaemonProc, leaks  # noqa: PLC0415 (the test's own daemon)

    d = DaemonProc(tmp_path / "state", str(tmp_path / "sock"), None, tmp_path / "log")
    d.start("--template-memory-mb", "100", "--no-inspector")
    try:
        s = Sandbox.create(socket=d.socket)
        s.files.write("/workspace/hog.py", HOG)
        s.exec("nohup python3 /workspace/hog.py >/dev/null 2>&1 &")
        time.sleep(1.0)
        cps = []
        for _ in range(3):
            cps.append(s.checkpoint(mode="full"))
            s.exec("pkill -USR1 -f hog.py")
            time.sleep(0.5)  # the rewrite is done
        # Three templates of ~64 MiB each against 100 MiB: the two oldest go within seconds
        # (the daemon logs each eviction; rolling back to probe would make them recent).
        deadline = time.monotonic() + 30
        while d.log.read_text().count("template budget") < 2:
            assert time.monotonic() < deadline, "nothing was evicted"
            time.sleep(0.5)
        for old in cps[:2]:
            # Evicted: rebuilt from the checkpoint's process dump when it is complete,
            # else processes restart, saying why.
            res = s.rollback(old)
            assert ("from disk" in res.note and res.process_state == "restored") or \
                (res.process_state == "restarted" and "evicted" in res.note), res
        newest = s.rollback(cps[-1])
        assert newest.process_state == "restored", newest
        assert s.exec("pgrep -f hog.py").exit_code == 0
        s.kill()
    finally:
        d.stop()
    assert not leaks(tmp_path)


def test_over_budget_keeps_templates_whose_dump_is_pending_unless_it_must() -> None:
    from deltabox.cr.engine import ProcessState
    from deltabox.daemon.budget import over_budget

    def st(t: float) -> ProcessState:
        s = ProcessState([], {}, {}, {})
        s.last_used = t
        return s

    states = [("a", st(1), 40), ("b", st(2), 40), ("c", st(3), 40)]
    # Oldest first; "a" is being dumped: "b" goes instead.
    assert over_budget(states, 80, keep={"a"}) == ["b"]
    # Complete dumps first.
    assert over_budget(states, 80, prefer={"c"}) == ["c"]
    # When nothing else can make room, a pending one goes too (memory first).
    assert over_budget(states, 30, keep={"a", "b"}) == ["c", "a", "b"]


def test_resident_size_bounds_what_a_process_alone_holds() -> None:
    """The daemon skips the page walk while the templates' resident sizes sum within the
    budget: that sum must never be below what the walk would count, for a real process."""
    import subprocess
    import sys

    from deltabox.daemon.budget import process_private_bytes, resident_bytes

    p = subprocess.Popen([sys.executable, "-c",
                          "import sys; b = bytearray(32 << 20)\n"
                          "for i in range(0, len(b), 4096): b[i] = 1\n"
                          "print('ready', flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        private, resident = process_private_bytes(p.pid), resident_bytes(p.pid)
        assert private >= 32 << 20
        assert resident >= private
    finally:
        p.kill()
        p.wait()
    assert resident_bytes(p.pid) == 0  # gone: costs nothing
