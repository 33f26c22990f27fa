"""deltaboxd holds descriptors for every sandbox: it raises its own soft RLIMIT_NOFILE to the
hard limit (a stock soft limit of 1024 would cap it at a few dozen sandboxes), while the
sandboxes' processes keep the soft limit it was started with."""

from __future__ import annotations

import resource

import pytest

from deltabox import Sandbox

from conftest import private_daemon


def _soft_nofile(pid: int) -> int:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")


def test_daemon_raises_its_fd_limit_sandboxes_keep_the_original() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 1024
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}: nothing to raise")
    with private_daemon("dbx-fdlimit-") as d:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # inherited by the daemon
        try:
            d.start("--no-inspector")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert d.proc is not None
        assert _soft_nofile(d.proc.pid) > low
        with Sandbox.create(socket=d.socket) as sbx:
            assert sbx.exec("ulimit -Sn").stdout.strip() == str(low)
            assert sbx.session("main").run("ulimit -Sn").stdout.strip() == str(low)
            # init (and what it starts) too
            assert sbx.exec("grep 'Max open files' /proc/1/limits").stdout.split()[3] == \
                str(low)
