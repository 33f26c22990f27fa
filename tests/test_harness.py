"""The test suite's own promise: however a run ends, it leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, leaks, sweep, wait_for

SLEEPER = """
import os, time
from pathlib import Path

def test_sleeps_with_a_sandbox(sbx):
    sbx.exec("sleep 1000 >/dev/null 2>&1 &")
    Path(os.environ["MARK"]).write_text(os.environ["DELTABOX_SOCKET"])
    time.sleep(1000)
"""


def test_a_run_ended_by_sigterm_stops_its_daemon_and_leaves_nothing(tmp_path: Path) -> None:
    """A CI runner's timeout ends pytest with SIGTERM: its daemon is stopped and its
    mounts, loop devices, cgroups and state dir go, as after Ctrl-C (before stop 72 they
    all stayed)."""
    (tmp_path / "test_sleeper.py").write_text(SLEEPER)
    mark = tmp_path / "socket"
    env = {**os.environ, "MARK": str(mark), "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    env.pop("DELTABOX_SOCKET", None)
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest",
                          "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path / "test_sleeper.py")],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    base = None
    try:
        wait_for(mark.exists, timeout=60, what="the inner run's sandbox")
        base = Path(mark.read_text()).parent
        assert base.is_dir() and leaks(base), "the inner run has a daemon and a sandbox"
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=120)[0].decode(errors="replace")
        assert p.returncode != 0, out
        assert leaks(base) == [], out
        assert not base.exists(), out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if base is not None and base.exists():   # the test failed: what the run left goes
            sweep(base)
            shutil.rmtree(base, ignore_errors=True)
