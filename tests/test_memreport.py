"""deltaboxd's memory report (daemon/memreport.py): on SIGUSR1 one log line says what its
memory is made of, and it goes on serving. A real daemon (the shared one)."""

from __future__ import annotations

import json
import re
import signal
import time

from deltabox import Sandbox

from conftest import DaemonProc, private_daemon, wait_for


def _reports(d: DaemonProc) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"deltaboxd INFO memory: (\{.*\})$",
                                              d.log.read_text(), re.M)]


def test_sigusr1_logs_what_the_daemons_memory_is_made_of(daemon: DaemonProc) -> None:
    sbx = Sandbox.create(socket=daemon.socket)
    try:
        before = len(_reports(daemon))
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: len(_reports(daemon)) > before, what="the memory report")
        r = _reports(daemon)[-1]
        # The process's own figures, not constants: a daemon holds tens of MB and
        # tens of thousands of Python objects frozen (idlegc: at start, and again once
        # idle, when only a few hundred may be left to count apart).
        assert 20 < r["rss_mb"] < 4096, r
        assert r["gc_objects"] > 0 and r["gc_frozen"] > 10_000, r
        assert r["python_blocks"] > 0 and len(r["top_types"]) == 12, r
        assert r["malloc"]["in_use_mb"] > 1 and r["malloc"]["free_kept_mb"] >= 0, r
        m = r["malloc"]
        assert m["in_use_mb"] + m["free_kept_mb"] <= m["heap_mb"] + m["mmapped_mb"] + 0.2, r
        # Still serving, the sandbox untouched.
        assert sbx.exec("echo ok").stdout == "ok\n"
        assert daemon.proc.poll() is None
    finally:
        sbx.kill()


def test_a_removed_sandbox_is_freed_at_once(tmp_path) -> None:
    """A removed sandbox's objects (its Live, every checkpoint's process records) go when
    it does, not at the collector's next full pass: under load that pass is rare
    (idlegc), and a 32 x 1000 soak's daemon still held 7280 process fd records 10 s after
    every sandbox was gone (a session held a method of its Live: a cycle), and an 8 x 100
    one's still held the last sandbox the template budget's pass had looked at (the
    pass's locals, kept while its loop slept)."""
    with private_daemon("dbx-memreport-") as d:
        d.start("--no-inspector")
        for _ in range(2):
            sbx = Sandbox.create(socket=d.socket)
            sbx.session("main").run("X=1; sleep 600 &")
            for _ in range(3):
                sbx.checkpoint(mode="full")
                sbx.exec("true")        # calls, and idle moments between them: the
                time.sleep(0.2)         # young collections move these objects on
            time.sleep(2.5)   # the daemon's periodic passes (template budget, keepers)
            sbx.kill()        # go over every sandbox every 2 s
        time.sleep(1)
        assert d.proc is not None
        before = len(_reports(d))
        d.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: len(_reports(d)) > before, what="the memory report")
        ours = _reports(d)[-1]["deltabox_types"]
        assert "Live" not in ours and "ProcessState" not in ours, ours
